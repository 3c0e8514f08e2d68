"""The vLLM serve would start: importable, the pinned version, this checkout's patches."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flashnext import VLLM_VERSION
from flashnext.checkout import BUILD_DOWNLOAD_TEXT, BUILD_INSTALLED_TEXT
from flashnext.checks.finding import Finding
from flashnext.checks.inputs import PreflightInput, _ok
from flashnext.facts.vllm_env import stamp_problem


def vllm_env(inp: PreflightInput) -> Iterator[Finding]:
    """The vLLM serve would exec: importable, the pinned version, this checkout's patches."""
    env = inp.vllm_env
    if env is None:
        return
    series = inp.patch_series
    required = (
        f"vLLM {VLLM_VERSION} + the {len(series)} patches of patches/vllm-{VLLM_VERSION}"
        if series is not None
        else f"vLLM {VLLM_VERSION} + the flashnext patches"
    )
    where = env.executable or env.env_dir or "-"
    use_pinned = _use_pinned_env(inp)
    if env.selected_by == "none":
        built = f", and {inp.build_env} has not built the pinned env here" if inp.build_env else ""
        yield Finding(
            "vllm.env",
            "fail",
            "no vLLM found",
            required,
            "no vLLM to start: --vllm-env and FLASHNEXT_VLLM_ENV are unset, no `vllm` is on "
            f"PATH{built}",
            (
                f"{inp.build_env} (builds the pinned, patched env: {BUILD_DOWNLOAD_TEXT}, "
                f"{BUILD_INSTALLED_TEXT}; `flashnext serve` runs it itself)"
            )
            if inp.build_env
            else use_pinned,
        )
        return
    if env.error:
        yield Finding(
            "vllm.env",
            "fail",
            "not usable",
            required,
            f"the vLLM chosen by {env.selected_by} ({where}): {env.error}",
            use_pinned,
        )
        return
    if env.version != VLLM_VERSION:
        yield Finding(
            "vllm.env",
            "fail",
            f"vLLM {env.version}",
            required,
            f"{where} ({env.selected_by}) runs vLLM {env.version} from {env.package_dir}; "
            f"the patch series is written for {VLLM_VERSION}",
            use_pinned,
        )
        return
    stamp_error = env.stamp_error or (env.stamp is not None and stamp_problem(env.stamp))
    if stamp_error:
        yield Finding(
            "vllm.env",
            "fail",
            "unreadable patch stamp",
            required,
            f"{env.package_dir}/_flashnext_patches.json cannot be read: {stamp_error}",
            use_pinned,
        )
        return
    if env.stamp is None:
        yield Finding(
            "vllm.env",
            "fail",
            f"stock vLLM {env.version}",
            required,
            f"{where} ({env.selected_by}) runs a stock vLLM from {env.package_dir} (no "
            "_flashnext_patches.json): it refuses qwen4_exp under PP=3 and has neither the "
            "PLE table file nor the QSA offload",
            use_pinned,
        )
        return
    applied = tuple((p.get("name"), p.get("sha256")) for p in env.stamp.get("patches") or ())
    stamped_for = env.stamp.get("vllm_version")
    if stamped_for != VLLM_VERSION or (series is not None and applied != series):
        yield Finding(
            "vllm.env",
            "fail",
            f"stale: {_stamp_difference(applied, series, stamped_for)}",
            required,
            f"{env.package_dir} ({env.selected_by}) was patched with another series than this "
            "checkout's: it runs other code than the one proven here",
            use_pinned,
        )
        return
    compared = (
        "equal to this checkout's series"
        if series is not None
        else "no checkout series to compare (an installed launcher ships with its env)"
    )
    yield _ok(
        "vllm.env",
        f"vLLM {env.version}, {len(applied)} patches",
        required,
        f"{where} ({env.selected_by}); stamp {compared}",
    )


def _use_pinned_env(inp: PreflightInput) -> str:
    if inp.build_env:
        return (
            f'pass --vllm-env "$({inp.build_env} | tail -1)" (builds the pinned, patched env '
            "or reuses the built one)"
        )
    return (
        "pass --vllm-env DIR of an env built by pins/build-env in a flashnext checkout, or "
        "run the Nix app or the image, which carry theirs"
    )


def _stamp_difference(
    applied: tuple[tuple[Any, Any], ...], series: tuple[tuple[str, str], ...] | None, version: Any
) -> str:
    if version != VLLM_VERSION:
        return f"stamped for vLLM {version}"
    names = {n for n, _ in applied}
    for name, digest in series or ():
        if name not in names:
            return f"{name} not applied"
        if (name, digest) not in applied:
            return f"{name} changed since"
    extra = [n for n, _ in applied if n not in {n for n, _ in series or ()}]
    return f"{extra[0]} not in the series" if extra else "patch order differs"
