"""checkpoint check/fix on the tiny skeleton (real headers and bytes; no vLLM needed).

The proof that vLLM itself resolves the fixed metadata right is checks/checkpoint/.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
from flashnext.checkpoint.errors import CheckpointError
from flashnext.checkpoint.fix import apply_fix, plan_fix
from flashnext.checkpoint.sampling import parse_sampling, sampling_from_dir
from flashnext.checkpoint.targets import explicit_targets
from flashnext.checks.checkpoint_metadata import check
from flashnext.facts.model import read_model_facts
from flashnext.facts.scheme_map import SchemeMap, vllm_name
from flashnext.facts.stored_schemes import (
    Scheme,
    StoredModule,
    StoredSchemeError,
    derive_scheme,
    ple_table_modules,
    scheme_of_group,
    stored_modules,
)
from flashnext.skeleton import write_skeleton


@pytest.fixture(scope="module")
def shipped_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "shipped"
    write_skeleton(path, "tiny")
    return path


@pytest.fixture
def model_dir(shipped_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(shipped_dir, path)
    return path


def ids(report, status=None):
    return [f.id for f in report.findings if status is None or f.status == status]


# ---------------------------------------------------------------- stored schemes


def test_schemes_derived_from_packed_scale_and_weight_shape():
    assert derive_scheme((640, 320), (640, 20), 2560, True) == Scheme(4, 128)
    assert derive_scheme((640, 480), (640, 20), 2560, True) == Scheme(6, 128)
    assert derive_scheme((10240, 80), (10240, 5), 320, True) == Scheme(8, 64)
    # INT8 g64 and INT4 g128 have the same packed/scale ratio: in_features decides
    assert derive_scheme((10, 160), (10, 10), 640, True) == Scheme(8, 64)
    assert derive_scheme((10, 160), (10, 10), 1280, True) == Scheme(4, 128)


@pytest.mark.parametrize(
    ("packed", "scale", "in_features", "message"),
    [
        ((640, 320), (640, 20), None, "weight_shape is missing or zero"),
        ((640, 321), (640, 20), 2560, "packed width 321 fits no single bit width"),
        ((640, 320), (640, 21), 2560, "21 scale columns do not divide in_features 2560"),
        ((640, 320), (64, 20), 2560, "do not pair up"),
    ],
)
def test_inconsistent_tensors_are_refused(packed, scale, in_features, message):
    with pytest.raises(StoredSchemeError, match=message):
        derive_scheme(packed, scale, in_features, True)


def test_stored_modules_of_the_tiny_skeleton(shipped_dir):
    modules, problems = stored_modules(read_model_facts(shipped_dir))
    assert problems == []
    by_name = {m.name: m.scheme for m in modules}
    p = "model.language_model.layers.0"
    assert by_name[f"{p}.mlp.experts.0.gate_proj"] == Scheme(4, 128)
    assert by_name[f"{p}.linear_attn.in_proj_qkv"] == Scheme(6, 128)
    assert by_name[f"{p}.attn_hyper_connection.input_mix_weight_up"] == Scheme(8, 64)
    assert by_name["lm_head"] == Scheme(8, 128)
    assert by_name[f"{p}.linear_attn.in_proj_b"] is None  # plain BF16


def test_zeroed_weight_shape_is_reported_not_guessed(model_dir):
    model = read_model_facts(model_dir)
    name = "model.language_model.layers.0.mlp.experts.0.gate_proj.weight_shape"
    info = next(t for t in model.tensors if t.name == name)
    path, offset = model_dir / info.file, info.offset_bytes
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(struct.pack("<qq", 0, 0))
    report = check(model)
    assert (
        "stored-scheme",
        "fail",
        "model.language_model.layers.0.mlp.experts.0.gate_proj: weight_shape is missing or "
        "zero, so in_features is unknown",
    ) in [(f.id, f.status, f.message) for f in report.findings]
    with pytest.raises(CheckpointError, match="cannot derive the stored scheme of 1 module"):
        plan_fix(model)


# ---------------------------------------------------------------- check


def test_check_reports_both_shipped_defects(shipped_dir):
    report = check(read_model_facts(shipped_dir))
    assert report.failed
    assert ids(report, "fail")[:2] == ["duplicate-targets", "wrong-scheme"]
    messages = {f.id: f.message for f in report.findings}
    assert messages["duplicate-targets"] == (
        "target 'Linear' is listed by 4 groups (group_0, group_1, group_2, group_3); vLLM keys "
        "its scheme map by target, so only group_3 (INT8 g128) survives"
    )
    wrong = [f.message for f in report.findings if f.id == "wrong-scheme"]
    assert wrong[0].startswith("96 modules store INT4 g128 but vLLM would load them as INT8 g128")
    assert ids(report).count("unmatched-group") == 3
    assert "ple-not-ignored" in ids(report, "warn")
    assert "generation-config" in ids(report, "fail")
    fixes = {f.fix for f in report.findings if f.id == "duplicate-targets"}
    assert fixes == {f"flashnext checkpoint fix --model {shipped_dir}"}


def test_check_passes_the_fixed_skeleton(tmp_path):
    write_skeleton(tmp_path / "fixed", "tiny", fixed_metadata=True)
    report = check(read_model_facts(tmp_path / "fixed"))
    # the skeleton's metadata is what `fix` writes: nothing left for fix to repair
    assert ids(report, "fail") == []
    assert ids(report, "warn") == []


def edit_quant(model_dir, edit):
    path = model_dir / "config.json"
    doc = json.loads(path.read_text())
    edit(doc["quantization_config"])
    path.write_text(json.dumps(doc))
    return read_model_facts(model_dir)


def test_group_that_matches_nothing_and_module_matched_twice(model_dir):
    def edit(q):
        groups = q["config_groups"]
        groups["group_0"]["targets"] = [r"re:.*experts\.\d+\.(gate|up|down)_proj$"]
        groups["group_1"]["targets"] = [r"re:.*no_such_module$"]
        groups["group_2"]["targets"] = [r"re:.*input_mix_weight_up$", r"re:.*experts\.0\.up_proj$"]
        groups["group_3"]["targets"] = [r"re:.*(input_mix_weight_down|embed_tokens|lm_head)$"]

    report = check(edit_quant(model_dir, edit))
    by_id = {f.id: f for f in report.findings}
    assert by_id["unmatched-group"].message == (
        "config group group_1 (INT6 g128) resolves for no module"
    )
    assert by_id["multi-match"].message.startswith(
        "4 modules of kind model.language_model.layers.N.mlp.experts.N.up_proj are matched by "
        "targets of group_0, group_2"
    )
    assert "INT6 g128 but vLLM would load them as unquantized" in " ".join(
        f.message for f in report.findings if f.id == "wrong-scheme"
    )


def test_targets_that_only_match_checkpoint_names_are_caught(model_dir):
    # vLLM renames modules (model.language_model. -> language_model.model.) but not `re:` targets
    def edit(q):
        for g in q["config_groups"].values():
            g["targets"] = []
        q["config_groups"]["group_0"]["targets"] = [r"re:^model\.language_model\..*experts.*"]
        q["config_groups"]["group_1"]["targets"] = [
            r"re:.*(linear_attn|self_attn|shared_expert|ple)\.\w+$",
            r"re:.*indexer\.index_qk_proj$",
        ]  # noqa: E501
        q["config_groups"]["group_2"]["targets"] = [r"re:.*input_mix_weight_up$"]
        q["config_groups"]["group_3"]["targets"] = [
            r"re:.*(input_mix_weight_down|embed_tokens|lm_head)$"
        ]  # noqa: E501

    report = check(edit_quant(model_dir, edit))
    found = [f.message for f in report.findings if f.status == "fail"]
    assert len(found) == 4  # 3 expert projections + the generation config
    assert found[0] == (
        "32 modules of kind model.language_model.layers.N.mlp.experts.N.down_proj resolve "
        "correctly under checkpoint names but as unquantized under vLLM's names (e.g. "
        "language_model.model.layers.0.mlp.experts.0.down_proj); `re:` targets are not renamed "
        "by vLLM"
    )


# ---------------------------------------------------------------- fix


def test_fix_dry_run_shows_a_diff_and_writes_nothing(model_dir):
    before = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    plan = plan_fix(read_model_facts(model_dir))
    diff = plan.diff()
    assert diff.startswith("--- a/config.json\n+++ b/config.json\n")
    assert '-          "Linear"' in diff
    assert (
        r'+          "re:^(?:model\\.language_model|language_model\\.model)\\.layers\\.\\d+\\.mlp'
        r'\\.experts\\.\\d+\\.(?:down_proj|gate_proj|up_proj)$"'
    ) in diff
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == before


def test_fix_writes_backups_once_and_is_idempotent(model_dir):
    original = (model_dir / "config.json").read_text()
    plan = plan_fix(read_model_facts(model_dir))
    assert plan.remaining and "flashnext does not invent them" in plan.remaining[0]
    backups = apply_fix(plan)
    assert backups == [model_dir / "config.json.orig"]
    assert backups[0].read_text() == original
    fixed = read_model_facts(model_dir)
    report = check(fixed)
    assert [f.id for f in report.findings if f.status != "ok"] == ["generation-config"]
    assert report.findings[0].message.startswith("every one of ")
    # a second run changes nothing and keeps the first backup
    again = plan_fix(fixed)
    assert again.changes == {}
    (model_dir / "config.json").write_text((model_dir / "config.json").read_text())
    assert (model_dir / "config.json.orig").read_text() == original


def test_fixed_targets_resolve_every_module(model_dir):
    apply_fix(plan_fix(read_model_facts(model_dir)))
    model = read_model_facts(model_dir)
    smap = SchemeMap.from_config(model.quantization_config)
    schemes = {g: scheme_of_group(v)
               for g, v in model.quantization_config["config_groups"].items()}  # fmt: skip
    modules, _ = stored_modules(model)
    for m in modules:
        for runtime in (False, True):
            name = vllm_name(m.name) if runtime else m.name
            group = smap.resolve(name, runtime, by_class=m.scheme is not None)
            assert (schemes[group] if group else None) == m.scheme, name
    (ple,) = ple_table_modules(model)
    assert smap.ignored(vllm_name(ple), True)


def test_sampling_restored_only_from_a_named_source(model_dir, tmp_path):
    src = tmp_path / "published"
    src.mkdir()
    (src / "generation_config.json").write_text(
        json.dumps(
            {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "eos_token_id": 1}
        )  # fmt: skip
    )
    sampling = sampling_from_dir(src)
    assert sampling == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}
    plan = plan_fix(read_model_facts(model_dir), sampling)
    assert plan.remaining == []
    own = json.loads((model_dir / "generation_config.json").read_text())
    apply_fix(plan)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen == {**own, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}
    assert (model_dir / "generation_config.json.orig").exists()
    report = check(read_model_facts(model_dir))
    assert not report.failed


def test_sampling_source_without_keys_is_refused(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    with pytest.raises(CheckpointError, match="has none of repetition_penalty"):
        sampling_from_dir(tmp_path)
    with pytest.raises(CheckpointError, match="cannot read"):
        sampling_from_dir(tmp_path / "missing")


def test_sampling_pairs_are_validated():
    assert parse_sampling(["temperature=0.7", "top_k=20", "do_sample=true"]) == {
        "temperature": 0.7,
        "top_k": 20,
        "do_sample": True,
    }
    with pytest.raises(CheckpointError, match="expected KEY=VALUE, KEY one of"):
        parse_sampling(["temprature=0.7"])
    with pytest.raises(CheckpointError, match="'hot' is not a number or true/false"):
        parse_sampling(["temperature=hot"])


def test_fix_refuses_a_group_no_tensor_stores(model_dir):
    def edit(q):
        q["config_groups"]["group_9"] = json.loads(json.dumps(q["config_groups"]["group_0"]))
        q["config_groups"]["group_9"]["weights"]["num_bits"] = 2

    model = edit_quant(model_dir, edit)
    with pytest.raises(CheckpointError, match="config group group_9 .* describes no stored module"):
        plan_fix(model)


def test_failed_write_leaves_the_original(model_dir, monkeypatch):
    original = (model_dir / "config.json").read_text()
    plan = plan_fix(read_model_facts(model_dir))

    def boom(*_args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        apply_fix(plan)
    assert (model_dir / "config.json").read_text() == original
    assert not [p for p in model_dir.iterdir() if p.name.startswith(".")]  # no temp files left


def test_targets_pin_numbers_only_where_schemes_differ():
    P = "model.language_model.layers"
    mods = [
        StoredModule(f"{P}.{layer}.mlp.experts.{e}.{proj}",
                                Scheme(8, 128) if layer == 2 else Scheme(4, 128))
        for layer in range(4) for e in range(3) for proj in ("gate_proj", "up_proj")
    ] + [StoredModule(f"{P}.{layer}.mlp.gate", None) for layer in range(4)]  # fmt: skip
    got = explicit_targets(mods)
    alt = r"(?:model\.language_model|language_model\.model)"
    assert got == {
        Scheme(4, 128): [
            rf"re:^{alt}\.layers\.(?:0|1|3)\.mlp\.experts\.\d+\.(?:gate_proj|up_proj)$"
        ],
        Scheme(8, 128): [rf"re:^{alt}\.layers\.2\.mlp\.experts\.\d+\.(?:gate_proj|up_proj)$"],
    }
    groups = {"int4": {"targets": got[Scheme(4, 128)]}, "int8": {"targets": got[Scheme(8, 128)]}}
    smap = SchemeMap.from_config({"config_groups": groups})
    for m in mods:
        want = {Scheme(4, 128): "int4", Scheme(8, 128): "int8", None: None}[m.scheme]
        assert smap.resolve(m.name, runtime=False, by_class=False) == want
        assert smap.resolve(vllm_name(m.name), runtime=True, by_class=False) == want
    # layer 12 would be read as layer 1x by a careless pattern; ours says exactly 0, 1, 3
    assert smap.resolve(f"{P}.12.mlp.experts.0.up_proj", runtime=False) is None
