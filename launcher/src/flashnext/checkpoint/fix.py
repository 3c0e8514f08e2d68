"""`checkpoint fix`: rewrite the checkpoint's metadata to what its tensors store.

Each config group's targets become anchored `re:` patterns that match exactly the
modules storing that group's scheme (targets.py), the PLE table is added to
`ignore`, and sampling keys are restored only from a source the user names
(sampling.py). The rewrite is proved by `checkpoint check`'s own emulation before
anything is written; originals are kept as FILE.orig, writes are atomic.
"""

from __future__ import annotations

import copy
import difflib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashnext.atomic import write_text_atomic
from flashnext.checkpoint.errors import CheckpointError
from flashnext.checkpoint.targets import explicit_targets, ple_ignore_pattern
from flashnext.checks.checkpoint_metadata import CheckReport, check_quantization
from flashnext.facts.model import CONFIG_FILE, GENERATION_CONFIG_FILE
from flashnext.facts.model_derived import sampling_keys_present, sampling_keys_restoring_nothing
from flashnext.facts.schema import ModelFacts
from flashnext.facts.scheme_map import SchemeMap, vllm_name
from flashnext.facts.stored_schemes import group_schemes, ple_table_modules, stored_modules

BACKUP_SUFFIX = ".orig"


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
    schemes = group_schemes(qcfg)
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


def _read_config_text(path: Path) -> tuple[str, dict[str, Any]]:
    """(text, object) of a checkpoint JSON file, read bounded like every input."""
    from flashnext.facts.jsonfile import MAX_CONFIG_BYTES, JsonFileError, parse_json, read_bounded

    try:
        raw = read_bounded(path, "model config", MAX_CONFIG_BYTES)
        doc = parse_json(raw, str(path), "model config")
    except JsonFileError as exc:
        raise CheckpointError(f"{exc}; re-download it from the checkpoint") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: not a JSON object; re-download it from the checkpoint")
    return raw.decode("utf-8"), doc


def plan_fix(model: ModelFacts, sampling: Mapping[str, Any] | None = None) -> FixPlan:
    """Everything `fix` would write, as text, without touching the disk."""
    root = Path(model.path)
    plan = FixPlan(root)
    config_text, config = _read_config_text(root / CONFIG_FILE)
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
        old_text = _read_config_text(gen_path)[0] if gen_path.exists() else ""
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
