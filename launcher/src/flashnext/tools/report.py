"""One redacted file to attach to a bug report: facts, plan, preflight, versions, patches.

Inputs are plain JSON-able dicts (what `facts --json`, `plan --json` and
`preflight --json` print), so this module is a pure function of them plus the
redaction context. A part that could not be collected is recorded as
{"unavailable": reason} instead of aborting the report (TGI's env dump does the same).

Redacted: the hostname, the user's name, serial numbers and UUIDs, MAC and
non-loopback IP addresses, secrets (values of keys that look like keys, tokens,
passwords), and paths under $HOME (shown as `~/...`). The user's name and home
only when the account is a person's: a service account (a no-login shell, as
the image's `flashnext` user has) keeps them, since they are product words.
"""

from __future__ import annotations

import getpass
import hashlib
import importlib.metadata
import json
import os
import platform
import pwd
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashnext import VLLM_VERSION, __version__
from flashnext.atomic import write_text_atomic

REPORT_SCHEMA_VERSION = 1

UUID_RE = re.compile(
    r"\b(?:GPU-|MIG-)?[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
)
MAC_RE = re.compile(r"\b[0-9a-fA-F]{2}(?::[0-9a-fA-F]{2}){5}\b")
IPV4_RE = re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}\b")
# Candidates only (two colons or more, optional zone id): `ipaddress` decides, so a
# time of day (12:34:56) or a C++ name (std::vector) is left alone.
IPV6_CANDIDATE_RE = re.compile(
    r"(?<![\w:.])(?:[0-9a-fA-F]{0,4}:){2,7}(?:(?:\d{1,3}\.){3}\d{1,3}|[0-9a-fA-F]{1,4})?"
    r"(?:%[\w.-]+)?(?![\w:]|\.\d)"
)
SECRET_KEY_RE = re.compile(
    r"(^|[_-])(api[_-]?key|key|token|secret|password|passwd|credentials?)($|[_-])", re.IGNORECASE
)
SERIAL_KEY_RE = re.compile(r"(serial|uuid|machine_id|boot_id)", re.IGNORECASE)
# Addresses that say nothing about the host: loopback, unspecified, broadcast.
PUBLIC_SAFE_IPS = re.compile(r"^(127\.|0\.0\.0\.0$|255\.255\.255\.255$)")


