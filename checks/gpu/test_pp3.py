"""CPU tests of the PP=3-on-one-GPU harness (checks/gpu/pp3).

The shim is tried against the real vLLM 0.33.0 ParallelConfig, and the
layer comparison on capture files in the schema capture.dump writes, both in
the pinned vLLM env's python (torch; FLASHNEXT_VLLM_PY, which checks/run
sets). The engine specs need neither.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

PP3 = Path(__file__).resolve().parent / "pp3"
sys.path.insert(0, str(PP3))

import orchestrate  # noqa: E402


def vllm_python() -> str:
    py = os.environ.get("FLASHNEXT_VLLM_PY")
    if not py:
        pytest.skip("FLASHNEXT_VLLM_PY is not set (checks/run sets it to the pinned vLLM env)")
    return py


SHIM_PROBE = """
import os
from vllm.config import ParallelConfig
config = ParallelConfig(pipeline_parallel_size=3, distributed_executor_backend="mp")
print(config.get_local_gpu_index(2), os.environ.get("NCCL_HOSTID"))
"""


@pytest.mark.parametrize(
    ("switch", "expected"), [(None, "2 None"), ("1", "0 flashnext-onegpu-rank2")]
)
def test_the_one_gpu_shim_acts_only_when_asked(switch, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHNEXT_PP_ONE_GPU", "NCCL_HOSTID")}
    env |= {"PYTHONPATH": str(PP3 / "onegpu"), "VLLM_TARGET_DEVICE": "cpu"}
    if switch:
        env["FLASHNEXT_PP_ONE_GPU"] = switch
    out = subprocess.run(
        [vllm_python(), "-c", SHIM_PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == expected


# The launcher's `vllm serve` names no executor backend: on one CUDA GPU, vLLM
# refuses a world size of 3 unless the shim picks "mp" (the platform is made to
# claim one CUDA device, as the lent host has).
BACKEND_PROBE = """
from vllm.platforms import current_platform
platform = type(current_platform)
platform.is_cuda = lambda self: True
platform.device_count = classmethod(lambda cls: 1)
from vllm.config import ParallelConfig
try:
    pp3 = ParallelConfig(pipeline_parallel_size=3).distributed_executor_backend
except Exception as exc:
    pp3 = "refused: " + str(exc).splitlines()[1].split(" in this node")[0].strip()
print(pp3, "|", ParallelConfig().distributed_executor_backend)
"""


@pytest.mark.parametrize(
    ("switch", "expected"),
    [
        (
            None,
            "refused: Value error, World size (3) is larger than the number of available GPUs "
            "(1) | uni",
        ),
        ("1", "mp | uni"),
    ],
)
def test_the_shim_picks_mp_when_serve_names_no_backend(switch, expected):
    env = {k: v for k, v in os.environ.items() if k != "FLASHNEXT_PP_ONE_GPU"}
    env |= {"PYTHONPATH": str(PP3 / "onegpu"), "VLLM_TARGET_DEVICE": "cpu"}
    if switch:
        env["FLASHNEXT_PP_ONE_GPU"] = switch
    out = subprocess.run(
        [vllm_python(), "-c", BACKEND_PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == expected


def test_the_shim_imports_nothing_of_vllm_itself():
    """The launcher and the bench client run under the shim's env too: vLLM is patched
    when it is imported, never imported by the shim."""
    from emulation import shim_env

    env = os.environ | shim_env(None)
    out = subprocess.run(
        [sys.executable, "-c", "import sys; print(sorted(m for m in sys.modules if 'vllm' in m))"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


CAPTURES = """
import json, sys, torch
from pathlib import Path
root = Path(sys.argv[1])
hidden = 6
pos = torch.arange(10)
ids = torch.arange(100, 110)
rows = torch.randn(10, hidden, generator=torch.Generator().manual_seed(0))
def write(run, files):
    (root / f"{run}.out.json").write_text(json.dumps(
        {"run": run, "cases": {"10x1": {"output_ids": [[1, 2]]}}}))
    for rank, points in enumerate(files):
        # engine.py's names: OUT.<case>.rank<R>.pt beside OUT.json
        torch.save(points, root / f"{run}.out.10x1.rank{rank}.pt")
ref = {"layer.0.out": (pos, ids, rows), "layer.1.out": (pos, ids, rows * 2)}
write("ref", [ref])
# PP=3-like: the layers in two files, tokens in another order, one token of
# layer 1 changed from position 7 on, and a duplicated key (dropped).
order = torch.tensor([3, 1, 2, 0, 4, 5, 6, 7, 8, 9, 9])
changed = rows * 2
changed[7] += 1.0
write("other", [{"layer.0.out": (pos[order], ids[order], rows[order])},
                {"layer.1.out": (pos[order], ids[order], changed[order])}])
sys.path.insert(0, sys.argv[2])
from compare import compare_runs
print(json.dumps(compare_runs(root / "ref.out.json", root / "other.out.json")))
"""


def test_the_comparison_matches_tokens_across_ranks_and_orders(tmp_path):
    out = subprocess.run(
        [vllm_python(), "-c", CAPTURES, str(tmp_path), str(PP3)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    case = json.loads(out.stdout)["cases"]["10x1"]
    layer0, layer1 = case["points"]["layer.0.out"], case["points"]["layer.1.out"]
    # position 9 appears twice in the other run: dropped from the comparison
    assert layer0["tokens"] == 9 and layer0["only_ref"] == 1
    assert layer0["max_rel"] == 0.0 and layer0["first_parting_position"] is None
    assert layer1["first_parting_position"] == 7 and layer1["max_rel"] > 0.1
    assert layer1["identical_frac"] == pytest.approx(8 / 9)
    assert case["ids_equal"] and case["missing"] == []


def test_only_pp3_engines_get_the_one_gpu_environment():
    args = SimpleNamespace(model=Path("/m"), stock_model=Path("/s"), tables=Path("/t"))
    specs = {e.name: orchestrate.spec_for(e, args) for e in orchestrate.diagnose_engines()}
    for name, spec in specs.items():
        emulated = spec["env"].get("FLASHNEXT_PP_ONE_GPU") == "1"
        assert emulated == (spec["pp"] == 3), name
    stock = specs["pp3-stock"]
    assert (stock["model"], stock["load_format"], stock["table"]) == ("/s", "dummy", None)
    assert specs["pp1-ref"]["capture"] and specs["pp1-ref"]["table"] == "/t/ple-packed.bin"
    assert specs["pp3-v1"]["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_every_probe_an_engine_asks_for_exists():
    import capture

    in_place = {"none", "recv", "pre_forward", "post_forward", "sample", "layers"}
    unknown = set(orchestrate.SYNC_PROBES) - in_place - set(capture._PROBES)
    assert unknown == set()
