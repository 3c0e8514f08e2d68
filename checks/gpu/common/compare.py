"""Compare two engines' layer captures token by token (capture.py's files).

    python checks/gpu/common/compare.py REF_OUT.json OTHER_OUT.json [--json FILE]

For every case both engines ran, every capture point both hold (a rank's
files are merged: PP=3 spreads the layers over three files, PP=1 holds them
in one), the rows are matched by token key (position, input id); keys seen
twice in either engine are dropped (a collision of random prompts, or a
padded row), and so are generated rows that follow another history in each
engine (another request's, or the same request's after another sampled
token: `history`). Per point: max and mean relative difference,
|a - b| / mean|a| over the row, and the first position where any row parts.

The verdict (`judge`) holds each point to bf16 rounding on its clean rows:
those before the first position where the layer's input (the previous
layer's materialized output) parts, and for the MoE and the layer's output
also before the layer's mixer (GDN or QSA) or MoE parts, so a point is
judged only where both engines fed it the same tokens; what a parting does
downstream is not judged again. Where a spread is given (two runs of the
reference engine), a point's rows from the position where the reference parts from itself on
may differ up to SPREAD_MARGIN times that spread: past the QSA indexer's
budget the selection is tie-sensitive, and the reference disagrees with
itself. Rows before it are held to rounding.

What parts two engines where the inputs are the same (e1's unexplained
partings, RESULTS.md "What parts them, explained"): per case, `schedule`
says where the two engines first ran a row in another prefill chunk or
another step size (capture.py's `#steps`), `autotune` which Triton
autotuners chose another config, `kinds` splits every point's rows into
prompt, decode and MTP draft rows (a verify row by its own `#spec` offset)
and names each kind's worst row with where each engine ran it, and `cause`
names the first of these that comes at or before the first parting. None
of it changes a verdict.
"""

from __future__ import annotations

import argparse
import json
import re
from itertools import zip_longest
from pathlib import Path
from typing import Any

# The capture's record names, from the capture itself (stdlib-only at import):
# fingerprints of rows left out, per-row steps, per-verify-row GDN metadata.
from capture import FINGERPRINT, SPEC, SPEC_FIELDS, STEPS

POINT_ORDER = ("in", "mix", "mix_fused", "block_input", "ple", "gdn", "qsa", "moe", "out")
# The points within a layer whose output the layer's later points take in.
INSIDE_INPUTS = ("gdn", "qsa", "moe")

# Per row: |a - b| / mean|a|. bf16 keeps 8 significant bits, so one ulp is
# 2^-8 to 2^-7 of a value: a row whose every element is one ulp off has a
# mean difference of at most 2^-7 (e3: an offloaded QSA's output, another
# accumulation order, came to 0.0033-0.0044, over the 2^-8 this was until
# e3). A row mean above 2^-7, or its largest element off by 16 ulps of the
# row's mean magnitude, is not rounding.
BF16_ROW_MEAN = 2.0**-7
BF16_ROW_MAX = 2.0**-4
SPREAD_MARGIN = 2.0


def load_case(out_json: Path, case: str) -> dict[str, tuple]:
    """The ranks' captures merged; each rank's `#steps` also kept under
    `#steps@RANK` (the merged `#steps` is the last rank's)."""
    import torch

    merged: dict[str, tuple] = {}
    for path in sorted(out_json.parent.glob(f"{out_json.stem}.{case}.rank*.pt")):
        points = torch.load(path)
        merged.update(points)
        if STEPS in points:
            rank = int(re.search(r"\.rank(\d+)\.pt$", path.name).group(1))
            merged[f"{STEPS}@{rank}"] = points[STEPS]
    return merged


