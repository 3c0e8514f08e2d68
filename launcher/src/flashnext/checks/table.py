"""The PLE table file: given, the one the facts describe, readable, its size and
manifest in a layout vLLM reads, and the medium it sits on."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flashnext import __version__
from flashnext.checks.finding import Finding
from flashnext.checks.inputs import PreflightInput, _facts_lack, _ok
from flashnext.facts.schema import StorageFacts
from flashnext.table.file_layout import LAYOUTS, PACKED, both_sizes, layouts_matching, table_bytes
from flashnext.table.path_kind import interrupted_prepare_output, partial_message, rewrite_fix
from flashnext.table.storage_policy import storage_refusal


def table(inp: PreflightInput) -> Iterator[Finding]:
    if not inp.table_path:
        yield Finding(
            "table.path",
            "fail",
            "not given",
            "the PLE table file",
            "no PLE table path was given",
            "pass --table FILE (make it with `flashnext table prepare`)",
        )
        return
    st = inp.facts.storage.get("table")
    if inp.facts_source and (st is None or not _same_path(st.path, inp.table_path)):
        recorded = "no table storage" if st is None else f"the storage of {st.path}"
        yield Finding(
            "table.path",
            "warn",
            "not in the facts" if st is None else f"facts for {st.path}",
            inp.table_path,
            f"{inp.facts_source} records {recorded}, not of {inp.table_path}: its size, "
            "manifest and medium are unknown",
            "record facts for it on the serving host (`flashnext facts --table "
            f"{inp.table_path} --out FILE`) and pass --facts FILE"
            + ("" if st is None else f", or pass --table {st.path}"),
        )
        return
    partial = _interrupted_prepare(inp)
    if partial is not None:
        yield partial
        return
    if st is None or not st.exists:
        yield Finding(
            "table.path",
            "fail",
            "missing",
            inp.table_path,
            f"{inp.table_path} does not exist",
            _prepare_fix(inp)
            if inp.facts.in_container
            else f"flashnext table prepare --model {inp.model_dir or 'DIR'} --out {inp.table_path}",
        )
        return
    if not st.is_regular_file:
        yield Finding(
            "table.path",
            "fail",
            "not a regular file",
            "a regular file",
            f"{inp.table_path} is not a regular file",
            "point --table at the flat file",
        )
        return
    if not st.readable:
        yield Finding(
            "table.readable",
            "fail",
            "not readable",
            "readable",
            f"{inp.table_path} cannot be read by this user",
            f"chmod a+r {inp.table_path}",
        )
    yield from _table_size(inp, st)
    yield from _table_medium(inp, st)


def _prepare_fix(inp: PreflightInput) -> str:
    """Inside a container the table's directory is a mount the run line makes read-only
    (containers/README.md): `--out` there cannot write. Prepare it with the image and
    the host's directory mounted read-write; the host paths are not visible from here,
    so they are named MODEL_DIR and TABLE_DIR."""
    model = inp.model_dir or "/models/qwen3.8-flash-next"
    table_dir = str(Path(inp.table_path).parent)
    return (
        "prepare it from the host, with the image and the table's host directory mounted "
        f"read-write: podman run --rm --entrypoint flashnext -v MODEL_DIR:{model}:ro "
        f"-v TABLE_DIR:{table_dir} localhost/flashnext:{__version__} table prepare "
        f"--model {model} --out {inp.table_path}  (MODEL_DIR, TABLE_DIR: the host "
        f"directories mounted at {model} and {table_dir}; containers/README.md)"
    )


def _interrupted_prepare(inp: PreflightInput) -> Finding | None:
    """--table names an interrupted prepare's partial copy or journal: say so, and resume
    (a size or manifest finding's "remove it" would throw the copy away)."""
    final = interrupted_prepare_output(inp.table_path)
    if final is None:
        return None
    return Finding(
        "table.path", "fail", "an interrupted prepare's partial", "the finished table",
        partial_message(inp.table_path, final, inp.model_dir),
        f"flashnext table prepare --model {inp.model_dir or 'DIR'} --out {final}",
    )  # fmt: skip


def _manifest_sizes_disagree(doc: dict[str, Any], row_bytes: int, total: int) -> str | None:
    """What verify also checks: the manifest's row_bytes and total_bytes are the shape's."""
    for key, want in (("row_bytes", row_bytes), ("total_bytes", total)):
        if doc.get(key) != want:
            return f"{key} is {doc.get(key)!r}, the checkpoint implies {want}"
    return None


def _same_path(recorded: str, asked: str) -> bool:
    return os.path.normpath(recorded) == os.path.normpath(os.path.abspath(asked))


def _table_size(inp: PreflightInput, st: StorageFacts) -> Iterator[Finding]:
    if inp.table_shape is None:
        if inp.table_shape_error:
            yield Finding(
                "table.size",
                "fail",
                "unknown",
                "the shape config.json implies",
                f"cannot tell the PLE table's shape: {inp.table_shape_error}",
                "restore config.json from the published checkpoint",
            )
        return
    rows, cols = inp.table_shape
    row_bytes = cols * 2  # BF16
    # Either layout `table prepare` writes; vLLM checks the one its manifest names.
    fits = layouts_matching(st.size_bytes, rows, row_bytes)
    if not fits:
        yield Finding(
            "table.size",
            "fail",
            f"{st.size_bytes} bytes",
            f"{both_sizes(rows, row_bytes)} ([{rows}, {cols}] BF16)",
            f"{inp.table_path} is {st.size_bytes} bytes, not the [{rows}, {cols}] BF16 table "
            f"the model config implies in either layout ({both_sizes(rows, row_bytes)}): "
            "a truncated copy or another model's table",
            f"remove it and rerun `flashnext table prepare --model {inp.model_dir} "
            f"--out {inp.table_path}` (add --layout page-aligned for the page-aligned layout)",
            measured_bytes=st.size_bytes,
            required_bytes=table_bytes(rows, row_bytes, PACKED),
        )
    else:
        yield from _table_manifest(inp, st, fits)


def _table_manifest(inp: PreflightInput, st: StorageFacts, fits: list[str]) -> Iterator[Finding]:
    """The size fits a layout; vLLM reads which one from the manifest (none: packed)."""
    rows, cols = inp.table_shape
    row_bytes = cols * 2
    shape = f"[{rows}, {cols}] BF16"
    measured = f"{st.size_bytes} bytes"
    table = inp.table_path
    m = st.manifest
    name = Path(m.path).name if m else f"{Path(table).name}.json"
    redo = (
        f"remove {table} and {name} and rerun `flashnext table prepare --model "
        f"{inp.model_dir} --out {table}`"
    )
    if m is None:
        yield Finding(
            "table.size",
            "warn",
            measured,
            shape,
            f"{_facts_lack(inp, f'the table manifest ({name})')}, as facts from a flashnext "
            f"before manifests were read: whether vLLM takes the file as {fits[0]} is unknown",
            f"record facts with this flashnext on the serving host (`flashnext facts --table "
            f"{table} --out FILE`)",
        )
        return
    if not m.exists:
        if PACKED in fits:
            yield _ok("table.size", measured, shape, "exact size (packed layout, no manifest)")
            return
        yield Finding(
            "table.size",
            "fail",
            measured,
            f"{table_bytes(rows, row_bytes, PACKED)} bytes (packed: no manifest)",
            f"{table} has no manifest ({name}), so vLLM reads it as packed: "
            f"{table_bytes(rows, row_bytes, PACKED)} bytes, but it is {st.size_bytes} bytes "
            f"(the {fits[0]} size: its manifest is missing)",
            f"restore {name} from where the table was prepared, or remove {table} and rerun "
            f"`flashnext table prepare --model {inp.model_dir} --out {table} --layout {fits[0]}`",
        )
        return
    doc = m.doc or {}
    layout = doc.get("layout", PACKED)
    if m.error or layout not in LAYOUTS:
        why = m.error or f"layout is {layout!r}, not one of {', '.join(LAYOUTS)}"
        yield Finding(
            "table.size",
            "fail",
            f"{name}: unreadable" if m.error else f"{name}: layout {layout!r}",
            shape,
            f"{m.path}: {why}: vLLM refuses to load the table",
            rewrite_fix(inp.model_dir or "DIR", table),
        )
        return
    found = (doc.get("rows"), doc.get("dim"), doc.get("dtype"))
    if found != (rows, cols, "BF16"):
        yield Finding(
            "table.size",
            "fail",
            f"{name}: [{found[0]}, {found[1]}] {found[2]}",
            shape,
            f"{name} describes [{found[0]}, {found[1]}] {found[2]} rows, the model config "
            f"implies {shape}: vLLM refuses the table",
            redo,
        )
        return
    want = table_bytes(rows, row_bytes, layout)
    if st.size_bytes != want:
        yield Finding(
            "table.size",
            "fail",
            measured,
            f"{want} bytes ({layout}, per {name})",
            f"{table} is {st.size_bytes} bytes, but {name} says the {layout} layout: {want} "
            f"bytes for {shape}; vLLM refuses it (the size is the {fits[0]} one: the manifest "
            "is stale)",
            redo,
        )
        return
    lie = _manifest_sizes_disagree(doc, row_bytes, want)
    if lie:
        yield Finding("table.size", "fail", f"{name}: {lie.split(',')[0]}", shape,
                      f"{m.path}: {lie}: the manifest does not describe this table",
                      rewrite_fix(inp.model_dir or "DIR", table))  # fmt: skip
        return
    yield _ok("table.size", measured, shape, f"exact size ({layout} layout, per {m.path})")


def _table_medium(inp: PreflightInput, st: StorageFacts) -> Iterator[Finding]:
    where = f"{st.mount_point} ({st.fs_type}, {st.transport})"
    fix = "move the table to a local NVMe filesystem (ext4/xfs) and pass its new path"
    # One policy for `table prepare` and preflight: flashnext.table.storage_policy.
    refusal = storage_refusal(st)
    if refusal and inp.profile.table.medium_check == "warn":
        yield Finding(
            "table.medium",
            "warn",
            where,
            "local NVMe",
            f'{refusal} (profile {inp.profile.name} accepts it: table.medium_check = "warn")',
            fix,
        )
    elif refusal:
        yield Finding("table.medium", "fail", where, "local NVMe", refusal, fix)
    elif st.transport == "nvme":
        yield _ok("table.medium", where, "local NVMe", "random reads at NVMe latency")
    elif st.transport == "sata":
        yield Finding(
            "table.medium",
            "warn",
            where,
            "local NVMe",
            "a SATA SSD serves the random row reads, but cold prefills will be slower",
            fix,
        )
    else:
        yield Finding(
            "table.medium",
            "warn",
            where,
            "local NVMe",
            f"the table's device ({st.transport}) is not a local NVMe drive",
            fix,
        )
