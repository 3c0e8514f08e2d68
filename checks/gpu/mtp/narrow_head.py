#!/usr/bin/env python3
"""A copy of the tiny checkpoint whose LM head picks among three tokens (issue 16).

    python checks/gpu/mtp/narrow_head.py SRC_DIR DST_DIR [--tokens 4096 12288] [--balance 20480]

The MTP equality run needs a drafter that is right part of the time: a
random MTP layer over a 32,768-token head agrees with the target almost never,
so every draft would be rejected and the accepted path (with the state kept
past a draft) would never run. Training the tiny drafter needs the target's
forward, which only runs on a GPU.

Instead the copy keeps the LM head rows of `--tokens`, sets the row of the
`--balance` token to minus their sum, and zeroes every other row. Whatever
the hidden state, the kept and balance logits sum to zero, so their largest
is above zero and above every zeroed row's exact 0: greedy picks one of the
three, and each engine's top-k lists them first with distinct logits, so a
near tie between two of them is told from a wrong token by vLLM's rule. The
target and the drafter share that head (vLLM's eagle loader gives the
drafter the target's lm_head), so the drafter's choice matches the
target's a fair part of the time, by chance, with nothing else of either
model changed: attention, PLE, the experts and the MTP layer all still
decide which of the three wins.

Measured on the H200 (checks/gpu/RESULTS.md, "MTP on"): zeroed rows alone
(run mtp1) gave acceptance 0.51 at K=1, mostly through the exact-zero tie
token, whose ties then filled every top-k list; shrinking the other rows
instead (mtp2, mtp3) left the drafter right 2-3% of the time. The balance
row keeps mtp1's three-way choice without the ties.

Only the head's bytes change: the shard holding lm_head.weight is copied and
the head rewritten in place (BF16, F16 or F32), the header and every other
file copied as they are. DST_DIR is written beside itself and renamed into
place when complete, so a failed run leaves nothing half-written. Imports:
the standard library, numpy and the launcher's safetensors header reader
(launcher/src).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tiny"))

from checkpoint_copy import CheckpointEditError, edited_copy  # noqa: E402

HEAD = "lm_head.weight"
DEFAULT_TOKENS = (4096, 12288)
DEFAULT_BALANCE = 20480
RECORD = "narrow_head.json"


def narrow(src: Path, dst: Path, tokens: tuple[int, ...], balance: int = DEFAULT_BALANCE) -> Path:
    def edit(reader):
        if HEAD not in reader:
            raise CheckpointEditError(
                f"{src} has no {HEAD} (tied embeddings?): the head cannot be narrowed "
                "without narrowing the input embedding too"
            )
        head = reader.read(HEAD)
        rows = head.shape[0]
        bad = [t for t in (*tokens, balance) if not 0 <= t < rows]
        if not tokens or bad or balance in tokens or len(set(tokens)) != len(tokens):
            raise CheckpointEditError(
                f"--tokens {list(tokens)} --balance {balance}: give distinct ids in 0..{rows - 1}"
            )
        kept = sorted(tokens)
        narrowed = np.zeros_like(head)
        narrowed[kept] = head[kept]
        narrowed[balance] = -head[kept].sum(axis=0)
        return {HEAD: narrowed}

    record = {"source": str(src), "kept_tokens": sorted(tokens), "balance_token": balance}
    return edited_copy(src, dst, edit, RECORD, record)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("src_dir", type=Path)
    parser.add_argument("dst_dir", type=Path, help="new directory")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    parser.add_argument("--balance", type=int, default=DEFAULT_BALANCE)
    args = parser.parse_args(argv)
    try:
        path = narrow(args.src_dir, args.dst_dir, tuple(args.tokens), args.balance)
    except (CheckpointEditError, OSError) as exc:
        print(f"narrow_head: {exc}", file=sys.stderr)
        return 1
    print(
        f"{path}: LM head rows {sorted(args.tokens)} kept, {args.balance} = minus their sum, "
        "every other row zero"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
