"""The soak's picture for people: decode tok/s, latency and server memory over time.

matplotlib is an optional extra (`plot`): the launcher itself stays small, and a
soak without it still writes every figure as JSON and says how to get the picture.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

from flashnext.atomic import write_atomic
from flashnext.tools import growth

GIB = float(1 << 30)


def missing_text() -> str | None:
    """None when matplotlib imports, else what to run to get it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (
            "no picture: matplotlib is not installed (the launcher's optional `plot` extra); "
            f"install it with `{sys.executable} -m pip install 'matplotlib>=3.8'`"
        )
    return None


def render_png(result: dict[str, Any]) -> bytes:
    """Three panels over the soak's time axis, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    rows = result["intervals"]
    mid = [(r["t0_s"] + r["t1_s"]) / 2 for r in rows]
    fig, (rate, lat, mem) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    rate.plot(mid, [r["decode_tok_s"] for r in rows], marker="o")
    rate.set_ylabel("decode tok/s")
    rate.set_title(
        f"soak: {result['requests']} requests, {result['lost']} lost, {result['duration_s']:.0f} s"
    )
    for key, style in (("ttft_s", "-"), ("itl_s", "--")):
        for q in ("p50", "p99"):
            pts = [(m, r[key][q]) for m, r in zip(mid, rows, strict=True) if r[key][q] is not None]
            if pts:
                xs, ys = zip(*pts, strict=True)
                lat.plot(xs, ys, style, marker=".", label=f"{key[:-2].upper()} {q}")
    lat.set_ylabel("seconds")
    lat.set_yscale("log")
    lat.legend(loc="upper right", fontsize="small")
    samples = result["samples"]
    ts = [s["t_s"] for s in samples]
    drew = False
    gpu = growth.gpu_field(samples)  # the reading the growth judge uses
    for key, label in (
        ("rss_bytes", "server RSS"),
        (gpu, "GPU (server's processes)" if gpu == "gpu_tree_bytes" else "GPU used (device)"),
        ("pinned_bytes", "pinned (VmPin + QSA pools)"),
    ):
        pts = [
            (t, s[key] / GIB) for t, s in zip(ts, samples, strict=True) if s.get(key) is not None
        ]
        if pts:
            xs, ys = zip(*pts, strict=True)
            mem.plot(xs, ys, marker=".", label=label)
            drew = True
    mem.set_ylabel("GiB")
    mem.set_xlabel("seconds since the soak started")
    if drew:
        mem.legend(loc="upper right", fontsize="small")
    else:
        why = result["memory"]["rss"].get("unavailable", "not sampled")
        mem.text(
            0.5,
            0.5,
            f"memory not sampled: {why}",
            ha="center",
            va="center",
            transform=mem.transAxes,
            wrap=True,
        )
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return buf.getvalue()


def write_png(path: Path, result: dict[str, Any]) -> None:
    write_atomic(path, render_png(result))