@dataclass
class Redactor:
    """Replaces identifying strings; counts what it replaced, by kind."""

    hostname: str | None = None
    username: str | None = None
    home: str | None = None
    sudo_user: str | None = None
    """Under sudo, the person who invoked it (SUDO_USER): `username` is then root."""
    sudo_home: str | None = None
    """That person's home directory, redacted like `home`."""
    counts: dict[str, int] = field(default_factory=dict)

    def _count(self, kind: str, n: int = 1) -> None:
        if n:
            self.counts[kind] = self.counts.get(kind, 0) + n

    def text(self, s: str) -> str:
        for home in (self.home, self.sudo_home):
            if home and len(home.rstrip("/")) > 1:
                # "~" for the home dir itself and for paths below it, not for /home/userx.
                pattern = re.escape(home.rstrip("/")) + r"(?=/|$|\s|\"|')"
                s, n = re.subn(pattern, "~", s)
                self._count("home_path", n)
        s, n = UUID_RE.subn("<uuid>", s)
        self._count("uuid", n)
        s, n = MAC_RE.subn("<mac>", s)
        self._count("mac", n)

        def ip(m: re.Match[str]) -> str:
            if PUBLIC_SAFE_IPS.match(m.group(0)):
                return m.group(0)
            self._count("ip")
            return "<ip>"

        s = IPV6_CANDIDATE_RE.sub(self._ipv6, s)  # first: ::ffff:192.0.2.7 is one address
        s = IPV4_RE.sub(ip, s)
        names = ((self.hostname, "<hostname>"), (self.username, "<user>"),
                 (self.sudo_user, "<user>"))  # fmt: skip
        for value, tag in names:
            if value and len(value) >= 2:
                s, n = re.subn(rf"(?<![\w-]){re.escape(value)}(?![\w-])", tag, s)
                self._count(tag.strip("<>"), n)
        return s

    def _ipv6(self, m: re.Match[str]) -> str:
        """An IPv6 address other than loopback (::1) and unspecified (::) is the host's."""
        import ipaddress

        try:
            addr = ipaddress.IPv6Address(m.group(0).partition("%")[0])
        except ValueError:
            return m.group(0)  # not an address after all
        if addr.is_loopback or addr.is_unspecified:
            return m.group(0)
        self._count("ip")
        return "<ip>"

    def value(self, obj: Any, key: str = "") -> Any:
        if isinstance(obj, dict):
            return {k: self.value(v, str(k)) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            out = [self.value(v, key) for v in obj]
            # argv: the value after --api-key (or --api-key=VALUE) is a secret.
            for i, v in enumerate(obj):
                flag, eq, _ = v.partition("=") if isinstance(v, str) else ("", "", "")
                if flag.startswith("--") and SECRET_KEY_RE.search(flag[2:]):
                    if eq:
                        out[i] = f"{flag}=<redacted>"
                        self._count("secret")
                    elif i + 1 < len(obj):
                        out[i + 1] = "<redacted>"
                        self._count("secret")
            return out
        if isinstance(obj, str) and obj:
            if key == "hostname":
                self._count("hostname")
                return "<hostname>"
            if SERIAL_KEY_RE.search(key):
                self._count("serial")
                return "<redacted>"
            if SECRET_KEY_RE.search(key):
                self._count("secret")
                return "<redacted>"
            return self.text(obj)
        return obj


# Login shells of accounts nobody logs in to (`useradd --system --shell
# /usr/sbin/nologin`, as the image's `flashnext` user is made).
NO_LOGIN_SHELLS = frozenset({"nologin", "false"})


def is_service_account(shell: str | None) -> bool:
    """A passwd entry whose shell lets nobody log in names a service, not a person.

    Its name and home are product words (the image's user `flashnext` owns
    /opt/flashnext and runs `flashnext ...`): redacting them would turn every
    path and fix line into `<user>` and hide nothing about anyone.
    """
    return bool(shell) and Path(shell).name in NO_LOGIN_SHELLS


def redactor_for_this_host(facts: dict[str, Any] | None, account=None) -> Redactor:
    """The redactor for the invoking user; `account` is (name, shell, home), else read
    from the passwd entry. A person's name and home are redacted, a service's are not;
    without a passwd entry the name from the environment counts as a person's."""
    hostname = (facts or {}).get("hostname") or platform.node() or None
    if account is None:
        account = _invoking_account()
    name, shell, home = account
    # Under sudo the invoking person (SUDO_USER) is redacted whatever account runs it.
    sudo_user, sudo_home = _sudo_invoker(name)
    if is_service_account(shell):
        return Redactor(hostname=hostname, sudo_user=sudo_user, sudo_home=sudo_home)
    return Redactor(hostname=hostname, username=name, home=home, sudo_user=sudo_user,
                    sudo_home=sudo_home)  # fmt: skip


def _invoking_account() -> tuple[str | None, str | None, str]:
    home = os.path.expanduser("~")
    try:
        entry = pwd.getpwuid(os.geteuid())
        return entry.pw_name, entry.pw_shell, home
    except KeyError:  # no passwd entry (an arbitrary --user in a container)
        pass
    try:
        return getpass.getuser(), None, home
    except (KeyError, OSError):
        return None, None, home


def _sudo_invoker(username: str | None) -> tuple[str | None, str | None]:
    """(name, home) of the person behind `sudo flashnext report` (SUDO_USER), whose paths
    and name the report would otherwise carry; (None, None) when not under sudo."""
    sudo_user = os.environ.get("SUDO_USER") or None
    if not sudo_user or sudo_user == username:
        return None, None
    try:
        return sudo_user, pwd.getpwnam(sudo_user).pw_dir
    except KeyError:  # no passwd entry: the name alone is still theirs
        return sudo_user, None


# ---------------------------------------------------------------- parts


def patch_series(series_dir: Path | None) -> dict[str, Any]:
    """Each patch named in `series`, in order, with the sha256 of its file."""
    if series_dir is None:
        return {"unavailable": "patch series directory not found"}
    series = series_dir / "series"
    try:
        lines = series.read_text().splitlines()
    except OSError as exc:
        return {"unavailable": f"{series}: {exc.strerror}"}
    patches = []
    for line in lines:
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        try:
            digest = hashlib.sha256((series_dir / name).read_bytes()).hexdigest()
        except OSError as exc:
            digest = f"unavailable: {exc.strerror}"
        patches.append({"name": name, "sha256": digest})
    return {"dir": str(series_dir), "patches": patches}


STAMP_NAME = "_flashnext_patches.json"
"""Written into the vLLM package by patches/apply: which patches that tree carries."""


def vllm_package_dir(python: str) -> Path | None:
    """Where `python` finds the vllm package, without importing it (find_spec only)."""
    code = (
        "import importlib.util as u; s = u.find_spec('vllm'); "
        "print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')"
    )
    try:
        out = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=60, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(out) if out else None


def env_versions(python: str) -> dict[str, str]:
    """Distribution versions in another Python env (metadata only, nothing imported)."""
    code = (
        "import importlib.metadata as m, json, platform\n"
        "def v(d):\n"
        "    try:\n"
        "        return m.version(d)\n"
        "    except m.PackageNotFoundError:\n"
        "        return 'N/A'\n"
        "print(json.dumps({d: v(d) for d in ('vllm', 'torch', 'transformers', 'triton')}"
        " | {'python': platform.python_version()}))"
    )
    try:
        out = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=60, check=True
        ).stdout
        return json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return {"unavailable": f"{python}: {exc}"}


