"""Issue 25, class 2: --max-model-len is bounded by the context vLLM derives from
config.json (RoPE scaling included): a longer one is refused before vLLM loads
anything, the profile's default is cut to it, and no fix line names a longer one."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.skeleton import write_skeleton
from lead_fixtures import BASE_FILE

TABLE = "/nvme/flashnext/ple-table.bin"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def fixed_tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ctx") / "fixed"
    write_skeleton(path, "tiny", fixed_metadata=True)
    return path


def model_with(fixed_tiny: Path, tmp_path: Path, **text) -> Path:
    model = tmp_path / "m"
    shutil.copytree(fixed_tiny, model)
    config = json.loads((model / "config.json").read_text())
    config["text_config"].update(text)
    (model / "config.json").write_text(json.dumps(config))
    return model


CASES = {
    # (text_config changes, the context vLLM derives, how it is described)
    "default rope": ({"max_position_embeddings": 262144}, 262144,
                     "max_position_embeddings 262144 = 262144 tokens"),
    "linear x2": ({"max_position_embeddings": 65536,
                   "rope_parameters": {"rope_type": "linear", "factor": 2.0}}, 131072,
                  "max_position_embeddings 65536 x RoPE factor 2 = 131072 tokens"),
    "yarn (already scaled)": ({"max_position_embeddings": 100000,
                               "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
                              100000, "max_position_embeddings 100000 = 100000 tokens"),
    "legacy rope_scaling": ({"max_position_embeddings": 50000, "rope_parameters": None,
                             "rope_scaling": {"type": "dynamic", "factor": 3}}, 150000,
                            "max_position_embeddings 50000 x RoPE factor 3 = 150000 tokens"),
    "smaller key wins": ({"max_position_embeddings": 262144, "seq_length": 70000}, 70000,
                         "seq_length 70000 = 70000 tokens"),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("over", [1, 10_000_000])
def test_a_length_beyond_the_models_context_is_refused(case, over, fixed_tiny, tmp_path):
    text, context, described = CASES[case]
    model = model_with(fixed_tiny, tmp_path, **text)
    asked = context + over
    common = ("--facts", BASE_FILE, "--model", model, "--table", TABLE,
              "--max-model-len", asked)  # fmt: skip
    want = (
        f"--max-model-len {asked} is longer than the model's context ({model / 'config.json'}: "
        f"{described}), which vLLM refuses at start: pass --max-model-len {context} or less"
    )
    plan = invoke("plan", *common)
    assert plan.exit_code == 1
    assert plan.output == f"Error: no plan: {want}\n"
    pre = invoke("preflight", *common)
    assert pre.exit_code == 1
    # No fix line may name a length the model cannot take.
    fixes = "\n".join(ln for ln in pre.stdout.splitlines() if ln.startswith("fix "))
    named = [int(n) for n in re.findall(r"--max-model-len (\d+)", fixes)]
    assert all(n <= context for n in named), fixes
    assert invoke("plan", *common[:-1], context).exit_code == 0


def test_the_profiles_length_is_cut_to_a_shorter_context(fixed_tiny, tmp_path):
    model = model_with(fixed_tiny, tmp_path, max_position_embeddings=100000)
    result = invoke("plan", "--facts", BASE_FILE, "--model", model, "--table", TABLE, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["max_model_len"] == {
        "value": 100000,
        "source": "derived",
        "reason": "the model's context (max_position_embeddings 100000 = 100000 tokens), "
        "shorter than profile 3x3090's 262144",
    }
    argv = doc["argv"]
    assert argv[argv.index("--max-model-len") + 1] == "100000"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ({"max_position_embeddings": "262144"},
         "max_position_embeddings is '262144', not a number"),
        ({"max_position_embeddings": -1}, "max_position_embeddings is -1, not a positive number"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 0}},
         "rope factor is 0, not a positive number"),
        ({"rope_parameters": [1]}, "rope_parameters is [1], not an object"),
    ],
)  # fmt: skip
def test_a_context_that_cannot_be_derived_is_named(text, words, fixed_tiny, tmp_path):
    model = model_with(fixed_tiny, tmp_path, **text)
    result = invoke("plan", "--facts", BASE_FILE, "--model", model, "--table", TABLE)
    assert result.exit_code == 1
    assert result.output == (
        f"Error: no plan: {model / 'config.json'}: {words}; restore config.json from the "
        "published checkpoint\n"
    )
