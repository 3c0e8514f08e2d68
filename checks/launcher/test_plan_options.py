"""PlanOptions validates its bounds wherever it is built, not only behind Click."""

from __future__ import annotations

import dataclasses

import pytest
from flashnext.plan.options import PlanOptions
from pydantic import ValidationError


@pytest.mark.parametrize(
    "bad",
    [
        {"port": 0},
        {"port": 65536},
        {"kv_cache_memory_bytes": 0},
        {"max_model_len": -1},
        {"served_model_name": ""},
        {"bogus": 1},
    ],
)
def test_out_of_bounds_options_are_refused(bad):
    with pytest.raises(ValidationError):
        PlanOptions(**bad)


def test_defaults_and_replace_still_work():
    opts = PlanOptions(model_dir="/m")
    assert (opts.host, opts.port, opts.kv_cache_memory_bytes) == ("127.0.0.1", 8000, None)
    assert dataclasses.replace(opts, port=8001).port == 8001
    with pytest.raises(ValidationError):
        dataclasses.replace(opts, port=0)


def test_the_cli_turns_a_bound_into_a_usage_error_naming_the_flag(full_skeleton):
    from click.testing import CliRunner
    from flashnext.cli import main

    args = ["plan", "--model", str(full_skeleton), "--served-model-name", ""]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert "Invalid value for '--served-model-name'" in result.output
    assert "Traceback" not in result.output