def applied_patches(vllm_dir: Path | None, series: dict[str, Any]) -> dict[str, Any]:
    """The stamp of the vLLM tree that serves, checked against this checkout's series."""
    if vllm_dir is None:
        return {"unavailable": "no vLLM env given (--vllm-python) or vllm not found in it"}
    stamp_path = vllm_dir / STAMP_NAME
    from flashnext.facts.jsonfile import JsonFileError, parse_json, read_limited
    from flashnext.facts.vllm_env import stamp_problem

    try:
        stamp = parse_json(read_limited(stamp_path, "patch stamp", 1 << 20), str(stamp_path),
                           "patch stamp")  # fmt: skip
    except FileNotFoundError:
        return {"dir": str(vllm_dir), "stamp": None, "note": "stock tree: no patches applied"}
    except (OSError, JsonFileError) as exc:
        return {"unavailable": f"{stamp_path}: {exc}"}
    problem = stamp_problem(stamp)
    if problem:
        return {"unavailable": f"{stamp_path}: {problem}"}
    applied = [(p["name"], p["sha256"]) for p in stamp["patches"]]
    expected = [(p["name"], p["sha256"]) for p in series.get("patches", [])]
    return {
        "dir": str(vllm_dir),
        "stamp": stamp,
        "matches_checkout": applied == expected if "patches" in series else None,
    }


def default_series_dir() -> Path | None:
    """The checkout's patches/vllm-<pin>/ when flashnext runs from a checkout."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "patches" / f"vllm-{VLLM_VERSION}"
        if (candidate / "series").is_file():
            return candidate
    return None


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "N/A"


def versions() -> dict[str, str]:
    """What runs here; vLLM by its installed metadata (the launcher never imports it)."""
    return {
        "flashnext": __version__,
        "vllm_pinned": VLLM_VERSION,
        "vllm_installed": _dist_version("vllm"),
        "torch_installed": _dist_version("torch"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def build_report(
    *,
    facts: dict[str, Any] | None,
    plan: dict[str, Any] | None,
    preflight: dict[str, Any] | None,
    versions: dict[str, str],
    patches: dict[str, Any],
    redactor: Redactor,
    applied: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The report document, already redacted (with a count of what was redacted)."""
    raw = {
        "facts": facts if facts is not None else {"unavailable": "not collected"},
        "plan": plan if plan is not None else {"unavailable": "no plan"},
        "preflight": preflight if preflight is not None else {"unavailable": "not run"},
        "versions": versions,
        "patch_series": patches,
        "vllm_applied_patches": applied if applied is not None else {"unavailable": "not asked"},
    }
    doc = redactor.value(raw)
    doc["report_schema_version"] = REPORT_SCHEMA_VERSION
    doc["redactions"] = dict(sorted(redactor.counts.items()))
    return doc


def write_report(path: Path, text: str) -> None:
    """Atomic: a reader sees the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
