"""Port probe: can the server bind HOST:PORT right now?"""

from __future__ import annotations

import errno
import socket

from flashnext.facts.schema import PortFacts


def probe_port(host: str, port: int) -> PortFacts:
    """Try to bind a TCP socket to (host, port), then release it. Never raises.

    A port in use is `free=False` with no error; `error` is set only when the
    question could not be answered (bad port, unknown host, foreign address, ...).

    SO_REUSEADDR stays off on purpose: the answer is then "free" only when no
    socket (listening, or lingering in TIME_WAIT) holds the port, which is the
    conservative answer for a server about to start.
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
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
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