def rank_agreement(case: dict[str, tuple]) -> dict[str, Any]:
    """Whether every rank ran the same rows (position, input id) in each
    step, from the ranks' `#steps` side by side. A PP rank that embeds or
    labels a row with another id than the first rank's (a draft token taken
    from another step) makes that row part from PP=1 on some ranks only;
    this says so without a reference. One rank (PP=1): not recorded."""
    by_rank = {
        int(name.rsplit("@", 1)[1]): steps
        for name, steps in case.items()
        if name.startswith(f"{STEPS}@")
    }
    if len(by_rank) < 2:
        return {"recorded": False, "ranks": len(by_rank)}

    def rows_per_step(steps) -> dict[int, list[tuple[int, int]]]:
        out: dict[int, list[tuple[int, int]]] = {}
        for p, i, info in zip(*(t.tolist() for t in steps), strict=True):
            out.setdefault(info[0], []).append((p, i))
        return out

    first_rank = min(by_rank)
    base = rows_per_step(by_rank[first_rank])
    steps_differ, rows_differ, first = 0, 0, None
    for rank in sorted(by_rank)[1:]:
        other = rows_per_step(by_rank[rank])
        for step in sorted(set(base) | set(other)):
            bad = [
                (x, y) for x, y in zip_longest(base.get(step, []), other.get(step, [])) if x != y
            ]
            if bad:
                steps_differ += 1
                rows_differ += len(bad)
                if first is None:
                    x, y = bad[0]
                    # (position, id) of that row on the first rank and on this one
                    first = {"step": step, "rank": rank, "first_rank_row": x and list(x),
                             "rank_row": y and list(y)}  # fmt: skip
    return {
        "recorded": True,
        "ranks": len(by_rank),
        "steps": len(base),
        "steps_differ": steps_differ,
        "rows_differ": rows_differ,
        "first": first,
    }


def _unique_rows(pos, ids, rows) -> dict[tuple[int, int], int]:
    seen: dict[tuple[int, int], int] = {}
    dup: set[tuple[int, int]] = set()
    for i, key in enumerate(zip(pos.tolist(), ids.tolist(), strict=True)):
        if key in seen:
            dup.add(key)
        seen[key] = i
    return {k: v for k, v in seen.items() if k not in dup}


def spec_fields(spec: tuple | None) -> dict[tuple[int, int], dict[str, int]]:
    """Per verify-row key, its GDN metadata (`#spec`) by field name."""
    if spec is None:
        return {}
    rows = spec[2].tolist()
    return {
        key: dict(zip(SPEC_FIELDS, rows[i], strict=True))
        for key, i in _unique_rows(spec[0], spec[1], spec[2]).items()
    }


def spec_difference(a: tuple | None, b: tuple | None) -> dict[str, Any]:
    """MTP verify rows both engines ran (keyed by position and id): how many
    ran under other GDN metadata, the first such key and which fields. Equal
    metadata with a parting output row points at the kernel or its buffers;
    other metadata at how the step was built."""
    if a is None or b is None:
        return {"recorded": False}
    fa, fb = spec_fields(a), spec_fields(b)
    keys = sorted(set(fa) & set(fb))
    differ = [key for key in keys if fa[key] != fb[key]]
    fields = {f for key in differ for f in SPEC_FIELDS if fa[key][f] != fb[key][f]}
    return {
        "recorded": True,
        "rows": len(keys),
        "differ": len(differ),
        "first": list(differ[0]) if differ else None,
        "fields": sorted(fields),
    }


def row_contexts(steps: tuple | None) -> dict[tuple[int, int], tuple[int, int, int]]:
    """Per token key, the context a step ran it in: (first position of its
    run of consecutive positions in that step, i.e. its prefill chunk or its
    verify pair, the run's length, the step's token count). Keys seen twice
    (a recomputed or padded row) are left out."""
    if steps is None:
        return {}
    pos, ids, info = (t.tolist() for t in steps)
    contexts: dict[tuple[int, int], tuple[int, int, int]] = {}
    dup: set[tuple[int, int]] = set()
    i = 0
    while i < len(pos):
        j = i + 1
        while j < len(pos) and info[j][0] == info[i][0] and pos[j] == pos[j - 1] + 1:
            j += 1
        for r in range(i, j):
            key = (pos[r], ids[r])
            if key in contexts:
                dup.add(key)
            contexts[key] = (pos[i], j - i, info[i][1])
        i = j
    return {k: v for k, v in contexts.items() if k not in dup}


def moved_rows(a: tuple | None, b: tuple | None) -> set[tuple[int, int]]:
    """Keys both engines ran, each in another context (row_contexts): in
    another prefill chunk or beside other rows, where a recurrent GDN layer
    rounds the same tokens differently (RESULTS.md, "What parts them")."""
    ca, cb = row_contexts(a), row_contexts(b)
    return {key for key in set(ca) & set(cb) if ca[key] != cb[key]}


