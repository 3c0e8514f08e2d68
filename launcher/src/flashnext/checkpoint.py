"""Check and fix the checkpoint's quantization metadata against what its tensors hold.

The shipped export has two metadata defects (SPEC.md): every config group
targets ["Linear"], so vLLM's scheme map (keyed by target) keeps only the last
group and reads e.g. all INT4 experts as INT8 g128; and generation_config.json
lacks every sampling key vLLM reads. The weights themselves are right.

The ground truth here is the tensors: a pack-quantized Linear stores
`weight_packed` I32 [out, ceil(in x bits / 32)], `weight_scale` [out, in / group]
and `weight_shape` I64 [2] = (out, in). From those (headers plus the 16 bytes of
weight_shape) each module's stored scheme is exact. `check` resolves every
module the way vLLM 0.33.0's CompressedTensorsConfig does (ignore list first,
then the first target in scheme-map order that equals or `re.match`es the name,
then a target contained in the module's class name) under both the checkpoint's
names and vLLM's runtime names, and reports every disagreement. `fix` rewrites
each group's targets to anchored `re:` patterns that match exactly the modules
storing that group's scheme, adds the PLE table to `ignore`, and restores
sampling keys only from a source the user names.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import re
import struct
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashnext.atomic import write_text_atomic
from flashnext.checks.finding import Finding, Level
from flashnext.facts.model import CONFIG_FILE, GENERATION_CONFIG_FILE
from flashnext.facts.model_derived import (
    VLLM_SAMPLING_KEYS,
    sampling_keys_present,
    sampling_keys_restoring_nothing,
)
from flashnext.facts.schema import ModelFacts, TensorInfo

# Checkpoint-name prefix → vLLM 0.33.0 runtime prefix (Qwen3VLForConditionalGeneration's
# hf_to_vllm_mapper, which Qwen4ExpForConditionalGeneration inherits). vLLM maps plain
# names in `ignore` with it but leaves `re:` targets alone, so our patterns spell both.
VLLM_PREFIXES: dict[str, str] = {
    "model.language_model.": "language_model.model.",
    "lm_head.": "language_model.lm_head.",
    "model.visual.": "visual.",
}

# Keys restored into generation_config.json: what vLLM reads, plus do_sample which
# tells transformers to sample with them.
RESTORABLE_KEYS = (*VLLM_SAMPLING_KEYS, "do_sample")

BACKUP_SUFFIX = ".orig"
PLE_SHARD_MARK = ".ngram_embedding.shard_"
PACKED_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point")


class CheckpointError(Exception):
    """The checkpoint cannot be checked or fixed as asked; the message says why and how."""


# ---------------------------------------------------------------- schemes


@dataclass(frozen=True)
class Scheme:
    """Weight quantization of one Linear, as stored or as a config group declares it."""

    num_bits: int
    group_size: int | None
    """None: one scale per output channel (strategy "channel")."""
    symmetric: bool = True

    def label(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "per-channel"
        return f"INT{self.num_bits} {group}" + ("" if self.symmetric else " asym")


def scheme_of_group(group: Mapping[str, Any]) -> Scheme | None:
    """The Scheme a config group declares (None for anything but int weight-only)."""
    w = group.get("weights") or {}
    if w.get("type", "int") != "int" or w.get("num_bits") is None:
        return None
    size = w.get("group_size")
    group_size = int(size) if w.get("strategy") == "group" and size and size > 0 else None
    return Scheme(int(w["num_bits"]), group_size, bool(w.get("symmetric", True)))


def derive_scheme(
    packed: tuple[int, ...], scale: tuple[int, ...], in_features: int | None, symmetric: bool
) -> Scheme:
    """Bits and group size from packed/scale widths and the stored in_features.

    Raises CheckpointError when the shapes contradict each other.
    """
    if len(packed) != 2 or len(scale) != 2 or packed[0] != scale[0]:
        raise CheckpointError(f"packed {list(packed)} and scale {list(scale)} do not pair up")
    if not in_features:
        raise CheckpointError("weight_shape is missing or zero, so in_features is unknown")
    bits = [b for b in range(2, 9) if -(-in_features * b // 32) == packed[1]]
    if len(bits) != 1:
        raise CheckpointError(
            f"packed width {packed[1]} fits no single bit width for in_features {in_features}"
        )
    if in_features % scale[1]:
        raise CheckpointError(f"{scale[1]} scale columns do not divide in_features {in_features}")
    # One scale column is also what a per-channel scheme stores; `declares` accepts both.
    return Scheme(bits[0], in_features // scale[1], symmetric)


# ---------------------------------------------------------------- stored modules


@dataclass(frozen=True)
class StoredModule:
    name: str
    """Checkpoint module name (tensor name without .weight / .weight_packed ...)."""
    scheme: Scheme | None
    """What the tensors hold; None = unquantized (a plain 2-D weight)."""
    in_features: int | None = None


def declares(declared: Scheme | None, module: StoredModule) -> bool:
    """Whether a group's declared scheme is what `module` stores."""
    if declared is None or module.scheme is None:
        return declared is None and module.scheme is None
    if declared.group_size is None:  # per-channel: one scale per row
        return (declared.num_bits, declared.symmetric) == (
            module.scheme.num_bits,
            module.scheme.symmetric,
        ) and module.scheme.group_size == module.in_features
    return declared == module.scheme


