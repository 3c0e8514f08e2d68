"""vLLM 0.33.0's scheme resolution, emulated: which config group each module gets.

CompressedTensorsConfig resolves a module by its ignore list first, then the first
target in scheme-map order that equals or `re.match`es the name, then a target
contained in the module's class name; it does so under vLLM's runtime names, which
rename plain `ignore` entries but never `re:` targets.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Checkpoint-name prefix → vLLM 0.33.0 runtime prefix (Qwen3VLForConditionalGeneration's
# hf_to_vllm_mapper, which Qwen4ExpForConditionalGeneration inherits). vLLM maps plain
# names in `ignore` with it but leaves `re:` targets alone, so our patterns spell both.
VLLM_PREFIXES: dict[str, str] = {
    "model.language_model.": "language_model.model.",
    "lm_head.": "language_model.lm_head.",
    "model.visual.": "visual.",
}


def vllm_name(name: str) -> str:
    """A checkpoint module name as vLLM 0.33.0 names the module at runtime."""
    dotted = name + "."
    for old, new in VLLM_PREFIXES.items():
        if dotted.startswith(old):
            return (new + dotted[len(old) :])[:-1]
    return name


def _class_name(name: str) -> str:
    # The class vLLM builds for the module: experts fuse into RoutedExperts, the rest
    # are *ParallelLinear; only the substring test against a target uses it.
    return "RoutedExperts" if re.search(r"\.experts\.\d+\.", name) else "ColumnParallelLinear"


@dataclass
class SchemeMap:
    """vLLM's target_scheme_map: target -> group name, later groups overwriting earlier."""

    targets: dict[str, str]
    ignore: list[str]
    duplicates: dict[str, list[str]]
    """Targets listed by more than one group: target -> groups, in order."""

    @classmethod
    def from_config(cls, qcfg: Mapping[str, Any]) -> SchemeMap:
        targets: dict[str, str] = {}
        listed: dict[str, list[str]] = defaultdict(list)
        for group_name, group in (qcfg.get("config_groups") or {}).items():
            for target in group.get("targets") or []:
                targets[target] = group_name  # dict keeps the first position, last value
                listed[target].append(group_name)
        if "Linear" in targets and "RoutedExperts" not in targets:
            # compressed_tensors.py _add_fused_moe_to_target_scheme_map
            targets["RoutedExperts"] = targets["Linear"]
        dups = {t: gs for t, gs in listed.items() if len(gs) > 1}
        return cls(targets, list(qcfg.get("ignore") or []), dups)

    def __post_init__(self) -> None:
        # Precompiled once: `check` resolves ~110k modules twice on the full checkpoint.
        self._ignore_exact = {
            False: {p for p in self.ignore if not p.startswith("re:")},
            True: {vllm_name(p) if "." in p else p for p in self.ignore if not p.startswith("re:")},
        }
        self._ignore_re = [re.compile(p[3:]) for p in self.ignore if p.startswith("re:")]
        # compressed_tensors/utils.py is_equal_or_regex_match: re.match (anchored at the
        # start only) for "re:" targets, equality otherwise.
        self._targets = [
            (re.compile(t[3:]) if t.startswith("re:") else t, g) for t, g in self.targets.items()
        ]

    def ignored(self, name: str, runtime: bool) -> bool:
        # vLLM maps plain ignore entries to its names (apply_vllm_mapper), never `re:` ones.
        return name in self._ignore_exact[runtime] or any(r.match(name) for r in self._ignore_re)

    def resolve(self, name: str, runtime: bool, by_class: bool = True) -> str | None:
        """Group whose scheme vLLM gives module `name`, or None (unquantized)."""
        if self.ignored(name, runtime):
            return None
        for target, group in self._targets:
            if target == name if isinstance(target, str) else target.match(name):
                return group
        if by_class:
            cls_name = _class_name(name).lower()
            for target, group in self.targets.items():
                if not target.startswith("re:") and target.lower() in cls_name:
                    return group
        return None

    def name_matches(self, name: str) -> list[str]:
        """Every group with a target matching `name` by name (not class)."""
        return sorted({
            g for t, g in self._targets if (t == name if isinstance(t, str) else t.match(name))
        })  # fmt: skip
