"""Issue 39, classes 4 and 5: structure is validated before it is used, and nothing
vouches for what it did not check.

Each mutation of the tiny skeleton (real headers) once raised a traceback
(AttributeError, re.error, OverflowError) or passed `checkpoint check` and
preflight as "ok". CLI calls run with catch_exceptions=False: an exception
escaping a command fails the test itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.skeleton import write_skeleton

FACTS = Path(__file__).resolve().parents[1] / "fixtures" / "facts" / "3x3090-nvme.json"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def fixed_tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("structure") / "fixed"
    write_skeleton(path, "tiny", fixed_metadata=True)
    return path


@pytest.fixture
def model(fixed_tiny: Path, tmp_path: Path) -> Path:
    shutil.copytree(fixed_tiny, tmp_path / "m")
    return tmp_path / "m"


def edit(model: Path, name: str, change) -> None:
    path = model / name
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def check_findings(model: Path) -> tuple[int, dict[str, dict]]:
    result = invoke("checkpoint", "check", "--model", model, "--json")
    return result.exit_code, {f["id"]: f for f in json.loads(result.stdout)["findings"]}


def preflight(model: Path, *extra) -> dict[str, dict]:
    result = invoke("preflight", "--json", "--facts", FACTS, "--model", model,
                    "--table", "/nvme/flashnext/ple-table.bin", *extra)  # fmt: skip
    assert result.exit_code == 1
    return {f["id"]: f for f in json.loads(result.stdout)["findings"]}


def quant(config: dict) -> dict:
    return config["quantization_config"]


def group0(config: dict) -> dict:
    return quant(config)["config_groups"]["group_0"]


STRUCTURE = {
    "groups as a list": (
        lambda c: quant(c).update(config_groups=list(quant(c)["config_groups"].values())),
        "quantization_config.config_groups is a list, not an object",
    ),
    "a target regex that does not compile": (
        lambda c: group0(c).update(targets=["re:(("]),
        "targets holds 're:((', whose pattern does not compile",
    ),
    "a non-string target": (
        lambda c: group0(c).update(targets=[5]),
        "targets holds 5, not a module name or re: pattern",
    ),
    "ignore: [null]": (
        lambda c: quant(c).update(ignore=[None]),
        "quantization_config.ignore holds None",
    ),
    "targets as a plain string": (
        lambda c: group0(c).update(targets="re:.*mlp.*"),
        "targets is str 're:.*mlp.*', not a list of names",
    ),
}


@pytest.mark.parametrize("case", STRUCTURE)
def test_quantization_config_structure(model, case):
    change, expected = STRUCTURE[case]
    edit(model, "config.json", change)
    result = invoke("checkpoint", "check", "--model", model)
    assert result.exit_code == 1 and expected in result.output, result.output
    assert expected in preflight(model)["model.dir"]["message"]


@pytest.mark.parametrize(
    ("length", "factor", "expected"),
    [
        (0.5, None, "max_position_embeddings is 0.5, not a whole number of tokens"),
        (1e300, 1e300, "= inf tokens, not a context any model has"),
        (4096, 1e300, "x RoPE factor 1e+300 = 4.096e+303 tokens, not a context any model has"),
    ],
)
def test_context_length_that_is_no_token_count(model, length, factor, expected):
    def change(c):
        c["text_config"]["max_position_embeddings"] = length
        if factor is not None:
            c["text_config"]["rope_parameters"] = {"rope_type": "linear", "factor": factor}

    edit(model, "config.json", change)
    found = preflight(model)
    assert found["plan"]["level"] == "fail" and expected in found["plan"]["message"]


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda c: c.pop("quantization_config"), "config.json has no quantization_config"),
        (lambda c: quant(c).update(quant_method="gptq"), "config.json has quant_method 'gptq'"),
    ],
)
def test_packed_tensors_without_their_quant_method_fail(model, change, said):
    edit(model, "config.json", change)
    code, found = check_findings(model)
    assert code == 1
    assert found["quantization"]["status"] == "fail"
    assert said in found["quantization"]["message"]
    assert "vLLM would load them as the wrong format" in found["quantization"]["message"]
    quant_groups = preflight(model)["model.quant_groups"]
    assert quant_groups["level"] == "fail" and said in quant_groups["message"]


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("temperature", "hot", 'temperature must be a number, got "hot"'),
        ("top_p", 7, "top_p must be in (0, 1], got 7"),
        ("top_k", -50, "top_k must be -1 or 0 (off) or at least 1, got -50"),
    ],
)
def test_sampling_defaults_vllm_refuses_are_not_ok(model, key, value, why):
    edit(model, "generation_config.json", lambda g: g.update({key: value}))
    code, found = check_findings(model)
    assert code == 1 and found["generation-config"]["status"] == "fail"
    assert why in found["generation-config"]["message"]
    sampling = preflight(model)["model.sampling"]
    assert sampling["level"] == "fail" and why in sampling["message"]


def test_a_generation_config_dir_with_a_refused_value(model, tmp_path):
    given = tmp_path / "gen"
    given.mkdir()
    (given / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": -1}))
    sampling = preflight(model, "--generation-config", given)["model.sampling"]
    assert sampling["level"] == "fail"
    assert sampling["message"].startswith(f"--generation-config {given}: top_p must be in (0, 1]")


def _rename_shards_and_drop(model: Path, drop) -> None:
    """Shards renamed off the -NNNNN-of-NNNNN pattern, then the entries `drop` picks
    removed from the index together with every shard file that held only those."""
    import os

    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    renamed = {f: f"part-{chr(97 + i)}.safetensors" for i, f in enumerate(files)}
    for old, new in renamed.items():
        os.rename(model / old, model / new)
    weight_map = {k: renamed[v] for k, v in index["weight_map"].items()}
    kept = {k: v for k, v in weight_map.items() if not drop(k, v, weight_map)}
    for file in set(weight_map.values()) - set(kept.values()):
        (model / file).unlink()
    index["weight_map"] = kept
    index_path.write_text(json.dumps(index))


def test_a_shard_deleted_with_its_index_entries_is_found_by_what_the_config_implies(model):
    """Issue 39 class 5: unnumbered shards cannot be counted; the config's layers can."""
    victim = "model.language_model.layers.2.mlp.experts.3.down_proj.weight_packed"
    _rename_shards_and_drop(model, lambda k, v, m: v == m[victim])
    result = invoke("checkpoint", "check", "--model", model)
    assert result.exit_code == 1
    assert "names no tensor of decoder layer(s) 2-3 of 4, which config.json implies" in (
        result.output
    )
    assert "names no tensor of decoder layer" in preflight(model)["model.dir"]["message"]


