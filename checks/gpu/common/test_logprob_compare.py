"""The A/B's comparison rule (checks/gpu/common/logprob_compare.py), on recorded-shape data.

Requests are in the worker's JSON form (token ids as strings, as after a JSON
round trip): `prompt_logprobs` one top-k dict per position (the first None),
`output_ids` and one top-k dict per generated token.
"""

from __future__ import annotations

import json

from logprob_compare import compare_runs, disagreement


def request(prompt_tops, output_ids, output_tops):
    data = {
        "prompt_logprobs": [None, *prompt_tops],
        "output_ids": output_ids,
        "output_logprobs": output_tops,
    }
    return json.loads(json.dumps(data))  # ids become strings, as recorded


def base(n: int = 6):
    """n prompt positions, each with a clear top-1 (token 10 + position)."""
    tops = [{10 + p: -0.1, 90: -2.5, 91: -4.0} for p in range(n)]
    return request(tops, [3, 4], [{3: -0.3, 4: -1.5}, {4: -0.05, 2: -3.1}])


def changed(req, position, top):
    """A copy of req whose prompt position `position` (1-based) has top `top`."""
    out = json.loads(json.dumps(req))
    out["prompt_logprobs"][position] = {str(k): v for k, v in top.items()}
    return out


def test_identical_runs_are_equal_with_zero_difference():
    verdict = compare_runs([base()], [base()], [base()])
    assert verdict.equal and verdict.max_logprob_diff == 0.0 and verdict.violations == 0
    assert verdict.deterministic_positions == 6


def test_noise_inside_the_rule_where_stock_is_exact_is_equal_and_measured():
    noisy = changed(base(), 2, {11: -0.3, 90: -2.5, 91: -4.0})
    verdict = compare_runs([base()], [base()], [noisy])
    assert verdict.equal
    assert abs(verdict.max_logprob_diff - 0.2) < 1e-9


def test_a_violation_where_stock_reproduces_itself_fails():
    """The two stock runs agree everywhere: any broken rule is the candidate's."""
    wrong = changed(base(), 3, {50: -0.1, 51: -0.2})  # 12 is not in this top-k
    verdict = compare_runs([base()], [base()], [wrong])
    assert not verdict.equal
    assert verdict.where.startswith("request 0, prompt position 3: 12 vs 50")


def test_after_stocks_own_first_difference_its_spread_is_allowed():
    stock_2 = changed(base(), 4, {60: -0.1, 61: -0.2})  # stock itself breaks at 4
    candidate = changed(base(), 5, {70: -0.1, 71: -0.2})  # the candidate at 5, once
    verdict = compare_runs([base()], [stock_2], [candidate])
    assert verdict.equal, verdict.where
    assert (verdict.violations, verdict.stock_violations) == (1, 1)
    assert verdict.deterministic_positions == 3


def test_more_violations_than_stocks_spread_fail():
    stock_2 = changed(base(8), 4, {60: -0.1, 61: -0.2})  # 1 violation: allows 2x1+1 = 3
    candidate = base(8)
    for position in (4, 5, 6, 7):
        candidate = changed(candidate, position, {70 + position: -0.1})
    verdict = compare_runs([base(8)], [stock_2], [candidate])
    assert not verdict.equal and verdict.violations == 4
    assert verdict.where.startswith("4 rule violations, stock's own spread allows 3")


def test_a_mean_difference_far_over_stocks_fails():
    stock_2 = changed(base(), 4, {14: -0.12, 90: -2.5, 91: -4.0})  # stock differs by 0.02
    candidate = base()
    for position in range(4, 7):
        candidate = changed(candidate, position, {9 + position: -0.9, 90: -2.5, 91: -4.0})
    verdict = compare_runs([base()], [stock_2], [candidate])
    assert not verdict.equal and verdict.where.startswith("mean |logprob diff|")


def test_a_generated_token_outside_the_others_top_k_is_a_violation():
    wrong = request(base()["prompt_logprobs"][1:], [3, 7], [{3: -0.3}, {7: -0.01, 1: -5.0}])
    found = disagreement([base()], [wrong])
    assert found.violations == [(0, "output position 1: 4 vs 7")]
    # where stock decodes reproducibly, that fails the case
    assert not compare_runs([base()], [base()], [wrong]).equal


def test_a_near_tie_flip_inside_both_top_k_ends_the_output_comparison():
    flipped = request(base()["prompt_logprobs"][1:], [4, 9], [{4: -0.29, 3: -0.31}, {9: -0.01}])
    assert disagreement([base()], [flipped]).violations == []


def test_request_count_and_length_mismatches_are_violations():
    assert disagreement([base()], [base(), base()]).violations
    assert disagreement([base(6)], [base(5)]).violations[0] == (0, "prompt lengths differ")
