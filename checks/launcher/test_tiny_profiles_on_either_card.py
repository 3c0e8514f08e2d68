"""The tiny test profiles on the card that comes: a call for the lent H200 may be
served by an H100, and h200-tiny / h200-tiny-pp3 take either as they are.

Judged from replayed facts of each card (h200_tiny_facts.py: the H200's NVML
recording; the H100's name and total as nvidia-smi showed them, the rest marked)
against the skeleton's tiny variant (8 layers; 12 for PP=3, as the harness's
checkpoint): preflight's GPU checks pass on both, the plan's command is the same
on both (so every harness's engines are the same, whichever card ran them), the
roofline takes the card's own bandwidth, and a smaller card or a MIG slice is
refused by the profile's whole-card rule (gpu.min_memory_bytes) with a message
that names it.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.profiles import available_profiles
from h200_tiny_facts import CARDS, H100_NAME, h200_facts

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "checks" / "fixtures" / "standin_vllm"))
sys.path.insert(0, str(REPO / "checks" / "gpu" / "pp3"))
from emulation import replicate_gpu  # noqa: E402
from harness import free_port  # noqa: E402

# profile -> (layers of its checkpoint, GPUs the harness replays the one card as)
PROFILES = {"h200-tiny": (8, 1), "h200-tiny-pp3": (12, 3)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """profile -> (model, table) of the tiny skeleton with the profile's layers."""
    from flashnext.skeleton import write_skeleton

    root = tmp_path_factory.mktemp("either-card")
    out = {}
    for profile, (layers, _) in PROFILES.items():
        model = root / f"tiny{layers}"
        write_skeleton(model, "tiny", fixed_metadata=True, num_hidden_layers=layers)
        table = root / "tables" / f"tiny{layers}.bin"
        table.parent.mkdir(exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "flashnext", "table", "prepare", "--model", str(model),
             "--out", str(table), "--force"],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
        out[profile] = (model, table)
    return out


def replayed(
    tmp_path: Path, checkpoints, profile: str, card: str, edit=None, port: int | None = None
) -> list[str]:
    """The arguments of preflight/plan on replayed facts of `card` (as the harness
    replays it: once, or three times for PP=3), `edit` applied to the one card."""
    model, table = checkpoints[profile]
    port = port or free_port()
    facts = h200_facts(model, table, port, card=card)
    if edit:
        edit(facts["gpu"]["devices"][0])
    gpus = PROFILES[profile][1]
    facts = replicate_gpu(facts, gpus) if gpus > 1 else facts
    path = tmp_path / f"facts-{profile}-{card}.json"
    path.write_text(json.dumps(facts))
    return ["--facts", str(path), "--profile", profile, "--model", str(model),
            "--table", str(table), "--port", str(port)]  # fmt: skip


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def preflight(args: list[str]) -> tuple[int, dict]:
    result = invoke("preflight", *args, "--json")
    return result.exit_code, json.loads(result.output)


@pytest.mark.parametrize("profile", PROFILES)
def test_preflight_passes_on_either_card(profile, checkpoints, tmp_path):
    for card in CARDS:
        code, doc = preflight(replayed(tmp_path, checkpoints, profile, card))
        findings = {f["id"]: f for f in doc["findings"]}
        assert code == 0, (card, [f for f in doc["findings"] if f["level"] == "fail"])
        assert findings["gpu.count"]["level"] == "ok"
        assert findings["gpu.count"]["required"] == f"{PROFILES[profile][1]}x H200 or H100"
        for index in range(PROFILES[profile][1]):
            vram = findings[f"gpu{index}.vram"]
            assert vram["level"] == "ok" and vram["required"] == ">= 75.00 GiB"
        # the H100's link was never recorded: preflight says so, and only warns
        pcie = findings["gpu0.pcie"]["level"]
        assert pcie == ("ok" if card == "H200" else "warn")


@pytest.mark.parametrize("profile", PROFILES)
def test_the_command_is_the_same_on_either_card(profile, checkpoints, tmp_path):
    plans, port = {}, free_port()
    for card in CARDS:
        args = replayed(tmp_path, checkpoints, profile, card, port=port)
        result = invoke("plan", *args, "--json")
        assert result.exit_code == 0, result.output
        plans[card] = json.loads(result.output)
    h200, h100 = plans["H200"], plans["H100"]
    assert h100["argv"] == h200["argv"] and h100["env"] == h200["env"]
    # what differs is the card's own: its memory, and the roofline's bandwidth
    h100_card = available_profiles()[profile].gpu.other_cards[0]
    assert json.dumps(h100).count(str(h100_card.bandwidth_bytes_per_s)) >= 1
    assert str(h100_card.bandwidth_bytes_per_s) not in json.dumps(h200)


def _mig_slice(device: dict) -> None:
    """An H100's half as NVML shows a MIG instance: its own name, 40 GiB."""
    device.update(name=f"{H100_NAME} MIG 3g.40gb", memory_total_bytes=40 << 30)
    device["memory_free_bytes"] = (40 << 30) - (1 << 30)


def _a100(device: dict) -> None:
    device.update(name="NVIDIA A100-SXM4-80GB", compute_capability="8.0")


def test_a_mig_slice_is_refused_by_the_whole_card_rule(checkpoints, tmp_path):
    code, doc = preflight(replayed(tmp_path, checkpoints, "h200-tiny", "H100", _mig_slice))
    vram = next(f for f in doc["findings"] if f["id"] == "gpu0.vram")
    assert code == 1 and vram["level"] == "fail"
    assert vram["message"] == (
        "GPU 0 has 40.00 GiB; profile h200-tiny needs H200 or H100 cards of at least 75.00 GiB"
    )
    assert vram["fix"] == (
        "run on whole H200 or H100 cards (not a MIG slice), or pick a --profile for your cards"
    )


def test_another_card_is_refused_by_name(checkpoints, tmp_path):
    args = replayed(tmp_path, checkpoints, "h200-tiny", "H100", _a100)
    code, doc = preflight(args)
    count = next(f for f in doc["findings"] if f["id"] == "gpu.count")
    assert code == 1 and count["level"] == "fail" and count["required"] == "1x H200 or H100"
    result = invoke("plan", *args, "--json")
    assert result.exit_code == 1
    assert "profile h200-tiny is for 1x H200 or H100, the facts show 1x NVIDIA A100" in (
        result.output
    )


def test_the_roofline_takes_the_slowest_card_the_facts_show():
    from flashnext.facts.schema import host_facts_from_json
    from flashnext.plan.planner import _bandwidth
    from h200_tiny_facts import h100_gpu, h200_gpu
    from lead_fixtures import BASE_FILE

    def facts_with(gpu: dict):  # the recorded 3x3090 host's facts with these GPUs
        doc = json.loads(Path(BASE_FILE).read_text()) | {"gpu": gpu}
        return host_facts_from_json(json.dumps(doc), source="replayed")

    profile = available_profiles()["h200-tiny-pp3"]
    mixed = h200_gpu()
    mixed["devices"].append(copy.deepcopy(h100_gpu()["devices"][0]) | {"index": 1})
    assert _bandwidth(facts_with(mixed), profile) == 3_350_000_000_000
    assert _bandwidth(facts_with(h200_gpu()), profile) == profile.gpu.bandwidth_bytes_per_s
    # no card of the profile in the facts: the profile's own card's figure
    assert _bandwidth(facts_with({"devices": []}), profile) == profile.gpu.bandwidth_bytes_per_s
