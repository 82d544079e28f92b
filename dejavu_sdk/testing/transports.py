"""`TransportTests`: the conformance suite every networked transport passes (tcp, ucx, nccl/gloo).

    class TestTcp(TransportTests):
        scheme = "tcp"

Servers run in this process for the functional tests, and in a `dejavu serve-store` child process for
the peer-death and timeout tests, which kill or freeze that child.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from ..blocks import DTYPE_CODES, BlockKey, torch_dtype
from ..errors import BlockNotFound, ConfigError, StoreClosed, TransportError
from ..stores import MemoryStore
from ..tensors import random_tensor, same_bits
from ..transports import Server, Transport, open_transport, serve
from ..transports.child import ServedStoreProcess

KEY = BlockKey("req-1", layers=(0, 2), tokens=(0, 16))
BIG = 64 << 20


def _in_background(action: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = action()
        except BaseException as error:  # inspected by the test
            outcome["error"] = error
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


class TransportTests:
    """Behaviour every networked transport must have. Subclasses set `scheme` (and `options`)."""

    scheme: ClassVar[str]
    options: ClassVar[dict[str, Any]] = {}

    @pytest.fixture
    def server(self) -> Iterator[Server]:
        with serve(f"{self.scheme}://127.0.0.1:0", MemoryStore()) as server:
            yield server

    @pytest.fixture
    def transport(self, server: Server) -> Iterator[Transport]:
        with open_transport(server.url, **self.options) as transport:
            yield transport

    @pytest.fixture
    def peer(self) -> Iterator[ServedStoreProcess]:
        with ServedStoreProcess(self.scheme) as peer:
            yield peer

    # ---- blocks ----------------------------------------------------------------------------
    @pytest.mark.parametrize("dtype_name", sorted(DTYPE_CODES))
    def test_every_dtype_round_trips(self, transport: Transport, dtype_name: str) -> None:
        block = random_tensor((2, 2, 1, 3, 16, 8), torch_dtype(dtype_name), seed=len(dtype_name))
        transport.flush(KEY, block)
        assert same_bits(transport.fetch(KEY), block)

    def test_large_blocks_round_trip_into_out(self, transport: Transport) -> None:
        block = random_tensor((BIG // 2,), torch.float16, seed=7)
        transport.flush(KEY, block)
        out = torch.empty_like(block)
        assert transport.fetch(KEY, out=out) is out
        assert same_bits(out, block)

    def test_strided_sources_and_outs(self, transport: Transport) -> None:
        block = random_tensor((16, 8), torch.bfloat16).t()
        transport.flush(KEY, block)
        out = torch.empty(16, 8, dtype=torch.bfloat16).t()
        transport.fetch(KEY, out=out)
        assert same_bits(out, block)

    def test_a_wrong_out_is_refused_and_the_link_stays_usable(self, transport: Transport) -> None:
        block = random_tensor((4, 4), torch.float32)
        transport.flush(KEY, block)
        with pytest.raises(ConfigError, match="out"):
            transport.fetch(KEY, out=torch.empty(2, 8))
        assert same_bits(transport.fetch(KEY), block)

    def test_missing_blocks_raise_block_not_found(self, transport: Transport) -> None:
        with pytest.raises(BlockNotFound, match="req-1"):
            transport.fetch(KEY)
        transport.flush(KEY, torch.ones(2))  # the link survives the error reply
        assert transport.fetch(KEY).tolist() == [1.0, 1.0]

    def test_record_operations(self, transport: Transport, server: Server) -> None:
        transport.flush(KEY, torch.ones(3))
        assert transport.names("") == [str(KEY)]
        record = transport.get_record(str(KEY))
        other = BlockKey("req-2", layers=(0, 2), tokens=(0, 16))
        third = BlockKey("req-2", layers=(2, 4), tokens=(0, 16))
        transport.put_records([(str(other), record), (str(third), record[:-1])])  # one request, both stored
        assert sorted(transport.names("")) == [str(KEY), str(other), str(third)]
        assert np.array_equal(transport.get_record(str(other)), record)
        transport.remove([str(KEY)])
        assert transport.names("req-1/") == []

    # ---- tensors ---------------------------------------------------------------------------
    def test_tensors_reach_the_inbox_in_order(self, transport: Transport, server: Server) -> None:
        sent = [random_tensor((3, 5), torch.bfloat16, seed=s) for s in range(3)] + [torch.arange(7)]
        for tensor in sent:
            transport.send_tensor(tensor)
        for tensor in sent:
            assert same_bits(server.recv_tensor(timeout=10), tensor)
        with pytest.raises(TransportError, match="no tensor"):
            server.recv_tensor(timeout=0.1)

    # ---- arguments, closing, threads -------------------------------------------------------
    def test_bad_arguments_raise_config_errors(self, transport: Transport) -> None:
        with pytest.raises(ConfigError, match="BlockKey"):
            transport.flush(str(KEY), torch.ones(2))  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="torch.Tensor"):
            transport.send_tensor([1, 2])  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="would not be used"):
            open_transport(transport.url, colour="red")

    def test_use_after_close_raises_store_closed(self, server: Server) -> None:
        transport = open_transport(server.url, **self.options)
        transport.close()
        with pytest.raises(StoreClosed):
            transport.fetch(KEY)
        transport.close()

    def test_threads_can_share_a_transport(self, transport: Transport) -> None:
        def worker(thread: int) -> None:
            for step in range(10):
                key = BlockKey(f"t{thread}", layers=(0, 1), tokens=(step, step + 1))
                block = random_tensor((64, 64), torch.float16, seed=thread * 100 + step)
                transport.flush(key, block)
                assert same_bits(transport.fetch(key), block)

        threads = [_in_background(lambda t=t: worker(t)) for t in range(4)]
        for thread, outcome in threads:
            thread.join(timeout=120)
            assert "error" not in outcome, outcome.get("error")
        assert len(transport.names("")) == 40

    # ---- failures of the peer --------------------------------------------------------------
    def test_a_peer_killed_mid_transfer_gives_transport_error_at_once(self, peer: ServedStoreProcess) -> None:
        transport = open_transport(peer.url, timeout=20, connect_timeout=3, **self.options)
        transport.flush(KEY, torch.ones(4))  # connected
        peer.signal(signal.SIGSTOP)  # the transfer below stalls half way, then the peer dies
        thread, outcome = _in_background(lambda: transport.flush(KEY, torch.empty(4 * BIG, dtype=torch.uint8)))
        time.sleep(1.0)
        assert thread.is_alive(), "the transfer should be stalled mid-way"
        killed_at = time.monotonic()
        peer.signal(signal.SIGKILL)
        thread.join(timeout=20)
        assert isinstance(outcome.get("error"), TransportError), outcome
        assert outcome["at"] - killed_at < 5.0
        with pytest.raises(TransportError, match="connect|refused|reach|closed|reset|failed"):
            transport.fetch(KEY)
        transport.close()

    def test_a_hung_peer_gives_transport_error_within_the_timeout_then_the_link_recovers(
            self, peer: ServedStoreProcess) -> None:
        transport = open_transport(peer.url, timeout=1.0, **self.options)
        transport.flush(KEY, torch.ones(4))
        peer.signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(TransportError):
            transport.fetch(KEY)
        assert time.monotonic() - started < 10.0
        peer.signal(signal.SIGCONT)
        assert transport.fetch(KEY).tolist() == [1.0] * 4  # reconnected
        transport.close()

    def test_the_server_stops_cleanly_on_sigterm(self, peer: ServedStoreProcess) -> None:
        with open_transport(peer.url, **self.options) as transport:
            transport.flush(KEY, torch.ones(4))
        peer.signal(signal.SIGTERM)
        assert peer.process.wait(timeout=20) == 0
