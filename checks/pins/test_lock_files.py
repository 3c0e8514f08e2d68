"""The committed locks: format, coverage of both Pythons, agreement with vllm.toml."""

import hashlib
import re
import tomllib

import pytest
from pinkit import lockfile, meta
from pinkit.target import PYTHONS

VLLM_VERSION = "0.33.0"
TORCH_VERSION = "2.14.0"
ENTRY_RE = re.compile(
    r"^(?P<name>[a-z0-9][a-z0-9-]*)(\[[a-z0-9,-]+\])?==(?P<version>\S+)"
    r"(?P<hashes>( --hash=sha256:[0-9a-f]{64})+)$"
)


def _raw_entries(text: str) -> list[str]:
    """Requirement entries joined across backslash continuations, comments dropped.

    Deliberately independent of pinkit.lockfile, so a parser bug cannot hide
    a malformed lock.
    """
    joined = re.sub(r"\\\n\s*", " ", text)
    return [
        " ".join(line.split())
        for line in joined.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


@pytest.fixture(scope="module")
def pins_meta(pins_dir):
    return meta.load(pins_dir)


@pytest.fixture(scope="module", params=PYTHONS)
def lock(request, pins_dir):
    return request.param, pins_dir / f"requirements-cp{request.param.replace('.', '')}.txt"


def test_vllm_toml_parses_and_names_each_python(pins_dir):
    data = tomllib.loads((pins_dir / "vllm.toml").read_text())
    assert data["vllm"]["version"] == VLLM_VERSION
    assert re.fullmatch(r"[0-9a-f]{64}", data["vllm"]["sha256"])
    assert sorted(data["lock"]) == sorted(PYTHONS)


def test_every_entry_is_name_eq_version_with_a_sha256(lock):
    _, path = lock
    entries = _raw_entries(path.read_text())
    assert len(entries) > 150  # the real closure is ~200 distributions
    bad = [e for e in entries if not ENTRY_RE.match(e)]
    assert bad == []


def test_parser_agrees_with_the_raw_entries(lock):
    _, path = lock
    text = path.read_text()
    pins = lockfile.parse(text, path.name)
    assert len(pins) == len(_raw_entries(text))
    assert all(p.sha256 for p in pins)


def test_rendering_the_parsed_lock_gives_the_same_bytes(lock):
    _, path = lock
    text = path.read_text()
    assert lockfile.render(lockfile.parse(text), lockfile.header_lines(text)) == text


def test_extras_other_pins_ask_for_are_written_on_the_pin(lock):
    """Without `[cu13]` on the pin, `pip install --require-hashes` against the index
    stops at vllm's `nvidia-cutlass-dsl[cu13]` as soon as a newer release exists."""
    _, path = lock
    pins = {p.name: p for p in lockfile.parse(path.read_text())}
    assert pins["nvidia-cutlass-dsl"].extras == ("cu13",)
    assert pins["uvicorn"].extras == ("standard",)
    assert "nvidia-cutlass-dsl[cu13]==" in path.read_text()


def test_header_names_the_regenerating_command(lock):
    _, path = lock
    header = lockfile.header_lines(path.read_text())
    assert "Regenerate: pins/lock" in header[0]


@pytest.mark.parametrize("wanted", [("vllm", VLLM_VERSION), ("torch", TORCH_VERSION)])
def test_both_pythons_pin_vllm_and_torch(lock, wanted):
    _, path = lock
    versions = {p.name: p.version for p in lockfile.parse(path.read_text())}
    assert versions.get(wanted[0]) == wanted[1]


def test_vllm_sha256_in_vllm_toml_matches_each_lock(lock, pins_meta):
    _, path = lock
    vllm = next(p for p in lockfile.parse(path.read_text()) if p.name == "vllm")
    assert vllm.sha256 == (pins_meta.vllm_sha256,)


def test_lock_bytes_match_the_sha256_recorded_in_vllm_toml(lock, pins_meta):
    python, path = lock
    entry = pins_meta.lock_for(python)
    assert entry.file == path.name
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry.sha256
    assert entry.packages == len(lockfile.parse(path.read_text()))


def test_every_pin_but_vllm_says_what_requires_it(lock):
    _, path = lock
    pins = {p.name: p for p in lockfile.parse(path.read_text())}
    orphans = [n for n, p in pins.items() if n != "vllm" and not p.via]
    dangling = [(n, v) for n, p in pins.items() for v in p.via if v not in pins]
    assert orphans == [] and dangling == []


def test_the_launchers_own_deps_and_test_tools_are_not_added(lock):
    """click and rich are in vllm's closure anyway; pytest and ruff must not be."""
    _, path = lock
    names = {p.name for p in lockfile.parse(path.read_text())}
    assert not names & {"pytest", "ruff", "flashnext"}


HOST_RE = re.compile(
    r"\b[a-z0-9-]+\.(?:org|com|net|io|dev|ai|cloud)\b|pythonhosted|pypi\.", re.IGNORECASE
)


def test_no_hostnames_in_any_pins_file(pins_dir):
    offenders = []
    for path in sorted(pins_dir.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            for lineno, line in enumerate(path.read_text().splitlines(), 1):
                if HOST_RE.search(line):
                    offenders.append(f"{path.relative_to(pins_dir)}:{lineno}: {line.strip()}")
    assert offenders == []


def test_no_urls_or_pip_options_in_the_generated_files(pins_dir):
    generated = sorted(pins_dir.glob("requirements-*.txt")) + [pins_dir / "vllm.toml"]
    offenders = [
        f"{path.name}:{lineno}"
        for path in generated
        for lineno, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"://|file:|@ |--(?:extra-)?index-url|--find-links|^-[ifec] ", line)
    ]
    assert offenders == []


def test_cp312_has_its_own_resolution(pins_dir):
    """vllm requires six and setuptools<81 only on Python > 3.11: a 3.12 lock
    resolved by a 3.11 pip would miss them."""
    cp311 = {
        p.name: p.version for p in lockfile.parse((pins_dir / "requirements-cp311.txt").read_text())
    }
    cp312 = {
        p.name: p.version for p in lockfile.parse((pins_dir / "requirements-cp312.txt").read_text())
    }
    assert "six" in cp312 and "six" not in cp311
    major, minor = (int(x) for x in cp312["setuptools"].split(".")[:2])
    assert (major, minor) < (81, 0)
