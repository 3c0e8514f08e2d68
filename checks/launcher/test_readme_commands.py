"""Issue 43: every command line the README shows parses with today's CLI.

Each `./flashnext ...` line of its shell blocks and inline code, the Nix app's
`nix run .#serve -- ...` and the image's `podman run ... IMAGE ARGS` (whose
entrypoint is `flashnext serve`) is parsed by Click itself against the real
`flashnext` command: its groups, subcommands, options, types and callbacks.
Nothing runs. Paths the README names need not exist on this machine, so
click.Path's exists check is the one thing left out. The page's other figures
are held here too: what a host needs (preflight's own requirements for the
shipped profile), the proven-where table's results, and `.ci/run`.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import click
import pytest
from flashnext.cli import main

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
GOLDEN_PASS = REPO / "checks" / "launcher" / "golden" / "preflight" / "3x3090-pass.txt"


def section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def shown_commands() -> list[tuple[list[str], bool]]:
    """Every command on the page as (words, mention): the shell blocks' lines
    (comments and continuations handled) and inline code; an inline one without
    options is a mention."""
    shown = []
    for block in re.findall(r"```sh\n(.*?)```", README, re.S):
        lines = block.replace("\\\n", " ").splitlines()
        shown += [(shlex.split(ln, comments=True), False) for ln in lines if ln.strip()]
    for span in re.findall(r"`((?:\./flashnext|flashnext|nix run|podman run) [^`]+)`", README):
        words = shlex.split(span)
        shown.append((words, not any(w.startswith("-") for w in words)))
    return shown


def as_flashnext_args(words: list[str]) -> list[str] | None:
    """The arguments the flashnext CLI receives for a shown line; None: not flashnext."""
    if words[0] in ("./flashnext", "flashnext"):
        return words[1:]
    if words[:2] == ["nix", "run"] and ".#serve" in words:
        return ["serve", *words[words.index("--") + 1 :]]
    if words[:2] == ["podman", "run"]:
        image = next(i for i, w in enumerate(words) if w.startswith("localhost/flashnext:"))
        if "--entrypoint" in words:
            return words[image + 1 :]
        return ["serve", *words[image + 1 :]]  # the image's entrypoint
    return None


def parse(args: list[str], mention: bool = False) -> click.Context:
    """Click's own parse of `flashnext ARGS`, down to the leaf command; raises on a
    usage error (unknown command or option, a bad value, a missing required one).
    A mention (prose naming a command, no options: `flashnext checkpoint fix`) is
    held to its names only: Click's resilient parse skips required options."""
    ctx = main.make_context("flashnext", list(args), resilient_parsing=mention)
    cmd = main
    while isinstance(cmd, click.Group):
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        if not rest:
            break
        name, cmd, rest = cmd.resolve_command(ctx, rest)
        if cmd is None:  # a resilient parse answers an unknown name with None
            raise click.UsageError(f"no such command {name!r}")
        ctx = cmd.make_context(cmd.name, rest, parent=ctx, resilient_parsing=mention)
    if mention and ctx.args:
        raise click.UsageError(f"{ctx.command_path} takes no argument {ctx.args[0]!r}")
    return ctx


@pytest.fixture
def paths_need_not_exist(monkeypatch):
    """The README's example paths (/models/..., plan.json) are not on this machine."""

    def walk(cmd):
        for param in cmd.params:
            if isinstance(param.type, click.Path):
                monkeypatch.setattr(param.type, "exists", False)
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    walk(main)


def test_every_command_the_readme_shows_parses(paths_need_not_exist):
    commands = [(a, m) for w, m in shown_commands() if (a := as_flashnext_args(w)) is not None]
    assert len([a for a, mention in commands if not mention]) >= 10, commands
    leaves = set()
    for args, mention in commands:
        try:
            ctx = parse(args, mention)
        except click.ClickException as exc:
            pytest.fail(f"README: `flashnext {shlex.join(args)}` does not parse: {exc}")
        leaves.add(ctx.command_path)
    for command in ("serve", "preflight", "plan", "table prepare", "checkpoint fix", "facts"):
        assert f"flashnext {command}" in leaves, leaves


def test_the_parse_fails_on_what_the_cli_does_not_take(paths_need_not_exist):
    with pytest.raises(click.NoSuchOption):
        parse(["serve", "--model", "/m", "--tabel", "/t"])
    with pytest.raises(click.UsageError):
        parse(["tabel", "prepare"])
    with pytest.raises(click.BadParameter):
        parse(["serve", "--port", "eighty"])
    with pytest.raises(click.MissingParameter):
        parse(["checkpoint", "fix"])  # a command line must carry what it requires
    with pytest.raises(click.UsageError):
        parse(["checkpoint", "fixx"], mention=True)
    assert as_flashnext_args(["podman", "run", "-d", "localhost/flashnext:0.1.0", "--port", "1"])


def test_ci_runs_exactly_the_readmes_test_command():
    blocks = re.findall(r"```sh\n(.*?)```", section("The two commands"), re.S)
    assert [b.strip() for b in blocks][1] == "checks/run"
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert [ln for ln in ci if ln.startswith("exec ")] == ["exec checks/run"]


def test_what_a_host_needs_is_preflights_requirement():
    """The RAM, memlock and shm figures are those preflight requires for the shipped
    profile (its golden output on the reference host)."""
    golden = GOLDEN_PASS.read_text()
    needs = " ".join(section("What a host needs").split())
    for check in ("host.ram", "host.memlock", "host.shm"):
        row = next(ln for ln in golden.splitlines() if f" {check} " in ln)
        required = row.split("│")[4].strip()  # ">= 43.69 GiB", ">= 29.19 GiB or unlimited"
        figure = re.search(r">= [\d.]+ GiB", required).group(0)
        assert figure in needs, (check, figure)


def test_each_proven_row_names_a_results_file_and_its_date():
    rows = [ln for ln in section("What has been proven, and where").splitlines()
            if ln.startswith("| ") and not ln.startswith("| where")]  # fmt: skip
    assert any("three RTX 3090s" in r and r.rstrip(" |").endswith("never") for r in rows)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        named = re.findall(r"`(checks/gpu/results/[^`]+)`", cells[2])
        if not named:
            continue
        path = REPO / named[0]
        assert path.exists(), named[0]
        date = cells[3]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), row
        files = [path] if path.is_file() else sorted(path.rglob("*.json"))
        stamps = {d for f in files for d in re.findall(r'"collected_at": "(\d{4}-\d{2}-\d{2})',
                                                       f.read_text())}  # fmt: skip
        assert not stamps or date in stamps, (named[0], date, stamps)
        stem = path.name.removesuffix(".json")
        results = (REPO / "checks" / "gpu" / "RESULTS.md").read_text()
        assert stem in results or path.name in results, f"RESULTS.md does not name {stem}"


def test_the_json_of_a_dated_run_agrees():
    """One row checked against its own JSON: s2's preflight was collected that day."""
    doc = json.loads((REPO / "checks/gpu/results/serve_pp3-h200-s2/preflight.json").read_text())
    assert "2026-12-04" in json.dumps(doc)
    assert "| `checks/gpu/results/serve_pp3-h200-s2/` | 2026-12-04 |" in README
