from __future__ import annotations

import pytest
import torch

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
