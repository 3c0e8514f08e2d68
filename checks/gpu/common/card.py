"""Which card ran: GPU 0's name and memory as nvidia-smi reports them, for every
result JSON the GPU harnesses write (stdlib only: the host's python3).

A call for the lent H200 may be served by an H100 (.library/device KINDS.md), so
a result says which card it came from, and a rule that needs more memory than
one of them has says so by name (`refusal`) instead of failing somewhere inside
vLLM.

    python3 checks/gpu/common/card.py      (prints the card as JSON)
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

QUERY = ["nvidia-smi", "--query-gpu=name,memory.total,memory.free",
         "--format=csv,noheader,nounits", "--id=0"]  # fmt: skip
MIB = 1 << 20


def parse(line: str) -> dict[str, Any]:
    """One line of QUERY's output ("NVIDIA H200, 143771, 143161": MiB) as the record."""
    name, total, free = (part.strip() for part in line.strip().split(","))
    return {
        "name": name,
        "memory_total_bytes": int(total) * MIB,
        "memory_free_bytes": int(free) * MIB,  # when the harness asked
        "source": "nvidia-smi " + " ".join(QUERY[1:]),
    }


def card() -> dict[str, Any]:
    """GPU 0 now; where nvidia-smi cannot say, the same keys with None and why."""
    try:
        said = subprocess.run(QUERY, capture_output=True, text=True, timeout=60)
        if said.returncode == 0 and said.stdout.strip():
            return parse(said.stdout.splitlines()[0])
        why = f"exit {said.returncode}: {(said.stderr or said.stdout).strip()[:200]}"
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        why = str(exc)
    return {"name": None, "memory_total_bytes": None, "memory_free_bytes": None,
            "source": f"unavailable ({why})"}  # fmt: skip


def refusal(found: dict[str, Any], need_free_bytes: int, what: str) -> str | None:
    """Why `what` cannot run on the card `found` (None: it can, or nothing is known)."""
    free = found.get("memory_free_bytes")
    if free is None or free >= need_free_bytes:
        return None
    return (
        f"{what} needs {need_free_bytes / 2**30:.1f} GiB free on one card; this "
        f"{found['name']} has {free / 2**30:.1f} GiB free of "
        f"{found['memory_total_bytes'] / 2**30:.1f}: free the card, or run on a larger one "
        "(the device call's kind nvidia-h200 with needs_h200)"
    )


if __name__ == "__main__":
    print(json.dumps(card(), indent=1))
    sys.exit(0)
