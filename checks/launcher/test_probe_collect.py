"""collect_host_facts and `flashnext facts`: the real host, end to end."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path

from click.testing import CliRunner
from flashnext.cli import main
from flashnext.facts.collect import collect_host_facts, host_facts_tables
from flashnext.facts.schema import SCHEMA_VERSION, HostFacts, dumps, host_facts_from_json
from test_probe_gpu import ReplayNVML, machine


def test_collect_real_host(tmp_path):
    table = tmp_path / "ple.bin"
    table.write_bytes(b"\0" * 8192)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        busy = server.getsockname()[1]
        facts = collect_host_facts(
            {"table": table, "model": tmp_path / "missing-model"}, [("127.0.0.1", busy)]
        )
    assert facts.schema_version == SCHEMA_VERSION
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", facts.collected_at)
    assert facts.hostname == socket.gethostname()
    assert (
        facts.kernel
        == subprocess.run(
            ["uname", "-r"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    assert facts.memory.mem_total_bytes > 0
    assert set(facts.storage) == {"table", "model"}
    assert facts.storage["table"].size_bytes == 8192
    assert facts.storage["model"].exists is False
    assert facts.storage["model"].mount_point == facts.storage["table"].mount_point
    assert [(p.port, p.free) for p in facts.ports] == [(busy, False)]
    assert host_facts_from_json(dumps(facts)) == facts


def test_in_container_markers(tmp_path, monkeypatch):
    from flashnext.facts.host import in_container

    monkeypatch.delenv("container", raising=False)
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (proc / "1" / "cgroup").write_text("0::/init.scope\n")
    assert in_container(str(proc), str(tmp_path)) is False
    (proc / "1" / "cgroup").write_text("0::/kubepods/besteffort/pod1/abc\n")
    assert in_container(str(proc), str(tmp_path)) is True
    (proc / "1" / "cgroup").write_text("0::/\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".containerenv").write_text("")
    assert in_container(str(proc), str(tmp_path)) is True


def test_tables_for_a_replayed_gpu_host(tmp_path):
    facts = collect_host_facts({}, [], nvml=ReplayNVML(machine()), sys=str(tmp_path))
    titles = [t for t, _, _ in host_facts_tables(facts)]
    assert titles[:2] == ["Host", "Memory"]
    assert titles[2] == "GPUs: 3 (driver 999.99.99, CUDA 12.8)"
    gpus = dict((t, rows) for t, _, rows in host_facts_tables(facts))[titles[2]]
    assert gpus[2] == [
        2,
        "NVIDIA GeForce RTX 3090",
        "23.70 GiB / 24.00 GiB",
        "8.6",
        "Gen1 x4 (max Gen4 x4)",
        "on",
        "-",  # NUMA node: none under this sysfs
        "none",
    ]


# ---------------------------------------------------------------- the command


def test_facts_json_out_is_atomic_and_canonical(tmp_path):
    out = tmp_path / "host.json"
    result = CliRunner().invoke(
        main, ["facts", "--json", "--out", str(out), "--table", str(tmp_path / "t.bin")]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["schema_version"] == SCHEMA_VERSION
    assert list(doc) == sorted(doc)
    written = out.read_text()
    facts = host_facts_from_json(written, str(out))
    assert isinstance(facts, HostFacts)
    assert written == dumps(facts)
    assert [p.name for p in tmp_path.iterdir()] == ["host.json"]  # no temp file left behind
    assert facts.storage["table"].exists is False
    assert [(p.host, p.port) for p in facts.ports] == [("127.0.0.1", 8000)]


def test_facts_table_says_why_nvml_is_missing():
    result = CliRunner().invoke(main, ["facts", "--port", "8123", "--host", "127.0.0.1"])
    assert result.exit_code == 0, result.output
    assert "Memory" in result.output and "Ports" in result.output
    assert "127.0.0.1:8123" in result.output
    if not Path("/dev/nvidiactl").exists():
        assert "unavailable: NVML init failed" in result.output


def test_facts_out_into_missing_directory_is_a_usage_error(tmp_path):
    target = tmp_path / "nope" / "host.json"
    result = CliRunner().invoke(main, ["facts", "--out", str(target)])
    assert result.exit_code == 2
    assert f"directory {target.parent} does not exist" in result.output
    assert not target.parent.exists()


def test_facts_rejects_bad_port():
    result = CliRunner().invoke(main, ["facts", "--port", "0"])
    assert result.exit_code == 2
    assert "--port" in result.output


def test_facts_out_keeps_old_file_when_write_fails(tmp_path, monkeypatch):
    out = tmp_path / "host.json"
    out.write_text("old\n")

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    result = CliRunner().invoke(main, ["facts", "--out", str(out)])
    assert result.exit_code == 1
    assert "cannot write" in result.output and "No space left on device" in result.output
    assert out.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["host.json"]