def _sequence_heads(steps: tuple, spec: tuple | None) -> dict[tuple[int, int], tuple[int, int]]:
    """Per token key, the key of its sequence's first row in its step: the
    row `offset` rows before it by its own `#spec` (a sequence's rows are
    contiguous in a step), else the row itself (a prompt or decode row; runs
    of positions would join two requests whose positions follow on). Keys
    seen twice are left out."""
    offsets = {key: f["offset"] for key, f in spec_fields(spec).items()}
    pos, ids = steps[0].tolist(), steps[1].tolist()
    heads: dict[tuple[int, int], tuple[int, int]] = {}
    dup: set[tuple[int, int]] = set()
    for i, key in enumerate(zip(pos, ids, strict=True)):
        if key in heads:
            dup.add(key)
        head = max(i - offsets.get(key, 0), 0)
        heads[key] = (pos[head], ids[head])
    return {k: v for k, v in heads.items() if k not in dup}


def row_histories(
    steps: tuple | None, outputs: list[list[int]], prompt_len: int, spec: tuple | None = None
) -> dict[tuple[int, int], tuple[int, tuple[int, ...]] | None]:
    """Per generated row key (position past the prompt): the request whose
    tokens it follows and its emitted tokens before the row's position,
    (request, ids). A GDN or attention row depends on its request's whole
    history, and two engines can run a row of the same (position, id) after
    different ones: once they sample different tokens at a near-tie (the
    rounding of another schedule flips it), the drafter can still propose
    the same id at the next position in both (e4, RESULTS.md). The request
    is the one whose emitted token heads the row's sequence in its step
    (_sequence_heads; output k is fed at prompt_len + k); None where no
    request or more than one fits."""
    if steps is None:
        return {}
    histories: dict[tuple[int, int], tuple[int, tuple[int, ...]] | None] = {}
    for key, (start, first_id) in _sequence_heads(steps, spec).items():
        if key[0] < prompt_len or start < prompt_len:
            continue
        k = start - prompt_len
        owners = [r for r, ids in enumerate(outputs) if k < len(ids) and ids[k] == first_id]
        histories[key] = (
            (owners[0], tuple(outputs[owners[0]][: key[0] - prompt_len]))
            if len(owners) == 1
            else None
        )
    return histories


def history_parting(
    ca: dict, out_a: list, cb: dict, out_b: list, prompt_len: int
) -> dict[str, Any]:
    """Generated rows both engines ran (same position and id) that follow
    another history in each (another request, or its tokens before the row
    differ): they are not the same computation, so they are not judged.
    `unknown`: rows whose request the record cannot name; still judged."""
    ha = row_histories(ca.get(STEPS), out_a, prompt_len, ca.get(SPEC))
    hb = row_histories(cb.get(STEPS), out_b, prompt_len, cb.get(SPEC))
    keys = sorted(set(ha) & set(hb))
    unknown = [k for k in keys if ha[k] is None or hb[k] is None]
    parted = [k for k in keys if k not in unknown and ha[k] != hb[k]]
    return {
        "recorded": STEPS in ca and STEPS in cb,
        "rows": len(keys),
        "parted": [list(k) for k in parted],
        "unknown": len(unknown),
    }


def row_kinds(
    steps: tuple | None, prompt_len: int, spec: tuple | None = None
) -> dict[tuple[int, int], str]:
    """Per token key: `prompt` (position < prompt_len), `decode` (the token
    the last step sampled) or `draft` (an MTP verify step's drafted
    position). A verify row's own metadata (`#spec`: its offset in its
    sequence) decides where recorded; else the row's run of consecutive
    positions in its step does (its first row decodes), which two requests
    whose positions happen to follow on in one step would join."""
    offsets = {key: f["offset"] for key, f in spec_fields(spec).items()}
    kinds = {}
    for key, (start, _, _) in row_contexts(steps).items():
        if key[0] < prompt_len:
            kinds[key] = "prompt"
        elif key in offsets:
            kinds[key] = "decode" if offsets[key] == 0 else "draft"
        else:
            kinds[key] = "decode" if key[0] == start else "draft"
    return kinds


