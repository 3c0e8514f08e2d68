"""Issue 25, class 5: every config.json value the launcher reads has a type, bounds and
agreement with the tensors, checked before any work sized by it; the message names
the field and the fix. Values that would size memory run in a child process under an
address-space limit, so a regression fails the test instead of the CI machine."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.skeleton import write_skeleton
from lead_fixtures import BASE_FILE

TABLE = "/nvme/flashnext/ple-table.bin"
LIMIT_BYTES = 2 << 30  # the launcher plans the full skeleton in well under this
RESTORE = "restore config.json from the published checkpoint"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def limited(*args, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`python -m flashnext ARGS` with its address space capped at LIMIT_BYTES."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))

    return subprocess.run([sys.executable, "-m", "flashnext", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout_s,
                          preexec_fn=cap, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def fixed_tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "fixed"
    write_skeleton(path, "tiny", fixed_metadata=True)  # 4 decoder layers
    return path


def damaged(fixed_tiny: Path, tmp_path: Path, top=None, **text) -> Path:
    model = tmp_path / "m"
    shutil.copytree(fixed_tiny, model)
    config = json.loads((model / "config.json").read_text())
    config["text_config"].update(text)
    config.update(top or {})
    (model / "config.json").write_text(json.dumps(config))  # NaN is written as NaN
    return model


# ---------------------------------------------------------------- sized by the value


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ({"num_hidden_layers": 1_000_000_000},
         "num_hidden_layers is 1000000000, more than 1024: no Qwen4Exp model has that many"),
        ({"num_hidden_layers": 100_000},
         "num_hidden_layers is 100000, more than 1024: no Qwen4Exp model has that many"),
        ({"split_ngram_parts": 1_000_000_000},
         "split_ngram_parts is 1000000000, more than 8192: no Qwen4Exp model has that many"),
        ({"full_attention_interval": 10**12},
         "full_attention_interval is 1000000000000, more than 1024: no Qwen4Exp model has "
         "that many"),
    ],
    ids=["layers 1e9", "layers 1e5", "table shards 1e9", "interval 1e12"],
)  # fmt: skip
def test_a_huge_value_is_refused_before_anything_is_sized_by_it(text, words, fixed_tiny,
                                                                 tmp_path):  # fmt: skip
    model = damaged(fixed_tiny, tmp_path, **text)
    want = f"{model / 'config.json'}: {words}; {RESTORE}"
    common = ("--facts", BASE_FILE, "--model", model, "--table", TABLE)
    plan = limited("plan", *common)
    assert (plan.returncode, plan.stderr) == (1, f"Error: no plan: {want}\n")
    pre = limited("preflight", *common, "--json")
    assert pre.returncode == 1, pre.stderr
    found = {f["id"]: f for f in json.loads(pre.stdout)["findings"]}
    assert found["plan"]["message"] == f"cannot plan: {want}"
    dry = limited("serve", "--dry-run", "--replay-facts-for-testing", *common[1:], "--json")
    assert dry.returncode == 1 and "Traceback" not in dry.stderr, dry.stderr


def test_a_huge_table_shape_is_a_table_finding_not_a_hang(fixed_tiny, tmp_path):
    model = damaged(fixed_tiny, tmp_path, heads_per_ngram=1_000_000_000)
    result = limited("preflight", "--facts", BASE_FILE, "--model", model, "--table", TABLE,
                     "--json", timeout_s=60)  # fmt: skip
    assert result.returncode == 1, result.stderr
    found = {f["id"]: f for f in json.loads(result.stdout)["findings"]}
    assert found["table.size"]["message"] == (
        f"cannot tell the PLE table's shape: {model / 'config.json'}: heads_per_ngram is "
        "1000000000, more than 64: no Qwen4Exp model has that many"
    )


# ---------------------------------------------------------------- agreement and types


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ({"num_hidden_layers": 5}, "num_hidden_layers is 5, but the checkpoint's tensors hold "
         "4 decoder layers (layers.0 to layers.3): set num_hidden_layers to 4"),
        ({"num_hidden_layers": 3}, "num_hidden_layers is 3, but the checkpoint's tensors hold "
         "4 decoder layers (layers.0 to layers.3): set num_hidden_layers to 4"),
        ({"num_hidden_layers": 4.0}, "num_hidden_layers is 4.0, not an integer >= 1"),
        ({"num_hidden_layers": "4"}, "num_hidden_layers is '4', not an integer >= 1"),
        ({"num_hidden_layers": True}, "num_hidden_layers is True, not an integer >= 1"),
        ({"hidden_size": float("nan")}, "hidden_size is nan, not an integer >= 1"),
        ({"head_dim": 64.5}, "head_dim is 64.5, not an integer >= 1"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok is 9, more than num_experts 8"),
        ({"layer_types": "linear_attention"},
         "layer_types is 'linear_attention', not a list of strings"),
        ({"layer_types": ["linear_attention"] * 3},
         "layer_types names 3 layers, num_hidden_layers is 4"),
    ],
    ids=["layers 5", "layers 3", "layers 4.0", "layers '4'", "layers true", "hidden NaN",
         "head_dim 64.5", "top-k > experts", "layer_types str", "layer_types short"],
)  # fmt: skip
def test_a_value_is_checked_against_its_type_and_the_tensors(text, words, fixed_tiny, tmp_path):
    model = damaged(fixed_tiny, tmp_path, **text)
    common = ("--facts", BASE_FILE, "--model", model, "--table", TABLE)
    want = f"{model / 'config.json'}: {words}; {RESTORE}"
    plan = invoke("plan", *common)
    assert (plan.exit_code, plan.output) == (1, f"Error: no plan: {want}\n")
    pre = invoke("preflight", *common, "--json")
    found = {f["id"]: f for f in json.loads(pre.stdout)["findings"]}
    assert found["plan"]["message"] == f"cannot plan: {want}"
    # no other check blames VRAM for what config.json got wrong
    assert not [i for i, f in found.items() if i.endswith(".vram") and f["level"] == "fail"]


@pytest.mark.parametrize(
    ("top", "words"),
    [
        ({"text_config": [1, 2]}, "text_config is a JSON list, not an object"),
        ({"text_config": "qwen"}, "text_config is a JSON str, not an object"),
        ({"architectures": "Qwen4ExpForConditionalGeneration"},
         "architectures is a JSON str, not a list of class names"),
        ({"architectures": [7]}, "architectures is [7], not a list of class names"),
        ({"model_type": 4}, "model_type is a JSON int, not a string"),
    ],
)  # fmt: skip
def test_a_section_of_the_wrong_type_is_named(top, words, fixed_tiny, tmp_path):
    model = damaged(fixed_tiny, tmp_path, top=top)
    want = f"{model / 'config.json'}: {words}; {RESTORE}"
    plan = invoke("plan", "--facts", BASE_FILE, "--model", model, "--table", TABLE)
    assert (plan.exit_code, plan.output) == (1, f"Error: no plan: no model facts ({want})\n")
    pre = invoke("preflight", "--facts", BASE_FILE, "--model", model, "--table", TABLE, "--json")
    assert pre.exit_code == 1
    check = invoke("checkpoint", "check", "--model", model)
    assert check.exit_code == 1 and check.output.startswith(f"Error: {want}"), check.output


def test_host_checks_blame_the_failed_plan_not_a_missing_model(fixed_tiny, tmp_path):
    """Issue 25, class 11: with --model readable and the plan failed for another reason,
    the unsized host checks do not ask for --model."""
    model = damaged(fixed_tiny, tmp_path, num_hidden_layers=5)
    # a partition for 5 layers: the reference plan (the profile's 48) cannot size either
    pre = invoke("preflight", "--facts", BASE_FILE, "--model", model, "--table", TABLE,
                 "--pp-layer-partition", "1,2,2", "--json")  # fmt: skip
    found = {f["id"]: f for f in json.loads(pre.stdout)["findings"]}
    assert found["plan"]["level"] == "fail"
    ram = found["host.ram"]
    assert ram["message"].startswith("the plan failed (see the plan check), so it cannot size")
    assert ram["fix"] == "fix what the plan check names, then re-run"
