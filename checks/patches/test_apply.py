"""patches/apply on small fake site-packages trees: it applies, or refuses and changes nothing."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

APPLY = Path(__file__).resolve().parents[2] / "patches" / "apply"

STOCK_CACHE = "\n".join(f"line {i}" for i in range(1, 21)) + "\n"
VERSION_PY = "__version__ = version = '0.33.0'\n__version_tuple__ = (0, 33, 0)\n"


def make_diff(rel: str, old: str | None, new: str, tmp: Path) -> str:
    """A real unified diff from GNU diff, paths a/<rel> b/<rel>."""
    a, b = tmp / "diff-a", tmp / "diff-b"
    a.write_text(old or "")
    b.write_text(new)
    label_a = "/dev/null" if old is None else f"a/{rel}"
    cmd = ["diff", "-u", "--label", label_a, "--label", f"b/{rel}", str(a), str(b)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert out.returncode == 1, out.stderr
    return out.stdout


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture
def site(tmp_path: Path) -> Path:
    site = tmp_path / "site-packages"
    (site / "vllm" / "config").mkdir(parents=True)
    (site / "vllm" / "_version.py").write_text(VERSION_PY)
    (site / "vllm" / "config" / "cache.py").write_text(STOCK_CACHE)
    return site


def write_series(tmp_path: Path, patches: dict[str, str], listed: list[str] | None = None) -> Path:
    sdir = tmp_path / "patches" / "vllm-0.33.0"
    sdir.mkdir(parents=True, exist_ok=True)
    for name, body in patches.items():
        (sdir / name).write_text("Description: test patch\n\n" + body)
    names = list(patches) if listed is None else listed
    (sdir / "series").write_text("# test series\n" + "".join(n + "\n" for n in names))
    (sdir / "pristine.sha256").write_text(f"{sha256(STOCK_CACHE)}  vllm/config/cache.py\n")
    return sdir / "series"


def run_apply(*args: str | Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(APPLY), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every path under root with its inode and content: any change shows."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            snap[str(p.relative_to(root))] = (
                p.stat().st_ino,
                p.read_bytes() if p.is_file() else None,
            )
    return snap


def good_patches(tmp_path: Path) -> dict[str, str]:
    one = STOCK_CACHE.replace("line 5\n", "line 5 patched\n")
    two = one.replace("line 15\n", "line 15 patched\n")
    return {
        "0001-first.patch": make_diff("vllm/config/cache.py", STOCK_CACHE, one, tmp_path),
        "0002-second.patch": make_diff("vllm/config/cache.py", one, two, tmp_path)
        + make_diff("vllm/new_module.py", None, "X = 1\n", tmp_path),
    }


def assert_refused(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "patches/apply: error: " in proc.stderr
    assert "  fix: " in proc.stderr
    assert "nothing was changed" in proc.stderr
    for needle in needles:
        assert needle in proc.stderr


def test_applies_series_in_order_and_stamps(site: Path, tmp_path: Path) -> None:
    series = write_series(tmp_path, good_patches(tmp_path))
    pycache = site / "vllm/config/__pycache__"
    pycache.mkdir()
    (pycache / "cache.cpython-311.pyc").write_bytes(b"stale")
    (pycache / "other.cpython-311.pyc").write_bytes(b"kept")
    stock_copy = tmp_path / "stock"
    stock_copy.mkdir()
    os.link(site / "vllm/config/cache.py", stock_copy / "cache.py")  # like cp -al

    proc = run_apply(site, "--series", series)

    assert proc.returncode == 0, proc.stderr
    assert "ok: 2 patch(es), 2 file(s) changed" in proc.stdout
    text = (site / "vllm/config/cache.py").read_text()
    assert "line 5 patched\n" in text and "line 15 patched\n" in text
    assert (site / "vllm/new_module.py").read_text() == "X = 1\n"
    assert (stock_copy / "cache.py").read_text() == STOCK_CACHE, "hardlinked stock tree changed"
    stamp = json.loads((site / "vllm/_flashnext_patches.json").read_text())
    assert stamp["vllm_version"] == "0.33.0"
    assert [p["name"] for p in stamp["patches"]] == ["0001-first.patch", "0002-second.patch"]
    digest = hashlib.sha256((series.parent / "0001-first.patch").read_bytes()).hexdigest()
    assert stamp["patches"][0]["sha256"] == digest
    assert stamp["patches"][1]["files"] == ["vllm/config/cache.py", "vllm/new_module.py"]
    assert not list(site.glob(".flashnext-patch-*")), "staging directory left behind"
    assert [p.name for p in pycache.iterdir()] == ["other.cpython-311.pyc"]


def test_refuses_already_patched_tree(site: Path, tmp_path: Path) -> None:
    series = write_series(tmp_path, good_patches(tmp_path))
    assert run_apply(site, "--series", series).returncode == 0
    before = snapshot(site)

    proc = run_apply(site, "--series", series)

    assert_refused(proc, "is already patched", "0001-first.patch, 0002-second.patch")
    assert snapshot(site) == before


def test_refuses_wrong_vllm_version(site: Path, tmp_path: Path) -> None:
    series = write_series(tmp_path, good_patches(tmp_path))
    (site / "vllm/_version.py").write_text(VERSION_PY.replace("0.33.0", "0.32.1"))
    before = snapshot(site)

    proc = run_apply(site, "--series", series)

    assert_refused(proc, "is vLLM 0.32.1, the series is for vLLM 0.33.0")
    assert snapshot(site) == before


def test_refuses_missing_patch_file(site: Path, tmp_path: Path) -> None:
    patches = good_patches(tmp_path)
    series = write_series(tmp_path, patches, listed=[*patches, "0003-gone.patch"])
    before = snapshot(site)

    proc = run_apply(site, "--series", series)

    assert_refused(proc, "series lists 0003-gone.patch but no such file")
    assert snapshot(site) == before


def test_refuses_series_out_of_order(site: Path, tmp_path: Path) -> None:
    patches = good_patches(tmp_path)
    series = write_series(tmp_path, patches, listed=["0002-second.patch", "0001-first.patch"])
    before = snapshot(site)

    proc = run_apply(site, "--series", series)

    assert_refused(proc, "0001-first.patch comes after 0002-second.patch")
    assert snapshot(site) == before


def test_refuses_patch_file_missing_from_series(site: Path, tmp_path: Path) -> None:
    series = write_series(tmp_path, good_patches(tmp_path), listed=["0001-first.patch"])
    before = snapshot(site)

    proc = run_apply(site, "--series", series)

    assert_refused(proc, "0002-second.patch in", "is not listed in the series")
    assert snapshot(site) == before


def test_reject_in_a_later_patch_leaves_tree_untouched(site: Path, tmp_path: Path) -> None:
    patches = good_patches(tmp_path)
    # Written against a tree that never existed: its hunk cannot apply.
    other = STOCK_CACHE.replace("line 9\n", "line nine\n")
    patches["0003-bad.patch"] = make_diff(
        "vllm/config/cache.py", other, other.replace("line 10\n", "line ten\n"), tmp_path
    )
    series = write_series(tmp_path, patches)
    before = snapshot(site)

    proc = run_apply(site, "--series", series)

    assert_refused(proc, "0003-bad.patch does not apply cleanly", "FAILED")
    assert snapshot(site) == before


def test_refuses_a_hunk_that_needs_fuzz(site: Path, tmp_path: Path) -> None:
    # Outer context line differs: GNU patch's default fuzz 2 would apply it.
    other = STOCK_CACHE.replace("line 2\n", "line two\n")
    body = make_diff("vllm/config/cache.py", other, other.replace("line 5\n", "five\n"), tmp_path)
    fuzzed = subprocess.run(
        ["patch", "--dry-run", "-p1", "-d", str(site)], input=body, text=True,
        capture_output=True, check=False,
    )  # fmt: skip
    assert fuzzed.returncode == 0 and "fuzz" in fuzzed.stdout, "fixture must need fuzz"
    series = write_series(tmp_path, {"0001-fuzzy.patch": body})
    before = snapshot(site)

    proc = run_apply(site, "--series", series)

    assert_refused(proc, "0001-fuzzy.patch does not apply cleanly")
    assert snapshot(site) == before


def test_refuses_modified_stock_file(site: Path, tmp_path: Path) -> None:
    series = write_series(tmp_path, good_patches(tmp_path))
    (site / "vllm/config/cache.py").write_text(STOCK_CACHE + "# local edit\n")
    before = snapshot(site)

    proc = run_apply(site, "--series", series)

    assert_refused(proc, "vllm/config/cache.py differs from stock vLLM 0.33.0")
    assert snapshot(site) == before


def test_refuses_directory_without_vllm(tmp_path: Path) -> None:
    series = write_series(tmp_path, good_patches(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()

    proc = run_apply(empty, "--series", series)

    assert_refused(proc, "holds no vllm package")
    assert list(empty.iterdir()) == []


def test_check_mode_changes_nothing(site: Path, tmp_path: Path) -> None:
    series = write_series(tmp_path, good_patches(tmp_path))
    before = snapshot(site)

    proc = run_apply(site, "--series", series, "--check")

    assert proc.returncode == 0, proc.stderr
    assert "2 patch(es) apply cleanly" in proc.stdout
    assert snapshot(site) == before


def _write_record(site: Path, files: dict[str, str]) -> None:
    dist = site / "vllm-0.33.0.dist-info"
    dist.mkdir()
    rows = []
    for rel, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        rows.append(f"{rel},sha256={digest.decode()},{len(text)}")
    (dist / "RECORD").write_text("\n".join(rows) + "\nvllm-0.33.0.dist-info/RECORD,,\n")


def test_write_manifest_takes_hashes_checked_against_wheel_record(
    site: Path, tmp_path: Path
) -> None:
    series = write_series(tmp_path, good_patches(tmp_path))
    manifest = series.parent / "pristine.sha256"
    manifest.unlink()
    _write_record(site, {"vllm/config/cache.py": STOCK_CACHE, "vllm/_version.py": VERSION_PY})

    proc = run_apply("--write-manifest", site, "--series", series)

    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in manifest.read_text().splitlines() if not ln.startswith("#")]
    assert lines == [f"{sha256(STOCK_CACHE)}  vllm/config/cache.py"]


def test_write_manifest_refuses_file_that_differs_from_record(site: Path, tmp_path: Path) -> None:
    series = write_series(tmp_path, good_patches(tmp_path))
    _write_record(site, {"vllm/config/cache.py": STOCK_CACHE + "x"})
    before = (series.parent / "pristine.sha256").read_text()

    proc = run_apply("--write-manifest", site, "--series", series)

    assert_refused(proc, "does not match the wheel's RECORD")
    assert (series.parent / "pristine.sha256").read_text() == before


def _with_depends(body: str, depends: str) -> str:
    return f"Depends: {depends}\n\n{body}"


def test_applies_a_series_whose_prerequisites_come_first(site: Path, tmp_path: Path) -> None:
    patches = good_patches(tmp_path)
    patches["0002-second.patch"] = _with_depends(patches["0002-second.patch"], "0001-first.patch")
    series = write_series(tmp_path, patches)

    proc = run_apply(site, "--series", series)

    assert proc.returncode == 0, proc.stderr
    assert "ok: 2 patch(es)" in proc.stdout


def test_refuses_a_series_that_lacks_a_prerequisite(site: Path, tmp_path: Path) -> None:
    """0002 needs 0001 at run time; a series (and dir) without 0001 is refused."""
    one = STOCK_CACHE.replace("line 5\n", "line 5 patched\n")
    body = make_diff("vllm/config/cache.py", STOCK_CACHE, one, tmp_path)
    series = write_series(
        tmp_path, {"0002-second.patch": _with_depends(body, "0001-first.patch, 0000-x.patch")}
    )
    before = snapshot(site)

    proc = run_apply(site, "--series", series)

    assert_refused(
        proc,
        "0002-second.patch needs 0001-first.patch (its Depends field), which series",
        "fix: add 0001-first.patch to series before 0002-second.patch, or remove"
        " 0002-second.patch from it",
    )
    assert snapshot(site) == before
    assert not (site / "vllm/_flashnext_patches.json").exists()


def test_refuses_a_prerequisite_listed_after_its_user(site: Path, tmp_path: Path) -> None:
    patches = good_patches(tmp_path)
    # A Depends field may run over continuation lines.
    patches["0001-first.patch"] = (
        "Depends: 0000-none.patch,\n 0002-second.patch\n" + patches["0001-first.patch"]
    )
    series = write_series(tmp_path, patches)
    before = snapshot(site)

    proc = run_apply(site, "--series", series, "--check")

    assert_refused(proc, "0001-first.patch needs 0000-none.patch")
    assert snapshot(site) == before
    patches["0001-first.patch"] = patches["0001-first.patch"].replace("0000-none.patch,\n", "\n")
    series = write_series(tmp_path, patches)
    assert_refused(
        run_apply(site, "--series", series),
        "0001-first.patch needs 0002-second.patch, which series lists after it",
        "fix: list 0002-second.patch before 0001-first.patch",
    )
    assert snapshot(site) == before


def test_refuses_a_depends_entry_that_is_not_a_patch_name(site: Path, tmp_path: Path) -> None:
    patches = good_patches(tmp_path)
    patches["0002-second.patch"] = _with_depends(patches["0002-second.patch"], "first")
    series = write_series(tmp_path, patches)

    assert_refused(run_apply(site, "--series", series), "0002-second.patch: Depends names 'first'")


def _text_dependent_patches(tmp_path: Path) -> dict[str, str]:
    """0002's hunk has 0001's changed line in its context: it applies only after 0001."""
    one = STOCK_CACHE.replace("line 5\n", "line 5 patched\n")
    two = one.replace("line 6\n", "line 6 patched\n")
    return {
        "0001-first.patch": make_diff("vllm/config/cache.py", STOCK_CACHE, one, tmp_path),
        "0002-second.patch": make_diff("vllm/config/cache.py", one, two, tmp_path),
    }


def test_applies_a_series_whose_text_prerequisites_come_first(site: Path, tmp_path: Path) -> None:
    patches = _text_dependent_patches(tmp_path)
    patches["0002-second.patch"] = (
        "Applies-After: 0001-first.patch\n\n" + patches["0002-second.patch"]
    )
    series = write_series(tmp_path, patches)

    proc = run_apply(site, "--series", series)

    assert proc.returncode == 0, proc.stderr
    assert "line 5 patched\nline 6 patched\n" in (site / "vllm/config/cache.py").read_text()


def test_refuses_a_series_that_lacks_a_text_prerequisite(site: Path, tmp_path: Path) -> None:
    """Without its header field, 0002 alone fails inside GNU patch; with it, before."""
    body = _text_dependent_patches(tmp_path)["0002-second.patch"]
    series = write_series(tmp_path, {"0002-second.patch": body})
    before = snapshot(site)
    assert_refused(run_apply(site, "--series", series), "0002-second.patch does not apply cleanly")
    series = write_series(
        tmp_path, {"0002-second.patch": "Applies-After: 0001-first.patch\n\n" + body}
    )

    proc = run_apply(site, "--series", series)

    assert_refused(
        proc,
        "0002-second.patch applies only after 0001-first.patch (its Applies-After field),"
        " which series",
        "fix: add 0001-first.patch to series before 0002-second.patch, or remove"
        " 0002-second.patch from it (its hunks need 0001-first.patch's text: regenerate it"
        " without 0001-first.patch)",
    )
    assert "GNU patch" not in proc.stderr, "refused by the header, not by a failed hunk"
    assert snapshot(site) == before


def test_refuses_a_text_prerequisite_listed_after_its_user(site: Path, tmp_path: Path) -> None:
    patches = good_patches(tmp_path)
    patches["0001-first.patch"] = (
        "Applies-After:\n 0002-second.patch\n\n" + patches["0001-first.patch"]
    )
    series = write_series(tmp_path, patches)
    before = snapshot(site)

    proc = run_apply(site, "--series", series, "--check")

    assert_refused(
        proc,
        "0001-first.patch applies only after 0002-second.patch, which series lists after it",
        "fix: list 0002-second.patch before 0001-first.patch",
    )
    assert snapshot(site) == before


def test_refuses_a_prerequisite_in_both_fields(site: Path, tmp_path: Path) -> None:
    patches = good_patches(tmp_path)
    patches["0002-second.patch"] = (
        "Depends: 0001-first.patch\nApplies-After: 0001-first.patch\n\n"
        + patches["0002-second.patch"]
    )
    series = write_series(tmp_path, patches)

    assert_refused(
        run_apply(site, "--series", series),
        "0002-second.patch: 0001-first.patch is in both Depends and Applies-After",
        "fix: keep it in Depends only",
    )
