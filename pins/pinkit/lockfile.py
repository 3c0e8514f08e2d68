"""The lock format: pip `--require-hashes` requirements, one `name==version` per
entry with its sha256 hashes, `# via` annotations, no URLs and no pip options.

Parsing is strict on purpose: anything pip would accept but we did not write
(an index URL, a direct reference, a marker, an unpinned name) is an error,
because the lock is the one source of truth for CI, Nix and the image.
"""

import hashlib
import re
from dataclasses import dataclass

_NAME = r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?"
_PIN_RE = re.compile(
    rf"^(?P<name>{_NAME})(?:\[(?P<extras>{_NAME}(?:,{_NAME})*)\])?==(?P<version>[A-Za-z0-9.+!_-]+)$"
)
_HASH_RE = re.compile(r"^--hash=sha256:(?P<hex>[0-9a-f]{64})$")
_URLISH_RE = re.compile(r"://|^-[-a-z]|@|file:", re.IGNORECASE)


class LockError(ValueError):
    """A lock file that does not follow the format; the message names the line."""


@dataclass(frozen=True)
class Pin:
    """One locked distribution."""

    name: str
    """PEP 503 normalized project name (lowercase, `-` separators)."""
    version: str
    """Exact version, as the wheel's metadata spells it."""
    sha256: tuple[str, ...]
    """Hex sha256 of every file pip may install for this pin (sorted)."""
    via: tuple[str, ...] = ()
    """Normalized names of the locked packages that require this one (sorted)."""
    extras: tuple[str, ...] = ()
    """Extras some locked package asks for (sorted, normalized). They are written
    on the pin (`uvicorn[standard]==...`) because pip's --require-hashes mode
    refuses a dependency like `uvicorn[standard]>=0.15` as unpinned when the
    index has a newer release than the lock, unless the lock names the extra."""

    @property
    def requirement(self) -> str:
        extras = f"[{','.join(self.extras)}]" if self.extras else ""
        return f"{self.name}{extras}=={self.version}"


def canonical_name(name: str) -> str:
    """PEP 503 normalization: `Foo.Bar_baz` -> `foo-bar-baz`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def render(pins: list[Pin], header: list[str]) -> str:
    """Lock text: `header` as comment lines, then pins sorted by name."""
    out = [f"# {line}".rstrip() for line in header]
    out.append("")
    for pin in sorted(pins, key=lambda p: p.name):
        hashes = [f"    --hash=sha256:{h}" for h in pin.sha256]
        out.append(" \\\n".join([pin.requirement, *hashes]))
        if len(pin.via) == 1:
            out.append(f"    # via {pin.via[0]}")
        elif pin.via:
            out.append("    # via")
            out.extend(f"    #   {parent}" for parent in pin.via)
    return "\n".join(out) + "\n"


def parse(text: str, source: str = "<lock>") -> list[Pin]:
    """Parse lock text into pins; raise LockError on anything outside the format."""
    pins: list[Pin] = []
    seen: dict[str, int] = {}
    for lineno, entry, via in _entries(text, source):
        tokens = entry.split()
        match = _PIN_RE.match(tokens[0]) if tokens else None
        if match is None:
            why = "a URL or pip option" if _URLISH_RE.search(entry) else "not `name==version`"
            raise LockError(
                f"{source}:{lineno}: {why}: {entry!r}; regenerate the file with pins/lock"
            )
        name = match["name"]
        hashes = []
        for token in tokens[1:]:
            hash_match = _HASH_RE.match(token)
            if hash_match is None:
                raise LockError(
                    f"{source}:{lineno}: {name}: unexpected {token!r} (only "
                    "--hash=sha256:<64 hex> may follow a pin); regenerate with pins/lock"
                )
            hashes.append(hash_match["hex"])
        if not hashes:
            raise LockError(
                f"{source}:{lineno}: {name}=={match['version']} has no --hash=sha256:; "
                "pip --require-hashes would refuse it; regenerate with pins/lock"
            )
        if name in seen:
            raise LockError(f"{source}:{lineno}: {name} is pinned twice (first at {seen[name]})")
        seen[name] = lineno
        extras = tuple(match["extras"].split(",")) if match["extras"] else ()
        if list(extras) != sorted(set(extras)):
            raise LockError(f"{source}:{lineno}: {name}: extras must be sorted and unique")
        pins.append(Pin(name, match["version"], tuple(sorted(hashes)), tuple(via), extras))
    return pins


def pins_digest(pins: list[Pin]) -> str:
    """sha256 over what pip installs from a lock (requirements and hashes).

    Comments, `# via` and the header do not count, so regenerating a lock
    with a newer pip or a reworded header does not rebuild a 9 GB env.
    """
    lines = sorted(f"{p.requirement} {' '.join(p.sha256)}" for p in pins)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def header_lines(text: str) -> list[str]:
    """The leading comment block (without `# `), where the lock says how it was made."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[2:] if line.startswith("# ") else line[1:])
    return lines


def _entries(text: str, source: str):
    """Yield (first line number, requirement text, via names) per entry."""
    entry: list[str] = []
    start = 0
    via: list[str] = []
    in_via = False
    pending: tuple[int, str] | None = None

    def flush():
        nonlocal pending, via
        if pending is not None:
            yield pending[0], pending[1], sorted(via)
        pending, via = None, []

    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip()
        if entry:
            entry.append(line.strip().removesuffix("\\").strip())
            if not line.endswith("\\"):
                pending = (start, " ".join(entry))
                entry = []
            continue
        stripped = line.strip()
        if stripped.startswith("#"):
            comment = stripped[1:].strip()
            if pending is not None and raw.startswith("    #"):
                if comment == "via":
                    in_via = True
                elif comment.startswith("via "):
                    via.append(comment[4:].strip())
                elif in_via and comment:
                    via.append(comment)
            continue
        if not stripped:
            continue
        yield from flush()
        in_via = False
        start = lineno
        if line.endswith("\\"):
            entry = [stripped.removesuffix("\\").strip()]
        else:
            pending = (lineno, stripped)
    if entry:
        raise LockError(f"{source}: file ends inside a continued line (trailing backslash)")
    yield from flush()
