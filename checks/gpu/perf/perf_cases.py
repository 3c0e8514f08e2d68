"""The engines the PP=3 perf harness runs, each one's cases, and issue 27's cut.

Its own module so that `pp3_perf.py` (which runs the engines and calls the
contract) and `perf_contract.py` (which reads the cut's two engines) share the
names without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

TTFT_48K = 48_000


@dataclass(frozen=True)
class Engine:
    name: str
    mode: str  # "offload": the plan's; "vram": QSA K/V in VRAM
    mtp_k: int = 0
    cases: tuple = ()  # ("decode", concurrency) | ("ttft", prompt_tokens or "limit")
    # The cut's before: the profile's capture sizes alone, as the plan had them
    # before flashnext.plan.decode_graphs (MTP's 3-4 request decodes ran eager).
    profile_capture_sizes: bool = False


MTP_DECODE = (("decode", 1), ("decode", 4))
ENGINES = (
    Engine("offload", "offload", 0, (("decode", 1), ("decode", 4), ("ttft", TTFT_48K))),
    Engine("offload-262k", "offload", 0, (("ttft", "limit"),)),
    Engine("vram", "vram", 0, (("decode", 1), ("decode", 4), ("ttft", TTFT_48K))),
    *(Engine(f"mtp{k}", "offload", k, MTP_DECODE) for k in (1, 2, 3)),
    Engine("mtp1-before", "offload", 1, MTP_DECODE, profile_capture_sizes=True),
)
# issue 27's cut, before and after in one run: (engine before, engine after, what)
CUT = ("mtp1-before", "mtp1", "MTP K=1 decode graphs: capture sizes [1, 2, 4] -> [1, 2, 4, 8] "
       "(flashnext.plan.decode_graphs: with the profile's alone a decode of 3-4 requests, 6-8 "
       "tokens, had no graph and ran eager); decode tok/s at c=4")  # fmt: skip


def engines_named(names: list[str] | None) -> list[Engine]:
    known = {e.name: e for e in ENGINES}
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        raise SystemExit(f"pp3_perf: unknown engine(s) {unknown}; known: {list(known)}")
    return [known[n] for n in names] if names else list(ENGINES)
