#!/usr/bin/env python3
"""A copy of the tiny checkpoint whose LM head can pick only a few tokens (issue 16).

    python checks/gpu/narrow_head.py SRC_DIR DST_DIR [--tokens 4096 12288]

The MTP equality run needs a drafter that is right part of the time: a
random MTP layer over a 32,768-token head agrees with the target almost never,
so every draft would be rejected and the accepted path (with the state kept
past a draft) would never run. Training the tiny drafter needs the target's
forward, which only runs on a GPU.

Instead the copy keeps the LM head rows of `--tokens` and zeroes every other
row. The target and the drafter share that head (vLLM's eagle loader gives
the drafter the target's lm_head), so both choose among the kept tokens and
token 0: a zero row's logit is exactly 0, and when every kept logit is
negative greedy argmax takes the first of the exact ties, token 0, the same
way in every pass. The drafter's choice then matches the target's a fair
part of the time, by chance, with nothing else of either model changed:
attention, PLE, the experts and the MTP layer all still decide which of the
few tokens wins. Two kept tokens leave three outcomes per position.

Only the head's bytes change: the shard holding lm_head.weight is copied and
the dropped rows' bytes zeroed in place (any dtype: a zero row is zero
bytes), the header and every other file copied as they are. DST_DIR is
written beside itself and renamed into place when complete, so a failed run
leaves nothing half-written. Imports: the standard library and the
launcher's safetensors header reader (launcher/src).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launcher" / "src"))

from flashnext.facts.safetensors import (  # noqa: E402
    SafetensorsError,
    read_safetensors_header,
)

HEAD = "lm_head.weight"
INDEX = "model.safetensors.index.json"
DEFAULT_TOKENS = (4096, 12288)
RECORD = "narrow_head.json"


class NarrowHeadError(Exception):
    """The source cannot be narrowed (said how to fix it)."""


def head_shard(src: Path) -> str:
    index = src / INDEX
    if not index.is_file():
        raise NarrowHeadError(f"{index} is missing: SRC_DIR must be a sharded checkpoint")
    weight_map = json.loads(index.read_text()).get("weight_map", {})
    if HEAD not in weight_map:
        raise NarrowHeadError(
            f"{src} has no {HEAD} (tied embeddings?): the head cannot be narrowed "
            "without narrowing the input embedding too"
        )
    return weight_map[HEAD]


def narrow(src: Path, dst: Path, tokens: tuple[int, ...]) -> Path:
    if dst.exists():
        raise NarrowHeadError(f"{dst} exists: remove it or pick another DST_DIR")
    shard = head_shard(src)
    try:
        _, _, tensors = read_safetensors_header(src / shard)
    except SafetensorsError as exc:
        raise NarrowHeadError(str(exc)) from exc
    head = next(t for t in tensors if t.name == HEAD)
    rows = head.shape[0]
    bad = [t for t in tokens if not 0 < t < rows]
    if not tokens or bad:
        raise NarrowHeadError(
            f"--tokens {bad or '(none)'}: give ids in 1..{rows - 1} "
            "(0 is the tie token every zero row leads to)"
        )
    row_bytes = head.nbytes // rows
    kept = set(tokens)

    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        for path in src.iterdir():
            if path.is_file():
                shutil.copy2(path, staging / path.name)
        zero = bytes(row_bytes)
        with (staging / shard).open("r+b") as f:
            for row in range(rows):
                if row not in kept:
                    f.seek(head.offset_bytes + row * row_bytes)
                    f.write(zero)
        record = {"source": str(src), "kept_tokens": sorted(kept), "tie_token": 0}
        (staging / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        staging.rename(dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("src_dir", type=Path)
    parser.add_argument("dst_dir", type=Path, help="new directory")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    args = parser.parse_args(argv)
    try:
        path = narrow(args.src_dir, args.dst_dir, tuple(args.tokens))
    except (NarrowHeadError, OSError) as exc:
        print(f"narrow_head: {exc}", file=sys.stderr)
        return 1
    print(f"{path}: LM head keeps tokens {sorted(args.tokens)}, every other row zero")
    return 0


if __name__ == "__main__":
    sys.exit(main())
