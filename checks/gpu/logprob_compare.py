"""Compare two engines' outputs the way vLLM's own tests do (pure Python).

vLLM's `tests/models/utils.py check_logprobs_close` accepts two greedy runs as
close when, at the first position where their tokens differ, each run's token
is among the other's top-k logprobs; after that the sequences diverge and are
not compared further. Teacher-forced prompt logprobs see the same inputs at
every position, so the rule is applied at every position there (no
divergence), comparing each position's top-1 token. Besides the verdict we
keep the largest |logprob difference| of the tokens both runs scored (the
prompt token at each position, the generated token until divergence).

The inputs are what a worker records from `RequestOutput`: per request
`output_ids` and `output_logprobs` (one `{token_id: logprob}` dict per
generated token) and `prompt_logprobs` (one dict per prompt position; the
first is None), token ids as strings once they went through JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TopK = dict[int, float]


@dataclass(frozen=True)
class Verdict:
    equal: bool
    max_logprob_diff: float
    where: str
    """The first position that broke the rule ('' when equal)."""


def _topk(entry: dict[Any, float] | None) -> TopK:
    return {int(token): float(lp) for token, lp in (entry or {}).items()}


def _argmax(top: TopK) -> int:
    return max(top, key=lambda token: (top[token], -token))


def compare_request(a: dict[str, Any], b: dict[str, Any]) -> Verdict:
    """One request of two runs: prompt logprobs at every position, then tokens."""
    worst = 0.0
    prompt_a, prompt_b = a["prompt_logprobs"], b["prompt_logprobs"]
    if len(prompt_a) != len(prompt_b):
        return Verdict(False, float("inf"), "prompt lengths differ")
    for pos, (ea, eb) in enumerate(zip(prompt_a, prompt_b, strict=True)):
        if ea is None and eb is None:
            continue
        top_a, top_b = _topk(ea), _topk(eb)
        for token in top_a.keys() & top_b.keys():
            worst = max(worst, abs(top_a[token] - top_b[token]))
        best_a, best_b = _argmax(top_a), _argmax(top_b)
        if best_a != best_b and not (best_a in top_b and best_b in top_a):
            return Verdict(False, worst, f"prompt position {pos}: {best_a} vs {best_b}")
    ids_a, ids_b = a["output_ids"], b["output_ids"]
    for pos, (ta, tb) in enumerate(zip(ids_a, ids_b, strict=False)):
        top_a, top_b = _topk(a["output_logprobs"][pos]), _topk(b["output_logprobs"][pos])
        if ta == tb:
            worst = max(worst, abs(top_a[ta] - top_b[tb]))
            continue
        if ta in top_b and tb in top_a:
            break  # a tie broken differently: the rest diverges, as in vLLM's rule
        return Verdict(False, worst, f"output position {pos}: {ta} vs {tb}")
    else:
        if len(ids_a) != len(ids_b):
            return Verdict(False, worst, f"output lengths {len(ids_a)} vs {len(ids_b)}")
    return Verdict(True, worst, "")


def compare_runs(reference: list[dict], candidate: list[dict]) -> Verdict:
    """All requests of one (prompt length, batch) case; the first failure wins."""
    if len(reference) != len(candidate):
        return Verdict(False, float("inf"), "request counts differ")
    worst = 0.0
    for index, (ra, rb) in enumerate(zip(reference, candidate, strict=True)):
        verdict = compare_request(ra, rb)
        worst = max(worst, verdict.max_logprob_diff)
        if not verdict.equal:
            return Verdict(False, worst, f"request {index}, {verdict.where}")
    return Verdict(True, worst, "")
