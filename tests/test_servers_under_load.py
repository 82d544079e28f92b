"""A TCP server that one client cannot harm: trickling, idle and flooding clients cost others nothing.

These use raw sockets, so they are TCP's own; `ServerSecurityTests` covers what every server transport does.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.stores import MemoryStore
from dejavu_sdk.testing.frames import HELLO, frame
from dejavu_sdk.transports.wire import Op

KEY = dv.BlockKey("req-1", layers=(0, 1), tokens=(0, 4))


def _connect(server: dv.transports.Server) -> socket.socket:
    host, port = server.url.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _flush_seconds(server: dv.transports.Server) -> float:
    with dv.open_transport(server.url, timeout=10) as good:
        started = time.monotonic()
        good.flush(KEY, torch.arange(4))
        assert good.fetch(KEY).tolist() == [0, 1, 2, 3]
        return time.monotonic() - started


@pytest.fixture
def server() -> Iterator[dv.transports.Server]:
    with dv.serve("tcp://127.0.0.1:0", MemoryStore(), timeout=1.0, idle_timeout=1.0) as server:
        yield server


def test_a_client_that_trickles_a_request_is_dropped_at_the_deadline_and_stalls_nobody(server) -> None:
    request = HELLO + frame(Op.LIST, b"")
    with _connect(server) as slow:
        slow.sendall(request[:len(HELLO)])
        assert slow.recv(4096)  # greeted
        started = time.monotonic()
        dropped = False
        for byte in request[len(HELLO):]:  # one byte every 0.2 s: each piece is prompt
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                dropped = True
                break
            assert _flush_seconds(server) < 1.0  # everyone else is served meanwhile
            time.sleep(0.2)
            if time.monotonic() - started > 5:
                break
        slow.settimeout(5)
        with contextlib.suppress(OSError):
            dropped = dropped or slow.recv(4096) == b""
    assert dropped, "a request trickled over 5 s was never dropped, although the deadline is 1 s"


def test_idle_connections_are_closed_and_cost_others_nothing(server) -> None:
    idle = [_connect(server) for _ in range(50)]
    try:
        for sock in idle:
            sock.sendall(HELLO)
        assert _flush_seconds(server) < 1.0
        time.sleep(1.5)  # past the idle timeout
        for sock in idle:
            sock.settimeout(5)
            received = b""
            while chunk := sock.recv(4096):  # the greeting, then the server's close
                received += chunk
            assert received  # it was greeted before it went idle
    finally:
        for sock in idle:
            sock.close()


def test_an_idle_client_connection_reconnects_by_itself() -> None:
    with dv.serve("tcp://127.0.0.1:0", MemoryStore(), idle_timeout=0.3) as server, \
            dv.open_transport(server.url) as link:
        link.flush(KEY, torch.arange(4))
        time.sleep(0.8)  # the server closes the idle connection
        assert link.fetch(KEY).tolist() == [0, 1, 2, 3]  # one call, no error: reopened once


def test_a_burst_of_connections_is_queued_not_dropped() -> None:
    with dv.serve("tcp://127.0.0.1:0", MemoryStore()) as server:
        host, port = server.url.removeprefix("tcp://").rsplit(":", 1)
        seconds: list[float] = []
        lock = threading.Lock()

        def connect() -> None:
            started = time.monotonic()
            with socket.create_connection((host, int(port)), timeout=10), lock:
                seconds.append(time.monotonic() - started)

        threads = [threading.Thread(target=connect) for _ in range(200)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert len(seconds) == 200
        assert max(seconds) < 1.0, f"{sum(s >= 1.0 for s in seconds)} of 200 connects took a second or more"
