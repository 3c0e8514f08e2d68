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


def _loopback(host: str) -> bool:
    """Whether only this machine reaches `host`: 127.0.0.0/8, ::1 or `localhost`.
    A wildcard (0.0.0.0, ::) or any other name may be reached from the network."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def exposure(inp: PreflightInput) -> Iterator[Finding]:
    """An API bound beyond loopback without a key serves anyone who reaches it."""
    if inp.api_key_set is None or _loopback(inp.host):
        return
    where = f"{inp.host}:{inp.port}"
    if inp.api_key_set:
        yield _ok("api.exposure", f"{where}, API key set", "a key off loopback",
                  f"the API at {where} demands the key")  # fmt: skip
        return
    yield Finding(
        "api.exposure",
        "warn",
        f"{where}, no API key",
        "an API key when bound beyond loopback",
        f"--host {inp.host} exposes the API beyond this machine with no API key: anyone who "
        f"reaches port {inp.port} can generate with the model and read what it serves",
        "write a key to a file only you can read and pass --api-key-file FILE "
        "(or set VLLM_API_KEY), or bind loopback with --host 127.0.0.1",
    )
