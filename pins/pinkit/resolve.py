"""Ask pip's resolver for a closure and turn its `--report` into pins.

The resolver runs as `pip install --dry-run --report`: nothing is installed
and, with the index's PEP 658 metadata, no wheel is downloaded. The report
carries each chosen file's sha256 as the index publishes it and each
distribution's Requires-Dist, from which the `# via` annotations are rebuilt.
"""

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .lockfile import Pin, canonical_name
from .target import Target

try:  # pip's own copy, so markers are read exactly as the resolver read them
    from pip._vendor.packaging.requirements import Requirement
except ImportError:  # pragma: no cover - pip without vendored packaging
    from packaging.requirements import Requirement


class ResolveError(RuntimeError):
    """pip could not resolve, or its report is unusable; the message says why."""


@dataclass(frozen=True)
class Resolved:
    """One distribution in a resolver report."""

    name: str
    version: str
    sha256: str
    filename: str
    requires_dist: tuple[str, ...]
    requested_extras: tuple[str, ...] = ()


@dataclass(frozen=True)
class Report:
    """What a resolver run produced."""

    pip_version: str
    environment: dict
    dists: dict[str, Resolved]
    """By normalized name."""


def run_resolver(python: str, target: Target, requirement_args: list[str]) -> Report:
    """Run pip under `python` (a real CPython target.python) and parse its report."""
    with tempfile.TemporaryDirectory(prefix="flashnext-pins-") as tmp:
        report_path = Path(tmp) / "report.json"
        argv = [
            python,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report_path),
            # pip only accepts foreign --platform tags together with --target.
            "--target",
            str(Path(tmp) / "target"),
            *target.pip_target_args(),
            *requirement_args,
        ]
        print(f"pins: resolving for CPython {target.python} ({python})", file=sys.stderr)
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if "is ignored" not in line]
            raise ResolveError(
                f"pip could not resolve for CPython {target.python}:\n" + "\n".join(errors[-30:])
            )
        return parse_report(json.loads(report_path.read_text()))


def parse_report(report: dict) -> Report:
    """Pull name, version, file hash and dependencies out of pip's install report."""
    dists = {}
    for item in report.get("install", []):
        meta = item["metadata"]
        name = canonical_name(meta["name"])
        info = item["download_info"]
        url = info.get("url", "")
        hashes = info.get("archive_info", {}).get("hashes", {})
        if "sha256" not in hashes:
            raise ResolveError(
                f"{name} {meta['version']}: the index published no sha256 for "
                f"{url.rsplit('/', 1)[-1] or url}; a hash-pinned lock cannot include it"
            )
        if not url.endswith(".whl"):
            raise ResolveError(f"{name}: resolved to a non-wheel {url!r}; the lock is wheels only")
        dists[name] = Resolved(
            name=name,
            version=meta["version"],
            sha256=hashes["sha256"],
            filename=url.rsplit("/", 1)[-1],
            requires_dist=tuple(meta.get("requires_dist") or ()),
            requested_extras=tuple(item.get("requested_extras") or ()),
        )
    return Report(report.get("pip_version", "?"), report.get("environment", {}), dists)


def dependency_parents(
    report: Report, roots: list[str]
) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Walk Requires-Dist from `roots` the way pip does (markers, extras).

    Returns every reached name with the set of names that require it (roots
    map to an empty set), and every reached name with the extras asked of it.
    A requirement pip would need but the report lacks means the closure is
    incomplete and raises ResolveError.
    """
    extras: dict[str, set[str]] = {}
    parents: dict[str, set[str]] = {}
    queue = []
    for root in roots:
        name = canonical_name(root)
        if name not in report.dists:
            raise ResolveError(f"{root} is not in the resolver report")
        parents[name] = set()
        extras[name] = set(report.dists[name].requested_extras)
        queue.append(name)
    while queue:
        parent = queue.pop()
        for line in report.dists[parent].requires_dist:
            req = Requirement(line)
            if not _marker_holds(req, extras[parent], report.environment):
                continue
            child = canonical_name(req.name)
            if child not in report.dists:
                raise ResolveError(f"{parent} requires {line!r} but {child} is not in the closure")
            new_extras = set(req.extras) - extras.get(child, set())
            first_visit = child not in parents
            parents.setdefault(child, set()).add(parent)
            extras.setdefault(child, set()).update(new_extras)
            if first_visit or new_extras:
                queue.append(child)
    return parents, extras


def _marker_holds(req, active_extras: set[str], environment: dict) -> bool:
    if req.marker is None:
        return True
    return any(
        req.marker.evaluate({**environment, "extra": extra}) for extra in ({""} | active_extras)
    )


def to_pins(report: Report, roots: list[str]) -> tuple[list[Pin], list[str]]:
    """Pins for everything reachable from `roots`, and names the roots never reach."""
    parents, extras = dependency_parents(report, roots)
    pins = [
        Pin(
            d.name,
            d.version,
            (d.sha256,),
            tuple(sorted(parents[d.name])),
            tuple(sorted(canonical_name(e) for e in extras[d.name])),
        )
        for d in report.dists.values()
        if d.name in parents
    ]
    unreachable = sorted(set(report.dists) - set(parents))
    return pins, unreachable
