from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from dejavu_sdk import open_transport, serve
from dejavu_sdk.stores import MemoryStore
from dejavu_sdk.testing.transports import KEY, TransportTests


class TestGlooTransport(TransportTests):
    scheme = "gloo"


def test_nccl_urls_use_gloo_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, so nccl:// uses NCCL")
    with serve("nccl://127.0.0.1:0", MemoryStore()) as server, open_transport(server.url) as transport:
        assert transport.backend == "gloo"
        transport.flush(KEY, torch.arange(6))
        assert transport.fetch(KEY).tolist() == list(range(6))


def test_a_client_that_took_a_link_and_died_before_joining_holds_back_no_later_client() -> None:
    """A client killed between taking a link number and joining: the next client still links at once (within its
    connect timeout, far below the server's wait for the dead one)."""
    with serve("gloo://127.0.0.1:0", MemoryStore()) as server:
        port = int(server.url.rsplit(":", 1)[1])
        dead = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
        dead.add("links", 1)  # took a number, never says it is ready
        started = time.monotonic()
        with open_transport(server.url, connect_timeout=5) as transport:
            transport.flush(KEY, torch.arange(4))
            assert transport.fetch(KEY).tolist() == [0, 1, 2, 3]
        assert time.monotonic() - started < 5