def _read_i64_pair(
    model_dir: Path, tensor: TensorInfo, handles: dict[Path, Any]
) -> tuple[int, int] | None:
    """The two int64s a 16-byte tensor stores, at the offset its header gave (TensorInfo);
    None for another size, or for an inventory not read from files."""
    if tensor.nbytes != 16 or tensor.offset_bytes < 0:
        return None
    path, offset = model_dir / tensor.file, tensor.offset_bytes
    fh = handles.get(path)
    if fh is None:
        fh = handles[path] = open(path, "rb")  # noqa: SIM115 (closed by the caller)
    fh.seek(offset)
    data = fh.read(16)
    return struct.unpack("<qq", data) if len(data) == 16 else None


def stored_modules(
    model: ModelFacts, known_values: Mapping[str, Sequence[int]] | None = None
) -> tuple[list[StoredModule], list[str]]:
    """Every Linear-like module with its stored scheme, and the problems found on the way.

    `known_values` (tensor name -> values) gives weight_shape values without reading
    files: an inventory not read from disk (the skeleton's) has no offsets to read them at.
    """
    known = known_values or {}
    tensors = {t.name: t for t in model.tensors}
    problems: list[str] = []
    modules: list[StoredModule] = []
    packed_modules = sorted(
        n[: -len(".weight_packed")] for n in tensors if n.endswith(".weight_packed")
    )
    handles: dict[Path, Any] = {}
    try:
        for name in packed_modules:
            packed = tensors[f"{name}.weight_packed"]
            scale = tensors.get(f"{name}.weight_scale")
            shape_t = tensors.get(f"{name}.weight_shape")
            values = known.get(shape_t.name) if shape_t else None
            if values is not None:
                pair = (values[0], values[1]) if len(values) == 2 else None
            else:
                pair = _read_i64_pair(Path(model.path), shape_t, handles) if shape_t else None
            if scale is None:
                problems.append(f"{name}: weight_packed without weight_scale")
                continue
            in_features = pair[1] if pair and pair[0] == packed.shape[0] else None
            try:
                scheme = derive_scheme(
                    packed.shape,
                    scale.shape,
                    in_features,
                    symmetric=f"{name}.weight_zero_point" not in tensors,
                )
            except CheckpointError as exc:
                problems.append(f"{name}: {exc}")
                continue
            modules.append(StoredModule(name, scheme, in_features))
    finally:
        for fh in handles.values():
            fh.close()
    for t in model.tensors:
        if t.name.endswith(".weight") and len(t.shape) == 2:
            modules.append(StoredModule(t.name[: -len(".weight")], None))
    return modules, problems


def ple_table_modules(model: ModelFacts) -> list[str]:
    """Module names of the PLE n-gram tables (the part before `.shard_<i>.weight`)."""
    names = {t.name.split(PLE_SHARD_MARK)[0] + ".ngram_embedding" for t in model.tensors
             if PLE_SHARD_MARK in t.name}  # fmt: skip
    return sorted(names)


# ---------------------------------------------------------------- vLLM's resolution, emulated


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


# ---------------------------------------------------------------- findings


def _finding(id: str, status: Level, message: str, fix: str = "") -> Finding:
    return Finding(id, status, message=message, fix=fix)