def schedule_parting(a: tuple | None, b: tuple | None) -> dict[str, Any]:
    """Where two engines first ran a token (both hold) in another context:
    another chunk start, chunk length or step size."""
    if a is None or b is None:
        return {"recorded": False}
    ca, cb = row_contexts(a), row_contexts(b)
    both = set(ca) & set(cb)
    moved = sorted(k[0] for k in both if ca[k] != cb[k])
    return {
        "recorded": True,
        "tokens": len(both),
        "other_context": len(moved),
        "first_context_parting": moved[0] if moved else None,
    }


def autotune_difference(a: list | None, b: list | None) -> dict[str, Any]:
    """The autotuners (capture.dump's `autotune`, merged over ranks) whose
    chosen config differs for a key both engines tuned."""

    def merged(dumps):
        out: dict[str, dict[str, str]] = {}
        for d in dumps or []:
            for kernel, choices in (d or {}).get("autotune", {}).items():
                out.setdefault(kernel, {}).update(choices)
        return out

    ma, mb = merged(a), merged(b)
    if not ma or not mb:
        return {"recorded": False}
    differ = sorted(
        k for k in set(ma) & set(mb) if any(ma[k][x] != mb[k][x] for x in set(ma[k]) & set(mb[k]))
    )
    return {"recorded": True, "kernels": len(set(ma) & set(mb)), "differ": differ}


def first_parting(points: dict[str, dict]) -> tuple[str, int] | None:
    """The first point, in layer order, that parts where its input has not
    parted (clean_before: None or later), and the position."""
    for name, s in points.items():
        first = s.get("first_parting_position")
        if first is None:
            continue
        before = s.get("clean_before")
        if before is None or first < before:
            return name, first
    return None


def parting_cause(
    points: dict[str, dict], schedule: dict[str, Any], autotune: dict[str, Any]
) -> dict[str, Any] | None:
    """Why the first parting on an identical input happened, as far as the
    record tells: `schedule` (the row, or one before it, ran in another chunk
    or step), else `autotune` (a Triton autotuner chose another config),
    else `spread` (at or past where the reference parts from itself at this
    point: QSA's tie-sensitive selection past the indexer budget), else
    `unexplained`; None when nothing parts."""
    found = first_parting(points)
    if found is None:
        return None
    name, at = found
    moved = schedule.get("first_context_parting")
    if moved is not None and moved <= at:
        cause = "schedule"
    elif autotune.get("differ"):
        cause = "autotune"
    elif (loose := points[name].get("loose_from")) is not None and loose <= at:
        cause = "spread"
    elif not schedule.get("recorded") or not autotune.get("recorded"):
        cause = "not recorded"
    else:
        cause = "unexplained"
    return {"point": name, "position": at, "cause": cause}


def first_fingerprint_parting(a: tuple | None, b: tuple | None) -> int | None:
    """The first position whose row fingerprints differ (rows both engines hold)."""
    if a is None or b is None:
        return None
    ua, ub = _unique_rows(*a), _unique_rows(*b)
    parted = [k[0] for k in set(ua) & set(ub) if int(a[2][ua[k]][0]) != int(b[2][ub[k]][0])]
    return min(parted) if parted else None