def test_an_expert_dropped_from_the_index_is_named(model):
    dropped = "model.language_model.layers.1.mlp.experts.5."
    _rename_shards_and_drop(model, lambda k, v, m: k.startswith(dropped))
    result = invoke("checkpoint", "check", "--model", model)
    assert result.exit_code == 1
    assert "layer 1's routed expert(s) 5 of 8" in result.output


@pytest.mark.parametrize("dtype", [["BF16"], {"BF16": 1}])
def test_a_safetensors_dtype_that_is_no_name(model, dtype):
    import struct

    shard = sorted(model.glob("*.safetensors"))[0]
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    key = next(k for k in header if k != "__metadata__")
    header[key]["dtype"] = dtype
    packed = json.dumps(header, separators=(",", ":")).encode()
    assert len(packed) <= length  # same frame: padded with spaces, as writers do
    shard.write_bytes(raw[:8] + packed.ljust(length) + raw[8 + length :])
    result = invoke("checkpoint", "check", "--model", model)
    assert result.exit_code == 1
    assert f"tensor {key!r} has unknown dtype {dtype!r}" in result.output


def test_a_model_path_that_is_a_symlink_loop_is_named_so(tmp_path):
    loop = tmp_path / "model"
    loop.symlink_to(loop.name)
    result = invoke("checkpoint", "check", "--model", loop)
    assert result.exit_code == 1
    assert f"{loop}: a symlink loop (it never reaches a file)" in result.output
    assert "no such directory" not in result.output
