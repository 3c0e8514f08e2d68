"""Preflight over facts fixtures: each check's ok, and one fixture per failure kind."""

from __future__ import annotations

import json
import shutil

import pytest
from flashnext.assess import assess
from flashnext.checks import worst
from flashnext.plan.planner import PlanOptions
from lead_fixtures import VARIANTS, base_facts

TABLE = "/nvme/flashnext/ple-table.bin"
# What the reference host itself warns about: its pool holds 2 requests of 262,144
# tokens at once as vLLM counts blocks, fewer than --max-num-seqs 4
# (checks/patches/test_kv_request_capacity.py holds the count to vLLM's).
REFERENCE_WARNINGS = {"kv.capacity"}


def run(facts, model_dir, model=None, **options):
    opts = PlanOptions(model_dir=str(model_dir) if model_dir else None, table_path=TABLE, **options)
    return assess(facts, opts, None, model=model)


def by_id(assessment):
    return {f.id: f for f in assessment.findings}


def test_the_reference_host_passes(full_skeleton, full_model):
    a = run(base_facts(), full_skeleton, full_model)
    bad = [f for f in a.findings if f.level != "ok"]
    assert [(f.id, f.level) for f in bad] == [("kv.capacity", "warn")]
    kv = bad[0]
    assert (kv.measured, kv.required) == ("2 full-length requests", ">= 4 (--max-num-seqs)")
    assert "takes 42 blocks of 12144 tokens (22 of K/V, 20 of GDN" in kv.message
    assert kv.fix == "accept it, or --max-model-len 72864 for 4 at once"
    ids = set(by_id(a))
    for expected in (
        "gpu.count",
        "gpu0.vram",
        "gpu2.pcie",
        "host.ram",
        "host.memlock",
        "host.cgroup",
        "host.shm",
        "pp.ple_rank",
        "kv.capacity",
        "rank1.vram",
        "model.dir",
        "model.arch",
        "model.quant_groups",
        "model.sampling",
        "table.size",
        "table.medium",
        "port",
    ):
        assert expected in ids, expected


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_failure_kind_is_reported_with_a_fix(name, full_skeleton, full_model):
    change, check_id, level, consequences = VARIANTS[name]
    a = run(change(base_facts()), full_skeleton, full_model)
    finding = by_id(a)[check_id]
    assert finding.level == level, finding
    assert finding.fix, "a non-ok finding must say how to fix it"
    assert finding.measured and finding.required
    others = {f.id for f in a.findings if f.level != "ok" and f.id != check_id}
    # Only the changed fact fires, and what it causes (a small card also
    # leaves its rank no VRAM), nothing else beyond the reference host's own.
    assert others - REFERENCE_WARNINGS == set(consequences) - REFERENCE_WARNINGS, others
    assert worst(a.findings) == level


def test_memlock_message_names_the_pinned_bytes(full_skeleton, full_model):
    change = VARIANTS["memlock_64k"][0]
    a = run(change(base_facts()), full_skeleton, full_model)
    f = by_id(a)["host.memlock"]
    assert f.measured == "64 KiB"
    pinned = a.plan.pinned_bytes_needed
    assert pinned == a.plan.qsa.total_exact_bytes > 0
    assert f"pools need {pinned / 2**30:.2f} GiB" in f.message
    assert "--ulimit memlock=-1:-1" in f.fix and "ulimit -l unlimited" in f.fix


def test_shipped_checkpoint_defects_fail_with_the_fix_command(shipped_skeleton):
    a = run(base_facts(), shipped_skeleton)
    found = by_id(a)
    groups, sampling = found["model.quant_groups"], found["model.sampling"]
    assert groups.level == "fail" and "'Linear'" in groups.measured
    assert groups.fix == f"flashnext checkpoint fix --model {shipped_skeleton}"
    assert sampling.level == "fail" and "temperature 1" in sampling.message
    assert sampling.fix.startswith(f"flashnext checkpoint fix --model {shipped_skeleton}")


def test_generation_config_flag_satisfies_the_sampling_check(shipped_skeleton, tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.7, "top_p": 0.8}')
    a = run(base_facts(), shipped_skeleton, generation_config_dir=str(tmp_path))
    assert by_id(a)["model.sampling"].level == "ok"
    assert "--generation-config" in a.command.argv


def test_partition_that_moves_ple_off_rank_0_fails(full_skeleton, full_model):
    a = run(base_facts(), full_skeleton, full_model, pp_layer_partition="1,23,24")
    f = by_id(a)["pp.ple_rank"]
    assert f.level == "fail" and "VLLM_PP_LAYER_PARTITION" in f.fix
    assert "rank(s) [1]" in f.measured


def test_too_much_kv_overflows_a_rank(full_skeleton, full_model):
    a = run(base_facts(), full_skeleton, full_model, kv_cache_memory_bytes=4 << 30)
    assert {f.id for f in a.findings if f.level == "fail"} >= {"rank0.vram", "rank2.vram"}


def test_too_little_kv_for_one_request(full_skeleton, full_model):
    a = run(base_facts(), full_skeleton, full_model, kv_cache_memory_bytes=20_000_000)
    f = by_id(a)["kv.capacity"]
    assert f.level == "fail" and "--max-model-len" in f.message


# ---------------------------------------------------------------- bad model dirs


def test_missing_model_dir(tmp_path):
    a = run(base_facts(), tmp_path / "absent")
    f = by_id(a)["model.dir"]
    assert f.level == "fail" and f.measured == "no such directory" and "absent" in f.message
    assert "plan" not in by_id(a)  # model.dir already says why