def compare_point(
    a: tuple,
    b: tuple,
    clean_before: int | None = None,
    loose_from: int | None = None,
    kinds: dict[tuple[int, int], str] | None = None,
    other_history: set[tuple[int, int]] | frozenset = frozenset(),
    moved: set[tuple[int, int]] | frozenset = frozenset(),
) -> dict[str, Any]:
    """a, b: (positions, ids, rows). clean_before: rows at this position or
    later are not judged (their input already parted). loose_from: judged
    rows at this position or later are reported apart (loose_*), held to the
    reference's spread rather than to rounding. other_history: keys whose
    rows follow another history in each engine (history_parting): left out.
    moved: keys each engine ran in another context (run or step size);
    judged rows among them before loose_from are reported apart (moved_*),
    held to the reference's spread over another chunking (judge)."""
    import torch

    ua, ub = _unique_rows(*a), _unique_rows(*b)
    both = set(ua) & set(ub)
    keys = sorted(both - set(other_history))
    if not keys:
        return {"tokens": 0, "only_ref": len(ua) - len(both), "only_other": len(ub) - len(both),
                "other_history": len(both)}  # fmt: skip
    ra = a[2][torch.tensor([ua[k] for k in keys])]
    rb = b[2][torch.tensor([ub[k] for k in keys])]
    # A NaN row (capture's poison_gdn_out: a row no kernel wrote) is counted
    # apart: NaN fails every `>` and a max over it is NaN, so it would pass
    # the judge and spoil the statistics of the rows that were written.
    nan_a, nan_b = ra.isnan().any(dim=1), rb.isnan().any(dim=1)
    nan_parted = nan_a != nan_b
    ra, rb = ra.masked_fill(ra.isnan(), 0.0), rb.masked_fill(rb.isnan(), 0.0)
    scale = ra.abs().mean(dim=1).clamp_min(1e-12)
    diff = (ra - rb).abs()
    diff[nan_a | nan_b] = 0.0
    rel_max = diff.max(dim=1).values / scale
    rel_mean = diff.mean(dim=1) / scale
    parted = (diff.max(dim=1).values > 0) | nan_parted
    positions = torch.tensor([k[0] for k in keys])

    def first_parting(rows) -> int | None:
        """The first position among these rows that parts (tensor ops: a
        Python loop over a long case's rows cost the GPU host seconds)."""
        at = positions[parted & rows]
        return int(at.min()) if len(at) else None

    every, none = torch.ones(len(keys), dtype=torch.bool), torch.zeros(len(keys), dtype=torch.bool)
    clean = every if clean_before is None else positions < clean_before
    loose = none if loose_from is None else positions >= loose_from
    elsewhere = torch.tensor([k in moved for k in keys])
    strict, shifted, loose = clean & ~loose & ~elsewhere, clean & ~loose & elsewhere, clean & loose
    first = first_parting(every)

    def worst(rel, rows) -> float:
        return float(rel[rows].max()) if bool(rows.any()) else 0.0

    by_kind: dict[str, Any] = {}
    for kind in sorted(set((kinds or {}).values())):
        rows = torch.tensor([(kinds or {}).get(k) == kind for k in keys])
        if bool(rows.any()):
            # The kind's worst row by name, so a run says which row it was
            # (compare_case adds where each engine ran it).
            top = int(torch.where(rows, rel_mean, -1.0).argmax())
            by_kind[kind] = {
                "tokens": int(rows.sum()),
                "max_rel": worst(rel_max, rows),
                "max_row_mean_rel": worst(rel_mean, rows),
                "first_parting_position": first_parting(rows),
                "nan_rows": {"ref": int(nan_a[rows].sum()), "other": int(nan_b[rows].sum())},
                # One row past rounding or all of them: a stray row or the kind's path.
                "rows_over_rounding": int((rel_mean[rows] > BF16_ROW_MEAN).sum()),
                "worst": {
                    "position": keys[top][0],
                    "id": keys[top][1],
                    "row_mean_rel": float(rel_mean[top]),
                    "row_max_rel": float(rel_max[top]),
                    # Its mean |value| against the kind's median: a row far
                    # smaller than its kind's makes rounding large relative to it.
                    "scale": float(scale[top]),
                    "kind_scale_median": float(scale[rows].median()),
                },
            }
    result = {
        "tokens": len(keys),
        "only_ref": len(ua) - len(both),
        "only_other": len(ub) - len(both),
        "other_history": len(both) - len(keys),
        "max_rel": float(rel_max.max()),
        "mean_rel": float(rel_mean.mean()),
        "max_row_mean_rel": float(rel_mean.max()),
        "identical_frac": float(((diff.max(dim=1).values == 0) & ~nan_parted).float().mean()),
        "nan_rows": {"ref": int(nan_a.sum()), "other": int(nan_b.sum())},
        # Judged rows NaN in one engine only: a row one engine never wrote.
        "clean_nan_rows": int((nan_parted & clean).sum()),
        "first_parting_position": first,
        "clean_before": clean_before,
        "clean_tokens": int(clean.sum()),
        "clean_row_max_rel": worst(rel_max, strict),
        "clean_row_mean_rel": worst(rel_mean, strict),
        "moved_tokens": int(shifted.sum()),
        "moved_row_max_rel": worst(rel_max, shifted),
        "moved_row_mean_rel": worst(rel_mean, shifted),
        "loose_from": loose_from,
        "loose_tokens": int(loose.sum()),
        "loose_row_max_rel": worst(rel_max, loose),
        "loose_row_mean_rel": worst(rel_mean, loose),
    }
    if by_kind:
        result["by_kind"] = by_kind
    return result


