"""pins/wheelhouse: the wheelhouse path pins/build-env uses, filled only when incomplete."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pinkit import lockfile, meta, wheelhouse

PINS_DIR = Path(__file__).resolve().parents[2] / "pins"
SCRIPT = PINS_DIR / "wheelhouse"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def lock_digest(python: str) -> str:
    entry = meta.load(PINS_DIR).lock_for(python)
    pins = lockfile.parse((PINS_DIR / entry.file).read_text(), entry.file)
    return lockfile.pins_digest(pins)


def test_path_is_build_envs_wheelhouse(tmp_path):
    proc = run("--python-version", "3.11", "--path", "--cache", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(wheelhouse.path_for(tmp_path, lock_digest("3.11")))
    assert not (tmp_path / "wheelhouse").exists(), "--path must not fill anything"


def test_a_complete_wheelhouse_is_printed_without_pip(tmp_path):
    digest = lock_digest("3.12")
    found = wheelhouse.path_for(tmp_path, digest)
    found.mkdir(parents=True)
    wheelhouse.mark_complete(found, digest)
    proc = run("--python-version", "3.12", "--cache", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(found)


def test_a_python_without_a_lock_is_refused_with_the_fix(tmp_path):
    proc = run("--python-version", "3.9", "--cache", str(tmp_path))
    assert proc.returncode == 1
    assert proc.stderr.startswith("pins/wheelhouse: error: no lock for CPython 3.9")
    assert "Traceback" not in proc.stderr


def test_a_download_reports_progress_while_pip_is_quiet(tmp_path, monkeypatch, capfd):
    """Issue 43: the wheel download printed nothing for 1.5 minutes. While pip runs
    (quiet, no bar), a line every PROGRESS_EVERY s says how many wheels are here.
    pip itself would need the index; a stand-in 'python' writes wheels slowly."""
    from pinkit.target import Target

    lock = tmp_path / "requirements.txt"
    lock.write_text("# a lock\na==1 \\\n    --hash=sha256:00\nb==2 \\\n    --hash=sha256:11\n")
    dest = tmp_path / "wheels"
    dest.mkdir()
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        f"sleep 0.3; head -c 1000000 /dev/zero > {dest}/a-1-py3-none-any.whl\n"
        f"sleep 0.6; head -c 1000000 /dev/zero > {dest}/b-2-py3-none-any.whl\nsleep 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(wheelhouse, "PROGRESS_EVERY", 0.2)
    wheelhouse.download(str(fake), Target("3.11"), lock, dest)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("wheelhouse: ")]
    assert len(lines) >= 3, lines
    assert lines[0].startswith("wheelhouse: 0 of 2 wheels here (0.00 GB)")
    assert lines[-1].startswith("wheelhouse: 2 of 2 wheels here (0.00 GB)")
