"""`checkpoint check`: the checkpoint's quantization metadata and sampling keys, as Findings.

The shipped export has two metadata defects (SPEC.md): every config group
targets ["Linear"], so vLLM's scheme map (keyed by target) keeps only the last
group and reads e.g. all INT4 experts as INT8 g128; and generation_config.json
lacks every sampling key vLLM reads. The weights themselves are right.

`check` resolves every module the way vLLM 0.33.0's CompressedTensorsConfig does
(facts/scheme_map.py) under both the checkpoint's names and vLLM's runtime names,
against the scheme its tensors store (facts/stored_schemes.py), and reports every
disagreement. `checkpoint fix` proves its rewrite with the same check.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from flashnext.checks.finding import Finding, Level
from flashnext.facts.model import GENERATION_CONFIG_FILE
from flashnext.facts.model_derived import (
    VLLM_SAMPLING_KEYS,
    sampling_keys_present,
    sampling_keys_restoring_nothing,
    sampling_value_problems,
)
from flashnext.facts.schema import ModelFacts
from flashnext.facts.scheme_map import SchemeMap, vllm_name
from flashnext.facts.stored_schemes import (
    Scheme,
    StoredModule,
    declares,
    group_schemes,
    ple_table_modules,
    stored_modules,
)


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


QUANT_METHOD = "compressed-tensors"  # what this kit's checkpoint is, and all it checks


def quant_method_problem(model: ModelFacts) -> str | None:
    """Why vLLM would misread the stored weights: tensors packed as compressed-tensors
    stores them, but no quantization_config, or one of another method; None if not."""
    qcfg = model.quantization_config or {}
    method = qcfg.get("quant_method")
    if method == QUANT_METHOD:
        return None
    packed = next((t.name for t in model.tensors if t.name.endswith(".weight_packed")), None)
    if packed is None:
        return None  # nothing packed: an unquantized checkpoint has nothing to misread
    said = f"quant_method {method!r}" if qcfg else "no quantization_config"
    return (f"config.json has {said}, but the tensors are packed as {QUANT_METHOD} "
            f"stores them ({packed}, ...): vLLM would load them as the wrong format")  # fmt: skip


def check_quantization(
    model: ModelFacts,
    report: CheckReport,
    stored: tuple[list[StoredModule], list[str]] | None = None,
) -> list[StoredModule]:
    qcfg = model.quantization_config
    wrong_method = quant_method_problem(model)
    if wrong_method:
        report.findings.append(_finding(
            "quantization", "fail", wrong_method,
            "restore config.json from the published checkpoint",
        ))  # fmt: skip
        return []
    if not qcfg:
        report.findings.append(_finding(
            "quantization", "ok", "no quantization_config and no packed tensors: nothing "
            "to resolve",
        ))  # fmt: skip
        return []
    if qcfg.get("quant_method") != QUANT_METHOD:
        report.findings.append(_finding(
            "quantization", "warn",
            f"quant_method {qcfg.get('quant_method')!r}: only {QUANT_METHOD} is checked",
        ))  # fmt: skip
        return []
    fix_cmd = f"flashnext checkpoint fix --model {model.path}"
    modules, problems = stored if stored is not None else stored_modules(model)
    report.modules_checked = len(modules)
    for p in problems[:20]:
        report.findings.append(_finding("stored-scheme", "fail", p, "re-download the shard"))
    smap = SchemeMap.from_config(qcfg)
    schemes = group_schemes(qcfg)

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
    refused = sampling_value_problems(model.generation_config)
    if refused:
        report.findings.append(_finding(
            "generation-config", "fail",
            f"{GENERATION_CONFIG_FILE}: {'; '.join(refused)}: vLLM refuses such a default, so "
            "every request that relies on it fails",
            fix,
        ))  # fmt: skip
    elif not present:
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
