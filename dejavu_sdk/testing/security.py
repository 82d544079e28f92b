"""`ServerSecurityTests`: what a server does about other people and careless clients, for every server
transport (tcp, ucx, nccl/gloo), so a new transport inherits them.

    class TestTcpSecurity(ServerSecurityTests):
        scheme = "tcp"

Covered: a client without a token, or with a wrong one, can neither list, read, delete nor overwrite
anything, and the server keeps serving others; a token limited to a stream-id prefix reaches nothing
else; connections past the cap are refused politely; tensors nobody takes are refused, not queued
forever; malformed or non-canonical names are bad requests that leave the connection usable.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from ..backends import open_store, open_transport, serve
from ..blocks import BlockKey
from ..errors import AccessDenied, ServerBusy, TransportError
from ..store import Store
from ..tensors import random_tensor, same_bits
from ..transports.base import Server

TOKEN, TENANT_TOKEN = "root-token-1f2e", "tenant-a-token-9c8b"
KEY = BlockKey("tenant-a.req", layers=(0, 1), tokens=(0, 8))
OTHER = BlockKey("tenant-b.req", layers=(0, 1), tokens=(0, 8))


class ServerSecurityTests:
    """Threats every server transport withstands. Subclasses set `scheme`."""

    scheme: ClassVar[str]

    @contextlib.contextmanager
    def _server(self, **options: Any) -> Iterator[Server]:
        with serve(f"{self.scheme}://127.0.0.1:0", open_store("memory://"), **options) as server:
            yield server

    @pytest.fixture
    def guarded(self) -> Iterator[Server]:
        """A server with a token for every stream and one for streams starting with `tenant-a.`."""
        with self._server(tokens={TOKEN: "", TENANT_TOKEN: "tenant-a."}) as server:
            with open_transport(server.url, token=TOKEN) as owner:
                owner.flush(KEY, torch.arange(8))
                owner.flush(OTHER, torch.arange(8) * 2)
            yield server

    # ---- tokens -------------------------------------------------------------------------------
    @pytest.mark.parametrize("token", [None, "", "wrong-token", TOKEN + "x", TOKEN[:-1]])
    def test_a_client_without_the_token_can_do_nothing(self, guarded: Server, token: str | None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv("DEJAVU_TOKEN", raising=False)
        with open_transport(guarded.url, token=token or None) as stranger:
            attempts = [lambda: stranger.names(""), lambda: stranger.fetch(KEY),
                        lambda: stranger.remove([str(KEY)]), lambda: stranger.flush(KEY, torch.zeros(8)),
                        lambda: stranger.put_records([(str(KEY), np.zeros(64, np.uint8))]),
                        lambda: stranger.send_tensor(torch.ones(2))]
            for attempt in attempts:
                with pytest.raises(AccessDenied, match="token"):
                    attempt()
        with open_transport(guarded.url, token=TOKEN) as owner:  # nothing changed, and the server still serves
            assert same_bits(owner.fetch(KEY), torch.arange(8))
            assert sorted(owner.names("")) == sorted([str(KEY), str(OTHER)])

    def test_the_token_can_come_from_the_environment(self, guarded: Server, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("DEJAVU_TOKEN", TOKEN)
        with open_transport(guarded.url) as owner:
            assert same_bits(owner.fetch(KEY), torch.arange(8))

    def test_a_prefix_token_reaches_only_its_streams(self, guarded: Server) -> None:
        with open_transport(guarded.url, token=TENANT_TOKEN) as tenant:
            assert tenant.names("") == [str(KEY)]  # the other tenant's streams are not even listed
            assert same_bits(tenant.fetch(KEY), torch.arange(8))
            mine = BlockKey("tenant-a.new", layers=(0, 1), tokens=(0, 2))
            tenant.flush(mine, torch.ones(2))
            for attempt in (lambda: tenant.fetch(OTHER), lambda: tenant.flush(OTHER, torch.zeros(8)),
                            lambda: tenant.remove([str(OTHER)]), lambda: tenant.names("tenant-b.req/"),
                            lambda: tenant.put_records([(str(mine), np.zeros(64, np.uint8)),
                                                        (str(OTHER), np.zeros(64, np.uint8))])):
                with pytest.raises(AccessDenied, match=r"tenant-b\.req"):
                    attempt()
            assert same_bits(tenant.fetch(mine), torch.ones(2))  # the refused batch stored none of its records
            store = Store(tenant)  # a Store over a tenant's connection is held to its streams too
            listed = store.keys()
            assert [key.stream_id for key in listed] == ["tenant-a.new", "tenant-a.req"]
        with open_transport(guarded.url, token=TOKEN) as owner:
            assert same_bits(owner.fetch(OTHER), torch.arange(8) * 2)

    # ---- floods and careless clients --------------------------------------------------------
    @pytest.mark.slow
    def test_a_client_frozen_mid_request_stalls_nobody(self) -> None:
        """A client process stopped half way through sending a block must not hold up anyone else."""
        with self._server(timeout=2.0) as server:
            code = (f"import sys, torch, dejavu_sdk as dv\nlink = dv.open_transport({server.url!r}, timeout=60)\n"
                    "block = torch.zeros(64 << 20, dtype=torch.uint8)\nprint('ready', flush=True)\n"
                    "for step in range(1000):\n"
                    "    link.flush(dv.BlockKey('slow', layers=(0, 1), tokens=(step, step + 1)), block)\n")
            slow = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
            try:
                assert slow.stdout is not None
                assert slow.stdout.readline().strip() == "ready"
                time.sleep(0.5)  # well into its stream of 64 MiB flushes
                slow.send_signal(signal.SIGSTOP)
                with open_transport(server.url, timeout=10) as other:
                    for _ in range(3):
                        started = time.monotonic()
                        other.flush(KEY, torch.arange(8))
                        assert same_bits(other.fetch(KEY), torch.arange(8))
                        assert time.monotonic() - started < 1.0
                    time.sleep(2.5)  # past the server's deadline for the frozen request
                    names = other.names("")
                    assert str(KEY) in names
                    for name in names:  # what the frozen client got stored is whole; its half block is not there
                        other.fetch(BlockKey.parse(name))
            finally:
                slow.kill()
                slow.wait(timeout=30)


    def test_connections_past_the_cap_are_refused_politely(self) -> None:
        with self._server(max_connections=2) as server:
            first, second = open_transport(server.url), open_transport(server.url)
            first.names("")
            second.names("")
            third = open_transport(server.url)
            with pytest.raises(ServerBusy, match="connections"):
                third.names("")
            first.close()
            for _ in range(100):  # the server notices the closed connection within moments
                with contextlib.suppress(ServerBusy):
                    assert third.names("") == []
                    break
            else:
                pytest.fail("the freed connection slot was never given to the waiting client")
            second.close()
            third.close()

    def test_tensors_nobody_takes_are_refused_not_queued(self) -> None:
        with self._server(inbox_size=2) as server, open_transport(server.url) as link:
            link.send_tensor(torch.ones(2))
            link.send_tensor(torch.ones(3))
            with pytest.raises(ServerBusy, match="inbox"):
                link.send_tensor(torch.ones(4))
            assert server.recv_tensor(timeout=5).tolist() == [1.0, 1.0]
            link.send_tensor(torch.ones(4))  # room again
        with self._server(accept_tensors=False) as server, open_transport(server.url) as link:
            with pytest.raises(TransportError, match="takes no tensors"):
                link.send_tensor(torch.ones(2))
            link.flush(KEY, torch.ones(2))  # the connection stays usable

    @pytest.mark.parametrize("name", ["req/L01-2.T0-5", "req/L1-2.T0-05", "req/L\u0661-2.T0-5",
                                      "req/L1-2.T0-" + "9" * 5000, "../etc/passwd", "req/L2-1.T0-5"])
    def test_malformed_names_are_bad_requests(self, name: str) -> None:
        block = random_tensor((4,), torch.float16)
        with self._server() as server, open_transport(server.url) as link:
            with pytest.raises(TransportError, match=r"block key|canonical|outside|range"):
                link.put_records([(name, np.zeros(64, np.uint8))])
            with pytest.raises(TransportError, match=r"block key|canonical|outside|range"):
                link.remove([name])
            assert link.names("") == []  # nothing stored under any spelling
            link.flush(KEY, block)  # and the connection still works
            assert same_bits(link.fetch(KEY), block)