def test_partial_model_dir_names_the_missing_shard(tmp_path, shipped_skeleton):
    partial = tmp_path / "partial"
    shutil.copytree(shipped_skeleton, partial)
    index = json.loads((partial / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (partial / victim).unlink()
    f = by_id(run(base_facts(), partial))["model.dir"]
    assert f.level == "fail" and victim in f.message


def test_corrupt_header_is_named(tmp_path, shipped_skeleton):
    broken = tmp_path / "broken"
    shutil.copytree(shipped_skeleton, broken)
    shard = sorted(broken.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:16] = b"\x00garbage"
    shard.write_bytes(bytes(data))
    f = by_id(run(base_facts(), broken))["model.dir"]
    assert f.level == "fail" and shard.name in f.message


def test_wrong_architecture(tmp_path, shipped_skeleton):
    other = tmp_path / "other"
    shutil.copytree(shipped_skeleton, other)
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "llama"
    config["text_config"]["model_type"] = "llama"
    (other / "config.json").write_text(json.dumps(config))
    f = by_id(run(base_facts(), other))["model.arch"]
    assert f.level == "fail" and "llama" in f.measured


# ---------------------------------------------------------------- issue 13, finding 11


def test_without_a_model_host_memory_is_still_judged(full_model):
    # No --model: memlock and RAM are sized from the checkpoint the profile serves
    # (its skeleton inventory), so a 64 KiB memlock fails before any download.
    change = VARIANTS["memlock_64k"][0]
    a = run(change(base_facts()), None)
    found = by_id(a)
    memlock = found["host.memlock"]
    assert (memlock.level, memlock.measured, memlock.required) == (
        "fail", "64 KiB", ">= 29.19 GiB or unlimited"
    )  # fmt: skip
    assert memlock.message == (
        "RLIMIT_MEMLOCK is 64 KiB; the pinned QSA K/V pools need 29.19 GiB (sized for the "
        "checkpoint profile 3x3090 serves, as no checkpoint was planned)"
    )
    # the same figures as the plan for the real inventory read from disk
    with_model = run(base_facts(), None, model=full_model)
    assert found["host.ram"].required == by_id(with_model)["host.ram"].required
    assert found["host.ram"].level == found["host.cgroup"].level == "ok"
    assert {f.id for f in a.findings if f.level == "fail"} == {"host.memlock", "model.dir"}


def test_a_missing_model_dir_says_check_the_path_and_how_to_download(tmp_path):
    missing = tmp_path / "Qwen3.8-Flash-Next"
    f = by_id(run(base_facts(), missing))["model.dir"]
    assert (f.level, f.measured, f.message) == (
        "fail", "no such directory", f"{missing}: no such directory"
    )  # fmt: skip
    assert f.fix == (
        "check the path: --model is the checkpoint directory (config.json, *.safetensors); to "
        "download it there: `hf download Minachist/Qwen3.8-Flash-Next-INT4-Mixed-AutoRound "
        f"--local-dir {missing}`"
    )
    # a directory that exists but lacks files is still a re-download
    missing.mkdir()
    assert "`hf download` resumes" in by_id(run(base_facts(), missing))["model.dir"].fix


def test_a_profile_without_an_inventory_shows_host_memory_as_unsized(tmp_path):
    from flashnext.assess import assess

    a = assess(base_facts(), PlanOptions(table_path=TABLE), "h200-tiny")
    ram = by_id(a)["host.ram"]
    assert (ram.level, ram.required) == ("warn", "sized by the plan")
    assert (
        ram.fix == "pass --model the checkpoint directory: the plan sizes what the host must hold"
    )
    assert by_id(a)["host.shm"].level == "ok"


@pytest.mark.parametrize(
    ("host", "api_key_set", "expected"),
    [
        ("127.0.0.1", False, None),  # loopback: only this machine reaches it
        ("::1", False, None),
        ("localhost", False, None),
        ("0.0.0.0", False, "warn"),  # every interface, no key
        ("192.0.2.7", False, "warn"),
        ("serving-host", False, "warn"),  # a name may resolve beyond loopback
        ("0.0.0.0", True, "ok"),
        ("0.0.0.0", None, None),  # `plan`: the key was not asked
    ],
)
def test_an_api_bound_beyond_loopback_without_a_key_is_a_warning(
    host, api_key_set, expected, full_skeleton, full_model
):
    opts = PlanOptions(model_dir=str(full_skeleton), table_path=TABLE, host=host)
    found = by_id(assess(base_facts(), opts, None, model=full_model, api_key_set=api_key_set))
    exposure = found.get("api.exposure")
    assert (exposure.level if exposure else None) == expected
    if expected == "warn":
        assert exposure.message.startswith(f"--host {host} exposes the API beyond this machine")
        assert "--api-key-file FILE" in exposure.fix and "--host 127.0.0.1" in exposure.fix


def test_a_missing_table_in_a_container_is_prepared_through_the_image(full_skeleton, full_model):
    """Issue 43: inside the image the fix named `--out` on the container's read-only
    table mount. There it says to run the image with the host directory read-write."""
    import dataclasses

    from flashnext import __version__

    def missing(in_container: bool):
        facts = base_facts()
        storage = dict(facts.storage)
        storage["table"] = dataclasses.replace(storage["table"], exists=False)
        facts = dataclasses.replace(facts, storage=storage, in_container=in_container)
        return by_id(run(facts, full_skeleton, full_model))["table.path"]

    host = missing(False)
    assert host.fix == f"flashnext table prepare --model {full_skeleton} --out {TABLE}"
    inside = missing(True)
    assert inside.level == "fail" and inside.measured == "missing"
    assert (
        f"podman run --rm --entrypoint flashnext -v MODEL_DIR:{full_skeleton}:ro "
        f"-v TABLE_DIR:/nvme/flashnext localhost/flashnext:{__version__} table prepare "
        f"--model {full_skeleton} --out {TABLE}" in inside.fix
    )
    assert "\n" not in inside.fix
