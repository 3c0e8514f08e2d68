"""Issue 25, class 3: model.sampling is satisfied only by a value that restores
something: a key set to vLLM's own fallback (top_k -1 or 0, temperature 1, top_p 1,
...) or one that shapes no distribution (max_new_tokens) leaves vLLM sampling at
temperature 1 and top_p 1, the state the check exists to catch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.skeleton import write_skeleton
from lead_fixtures import BASE_FILE

TABLE = "/nvme/flashnext/ple-table.bin"
NOTHING = {
    "top_k -1": ({"top_k": -1}, "top_k=-1"),
    "top_k 0": ({"top_k": 0}, "top_k=0"),
    "fallbacks": ({"temperature": 1.0, "top_p": 1, "min_p": 0.0}, "temperature=1.0, top_p=1, "
                  "min_p=0.0"),
    "length only": ({"max_new_tokens": 512, "skip_special_tokens": True},
                    "max_new_tokens=512, skip_special_tokens=true"),
}  # fmt: skip


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sampling") / "shipped"
    write_skeleton(path, "tiny")  # no sampling keys, as exported
    return path


def with_generation(shipped: Path, tmp_path: Path, doc: dict) -> Path:
    model = tmp_path / "m"
    shutil.copytree(shipped, model)
    (model / "generation_config.json").write_text(json.dumps(doc))
    return model


@pytest.mark.parametrize("case", NOTHING)
def test_keys_that_restore_nothing_fail_check_and_preflight(case, shipped, tmp_path):
    doc, shown = NOTHING[case]
    model = with_generation(shipped, tmp_path, doc)
    check = invoke("checkpoint", "check", "--model", model, "--json")
    assert check.exit_code == 1
    found = {f["id"]: f for f in json.loads(check.stdout)["findings"]}
    assert found["generation-config"]["status"] == "fail"
    assert found["generation-config"]["message"].startswith(
        f"generation_config.json sets only {shown}, which restore nothing; "
    )
    pre = invoke("preflight", "--facts", BASE_FILE, "--model", model, "--table", TABLE, "--json")
    f = {f["id"]: f for f in json.loads(pre.stdout)["findings"]}["model.sampling"]
    assert (f["level"], f["measured"]) == ("fail", f"only {shown}"), f
    assert f["message"] == (
        f"generation_config.json sets only {shown}, which restore nothing: vLLM falls back to "
        "temperature 1, top_p 1, top_k 0 over 248k tokens and output degrades"
    )


@pytest.mark.parametrize("case", NOTHING)
def test_a_generation_config_dir_that_restores_nothing_fails(case, shipped, tmp_path):
    doc, shown = NOTHING[case]
    given = tmp_path / "gen"
    given.mkdir()
    (given / "generation_config.json").write_text(json.dumps(doc))
    pre = invoke("preflight", "--facts", BASE_FILE, "--model", shipped, "--table", TABLE,
                 "--generation-config", given, "--json")  # fmt: skip
    f = {f["id"]: f for f in json.loads(pre.stdout)["findings"]}["model.sampling"]
    assert (f["level"], f["measured"]) == ("fail", f"only {shown}"), f


@pytest.mark.parametrize("pairs", [["top_k=-1"], ["top_k=0"], ["temperature=1", "top_p=1"]])
def test_fix_refuses_to_write_values_that_restore_nothing(pairs, shipped, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(shipped, model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    args = [a for pair in pairs for a in ("--sampling", pair)]
    result = invoke("checkpoint", "fix", "--model", model, *args)
    assert result.exit_code == 1
    assert result.output.startswith("Error: --sampling: generation_config.json would set only ")
    assert "which restore nothing" in result.output
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


def test_one_value_that_restores_something_passes(shipped, tmp_path):
    model = with_generation(shipped, tmp_path, {"top_k": -1, "temperature": 0.7})
    pre = invoke("preflight", "--facts", BASE_FILE, "--model", model, "--table", TABLE, "--json")
    f = {f["id"]: f for f in json.loads(pre.stdout)["findings"]}["model.sampling"]
    assert (f["level"], f["measured"]) == ("ok", "temperature"), f
