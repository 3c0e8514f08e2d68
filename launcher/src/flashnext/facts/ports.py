"""Port probe: can the server bind HOST:PORT right now?"""

from __future__ import annotations

import errno
import socket

from flashnext.facts.schema import PortFacts


def probe_port(host: str, port: int) -> PortFacts:
    """Try to bind a TCP socket to (host, port), then release it. Never raises.

    A port in use is `free=False` with no error; `error` is set only when the
    question could not be answered (bad port, unknown host, foreign address, ...).

    The probe binds as vLLM 0.33.0's server does (SO_REUSEADDR on,
    `entrypoints/launchers/launcher.py`): a listener holds the port, but
    connections of a stopped server lingering in TIME_WAIT (for a minute after
    a restart) do not, since vLLM's bind succeeds then.
    """
    if not 0 < port < 65536:
        return PortFacts(host=host, port=port, free=False, error=f"port {port} is not in 1-65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return PortFacts(host=host, port=port, free=False, error=f"cannot resolve {host!r}: {exc}")
    family, socktype, proto, _, address = infos[0]
    try:
        with socket.socket(family, socktype, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return PortFacts(host=host, port=port, free=False)
        if exc.errno == errno.EADDRNOTAVAIL:
            reason = f"{host} is not an address of this machine"
        elif exc.errno == errno.EACCES:
            reason = "permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE)"
        else:
            reason = str(exc)
        return PortFacts(host=host, port=port, free=False, error=reason)
    return PortFacts(host=host, port=port, free=True)
