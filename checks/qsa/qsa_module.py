#!/usr/bin/env python3
"""Get the QSA offload kernel module out of its patch (the single source).

The module that patch 0021 adds to vLLM imports only torch and triton, so the
CPU proofs and the GPU scripts test it without vLLM. They must test the text
the patch ships, never a second copy: this reads the new-file hunk back out.

    python checks/qsa/qsa_module.py extract DEST_DIR   # writes DEST_DIR/qsa_offload.py
    python checks/qsa/qsa_module.py make-patch SRC     # rewrites the patch from SRC
                                                       # (keeps its DEP-3 header)
Only the Python standard library.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
PATCH = REPO / "patches" / "vllm-0.33.0" / "0021-qsa-offload-kernels.patch"
TARGET = "vllm/models/qwen4_exp/nvidia/ops/qsa_offload.py"
_HUNK_RE = re.compile(r"^@@ -0,0 \+1(?:,(\d+))? @@")


class PatchError(ValueError):
    """The patch does not hold the module as one clean new-file hunk."""


def extract_new_file(patch_text: str, target: str = TARGET) -> str:
    """Return the contents of ``target`` created by a new-file hunk in the patch."""
    lines = patch_text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.rstrip("\n") != f"+++ b/{target}":
            continue
        if i == 0 or not lines[i - 1].startswith("--- /dev/null"):
            raise PatchError(f"{target} is not created from /dev/null in the patch")
        match = _HUNK_RE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if not match:
            raise PatchError(f"{target}: expected '@@ -0,0 +1,N @@' after its header")
        count = int(match.group(1) or 1)
        body = lines[i + 2 : i + 2 + count]
        if len(body) != count or any(not ln.startswith("+") for ln in body):
            raise PatchError(f"{target}: hunk is shorter than its header says ({count} lines)")
        text = "".join(ln[1:] for ln in body)
        following = lines[i + 2 + count] if i + 2 + count < len(lines) else ""
        if following.startswith("\\ No newline"):
            text = text.rstrip("\n")
        return text
    raise PatchError(f"the patch creates no {target}")


def module_text(patch: Path = PATCH) -> str:
    return extract_new_file(patch.read_text())


def load_offload_module(patch: Path = PATCH) -> ModuleType:
    """Import the module as shipped in the patch (written to a private temp dir)."""
    tmp = Path(tempfile.mkdtemp(prefix="qsa_offload_"))
    path = tmp / "qsa_offload.py"
    path.write_text(module_text(patch))
    spec = importlib.util.spec_from_file_location("qsa_offload", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["qsa_offload"] = module
    spec.loader.exec_module(module)
    return module


def make_patch(src: Path, patch: Path = PATCH) -> None:
    """Rewrite the patch's new-file hunk from ``src``; the header is kept."""
    text = src.read_text()
    if not text.endswith("\n"):
        raise PatchError(f"{src} must end with a newline")
    header = patch.read_text().split("--- /dev/null", 1)[0] if patch.exists() else ""
    body = text.splitlines(keepends=True)
    hunk = "".join("+" + ln for ln in body)
    out = f"{header}--- /dev/null\n+++ b/{TARGET}\n@@ -0,0 +1,{len(body)} @@\n{hunk}"
    tmp = patch.with_suffix(".tmp")
    tmp.write_text(out)
    os.replace(tmp, patch)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("extract", "make-patch"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        if argv[0] == "extract":
            dest = Path(argv[1])
            dest.mkdir(parents=True, exist_ok=True)
            (dest / "qsa_offload.py").write_text(module_text())
            print(dest / "qsa_offload.py")
        else:
            make_patch(Path(argv[1]))
            print(PATCH)
    except (OSError, PatchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
