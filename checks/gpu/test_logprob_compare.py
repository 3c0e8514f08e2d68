"""The A/B's comparison rule (checks/gpu/logprob_compare.py), on recorded-shape data.

Requests are in the worker's JSON form (token ids as strings, as after a JSON
round trip): `prompt_logprobs` one top-k dict per position (the first None),
`output_ids` and one top-k dict per generated token.
"""

from __future__ import annotations

import json

from logprob_compare import compare_request, compare_runs


def request(prompt_tops, output_ids, output_tops):
    data = {
        "prompt_logprobs": [None, *prompt_tops],
        "output_ids": output_ids,
        "output_logprobs": output_tops,
    }
    return json.loads(json.dumps(data))  # ids become strings, as recorded


BASE = request(
    [{5: -0.1, 6: -2.5, 7: -4.0}, {8: -0.2, 9: -1.9}],
    [3, 4],
    [{3: -0.3, 4: -1.5}, {4: -0.05, 2: -3.1}],
)


def test_identical_runs_are_equal_with_zero_difference():
    verdict = compare_request(BASE, BASE)
    assert verdict.equal and verdict.max_logprob_diff == 0.0 and verdict.where == ""


def test_small_logprob_noise_is_equal_and_measured():
    noisy = request(
        [{5: -0.12, 6: -2.5, 7: -4.0}, {8: -0.2, 9: -1.9}],
        [3, 4],
        [{3: -0.3, 4: -1.5}, {4: -0.07, 2: -3.1}],
    )
    verdict = compare_request(BASE, noisy)
    assert verdict.equal
    assert abs(verdict.max_logprob_diff - 0.02) < 1e-9


def test_a_prompt_argmax_outside_the_others_top_k_fails_at_that_position():
    other = request(
        [{5: -0.1, 6: -2.5, 7: -4.0}, {1: -0.1, 2: -1.0}],  # 8 is not in this top-k
        [3, 4],
        [{3: -0.3, 4: -1.5}, {4: -0.05, 2: -3.1}],
    )
    verdict = compare_request(BASE, other)
    assert not verdict.equal and verdict.where == "prompt position 2: 8 vs 1"


def test_a_near_tie_flip_inside_both_top_k_is_accepted_and_ends_the_comparison():
    flipped = request(
        [{5: -0.1, 6: -2.5, 7: -4.0}, {8: -0.2, 9: -1.9}],
        [4, 9],  # 4 was the runner-up at position 0; later tokens diverge freely
        [{4: -0.29, 3: -0.31}, {9: -0.01}],
    )
    assert compare_request(BASE, flipped).equal


def test_a_generated_token_outside_the_others_top_k_fails():
    wrong = request(
        [{5: -0.1, 6: -2.5, 7: -4.0}, {8: -0.2, 9: -1.9}],
        [3, 7],
        [{3: -0.3, 4: -1.5}, {7: -0.01, 1: -5.0}],
    )
    verdict = compare_request(BASE, wrong)
    assert not verdict.equal and verdict.where == "output position 1: 4 vs 7"


def test_different_lengths_fail():
    shorter = dict(BASE, output_ids=[3], output_logprobs=BASE["output_logprobs"][:1])
    assert not compare_request(BASE, shorter).equal
    assert not compare_runs([BASE], [BASE, BASE]).equal


def test_runs_report_the_failing_request_and_the_worst_difference():
    noisy = json.loads(json.dumps(BASE))
    noisy["prompt_logprobs"][1]["5"] = -0.6
    broken = json.loads(json.dumps(BASE))
    broken["output_ids"] = [3, 2]
    broken["output_logprobs"][1] = {"2": -0.1, "1": -0.2}
    verdict = compare_runs([BASE, BASE], [noisy, broken])
    assert not verdict.equal
    assert verdict.where.startswith("request 1, output position 1")
    assert abs(verdict.max_logprob_diff - 0.5) < 1e-9
