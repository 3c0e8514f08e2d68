"""The MTP equality run's bookkeeping (checks/gpu/mtp/mtp_equality.py) on recorded-shape runs.

No engine runs here: the records are what in_vllm_worker.py writes (generated
ids, top-k logprobs, vLLM's spec-decode counters), so the verdict is checked
before a GPU call depends on it. That vLLM 0.33.0 builds the two engines'
configs is checked in checks/patches/test_tiny_gpu_checkpoint.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ab"))

import in_vllm_worker  # noqa: E402
import mtp_equality  # noqa: E402


def request(ids, margin=3.0):
    """One request's record: generated ids and a top-2 logprob pair per step."""
    return {
        "output_ids": list(ids),
        # Runner-up: token 7, or 2 where 7 itself is the choice.
        "output_logprobs": [{str(t): -0.1, "7" if t != 7 else "2": -0.1 - margin} for t in ids],
        "prompt_logprobs": [],
    }


KS = [1, 2]


def engines(off_ids, on_ids, counts, cases=("100x1", "3000x4"), host_bytes=4096):
    """Records of every compared and timed engine of a run with K = 1 and 2."""
    off = {"cases": {c: [request(i) for i in off_ids] for c in cases}}
    on = {"cases": {c: [request(i) for i in on_ids] for c in cases}, "spec_decode": counts}
    records = {"mtp-off": off, "mtp-off-offload": off,
               "timing-mtp-off": {"timing": [{"decode_tok_s": 200.0}]}}  # fmt: skip
    for k in KS:
        records[f"mtp-on-k{k}"] = on
        records[f"timing-mtp-on-k{k}"] = {"timing": [{"decode_tok_s": 200.0 + 100 * k}]}
    records[f"mtp-on-offload-k{max(KS)}"] = on | {
        "host_weights": {"params": 7, "bytes": host_bytes, "returned_from_device": 2}
    }
    return records


COUNTS = {"drafts": 40, "draft_tokens": 80, "accepted_tokens": 36}


def fake_plan(k: int = 0) -> dict:
    """A plan's shape (`flashnext plan --json`, MTP at K or off); test_mtp_settings.py
    holds the engines to a real one."""
    argv = ["vllm", "serve", "/m", "--engram-config", '{"mmap_path":"/t/ple-packed.bin"}']
    if k:
        spec = mtp_equality.json.dumps({"method": "mtp", "num_speculative_tokens": k})
        segments = ["mtp.embed_tokens", "mtp.layers.8.mlp.experts"]
        argv += ["--speculative-config", spec, "--cpu-offload-gb", "0.01",
                 "--cpu-offload-params", *segments]  # fmt: skip
    env = {"VLLM_QSA_KV_OFFLOAD": "1", "VLLM_QSA_KV_OFFLOAD_CHUNK_TOKENS": "1024", "A": "b"}
    return {"profile": "h200-tiny", "argv": argv, "env": env}


def spec_args(model):
    return SimpleNamespace(model=model, tables=mtp_equality.Path("/t"), plan=fake_plan(),
                           mtp_plans={k: fake_plan(k) for k in KS},
                           gpu_memory_utilization=None, speculative_tokens=KS)  # fmt: skip


def tiny_model_dir(tmp_path, layers=8, mtp_layers=1):
    config = {"text_config": {"num_hidden_layers": layers, "mtp_num_hidden_layers": mtp_layers}}
    (tmp_path / "config.json").write_text(mtp_equality.json.dumps(config))
    return tmp_path


