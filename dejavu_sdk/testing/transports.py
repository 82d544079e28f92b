"""Conformance suites for transports, in two halves:

    TransportContractTests   what every transport does: blocks, records, tensors, bad arguments, closing,
                             threads, and whether it serves (as it declares); `local` passes it too
    TransportFailureTests    what a networked transport does when its peer dies, hangs or stops
    TransportTests           both, for networked transports:

    class TestTcp(TransportTests):
        scheme = "tcp"

A networked transport's server runs in this process for the contract, and in a `dejavu serve-store`
child process for the failure tests, which kill or freeze that child. A transport that is not reached by
URL (like `local`) subclasses the contract and overrides the `transport_factory` and `inbox` fixtures.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol

import attrs
import numpy as np
import pytest
import torch

from ..backends import open_store, open_transport, serve
from ..blocks import DTYPE_CODES, BlockKey, ProgressKey, torch_dtype
from ..errors import BlockNotFound, ConfigError, StoreClosed, TransportError
from ..store import Store
from ..tensors import random_tensor, same_bits
from ..transports.base import INBOX_SIZE, Server, ServingTransport, Transport
from .peers import ServedStoreProcess

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


class Inbox(Protocol):
    """Where tensors sent through a transport arrive: its peer's Server (or the local transport itself)."""

    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor: ...


class TransportContractTests:
    """Behaviour every transport must have. Networked ones set `scheme` (and `options`); others override
    the `transport_factory` and `inbox` fixtures."""

    scheme: ClassVar[str]
    options: ClassVar[dict[str, Any]] = {}

    @pytest.fixture
    def server(self) -> Iterator[Server]:
        with serve(f"{self.scheme}://127.0.0.1:0", open_store("memory://")) as server:
            yield server

    @pytest.fixture
    def transport_factory(self, server: Server) -> Callable[[], Transport]:
        """Each call: a new connection to the same peer store."""
        return lambda: open_transport(server.url, **self.options)

    @pytest.fixture
    def inbox(self, server: Server) -> Inbox:
        return server

    @pytest.fixture
    def transport(self, transport_factory: Callable[[], Transport]) -> Iterator[Transport]:
        with transport_factory() as transport:
            yield transport

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

    # ---- records ---------------------------------------------------------------------------
    def test_record_operations(self, transport: Transport) -> None:
        transport.flush(KEY, torch.ones(3))
        assert transport.names("") == [str(KEY)]
        with transport.get_record(str(KEY)) as stored:
            record = np.frombuffer(bytes(stored), dtype=np.uint8)
        other = BlockKey("req-2", layers=(0, 2), tokens=(0, 16))
        third = BlockKey("req-2", layers=(2, 4), tokens=(0, 16))
        transport.put_records([(str(other), record), (str(third), record[:-1])])  # one request, both stored
        assert sorted(transport.names("")) == [str(KEY), str(other), str(third)]
        with transport.get_record(str(other)) as copied:
            assert np.array_equal(np.frombuffer(bytes(copied), dtype=np.uint8), record)
        transport.remove([str(KEY)])
        assert transport.names("req-1/") == []
        assert transport.allocate(16).nbytes == 16

    def test_a_store_over_the_transport_is_a_store_like_any_other(self, transport_factory: Callable[[],
                                                                                               Transport]) -> None:
        with Store(transport_factory()) as store:
            block = random_tensor((2, 2, 1, 2, 4, 8), torch.float16, seed=5)
            key, progress = attrs.evolve(KEY, run="abc"), ProgressKey(KEY.stream_id, "abc", 0, 0)
            store.write_manifest(KEY.stream_id, b'{"step": 0}')
            store.flush_with_progress(key, block, progress, b'{"step": 1}')
            assert same_bits(store.fetch(key), block)
            assert store.read_manifest(KEY.stream_id) == b'{"step": 0}'
            assert store.read_progress(progress) == b'{"step": 1}'
            assert store.keys() == [key]
            assert store.progress_keys(KEY.stream_id) == [progress]
            assert store.delete(KEY.stream_id) == 1
            assert store.keys() == []
            assert store.progress_keys(KEY.stream_id) == []

    # ---- tensors ---------------------------------------------------------------------------
    def test_tensors_reach_the_inbox_in_order(self, transport: Transport, inbox: Inbox) -> None:
        sent = [random_tensor((3, 5), torch.bfloat16, seed=s) for s in range(3)] + [torch.arange(7)]
        for tensor in sent:
            transport.send_tensor(tensor)
        for tensor in sent:
            assert same_bits(inbox.recv_tensor(timeout=10), tensor)
        with pytest.raises(TransportError, match="no tensor"):
            inbox.recv_tensor(timeout=0.1)

    def test_posted_tensors_reach_the_inbox_in_order_among_sent_ones(self, transport: Transport,
                                                                     inbox: Inbox) -> None:
        sent = [random_tensor((3, 5), torch.bfloat16, seed=s) for s in range(3)] + [torch.arange(7)]
        transport.post_tensor(sent[0])
        transport.send_tensor(sent[1])
        transport.post_tensor(sent[2])
        transport.post_tensor(sent[3])
        for tensor in sent:
            assert same_bits(inbox.recv_tensor(timeout=10), tensor)
        with pytest.raises(ConfigError, match=r"torch\.Tensor"):
            transport.post_tensor([1, 2])  # type: ignore[arg-type]

    def test_posts_beyond_a_full_inbox_wait_for_room_and_none_is_lost(self, transport: Transport,
                                                                      inbox: Inbox) -> None:
        count = INBOX_SIZE + 16

        def post_them_all() -> None:
            for i in range(count):
                transport.post_tensor(torch.full((4,), i))

        thread, outcome = _in_background(post_them_all)
        time.sleep(0.5)  # the inbox fills, and the sender waits
        received = [int(inbox.recv_tensor(timeout=30)[0]) for _ in range(count)]
        thread.join(timeout=30)
        assert "error" not in outcome
        assert not thread.is_alive()
        assert received == list(range(count))

    # ---- declared capabilities, arguments, closing, threads --------------------------------
    def test_serving_is_as_declared(self, transport: Transport) -> None:
        if isinstance(transport, ServingTransport):
            scheme = transport.url.partition("://")[0]
            with serve(f"{scheme}://127.0.0.1:0", open_store("memory://")) as server:
                assert server.url.startswith(f"{scheme}://127.0.0.1:")
        else:
            with pytest.raises(ConfigError, match="serve no peers"):
                serve(f"{transport.url.partition('+')[0]}://", open_store("memory://"))

    def test_bad_arguments_raise_config_errors(self, transport: Transport) -> None:
        with pytest.raises(ConfigError, match="BlockKey"):
            transport.flush(str(KEY), torch.ones(2))  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"torch\.Tensor"):
            transport.send_tensor([1, 2])  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="buffer"):
            transport.put_records([("req-1/manifest", 42)])

    def test_use_after_close_raises_store_closed(self, transport_factory: Callable[[], Transport]) -> None:
        transport = transport_factory()
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

        threads = [_in_background(functools.partial(worker, t)) for t in range(4)]
        for thread, outcome in threads:
            thread.join(timeout=120)
            assert "error" not in outcome, outcome.get("error")
        assert len(transport.names("")) == 40


