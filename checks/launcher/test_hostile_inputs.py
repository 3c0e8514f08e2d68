"""Preflight, plan, serve, report and `checkpoint fix` on malformed inputs and facts that
do not say enough: a clear verdict or error, never a traceback, never a false "ok".

CLI calls run with catch_exceptions=False: an exception escaping a command (a
traceback for the user) fails the test itself.
"""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.facts.schema import dumps
from flashnext.skeleton import write_skeleton
from lead_fixtures import BASE_FILE, base_facts

TABLE = "/nvme/flashnext/ple-table.bin"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def findings(result) -> dict[str, dict]:
    return {f["id"]: f for f in json.loads(result.stdout)["findings"]}


@pytest.fixture
def model(tiny_copy: Path) -> Path:
    """A private copy of the tiny skeleton (fixed metadata) to damage."""
    return tiny_copy


def edit_text_config(model: Path, **changes) -> Path:
    path = model / "config.json"
    config = json.loads(path.read_text())
    config["text_config"].update(changes)
    path.write_text(json.dumps(config, indent=2))
    return path


# ---------------------------------------------------------------- 4. --generation-config


@pytest.mark.parametrize("what", ["missing dir", "empty dir", "no sampling keys"])
def test_generation_config_dir_must_supply_sampling_keys(what, model, tmp_path):
    given = tmp_path / "gen"
    if what != "missing dir":
        given.mkdir()
    if what == "no sampling keys":
        (given / "generation_config.json").write_text('{"bos_token_id": 1}')
    result = invoke("preflight", "--facts", BASE_FILE, "--model", model, "--table", TABLE,
                    "--generation-config", given, "--json")  # fmt: skip
    assert result.exit_code == 1
    f = findings(result)["model.sampling"]
    assert f["level"] == "fail", f
    words = {
        "missing dir": f"{given}: not a directory",
        "empty dir": f"{given / 'generation_config.json'}: missing",
        "no sampling keys": f"{given / 'generation_config.json'} sets none of",
    }[what]
    assert words in f["message"], f
    assert "--generation-config" in f["fix"]


def test_generation_config_dir_with_keys_passes(model, tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.7, "top_p": 0.8}')
    result = invoke("preflight", "--facts", BASE_FILE, "--model", model, "--table", TABLE,
                    "--generation-config", tmp_path, "--json")  # fmt: skip
    f = findings(result)["model.sampling"]
    assert f["level"] == "ok" and f["measured"] == "temperature, top_p", f


# ---------------------------------------------------------------- 5. facts that say too little


@pytest.mark.parametrize(
    "doc",
    [
        {"schema_version": 1},
        {"schema_version": 1, "memory": {"mem_available_bytes": 128 << 30}},
    ],
    ids=["no memory section", "memory without limits"],
)
def test_missing_memory_facts_are_unknown_not_unlimited(doc, model, tmp_path):
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps(doc))
    result = invoke("preflight", "--facts", facts, "--model", model, "--table", TABLE, "--json")
    found = findings(result)
    memlock, cgroup = found["host.memlock"], found["host.cgroup"]
    assert (memlock["level"], memlock["measured"]) == ("warn", "unknown"), memlock
    assert (cgroup["level"], cgroup["measured"]) == ("warn", "unknown"), cgroup
    assert f"{facts} does not record RLIMIT_MEMLOCK" in memlock["message"]
    assert "flashnext facts --out FILE" in memlock["fix"]


def test_recorded_unlimited_memlock_stays_unlimited(model):
    result = invoke("preflight", "--facts", BASE_FILE, "--model", model, "--table", TABLE, "--json")
    found = findings(result)
    assert (found["host.memlock"]["level"], found["host.memlock"]["measured"]) == (
        "ok",
        "unlimited",
    )
    assert found["host.cgroup"]["measured"] == "no limit"


def test_a_failed_memlock_probe_is_unknown(monkeypatch):
    import resource

    from flashnext.facts.host import probe_memory

    def refuse(which):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(resource, "getrlimit", refuse)
    facts = probe_memory()
    assert facts.memlock_soft_bytes is None
    assert {"memlock_soft_bytes", "memlock_hard_bytes"} <= set(facts.unknown)
    assert "RLIMIT_MEMLOCK" in facts.error


# ---------------------------------------------------------------- 9. facts about another file