@dataclass
class CheckReport:
    model_dir: str
    findings: list[Finding] = field(default_factory=list)
    modules_checked: int = 0

    @property
    def failed(self) -> bool:
        return any(f.level == "fail" for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        return {
            "model_dir": self.model_dir,
            "modules_checked": self.modules_checked,
            "ok": not self.failed,
            # The keys `checkpoint check --json` has always had (status = level).
            "findings": [
                {"id": f.id, "status": f.level, "message": f.message, "fix": f.fix}
                for f in self.findings
            ],
        }


def _kind(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".N", name)


def _group_schemes(qcfg: Mapping[str, Any]) -> dict[str, Scheme | None]:
    return {g: scheme_of_group(v) for g, v in (qcfg.get("config_groups") or {}).items()}


def check_quantization(
    model: ModelFacts,
    report: CheckReport,
    stored: tuple[list[StoredModule], list[str]] | None = None,
) -> list[StoredModule]:
    qcfg = model.quantization_config
    if not qcfg:
        report.findings.append(
            _finding("quantization", "ok", "no quantization_config: nothing to resolve")
        )
        return []
    if qcfg.get("quant_method") != "compressed-tensors":
        report.findings.append(_finding(
            "quantization", "warn",
            f"quant_method {qcfg.get('quant_method')!r}: only compressed-tensors is checked",
        ))  # fmt: skip
        return []
    fix_cmd = f"flashnext checkpoint fix --model {model.path}"
    modules, problems = stored if stored is not None else stored_modules(model)
    report.modules_checked = len(modules)
    for p in problems[:20]:
        report.findings.append(_finding("stored-scheme", "fail", p, "re-download the shard"))
    smap = SchemeMap.from_config(qcfg)
    schemes = _group_schemes(qcfg)

    for target, groups in smap.duplicates.items():
        winner = groups[-1]
        label = schemes[winner].label() if schemes.get(winner) else winner
        report.findings.append(_finding(
            "duplicate-targets", "fail",
            f"target {target!r} is listed by {len(groups)} groups ({', '.join(groups)}); vLLM keys "
            f"its scheme map by target, so only {winner} ({label}) survives",
            fix_cmd,
        ))  # fmt: skip

    undeclared: dict[Scheme, int] = Counter(
        m.scheme for m in modules if m.scheme and not any(declares(s, m) for s in schemes.values())
    )
    for scheme, n in sorted(undeclared.items(), key=lambda kv: kv[0].label()):
        report.findings.append(_finding(
            "no-group-for-scheme", "fail",
            f"{n} modules store {scheme.label()} but no config group declares it",
            "re-export the quantization_config; a group cannot be invented safely",
        ))  # fmt: skip

    wrong: Counter[tuple[str, str, str, bool]] = Counter()
    example: dict[tuple[str, str, str, bool], str] = {}
    resolved_groups: set[str] = set()
    multi: Counter[tuple[str, tuple[str, ...]]] = Counter()
    for m in modules:
        for runtime in (False, True):
            name = vllm_name(m.name) if runtime else m.name
            # Plain weights: only name targets count (which unquantized 2-D weights vLLM
            # builds as quantizable Linears is known only to the model code).
            group = smap.resolve(name, runtime, by_class=m.scheme is not None)
            if group:
                resolved_groups.add(group)
            got = schemes.get(group) if group else None
            if not declares(got, m):
                key = (_kind(m.name), m.scheme.label() if m.scheme else "unquantized",
                       f"{got.label()} ({group})" if got else "unquantized", runtime)  # fmt: skip
                wrong[key] += 1
                example.setdefault(key, name)
            if not runtime and not smap.ignored(name, False):
                hits = smap.name_matches(name)
                if len(hits) > 1:
                    multi[(_kind(m.name), tuple(hits))] += 1
    by_scheme: Counter[tuple[str, str]] = Counter()
    for (_k, stored, got, runtime), n in wrong.items():
        if not runtime:
            by_scheme[(stored, got)] += n
    for (stored, got), n in sorted(by_scheme.items()):
        kinds = sorted({k for (k, s, g, r) in wrong if s == stored and g == got and not r})
        first = example[next(k for k in wrong if k[1] == stored and k[2] == got and not k[3])]
        report.findings.append(_finding(
            "wrong-scheme", "fail",
            f"{n} modules store {stored} but vLLM would load them as {got}: "
            f"{len(kinds)} kind(s), e.g. {first}",
            fix_cmd,
        ))  # fmt: skip
    runtime_only = {
        k: n for k, n in wrong.items() if k[3] and (k[0], k[1], k[2], False) not in wrong
    }
    for (kind, stored, got, _), n in sorted(runtime_only.items()):
        report.findings.append(_finding(
            "wrong-scheme-runtime-name", "fail",
            f"{n} modules of kind {kind} resolve correctly under checkpoint names but as {got} "
            f"under vLLM's names (e.g. {example[(kind, stored, got, True)]}); `re:` targets are "
            "not renamed by vLLM",
            fix_cmd,
        ))  # fmt: skip
    for (kind, groups), n in sorted(multi.items()):
        report.findings.append(_finding(
            "multi-match", "fail",
            f"{n} modules of kind {kind} are matched by targets of {', '.join(groups)}; vLLM "
            "takes the first in map order",
            fix_cmd,
        ))  # fmt: skip
    for group in sorted(set(schemes) - resolved_groups):
        report.findings.append(_finding(
            "unmatched-group", "fail" if smap.duplicates else "warn",
            f"config group {group} ({schemes[group].label() if schemes[group] else '?'}) "
            "resolves for no module",
            fix_cmd,
        ))  # fmt: skip
    for ple in ple_table_modules(model):
        if not smap.ignored(ple, False) or not smap.ignored(vllm_name(ple), True):
            report.findings.append(_finding(
                "ple-not-ignored", "warn",
                f"the PLE table {ple} is not in quantization_config.ignore; it is BF16, and a "
                "broad target would make vLLM look for a scheme there",
                fix_cmd,
            ))  # fmt: skip
    if not any(f.status == "fail" for f in report.findings if f.id != "generation-config"):
        report.findings.append(_finding(
            "quantization", "ok",
            f"every one of {len(modules)} modules resolves to the scheme its tensors store",
        ))  # fmt: skip
    return modules


def check_generation_config(model: ModelFacts, report: CheckReport) -> None:
    fix = (
        f"flashnext checkpoint fix --model {model.path} --generation-config-from DIR "
        "(or --sampling temperature=... top_p=... top_k=... from the model card)"
    )
    if model.generation_config is None:
        report.findings.append(_finding(
            "generation-config", "warn",
            f"no {GENERATION_CONFIG_FILE}: vLLM samples with temperature 1, top_p 1, top_k 0",
            fix,
        ))  # fmt: skip
        return
    present = sampling_keys_present(model.generation_config)
    neutral = sampling_keys_restoring_nothing(model.generation_config)
    if not present:
        sets = (
            f"sets only {neutral}, which restore nothing"
            if neutral
            else f"sets none of {', '.join(VLLM_SAMPLING_KEYS)}"
        )
        report.findings.append(_finding(
            "generation-config", "fail",
            f"{GENERATION_CONFIG_FILE} {sets}; vLLM then "
            "samples the whole vocabulary at temperature 1 (long Japanese output collapses)",
            fix,
        ))  # fmt: skip
    else:
        report.findings.append(
            _finding("generation-config", "ok", f"sampling keys present: {', '.join(present)}")
        )


def check(model: ModelFacts) -> CheckReport:
    report = CheckReport(model.path)
    check_quantization(model, report)
    check_generation_config(model, report)
    return report


# ---------------------------------------------------------------- fix: targets


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


# ---------------------------------------------------------------- fix: files


@dataclass
class FixPlan:
    model_dir: Path
    changes: dict[str, tuple[str, str]] = field(default_factory=dict)
    """File name -> (old text, new text) for each file that changes."""
    notes: list[str] = field(default_factory=list)
    remaining: list[str] = field(default_factory=list)
    """Defects the fix could not repair without more input from the user."""

    def diff(self) -> str:
        out = []
        for name, (old, new) in self.changes.items():
            out.extend(difflib.unified_diff(
                old.splitlines(keepends=True), new.splitlines(keepends=True),
                fromfile=f"a/{name}", tofile=f"b/{name}",
            ))  # fmt: skip
        return "".join(out)


def _dump(doc: Any) -> str:
    # HF writes these files with indent=2 and keeps key order.
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def fixed_quantization_config(
    model: ModelFacts, known_values: Mapping[str, Sequence[int]] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """A quantization_config whose targets match what the tensors store, verified by emulation.

    `checkpoint fix` writes it; `flashnext skeleton --fixed-metadata` writes it too, from
    its inventory (`known_values`: the weight_shape values it would write)."""
    qcfg = copy.deepcopy(model.quantization_config or {})
    modules, problems = stored_modules(model, known_values)
    if problems:
        raise CheckpointError(
            f"cannot derive the stored scheme of {len(problems)} module(s), e.g. {problems[0]}; "
            "nothing was changed"
        )
    schemes = _group_schemes(qcfg)
    notes: list[str] = []
    ple = ple_table_modules(model)
    smap0 = SchemeMap.from_config(qcfg)
    ignore = list(qcfg.get("ignore") or [])
    for table in ple:
        if not (smap0.ignored(table, False) and smap0.ignored(vllm_name(table), True)):
            ignore.append(ple_ignore_pattern(table))
            notes.append(f"added the PLE table {table} to ignore")
    probe = SchemeMap({}, ignore, {})
    kept = [m for m in modules if not probe.ignored(m.name, False)]
    targets = explicit_targets(kept)
    for scheme in targets:
        owners = [g for g, s in schemes.items() if s == scheme]
        if len(owners) != 1:
            raise CheckpointError(
                f"tensors store {scheme.label()}, declared by {len(owners)} config groups "
                f"({', '.join(owners) or 'none'}); fix the groups by hand, nothing was changed"
            )
    for group_name, group in qcfg.get("config_groups", {}).items():
        scheme = schemes[group_name]
        if scheme not in targets:
            raise CheckpointError(
                f"config group {group_name} ({scheme.label() if scheme else '?'}) describes no "
                "stored module; remove it by hand, nothing was changed"
            )
        if group.get("targets") != targets[scheme]:
            notes.append(
                f"{group_name} ({scheme.label()}): targets {group.get('targets')} -> "
                f"{len(targets[scheme])} explicit pattern(s)"
            )
        group["targets"] = targets[scheme]
    qcfg["ignore"] = ignore
    # Prove it before anything is written: the same emulation `check` uses.
    fixed = copy.copy(model)
    object.__setattr__(fixed, "quantization_config", qcfg)
    report = CheckReport(model.path)
    check_quantization(fixed, report, (modules, problems))
    bad = [f for f in report.findings if f.status != "ok"]
    if bad:
        raise CheckpointError(f"the rewritten targets do not verify: {bad[0].message}")
    return qcfg, notes


# What vLLM 0.33.0 accepts for each key (vllm/sampling_params.py
# SamplingParams._verify_args; max_new_tokens becomes max_tokens, config/model.py):
# a default outside these ranges makes every request that relies on it fail.
_BOOLEAN_KEYS = ("skip_special_tokens", "do_sample")
_NUMBER_RANGES: dict[str, tuple[str, Any]] = {
    "temperature": ("in [0, 2]", lambda v: 0 <= v <= 2),
    "top_p": ("in (0, 1]", lambda v: 0 < v <= 1),
    "min_p": ("in [0, 1]", lambda v: 0 <= v <= 1),
    "presence_penalty": ("in [-2, 2]", lambda v: -2 <= v <= 2),
    "frequency_penalty": ("in [-2, 2]", lambda v: -2 <= v <= 2),
    "repetition_penalty": ("greater than 0", lambda v: v > 0),
}


def sampling_value_error(key: str, value: Any) -> str | None:
    """Why vLLM would refuse `value` as the default for `key`, or None when it is fine."""
    if key in _BOOLEAN_KEYS:
        return None if isinstance(value, bool) else f"{key} must be true or false, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{key} must be a number, got {json.dumps(value)}"
    if not math.isfinite(value):
        return f"{key} must be a finite number, got {value!r}"
    if key == "top_k":
        if not isinstance(value, int):
            return f"top_k must be an integer, got {value!r}"
        return None if value >= -1 else f"top_k must be -1 or 0 (off) or at least 1, got {value}"
    if key == "max_new_tokens":
        ok = isinstance(value, int) and value >= 1
        return None if ok else f"max_new_tokens must be an integer >= 1, got {value!r}"
    rule = _NUMBER_RANGES.get(key)
    if rule and not rule[1](value):
        return f"{key} must be {rule[0]}, got {value!r}"
    return None


def parse_sampling(pairs: Sequence[str]) -> dict[str, Any]:
    """`--sampling key=value` pairs; keys must be ones vLLM reads, values numbers/booleans."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or key not in RESTORABLE_KEYS:
            raise CheckpointError(
                f"--sampling {pair!r}: expected KEY=VALUE, KEY one of {', '.join(RESTORABLE_KEYS)}"
            )
        try:
            value = json.loads(
                raw.strip().lower() if raw.strip().lower() in ("true", "false") else raw
            )
        except json.JSONDecodeError:
            raise CheckpointError(
                f"--sampling {pair!r}: {raw!r} is not a number or true/false"
            ) from None
        if not isinstance(value, int | float | bool):
            raise CheckpointError(f"--sampling {pair!r}: {raw!r} is not a number or true/false")
        why = sampling_value_error(key, value)
        if why:
            raise CheckpointError(f"--sampling {pair!r}: {why} (vLLM refuses other values)")
        out[key] = value
    return out


def sampling_from_dir(source: Path) -> dict[str, Any]:
    path = source / GENERATION_CONFIG_FILE if source.is_dir() else source
    from flashnext.facts.jsonfile import JsonFileError, read_json_object

    try:
        doc = read_json_object(path, "generation config")
    except JsonFileError as exc:
        raise CheckpointError(
            f"--generation-config-from: {exc}; name the published model's directory (or its "
            "generation_config.json)"
        ) from None
    keys = {k: doc[k] for k in RESTORABLE_KEYS if k in doc}
    for key, value in keys.items():
        why = None if value is None else sampling_value_error(key, value)
        if why:
            raise CheckpointError(
                f"--generation-config-from: {path}: {why}; vLLM refuses it, nothing was changed"
            )
    if not sampling_keys_present(keys):
        neutral = sampling_keys_restoring_nothing(keys)
        has = (f"sets only {neutral}, which restore nothing" if neutral
               else f"has none of {', '.join(VLLM_SAMPLING_KEYS)} either")  # fmt: skip
        raise CheckpointError(
            f"--generation-config-from: {path} {has}; name the published model's "
            "generation_config.json"
        )
    return keys


def plan_fix(model: ModelFacts, sampling: Mapping[str, Any] | None = None) -> FixPlan:
    """Everything `fix` would write, as text, without touching the disk."""
    root = Path(model.path)
    plan = FixPlan(root)
    config_text = (root / CONFIG_FILE).read_text()
    config = json.loads(config_text)
    if (
        model.quantization_config
        and model.quantization_config.get("quant_method") == "compressed-tensors"
    ):
        qcfg, notes = fixed_quantization_config(model)
        if "quantization_config" in config:
            config["quantization_config"] = qcfg
        else:
            config["text_config"]["quantization_config"] = qcfg
        if notes:
            plan.notes += notes
            plan.changes[CONFIG_FILE] = (config_text, _dump(config))

    gen_path = root / GENERATION_CONFIG_FILE
    gen = model.generation_config
    if sampling:
        old_text = gen_path.read_text() if gen_path.exists() else ""
        new = dict(gen or {})
        new.update(sampling)
        if new != (gen or {}):
            plan.changes[GENERATION_CONFIG_FILE] = (old_text, _dump(new))
            plan.notes.append(f"{GENERATION_CONFIG_FILE}: set {', '.join(sorted(sampling))}")
        if not sampling_keys_present(new):  # refused before anything is written
            raise CheckpointError(
                f"--sampling: {GENERATION_CONFIG_FILE} would set only "
                f"{sampling_keys_restoring_nothing(new)}, vLLM's own fallbacks, which restore "
                "nothing; pass the published values: --generation-config-from DIR (the "
                "original release's) or --sampling temperature=... --sampling top_p=... from "
                "the model card"
            )
    elif not sampling_keys_present(gen):
        plan.remaining.append(
            f"{GENERATION_CONFIG_FILE} still has no sampling keys: pass --generation-config-from "
            "DIR (the published checkpoint's) or --sampling KEY=VALUE from the model card; "
            "flashnext does not invent them"
        )
    return plan


def _atomic_write(path: Path, text: str, mode: int | None = None) -> None:
    write_text_atomic(path, text, mode)


def apply_fix(plan: FixPlan) -> list[Path]:
    """Back up each original once (FILE.orig, never overwritten), then write atomically.

    A backup keeps its original's mode; a file that did not exist gets config.json's,
    so whoever can read the checkpoint (vLLM's user) can read what fix writes.
    """
    backups = []
    default_mode = (plan.model_dir / CONFIG_FILE).stat().st_mode & 0o777
    for name, (old, new) in plan.changes.items():
        path = plan.model_dir / name
        backup = path.with_name(path.name + BACKUP_SUFFIX)
        mode = path.stat().st_mode & 0o777 if path.exists() else default_mode
        if path.exists() and not backup.exists():
            _atomic_write(backup, old, mode)
            backups.append(backup)
        _atomic_write(path, new, mode)
    return backups
