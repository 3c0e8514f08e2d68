"""card.py: which card ran, read from nvidia-smi (a stand-in on PATH prints what the
lent cards' nvidia-smi showed: .library/device KINDS.md, "NVIDIA H200" with 143771
MiB, "NVIDIA H100 80GB HBM3" with 81559 MiB; the free figures are this test's), and
the refusal of a card with too little free memory, by name."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from card import card, parse, refusal  # noqa: E402

H200_LINE = "NVIDIA H200, 143771, 143147"
H100_LINE = "NVIDIA H100 80GB HBM3, 81559, 80935"
THREE_3090S_FREE = 3 * 25_390_219_264  # checks/fixtures/facts/3x3090-nvme.json, x3


def standin_smi(tmp_path: Path, body: str) -> Path:
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(f"#!/bin/sh\n{body}\n")
    smi.chmod(0o755)
    return smi.parent


@pytest.mark.parametrize(
    "line, name, total_mib", [(H200_LINE, "NVIDIA H200", 143771),
                              (H100_LINE, "NVIDIA H100 80GB HBM3", 81559)],
)  # fmt: skip
def test_the_card_comes_from_nvidia_smi(tmp_path, monkeypatch, line, name, total_mib):
    bin_dir = standin_smi(tmp_path, f'echo "$*" > "{tmp_path}/argv"; echo "{line}"')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    found = card()
    assert (found["name"], found["memory_total_bytes"]) == (name, total_mib << 20)
    assert found["source"].startswith("nvidia-smi --query-gpu=name,memory.total,memory.free")
    assert "--id=0" in (tmp_path / "argv").read_text()


def test_without_nvidia_smi_the_card_is_unknown_and_says_why(tmp_path, monkeypatch):
    bin_dir = standin_smi(tmp_path, "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    monkeypatch.setenv("PATH", str(bin_dir))
    found = card()
    assert found["name"] is None and found["memory_total_bytes"] is None
    assert found["source"] == "unavailable (exit 9: NVIDIA-SMI has failed)"


def test_three_3090s_fit_on_either_lent_card_and_not_on_a_smaller_one():
    assert refusal(parse(H200_LINE), THREE_3090S_FREE, "pp3_perf") is None
    assert refusal(parse(H100_LINE), THREE_3090S_FREE, "pp3_perf") is None
    busy = parse("NVIDIA H100 80GB HBM3, 81559, 40000")  # another process holds half
    assert refusal(busy, THREE_3090S_FREE, "pp3_perf (three 3090 ranks)") == (
        "pp3_perf (three 3090 ranks) needs 70.9 GiB free on one card; this NVIDIA H100 "
        "80GB HBM3 has 39.1 GiB free of 79.6: free the card, or run on a larger one "
        "(the device call's kind nvidia-h200 with needs_h200)"
    )
    assert refusal({"memory_free_bytes": None}, THREE_3090S_FREE, "x") is None  # not known
