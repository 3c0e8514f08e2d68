"""checks/gpu/perf/hbm_bandwidth.py run for real on CPU (the pinned env's torch): the
result's schema, and bytes counted as moved (a copy reads and writes its buffer)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "hbm_bandwidth.py"


def test_cpu_run_writes_the_bandwidth_of_each_stream(tmp_path):
    py = os.environ.get("FLASHNEXT_VLLM_PY")
    if not py:
        pytest.skip("FLASHNEXT_VLLM_PY is not set (checks/run sets it to the pinned vLLM env)")
    out = tmp_path / "bw.json"
    proc = subprocess.run([py, str(SCRIPT), "--device", "cpu", "--gib", "0.001", "--repeats", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc == json.loads(proc.stdout)
    assert doc["device"] == "cpu" and doc["buffer_bytes"] == (1 << 30) // 1000 // 2 * 2
    results = doc["results"]
    assert set(results) == {"read", "copy", "h2d_pinned", "h2d_pageable"}
    assert results["copy"]["bytes"] == 2 * results["read"]["bytes"] == 2 * doc["buffer_bytes"]
    for r in results.values():
        assert r["seconds"] > 0 and r["bytes_per_s"] == pytest.approx(r["bytes"] / r["seconds"])
    assert [line.split()[0] for line in proc.stderr.splitlines()] == list(results)
