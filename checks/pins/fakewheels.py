"""Tiny real wheels (zip + dist-info with a correct RECORD) for builder tests.

The real closure is ~4 GB of wheels; the builder's mechanics (seeding, pip
--require-hashes, stock copy, patching, smoke, publish) are the same on a
two-wheel closure, so tests build one here: a stand-in `vllm` 0.33.0 that
depends on `tinydep` and has the `vllm.models.qwen4_exp` module the smoke
step imports.
"""

import base64
import hashlib
import zipfile
from pathlib import Path

from pinkit import lockfile, meta


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(dest: Path, name: str, version: str, files: dict[str, str], requires=()) -> Path:
    """Write `{name}-{version}-py3-none-any.whl` holding `files` and return its path."""
    dist_info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    contents = dict(files)
    contents[f"{dist_info}/METADATA"] = metadata
    contents[f"{dist_info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: flashnext-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record_lines = [
        f"{path},{_record_hash(text.encode())},{len(text.encode())}"
        for path, text in sorted(contents.items())
    ]
    record_lines.append(f"{dist_info}/RECORD,,")
    contents[f"{dist_info}/RECORD"] = "\n".join(record_lines) + "\n"
    path = Path(dest) / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in sorted(contents.items()):
            info = zipfile.ZipInfo(member, date_time=(2020, 1, 1, 0, 0, 0))
            zf.writestr(info, text)
    return path


MODEL_INIT = "class Qwen4ExpForCausalLM:\n    patched = False\n"
VLLM_INIT = """import sys

import tinydep

__version__ = "0.33.0"


def main():
    from vllm.models.qwen4_exp import Qwen4ExpForCausalLM

    print(sys.prefix, Qwen4ExpForCausalLM.patched)
"""


def make_closure(seed_dir: Path) -> list[Path]:
    """The stand-in vllm 0.33.0 and its one dependency, as wheels in `seed_dir`."""
    seed_dir.mkdir(parents=True, exist_ok=True)
    vllm = make_wheel(
        seed_dir,
        "vllm",
        "0.33.0",
        {
            "vllm/__init__.py": VLLM_INIT,
            "vllm/models/__init__.py": "",
            "vllm/models/qwen4_exp/__init__.py": MODEL_INIT,
            "vllm-0.33.0.dist-info/entry_points.txt": "[console_scripts]\nvllm = vllm:main\n",
        },
        requires=["tinydep>=1"],
    )
    tinydep = make_wheel(seed_dir, "tinydep", "1.0", {"tinydep/__init__.py": "VALUE = 1\n"})
    return [vllm, tinydep]


def write_pins(pins_dir: Path, wheels: list[Path], python: str) -> Path:
    """A pins dir (lock + vllm.toml) locking `wheels` for CPython `python`."""
    pins_dir.mkdir(parents=True, exist_ok=True)
    pins = []
    for wheel in wheels:
        name, version = wheel.name.split("-")[:2]
        via = ("vllm",) if name != "vllm" else ()
        pins.append(lockfile.Pin(name, version, (meta.file_sha256(wheel),), via))
    tag = "cp" + python.replace(".", "")
    lock_name = f"requirements-{tag}.txt"
    text = lockfile.render(pins, ["test lock", "Regenerate: pins/lock"])
    (pins_dir / lock_name).write_text(text)
    vllm_pin = next(p for p in pins if p.name == "vllm")
    pins_meta = meta.Meta(
        vllm_version="0.33.0",
        vllm_wheel=wheels[0].name,
        vllm_sha256=vllm_pin.sha256[0],
        torch_version="0",
        glibc="2.31",
        locks=(
            meta.LockEntry(python, lock_name, hashlib.sha256(text.encode()).hexdigest(), len(pins)),
        ),
    )
    (pins_dir / meta.FILE_NAME).write_text(meta.render(pins_meta))
    return pins_dir / lock_name


APPLY_SCRIPT = """#!/usr/bin/env bash
# Test stand-in for patches/apply: applies each patch in the series with GNU
# patch (which writes a new file and renames it over the old one).
set -euo pipefail
site="$1"
dir="$(dirname "$0")/vllm-0.33.0"
while read -r p; do
  [[ -z "$p" || "$p" == \\#* ]] && continue
  patch -p1 --forward --fuzz=0 --no-backup-if-mismatch -d "$site" -i "$dir/$p" >&2
done < "$dir/series"
"""

PATCH = """--- a/vllm/models/qwen4_exp/__init__.py
+++ b/vllm/models/qwen4_exp/__init__.py
@@ -1,2 +1,2 @@
 class Qwen4ExpForCausalLM:
-    patched = False
+    patched = True
"""


def write_patches(patches_dir: Path, apply_script: str = APPLY_SCRIPT) -> Path:
    series_dir = patches_dir / "vllm-0.33.0"
    series_dir.mkdir(parents=True, exist_ok=True)
    (series_dir / "0001-mark-patched.patch").write_text(PATCH)
    (series_dir / "series").write_text("# test series\n0001-mark-patched.patch\n")
    apply = patches_dir / "apply"
    apply.write_text(apply_script)
    apply.chmod(0o755)
    return patches_dir
