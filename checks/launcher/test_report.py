"""report: the parts assembled and redacted (recorded facts, then this host's real probe)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import socket
import sys
from pathlib import Path

import pytest
from flashnext.facts.collect import collect_host_facts
from flashnext.facts.schema import to_jsonable
from flashnext.tools import report

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "checks" / "fixtures" / "facts" / "3x3090-nvme.json"


def personal_facts() -> dict:
    """The recorded 3x3090 facts, as alice's box would report them."""
    facts = json.loads(FIXTURE.read_text())
    facts["hostname"] = "gpubox-7"
    facts["gpu"]["devices"][0]["uuid"] = "GPU-3f2a9c1e-77b0-4c4e-9a51-0d2f6b8e1a42"
    facts["storage"] = {
        "model": {"path": "/home/alice/models/flash-next", "exists": True,
                  "mount_source": "/dev/nvme0n1p2", "devices": [
                      {"name": "nvme0n1", "transport": "nvme", "model": "Samsung 990 PRO",
                       "serial": "S6Z2NJ0W123456"}]},
    }  # fmt: skip
    return facts


PLAN = {
    "argv": ["vllm", "serve", "/home/alice/models/flash-next", "--host", "192.168.1.20",
             "--api-key", "sk-live-123", "--port", "8000"],
    "env": {"VLLM_PLE_MMAP_PATH": "/home/alice/ple.bin", "VLLM_API_KEY": "sk-live-123",
            "CUDA_VISIBLE_DEVICES": "0,1,2"},
    "decode": {"tokens_per_s": 160.5},
}  # fmt: skip
MESSAGE = "gpubox-7:/home/alice/ple.bin is on nvme0n1 (alice's disk)"
PREFLIGHT = {"result": "warn", "findings": [{"id": "table", "message": MESSAGE}]}


def alice() -> report.Redactor:
    return report.Redactor(hostname="gpubox-7", username="alice", home="/home/alice")


def test_everything_identifying_is_redacted():
    doc = report.build_report(
        facts=personal_facts(), plan=PLAN, preflight=PREFLIGHT,
        versions={"flashnext": "0.1.0"}, patches={"patches": []}, redactor=alice(),
    )  # fmt: skip
    text = json.dumps(doc)
    for secret in ("gpubox-7", "alice", "/home/alice", "3f2a9c1e", "S6Z2NJ0W123456",
                   "sk-live-123", "192.168.1.20"):  # fmt: skip
        assert secret not in text, secret
    assert doc["facts"]["hostname"] == "<hostname>"
    assert doc["facts"]["gpu"]["devices"][0]["uuid"] == "<redacted>"
    assert doc["facts"]["storage"]["model"]["path"] == "~/models/flash-next"
    assert doc["facts"]["storage"]["model"]["devices"][0]["serial"] == "<redacted>"
    assert doc["plan"]["argv"] == ["vllm", "serve", "~/models/flash-next", "--host", "<ip>",
                                   "--api-key", "<redacted>", "--port", "8000"]  # fmt: skip
    assert doc["plan"]["env"] == {"VLLM_PLE_MMAP_PATH": "~/ple.bin", "VLLM_API_KEY": "<redacted>",
                                  "CUDA_VISIBLE_DEVICES": "0,1,2"}  # fmt: skip
    assert doc["preflight"]["findings"][0]["message"] == (
        "<hostname>:~/ple.bin is on nvme0n1 (<user>'s disk)"
    )
    # what is useful stays: shapes, sizes, device names, loopback addresses
    assert doc["facts"]["gpu"]["devices"][1]["memory_total_bytes"] == 25769803776
    assert doc["facts"]["storage"]["model"]["devices"][0]["model"] == "Samsung 990 PRO"
    assert doc["plan"]["decode"]["tokens_per_s"] == 160.5
    assert doc["redactions"] == {
        "home_path": 4, "hostname": 2, "ip": 1, "secret": 2, "serial": 4, "user": 1,
    }  # fmt: skip


