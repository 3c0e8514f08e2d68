"""Port probe: real sockets on the loopback interface."""

from __future__ import annotations

import socket

import pytest
from flashnext.facts.ports import probe_port


def _listening(host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen()
    return sock


def test_busy_port_is_not_free():
    with _listening() as server:
        port = server.getsockname()[1]
        facts = probe_port("127.0.0.1", port)
        assert (facts.free, facts.error) == (False, None)
    # Closed without ever accepting a connection: no TIME_WAIT, so the port is free again.
    assert probe_port("127.0.0.1", port).free is True


def test_wildcard_listener_blocks_loopback():
    # A server on 0.0.0.0 holds the port on every address, 127.0.0.1 included.
    with _listening("0.0.0.0") as server:
        port = server.getsockname()[1]
        assert probe_port("127.0.0.1", port).free is False


def test_probe_releases_the_port():
    with _listening() as server:
        port = server.getsockname()[1]
    assert probe_port("127.0.0.1", port).free
    # The probe itself must not keep the port: binding right after succeeds.
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    ("host", "port", "words"),
    [
        ("127.0.0.1", 0, "port 0 is not in 1-65535"),
        ("127.0.0.1", 70000, "port 70000 is not in 1-65535"),
        ("no-such-host.invalid", 8000, "cannot resolve 'no-such-host.invalid'"),
        ("192.0.2.1", 8000, "192.0.2.1 is not an address of this machine"),  # TEST-NET-1
    ],
)
def test_unanswerable_questions_say_why(host, port, words):
    facts = probe_port(host, port)
    assert facts.free is False
    assert words in facts.error


def test_ipv6_loopback():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this Python")
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with socket.socket(socket.AF_INET6) as server:
        server.bind(("::1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert probe_port("::1", port).free is False


def test_time_wait_of_a_stopped_server_does_not_hold_the_port():
    """A server restarted right after a stop: its old connections linger in
    TIME_WAIT on the port. vLLM binds with SO_REUSEADDR, so it starts; the
    probe must say free (seen on the H200: preflight refused the restart)."""
    import errno

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server side closes first: TIME_WAIT on the server's port
    client.close()
    server.close()
    with socket.socket() as plain, pytest.raises(OSError) as held:
        plain.bind(("127.0.0.1", port))  # the TIME_WAIT is there
    assert held.value.errno == errno.EADDRINUSE
    assert probe_port("127.0.0.1", port).free is True
    with socket.socket() as like_vllm:
        like_vllm.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        like_vllm.bind(("127.0.0.1", port))
        like_vllm.listen()
