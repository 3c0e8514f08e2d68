"""checks/gpu/soak/campaign and poll, the order of their steps and how they end: the
GPU scripts they run are replaced by a recorder (each is tested on its own against the
stand-in: test_soak_pp3_script.py, test_faults_pp1_script.py), so these tests see only
what the campaign decides. Both mends came of run h3: the faults started beside the soak
were refused by preflight for the soak's processes on the card, and a campaign that died
at once left `poll` waiting out its whole bound."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CAMPAIGN = REPO / "checks" / "gpu" / "soak" / "campaign"
POLL = REPO / "checks" / "gpu" / "soak" / "poll"

# python3 as the kit's env puts it first on PATH: it records each call's start and end
# and leaves what the campaign reads next (a checkpoint, a results file, a faults file)
RECORDER = r"""#!/usr/bin/env bash
echo "start $(basename "$1") ${2:-}" >> "$CALLS"
case "$(basename "$1")" in
  tiny_model.py) [ -n "${FAIL_TINY:-}" ] && exit 3; mkdir -p "$2" && touch "$2/config.json" ;;
  soak_pp3.py) sleep 1; mkdir -p "$RESULTS_DIR" && echo '{}' > "$RESULTS_DIR/soak-$5.json"
    [ -n "${FAIL_SOAK:-}" ] && exit 1 ;;
  faults_pp1.py) [ "$2" = merge ] || { mkdir -p "$4" && echo '{}' > "$4/faults-pp1-$5.json"; } ;;
esac
echo "end $(basename "$1")" >> "$CALLS"
"""


def kit(tmp_path: Path) -> dict[str, str]:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "python3").write_text(RECORDER)
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 81559 MiB'\n")
    for tool in fake_bin.iterdir():
        tool.chmod(0o755)
    (tmp_path / "kit").mkdir()
    (tmp_path / "kit" / "env-patched.sh").write_text(f'export PATH="{fake_bin}:$PATH"\n')
    (tmp_path / "out").mkdir()
    return {**os.environ, "KIT": str(tmp_path / "kit"), "WORK": str(tmp_path / "work"),
            "CAMP": str(tmp_path / "camp"), "RESULTS_DIR": str(tmp_path / "results"),
            "CALLS": str(tmp_path / "calls"), "OUT": str(tmp_path / "out")}  # fmt: skip


def campaign(env: dict[str, str], **more: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CAMPAIGN), "t1"], env={**env, **more}, timeout=60,
                          capture_output=True, text=True)  # fmt: skip


def calls(env: dict[str, str]) -> list[str]:
    return Path(env["CALLS"]).read_text().splitlines()


def test_the_faults_start_after_the_soak_has_ended_and_both_are_merged(tmp_path):
    env = kit(tmp_path)
    assert campaign(env).returncode == 0
    assert calls(env) == [
        "start tiny_model.py " + env["WORK"] + "/pp1/tiny", "end tiny_model.py",
        "start tiny_model.py " + env["WORK"] + "/pp3/tiny12", "end tiny_model.py",
        "start soak_pp3.py " + env["WORK"] + "/pp3/tiny12", "end soak_pp3.py",
        "start faults_pp1.py " + env["WORK"] + "/pp1/tiny", "end faults_pp1.py",
        "start faults_pp1.py merge", "end faults_pp1.py",
    ]  # fmt: skip
    camp = Path(env["CAMP"])
    assert (camp / "DONE").read_text().strip() == "0"
    assert (camp / "soak-t1.json").exists()  # the merge's target, copied from the results

    Path(env["CALLS"]).unlink()  # a second run on the same machine keeps the checkpoints
    assert campaign(env, ONLY="faults").returncode == 0
    assert calls(env) == ["start faults_pp1.py " + env["WORK"] + "/pp1/tiny", "end faults_pp1.py"]
    assert "reusing " + env["WORK"] + "/pp1/tiny" in (camp / "log").read_text()


def test_a_campaign_that_fails_early_says_so_and_poll_stops_at_once(tmp_path):
    env = kit(tmp_path)
    assert campaign(env, FAIL_TINY="1").returncode == 1
    camp = Path(env["CAMP"])
    assert (camp / "DONE").read_text().strip() == "1"
    assert "ended rc=1" in (camp / "log").read_text()

    begun = time.monotonic()
    poll = subprocess.run(["bash", str(POLL), "60"], env=env, timeout=30, capture_output=True,
                          text=True)  # fmt: skip
    assert time.monotonic() - begun < 15
    assert "campaign: DONE (rc 1)" in poll.stdout
    assert (tmp_path / "out" / "camp.tgz").stat().st_size > 0


def test_poll_stops_when_the_campaign_is_gone_without_its_done(tmp_path):
    """A campaign killed outright (SIGKILL, the machine's OOM killer) writes no DONE."""
    env = kit(tmp_path)
    camp = Path(env["CAMP"])
    camp.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (camp / "pid").write_text(f"{dead.pid}\n")
    begun = time.monotonic()
    poll = subprocess.run(["bash", str(POLL), "60"], env=env, timeout=30, capture_output=True,
                          text=True)  # fmt: skip
    assert time.monotonic() - begun < 15
    assert "campaign: died without DONE" in poll.stdout


def test_a_failed_half_still_lets_the_other_run_and_the_campaign_says_it_failed(tmp_path):
    env = kit(tmp_path)
    assert campaign(env, FAIL_SOAK="1").returncode == 1
    assert "start faults_pp1.py " + env["WORK"] + "/pp1/tiny" in calls(env)
    camp = Path(env["CAMP"])
    assert (camp / "DONE").read_text().strip() == "1"
    assert "soak_pp3 rc=1" in (camp / "log").read_text()
