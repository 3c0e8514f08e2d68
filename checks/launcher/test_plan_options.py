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
