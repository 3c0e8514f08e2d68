"""checks/run's closing report and the suites' installers (the CI entry points).

Here because the nix suite is where this repository tests its own build and CI
tooling. The report is checked on junit files that a real pytest run writes;
the installers run for real with `apt-get` (and the tools it would install)
replaced by stubs on PATH, so nothing is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO

SUMMARIZE = REPO / "checks" / "summarize.py"

SAMPLE_TESTS = """
import pytest

def test_ok():
    pass

def test_ok_too():
    pass

def test_broken():
    assert False

@pytest.mark.skip(reason="needs the GPU host")
def test_gpu_a():
    pass

@pytest.mark.skip(reason="needs the GPU host")
def test_gpu_b():
    pass

def test_env_missing():
    pytest.skip("set FLASHNEXT_PINS_REAL_ENV=1 to build the real env")

@pytest.mark.xfail(strict=True, reason="proof: fails on stock vLLM")
def test_proof_on_stock_a():
    assert False

@pytest.mark.xfail(strict=True, reason="proof: fails on stock vLLM")
def test_proof_on_stock_b():
    assert False

@pytest.mark.xfail(strict=True, reason="proof: fails on stock vLLM")
def test_proof_that_passes_on_stock():
    pass
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """A results dir as checks/run leaves it: junit files written by a real pytest run."""
    root = tmp_path_factory.mktemp("junit")
    (root / "test_sample.py").write_text(SAMPLE_TESTS)
    out = root / "results"
    out.mkdir()
    for name in ("patches-2-stock.xml", "pins-2.xml"):
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             str(root / "test_sample.py"), f"--junitxml={out / name}"],
            cwd=root, capture_output=True, check=False,
        )  # fmt: skip
        assert (out / name).is_file()
    return out


def summarize(results: Path, failed_suites: int = 0) -> list[str]:
    proc = subprocess.run(
        [sys.executable, str(SUMMARIZE), str(results), str(failed_suites)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return proc.stdout.splitlines()


def test_closing_line_keeps_its_format_and_leaves_xfails_out_of_skips(results):
    lines = summarize(results)
    # Two files: 2 passed, 2 failed (one assert, one strict xpass), 3 skipped, 2 xfailed each.
    assert lines[-1] == "checks: 4 passed, 4 failed, 6 skipped"
    assert lines[0].startswith("checks: 4 xfailed (expected failures, strict")


def test_reasons_are_grouped_with_their_suites(results):
    lines = summarize(results)
    assert "     4  proof: fails on stock vLLM  [patches/stock 2, pins 2]" in lines
    assert "checks: 6 skipped, by reason:" in lines
    assert "     4  needs the GPU host  [patches/stock 2, pins 2]" in lines
    real_env = "set FLASHNEXT_PINS_REAL_ENV=1 to build the real env"
    assert f"     2  {real_env}  [patches/stock 1, pins 1]" in lines
    # Skip reasons come after the xfails, before the junit line and the closing line.
    assert lines.index("checks: 6 skipped, by reason:") > 0
    assert lines[-2] == f"checks: junit files in {results}: patches-2-stock.xml, pins-2.xml"


def test_a_suite_that_failed_outside_pytest_still_counts(results, tmp_path):
    assert summarize(results, failed_suites=9)[-1] == "checks: 4 passed, 9 failed, 6 skipped"
    assert summarize(tmp_path, failed_suites=1) == [
        f"checks: no junit files in {tmp_path}",
        "checks: 0 passed, 1 failed, 0 skipped",
    ]


def test_checks_run_uses_the_report():
    text = (REPO / "checks" / "run").read_text()
    assert '"$FLASHNEXT_PY" checks/summarize.py "$FLASHNEXT_RESULTS" "$failed"' in text


# ---------------------------------------------------------------- installers


def stub_path(tmp_path: Path, tools: list[str]) -> tuple[dict[str, str], Path]:
    """A PATH with bash and coreutils but none of `tools`; `apt-get` logs its calls and,
    on install, puts a stub of each tool on that PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("bash", "dirname", "mkdir", "chmod", "cat"):
        os.symlink(shutil.which(name), bin_dir / name)
    log = tmp_path / "calls.log"
    stubs = " ".join(tools)
    (bin_dir / "apt-get").write_text(
        textwrap.dedent(f"""\
        #!/bin/sh
        echo "apt-get $*" >> {log}
        case " $* " in *" install "*)
          for t in {stubs}; do
            printf '#!/bin/sh\\necho stub $0\\n' > {bin_dir}/$t; chmod +x {bin_dir}/$t
          done;;
        esac
        """)
    )
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "python $*" >> {log}\n')
    for path in (bin_dir / "apt-get", python):
        path.chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "FLASHNEXT_PY": str(python),
           "FLASHNEXT_RESULTS": str(tmp_path)}  # fmt: skip
    return env, log


@pytest.mark.parametrize(
    ("script", "tools", "packages"),
    [
        ("checks/nix/run", ["nix"], "nix-bin"),
        ("checks/containers/run", ["podman", "runc", "debootstrap", "newuidmap"],
         "podman buildah skopeo runc uidmap debootstrap"),
    ],
)  # fmt: skip
def test_installers_update_the_package_lists_first(tmp_path, script, tools, packages):
    env, log = stub_path(tmp_path, tools)
    proc = subprocess.run([REPO / script], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    assert calls[:2] == ["apt-get update -q", f"apt-get install -y -q {packages}"], calls
    assert calls[2].startswith("python -m pytest"), calls


def test_installers_do_nothing_when_the_tools_are_there(tmp_path):
    env, log = stub_path(tmp_path, ["nix"])
    nix = Path(env["PATH"]) / "nix"
    nix.write_text("#!/bin/sh\necho nix stub\n")
    nix.chmod(0o755)
    proc = subprocess.run([REPO / "checks/nix/run"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [c.split()[0] for c in log.read_text().splitlines()] == ["python"]
