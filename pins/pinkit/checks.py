"""The checks behind pins/check. Each returns Findings; none raises on bad pins.

- lock-files: vllm.toml and every lock parse, each lock's bytes match the
  sha256 recorded in vllm.toml, vllm and torch pins agree with vllm.toml.
- resolves-<py>: pip, under a real CPython of that version and for the lock's
  platform, resolves `-r <lock>` in --require-hashes mode: every dependency of
  every pin must be pinned (pip refuses otherwise), the index must still serve
  a file with the locked sha256, and the resolved set (names, versions,
  hashes, `# via`) must equal the lock; pins nothing requires fail too.
- wheelhouse-<py>: if a wheelhouse for the lock is cached, every file in it
  hashes to its pin and every pin has a file.
"""

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import interpreters, lockfile, meta, resolve, toolpip, wheelhouse
from .target import PYTHONS, Target


@dataclass(frozen=True)
class Finding:
    id: str
    status: str
    """"ok", "fail" or "skip"."""
    message: str

    def as_dict(self) -> dict:
        return {"id": self.id, "status": self.status, "message": self.message}


@dataclass(frozen=True)
class LoadedLock:
    python: str
    path: Path
    pins: list


def check_lock_files(pins_dir: Path) -> tuple[list[Finding], meta.Meta | None, list[LoadedLock]]:
    try:
        pins_meta = meta.load(pins_dir)
    except meta.MetaError as exc:
        return [Finding("lock-files", "fail", str(exc))], None, []
    problems, loaded = [], []
    for python in PYTHONS:
        try:
            entry = pins_meta.lock_for(python)
        except meta.MetaError as exc:
            problems.append(str(exc))
            continue
        path = Path(pins_dir) / entry.file
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            problems.append(f"{path} is missing; run pins/lock")
            continue
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            problems.append(
                f"{entry.file}: sha256 differs from vllm.toml (edited by hand?); "
                "restore it or run pins/lock"
            )
        try:
            pins = lockfile.parse(data.decode(), entry.file)
        except lockfile.LockError as exc:
            problems.append(str(exc))
            continue
        by_name = {p.name: p for p in pins}
        vllm_pin, torch_pin = by_name.get("vllm"), by_name.get("torch")
        if vllm_pin is None or vllm_pin.version != pins_meta.vllm_version:
            problems.append(f"{entry.file}: vllm is not pinned to {pins_meta.vllm_version}")
        elif pins_meta.vllm_sha256 not in vllm_pin.sha256:
            problems.append(f"{entry.file}: vllm hash differs from vllm.toml's sha256")
        if torch_pin is None or torch_pin.version != pins_meta.torch_version:
            problems.append(f"{entry.file}: torch is not pinned to {pins_meta.torch_version}")
        if entry.packages != len(pins):
            problems.append(f"{entry.file}: {len(pins)} pins, vllm.toml says {entry.packages}")
        loaded.append(LoadedLock(python, path, pins))
    if problems:
        return [Finding("lock-files", "fail", "; ".join(problems))], pins_meta, loaded
    total = ", ".join(f"{lk.path.name} ({len(lk.pins)} pins)" for lk in loaded)
    return [Finding("lock-files", "ok", f"vllm.toml and {total} agree")], pins_meta, loaded


def compare(lock_pins: list, report: resolve.Report) -> list[str]:
    """Differences between a lock and what the resolver made of it."""
    resolved, unreachable = resolve.to_pins(report, ["vllm"])
    locked = {p.name: p for p in lock_pins}
    got = {p.name: p for p in resolved}
    diffs = [f"{name}: pinned but nothing requires it" for name in unreachable]
    for name in sorted(locked.keys() | got.keys()):
        a, b = locked.get(name), got.get(name)
        if a is None:
            diffs.append(f"{name}=={b.version}: required but not pinned")
        elif b is None:
            if name not in unreachable:
                diffs.append(f"{name}: pinned but not resolved")
        elif a.version != b.version:
            diffs.append(f"{name}: locked {a.version}, resolved {b.version}")
        elif not set(b.sha256) <= set(a.sha256):
            diffs.append(f"{name}: resolved file sha256 {b.sha256[0]} is not locked")
        elif a.extras != b.extras:
            diffs.append(f"{name}: extras {list(a.extras)} in the lock, {list(b.extras)} needed")
        elif a.via != b.via:
            diffs.append(f"{name}: via {list(a.via)} in the lock, {list(b.via)} resolved")
    return diffs


def check_resolves(
    loaded: list[LoadedLock], glibc: tuple[int, int], overrides, pins_dir: Path, cache: Path
) -> list[Finding]:
    def one(lock: LoadedLock) -> Finding:
        check_id = f"resolves-{lock.python}"
        try:
            base = interpreters.find(lock.python, overrides.get(lock.python))
            python = toolpip.resolver_python(base, pins_dir, cache)
            report = resolve.run_resolver(
                python, Target(lock.python, glibc), ["-r", str(lock.path)]
            )
        except (
            interpreters.InterpreterError,
            resolve.ResolveError,
            toolpip.ToolPipError,
        ) as exc:
            return Finding(check_id, "fail", str(exc))
        diffs = compare(lock.pins, report)
        if diffs:
            return Finding(
                check_id,
                "fail",
                f"{lock.path.name} no longer resolves to itself: "
                + "; ".join(diffs[:10])
                + "; review, then run pins/lock",
            )
        return Finding(
            check_id,
            "ok",
            f"{lock.path.name}: {len(lock.pins)} pins resolve to the same set and hashes "
            f"(pip {report.pip_version}, CPython {report.environment.get('python_full_version')})",
        )

    with ThreadPoolExecutor(max_workers=len(loaded) or 1) as pool:
        return list(pool.map(one, loaded))


def check_wheelhouses(loaded: list[LoadedLock], cache: Path) -> list[Finding]:
    findings = []
    for lock in loaded:
        check_id = f"wheelhouse-{lock.python}"
        lock_sha = lockfile.pins_digest(lock.pins)
        path = wheelhouse.path_for(cache, lock_sha)
        if not wheelhouse.is_complete(path, lock_sha):
            findings.append(
                Finding(check_id, "skip", f"no complete wheelhouse at {path} (pins/build-env)")
            )
            continue
        problems = wheelhouse.verify(path, lock.pins)
        if problems:
            findings.append(
                Finding(
                    check_id,
                    "fail",
                    f"{path}: " + "; ".join(problems[:10]) + f"; delete {path} and rerun "
                    "pins/build-env",
                )
            )
        else:
            findings.append(
                Finding(check_id, "ok", f"{path}: {len(lock.pins)} wheels match their sha256")
            )
    return findings
