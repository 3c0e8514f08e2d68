"""The `re:` targets `checkpoint fix` writes: anchored patterns that match exactly the
modules storing each scheme, spelled under both the checkpoint's and vLLM's names."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence

from flashnext.checkpoint.errors import CheckpointError
from flashnext.facts.scheme_map import VLLM_PREFIXES
from flashnext.facts.stored_schemes import Scheme, StoredModule

Part = str | frozenset  # a literal path component, r"\d+", or a set of literal alternatives


def _prefix_alternatives(name: str) -> tuple[str, str]:
    """(regex for the prefix in both spellings, rest of the name)."""
    dotted = name + "."
    for old, new in VLLM_PREFIXES.items():
        if dotted.startswith(old):
            alt = f"(?:{re.escape(old[:-1])}|{re.escape(new[:-1])})"
            return alt, dotted[len(old) : -1]
    return "", name


def _generalize(parts: tuple[str, ...], keep: frozenset[int]) -> tuple[Part, ...]:
    return tuple(p if (i in keep or not p.isdigit()) else r"\d+" for i, p in enumerate(parts))


def _partition(
    entries: list[tuple[str, tuple[str, ...], Scheme | None]], keep: frozenset[int] = frozenset()
) -> list[tuple[str, tuple[Part, ...], Scheme | None]]:
    """Group modules into templates with one scheme each, pinning numbers only where needed."""
    by_template: dict[tuple[str, tuple[Part, ...]], list] = defaultdict(list)
    for alt, parts, scheme in entries:
        by_template[(alt, _generalize(parts, keep))].append((alt, parts, scheme))
    out = []
    for (alt, template), members in by_template.items():
        kinds = {s for _, _, s in members}
        if len(kinds) == 1:
            out.append((alt, template, kinds.pop()))
            continue
        free = [i for i, p in enumerate(template) if p == r"\d+"]
        if not free:  # same name, different schemes: impossible for distinct modules
            raise CheckpointError(f"modules named like {members[0][1]} store different schemes")
        out.extend(_partition(members, keep | {free[0]}))
    return out


def _merge(templates: list[tuple[str, tuple[Part, ...]]]) -> list[tuple[str, tuple[Part, ...]]]:
    """Merge templates that differ in one literal component into an alternation."""
    items = list(dict.fromkeys(templates))
    changed = True
    while changed:
        changed = False
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                (ai, ti), (aj, tj) = items[i], items[j]
                if ai != aj or len(ti) != len(tj):
                    continue
                diff = [k for k in range(len(ti)) if ti[k] != tj[k]]
                if len(diff) != 1 or r"\d+" in (ti[diff[0]], tj[diff[0]]):
                    continue
                k = diff[0]
                a = ti[k] if isinstance(ti[k], frozenset) else frozenset([ti[k]])
                b = tj[k] if isinstance(tj[k], frozenset) else frozenset([tj[k]])
                items[i] = (ai, (*ti[:k], a | b, *ti[k + 1 :]))
                del items[j]
                changed = True
                break
            if changed:
                break
    return items


def _render(alt: str, template: tuple[Part, ...]) -> str:
    def part(p: Part) -> str:
        if isinstance(p, frozenset):
            return "(?:" + "|".join(re.escape(x) for x in sorted(p)) + ")"
        return p if p == r"\d+" else re.escape(p)

    body = r"\.".join(part(p) for p in template)
    if alt and body:
        return f"re:^{alt}\\.{body}$"
    return f"re:^{alt or body}$"


def explicit_targets(modules: Sequence[StoredModule]) -> dict[Scheme, list[str]]:
    """Scheme -> anchored `re:` targets matching exactly the modules that store it.

    `modules` are all modules vLLM will look up (ignored ones left out): quantized and
    plain alike, so a pattern can never cover a plain weight of the same name shape.
    Numbers (layer, expert) are generalized to `\\d+` unless that would mix schemes;
    then they are pinned, position by position.
    """
    entries = []
    for m in modules:
        alt, rest = _prefix_alternatives(m.name)
        entries.append((alt, tuple(rest.split(".")) if rest else (), m.scheme))
    by_scheme: dict[Scheme, list[tuple[str, tuple[Part, ...]]]] = defaultdict(list)
    for alt, template, scheme in _partition(entries):
        if scheme is not None:
            by_scheme[scheme].append((alt, template))
    return {s: sorted(_render(a, t) for a, t in _merge(ts)) for s, ts in by_scheme.items()}


def ple_ignore_pattern(ple_module: str) -> str:
    alt, rest = _prefix_alternatives(ple_module)
    body = re.escape(rest)
    # No "$": vLLM may ask for the table module or its shards; both are the table.
    return f"re:^{alt}\\.{body}" if alt else f"re:^{body}"
