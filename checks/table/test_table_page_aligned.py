"""The page-aligned table layout: 12 rows per 4 KiB page, then zero padding.

The expected file is built here from the checkpoint writer's own flat bytes
(ple_checkpoint.py), not with flashnext.table.file_layout, so a layout bug in
the tools shows up as a byte mismatch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.facts.storage import probe_storage
from flashnext.table.file_layout import row_offset, rows_per_page, table_bytes
from ple_checkpoint import ROW_BYTES, Checkpoint, make_checkpoint
from prepare_helpers import force_if_needed, kill_mid_copy

PAGE = 4096
PER_PAGE = 12  # 12 x 320 = 3840 bytes of rows, 256 bytes of padding


def aligned_bytes(flat: bytes) -> bytes:
    """The page-aligned file for these rows, by hand: 12 rows, 256 zero bytes, repeat."""
    rows = [flat[i : i + ROW_BYTES] for i in range(0, len(flat), ROW_BYTES)]
    pages = []
    for i in range(0, len(rows), PER_PAGE):
        body = b"".join(rows[i : i + PER_PAGE])
        pages.append(body + bytes(PAGE - len(body)))
    return b"".join(pages)


def _prepare(ckpt: Checkpoint, out: Path, *extra: str):
    args = ["table", "prepare", "--model", str(ckpt.path), "--out", str(out), *extra]
    return CliRunner().invoke(main, [*args, *force_if_needed(out.parent)])


def _verify(ckpt: Checkpoint, table: Path, *extra: str):
    args = ["table", "verify", "--model", str(ckpt.path), "--table", str(table), *extra]
    return CliRunner().invoke(main, args)


def test_geometry_of_the_real_table() -> None:
    """320,001,536 rows of 320 bytes: 12 per page, 256 bytes of padding, +6.7% disk."""
    rows = 320_001_536
    assert rows_per_page(320) == PER_PAGE
    assert table_bytes(rows, 320, "packed") == rows * 320 == 102_400_491_520
    assert table_bytes(rows, 320, "page-aligned") == -(-rows // 12) * 4096 == 109_227_192_320
    assert row_offset(13, 320, "page-aligned") == 4096 + 320
    assert row_offset(13, 320, "packed") == 13 * 320
    # No row of the aligned layout straddles a page; 4 of 64 packed rows do.
    spans = [(row_offset(r, 320, "page-aligned"), 320) for r in range(600)]
    assert all(off // PAGE == (off + n - 1) // PAGE for off, n in spans)
    packed = [r * 320 for r in range(64)]
    assert sum(off // PAGE != (off + 319) // PAGE for off in packed) == 4


def test_prepare_writes_rows_page_by_page(checkpoint: Checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "ple.bin"
    result = _prepare(checkpoint, out, "--layout", "page-aligned", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["layout"] == "page-aligned" and doc["status"] == "written"
    want = aligned_bytes(checkpoint.flat)
    assert len(want) == -(-checkpoint.rows // 12) * 4096
    assert out.read_bytes() == want
    assert doc["total_bytes"] == len(want)
    manifest = json.loads((tmp_path / "ple.bin.json").read_text())
    assert manifest["layout"] == "page-aligned" and manifest["total_bytes"] == len(want)
    assert (manifest["rows"], manifest["dim"], manifest["dtype"]) == (checkpoint.rows, 160, "BF16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "ple.bin", "ple.bin.json"]

    verify = _verify(checkpoint, out, "--samples", str(checkpoint.rows), "--json")
    assert verify.exit_code == 0, verify.output
    vdoc = json.loads(verify.stdout)
    assert vdoc["ok"] is True and vdoc["layout"] == "page-aligned"


def test_packed_stays_the_default(checkpoint: Checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "ple.bin"
    result = _prepare(checkpoint, out, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["layout"] == "packed"
    assert out.read_bytes() == checkpoint.flat
    assert json.loads((tmp_path / "ple.bin.json").read_text())["layout"] == "packed"


def test_second_run_in_the_other_layout_is_refused(checkpoint: Checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "ple.bin"
    assert _prepare(checkpoint, out).exit_code == 0
    before = out.read_bytes()
    result = _prepare(checkpoint, out, "--layout", "page-aligned")
    assert result.exit_code == 1
    assert f"Error: {out} is this checkpoint's table in the packed layout, not page-aligned" in (
        result.output
    )
    assert "rerun prepare with --layout page-aligned" in result.output
    assert out.read_bytes() == before
    again = _prepare(checkpoint, out, "--json")
    assert again.exit_code == 0 and json.loads(again.stdout)["status"] == "present"


def test_unknown_layout_is_a_usage_error(checkpoint: Checkpoint, tmp_path: Path) -> None:
    result = _prepare(checkpoint, tmp_path / "ple.bin", "--layout", "aligned")
    assert result.exit_code == 2
    assert "'aligned' is not one of 'packed', 'page-aligned'" in result.output
    assert not list(tmp_path.glob("ple.bin*"))


def test_flipped_byte_in_an_aligned_table_names_row_and_offset(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    out = tmp_path / "ple.bin"
    assert _prepare(checkpoint, out, "--layout", "page-aligned").exit_code == 0
    bad_row = 5 * checkpoint.rows_per_shard + 17
    offset = (bad_row // 12) * 4096 + (bad_row % 12) * 320
    data = bytearray(out.read_bytes())
    data[offset + 100] ^= 0x01
    out.write_bytes(bytes(data))
    result = _verify(checkpoint, out, "--samples", str(checkpoint.rows))
    assert result.exit_code == 1
    assert f"Error: row {bad_row} differs from the checkpoint" in result.output
    assert f"table offset {offset})" in result.output


def test_nonzero_padding_is_reported(checkpoint: Checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "ple.bin"
    assert _prepare(checkpoint, out, "--layout", "page-aligned").exit_code == 0
    data = bytearray(out.read_bytes())
    data[-1] = 0x7F  # the last page's padding, after the last row
    out.write_bytes(bytes(data))
    result = _verify(checkpoint, out, "--samples", "4")
    assert result.exit_code == 1
    assert f"Error: {out}: page padding is not zero" in result.output


def test_aligned_file_without_its_manifest_is_named(checkpoint: Checkpoint, tmp_path: Path) -> None:
    """verify assumes packed without a manifest; an aligned size says what happened."""
    out = tmp_path / "ple.bin"
    out.write_bytes(aligned_bytes(checkpoint.flat))
    result = _verify(checkpoint, out)
    assert result.exit_code == 1
    size = out.stat().st_size
    assert (
        f"Error: {out}: {size} bytes, expected {len(checkpoint.flat)} ({checkpoint.rows} rows "
        f"x 160 x BF16, packed layout, assumed: no manifest beside it); the table is "
        f"{len(checkpoint.flat)} bytes packed, {size} bytes page-aligned; the size is the "
        "page-aligned one: its manifest is missing or stale"
    ) in result.output


def test_wrong_size_aligned_table_names_both_sizes(checkpoint: Checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "ple.bin"
    assert _prepare(checkpoint, out, "--layout", "page-aligned").exit_code == 0
    size = out.stat().st_size
    with out.open("r+b") as f:
        f.truncate(size - PAGE)
    result = _verify(checkpoint, out)
    assert result.exit_code == 1
    assert (
        f"Error: {out}: {size - PAGE} bytes, expected {size} ({checkpoint.rows} rows x 160 x "
        f"BF16, page-aligned layout, per its manifest); the table is {len(checkpoint.flat)} "
        f"bytes packed, {size} bytes page-aligned\n"
    ) in result.output
    assert "fix: remove it and rerun `flashnext table prepare" in result.output


def test_unknown_layout_in_the_manifest_is_refused(checkpoint: Checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "ple.bin"
    out.write_bytes(checkpoint.flat)
    (tmp_path / "ple.bin.json").write_text(json.dumps({"layout": "striped"}))
    result = _verify(checkpoint, out)
    assert result.exit_code == 1
    assert "ple.bin.json: layout is 'striped', expected one of packed, page-aligned" in (
        result.output
    )


@pytest.fixture
def big(tmp_path: Path) -> Checkpoint:
    # 64 MiB of rows, synced every 1 MiB: the kill lands mid-copy.
    return make_checkpoint(tmp_path / "model", shards=16, vocab_base=13_000, seed=7)


def test_killed_aligned_prepare_resumes(big: Checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "ple.bin"
    committed = kill_mid_copy(big, out, "--layout", "page-aligned")
    want = aligned_bytes(big.flat)
    assert 0 < committed < len(want) and committed % PAGE == 0
    journal = json.loads((tmp_path / "ple.bin.partial.json").read_text())
    assert journal["layout"] == "page-aligned"

    result = _prepare(big, out, "--layout", "page-aligned", "--json",
                      "--chunk-bytes", str(1 << 20))  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "resumed" and doc["resumed_from_bytes"] >= committed
    assert doc["copied_bytes"] == len(want) - doc["resumed_from_bytes"]
    assert out.read_bytes() == want
    assert not (tmp_path / "ple.bin.partial").exists()


def test_partial_of_the_other_layout_is_not_resumed(big: Checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "ple.bin"
    partial = tmp_path / "ple.bin.partial"
    kill_mid_copy(big, out)  # packed
    kept = partial.read_bytes()
    result = _prepare(big, out, "--layout", "page-aligned")
    assert result.exit_code == 1
    assert (
        f"Error: {partial} was written with --layout packed, this run asks for --layout "
        "page-aligned; its bytes cannot be continued in the other layout"
    ) in result.output
    assert "fix: rerun with --layout packed to resume it, or remove" in result.output
    assert partial.read_bytes() == kept and not out.exists()
    # The same command with the layout it was started with finishes it.
    again = _prepare(big, out, "--json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["status"] == "resumed"
    assert out.read_bytes() == big.flat


def test_corrupt_aligned_partial_is_rewritten(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "model", shards=4, vocab_base=1_000, seed=3)
    out = tmp_path / "ple.bin"
    want = aligned_bytes(ckpt.flat)
    half = len(want) // 2 // PAGE * PAGE
    bad = bytearray(want[:half])
    bad[half - 10] ^= 0x55  # padding of the last committed page
    (tmp_path / "ple.bin.partial").write_bytes(bytes(bad))
    from flashnext.table.layout import read_layout

    identity = read_layout(ckpt.path).identity()
    (tmp_path / "ple.bin.partial.json").write_text(
        json.dumps({"identity": identity, "layout": "page-aligned", "committed_bytes": half})
    )
    result = _prepare(ckpt, out, "--layout", "page-aligned", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "written" and doc["resumed_from_bytes"] == 0
    assert out.read_bytes() == want


def test_preflight_accepts_either_layout_and_names_both_sizes(tmp_path: Path) -> None:
    """preflight's table.size check, on the facts of a real file of each size and the
    manifest beside it (vLLM learns the layout there; none means packed)."""
    import dataclasses

    from flashnext.checks.inputs import PreflightInput
    from flashnext.checks.table import _table_size
    from flashnext.facts.manifest import probe_manifest

    rows, cols = 2816, 160
    cases = {
        "packed": (rows * 320, "packed"),
        "aligned": (-(-rows // 12) * 4096, "page-aligned"),
        "aligned, no manifest": (-(-rows // 12) * 4096, None),
        "bad": (999, "packed"),
    }
    findings = {}
    for name, (size, layout) in cases.items():
        path = tmp_path / f"{name}.bin"
        with path.open("wb") as f:
            f.truncate(size)
        if layout:
            # as prepare writes it: preflight checks what verify checks (issue 25)
            total = rows * 320 if layout == "packed" else -(-rows // 12) * 4096
            doc = {"layout": layout, "rows": rows, "dim": cols, "dtype": "BF16",
                   "row_bytes": 320, "total_bytes": total}  # fmt: skip
            Path(f"{path}.json").write_text(json.dumps(doc))
        st = dataclasses.replace(probe_storage(str(path)), manifest=probe_manifest(path))
        inp = PreflightInput(
            facts=None, profile=None, plan=None, plan_error=None, model=None, model_error=None,
            model_dir="M", table_path=str(path), table_shape=(rows, cols), port=0, host="",
        )  # fmt: skip
        findings[name] = list(_table_size(inp, st))
    assert findings["packed"][0].level == "ok" and "packed layout" in findings["packed"][0].message
    assert findings["aligned"][0].level == "ok"
    assert "page-aligned layout" in findings["aligned"][0].message
    lost = findings["aligned, no manifest"][0]
    assert lost.level == "fail" and "so vLLM reads it as packed" in lost.message
    bad = findings["bad"][0]
    assert bad.level == "fail"
    assert f"{rows * 320} bytes packed, {-(-rows // 12) * 4096} bytes page-aligned" in bad.message
    assert "--layout page-aligned" in bad.fix


def test_foreign_partial_of_the_other_layout_starts_over(tmp_path: Path) -> None:
    """Only a resumable partial (same checkpoint) is protected; another one is rewritten."""
    ckpt = make_checkpoint(tmp_path / "model", shards=4, vocab_base=128, seed=5)
    out = tmp_path / "ple.bin"
    (tmp_path / "ple.bin.partial").write_bytes(ckpt.flat[:4096])
    (tmp_path / "ple.bin.partial.json").write_text(
        json.dumps({"identity": "0" * 64, "layout": "packed", "committed_bytes": 4096})
    )
    result = _prepare(ckpt, out, "--layout", "page-aligned", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["resumed_from_bytes"] == 0
    assert out.read_bytes() == aligned_bytes(ckpt.flat)