def test_loopback_and_lookalikes_are_kept():
    r = alice()
    assert r.text("http://127.0.0.1:8000 0.0.0.0") == "http://127.0.0.1:8000 0.0.0.0"
    assert r.text("/home/alicex/x and malice") == "/home/alicex/x and malice"
    assert r.text("/home/alice") == "~"
    assert r.value("--api-key=abc", "x") == "--api-key=abc"  # a lone string is not argv
    assert r.value(["--api-key=abc"]) == ["--api-key=<redacted>"]
    assert r.text("nic 00:1b:21:3a:4f:5c") == "nic <mac>"


def test_ipv6_addresses_are_redacted_and_lookalikes_kept():
    r = alice()
    assert r.text("bound [2001:db8::7]:8000 and fe80::1ff:fe23:4567:890a%eth0") == (
        "bound [<ip>]:8000 and <ip>"
    )
    assert r.text("peer 2001:db8:0:0:1:0:0:1 and ::ffff:192.0.2.7") == "peer <ip> and <ip>"
    # what says nothing about the host, or is no address at all, stays
    kept = "[::1]:8000 [::]:8000 at 12:34:56 in std::vector c::d::e"
    assert r.text(kept) == kept
    assert r.counts == {"ip": 4}


def test_the_person_behind_sudo_is_redacted(monkeypatch):
    # `sudo flashnext report`: getpass says root; SUDO_USER is the person, and their home
    # directory is theirs too.
    monkeypatch.setenv("SUDO_USER", "root")  # `sudo -u root` from root: nobody else
    assert report._sudo_invoker("root") == (None, None)
    me = report.Redactor(username="root", home="/root", sudo_user="alice",
                         sudo_home="/home/alice")  # fmt: skip
    text = me.text("/home/alice/models/x by alice, run as root in /root/tmp")
    assert text == "~/models/x by <user>, run as <user> in ~/tmp"
    import pwd

    someone = pwd.getpwuid(os.getuid())
    monkeypatch.setenv("SUDO_USER", someone.pw_name)
    assert report._sudo_invoker("another-name") == (someone.pw_name, someone.pw_dir)
    monkeypatch.setenv("SUDO_USER", "no-such-user-xyz")
    assert report._sudo_invoker("root") == ("no-such-user-xyz", None)


def test_missing_parts_are_recorded_not_fatal():
    doc = report.build_report(
        facts=None, plan=None, preflight=None, versions={}, patches={"unavailable": "x"},
        redactor=report.Redactor(),
    )  # fmt: skip
    assert doc["facts"] == {"unavailable": "not collected"}
    assert doc["plan"] == {"unavailable": "no plan"}
    assert doc["report_schema_version"] == report.REPORT_SCHEMA_VERSION


def test_patch_series_hashes(tmp_path):
    (tmp_path / "0001-a.patch").write_bytes(b"--- a\n+++ b\n")
    (tmp_path / "series").write_text("# comment\n0001-a.patch\n\n0002-missing.patch  # gone\n")
    doc = report.patch_series(tmp_path)
    assert doc["patches"] == [
        {"name": "0001-a.patch", "sha256": hashlib.sha256(b"--- a\n+++ b\n").hexdigest()},
        {"name": "0002-missing.patch", "sha256": "unavailable: No such file or directory"},
    ]
    assert report.patch_series(tmp_path / "nope") == {
        "unavailable": f"{tmp_path / 'nope' / 'series'}: No such file or directory"
    }
    assert report.patch_series(None) == {"unavailable": "patch series directory not found"}


def test_checkout_series_is_found():
    found = report.default_series_dir()
    assert found is not None and found.name == "vllm-0.33.0"


def test_versions_never_import_vllm():
    import sys

    v = report.versions()
    assert v["vllm_pinned"] == "0.33.0" and v["flashnext"]
    assert "vllm" not in sys.modules


def test_this_hosts_real_facts_leave_nothing_identifying(tmp_path):
    home = os.path.expanduser("~")
    facts = to_jsonable(collect_host_facts({"model": home}, [("127.0.0.1", 8000)]))
    red = report.redactor_for_this_host(facts)
    doc = report.build_report(
        facts=facts, plan=None, preflight=None, versions=report.versions(),
        patches=report.patch_series(report.default_series_dir()), redactor=red,
    )  # fmt: skip
    out = tmp_path / "report.json"
    report.write_report(out, json.dumps(doc, sort_keys=True, indent=2))
    text = out.read_text()
    host = socket.gethostname()
    # the redactor replaces the name as a word ("vm" stays inside "nvml_available")
    assert not re.search(rf"(?<![\w-]){re.escape(host)}(?![\w-])", text)
    assert f'"{home}' not in text
    assert doc["facts"]["storage"]["model"]["path"] == "~"


