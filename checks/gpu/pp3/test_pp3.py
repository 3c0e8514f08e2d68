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

PP3 = Path(__file__).resolve().parent
# compare.py and capture.py, shared with other harnesses
COMMON = PP3.parent / "common"
sys.path.insert(0, str(PP3))

import orchestrate  # noqa: E402
from tiny_plan import vllm_python  # noqa: E402  (checks/gpu/common, on the path by orchestrate)


def script_line(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    """A script's last line of output in the pinned vLLM env on CPU (vLLM may
    log on stdout before it); the script must succeed."""
    env = (os.environ if env is None else env) | {"VLLM_TARGET_DEVICE": "cpu"}
    out = subprocess.run(
        [vllm_python(), "-c", script, *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def script_json(script: str, *args: str):
    return json.loads(script_line(script, *args))


def shim_line(script: str, switch: str | None) -> str:
    """script_line with only the one-GPU shim on PYTHONPATH, switched on or not."""
    unset = ("FLASHNEXT_PP_ONE_GPU", "NCCL_HOSTID")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PYTHONPATH"] = str(PP3 / "onegpu")
    if switch:
        env["FLASHNEXT_PP_ONE_GPU"] = switch
    return script_line(script, env=env)


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
    assert shim_line(SHIM_PROBE, switch) == expected


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
    assert shim_line(BACKEND_PROBE, switch) == expected


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
    case = script_json(CAPTURES, str(tmp_path), str(COMMON))["cases"]["10x1"]
    layer0, layer1 = case["points"]["layer.0.out"], case["points"]["layer.1.out"]
    # position 9 appears twice in the other run: dropped from the comparison
    assert layer0["tokens"] == 9 and layer0["only_ref"] == 1
    assert layer0["max_rel"] == 0.0 and layer0["first_parting_position"] is None
    assert layer1["first_parting_position"] == 7 and layer1["max_rel"] > 0.1
    assert layer1["identical_frac"] == pytest.approx(8 / 9)
    assert case["ids_equal"] and case["missing"] == []


RANKS_AGREE = """
import json, sys, torch
from pathlib import Path
root = Path(sys.argv[1]); sys.path.insert(0, sys.argv[2])
from compare import STEPS, load_case, rank_agreement

# Two steps of one PP=3 engine: a prefill chunk, then a verify pair
# (p=12 sampled 7, p=13 drafted 70). Rank 2 takes the draft of another step (71).
def steps(draft):
    pos = torch.tensor(list(range(12)) + [12, 13])
    ids = torch.tensor([100 + p for p in range(12)] + [7, draft])
    info = torch.tensor([[1, 12]] * 12 + [[2, 2]] * 2)
    return (pos, ids, info)
for rank, draft in ((0, 70), (1, 70), (2, 71)):
    torch.save({STEPS: steps(draft)}, root / f"pp3.out.5x1.rank{rank}.pt")
torch.save({STEPS: steps(70)}, root / "pp1.out.5x1.rank0.pt")
print(json.dumps({"pp3": rank_agreement(load_case(root / "pp3.out.json", "5x1")),
                  "pp1": rank_agreement(load_case(root / "pp1.out.json", "5x1"))}))
"""


def test_the_ranks_agreement_on_each_steps_rows_is_checked_without_a_reference(tmp_path):
    """Every PP rank must run the same (position, id) rows in each step; a
    rank whose draft id comes from another step is named, with the row on
    the first rank and on it. PP=1 has nothing to compare."""
    r = script_json(RANKS_AGREE, str(tmp_path), str(COMMON))
    assert r["pp3"] == {
        "recorded": True,
        "ranks": 3,
        "steps": 2,
        "steps_differ": 1,
        "rows_differ": 1,
        "first": {"step": 2, "rank": 2, "first_rank_row": [13, 70], "rank_row": [13, 71]},
    }
    assert r["pp1"] == {"recorded": False, "ranks": 1}


CACHED = """
import json, subprocess, sys
from pathlib import Path
root, common, pp3 = (Path(a) for a in sys.argv[1:4])
subprocess.run([sys.executable, "-c", sys.argv[4], str(root), str(common)], check=True,
               capture_output=True)
sys.path.insert(0, str(pp3))
import orchestrate
from functools import partial
calls = []
def counted(*args):
    calls.append(args)
    return orchestrate.compare_runs(*args)
pair = [root / "ref.out.json", root / "other.out.json"]
def compare():
    return orchestrate.cached(root, "ref--other", pair, None, partial(counted, *pair, None))
first, again = compare(), compare()
# The other engine runs anew (its record changes): compared again.
record = json.loads(pair[1].read_text())
record["cases"]["10x1"]["output_ids"] = [[1, 3]]
pair[1].write_text(json.dumps(record))
third = compare()
print(json.dumps({"calls": len(calls), "same": first == again,
                  "ids_equal": [first["cases"]["10x1"]["ids_equal"],
                                third["cases"]["10x1"]["ids_equal"]]}))
"""


def test_a_later_call_takes_a_comparison_from_the_cache_until_an_engine_runs_anew(tmp_path):
    result = script_json(CACHED, str(tmp_path), str(COMMON), str(PP3), CAPTURES)
    assert result == {"calls": 2, "same": True, "ids_equal": [True, False]}


def test_only_pp3_engines_get_the_one_gpu_environment():
    plan = {"argv": ["vllm", "serve", "/m"], "env": {"VLLM_QSA_KV_OFFLOAD": "1"}}
    args = SimpleNamespace(model=Path("/m"), stock_model=Path("/s"), tables=Path("/t"), plan=plan)
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


def _verdict(first_over, equal=None):
    return {
        "equal": first_over is None if equal is None else equal,
        "first_layer_over_bound": first_over,
        "layer_max_rel": 0.0 if first_over is None else 0.5,
        "layer_mean_rel": 0.0 if first_over is None else 0.01,
        "ids_equal": True,
    }


def _equality_result(verdicts):
    return {
        "phase": "equality",
        "run_id": "t1",
        "emulated": True,
        "devices": 1,
        "cuda_launch_blocking": False,
        "series": {"series_sha256": "ab" * 32, "patches": ["0001-x.patch"]},
        "verdicts": verdicts,
    }


def test_contract_reports_each_mode_case_and_where_the_sensitivity_runs_were_caught(tmp_path):
    import contract

    verdicts = {
        "pp3-eager-vram": {"100x1": _verdict(None), "3000x4": _verdict("layer.3.qsa")},
        "pp3-graphs-offload-mtp": {"100x4": _verdict(None)},
        "boundary_shift": {"100x1": _verdict("layer.4.gdn"), "3000x1": _verdict("layer.4.gdn")},
        # Caught, but one layer late in one case: not where it acts.
        "drop_one_token": {"100x1": _verdict("layer.3.qsa"), "3000x1": _verdict("layer.3.moe")},
        "ab-offload": {"100x1": _verdict(None)},
        "spread-profile": {"20000x4": _verdict("layer.0.gdn")},
    }
    block = {"health": True, "smoke": True, "bench_c1_tok_s": 10.0, "bench_c4_tok_s": 30.0}
    serve = {"serve": block | {"clean_stop": True, "mtp_acceptance": 0.5}}
    pp3, ab = contract.build(_equality_result(verdicts), serve, ["checks/gpu/pp3/run equality t1"])
    assert (pp3["pp_size"], pp3["devices"], pp3["emulated"]) == (3, 1, True)
    assert pp3["cuda_launch_blocking"] is False and pp3["series_sha256"] == "ab" * 32
    runs = {(r["mode"], r["prompt_tokens"], r["batch"]): r for r in pp3["runs"]}
    assert runs[("eager-vram", 100, 1)]["equal_to_pp1"] is True
    over = runs[("eager-vram", 3000, 4)]
    assert over["equal_to_pp1"] is False and over["first_layer_over_bound"] == "layer.3.qsa"
    assert runs[("graphs-offload-mtp", 100, 4)]["graphs"] == "full_decode_only"
    assert pp3["sensitivity"] == {"drop_one_token_caught": False, "boundary_shift_caught": True}
    assert pp3["serve"]["bench_c4_tok_s"] == 30.0 and pp3["serve"]["mtp_acceptance"] == 0.5
    assert ab["pp_size"] == 1 and [r["mode"] for r in ab["runs"]] == ["QSA K/V offloaded vs VRAM"]
    # PP=1 against itself in the profile's mode: its own draft rows' parting.
    ((profile,),) = [pp3["spread_profile"]]
    assert (profile["graphs"], profile["batch"]) == ("full_decode_only", 4)
    assert profile["first_layer_over_bound"] == "layer.0.gdn" and pp3["spread"] == []


def test_contract_refuses_a_serve_result_without_the_serve_block(tmp_path):
    import contract

    with pytest.raises(SystemExit, match="lacks"):
        contract.build(_equality_result({}), {"steps": []}, ["x"])
    equality = tmp_path / "eq.json"
    equality.write_text(json.dumps(_equality_result({})))
    out = tmp_path / "out"
    out.mkdir()
    assert contract.main([str(equality), "--command", "c", "--out-dir", str(out)]) == 0
    written = json.loads((out / "pp3-t1.json").read_text())
    assert written["serve"] is None and written["sensitivity"]["boundary_shift_caught"] is None


def _moved_point(moved_mean):
    """A point whose only parting rows ran in another chunk in each engine."""
    return {
        "tokens": 10, "max_rel": 0.0, "mean_rel": 0.0, "max_row_mean_rel": moved_mean,
        "clean_row_max_rel": 0.0, "clean_row_mean_rel": 0.0,
        "loose_row_max_rel": 0.0, "loose_row_mean_rel": 0.0,
        "moved_tokens": 2, "moved_row_max_rel": 0.0, "moved_row_mean_rel": moved_mean,
    }  # fmt: skip


def _call(tmp_path, name, comparisons, **stamp):
    """One call's equality result, as orchestrate writes it, judged where it ran."""
    result = _equality_result(orchestrate.judge_all(comparisons)) | {
        "comparisons": comparisons,
        "engines": {n: {"ok": True} for c in comparisons.values() for n in (c["ref"], c["other"])},
        "compare_sha256": None,
    } | stamp  # fmt: skip
    path = tmp_path / name / "pp3_equality-t1.json"
    path.parent.mkdir()
    path.write_text(json.dumps(result))
    return path


def test_the_calls_of_one_run_on_two_machines_are_judged_as_one(tmp_path):
    """A machine lost between calls: the A/B ran on a fresh one, without the
    rechunked reference. Alone, its rows run in other chunks are held to
    rounding and part; with the first machine's `spread-schedule` they are
    held to twice the reference's own, as one machine would have judged."""
    import contract

    eager = f"pp1-{orchestrate.EAGER.name}"

    def pair(ref, other, moved_mean):
        case = {"points": {"layer.0.gdn": _moved_point(moved_mean)}, "ids_equal": True}
        return {"ref": ref, "other": other, "cases": {"3000x4": case}}

    first = _call(tmp_path, "call2", {"spread-schedule": pair(eager, f"{eager}-rechunk", 0.01)})
    ab = {"ab-offload": pair(eager, "pp1-eager-offload", 0.015)}  # within 2 x 0.01
    second = _call(tmp_path, "call3", ab)
    alone = json.loads(second.read_text())["verdicts"]["ab-offload"]["3000x4"]
    assert alone["first_layer_over_bound"] == "layer.0.gdn"
    out = tmp_path / "out"
    args = [str(first), str(second), "--command", "c", "--out-dir", str(out)]
    assert contract.main(args) == 0
    ((run,),) = [json.loads((out / "layer_ab-t1.json").read_text())["runs"]]
    assert run["equal_to_pp1"] is True
    written = json.loads((out / "pp3-t1.json").read_text())
    assert written["compared_in"] == {"spread-schedule": str(first), "ab-offload": str(second)}
    assert [c["engines"] for c in written["calls"]] == [
        sorted([eager, f"{eager}-rechunk"]),
        sorted([eager, "pp1-eager-offload"]),
    ]
    # Another kit's call, or one compared by another compare.py, is refused.
    other_series = _call(tmp_path, "other", ab, series={"series_sha256": "cd" * 32})
    with pytest.raises(SystemExit, match="series_sha256"):
        contract.main([str(first), str(other_series), "--command", "c", "--out-dir", str(out)])
    older = _call(tmp_path, "older", ab, compare_sha256="ef" * 32)
    with pytest.raises(SystemExit, match="another compare.py"):
        contract.main([str(older), "--command", "c", "--out-dir", str(out)])


def test_calls_on_two_kinds_of_card_are_not_one_run(tmp_path):
    """A call for the H200 may get an H100: its spreads do not bound the H200's
    comparisons, so the contract refuses to merge them; one card's calls merge, and
    the result names the card of each (card.py's record, as nvidia-smi showed them)."""
    import contract

    eager = f"pp1-{orchestrate.EAGER.name}"
    pair = {"ref": eager, "other": "pp1-eager-offload", "cases": {}}
    h200 = {"name": "NVIDIA H200", "memory_total_bytes": 143771 << 20}
    h100 = {"name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 81559 << 20}
    first = _call(tmp_path, "a", {"spread": pair | {"other": f"{eager}-again"}}, card=h200)
    same = _call(tmp_path, "b", {"ab-offload": pair}, card=h200)
    other = _call(tmp_path, "c", {"ab-offload": pair}, card=h100)
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="its card is 'NVIDIA H100 80GB HBM3', not 'NVIDIA H200'"):
        contract.main([str(first), str(other), "--command", "c", "--out-dir", str(out)])
    assert contract.main([str(first), str(same), "--command", "c", "--out-dir", str(out)]) == 0
    written = json.loads((out / "pp3-t1.json").read_text())
    assert written["card"] == h200 and [c["card"] for c in written["calls"]] == [h200, h200]
    assert json.loads((out / "layer_ab-t1.json").read_text())["card"] == h200


def test_a_call_on_a_fresh_machine_takes_every_spread_of_an_earlier_call(tmp_path):
    earlier = tmp_path / "pp3_equality-t1.json"
    spreads = {key: {"ref": key, "cases": {}} for key in orchestrate.SPREAD_KEYS}
    earlier.write_text(json.dumps({"comparisons": spreads | {"pp3-eager-vram": {"cases": {}}}}))
    taken = orchestrate.earlier_spreads(earlier)
    assert set(taken) == {"spread", "spread-schedule", "spread-profile"}
    assert all(c["from"] == str(earlier) for c in taken.values())


def _point(strict_max=0.0, strict_mean=0.0, loose_max=0.0, loose_mean=0.0):
    return {
        "tokens": 10, "max_rel": max(strict_max, loose_max), "mean_rel": strict_mean,
        "clean_row_max_rel": strict_max, "clean_row_mean_rel": strict_mean,
        "loose_row_max_rel": loose_max, "loose_row_mean_rel": loose_mean,
    }  # fmt: skip


def test_judge_holds_rows_before_the_spread_to_rounding_and_rows_past_it_to_the_spread():
    import compare

    one_case = {"tokens": 5, "max_rel": 0.3, "max_row_mean_rel": 0.01}
    other_case = {"tokens": 5, "max_rel": 0.1, "max_row_mean_rel": 0.02}
    spread = compare.spread_bounds(
        {"3000x1": {"points": {"layer.3.qsa": one_case}},
         "100x1": {"points": {"layer.3.qsa": other_case}}}
    )  # fmt: skip
    # The largest spread over the cases, per statistic, times the margin.
    assert spread == {"layer.3.qsa": (0.6, 0.04)}
    rounding = compare.BF16_ROW_MEAN / 2
    within = {"layer.2.gdn": _point(strict_mean=rounding), "layer.3.qsa": _point(loose_max=0.5)}
    verdict = compare.judge(within, spread)
    assert verdict["equal"] is True and verdict["first_layer_over_bound"] is None
    # Past the spread's parting, twice the spread is the limit.
    assert (
        compare.judge({"layer.3.qsa": _point(loose_max=0.7)}, spread)["first_layer_over_bound"]
        == "layer.3.qsa"
    )
    # Before it, the spread does not excuse anything.
    late = {"layer.2.gdn": _point(), "layer.3.qsa": _point(strict_mean=4 * compare.BF16_ROW_MEAN)}
    assert compare.judge(late, spread)["first_layer_over_bound"] == "layer.3.qsa"
    # The first point over its bound is named, not a later one.
    both = {"layer.1.moe": _point(strict_max=1.0), "layer.3.qsa": _point(strict_max=1.0)}
    assert compare.judge(both)["first_layer_over_bound"] == "layer.1.moe"
    assert compare.judge({})["equal"] is False  # nothing compared proves nothing


def test_the_profiles_comparisons_are_bounded_by_the_profiles_own_spread():
    """PP=3 in the profile's mode is held to the profile reference's spread
    past the indexer budget, the eager modes to the eager reference's."""

    def spread(max_rel):
        point = _point(loose_max=max_rel) | {"max_row_mean_rel": 0.01}
        return {"ref": "", "cases": {"3000x1": {"points": {"layer.3.qsa": point},
                                                "ids_equal": True}}}  # fmt: skip

    def compared(ref):
        return {"ref": ref, "cases": {"3000x1": {"points": {"layer.3.qsa": _point(loose_max=0.5)},
                                                  "ids_equal": True}}}  # fmt: skip

    profile, eager = (f"pp1-{m.name}" for m in (orchestrate.PROFILE, orchestrate.EAGER))
    verdicts = orchestrate.judge_all({
        "spread": spread(0.1),  # eager: 0.5 is past twice its 0.1
        "spread-profile": spread(0.3),  # the profile: within twice its 0.3
        "pp3-profile": compared(profile),
        "pp3-eager": compared(eager),
    })  # fmt: skip
    assert verdicts["pp3-profile"]["3000x1"]["equal"] is True
    assert verdicts["pp3-eager"]["3000x1"]["first_layer_over_bound"] == "layer.3.qsa"
    assert orchestrate.spread_key(profile) == "spread-profile"
    assert orchestrate.spread_key("pp1-eager-ple-vram") == "spread"


def ten_rows(seed: int, body: str) -> str:
    """A compare script over ten keyed rows of random data (`point(x)` keys x)."""
    head = f"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from compare import compare_case, judge
pos, ids = torch.arange(10), torch.arange(100, 110)
rows = torch.randn(10, 8, generator=torch.Generator().manual_seed({seed}))
def point(x):
    return (pos, ids, x)
"""
    return head + body


BOUNDARY = ten_rows(
    1,
    """
rounded = rows.clone()
rounded[5, 0] = rounded[5, 0] * (1 + 2**-8)   # one element, one bf16 ulp
later = rows.clone()
later[5:] += 0.5                               # what a recurrent layer makes of it
# Layer 1 starts a rank in the other engine: the reference fused its combine
# into the norm (mix_fused), the other mixed the materialized input (mix).
ref = {"layer.0.out": point(rows), "layer.1.mix": point(rows),
       "layer.1.mix_fused": point(rounded), "layer.1.gdn": point(rows)}
other = {"layer.0.out": point(rows), "layer.1.mix": point(rows), "layer.1.gdn": point(later)}
points = compare_case(ref, other)
print(json.dumps({"points": points, "verdict": judge(points),
                  "wrong": judge(compare_case(ref | {"layer.1.mix_fused": point(rows)}, other))}))
""",
)


def test_a_rank_boundary_judges_the_block_input_and_not_what_its_rounding_does_later(tmp_path):
    result = script_json(BOUNDARY, str(COMMON))
    block = result["points"]["layer.1.block_input"]
    assert block["first_parting_position"] == 5 and block["clean_row_max_rel"] < 0.05
    gdn = result["points"]["layer.1.gdn"]
    assert gdn["clean_before"] == 5 and gdn["clean_tokens"] == 5
    assert result["verdict"]["equal"] is True
    # Had both block inputs been the same, the later rows would be judged: caught.
    assert result["wrong"]["first_layer_over_bound"] == "layer.1.gdn"


ONE_ULP = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from compare import compare_point, judge
g = torch.Generator().manual_seed(4)
rows = (torch.randn(64, 256, generator=g) * 3).bfloat16()
def ulps(n):  # every element n bf16 ulps away from zero, as another order rounds
    bits = rows.view(torch.int16)
    return (bits + n).view(torch.bfloat16)
pos, ids = torch.arange(64), torch.arange(64) + 100
def verdict(n):
    point = compare_point((pos, ids, rows.float()), (pos, ids, ulps(n).float()))
    return judge({"layer.3.qsa": point}) | {"row_mean": point["clean_row_mean_rel"]}
print(json.dumps({"one": verdict(1), "two": verdict(2)}))
"""


def test_rounding_is_every_element_one_bf16_ulp_off_and_two_is_not():
    result = script_json(ONE_ULP, str(COMMON))
    assert result["one"]["equal"] is True
    # One ulp is 2^-8 to 2^-7 of a value: the old 2^-8 bound called it a fault.
    assert 2**-8 < result["one"]["row_mean"] <= 2**-7
    assert result["two"]["first_layer_over_bound"] == "layer.3.qsa"


INSIDE = ten_rows(
    2,
    """
rounded = rows.clone()
rounded[5:, 0] = rounded[5:, 0] * (1 + 2**-8)  # an offloaded QSA's rounding
routed = rows.clone()
routed[5:] += 1.0                              # another expert chosen from it
early = rows.clone()
early[2] += 1.0                                # an MoE fault on identical input
ref = {"layer.2.out": point(rows), "layer.3.qsa": point(rows),
       "layer.3.moe": point(rows), "layer.3.out": point(rows)}
def other(moe, out):
    return {"layer.2.out": point(rows), "layer.3.qsa": point(rounded),
            "layer.3.moe": point(moe), "layer.3.out": point(out)}
flipped = compare_case(ref, other(routed, routed))
fault = compare_case(ref, other(early, early))
print(json.dumps({"flipped": flipped, "flipped_verdict": judge(flipped),
                  "fault_verdict": judge(fault)}))
""",
)


def test_the_moe_is_judged_only_where_the_mixer_fed_it_the_same_rows():
    result = script_json(INSIDE, str(COMMON))
    flipped = result["flipped"]
    # The QSA output rounds differently from row 5: the MoE is judged before it.
    assert flipped["layer.3.qsa"]["first_parting_position"] == 5
    assert flipped["layer.3.moe"]["clean_before"] == 5
    assert flipped["layer.3.out"]["clean_before"] == 5
    assert result["flipped_verdict"]["equal"] is True
    # A MoE that parts on rows whose input agreed is still caught.
    assert result["fault_verdict"]["first_layer_over_bound"] == "layer.3.moe"


THINNED = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import capture
from compare import FINGERPRINT, compare_case
pos, ids = torch.arange(40), torch.arange(500, 540)
rows = torch.randn(40, 4, generator=torch.Generator().manual_seed(2)).bfloat16()
other_rows = rows.clone()
other_rows[13] += 1     # a row the thinned capture leaves out
def thinned(x):
    capture._STATE.update(on=True, keys=(pos, ids), keep=(8, 40), rows={})
    capture._store("layer.0.out", x)
    return {n: (torch.cat([p for p, _, _ in v]), torch.cat([i for _, i, _ in v]),
                torch.cat([r for _, _, r in v]) if n.endswith(FINGERPRINT)
                else torch.cat([r for _, _, r in v]).float())
            for n, v in capture._STATE["rows"].items()}
a, b = thinned(rows), thinned(other_rows)
same = thinned(rows.clone())
print(json.dumps({"kept": int(a["layer.0.out"][0].numel()),
                  "parted": compare_case(a, b)["layer.0.out"],
                  "same": compare_case(a, same)["layer.0.out"]}))
"""


def test_a_thinned_capture_still_finds_where_rows_it_left_out_part(tmp_path):
    result = script_json(THINNED, str(COMMON))
    assert result["kept"] == 5  # positions 0, 8, 16, 24, 32
    assert result["parted"]["max_rel"] == 0.0  # the kept rows are equal ...
    assert result["parted"]["first_parting_position"] == 13  # ... the left-out row 13 is not
    assert result["same"]["first_parting_position"] is None


DECODE_AND_PLACEHOLDERS = """
import json, sys, types, torch
sys.path.insert(0, sys.argv[1])
import capture
from vllm.utils.import_utils import PlaceholderModule
# A decode step of a thinned capture: its one row is past tail_from, kept,
# so the left-out rows it fingerprints are none (run e2's first call died here).
capture._STATE.update(on=True, keys=(torch.tensor([20000]), torch.tensor([7])),
                      keep=(8, 19990), rows={})
capture._store("layer.0.out", torch.ones(1, 4).bfloat16())
rows = capture._STATE["rows"]
# vLLM binds optional packages it lacks to placeholders that raise
# ModuleNotFoundError on any attribute (e2: runai_model_streamer).
module = types.ModuleType("vllm._flashnext_test_placeholders")
module.streamer = PlaceholderModule("runai_model_streamer")
sys.modules[module.__name__] = module
kept = int(rows["layer.0.out"][0][2].shape[0])
left_out = list(rows["layer.0.out" + capture.FINGERPRINT][0][2].shape)
capture._rank = lambda: 0  # no process group here
saved = capture.dump(None, sys.argv[2])
dumped = torch.load(saved["file"])
print(json.dumps({"kept": kept, "left_out": left_out, "autotune": saved["autotune"],
                  "dumped": {n: list(v[2].shape) for n, v in sorted(dumped.items())}}))
"""


def test_a_decode_step_and_vllms_placeholder_modules_do_not_stop_the_capture(tmp_path):
    result = script_json(DECODE_AND_PLACEHOLDERS, str(COMMON), str(tmp_path / "cap"))
    assert result == {
        "kept": 1,
        "left_out": [0, 1],
        "autotune": {},
        "dumped": {"layer.0.out": [1, 4], "layer.0.out" + "#fp": [0, 1]},
    }


TUNED_KERNEL = """
import triton
import triton.language as tl


# As FLA's GDN kernels in vLLM 0.33.0 (chunk_delta_h.py): heuristics over
# autotune over jit, so the module holds a Heuristics, not the Autotuner.
@triton.heuristics({"USE_G": lambda args: args["g"] is not None})
@triton.autotune(
    configs=[triton.Config({"BV": bv}, num_warps=w) for w in (2, 4) for bv in (32, 64)],
    key=["H"],
)
@triton.jit
def kernel(x, g, H, BV: tl.constexpr, USE_G: tl.constexpr):
    pass
"""

FIND_TUNED = """
import importlib.util, json, sys
sys.path.insert(0, sys.argv[1])
import capture
spec = importlib.util.spec_from_file_location("vllm._flashnext_test_tuned", sys.argv[2])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
tuner = module.kernel.fn
tuner.cache[(8,)] = tuner.configs[3]  # what a first call with H=8 would leave
found = capture.autotune_choices()
pinned = capture.pin_autotune(None)
print(json.dumps({"found": found, "pinned": pinned, "configs": len(tuner.configs),
                  "cache": len(tuner.cache), "after": capture.autotune_choices()}))
"""


def test_the_capture_finds_an_autotuner_under_triton_heuristics_and_pins_it(tmp_path):
    kernel = tmp_path / "tuned_kernel.py"
    kernel.write_text(TUNED_KERNEL)
    result = script_json(FIND_TUNED, str(COMMON), str(kernel))
    name = "vllm._flashnext_test_tuned.kernel"
    assert list(result["found"]) == [name]
    ((key, config),) = result["found"][name].items()
    assert key == "(8,)" and "BV: 64" in config and "num_warps: 4" in config
    # Pinned: one config left (Triton then runs it untimed), the timed choice forgotten.
    assert "BV: 32" in result["pinned"][name] and "num_warps: 2" in result["pinned"][name]
    assert (result["configs"], result["cache"]) == (1, 0)
    # What a pinned engine's dump then records: the one config, comparable.
    assert result["after"] == {name: {"only config": result["pinned"][name]}}


def test_the_pinned_pair_pins_both_sides_and_is_compared():
    engines = {e.name: e for e in orchestrate.equality_engines()}
    pinned = [n for n, e in engines.items() if e.pin_autotune]
    assert pinned == ["pp1-eager-vram-pinned", "pp3-eager-vram-pinned"]
    pairs = {key: (ref, other) for key, ref, other, _ in orchestrate.EQUALITY_PAIRS}
    assert pairs["pp3-eager-vram-pinned"] == tuple(pinned)
    # The same cases and mode as the unpinned pair, so the two verdicts compare.
    for name in pinned:
        plain = engines[name.removesuffix("-pinned")]
        assert (engines[name].cases, engines[name].graphs) == (plain.cases, plain.graphs)


SPEC_ROWS = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import capture, compare
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
def meta(prefills, accepted):
    # A mixed step: prompt rows 0-3, then two MTP verify sequences of two
    # tokens each (the verified token and its draft) at rows 4-7.
    return GDNAttentionMetadata(
        num_prefills=prefills, num_prefill_tokens=4, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=2, num_spec_decode_tokens=4, num_actual_tokens=8,
        spec_query_start_loc=torch.tensor([0, 2, 4], dtype=torch.int32),
        spec_token_indx=torch.tensor([4, 5, 6, 7]),
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32))
pos, ids = torch.arange(100, 108), torch.arange(500, 508)
a = capture.spec_rows(meta(1, [1, 1]), pos, ids)
b = capture.spec_rows(meta(1, [1, 2]), pos, ids)
none = capture.spec_rows(GDNAttentionMetadata(1, 4, 0, 0, 0, 0, 4), pos, ids)
print(json.dumps({"pos": a[0].tolist(), "ids": a[1].tolist(), "rows": a[2].tolist(),
                  "same": compare.spec_difference(a, a), "other": compare.spec_difference(a, b),
                  "none": none is None}))
"""


def test_mtp_verify_rows_carry_their_steps_gdn_metadata_and_compare_by_field():
    result = script_json(SPEC_ROWS, str(COMMON))
    assert result["pos"] == [104, 105, 106, 107] and result["ids"] == [504, 505, 506, 507]
    # prefills, decodes, spec decodes, tokens, sequence length, offset in it, accepted
    assert result["rows"] == [
        [1, 0, 2, 8, 2, 0, 1],
        [1, 0, 2, 8, 2, 1, 1],
        [1, 0, 2, 8, 2, 0, 1],
        [1, 0, 2, 8, 2, 1, 1],
    ]
    assert result["same"] == {"recorded": True, "rows": 4, "differ": 0, "first": None, "fields": []}
    assert result["other"] == {
        "recorded": True,
        "rows": 4,
        "differ": 2,
        "first": [106, 506],
        "fields": ["num_accepted_tokens"],
    }
    assert result["none"]


# --- e1's partings explained (RESULTS.md, "What parts them, explained") -------

E1 = PP3.parent / "results" / "pp3_equality-h200-e1.json"


def test_e1_echo_drafter_could_not_be_right_on_a_target_that_never_repeats():
    """e1 item 5: 105 drafts = 15 requests x 7 verify steps, and no engine's
    target ever repeated a token, which is the only time an echo draft is right."""
    sys.path.insert(0, str(COMMON))
    from compare import echo_acceptance

    record = json.loads(E1.read_text())
    for name in ("pp1-graphs-offload-mtp", "pp3-graphs-offload-mtp"):
        engine = record["engines"][name]
        echo = echo_acceptance(engine["ids"], engine["spec_decode"])
        assert echo == {
            "drafts": 105,
            "accepted": 0,
            "drafts_at_most": 105,
            "repeats": 0,
            "can_accept": False,
            "consistent": True,
        }
    # A drafter credited with more acceptances than the target's repeats is caught.
    assert not echo_acceptance({"8x1": [[5, 5, 6]]}, {"drafts": 2, "accepted_tokens": 2})[
        "consistent"
    ]


E3 = PP3.parent / "results" / "pp3_equality-h200-e3.json"


def echo_verify_keys(outputs: list[list[int]], prompt: int) -> tuple[set, set]:
    """The (position, id) keys an echo drafter's verify steps give, K=1: the
    decode row t_k at prompt + k, its draft (t_k again) at prompt + k + 1,
    for each output token but the last."""
    decode = {(prompt + k, t[k]) for t in outputs for k in range(len(t) - 1)}
    draft = {(prompt + k + 1, t[k]) for t in outputs for k in range(len(t) - 1)}
    return decode, draft


def test_e3_matched_one_draft_row_more_than_its_outputs_predict():
    """pp3 README (what to read in e4): at 20000x4 e3 compared 21 draft rows
    and 20 decode rows; the two engines' outputs, through the echo
    drafter's keys, predict 20 and 20. The extra draft row is e4's to name."""
    record = json.loads(E3.read_text())
    engines = ("pp1-graphs-offload-mtp", "pp3-graphs-offload-mtp")
    outputs = [record["engines"][e]["ids"]["20000x4"] for e in engines]
    (dec1, draft1), (dec3, draft3) = (echo_verify_keys(o, 20000) for o in outputs)
    assert (len(dec1 & dec3), len(draft1 & draft3)) == (20, 20)
    by_kind = record["comparisons"]["pp3-graphs-offload-mtp"]["cases"]["20000x4"]["points"][
        "layer.0.gdn"
    ]["by_kind"]
    assert (by_kind["decode"]["tokens"], by_kind["draft"]["tokens"]) == (20, 21)


# Two requests of 14-token prompts at a 12-token budget, as PP=1 and PP=3
# schedule them (SCHEDULES says how they differ).
TWO_SCHEDULES = """A, B = 1000, 2000
def steps(rows):
    pos = torch.tensor([p for _, p, _ in rows]); ids = torch.tensor([i for i, _, _ in rows])
    info = torch.tensor([[s, sum(1 for r in rows if r[2] == s)] for *_, s in rows])
    return (pos, ids, info)
def req(base, lo, hi, step):
    return [(base + p, p, step) for p in range(lo, hi)]
pp1 = steps(req(A, 0, 12, 1) + req(A, 12, 14, 2) + req(B, 0, 10, 2)
            + [(7, 14, 3)] + req(B, 10, 14, 3) + [(8, 15, 4)] + [(9, 14, 4)])
pp3 = steps(req(A, 0, 12, 1) + req(A, 12, 14, 2) + req(B, 0, 10, 2)
            + req(B, 10, 14, 3) + [(7, 14, 4), (9, 14, 4)] + [(8, 15, 5)])
"""

SCHEDULES = (
    """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from compare import STEPS, compare_case, parting_cause, row_kinds, schedule_parting
from compare import autotune_difference

# e1's batch-4 split, scaled down (budget 12 tokens, prompts of 14): request A's
# last chunk leaves 2 tokens of the budget to B in step 2 at both PP sizes; in
# step 3 PP=1 decodes A (1 token) beside B's next 11, PP=3 gives B all 12 (A
# decodes only every pp_size steps: scheduler next_decode_eligible_step).
"""
    + TWO_SCHEDULES
    + """
sched = schedule_parting(pp1, pp3)
# layer 0 GDN parts in B's third chunk (identical input): a split parting.
rows = torch.randn(40, 4, generator=torch.Generator().manual_seed(3))
def point(changed_from=None):
    pos, ids, _ = pp1
    r = rows[: len(pos)].clone()
    if changed_from is not None:
        r[(ids >= 2000) & (pos >= changed_from)] += 0.01
    return (pos, ids, r)
ca = {"layer.0.gdn": point(), STEPS: pp1}
cb = {"layer.0.gdn": point(12), STEPS: pp3}
points = compare_case(ca, cb, prompt_len=14)
same = {"recorded": True, "kernels": 5, "differ": []}
tuned = {"recorded": True, "kernels": 5, "differ": ["fla.chunk_fwd_kernel_o"]}
# e1 item 1: the same schedule, the GDN parts all the same: not the split.
one = {"layer.0.gdn": point(), STEPS: pp1}
other = {"layer.0.gdn": point(5), STEPS: pp1}
points_same_schedule = compare_case(one, other, prompt_len=14)
sched_same = schedule_parting(pp1, pp1)
def ref_parts(at):  # the reference against itself parts at layer 0's GDN from `at`
    return {"layer.0.gdn": {"first_parting_position": at}}
# MTP verify pairs past the prompt: (p, sampled) then (p + 1, draft).
verify = steps(req(A, 0, 12, 1) + [(7, 12, 2), (70, 13, 2)])
capture_a = [{"autotune": {"k.o": {"(4, 64)": "BK: 32"}}}, {"autotune": {"k.h": {"x": "BV: 32"}}}]
capture_b = [{"autotune": {"k.o": {"(4, 64)": "BK: 64"}, "k.h": {"x": "BV: 32"}}}]
print(json.dumps({
    "schedule": sched,
    "split_cause": parting_cause(points, sched, same),
    "by_kind": points["layer.0.gdn"]["by_kind"],
    "same_schedule": sched_same,
    "tuned_cause": parting_cause(points_same_schedule, sched_same, tuned),
    "unexplained": parting_cause(points_same_schedule, sched_same, same),
    "spread": [parting_cause(compare_case(one, other, ref_parts(f), 14), sched_same, same)
               for f in (3, 9)],
    "kinds": sorted(set(row_kinds(verify, 12).items())),
    "autotune": autotune_difference(capture_a, capture_b),
    "unrecorded": autotune_difference(None, capture_b),
}))
"""
)


def test_the_record_tells_a_split_from_an_autotune_choice_and_draft_rows_from_decode_rows():
    r = script_json(SCHEDULES, str(COMMON))
    # B's rows 10-13 ran as one run [10, 14) in a 4-token step at PP=3 and in a
    # 5-token step (beside A's decode) at PP=1: the first row in another context is 10.
    assert r["schedule"]["first_context_parting"] == 10
    assert r["split_cause"] == {"point": "layer.0.gdn", "position": 12, "cause": "schedule"}
    assert r["by_kind"]["prompt"]["first_parting_position"] == 12
    assert r["same_schedule"]["first_context_parting"] is None
    assert r["tuned_cause"]["cause"] == "autotune" and r["tuned_cause"]["position"] == 5
    assert r["unexplained"]["cause"] == "unexplained"
    # Past where the reference parts from itself (spread from 3): `spread`;
    # before it (spread from 9), still unexplained.
    assert [c["cause"] for c in r["spread"]] == ["spread", "unexplained"]
    kinds = dict((tuple(k), v) for k, v in r["kinds"])
    assert kinds[(12, 7)] == "decode" and kinds[(13, 70)] == "draft"
    assert kinds[(0, 1000)] == "prompt" and sum(v == "prompt" for v in kinds.values()) == 12
    assert r["autotune"] == {"recorded": True, "kernels": 2, "differ": ["k.o"]}
    assert r["unrecorded"] == {"recorded": False}


MOVED = (
    """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from compare import STEPS, compare_case, judge, schedule_bounds

# SCHEDULES' two schedules: B's rows 10-13 run in another context at PP=3.
"""
    + TWO_SCHEDULES
    + """
rows = torch.randn(40, 4, generator=torch.Generator().manual_seed(3))
def point(base, delta):  # every element of `base`'s rows from position 12 off by delta
    pos, ids, _ = pp1
    r = rows[: len(pos)].clone()
    r[(ids >= base) & (ids < base + 100) & (pos >= 12)] += delta
    return (pos, ids, r)
ref = {"layer.0.gdn": point(B, 0.0), STEPS: pp1}
def against(base, delta):
    return compare_case(ref, {"layer.0.gdn": point(base, delta), STEPS: pp3}, prompt_len=14)
spread = against(B, 0.02)  # the reference rechunked: B's moved rows round elsewhere
bounds = schedule_bounds({"14x2": {"points": spread}})
print(json.dumps({
    "spread_point": spread["layer.0.gdn"],
    "bounds": bounds,
    "within": judge(against(B, 0.03), None, bounds),
    "beyond": judge(against(B, 0.05), None, bounds),
    "unmeasured": judge(against(B, 0.03)),
    "not_moved": judge(against(A, 0.01), None, bounds),
}))
"""
)


def test_rows_run_in_another_chunk_are_held_to_the_references_own_rechunked_spread():
    """PP=3 runs batch 4's later prompts in other chunks (`cause: schedule`).
    Those rows are held to twice what the reference does to itself in other
    chunks (`spread-schedule`); unmeasured, to rounding; rows both engines
    ran alike stay held to rounding whatever the bound."""
    r = script_json(MOVED, str(COMMON))
    point = r["spread_point"]
    # B's rows 10-13 and A's two decodes (beside other rows at each PP size).
    assert point["moved_tokens"] == 6 and point["clean_row_mean_rel"] == 0.0
    (row_max, row_mean) = r["bounds"]["layer.0.gdn"]
    assert row_mean == pytest.approx(2 * point["moved_row_mean_rel"])
    assert row_max == pytest.approx(2 * point["moved_row_max_rel"])
    assert r["within"]["equal"] is True
    assert r["beyond"]["first_layer_over_bound"] == "layer.0.gdn"
    assert r["unmeasured"]["first_layer_over_bound"] == "layer.0.gdn"
    assert r["not_moved"]["first_layer_over_bound"] == "layer.0.gdn"


WORST_DRAFT = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from compare import SPEC, STEPS, compare_case, row_kinds

# One mixed step (step 2, 8 rows): a prefill chunk of C, then A's verify pair
# at [20, 21] and B's at [22, 23]: their positions follow on, so the runs
# join them into one and B's sampled row looks like a draft. The other
# engine runs the same rows with B's draft in its own step (3).
rows = [(300 + p, p, 1) for p in range(12)] + [(300 + p, p, 2) for p in range(12, 16)]
rows += [(5, 20, 2), (5, 21, 2), (6, 22, 2), (6, 23, 2)]
def steps(rows):
    pos = torch.tensor([p for _, p, _ in rows]); ids = torch.tensor([i for i, _, _ in rows])
    info = torch.tensor([[s, sum(1 for r in rows if r[2] == s)] for *_, s in rows])
    return (pos, ids, info)
other_rows = rows[:-1] + [(6, 23, 3)]
# #spec: prefills, decodes, spec decodes, tokens, sequence length, offset, accepted.
def spec(tokens):
    return (torch.tensor([20, 21, 22, 23]), torch.tensor([5, 5, 6, 6]),
            torch.tensor([[1, 0, 2, tokens, 2, o, 1] for o in (0, 1, 0, 1)]))
ca = {STEPS: steps(rows), SPEC: spec(8)}
cb = {STEPS: steps(other_rows), SPEC: spec(8)}
out = torch.randn(len(rows), 4, generator=torch.Generator().manual_seed(5))
parted = out.clone()
parted[-1] += 1.0  # B's draft row: a whole row off
pos, ids, _ = ca[STEPS]
ca["layer.0.gdn"], cb["layer.0.gdn"] = (pos, ids, out), (pos, ids, parted)
points = compare_case(ca, cb, prompt_len=20)
print(json.dumps({
    "runs_only": sorted(set(row_kinds(ca[STEPS], 20).items())),
    "with_spec": sorted(set(row_kinds(ca[STEPS], 20, ca[SPEC]).items())),
    "by_kind": points["layer.0.gdn"]["by_kind"],
}))
"""


def test_each_kind_names_its_worst_row_and_where_each_engine_ran_it():
    """A verify row's kind comes from its own metadata where recorded (two
    requests' pairs whose positions follow on are not one run), and the
    worst row of each kind is named with both engines' contexts, so a run
    says which draft row parted and how each engine scheduled it."""
    r = script_json(WORST_DRAFT, str(COMMON))
    runs_only = dict((tuple(k), v) for k, v in r["runs_only"])
    with_spec = dict((tuple(k), v) for k, v in r["with_spec"])
    assert runs_only[(22, 6)] == "draft"  # the joined run's misreading
    assert with_spec[(22, 6)] == "decode" and with_spec[(23, 6)] == "draft"
    assert with_spec[(20, 5)] == "decode" and with_spec[(21, 5)] == "draft"
    draft = r["by_kind"]["draft"]
    assert draft["tokens"] == 2 and draft["first_parting_position"] == 23
    assert draft["rows_over_rounding"] == 1  # B's draft; A's agrees
    assert r["by_kind"]["decode"]["rows_over_rounding"] == 0
    worst = draft["worst"]
    assert (worst["position"], worst["id"]) == (23, 6)
    assert worst["row_mean_rel"] == draft["max_row_mean_rel"] > 0.5
    assert worst["scale"] > 0 and worst["kind_scale_median"] > 0
    # Ref ran it in step 2's run [20, 24) of 8 tokens; the other alone in step 3.
    assert worst["context"] == {"ref": [20, 4, 8], "other": [23, 1, 1]}
    fields = worst["spec"]["ref"]
    assert fields["offset"] == 1 and fields["num_spec_decodes"] == 2
    assert worst["spec"]["other"] == fields
    assert r["by_kind"]["decode"]["worst"]["row_mean_rel"] == 0.0
    assert r["by_kind"]["prompt"]["worst"]["context"]["other"] == [0, 12, 12]


HISTORY = """
import json, sys, torch
from pathlib import Path
root = Path(sys.argv[1]); sys.path.insert(0, sys.argv[2])
from compare import SPEC, STEPS, compare_runs, judge, row_histories

# e4's parting draft row, scaled down. Two requests, prompts of 10 (A: ids
# 100-109, B: 200-209), MTP K=1. Both engines sample A's 5, 6, 7; B samples
# 8 then, at a near-tie, 9 in ref and 11 in other. In step 3 both engines
# verify B's row 11 with the draft 60 at 12: the same key (12, 60) after
# another history. A's draft (12, 50) follows the same history in both. A
# last row (13, 99) heads its own run with an id no request emitted there.
L = 10
outputs = {"ref": [[5, 6, 7], [8, 9, 10]], "other": [[5, 6, 7], [8, 11, 12]]}
def rows(b_row):
    seq = [(p, 100 + p, 1) for p in range(L)] + [(p, 200 + p, 1) for p in range(L)]
    seq += [(10, 5, 2), (11, 40, 2), (10, 8, 2), (11, 41, 2)]
    seq += [(11, 6, 3), (12, 50, 3), (11, b_row, 3), (12, 60, 3), (13, 99, 4)]
    return seq
def steps(seq):
    pos = torch.tensor([p for p, _, _ in seq]); ids = torch.tensor([i for _, i, _ in seq])
    info = torch.tensor([[s, sum(1 for r in seq if r[2] == s)] for *_, s in seq])
    return (pos, ids, info)
def spec(seq):  # #spec: prefills, decodes, spec decodes, tokens, length, offset, accepted
    verify = [(i, r) for i, r in enumerate(seq) if r[2] in (2, 3)]
    return (torch.tensor([r[0] for _, r in verify]), torch.tensor([r[1] for _, r in verify]),
            torch.tensor([[0, 0, 2, 4, 2, k % 2, 1] for k, _ in enumerate(verify)]))
values = torch.randn(len(rows(9)), 4, generator=torch.Generator().manual_seed(7))
def write(run, seq, off):
    case = {"output_ids": outputs[run]}
    (root / f"{run}.out.json").write_text(json.dumps({"run": run, "cases": {"10x2": case}}))
    out = values.clone()
    for key in off:  # a whole row off
        out[seq.index(next(r for r in seq if r[:2] == key))] += 1.0
    pos, ids, _ = steps(seq)
    torch.save({"layer.0.gdn": (pos, ids, out), STEPS: steps(seq), SPEC: spec(seq)},
               root / f"{run}.out.10x2.rank0.pt")
result = {}
for name, off in (("b_draft_off", [(12, 60)]), ("a_draft_off", [(12, 50)])):
    write("ref", rows(9), [])
    write("other", rows(11), off)
    case = compare_runs(root / "ref.out.json", root / "other.out.json")["cases"]["10x2"]
    result[name] = {"history": case["history"], "point": case["points"]["layer.0.gdn"],
                    "verdict": judge(case["points"])}
# Decode rows without `#spec` whose positions follow on in one step (B's
# 10, then A's 11): each is its own request's, not the run's first row's.
joined = steps([(p, 100 + p, 1) for p in range(L)] + [(10, 8, 2), (11, 6, 2)])
result["joined"] = {str(k): v for k, v in row_histories(joined, outputs["ref"], L).items()}
print(json.dumps(result))
"""


def test_rows_after_another_history_are_not_judged_and_rows_after_the_same_are(tmp_path):
    """e4: PP=3 and PP=1 sample different tokens at a near-tie, and the
    drafter proposes the same id at the next position in both: a row of the
    same (position, id) after another history. It parts by a whole row, as
    e4's 20007/9569 did, and is no fault; the same draft row after the same
    history is judged and caught."""
    r = script_json(HISTORY, str(tmp_path), str(COMMON))
    b, a = r["b_draft_off"], r["a_draft_off"]
    # 8 generated keys both ran; B's (11, 9) and (11, 11) are one engine's each.
    assert b["history"] == {"recorded": True, "rows": 8, "parted": [[12, 60]], "unknown": 1}
    assert b["point"]["other_history"] == 1 and b["point"]["only_ref"] == 1
    assert b["point"]["tokens"] == 20 + 7 and b["point"]["max_rel"] == 0.0
    assert b["verdict"]["equal"] is True
    # A's draft follows 5, 6 in both: judged, and its parting is caught.
    assert a["history"]["parted"] == [[12, 60]]
    assert a["verdict"] == {**a["verdict"], "equal": False, "first_layer_over_bound": "layer.0.gdn"}
    assert a["point"]["by_kind"]["draft"]["worst"]["position"] == 12
    assert a["point"]["by_kind"]["draft"]["worst"]["id"] == 50
    assert r["joined"] == {"(10, 8)": [1, []], "(11, 6)": [0, [5]]}


POISON = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import capture
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
from vllm.third_party.flash_linear_attention.ops import fused_sigmoid_gating as fsg
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
g = torch.Generator().manual_seed(3)
q, v = torch.randn(1, 6, 2, 4, generator=g), torch.randn(1, 6, 4, 4, generator=g)
def kernel(written):  # fused_sigmoid_gating.py's `o`, the sequences it does not skip written
    o = q.new_empty(1, *v.shape)
    o[:, :, :written] = v[:, :written] * 2
    return o.squeeze(0).squeeze(0)
plain = kernel(4)
with capture.nan_empty():
    poisoned = kernel(4)
    ops = [torch.zeros(3), q.index_select(1, torch.tensor([0, 2])), q.clone(), q @ q.mT]
    empties = [torch.empty(3), torch.empty_like(q), q.new_empty(2)]
out_ops = [torch.zeros(3), q.index_select(1, torch.tensor([0, 2])), q.clone(), q @ q.mT]
def meta(prefills, spec_indx):
    # Prompt rows 0-3 of one prefill chunk, then two verify pairs at rows 4-7,
    # two padded rows (8-9) past the real ones.
    return GDNAttentionMetadata(
        num_prefills=prefills, num_prefill_tokens=4, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=2, num_spec_decode_tokens=4, num_actual_tokens=10,
        spec_sequence_masks=torch.tensor([False, True, True]),
        spec_token_indx=torch.tensor(spec_indx), non_spec_token_indx=torch.tensor([0, 1, 2, 3]))
spec, non_spec = torch.randn(4, 2, generator=g), torch.randn(4, 2, generator=g)
seen = []
def merge(m, out):  # _forward_core's step 3, as in qwen_gdn_linear_attn.py
    def body():
        seen.append(capture._POISON["on"])
        out.index_copy_(0, m.spec_token_indx, spec[: m.spec_token_indx.numel()])
        out.index_copy_(0, m.non_spec_token_indx, non_spec)
    return body
def run(m, poison):
    out = torch.zeros(10, 2)
    (lambda: capture.poison_mixed_spec(m, out, merge(m, out)))() if poison else merge(m, out)()
    return out
full, drop = meta(1, [4, 5, 6, 7]), meta(1, [4, 5, 6])  # drop: row 7 never written
spec_only = meta(0, [4, 5, 6])
before = (gdn.QwenGatedDeltaNetAttention._forward_core, gdn.fused_sigmoid_gating_delta_rule_update)
capture._install_poison_gdn_out(None)
capture._install_poison_gdn_out(None)
after = (gdn.QwenGatedDeltaNetAttention._forward_core, gdn.fused_sigmoid_gating_delta_rule_update)
print(json.dumps({
    "written_same": torch.equal(plain[:4], poisoned[:4]),
    "unwritten_nan": bool(poisoned[4:].isnan().all()) and not bool(plain[4:].isnan().any()),
    "ops_same": all(torch.equal(a, b) for a, b in zip(ops, out_ops)),
    "empties_nan": [bool(e.isnan().all()) for e in empties],
    "full_same": torch.equal(run(full, False), run(full, True)),
    "drop_nan_rows": run(drop, True).isnan().any(1).nonzero().flatten().tolist(),
    "drop_plain_row7": run(drop, False)[7].tolist(),
    "spec_only_same": torch.equal(run(spec_only, False), run(spec_only, True)),
    "poison_on": seen, "off_after": capture._POISON["on"],
    "wrapped": [after[0].__wrapped__ is before[0],
                after[1].__wrapped__ is fsg.fused_sigmoid_gating_delta_rule_update],
    "listed": "poison_gdn_out" in capture._PROBES,
}))
"""


def test_poison_gdn_out_makes_only_unwritten_gdn_rows_nan():
    r = script_json(POISON, str(COMMON))
    # The spec kernel's output: rows it writes unchanged, rows it skips NaN.
    assert r["written_same"] and r["unwritten_nan"]
    assert r["ops_same"] and r["empties_nan"] == [True, True, True]
    # The merge: every row it writes is what it was; a row it misses is NaN
    # (0 without the probe); padded rows past the real ones untouched.
    assert r["full_same"] and r["drop_nan_rows"] == [7] and r["drop_plain_row7"] == [0.0, 0.0]
    # A spec-only step (graphs, padded sequences) is left as it is.
    assert r["spec_only_same"]
    # The recurrent kernel is poisoned only inside a mixed step's body.
    assert r["poison_on"] == [False, True, True, False, False, False]
    assert r["off_after"] is False
    assert r["wrapped"] == [True, True] and r["listed"]


NAN_ROWS = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from compare import compare_point, judge
g = torch.Generator().manual_seed(5)
pos, ids = torch.arange(10, 16), torch.arange(100, 106)
rows = torch.randn(6, 8, generator=g)
names = ["prompt"] * 3 + ["decode", "draft", "draft"]
kinds = {(int(p), int(i)): k for p, i, k in zip(pos, ids, names)}
other = rows.clone()
other[4] = float("nan")  # one draft row never written in the poisoned engine
other[1, 0] += 0.5       # a prompt row computed differently
point = compare_point((pos, ids, rows), (pos, ids, other), kinds=kinds)
clean = compare_point((pos, ids, rows), (pos, ids, rows.clone()), kinds=kinds)
only_nan = rows.clone()
only_nan[4] = float("nan")
late = compare_point((pos, ids, rows), (pos, ids, only_nan), clean_before=12, kinds=kinds)
print(json.dumps({"point": point, "judge": judge({"layer.0.gdn": point}),
                  "clean": judge({"layer.0.gdn": clean}), "late": judge({"layer.0.gdn": late}),
                  "clean_nan": clean["nan_rows"],
                  "late_nan": late["by_kind"]["draft"]["nan_rows"]}))
"""


def test_compare_counts_nan_rows_by_kind_and_judges_them():
    r = script_json(NAN_ROWS, str(COMMON))
    p = r["point"]
    assert p["by_kind"]["draft"]["nan_rows"] == {"ref": 0, "other": 1}
    assert p["by_kind"]["prompt"]["nan_rows"] == {"ref": 0, "other": 0}
    assert p["nan_rows"] == {"ref": 0, "other": 1} and p["clean_nan_rows"] == 1
    # The written rows' statistics stay numbers: the prompt row's 0.5 is the max.
    assert all(isinstance(p[k], float) and p[k] == p[k] for k in ("max_rel", "mean_rel"))
    assert p["by_kind"]["draft"]["max_rel"] == 0.0 and p["by_kind"]["prompt"]["max_rel"] > 0
    assert p["first_parting_position"] == 11
    assert p["by_kind"]["draft"]["first_parting_position"] == 14
    assert p["identical_frac"] == pytest.approx(4 / 6)
    assert r["judge"]["equal"] is False and r["judge"]["first_layer_over_bound"] == "layer.0.gdn"
    assert r["clean"]["equal"] is True and r["clean_nan"] == {"ref": 0, "other": 0}
    # A NaN row past the input's parting is not judged (it is still counted).
    assert r["late"]["equal"] is True and r["late_nan"] == {"ref": 0, "other": 1}


def interpreted(script: str) -> dict:
    """A script of this folder's last line of output, as JSON, run in the pinned
    vLLM env with its Triton kernels interpreted on CPU (triton_cpu.py)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    env |= {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [vllm_python(), str(PP3 / script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_spec_gdn_kernels_read_only_what_was_written_and_match_a_plain_run():
    """e3 item 6's reading, run: the pinned vLLM's two verify-step kernels
    (conv with its accepted-token offset, the recurrent kernel on the spec
    slots), on CPU through Triton's interpreter, over a prefill and seven
    verify steps with rejected and accepted drafts, every slot NaN until
    written. Both rows of every step equal the same kernels over the accepted
    history as one plain sequence, so a draft row cannot part by reading
    state nothing wrote; the control (acceptances kept from the kernels)
    parts from the first step after an acceptance."""
    r = interpreted("spec_gdn_cpu.py")
    lives = [*r["conv"].values(), r["recurrent"]]
    for life in lives:
        assert len(life) == len(r["accepted"]) == 7
        assert all(s["verified"] == 0.0 and s["draft"] == 0.0 for s in life)
        assert not any(any(s["nan"]) for s in life)
    # Acceptances really ran: steps after one are told 2 accepted tokens.
    assert [s["accepted_before"] for s in r["recurrent"]] == [1, 1, 1, 2, 1, 2, 2]
    first_after = r["accepted"].index(True) + 1
    for life in r["control"].values():
        assert all(s["verified"] == s["draft"] == 0.0 for s in life[:first_after])
        assert all(s["verified"] > 1e-3 and s["draft"] > 1e-3 for s in life[first_after:])


def test_verify_rows_in_a_step_that_also_prefills_equal_the_same_rows_run_alone():
    """e3's draft rows parted only where verifies shared steps with prefill
    chunks. Through vLLM's own GDN metadata builder and _forward_core, a
    request life of e3's 20000x4 kind (verifies beside first and later
    prefill chunks, in either order, one acceptance, two verifies together)
    gives every verify request's two rows exactly what the same request run
    alone in a pure verify step gives, from the same cache with every slot
    NaN until written. The control (A's accepted count wrong in one mixed
    step) reads a slot nothing wrote: its rows are NaN from there on, the
    other request's are not."""
    r = interpreted("spec_gdn_mixed_cpu.py")
    life, control = r["life"], r["control"]
    assert [(s["step"], s["request"]) for s in life] == [
        (2, "A"), (3, "A"), (4, "A"), (5, "A"), (5, "D"), (6, "D"),
    ]  # fmt: skip
    assert {s["prefills"] for s in life} == {0, 1} and {s["spec_decodes"] for s in life} == {1, 2}
    for s in life:
        assert s["verified"] == 0.0 and s["draft"] == 0.0 and s["nan"] == [False, False]
        assert s["row_mean"] > 1e-3  # rows with something in them
    wrong = [s for s in control if s["request"] == "A"]
    assert all(s["nan"] == [True, True] for s in wrong)
    assert all(
        s["nan"] == [False, False] and s["draft"] == 0.0 for s in control if s["request"] == "D"
    )
