"""The API's address: free to bind, as the facts probed it."""

from __future__ import annotations

from collections.abc import Iterator

from flashnext.checks.finding import Finding
from flashnext.checks.inputs import PreflightInput, _facts_lack, _ok


def port(inp: PreflightInput) -> Iterator[Finding]:
    probed = [p for p in inp.facts.ports if (p.host, p.port) == (inp.host, inp.port)]
    if not probed:
        held = ", ".join(f"{p.host}:{p.port}" for p in inp.facts.ports) or "none"
        yield Finding(
            "port",
            "warn",
            "unknown",
            "free",
            f"{_facts_lack(inp, f'a probe of {inp.host}:{inp.port}')} (it has {held}): "
            "whether the API can bind is unknown",
            f"record facts with `flashnext facts --host {inp.host} --port {inp.port} --out FILE` "
            "on the serving host and pass --facts FILE",
        )
    for p in probed:
        if p.free:
            yield _ok("port", f"{p.host}:{p.port} free", "free", "the API can bind")
        elif p.error:  # the probe could not answer (bad address, no permission)
            yield Finding(
                "port",
                "fail",
                f"{p.host}:{p.port}: {p.error}",
                "bindable",
                f"cannot bind {p.host}:{p.port}: {p.error}",
                "pass --host with an address of this machine, or a --port above 1023",
            )
        else:
            yield Finding(
                "port",
                "fail",
                f"{p.host}:{p.port} in use",
                "free",
                f"{p.host}:{p.port} is taken ({p.error or 'in use'})",
                f"stop what listens there (`ss -ltnp 'sport = :{p.port}'`) or pass --port N",
            )
