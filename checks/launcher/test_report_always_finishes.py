"""Issue 39, class 9: `report` always finishes, and each part it cannot assess says why.

The broken checkpoints and facts of classes 3-5 are what users attach to bug
reports: a FIFO or hostile JSON in the checkpoint, a quantization_config of the
wrong shape, a shard deleted with its index entries, facts no host could report.
Real subprocesses with a deadline: a hang fails the test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from flashnext.skeleton import write_skeleton

FACTS = Path(__file__).resolve().parents[1] / "fixtures" / "facts" / "3x3090-nvme.json"


@pytest.fixture(scope="module")
def fixed_tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("report") / "fixed"
    write_skeleton(path, "tiny", fixed_metadata=True)
    return path


def fifo_config(model: Path, tmp_path: Path) -> str:
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    return "config.json: not a regular file"


def deep_index(model: Path, tmp_path: Path) -> str:
    (model / "model.safetensors.index.json").write_text("[" * 50_000 + "]" * 50_000)
    return "nested too deeply"


def groups_as_list(model: Path, tmp_path: Path) -> str:
    config = json.loads((model / "config.json").read_text())
    q = config["quantization_config"]
    q["config_groups"] = list(q["config_groups"].values())
    (model / "config.json").write_text(json.dumps(config))
    return "quantization_config.config_groups is a list"


def impossible_facts(model: Path, tmp_path: Path) -> str:
    doc = json.loads(FACTS.read_text())
    doc["memory"]["cpu_count"] = 0
    (tmp_path / "facts.json").write_text(json.dumps(doc))
    return "no host reports this: memory.cpu_count is 0"


@pytest.mark.parametrize("damage", [fifo_config, deep_index, groups_as_list, impossible_facts])
def test_report_finishes_and_names_why(fixed_tiny, tmp_path, damage):
    model = tmp_path / "m"
    shutil.copytree(fixed_tiny, model)
    shutil.copy(FACTS, tmp_path / "facts.json")
    why = damage(model, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "flashnext", "report", "--facts", str(tmp_path / "facts.json"),
         "--model", str(model)],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    doc = json.loads(proc.stdout)
    reasons = [doc[part].get("unavailable", "") for part in ("facts", "plan", "preflight")
               if isinstance(doc[part], dict)]  # fmt: skip
    assert any(why in r for r in reasons), reasons
    assert doc["versions"] and doc["patch_series"]  # the parts it could assess are there
