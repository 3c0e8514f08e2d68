"""Output for people (rich tables) and for programs (canonical JSON)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from flashnext.facts.schema import SCHEMA_VERSION, dumps
from flashnext.units import GIB, gib, size  # noqa: F401 (size: checks/table imports it here)


def console(stderr: bool = False) -> Console:
    # soft_wrap keeps long fix commands pasteable; width fallback for pipes and CI logs.
    return Console(stderr=stderr, soft_wrap=False, width=None if sys.stdout.isatty() else 120)


def render_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    table = Table(title=title, title_justify="left", show_lines=False)
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*("-" if v is None else str(v) for v in row))
    console().print(table)


def emit_json(obj: Any) -> None:
    """Print canonical JSON (sorted keys) with a schema_version at the top level."""
    if isinstance(obj, dict) and "schema_version" not in obj:
        obj = {"schema_version": SCHEMA_VERSION, **obj}
    sys.stdout.write(dumps(obj))


LEVEL_STYLE = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[bold red]FAIL[/]"}


def render_findings(findings: Iterable[Any], prog: str = "flashnext") -> None:
    """Preflight findings: one row each; then each failure's and warning's fix.

    A fix is printed on a line of its own, never wrapped and never inside the
    table, so it pastes whatever the width; `prog` names the command as invoked.
    """
    findings = list(findings)
    table = Table(title="flashnext preflight", title_justify="left")
    for col in ("", "check", "measured", "required", "what"):
        table.add_column(col, overflow="fold")
    for f in findings:
        table.add_row(LEVEL_STYLE[f.level], f.id, f.measured, f.required, f.message)
    console().print(table)
    write_fix_lines([(f.id, f.fix) for f in findings if f.level != "ok" and f.fix], prog)


def write_fix_lines(fixes: Sequence[tuple[str, str]], prog: str = "flashnext") -> None:
    """`fix ID: TEXT`, one physical line each (plain text: no wrapping, no markup); a
    line already printed is not repeated."""
    from flashnext.invocation import name_command

    for line in dict.fromkeys(f"fix {i}: {name_command(fix, prog)}" for i, fix in fixes):
        sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 10_000_000 else f"{n:,} B"


def speed_rows(profile: str) -> list[tuple[str, str, str]]:
    """The serving speed's rows: the figures of a named, dated run, or none yet."""
    from flashnext.plan import speed_basis

    basis = speed_basis.basis_for(profile)
    if basis is None:
        why = "no run has measured this profile; flashnext bench measures it here"
        return [("decode tok/s, c=1 / c=4", speed_basis.NO_BASIS, why)]
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    return [("decode tok/s, c=1 / c=4",
             f"{fmt(basis.decode_c1_tok_s)} / {fmt(basis.decode_c4_tok_s)}",
             speed_basis.describe(basis))]  # fmt: skip


def render_plan(plan: Any, command: Any) -> None:
    """The plan for people: ranks, KV and host pools, roofline, then the command."""
    from flashnext.plan.command import shell_line

    render_table(
        f"plan: profile {plan.profile} ({plan.profile_reason})",
        ["rank", "layers", "QSA layers", "weights", "KV", "other", "usable", "headroom"],
        [
            (
                r.rank,
                f"{r.layers[0]}-{r.layers[1] - 1}",
                len(r.qsa_layers),
                gib(r.weight_bytes + r.drafter_weight_bytes),  # the MTP drafter's resident
                gib(r.kv_cache_bytes),
                gib(
                    r.workspace_bytes
                    + r.pp_buffer_bytes
                    + r.activation_bytes
                    + r.qsa_workspace_bytes
                ),
                gib(r.vram_usable_bytes),
                gib(r.headroom_bytes),
            )
            for r in plan.ranks
        ],
    )
    kv = plan.kv_cache_memory_bytes
    rows = [
        ("--kv-cache-memory-bytes", f"{kv.value}", f"{kv.source}: {kv.reason}"),
        ("tightest rank", str(plan.tightest_rank), "sizes KV for every rank"),
        ("PLE layers / rank", f"{list(plan.ple_layers)} / {list(plan.ple_ranks)}", "must be 0"),
    ]
    if plan.qsa is not None:
        q = plan.qsa
        rows += [
            (
                "QSA block",
                f"{q.block_tokens} tokens x {q.num_blocks}",
                f"{q.tokens} K/V slots per layer",
            ),
            (
                "host pool / layer",
                gib(q.per_layer_exact_bytes),
                f"pow2 pinned: {gib(q.per_layer_pow2_bytes)}",
            ),
            (
                "host pools, all",
                gib(q.total_exact_bytes),
                f"pow2 pinned: {gib(q.total_pow2_bytes)}",
            ),
            ("pinning", q.pinning, "exact = cudaHostRegister"),
        ]
    if plan.kv_capacity is not None:
        c = plan.kv_capacity
        rows.append((
            "full-length requests",
            f"{c.full_length_requests} x {c.max_model_len} tokens",
            f"{c.blocks_per_request} blocks each ({c.kv_blocks_per_request} K/V + "
            f"{c.state_blocks_per_request} state); vLLM: {c.max_concurrency:.2f}x, "
            f"{c.kv_cache_tokens} tokens",
        ))  # fmt: skip
    if plan.mtp is not None:
        rows.append(("MTP drafter", "placed" if plan.mtp.fits else "not placed", plan.mtp.reason))
    d = plan.decode
    rows += [
        (
            "host RAM needed",
            gib(plan.host_ram_needed_bytes),
            f"pinned {gib(plan.pinned_bytes_needed)}",
        ),
        (
            "decode bytes/token",
            f"{d.bytes_per_token / 1e9:.2f} GB",
            f"dense {d.dense_bytes / 1e9:.2f} + experts {d.experts_per_token}/{d.num_experts}: "
            "the terms counted below",
        ),
        (
            "roofline (1 stream)",
            f"{d.tokens_per_s:.0f} tok/s",
            f"{d.bandwidth_bytes_per_s / 1e9:.0f} GB/s per card: a bound, not a measurement",
        ),
        *speed_rows(plan.profile),
    ]
    render_table("memory and speed", ["what", "value", "why"], rows)
    render_table(
        "decode reads per token (safetensors headers)",
        ["term", "stored", "a token reads", "roofline", "where", "why"],
        [
            (
                t.name,
                _bytes(t.stored_bytes),
                _bytes(t.bytes_per_token),
                "counted" if t.counted else "left out",
                t.where,
                t.why,
            )
            for t in d.terms
        ],  # fmt: skip
    )
    for note in plan.notes:
        console().print(f"note: {note}")
    for key, why in sorted(plan.env_reasons.items()):
        console().print(f"note: {key}={plan.env[key]}: {why}", markup=False, highlight=False)
    console().print("[bold]command:[/]")
    # soft_wrap: one physical line, so the command stays pasteable.
    console().print(
        shell_line(command.argv, command.env), markup=False, highlight=False, soft_wrap=True
    )
