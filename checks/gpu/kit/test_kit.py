"""checks/gpu/kit: the carry rule on the real lock, parts round trip, overlay contents.

CPU only, no network, a few seconds. The assemble script runs as a subprocess,
the way it runs on the GPU machine.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

KIT = Path(__file__).resolve().parent
REPO = KIT.parents[2]
VERSION_PY = '__version__ = version = "0.33.0"\n'
CUTLASS_PTH = (
    "import sys, os, nvidia_cutlass_dsl; sys.path.insert(0, "
    "os.path.join(nvidia_cutlass_dsl.__path__[0], 'dsl_packages'))"
)


def _load(name: str, path: Path):
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    loader.exec_module(module)
    return module


build = _load("kit_build", KIT / "build")
apply_mod = _load("patches_apply", REPO / "patches" / "apply")


# --------------------------------------------------------------------------- carry rule


def test_carry_rule_on_the_real_lock_keeps_what_vllm_imports_and_drops_the_host_stack():
    pins, _ = build.load_lock()
    sel = build.select(pins, build.load_rules())
    carried = {p.name for p in sel.carried}
    for name in [
        "transformers",
        "huggingface-hub",
        "tokenizers",
        "pydantic",
        "pydantic-core",
        "flashinfer-python",
        "apache-tvm-ffi",
        "nvidia-cutlass-dsl",
        "nvidia-cutlass-dsl-libs-base",
        "nvidia-cutlass-dsl-libs-core",
        "nvidia-cutlass-dsl-libs-cu13",
        "quack-kernels",
        "torch-c-dlpack-ext",
        "compressed-tensors",
        "msgspec",
        "pyzmq",
        "fastapi",
        "starlette",
        "uvicorn",
        "openai",
        "mistral-common",
        "xgrammar",
        "llguidance",
    ]:
        assert name in carried, name
    for name in [
        "torch",
        "triton",
        "torchvision",
        "torchaudio",
        "numpy",
        "numba",
        "nvidia-cublas",
        "nvidia-cudnn-cu13",
        "nvidia-nccl-cu13",
        "nvidia-cuda-runtime",
        "nvidia-cutlass-dsl-libs-cu12",
        "cuda-bindings",
        "tokenspeed-triton",
        "tilelang",
        "opencv-python-headless",
        "sympy",  # only torch needs it: dropped as an orphan
    ]:
        assert name in sel.dropped, name
    assert {n for n in carried if n.startswith("nvidia-")} == {
        "nvidia-cutlass-dsl",
        "nvidia-cutlass-dsl-libs-base",
        "nvidia-cutlass-dsl-libs-core",
        "nvidia-cutlass-dsl-libs-cu13",
    }
    # vllm is packed on its own; every other pin is either carried or dropped
    assert "vllm" not in carried and "vllm" not in sel.dropped
    assert carried | set(sel.dropped) | {"vllm"} == {p.name for p in pins}
    # a carried package's requirers are carried, vllm, or dropped with a reason
    for pin in sel.carried:
        assert pin.via, pin.name
        assert any(v in carried or v == "vllm" for v in pin.via), pin.name


def test_carry_rule_must_carry_names_are_all_carried():
    rules = build.load_rules()
    pins, _ = build.load_lock()
    carried = {p.name for p in build.select(pins, rules).carried}
    assert set(rules.must_carry) <= carried
    with (KIT / "carry.toml").open("rb") as f:
        raw = tomllib.load(f)
    assert raw["vllm"]["drop_files"] == list(rules.vllm_drop_files)
    assert "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" not in rules.vllm_drop_files


def _pin(name, via=("vllm",)):
    return build.lockfile.Pin(name, "1.0", ("0" * 64,), tuple(via))


def test_carry_rule_refuses_dropping_a_must_carry_package_and_stale_names():
    pins = [_pin("vllm", ()), _pin("torch"), _pin("transformers"), _pin("sympy", ("torch",))]
    rules = build.Rules(
        must_carry=("transformers",),
        keep=(),
        drops=(("host", ("torch", "trans*")),),
        vllm_drop_files=(),
    )
    with pytest.raises(build.KitError, match="transformers is in must_carry but dropped"):
        build.select(pins, rules)
    stale = build.Rules((), (), (("gone", ("no-such-*",)),), ())
    with pytest.raises(build.KitError, match="'no-such-\\*' names nothing"):
        build.select(pins, stale)
    ok = build.select(pins, build.Rules((), (), (("host", ("torch",)),), ()))
    assert [p.name for p in ok.carried] == ["transformers"]
    assert ok.dropped["sympy"].startswith("only required by dropped packages: torch")


def test_pth_paths_are_read_like_site_py_would():
    paths, other = build.parse_pth(CUTLASS_PTH + "\n# comment\nextra_dir/\n")
    assert paths == ["nvidia_cutlass_dsl/dsl_packages", "extra_dir"]
    assert other == []
    _, other = build.parse_pth("import _distutils_hack; _distutils_hack.add_shim()\n")
    assert other == ["import _distutils_hack; _distutils_hack.add_shim()"]


# --------------------------------------------------------------------------- vllm tar


def _zip(path: Path, members: dict[str, bytes], exec_names=()) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
            info.external_attr = (0o100755 if name in exec_names else 0o100644) << 16
            zf.writestr(info, data)
    return path


def test_vllm_tree_drops_the_named_binaries_and_tars_reproducibly(tmp_path):
    wheel = _zip(
        tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        {
            "vllm/_version.py": VERSION_PY.encode(),
            "vllm/_C.abi3.so": b"\x7fELF keep",
            "vllm/vllm-rs": b"\x7fELF drop",
            "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"drop",
            "vllm/bin_tool": b"#!/bin/sh\n",
            "vllm-0.33.0.dist-info/METADATA": b"Name: vllm\nVersion: 0.33.0\n",
        },
        exec_names={"vllm/bin_tool"},
    )
    drop = ("vllm/vllm-rs", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so")
    tree = tmp_path / "tree"
    dropped = build.extract_wheel_tree(wheel, tree, drop, "0.33.0")
    assert dropped == len(b"\x7fELF drop") + len(b"drop")
    files = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())
    assert files == [
        "vllm-0.33.0.dist-info/METADATA",
        "vllm/_C.abi3.so",
        "vllm/_version.py",
        "vllm/bin_tool",
    ]
    assert os.access(tree / "vllm" / "bin_tool", os.X_OK)
    with pytest.raises(build.KitError, match="has no vllm/not-there"):
        build.extract_wheel_tree(wheel, tmp_path / "t2", ("vllm/not-there",), "0.33.0")

    if shutil.which("xz") is None:
        pytest.skip("xz is not installed")
    one, two = tmp_path / "one.tar.xz", tmp_path / "two.tar.xz"
    build.write_tar_xz(tree, one, level=0)
    os.utime(tree / "vllm" / "_version.py", (1, 1))  # mtimes must not matter
    build.write_tar_xz(tree, two, level=0)
    assert one.read_bytes() == two.read_bytes()
    with tarfile.open(one) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names)
    assert {m.mtime for m in members} == {build.FIXED_MTIME}
    assert {(m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, "", "")}
    assert next(m for m in members if m.name == "vllm/bin_tool").mode == 0o755


# --------------------------------------------------------------------------- overlay


def _stock(root: Path) -> Path:
    files = {
        "vllm/__init__.py": "from vllm._version import __version__\n",
        "vllm/_version.py": VERSION_PY,
        "vllm/a.py": "A = 1\n",
        "vllm/b.py": "B = 1\n",
        "vllm/sub/c.py": "C = 1\n",
        "vllm-0.33.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _series(root: Path, stock: Path, patches: dict[str, str]) -> Path:
    """A series dir named like the real one, with its pristine.sha256."""
    series_dir = root / "vllm-0.33.0"
    series_dir.mkdir(parents=True)
    (series_dir / "series").write_text("".join(f"{n}\n" for n in patches))
    modified = set()
    for name, diff in patches.items():
        (series_dir / name).write_text(diff)
        modified |= set(apply_mod.parse_patch(series_dir / name).modifies)
    lines = [f"{hashlib.sha256((stock / rel).read_bytes()).hexdigest()}  {rel}" for rel in modified]
    (series_dir / "pristine.sha256").write_text("\n".join(sorted(lines)) + "\n")
    return series_dir / "series"


PATCH_A = """--- a/vllm/a.py
+++ b/vllm/a.py
@@ -1 +1 @@
-A = 1
+A = 2
--- /dev/null
+++ b/vllm/sub/new.py
@@ -0,0 +1 @@
+NEW = True
"""
PATCH_B = """--- a/vllm/b.py
+++ b/vllm/b.py
@@ -1 +1 @@
-B = 1
+B = 2
"""


needs_patch = pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch missing")


@pytest.fixture(scope="module")
def overlays(tmp_path_factory):
    """Two overlays made by make_overlay (the real patches/apply) from a fake series."""
    if shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed (patches/apply needs it)")
    root = tmp_path_factory.mktemp("overlay")
    stock = _stock(root / "stock")
    out = {}
    for tag, patches in {"A": {"0001-a.patch": PATCH_A}, "B": {"0001-b.patch": PATCH_B}}.items():
        series = _series(root / f"series-{tag}", stock, patches)
        out[tag] = root / f"overlay-{tag}.tar"
        out[f"{tag}-index"] = build.make_overlay(stock, out[tag], "f" * 64, series)
    out["stock"] = stock
    return out


def test_overlay_holds_exactly_the_changed_and_created_files(overlays):
    index = overlays["A-index"]
    assert index["changed"] == ["vllm/a.py"]
    assert index["created"] == ["vllm/_flashnext_patches.json", "vllm/sub/new.py"]
    with tarfile.open(overlays["A"]) as tar:
        names = sorted(tar.getnames())
        assert tar.extractfile("vllm/a.py").read() == b"A = 2\n"
    assert names == sorted([build.OVERLAY_INDEX, *index["files"]])
    # the stock tree it was made from is untouched (apply renamed, never wrote through)
    assert (overlays["stock"] / "vllm" / "a.py").read_text() == "A = 1\n"
    assert not (overlays["stock"] / "vllm" / "_flashnext_patches.json").exists()


def _pristine_vllm_wheel() -> Path | None:
    info = build.meta.load(REPO / "pins")
    cache = build.cache_root()
    for path in [cache / "gpu-kit" / "vllm" / info.vllm_wheel] + [
        d / info.vllm_wheel for d in build.seed_dirs()
    ]:
        if path.is_file():
            return path
    return None


@needs_patch
def test_overlay_of_the_real_series_is_exactly_its_files(tmp_path):
    """The real patches/apply and series on the stock files they touch (from the wheel)."""
    wheel = _pristine_vllm_wheel()
    if wheel is None:
        pytest.skip("no vllm 0.33.0 wheel cached (pins/build-env or build vllm fetches it)")
    _, patches = apply_mod.load(apply_mod.DEFAULT_SERIES)
    modifies = {rel for p in patches for rel in p.modifies}
    creates = {rel for p in patches for rel in p.creates}
    stock = tmp_path / "stock"
    with zipfile.ZipFile(wheel) as zf:
        for rel in sorted(modifies | {"vllm/_version.py"}):
            (stock / rel).parent.mkdir(parents=True, exist_ok=True)
            (stock / rel).write_bytes(zf.read(rel))
    before = {rel: (stock / rel).read_bytes() for rel in modifies}
    index = build.make_overlay(stock, tmp_path / "overlay.tar", "e" * 64)
    assert set(index["changed"]) == modifies
    assert set(index["created"]) == creates | {"vllm/_flashnext_patches.json"}
    assert index["patches"] == [p.name for p in patches]
    with tarfile.open(tmp_path / "overlay.tar") as tar:
        for rel in modifies:
            assert tar.extractfile(rel).read() != before[rel], rel
    assert {rel: (stock / rel).read_bytes() for rel in modifies} == before


# --------------------------------------------------------------------------- parts + assemble


@pytest.fixture
def kit_inputs(tmp_path, overlays):
    """Synthetic artifacts split into small parts, with a manifest like `build parts`."""
    art = tmp_path / "art"
    art.mkdir()
    vllm_tar = art / "vllm-0.33.0.tar.xz"
    build.write_tar(vllm_tar, build.tree_entries(overlays["stock"]), mode="w:xz")
    alpha = _zip(
        art / "alpha-1.0-py3-none-any.whl",
        {
            "alpha/__init__.py": b"X = 'alpha'\n",
            "alpha/tool": b"#!/bin/sh\necho hi\n",
            "alpha-1.0.data/purelib/alpha_extra.py": b"EXTRA = 1\n",
            "alpha-1.0.data/scripts/alpha-cli": b"#!python\n",
            "alpha-1.0.dist-info/METADATA": b"Name: alpha\nVersion: 1.0\n",
        },
        exec_names={"alpha/tool"},
    )
    dsl = _zip(
        art / "nvidia_cutlass_dsl-1.0-py3-none-any.whl",
        {
            "nvidia_cutlass_dsl_packages.pth": CUTLASS_PTH.encode(),
            "nvidia_cutlass_dsl/dsl_packages/cutl/__init__.py": b"OK = 1\n",
            "nvidia_cutlass_dsl-1.0.dist-info/METADATA": b"Name: nvidia-cutlass-dsl\n",
        },
    )
    wheels_tar = art / "wheels.tar"
    build.write_tar(wheels_tar, [(w.name, w) for w in (alpha, dsl)])
    parts_dir = tmp_path / "parts"
    parts, artifacts = build.split([vllm_tar, wheels_tar], parts_dir, part_max=1500)
    wheels_state = {
        "lock": {"file": "x", "sha256": "0" * 64},
        "carry_rule": {"file": "y", "sha256": "0" * 64},
        "pth_paths": build.parse_pth(CUTLASS_PTH)[0],
        "wheels": [
            {
                "name": n,
                "version": "1.0",
                "file": w.name,
                "sha256": build.sha256_file(w),
                "size": w.stat().st_size,
            }
            for n, w in (("alpha", alpha), ("nvidia-cutlass-dsl", dsl))
        ],
        "not_carried": [{"name": "numpy", "version": "2.3.5", "why": "host"}],
    }
    vllm_state = {
        "version": "0.33.0",
        "wheel": "vllm.whl",
        "dropped_files": {},
        "unpacked_bytes": 1,
        "key": {"wheel_sha256": "f" * 64},
    }
    manifest = build.build_manifest(parts, artifacts, wheels_state, vllm_state, 1500)
    manifest_path = tmp_path / "manifest.json"
    manifest_path.write_text(json.dumps(manifest))
    return {
        "manifest": manifest,
        "manifest_path": manifest_path,
        "parts": parts_dir,
        "kit": tmp_path / "kit",
        "tmp": tmp_path,
        **overlays,
    }


def _assemble(inputs, *extra, overlay="A", parts=None):
    argv = [
        sys.executable,
        str(KIT / "assemble"),
        "--manifest",
        str(inputs["manifest_path"]),
        "--parts",
        str(parts or inputs["parts"]),
        "--kit",
        str(inputs["kit"]),
        "--overlay",
        str(inputs.get(overlay, overlay)),
        *extra,
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def _env_of(script: Path) -> dict[str, str]:
    out = subprocess.run(
        ["bash", "-c", f". {script} && env -0"], capture_output=True, check=True
    ).stdout.decode()
    return dict(line.split("=", 1) for line in out.split("\0") if "=" in line)


def test_split_spans_parts_and_artifacts(kit_inputs):
    m = kit_inputs["manifest"]
    assert len(m["parts"]) >= 3
    assert all(p["size"] <= 1500 for p in m["parts"])
    assert sum(p["size"] for p in m["parts"]) == sum(a["size"] for a in m["artifacts"])
    vllm_art, wheels_art = m["artifacts"]
    assert (vllm_art["kind"], wheels_art["kind"]) == ("vllm", "wheels")
    assert wheels_art["offset"] == vllm_art["size"]
    stream = b"".join((kit_inputs["parts"] / p["name"]).read_bytes() for p in m["parts"])
    art = kit_inputs["tmp"] / "art"
    assert stream == (art / "vllm-0.33.0.tar.xz").read_bytes() + (art / "wheels.tar").read_bytes()
    calls = build.carry_calls(m["parts"])
    assert len(calls) == len(m["parts"])
    assert all(f".gpu/{p['name']}" in c for p, c in zip(m["parts"], calls, strict=True))
    assert ".gpu/overlay.tar" in calls[-1] and "assemble" in calls[-1]


def _nothing_installed(kit: Path) -> None:
    left = sorted(p.name for p in kit.iterdir()) if kit.exists() else []
    assert left == [], left


def test_assemble_refuses_a_corrupt_part_naming_it(kit_inputs):
    part = kit_inputs["parts"] / "part02"
    data = bytearray(part.read_bytes())
    data[10] ^= 0xFF
    part.write_bytes(bytes(data))
    proc = _assemble(kit_inputs)
    assert proc.returncode == 1
    assert "part02 is corrupt" in proc.stderr
    assert "part01" not in proc.stderr.split("parts refused")[1].split("fix:")[0]
    _nothing_installed(kit_inputs["kit"])


def test_assemble_refuses_missing_parts_naming_each(kit_inputs):
    (kit_inputs["parts"] / "part01").unlink()
    (kit_inputs["parts"] / "part03").unlink()
    proc = _assemble(kit_inputs)
    assert proc.returncode == 1
    assert "part01 is missing" in proc.stderr and "part03 is missing" in proc.stderr
    _nothing_installed(kit_inputs["kit"])


def test_assemble_installs_stock_patched_and_env_then_refreshes_only_the_overlay(kit_inputs):
    kit = kit_inputs["kit"]
    proc = _assemble(kit_inputs)
    assert proc.returncode == 0, proc.stderr
    # wheels: unpacked like pip would, .data/purelib to the top, exec bits kept
    site = kit / "site"
    assert (site / "alpha" / "__init__.py").read_text() == "X = 'alpha'\n"
    assert (site / "alpha_extra.py").is_file()
    assert not (site / "alpha-1.0.data").exists()
    assert os.access(site / "alpha" / "tool", os.X_OK)
    assert (site / "nvidia_cutlass_dsl" / "dsl_packages" / "cutl" / "__init__.py").is_file()
    # stock as packed; patched = stock + overlay, unchanged files are hard links of stock
    stock, patched = kit / "stock", kit / "patched"
    assert (stock / "vllm" / "a.py").read_text() == "A = 1\n"
    assert (patched / "vllm" / "a.py").read_text() == "A = 2\n"
    assert (patched / "vllm" / "sub" / "new.py").is_file()
    assert not (stock / "vllm" / "sub" / "new.py").exists()
    assert os.path.samefile(patched / "vllm" / "b.py", stock / "vllm" / "b.py")
    assert not os.path.samefile(patched / "vllm" / "a.py", stock / "vllm" / "a.py")

    env = _env_of(kit / "env-patched.sh")
    assert env["PYTHONPATH"].split(":") == [
        str(patched),
        str(site),
        str(site / "nvidia_cutlass_dsl" / "dsl_packages"),
    ]
    assert env["PATH"].split(":")[0] == str(kit / "bin")
    for key, value in {
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }.items():
        assert env[key] == value, key
    assert _env_of(kit / "env-stock.sh")["PYTHONPATH"].split(":")[0] == str(stock)
    code = (
        "import importlib.metadata as m, vllm.a, alpha, alpha_extra, cutl;"
        "print(vllm.a.A, m.version('vllm'), cutl.OK)"
    )
    for tree, want in (("patched", "2 0.33.0 1"), ("stock", "1 0.33.0 1")):
        run_env = {**os.environ, **_env_of(kit / f"env-{tree}.sh")}
        out = subprocess.run(
            [sys.executable, "-c", code], env=run_env, capture_output=True, text=True, check=True
        )
        assert out.stdout.split() == want.split(), tree

    # second call, no parts left: base kept as is (not re-extracted), overlay B replaces A
    stock_inode = (stock / "vllm" / "a.py").stat().st_ino
    pyc = patched / "vllm" / "__pycache__" / "a.cpython-311.pyc"
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(b"stale")
    shutil.rmtree(kit_inputs["parts"])
    proc = _assemble(kit_inputs, "--overlay-only", overlay="B")
    assert proc.returncode == 0, proc.stderr
    assert "is current" in proc.stderr
    assert (stock / "vllm" / "a.py").stat().st_ino == stock_inode
    assert os.path.samefile(patched / "vllm" / "a.py", stock / "vllm" / "a.py")
    assert not (patched / "vllm" / "sub" / "new.py").exists()
    assert not pyc.exists()
    assert (patched / "vllm" / "b.py").read_text() == "B = 2\n"
    assert (stock / "vllm" / "b.py").read_text() == "B = 1\n"
    state = json.loads((kit / "patched-state.json").read_text())
    assert state["files"] == sorted(kit_inputs["B-index"]["files"])
    # the same overlay again is a no-op
    proc = _assemble(kit_inputs, overlay="B")
    assert proc.returncode == 0 and "overlay unchanged" in proc.stderr


def test_assemble_overlay_only_needs_a_base_and_a_matching_overlay(kit_inputs):
    proc = _assemble(kit_inputs, "--overlay-only")
    assert proc.returncode == 1 and "holds no base" in proc.stderr
    _nothing_installed(kit_inputs["kit"])
    other = kit_inputs["tmp"] / "other.tar"
    stock = _stock(kit_inputs["tmp"] / "other-stock")
    series = _series(kit_inputs["tmp"] / "other-series", stock, {"0001-b.patch": PATCH_B})
    build.make_overlay(stock, other, "0" * 64, series)
    assert _assemble(kit_inputs).returncode == 0
    assert (kit_inputs["kit"] / "env-patched.sh").is_file()
    proc = _assemble(kit_inputs, overlay=str(other))
    assert proc.returncode == 1 and "was built for vllm wheel 000000000000" in proc.stderr
    assert not (kit_inputs["kit"] / "env-patched.sh").exists()
    assert (kit_inputs["kit"] / "env-stock.sh").is_file()


def test_the_vllm_wrapper_runs_main_only_as_the_main_module(kit_inputs, tmp_path):
    """vLLM spawns its engine core, and spawn re-imports the main module: an
    unguarded wrapper starts a second CLI there and the engine dies (seen on
    the H200). Imported, the wrapper must do nothing; run, it calls main()."""
    assert _assemble(kit_inputs).returncode == 0
    wrapper = kit_inputs["kit"] / "bin" / "vllm"
    fake = tmp_path / "fake" / "vllm" / "entrypoints" / "cli"
    fake.mkdir(parents=True)
    for pkg in (fake.parents[1], fake.parent, fake):
        (pkg / "__init__.py").write_text("")
    (fake / "main.py").write_text("def main():\n    print('main called')\n    return 3\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake")}
    imported = subprocess.run(
        [sys.executable, "-c", f"import runpy; runpy.run_path({str(wrapper)!r}, run_name='x')"],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert imported.returncode == 0 and "main called" not in imported.stdout
    ran = subprocess.run(
        [sys.executable, str(wrapper)], env=env, capture_output=True, text=True, check=False
    )
    assert ran.returncode == 3 and "main called" in ran.stdout


# --------------------------------------------------------------------------- one call's room


def test_a_part_fits_one_device_call_beside_the_tracked_tree():
    """The device tool refuses a call over 64 MiB, the tree counted: the
    committed part size must leave room for the tree and the overlay."""
    tree = build.tracked_bytes()
    assert 1_000_000 < tree < build.CALL_MAX  # the real tree, read through git
    build.check_call_room(build.PART_MAX)  # today's tree: fits
    with pytest.raises(build.KitError, match="lower PART_MAX"):
        build.check_call_room(build.CALL_MAX - tree + 1)