class TransportFailureTests:
    """What a networked transport does when its peer fails. Subclasses set `scheme` (and `options`)."""

    scheme: ClassVar[str]
    options: ClassVar[dict[str, Any]] = {}

    @pytest.fixture
    def peer(self) -> Iterator[ServedStoreProcess]:
        with ServedStoreProcess(self.scheme) as peer:
            yield peer

    def test_unknown_options_are_refused(self, peer: ServedStoreProcess) -> None:
        with pytest.raises(ConfigError, match="would not be used"):
            open_transport(peer.url, colour="red")

    # ---- failures of the peer --------------------------------------------------------------
    @pytest.mark.slow
    def test_a_peer_killed_mid_transfer_gives_transport_error_at_once(self, peer: ServedStoreProcess) -> None:
        transport = open_transport(peer.url, timeout=20, connect_timeout=3, **self.options)
        transport.flush(KEY, torch.ones(4))  # connected
        peer.freeze()  # the transfer below stalls half way, then the peer dies
        thread, outcome = _in_background(lambda: transport.flush(KEY, torch.empty(4 * BIG, dtype=torch.uint8)))
        time.sleep(1.0)
        assert thread.is_alive(), "the transfer should be stalled mid-way"
        killed_at = time.monotonic()
        peer.signal(signal.SIGKILL)
        thread.join(timeout=20)
        assert isinstance(outcome.get("error"), TransportError), outcome
        assert outcome["at"] - killed_at < 5.0
        with pytest.raises(TransportError, match=r"connect|refused|reach|closed|reset|failed"):
            transport.fetch(KEY)
        transport.close()

    def test_a_hung_peer_gives_transport_error_within_the_timeout_then_the_link_recovers(
            self, peer: ServedStoreProcess) -> None:
        transport = open_transport(peer.url, timeout=1.0, **self.options)
        transport.flush(KEY, torch.ones(4))
        peer.freeze()
        started = time.monotonic()
        with pytest.raises(TransportError):
            transport.fetch(KEY)
        assert time.monotonic() - started < 10.0
        peer.thaw()
        assert transport.fetch(KEY).tolist() == [1.0] * 4  # reconnected
        transport.close()

    def test_the_server_stops_cleanly_on_sigterm(self, peer: ServedStoreProcess) -> None:
        with open_transport(peer.url, **self.options) as transport:
            transport.flush(KEY, torch.ones(4))
        peer.signal(signal.SIGTERM)
        assert peer.process.wait(timeout=20) == 0


class TransportTests(TransportContractTests, TransportFailureTests):
    """The whole conformance suite of a networked transport: the contract and the failure behaviour."""