def _order(name: str) -> tuple:
    m = re.match(r"layer\.(\d+)\.(\w+)", name)
    if not m:
        return (10**6, name)
    tag = m.group(2)
    return (int(m.group(1)), POINT_ORDER.index(tag) if tag in POINT_ORDER else 9)


def _layer(name: str) -> int | None:
    m = re.match(r"layer\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def compare_case(
    ca: dict[str, tuple],
    cb: dict[str, tuple],
    spread: dict[str, dict] | None = None,
    prompt_len: int | None = None,
    other_history: set[tuple[int, int]] | frozenset = frozenset(),
) -> dict[str, dict]:
    """Every point both hold, in layer order; each judged on the rows before
    its input's first parting (the previous layer's `out`; `final` after the
    last layer's). Within a layer the MoE takes the mixer's (GDN or QSA)
    output and `out` the MoE's, so they are judged only before those part:
    an offloaded QSA's rounding (e1, e3's A/B) changes the MoE's router
    input, and a flipped expert is what routing does with it, not a fault of
    the MoE. spread: the reference's points against itself. other_history:
    generated rows that follow another history in each engine
    (history_parting), judged nowhere."""
    points: dict[str, dict] = {}
    # layer -> first parting of what the next layers get: its out, and at a
    # layer that starts a rank in one engine only, the block input it mixes.
    parted_at: dict[float, int | None] = {}
    # layer -> first partings of its mixer and MoE, the inputs of what follows.
    inside: dict[int, list[int]] = {}
    names = {n for n in set(ca) & set(cb) if "#" not in n}
    kinds = row_kinds(ca.get(STEPS), prompt_len, ca.get(SPEC)) if prompt_len is not None else None
    ran = _where_rows_ran(ca, cb)
    moved = moved_rows(ca.get(STEPS), cb.get(STEPS))
    for name in sorted(names | _block_inputs(ca, cb), key=_order):
        layer = _layer(name)
        inputs = [p for l_, p in parted_at.items() if layer is None or l_ < layer]
        tag = name.split(".")[-1]
        if tag in ("ple", "gdn", "qsa", "moe", "out"):
            inputs += [p for l_, p in parted_at.items() if l_ == layer + 0.5]
        if tag in ("moe", "out"):
            inputs += inside.get(layer, [])
        firsts = [p for p in inputs if p is not None]
        clean_before = min(firsts) if firsts else None
        loose_from = (spread or {}).get(name, {}).get("first_parting_position")
        a, b = _pair(name, ca, cb)
        points[name] = compare_point(a, b, clean_before, loose_from, kinds, other_history, moved)
        for entry in points[name].get("by_kind", {}).values():
            entry["worst"].update(ran((entry["worst"]["position"], entry["worst"]["id"])))
        # A long prompt's rows left out of the capture may part first.
        fa, fb = _pair(name, ca, cb, suffix=FINGERPRINT)
        unseen = first_fingerprint_parting(fa, fb)
        seen = points[name].get("first_parting_position")
        if unseen is not None and (seen is None or unseen < seen):
            points[name]["first_parting_position"] = unseen
            points[name]["first_parting_unkept"] = True
        first = points[name].get("first_parting_position")
        if tag in INSIDE_INPUTS and layer is not None and first is not None:
            inside.setdefault(layer, []).append(first)
        if name.endswith(".out") and layer is not None:
            parted_at[layer] = points[name].get("first_parting_position")
        if name.endswith(".block_input"):
            parted_at[layer + 0.5] = points[name].get("first_parting_position")
    return points


