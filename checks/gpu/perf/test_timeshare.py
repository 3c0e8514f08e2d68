"""timeshare.py and the shared-GPU calibration's verdict, by hand. Every
interval and time below is made up for the test (not a measurement)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "common"))

import shared_gpu_calibration  # noqa: E402
import timeshare  # noqa: E402
from tiny_plan import in_vllm_last_json  # noqa: E402

MS = 1_000_000  # ns


def kernels(*spans, nccl=False):
    return timeshare.Kernels([a * MS for a, _ in spans], [b * MS for _, b in spans],
                             [nccl] * len(spans))  # fmt: skip


def test_sharing_divides_each_instant_by_the_ranks_in_flight():
    # rank 0 computes 0-10 ms; rank 1's NCCL kernel spins 5-20 ms (the
    # pipeline's wait: not its compute, but work on the card); rank 2 computes 8-12.
    got = timeshare.sharing({0: kernels((0, 10)), 1: kernels((5, 20), nccl=True),
                             2: kernels((8, 12))})  # fmt: skip
    # rank 0: 0-5 alone, 5-8 beside rank 1 (1/2), 8-10 beside both (1/3)
    assert got[0]["busy_ms"] == pytest.approx(10)
    assert got[0]["alone_ms"] == pytest.approx(5)
    assert got[0]["fair_ms"] == pytest.approx(5 + 3 / 2 + 2 / 3)
    assert got[0]["shared_fraction"] == pytest.approx(0.5)
    # rank 2: 8-10 beside both, 10-12 beside rank 1's spin
    assert got[2]["busy_ms"] == pytest.approx(4) and got[2]["alone_ms"] == 0
    assert got[2]["fair_ms"] == pytest.approx(2 / 3 + 1)
    assert got[1]["busy_ms"] == 0 and got[1]["shared_fraction"] is None


def test_a_ranks_own_kernels_count_once_back_to_back_or_on_two_streams():
    back_to_back = timeshare.sharing({0: kernels((0, 5), (5, 10))})[0]
    assert back_to_back == {"busy_ms": 10, "alone_ms": 10, "fair_ms": 10, "shared_fraction": 0}
    two_streams = timeshare.sharing({0: kernels((0, 6), (4, 10)), 1: kernels((20, 30))})[0]
    assert two_streams["busy_ms"] == 10 and two_streams["fair_ms"] == 10
    with pytest.raises(ValueError):
        timeshare.Kernels([0], [1, 2], [False])


def test_attach_sharing_scales_each_ranks_compute_by_its_shares_in_the_common_span():
    def profile(rank, spans, nccl=False):
        return {"rank": rank, "steps": 2, "compute_ms_per_step": 6.0,
                "kernels": vars(kernels(*spans, nccl=nccl))}  # fmt: skip

    # rank 0 profiled from 0 ms, rank 1 from 4 (its first decode step came later):
    # only 4-12 is seen by both, and rank 0's 0-4 is not judged
    ranks = [profile(0, [(0, 8), (10, 12)]), profile(1, [(4, 12)], nccl=True),
             {"rank": 2, "error": "not profiled"}]  # fmt: skip
    assert timeshare.common_window({r["rank"]: timeshare.Kernels(**r["kernels"])
                                    for r in ranks[:2]}) == (4 * MS, 12 * MS)  # fmt: skip
    out = timeshare.attach_sharing(ranks)
    assert all("kernels" not in p for p in out)
    # in 4-12: rank 0 busy 4-8 and 10-12 = 6 ms, all beside rank 1: fair 3, alone 0
    assert out[0]["time_sharing"] == {"busy_ms_per_step": 6.0, "alone_ms_per_step": 0.0,
                                      "fair_ms_per_step": 3.0, "shared_fraction": 1.0,
                                      "window_ms": 8.0, "ranks": 2}  # fmt: skip
    assert "time_sharing" not in out[1]  # no compute kernels (its NCCL spin only)
    assert out[2] == {"rank": 2, "error": "not profiled"}
    # one rank alone has nothing to share with: no figures
    assert "time_sharing" not in timeshare.attach_sharing([profile(0, [(0, 8)])])[0]


def _condition(spinners, kernel_sum, fair, span):
    return {"spinners": spinners, "kernel_sum_ms": kernel_sum, "fair_ms": fair, "span_ms": span}


def test_calibration_names_the_reading_that_recovers_the_time_alone():
    # the card inflates a shared kernel's duration: fair recovers the 20 ms alone
    inflating = [_condition(0, 20.0, 20.0, 22.0), _condition(1, 41.0, 20.5, 44.0),
                 _condition(2, 62.0, 21.0, 66.0)]  # fmt: skip
    got = shared_gpu_calibration.verdict(inflating)
    assert got["model"] == "fair" and got["inflation"] == {1: 2.05, 2: 3.1}
    assert got["span_inflation"] == {1: 2.0, 2: 3.0}
    # durations stay the kernels' own (the other process only delays their start)
    delaying = [_condition(0, 20.0, 20.0, 22.0), _condition(1, 21.0, 10.5, 44.0),
                _condition(2, 20.5, 7.0, 66.0)]  # fmt: skip
    assert shared_gpu_calibration.verdict(delaying)["model"] == "busy"
    # neither: the contract keeps busy and calls it an upper bound
    neither = [_condition(0, 20.0, 20.0, 22.0), _condition(1, 30.0, 15.0, 44.0)]
    assert shared_gpu_calibration.verdict(neither)["model"] is None


# The real profiler API timeshare reads (kineto_results.events(), absolute
# start_ns/end_ns): a CPU run records no GPU activity; GPU events, which cannot
# exist here, are replayed in the same schema to check the filter.
KINETO = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from torch.autograd import DeviceType
import timeshare

with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    torch.ones(64).sum()
real = timeshare.kernels_of(prof)
cpu_events = len(prof.profiler.kineto_results.events())

class Event:
    def __init__(self, name, device, start, end, annotation=False):
        self._v = (name, device, start, end, annotation)
    def name(self): return self._v[0]
    def device_type(self): return self._v[1]
    def start_ns(self): return self._v[2]
    def end_ns(self): return self._v[3]
    def is_user_annotation(self): return self._v[4]

class Prof:
    class profiler:
        class kineto_results:
            @staticmethod
            def events():
                return [Event("Marlin", DeviceType.CUDA, 10, 30),
                        Event("ncclDevKernel_Broadcast_RING_LL", DeviceType.CUDA, 5, 90),
                        Event("nccl:broadcast", DeviceType.CUDA, 5, 90, annotation=True),
                        Event("aten::sum", DeviceType.CPU, 0, 100),
                        Event("empty", DeviceType.CUDA, 40, 40)]
print(json.dumps({"real": vars(real), "cpu_events": cpu_events,
                  "replayed": vars(timeshare.kernels_of(Prof()))}))
"""


def test_kernels_of_reads_the_profilers_absolute_gpu_intervals():
    got = in_vllm_last_json("-c", KINETO, str(HERE))
    assert got["cpu_events"] > 0
    assert got["real"] == {"starts_ns": [], "ends_ns": [], "nccl": []}
    # kernels only: not the annotation over the broadcast, not CPU ops, not empty spans
    assert got["replayed"] == {"starts_ns": [10, 5], "ends_ns": [30, 90], "nccl": [False, True]}