def test_facts_about_another_table_judge_nothing_about_this_one(model):
    other = "/somewhere/else.bin"
    result = invoke("preflight", "--facts", BASE_FILE, "--model", model, "--table", other, "--json")
    found = findings(result)
    assert "table.size" not in found and "table.medium" not in found
    f = found["table.path"]
    assert f["level"] == "warn", f
    assert f["message"] == (
        f"{BASE_FILE} records the storage of {TABLE}, not of {other}: its size, manifest "
        "and medium are unknown"
    )
    assert f["fix"] == (
        f"record facts for it on the serving host (`flashnext facts --table {other} --out "
        f"FILE`) and pass --facts FILE, or pass --table {TABLE}"
    )


def test_facts_without_the_port_say_it_is_unknown(model):
    result = invoke("preflight", "--facts", BASE_FILE, "--model", model, "--table", TABLE,
                    "--port", "9000", "--json")  # fmt: skip
    f = findings(result)["port"]
    assert (f["level"], f["measured"]) == ("warn", "unknown"), f
    assert f["message"] == (
        f"{BASE_FILE} does not record a probe of 127.0.0.1:9000 (it has 127.0.0.1:8000): "
        "whether the API can bind is unknown"
    )
    assert "flashnext facts --host 127.0.0.1 --port 9000 --out FILE" in f["fix"]


# ---------------------------------------------------------------- 6. an index that drops a file


def test_index_that_drops_a_whole_shard_file_fails_model_dir(model):
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    dropped = "model-00003-of-00007.safetensors"
    index["weight_map"] = {t: f for t, f in index["weight_map"].items() if f != dropped}
    index_path.write_text(json.dumps(index))
    result = invoke("preflight", "--facts", BASE_FILE, "--model", model, "--table", TABLE, "--json")
    f = findings(result)["model.dir"]
    assert f["level"] == "fail", f
    assert f["message"] == (
        f"{index_path}: maps no tensor to {dropped}, which is in the directory (shard 3 of "
        "7); vLLM loads by the index, so its tensors would be missing: download "
        "model.safetensors.index.json again (it must come from the same export as the shards)"
    )
    check = invoke("checkpoint", "check", "--model", model)
    assert check.exit_code == 1 and check.output.startswith(f"Error: {index_path}: maps no")


def test_index_naming_fewer_files_than_the_shard_names_count(model):
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    dropped = "model-00007-of-00007.safetensors"
    index["weight_map"] = {t: f for t, f in index["weight_map"].items() if f != dropped}
    index_path.write_text(json.dumps(index))
    (model / dropped).unlink()
    result = invoke("preflight", "--facts", BASE_FILE, "--model", model, "--table", TABLE, "--json")
    f = findings(result)["model.dir"]
    assert f["level"] == "fail"
    assert f"maps no tensor to {dropped}, which is not in the directory either" in f["message"]


# ---------------------------------------------------------------- 7. malformed configs


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (0, "num_hidden_layers is 0, not an integer >= 1"),
        (-4, "num_hidden_layers is -4, not an integer >= 1"),
        ("forty-eight", "num_hidden_layers is 'forty-eight', not an integer >= 1"),
    ],
)
def test_bad_num_hidden_layers_is_named_by_every_command(value, words, model):
    config = edit_text_config(model, num_hidden_layers=value)
    want = f"{config}: {words}; restore config.json from the published checkpoint"
    common = ("--facts", BASE_FILE, "--model", model, "--table", TABLE)

    plan = invoke("plan", *common)
    assert plan.exit_code == 1
    assert plan.output == f"Error: no plan: {want}\n"

    pre = invoke("preflight", *common, "--json")
    assert pre.exit_code == 1
    assert findings(pre)["plan"]["message"] == f"cannot plan: {want}"

    serve = invoke("serve", "--dry-run", "--replay-facts-for-testing", *common[1:], "--json")
    assert serve.exit_code == 1
    assert findings(serve)["plan"]["message"] == f"cannot plan: {want}"

    report = invoke("report", *common)
    assert report.exit_code == 0
    assert json.loads(report.stdout)["plan"] == {"unavailable": want}


def test_ple_layer_beyond_the_model_is_named(model):
    config = edit_text_config(model, ple_layer_ids=[9])
    result = invoke("plan", "--facts", BASE_FILE, "--model", model, "--table", TABLE)
    assert result.exit_code == 1
    assert result.output == (
        f"Error: no plan: {config}: ple_layer_ids [9] name layer(s) beyond num_hidden_layers "
        "4; restore config.json from the published checkpoint\n"
    )