def _where_rows_ran(ca: dict, cb: dict):
    """A key -> where each engine ran that row: its run (first position,
    length, the step's token count; row_contexts) and, for a verify row,
    its GDN metadata (`#spec`); None where not recorded."""
    sides = {
        side: (row_contexts(c.get(STEPS)), spec_fields(c.get(SPEC)))
        for side, c in (("ref", ca), ("other", cb))
    }

    def ran(key: tuple[int, int]) -> dict[str, Any]:
        return {
            "context": {s: list(c[key]) if key in c else None for s, (c, _) in sides.items()},
            "spec": {s: f.get(key) for s, (_, f) in sides.items()},
        }

    return ran


def _block_inputs(ca: dict, cb: dict) -> set[str]:
    """`layer.N.block_input` where the reference fused its boundary path
    (mix_fused) and the other engine started a rank there (mix only)."""
    return {
        name.removesuffix(".mix_fused") + ".block_input"
        for name in ca
        if name.endswith(".mix_fused") and name not in cb and name.removesuffix("_fused") in cb
    }


def _pair(name: str, ca: dict, cb: dict, suffix: str = "") -> tuple:
    """The two captures a point compares: the reference's fused block input
    against the other's mix for `block_input`, else the same name (None
    where one engine lacks it, e.g. fingerprints of a short prompt)."""
    if name.endswith(".block_input"):
        stem = name.removesuffix(".block_input")
        return ca.get(f"{stem}.mix_fused{suffix}"), cb.get(f"{stem}.mix{suffix}")
    return ca.get(name + suffix), cb.get(name + suffix)


def _largest(cases: dict[str, Any], count: str, row_max: str, row_mean: str):
    """Per point, the largest (row max, row mean) over all cases of the
    rows `count` counts, times SPREAD_MARGIN."""
    bounds: dict[str, tuple[float, float]] = {}
    for entry in cases.values():
        for name, s in entry["points"].items():
            if not s.get(count):
                continue
            old = bounds.get(name, (0.0, 0.0))
            bounds[name] = (
                max(old[0], SPREAD_MARGIN * s[row_max]),
                max(old[1], SPREAD_MARGIN * s[row_mean]),
            )
    return bounds


def spread_bounds(spread_cases: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Per point, the reference's largest spread over all its cases (row max,
    row mean), times SPREAD_MARGIN: one run's spread is one draw of a
    tie-sensitive process, the cases together are the declared bound."""
    return _largest(spread_cases, "tokens", "max_rel", "max_row_mean_rel")


def schedule_bounds(spread_cases: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Per point, the reference against itself in other prefill chunks
    (orchestrate's `spread-schedule`): its largest moved rows (row max, row
    mean) over all cases, times SPREAD_MARGIN. Only rows whose input agreed
    count, so a layer downstream of a parting inherits no bound."""
    return _largest(spread_cases, "moved_tokens", "moved_row_max_rel", "moved_row_mean_rel")


def judge(
    points: dict[str, dict],
    bounds: dict[str, tuple[float, float]] | None = None,
    moved_bounds: dict[str, tuple[float, float]] | None = None,
) -> dict[str, Any]:
    """The first point over its bound, and the largest differences seen.
    bounds: spread_bounds() of the reference's spread, for the loose rows;
    moved_bounds: schedule_bounds(), for rows each engine ran in another
    chunk (rounding where none was measured)."""
    first_over = None
    for name, s in points.items():
        if not s.get("tokens"):
            continue
        spread_max, spread_mean = (bounds or {}).get(name, (0.0, 0.0))
        moved_max, moved_mean = (moved_bounds or {}).get(name, (0.0, 0.0))
        over = (
            s.get("clean_nan_rows", 0) > 0
            or s["clean_row_max_rel"] > BF16_ROW_MAX
            or s["clean_row_mean_rel"] > BF16_ROW_MEAN
            or s.get("moved_row_max_rel", 0.0) > max(BF16_ROW_MAX, moved_max)
            or s.get("moved_row_mean_rel", 0.0) > max(BF16_ROW_MEAN, moved_mean)
            or s["loose_row_max_rel"] > max(BF16_ROW_MAX, spread_max)
            or s["loose_row_mean_rel"] > max(BF16_ROW_MEAN, spread_mean)
        )
        if over and first_over is None:
            first_over = name
    judged = [s for s in points.values() if s.get("tokens")]
    return {
        "equal": first_over is None and bool(judged),
        "first_layer_over_bound": first_over,
        "layer_max_rel": max((s["max_rel"] for s in judged), default=None),
        "layer_mean_rel": max((s["mean_rel"] for s in judged), default=None),
    }


