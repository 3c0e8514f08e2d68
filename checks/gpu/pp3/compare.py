"""Compare two engines' layer captures token by token (capture.py's files).

    python checks/gpu/pp3/compare.py REF_OUT.json OTHER_OUT.json [--json FILE]

For every case both engines ran, every capture point both hold (a rank's
files are merged: PP=3 spreads the layers over three files, PP=1 holds them
in one), the rows are matched by token key (position, input id); keys seen
twice in either engine are dropped (a collision of random prompts, or a
padded row). Per point: max and mean relative difference,
|a - b| / mean|a| over the row, and the first position where any row parts.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

POINT_ORDER = ("ple", "gdn", "qsa", "moe", "out")


def load_case(out_json: Path, case: str) -> dict[str, tuple]:
    import torch

    merged: dict[str, tuple] = {}
    for path in sorted(out_json.parent.glob(f"{out_json.stem}.{case}.rank*.pt")):
        merged.update(torch.load(path))
    return merged


def _unique_rows(pos, ids, rows) -> dict[tuple[int, int], int]:
    seen: dict[tuple[int, int], int] = {}
    dup: set[tuple[int, int]] = set()
    for i, key in enumerate(zip(pos.tolist(), ids.tolist(), strict=True)):
        if key in seen:
            dup.add(key)
        seen[key] = i
    return {k: v for k, v in seen.items() if k not in dup}


def compare_point(a: tuple, b: tuple) -> dict[str, Any]:
    import torch

    ua, ub = _unique_rows(*a), _unique_rows(*b)
    keys = sorted(set(ua) & set(ub))
    if not keys:
        return {"tokens": 0, "only_ref": len(ua), "only_other": len(ub)}
    ra = a[2][torch.tensor([ua[k] for k in keys])]
    rb = b[2][torch.tensor([ub[k] for k in keys])]
    scale = ra.abs().mean(dim=1).clamp_min(1e-12)
    diff = (ra - rb).abs()
    rel_max = diff.max(dim=1).values / scale
    rel_mean = diff.mean(dim=1) / scale
    parted = (diff.max(dim=1).values > 0).nonzero()
    first = keys[int(parted[0])][0] if len(parted) else None
    return {
        "tokens": len(keys),
        "only_ref": len(ua) - len(keys),
        "only_other": len(ub) - len(keys),
        "max_rel": float(rel_max.max()),
        "mean_rel": float(rel_mean.mean()),
        "identical_frac": float((diff.max(dim=1).values == 0).float().mean()),
        "first_parting_position": first,
    }


def _order(name: str) -> tuple:
    m = re.match(r"layer\.(\d+)\.(\w+)", name)
    if not m:
        return (10**6, name)
    tag = m.group(2)
    return (int(m.group(1)), POINT_ORDER.index(tag) if tag in POINT_ORDER else 9)


def compare_runs(ref: Path, other: Path) -> dict[str, Any]:
    ra, rb = json.loads(ref.read_text()), json.loads(other.read_text())
    cases: dict[str, Any] = {}
    for case in ra.get("cases", {}):
        if case not in rb.get("cases", {}):
            continue
        ca, cb = load_case(ref, case), load_case(other, case)
        points = {
            name: compare_point(ca[name], cb[name])
            for name in sorted(set(ca) & set(cb), key=_order)
        }
        cases[case] = {
            "ids_equal": ra["cases"][case]["output_ids"] == rb["cases"][case]["output_ids"],
            "points": points,
            "missing": sorted(set(ca) ^ set(cb)),
        }
    return {"ref": ra["run"], "other": rb["run"], "cases": cases}


def render(result: dict[str, Any]) -> str:
    lines = [f"== {result['ref']} vs {result['other']}"]
    for case, entry in result["cases"].items():
        lines.append(f"  {case}: ids equal {entry['ids_equal']}; missing {entry['missing']}")
        for name, s in entry["points"].items():
            if not s.get("tokens"):
                lines.append(f"    {name:18} no common tokens ({s})")
                continue
            lines.append(
                f"    {name:18} tokens {s['tokens']:6d} max_rel {s['max_rel']:.2e} "
                f"mean_rel {s['mean_rel']:.2e} identical {s['identical_frac']:.2f} "
                f"first_parting_pos {s['first_parting_position']}"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("ref", type=Path)
    parser.add_argument("other", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = compare_runs(args.ref, args.other)
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