def test_each_mtp_engine_runs_its_ks_plan_and_only_the_serving_one_offloads(tmp_path):
    args = spec_args(tiny_model_dir(tmp_path))
    arms = mtp_equality.compared_arms(KS) + mtp_equality.timed_arms(KS)
    specs = {a.name: mtp_equality.engine_spec(a, args, {"100x1": [[1, 2]]}, [5] * 10) for a in arms}
    assert set(specs) == {
        "mtp-off", "mtp-on-k1", "mtp-on-k2", "mtp-off-offload", "mtp-on-offload-k2",
        "timing-mtp-off", "timing-mtp-on-k1", "timing-mtp-on-k2",
    }  # fmt: skip
    for name, spec in specs.items():
        k = int(name.rsplit("-k", 1)[1]) if "-on-" in name else 0
        assert mtp_equality.plan_tokens(spec["plan"]) == k, name
        assert spec["max_new_tokens"] == mtp_equality.NEW_TOKENS and spec["ignore_eos"] is True
        assert spec["prompt_logprobs"] is False
        offloaded = spec["env"].get("VLLM_QSA_KV_OFFLOAD") == "1"
        assert offloaded == ("offload" in name), name
        assert spec["env_dropped"] == (
            [] if offloaded else ["VLLM_QSA_KV_OFFLOAD", "VLLM_QSA_KV_OFFLOAD_CHUNK_TOKENS"]
        )
        assert spec["env"]["A"] == "b" and spec["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        # The plan's graphs and packed table: no override of either.
        assert set(spec["overrides"]) <= {"model", "disable_log_stats", "cpu_offload_gb",
                                          "cpu_offload_params"}, name  # fmt: skip
        assert ("disable_log_stats" in spec["overrides"]) == bool(k), name
        # The drafter's weights go to host memory only where there is a drafter and
        # the K/V are offloaded: the serving setup, the MTP plan as it is.
        kept = "cpu_offload_gb" not in spec["overrides"]
        assert kept == (not k or name == "mtp-on-offload-k2"), name
    assert specs["timing-mtp-on-k1"]["cases"] == {} and specs["timing-mtp-on-k1"]["timed_batches"]
    assert specs["mtp-on-k1"]["timed_batches"] == []


def test_a_k_without_its_plan_is_refused(tmp_path, monkeypatch):
    plans = {}
    for k in (0, 1):
        plans[k] = tmp_path / f"plan{k}.json"
        plans[k].write_text(mtp_equality.json.dumps(fake_plan(k)))
    assert mtp_equality.mtp_plans([plans[1]]).keys() == {1}
    argv = ["mtp_equality.py", "--model", str(tmp_path), "--tables", "/t", "--out", "/o",
            "--raw", "/r", "--run-id", "t", "--plan", str(plans[0]),
            "--mtp-plan", str(plans[1]), "--speculative-tokens", "1", "2"]  # fmt: skip
    monkeypatch.setattr(mtp_equality.sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        mtp_equality.main()
    assert exit_.value.code == 2


def test_run_in_vllm_writes_a_plan_for_each_default_k():
    script = (Path(__file__).resolve().parents[1] / "ab" / "run-in-vllm").read_text()
    default = " ".join(str(k) for k in mtp_equality.SPECULATIVE_TOKENS)
    assert f"ks=({default})  # mtp_equality.SPECULATIVE_TOKENS" in script


def test_every_pair_compares_an_on_engine_with_the_off_engine_of_its_kv_placement():
    assert [(p.off, p.on) for p in mtp_equality.pairs(mtp_equality.compared_arms(KS))] == [
        ("mtp-off", "mtp-on-k1"), ("mtp-off", "mtp-on-k2"),
        ("mtp-off-offload", "mtp-on-offload-k2"),
    ]  # fmt: skip


def test_equal_ids_and_acceptance_in_the_band_pass():
    v = mtp_equality.verdict(engines([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]], COUNTS), KS)
    assert v["ok"] is True
    for pair in v["pairs"]:
        assert [r["equal"] for r in pair["cases"]] == [True, True]
        assert pair["acceptance"] == pytest.approx(0.45)
    assert v["pairs"][-1]["drafter_in_host_memory"] is True
    assert v["decode"]["k1"]["on_over_off"] == pytest.approx(1.5)
    assert v["decode"]["k2"]["on_over_off"] == pytest.approx(2.0)


def test_the_serving_setup_fails_when_no_drafter_weight_left_vram():
    v = mtp_equality.verdict(engines([[1, 2, 3]], [[1, 2, 3]], COUNTS, host_bytes=0), KS)
    assert v["ok"] is False
    assert [p["ok"] for p in v["pairs"]] == [True, True, False]


def test_a_parting_names_the_position_and_the_margin_there():
    v = mtp_equality.verdict(engines([[1, 2, 3]], [[1, 9, 3]], COUNTS), KS)
    row = v["pairs"][0]["cases"][0]
    assert v["ok"] is False and row["equal"] is False
    assert (row["request"], row["position"]) == (0, 1)
    assert row["margin"] == pytest.approx(3.0)
    assert "generated token 1: 2 without MTP, 9 with" in row["why"]


def test_a_parting_at_a_near_tie_by_vllms_rule_is_close_and_passes():
    """Each engine's token is in the other's top-k (request() puts token 7 second):
    the tie broke the other way and the sequences diverge from there."""
    v = mtp_equality.verdict(engines([[1, 2, 3], [4, 5, 6]], [[1, 7, 8], [4, 5, 6]], COUNTS), KS)
    row = v["pairs"][0]["cases"][0]
    assert row["equal"] is False and row["close"] is True
    assert row["tokens_identical"] == 1 + 3 and row["tokens"] == 6
    assert [p["near_tie"] for p in row["partings"]] == [True]
    assert v["ok"] is True


def test_one_wrong_token_among_near_ties_fails():
    off, on = [[1, 2, 3], [4, 5, 6]], [[1, 7, 8], [4, 9, 6]]
    row = mtp_equality.verdict(engines(off, on, COUNTS), KS)["pairs"][0]["cases"][0]
    assert [p["near_tie"] for p in row["partings"]] == [True, False]
    assert row["close"] is False


def test_a_shorter_output_is_unequal():
    row = mtp_equality.verdict(engines([[1, 2, 3]], [[1, 2]], COUNTS), KS)["pairs"][0]["cases"][0]
    assert row["equal"] is False and row["position"] == 2


@pytest.mark.parametrize(
    "counts",
    [
        {"drafts": 40, "draft_tokens": 80, "accepted_tokens": 2},  # random drafter: ~0
        {"drafts": 40, "draft_tokens": 80, "accepted_tokens": 79},  # rejections never ran
        {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0},  # nothing drafted
    ],
)
def test_acceptance_outside_the_band_fails_even_when_equal(counts):
    v = mtp_equality.verdict(engines([[1, 2, 3]], [[1, 2, 3]], counts), KS)
    assert all(r["equal"] for p in v["pairs"] for r in p["cases"])
    assert v["ok"] is False


def test_a_failed_engine_fails_the_run():
    records = engines([[1, 2, 3]], [[1, 2, 3]], COUNTS)
    records["mtp-on-k2"] = {"run": "mtp-on-k2", "error": "exit 1", "log_tail": []}
    v = mtp_equality.verdict(records, KS)
    assert v["ok"] is False and v["errors"] == {"mtp-on-k2": "exit 1"}
    assert v["pairs"][1]["cases"][0]["why"] == "mtp-on has no result"


@dataclass
class Counter:  # vllm.v1.metrics.reader.Counter's fields
    name: str
    labels: dict[str, str]
    value: int


def test_the_workers_counts_sum_vllms_spec_decode_counters():
    metrics = [
        Counter("vllm:spec_decode_num_draft_tokens", {"engine": "0"}, 80),
        Counter("vllm:spec_decode_num_accepted_tokens", {"engine": "0"}, 30),
        Counter("vllm:spec_decode_num_accepted_tokens", {"engine": "1"}, 6),
        Counter("vllm:spec_decode_num_drafts", {"engine": "0"}, 40),
        Counter("vllm:prompt_tokens", {"engine": "0"}, 999),
    ]
    assert in_vllm_worker.spec_decode_counts(metrics) == COUNTS


GAINS = [2.0, 8.0]


def gain_engines(off_ids, on_ids_by_gain, counts_by_gain):
    """Records of a run with two echo drafters (gains 2 and 8), every engine of each."""
    records = engines(off_ids, off_ids, COUNTS)
    for g in GAINS:
        on = {"cases": {c: [request(i) for i in on_ids_by_gain[g]] for c in ("100x1", "3000x4")},
              "spec_decode": counts_by_gain[g]}  # fmt: skip
        for k in KS:
            records[mtp_equality.on_name(k, False, g)] = on
        records[mtp_equality.on_name(max(KS), True, g)] = on | {"host_weights": {"bytes": 4096}}
    return records


def test_each_drafter_gain_gets_its_own_engines_and_checkpoint(tmp_path):
    copies = {}
    for g in GAINS:
        d = tmp_path / f"echo-g{g:g}"
        d.mkdir()
        (d / mtp_equality.ECHO_RECORD).write_text(mtp_equality.json.dumps({"gain": g}))
        copies[g] = d
    args = spec_args(tiny_model_dir(tmp_path))
    args.drafter_models = mtp_equality.drafter_models(list(copies.values()))
    assert args.drafter_models == copies
    arms = mtp_equality.compared_arms(KS, GAINS, serving_gains=[8.0])
    assert [a.name for a in arms] == [
        "mtp-off", "mtp-off-offload", "mtp-on-k1-g2", "mtp-on-k2-g2",
        "mtp-on-k1-g8", "mtp-on-k2-g8", "mtp-on-offload-k2-g8",
    ]  # fmt: skip
    specs = {a.name: mtp_equality.engine_spec(a, args, {}, [5]) for a in arms}
    models = {name: spec["overrides"]["model"] for name, spec in specs.items()}
    assert models["mtp-off"] == str(args.model) and models["mtp-on-k1-g2"] == str(copies[2.0])
    assert models["mtp-on-offload-k2-g8"] == str(copies[8.0])
    timed = mtp_equality.timed_arms(KS, 8.0)
    assert [(a.name, a.gain) for a in timed] == [
        ("timing-mtp-off", None),
        ("timing-mtp-on-k1", 8.0),
        ("timing-mtp-on-k2", 8.0),
    ]


LOW = {"drafts": 40, "draft_tokens": 80, "accepted_tokens": 2}


def test_one_drafter_in_the_band_with_equal_output_everywhere_passes():
    ok = [[1, 2, 3]]
    arms = mtp_equality.compared_arms(KS, GAINS)
    v = mtp_equality.verdict(
        gain_engines(ok, {2.0: ok, 8.0: ok}, {2.0: LOW, 8.0: COUNTS}), KS, arms
    )
    assert [(r["gain"], r["ok"]) for r in v["gains"]] == [(2.0, False), (8.0, True)]
    assert v["ok"] is True
    assert mtp_equality.proving_gain(v["gains"]) == 8.0


def test_a_wrong_token_at_any_gain_fails_even_where_another_gain_passes():
    ok, wrong = [[1, 2, 3]], [[1, 9, 3]]
    arms = mtp_equality.compared_arms(KS, GAINS)
    v = mtp_equality.verdict(
        gain_engines(ok, {2.0: wrong, 8.0: ok}, {2.0: LOW, 8.0: COUNTS}), KS, arms
    )
    assert [r["ok"] for r in v["gains"]] == [False, True]
    assert v["ok"] is False


def test_no_drafter_in_the_band_fails_and_the_largest_gain_is_timed():
    ok = [[1, 2, 3]]
    arms = mtp_equality.compared_arms(KS, GAINS)
    v = mtp_equality.verdict(gain_engines(ok, {2.0: ok, 8.0: ok}, {2.0: LOW, 8.0: LOW}), KS, arms)
    assert v["ok"] is False
    assert mtp_equality.proving_gain(v["gains"]) == 8.0


def test_markdown_renders():
    result = {
        "run_id": "t",
        "host": {"gpu": "GPU", "torch": "2.11", "note": "note"},
        "verdict": mtp_equality.verdict(engines([[1, 2, 3]], [[1, 9, 3]], COUNTS), KS),
    }  # fmt: skip
    text = mtp_equality.markdown(result)
    assert "#### mtp-on-k1 vs mtp-off" in text
    assert "#### mtp-on-offload-k2 vs mtp-off-offload" in text
    assert "| 100 | 1 | 1 of 3 | False | False | request 0, generated token 1" in text
    assert "acceptance (accepted / drafted tokens): 0.450" in text and "ok: False" in text
    assert "drafter weights in pinned host memory (UVA): 7 tensors, 4096 bytes, 2 returned" in text
    assert "echo drafter gain" not in text  # one drafter, as given


def test_markdown_renders_a_row_per_drafter_gain():
    ok = [[1, 2, 3]]
    arms = mtp_equality.compared_arms(KS, GAINS)
    records = gain_engines(ok, {2.0: ok, 8.0: ok}, {2.0: LOW, 8.0: COUNTS})
    result = {"run_id": "t", "host": {"gpu": "GPU", "torch": "2.11", "note": "note"},
              "timed_gain": 8.0, "verdict": mtp_equality.verdict(records, KS, arms)}  # fmt: skip
    text = mtp_equality.markdown(result)
    assert (
        "| 2 | mtp-on-k1-g2 0.025, mtp-on-k2-g2 0.025, mtp-on-offload-k2-g2 0.025 | False |" in text
    )
    assert (
        "| 8 | mtp-on-k1-g8 0.450, mtp-on-k2-g8 0.450, mtp-on-offload-k2-g8 0.450 | True |" in text
    )
    assert "(MTP engines timed with the gain-8 drafter)" in text


def test_the_host_weights_come_from_patch_0031s_log_line():
    log = (
        "INFO [mtp.py:1] MTP drafter: 3 weights in pinned host memory (1000 bytes), "
        "0 returned there from the device after loading\n"
        "INFO [mtp.py:1] MTP drafter: 3 weights in pinned host memory (9000 bytes), "
        "2 returned there from the device after loading\n"
    )
    assert mtp_equality.host_weights(log) == {"params": 3, "bytes": 9000, "returned_from_device": 2}
    assert mtp_equality.host_weights("Total CPU offloaded parameters: 0.01") is None
