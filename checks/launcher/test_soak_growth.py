"""Issue 41 item 3, no growth: the judge on made-up samples exactly, then `bench --soak
--soak-idle` against the stand-in `vllm`, once well behaved and once leaking."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "standin_vllm"))
from flashnext.cli import main  # noqa: E402
from flashnext.tools import growth  # noqa: E402
from harness import start_standin  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30


def samples(rss, pinned, gpu, times):
    """One sample per time; each quantity a function of t (None: not measured)."""
    out = []
    for t in times:
        row = {"t_s": t, "unavailable": {}}
        for key, fn in (("rss_bytes", rss), ("pinned_bytes", pinned), ("gpu_used_bytes", gpu)):
            row[key] = fn(t)
        if gpu(t) is None:
            row["unavailable"]["gpu"] = "NVML: libnvidia-ml.so.1 not found"
        out.append(row)
    return out


# a 10 s soak, interval 2 s, counters settled at 11 s, then 6 s idle: samples every 0.5 s
TIMES = [i / 2 for i in range(0, 35)]


def judge(rows):
    return growth.judge(rows, interval_s=2.0, soak_end_s=10.0, idle_from_s=11.0, idle_s=6.0)


def test_noise_within_the_bounds_is_ok_and_a_drop_is_never_growth():
    rss = lambda t: 2 * GIB + (200 * MIB if t >= 11 else 0) + int(t * 7) % 3 * MIB  # noqa: E731
    pinned = lambda t: 3 * GIB  # noqa: E731
    gpu = lambda t: 40 * GIB + (100 * MIB if t >= 11 else 500 * MIB)  # noqa: E731 (a drop)
    v = judge(samples(rss, pinned, gpu, TIMES))
    assert {k: v[k]["verdict"] for k in growth.FIELDS} == {"rss": "ok", "pinned": "ok", "gpu": "ok"}
    assert v["rss"]["bound"] == 256 * MIB + int(0.05 * v["rss"]["after_warmup"])
    assert v["pinned"]["bound"] == 0 and v["gpu"]["grew_by"] == -400 * MIB
    # the levels are medians of their windows: [2, 4) after warm-up, [14, inf) after idle
    assert v["windows_s"] == {"after_warmup": [2.0, 4.0], "after_idle": [14.0, None]}
    assert v["pinned"]["after_warmup"] == v["pinned"]["after_idle"] == 3 * GIB
    assert not growth.any_grew(v)


def test_growth_past_each_bound_is_caught():
    rss = lambda t: 2 * GIB + (t >= 11) * (256 * MIB + int(0.05 * 2 * GIB) + 1)  # noqa: E731
    pinned = lambda t: 3 * GIB + (t >= 11) * 4096  # one page pinned for good  # noqa: E731
    gpu = lambda t: 40 * GIB + (t >= 11) * 129 * MIB  # noqa: E731
    v = judge(samples(rss, pinned, gpu, TIMES))
    assert {k: v[k]["verdict"] for k in growth.FIELDS} == {
        "rss": "grew", "pinned": "grew", "gpu": "grew"
    }  # fmt: skip
    assert v["pinned"]["grew_by"] == 4096 and "over the bound" in v["pinned"]["why"]
    assert growth.any_grew(v)


def test_one_sample_spike_does_not_decide_a_level():
    spike = lambda t: 2 * GIB + (GIB if t in (2.0, 15.0) else 0)  # noqa: E731
    v = judge(samples(spike, lambda t: 0, lambda t: 0, TIMES))
    assert v["rss"]["after_warmup"] == v["rss"]["after_idle"] == 2 * GIB


def test_a_quantity_not_measured_is_unknown_with_the_reason():
    v = judge(samples(lambda t: GIB, lambda t: 0, lambda t: None, TIMES))
    assert v["gpu"]["verdict"] == "unknown" and v["gpu"]["bound"] is None
    assert v["gpu"]["why"] == "not measurable: NVML: libnvidia-ml.so.1 not found"
    assert v["rss"]["verdict"] == "ok"
    # a soak too short for a sample after warm-up says so
    short = growth.judge(samples(lambda t: GIB, lambda t: 0, lambda t: 0, [0.0, 0.5]),
                         interval_s=2.0, soak_end_s=1.0, idle_from_s=1.0, idle_s=0.0)  # fmt: skip
    assert short["rss"]["verdict"] == "unknown"
    assert "no sample after warm-up" in short["rss"]["why"]


# ---------------------------------------------------------------- against the stand-in


@pytest.fixture
def standin():
    procs = []

    def start(**env):
        proc, url = start_standin(max_model_len=2048, extra=("--max-num-seqs", "2"), **env)
        procs.append(proc)
        return proc, url

    yield start
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.wait(10)


def soak(url, *more):
    res = CliRunner().invoke(main, ["bench", "--url", url, "--soak", "4", "--soak-interval", "1",
                                    "--soak-max-tokens", "16", "--soak-long-prompt", "1000",
                                    "--soak-idle", "3", *more])  # fmt: skip
    return res


def test_a_soak_with_an_idle_stretch_reports_no_growth(standin):
    _, url = standin(STANDIN_TOKEN_INTERVAL_S="0.004")
    res = soak(url, "--json", "--fail-on-growth")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    g = doc["growth"]
    assert g["idle_s"] == 3 and g["rss"]["verdict"] == "ok", g
    assert g["pinned"]["verdict"] == "ok"
    assert g["gpu"]["verdict"] in ("ok", "unknown")  # NVML absent on a CPU host
    # the idle stretch was sampled: samples after the soak span, none sent then
    idle = [s for s in doc["samples"] if s["t_s"] >= g["windows_s"]["after_idle"][0]]
    assert len(idle) >= 2 and idle[-1]["t_s"] - doc["duration_s"] >= 3
    # and the table for people
    res = soak(url)
    assert res.exit_code == 0, res.output
    assert "memory growth after 3 s idle" in res.output and "256 MiB + 5%" in res.output


def test_a_leaking_server_is_caught_and_fails_only_when_asked(standin):
    _, url = standin(STANDIN_TOKEN_INTERVAL_S="0.004",
                     STANDIN_LEAK_BYTES_PER_REQUEST=str(8 * MIB))  # fmt: skip
    res = soak(url, "--json")
    assert res.exit_code == 0, res.output  # reported, not failed, without the flag
    g = json.loads(res.stdout)["growth"]
    assert g["rss"]["verdict"] == "grew", g["rss"]
    assert g["rss"]["grew_by"] > g["rss"]["bound"]
    res = soak(url, "--fail-on-growth")
    assert res.exit_code == 1
    assert "grew" in res.output
    assert "server memory grew past its bound (--fail-on-growth)" in res.output


def test_the_servers_own_gpu_memory_is_judged_where_nvml_sees_its_processes():
    # another process takes 2 GiB of the card during the soak and leaves 1 GiB behind:
    # the device's use grew, the server's own did not
    rows = samples(lambda t: 2 * GIB, lambda t: 0, lambda t: 40 * GIB + (t >= 11) * GIB, TIMES)
    for row in rows:
        row["gpu_tree_bytes"] = 30 * GIB
    v = judge(rows)
    assert v["gpu"]["field"] == "gpu_tree_bytes" and v["gpu"]["verdict"] == "ok"
    assert v["gpu"]["after_warmup"] == v["gpu"]["after_idle"] == 30 * GIB
    # one sample without the pids' share: the whole device's use decides, and it grew
    rows[3]["gpu_tree_bytes"] = None
    v = judge(rows)
    assert v["gpu"]["field"] == "gpu_used_bytes" and v["gpu"]["verdict"] == "grew"