def test_write_report_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    out.write_text("old")

    def boom(*_a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        report.write_report(out, "new")
    assert out.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_applied_patches_read_from_the_serving_tree(tmp_path, monkeypatch):
    (tmp_path / "series_dir").mkdir()
    (tmp_path / "series_dir" / "0001-a.patch").write_bytes(b"x")
    (tmp_path / "series_dir" / "series").write_text("0001-a.patch\n")
    series = report.patch_series(tmp_path / "series_dir")
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise SystemExit('imported!')\n")  # must not be imported
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    found = report.vllm_package_dir(sys.executable)
    assert found == pkg
    assert report.applied_patches(found, series) == {
        "dir": str(pkg), "stamp": None, "note": "stock tree: no patches applied",
    }  # fmt: skip
    stamp = {"vllm_version": "0.33.0", "patches": [
        {"name": "0001-a.patch", "sha256": hashlib.sha256(b"x").hexdigest()}]}  # fmt: skip
    (pkg / report.STAMP_NAME).write_text(json.dumps(stamp))
    assert report.applied_patches(found, series)["matches_checkout"] is True
    stamp["patches"][0]["sha256"] = "0" * 64  # an env built from an older series
    (pkg / report.STAMP_NAME).write_text(json.dumps(stamp))
    assert report.applied_patches(found, series)["matches_checkout"] is False


def test_no_vllm_env_is_unavailable_not_fatal(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert report.vllm_package_dir(sys.executable) is None
    assert report.vllm_package_dir(str(tmp_path / "no-python")) is None
    assert "unavailable" in report.applied_patches(None, {})


def test_env_versions_come_from_metadata(tmp_path):
    v = report.env_versions(sys.executable)
    assert v["python"] == platform.python_version()
    assert v["vllm"] == "N/A"  # the launcher venv has no vLLM, and says so
    assert "unavailable" in report.env_versions(str(tmp_path / "no-python"))


FIX_LINE = "fix table.path: flashnext table prepare --out /opt/flashnext/ple.bin"


def test_a_service_accounts_name_is_a_product_word_and_stays():
    """Issue 43: inside the image `report` ran as the service user `flashnext`, and
    redacting that name turned /opt/flashnext and every fix line into `<user>`."""
    service = ("flashnext", "/usr/sbin/nologin", "/var/cache/flashnext")
    red = report.redactor_for_this_host({"hostname": "gpubox-7"}, account=service)
    assert red.text(f"{FIX_LINE} on gpubox-7") == f"{FIX_LINE} on <hostname>"
    assert red.text("/var/cache/flashnext/triton") == "/var/cache/flashnext/triton"
    # the same name on a person's account (a login shell) is still that person's
    person = ("flashnext", "/bin/bash", "/home/flashnext")
    red = report.redactor_for_this_host({"hostname": "gpubox-7"}, account=person)
    assert red.text(FIX_LINE) == "fix table.path: <user> table prepare --out /opt/<user>/ple.bin"
    assert red.text("/home/flashnext/m") == "~/m"


def test_which_accounts_are_services():
    for shell in ("/usr/sbin/nologin", "/sbin/nologin", "/bin/false", "/usr/bin/false"):
        assert report.is_service_account(shell), shell
    for shell in ("/bin/bash", "/usr/bin/zsh", "/bin/sh", "", None):
        assert not report.is_service_account(shell), shell
    # no passwd entry, a name from the environment: counted as a person's
    red = report.redactor_for_this_host({}, account=("alice", None, "/home/alice"))
    assert red.text("alice at /home/alice/x") == "<user> at ~/x"


def test_the_images_user_is_a_service_account():
    """The Containerfile makes `flashnext` with a shell the rule above reads as a service's."""
    text = (REPO / "containers" / "Containerfile").read_text()
    useradd = re.search(r"useradd ([^;]*)", text.replace("\\\n", " ")).group(1).split()
    assert useradd[-1] == "flashnext"
    assert report.is_service_account(useradd[useradd.index("--shell") + 1])
