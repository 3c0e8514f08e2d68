"""Issue 39, classes 4-5: replayed facts that no host could report are refused, named,
before anything is planned on them (`--facts` with a hand-edited or damaged file)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from flashnext.facts.plausible import replayed_facts
from flashnext.facts.schema import FactsSchemaError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "facts" / "3x3090-nvme.json"
BASE = json.loads(FIXTURE.read_text())


def gpu(doc, i):
    return doc["gpu"]["devices"][i]


CASES = {
    "free memory over the total": (
        lambda d: d["memory"].update(mem_available_bytes=d["memory"]["mem_total_bytes"] + 1),
        "memory.mem_available_bytes 134217728001 is more than memory.mem_total_bytes 134217728000",
    ),
    "a soft memlock over the hard one": (
        lambda d: d["memory"].update(memlock_soft_bytes=2, memlock_hard_bytes=1),
        "memory.memlock_soft_bytes 2 is more than memory.memlock_hard_bytes 1",
    ),
    "no CPUs": (lambda d: d["memory"].update(cpu_count=0), "memory.cpu_count is 0"),
    "GPU free over total": (
        lambda d: gpu(d, 1).update(memory_free_bytes=gpu(d, 1)["memory_total_bytes"] + 1),
        "GPU 1: 25769803777 bytes free of 25769803776",
    ),
    "duplicate GPU UUIDs": (
        lambda d: gpu(d, 2).update(uuid=gpu(d, 0)["uuid"]),
        "two GPUs share the UUID GPU-00000000-0000-0000-0000-000000000000",
    ),
    "duplicate GPU indices": (lambda d: gpu(d, 2).update(index=1), "two GPUs share the index 1"),
    "a compute capability of banana": (
        lambda d: gpu(d, 0).update(compute_capability="banana"),
        "GPU 0: compute_capability 'banana' is not major.minor",
    ),
    "a P2P matrix with a pair left out": (
        lambda d: d["gpu"]["p2p"].pop(),
        "the P2P matrix leaves out the pair (1, 2)",
    ),
    "a P2P pair of unknown GPUs": (
        lambda d: d["gpu"]["p2p"].append({"gpu_a": 0, "gpu_b": 7, "status": "ok"}),
        "the P2P matrix names the pair (0, 7)",
    ),
    "nfs4 off the network": (
        lambda d: d["storage"]["table"].update(fs_type="nfs4", network=False),
        "storage.table: fs_type nfs4 is a network filesystem, but network is false",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_impossible_facts_are_refused(case, tmp_path):
    change, expected = CASES[case]
    doc = copy.deepcopy(BASE)
    change(doc)
    path = tmp_path / "facts.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(FactsSchemaError) as err:
        replayed_facts(str(path))
    message = str(err.value)
    assert message.startswith(f"{path}: no host reports this: ")
    assert expected in message
    assert message.endswith("record facts on the serving host with `flashnext facts --out FILE` "
                            "instead of editing them")  # fmt: skip


def test_the_recorded_fixture_is_possible():
    replayed_facts(str(FIXTURE))


def test_plan_refuses_them_without_a_traceback(tmp_path):
    from click.testing import CliRunner
    from flashnext.cli import main

    doc = copy.deepcopy(BASE)
    doc["memory"]["cpu_count"] = 0
    path = tmp_path / "facts.json"
    path.write_text(json.dumps(doc))
    result = CliRunner().invoke(main, ["plan", "--facts", str(path)], catch_exceptions=False)
    assert result.exit_code == 1
    assert f"{path}: no host reports this: memory.cpu_count is 0" in result.output