def test_table_shape_that_cannot_be_derived_is_a_table_finding(model):
    config = edit_text_config(model, heads_per_ngram=0)
    result = invoke("preflight", "--facts", BASE_FILE, "--model", model, "--table", TABLE, "--json")
    f = findings(result)["table.size"]
    assert f["level"] == "fail", f
    assert f["message"] == (
        f"cannot tell the PLE table's shape: {config}: heads_per_ngram is 0, not an integer >= 1"
    )


# ---------------------------------------------------------------- 2. report --out read-only


def test_report_out_on_a_read_only_filesystem(model, tmp_path):
    """A real read-only mount (chmod does not stop root); skipped where mounting is refused."""
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(ro)],
                             capture_output=True, text=True, check=False)  # fmt: skip
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        out = ro / "report.json"
        result = invoke("report", "--facts", BASE_FILE, "--model", model, "--table", TABLE,
                        "--out", out)  # fmt: skip
        assert result.exit_code == 1
        assert result.output == (
            f"Error: cannot write {out}: Read-only file system\n"
            "  fix: pass --out a path on a writable filesystem, or drop --out to print the "
            "report\n"
        )
        assert list(ro.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


# ---------------------------------------------------------------- 8. and 10. checkpoint fix


@pytest.fixture(scope="module")
def shipped_tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "shipped"
    write_skeleton(path, "tiny")
    return path


def test_fix_keeps_the_originals_mode(shipped_tiny, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(shipped_tiny, model)
    (model / "config.json").chmod(0o644)
    (model / "generation_config.json").chmod(0o640)
    result = invoke("checkpoint", "fix", "--model", model, "--sampling", "temperature=0.7")
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE((model / "config.json.orig").stat().st_mode) == 0o644
    assert stat.S_IMODE((model / "generation_config.json.orig").stat().st_mode) == 0o640
    assert stat.S_IMODE((model / "config.json").stat().st_mode) == 0o644


def test_fix_gives_a_new_generation_config_the_configs_mode(shipped_tiny, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(shipped_tiny, model)
    (model / "generation_config.json").unlink()
    (model / "config.json").chmod(0o644)
    result = invoke("checkpoint", "fix", "--model", model, "--sampling", "top_p=0.8")
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE((model / "generation_config.json").stat().st_mode) == 0o644


@pytest.mark.parametrize(
    ("pair", "why"),
    [
        ("temperature=-5", "temperature must be in [0, 2]"),
        ("temperature=3", "temperature must be in [0, 2]"),
        ("top_p=0", "top_p must be in (0, 1]"),
        ("top_k=-2", "top_k must be -1 or 0 (off) or at least 1"),
        ("top_k=2.5", "top_k must be an integer"),
        ("min_p=1.5", "min_p must be in [0, 1]"),
        ("presence_penalty=3", "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty=-2.5", "frequency_penalty must be in [-2, 2]"),
        ("repetition_penalty=0", "repetition_penalty must be greater than 0"),
        ("max_new_tokens=0", "max_new_tokens must be an integer >= 1"),
        ("skip_special_tokens=1", "skip_special_tokens must be true or false"),
        ("temperature=true", "temperature must be a number"),
        ("temperature=nan", "is not a number or true/false"),
    ],
)
def test_fix_refuses_sampling_values_vllm_refuses(pair, why, shipped_tiny, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(shipped_tiny, model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    result = invoke("checkpoint", "fix", "--model", model, "--sampling", pair)
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: --sampling {pair!r}: "), result.output
    assert why in result.output
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


def test_fix_refuses_bad_values_from_a_generation_config_too(shipped_tiny, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(shipped_tiny, model)
    source = tmp_path / "published"
    source.mkdir()
    (source / "generation_config.json").write_text('{"temperature": -5, "top_p": 0.8}')
    result = invoke("checkpoint", "fix", "--model", model, "--generation-config-from", source)
    assert result.exit_code == 1
    assert result.output.startswith(
        f"Error: --generation-config-from: {source / 'generation_config.json'}: temperature "
        "must be in [0, 2], got -5"
    ), result.output
    assert not (model / "config.json.orig").exists()


# ---------------------------------------------------------------- the fixture still passes


def test_base_facts_written_by_this_flashnext_replay_unchanged(tmp_path):
    """What `facts --json` writes now replays to the same facts (the new fields included)."""
    facts = base_facts()
    path = tmp_path / "facts.json"
    path.write_text(dumps(facts))
    from flashnext.facts.schema import host_facts_from_json

    again = host_facts_from_json(path.read_text(), source=str(path))
    assert again == facts
    assert again.memory.unknown == ()