def boundary_paths(out_json: Path) -> dict[str, dict[str, Any]]:
    """Within one PP=1 engine, per case: at each layer that starts a PP=3 rank,
    the block input PP=1 computes (combine fused with the HC norm) against
    the one PP=3 computes from the materialized input (combine, then norm)."""
    record = json.loads(out_json.read_text())
    found: dict[str, dict[str, Any]] = {}
    for case in record.get("cases", {}):
        points = load_case(out_json, case)
        for name in sorted(points, key=_order):
            if name.endswith(".mix_fused"):
                split = name.removesuffix("_fused")
                if split in points:
                    result = compare_point(points[name], points[split])
                    unseen = first_fingerprint_parting(
                        points.get(name + FINGERPRINT), points.get(split + FINGERPRINT)
                    )
                    seen = result.get("first_parting_position")
                    if unseen is not None and (seen is None or unseen < seen):
                        result["first_parting_position"] = unseen
                    found.setdefault(case, {})[split] = result
    return found


def compare_runs(ref: Path, other: Path, spread: dict[str, Any] | None = None) -> dict[str, Any]:
    """spread: compare_runs of the reference against itself (its cases' points)."""
    ra, rb = json.loads(ref.read_text()), json.loads(other.read_text())
    cases: dict[str, Any] = {}
    for case in ra.get("cases", {}):
        if case not in rb.get("cases", {}):
            continue
        ca, cb = load_case(ref, case), load_case(other, case)
        outputs = ra["cases"][case]["output_ids"], rb["cases"][case]["output_ids"]
        prompt_len = _prompt_len(case)
        history = history_parting(ca, outputs[0], cb, outputs[1], prompt_len or 0)
        points = compare_case(
            ca,
            cb,
            (spread or {}).get("cases", {}).get(case, {}).get("points"),
            prompt_len,
            {tuple(k) for k in history["parted"]},
        )
        schedule = schedule_parting(ca.get(STEPS), cb.get(STEPS))
        autotune = autotune_difference(
            ra["cases"][case].get("capture"), rb["cases"][case].get("capture")
        )
        cases[case] = {
            "ids_equal": outputs[0] == outputs[1],
            "history": history,
            "points": points,
            "missing": sorted(n for n in set(ca) ^ set(cb) if "#" not in n),
            "schedule": schedule,
            "autotune": autotune,
            "spec": spec_difference(ca.get(SPEC), cb.get(SPEC)),
            "ranks_agree": {"ref": rank_agreement(ca), "other": rank_agreement(cb)},
            "cause": parting_cause(points, schedule, autotune),
        }
    return {"ref": ra["run"], "other": rb["run"], "cases": cases}


def _prompt_len(case: str) -> int | None:
    """`3000x4` -> 3000 (the harness's case names: prompt tokens x batch)."""
    m = re.fullmatch(r"(\d+)x\d+", case)
    return int(m.group(1)) if m else None


def echo_acceptance(ids: dict[str, list[list[int]]], spec_decode: dict | None) -> dict[str, Any]:
    """An echo drafter (checks/gpu/mtp/echo_drafter.py) drafts the token just
    sampled, so at K=1 a draft can be accepted only where the target repeats
    its previous token; each request verifies at most one draft per output
    token after the first. What an MTP engine's counters must satisfy."""
    rows = [r for seq in ids.values() for r in seq]
    repeats = sum(a == b for r in rows for a, b in zip(r, r[1:], strict=False))
    most = sum(max(len(r) - 1, 0) for r in rows)
    counts = spec_decode or {}
    drafts, accepted = counts.get("drafts"), counts.get("accepted_tokens")
    return {
        "drafts": drafts,
        "accepted": accepted,
        "drafts_at_most": most,
        "repeats": repeats,
        "can_accept": repeats > 0,
        "consistent": drafts is not None
        and accepted is not None
        and drafts <= most
        and accepted <= repeats,
    }


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
                f"first_parting_pos {s['first_parting_position']} "
                f"clean {s['clean_tokens']} row_max {s['clean_row_max_rel']:.2e} "
                f"row_mean {s['clean_row_mean_rel']:.2e}"
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
