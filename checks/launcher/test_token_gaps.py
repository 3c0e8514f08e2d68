"""checks/gpu/soak/token_gaps.py: the gaps between a stream's tokens per concurrency,
warm-up runs and prefill left out; and the figures RESULTS.md quotes for run h3."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "checks" / "gpu" / "soak" / "token_gaps.py"


def run(raw: Path) -> list[list[str]]:
    out = subprocess.run([sys.executable, str(SCRIPT), str(raw)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return [line.split() for line in out.splitlines()[1:]]


def test_gaps_leave_out_warmup_and_prefill(tmp_path):
    raw = tmp_path / "raw.jsonl"
    rows = [
        {"phase": "decode", "warmup": True, "concurrency": 1, "arrivals": [[0, 1], [5, 1]]},
        {"phase": "prefill", "warmup": False, "concurrency": 1, "arrivals": [[0, 1], [9, 1]]},
        {"phase": "decode", "warmup": False, "concurrency": 1,
         "arrivals": [[0.0, 1], [0.010, 1], [0.030, 1]]},
        {"phase": "decode", "warmup": False, "concurrency": 4, "arrivals": [[1.0, 1], [1.002, 1]]},
    ]  # fmt: skip
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert run(raw) == [["1", "2", "15.0", "15.0"], ["4", "1", "2.0", "2.0"]]


def test_the_figures_quoted_for_run_h3():
    raw = REPO / "checks" / "gpu" / "results" / "soak-h3" / "bench" / "raw.jsonl"
    assert run(raw) == [["1", "126", "18.8", "19.4"], ["4", "504", "21.4", "29.3"]]
    assert "checks/gpu/soak/token_gaps.py" in (REPO / "checks/gpu/RESULTS.md").read_text()


def test_a_missing_file_is_a_usage_error(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "none.jsonl")],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "usage" in proc.stderr and "Traceback" not in proc.stderr
