from __future__ import annotations

import contextlib
import logging
import os
import socket
import time

import numpy as np
import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk import open_transport, serve
from dejavu_sdk.stores import MemoryStore
from dejavu_sdk.testing.frames import HELLO, RecordingChannel
from dejavu_sdk.testing.transports import KEY, TransportTests
from dejavu_sdk.transports.wire import CONTROL, MAGIC, Op, OutgoingRecord, send_message


class TestTcpTransport(TransportTests):
    scheme = "tcp"


@pytest.fixture
def server():
    with serve("tcp://127.0.0.1:0", MemoryStore()) as server:
        yield server


def _raw_socket(server) -> socket.socket:
    host, port = server.url.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _control(op: int, meta_length: int, payload_length: int, version: int = 1) -> bytes:
    """A control frame with a checksum that does not match (enough to test what is refused first)."""
    return CONTROL.pack(MAGIC, version, op, 0, meta_length, 0, payload_length, 0)


def _wait_for_log(caplog, text: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in record.message for record in caplog.records):
        assert time.monotonic() < deadline, f"no log message with {text!r} within {timeout} s"
        time.sleep(0.01)


def _assert_still_serving(server) -> None:
    with open_transport(server.url, timeout=10) as good:
        good.flush(KEY, torch.arange(10))
        assert good.fetch(KEY).tolist() == list(range(10))


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\nHost: example\r\nAccept: */*\r\n\r\n",
    b"\x00" * 64,
    _control(Op.PUT, 0, 1 << 60),             # an oversized record
    _control(Op.LIST, 1 << 31, 0),            # oversized metadata
    _control(Op.HELLO, 0, 0, version=99),     # a future protocol version
    _control(Op.HELLO, 0, 0),                 # a bad checksum
])
def test_garbage_and_oversized_frames_are_refused_and_logged(server, caplog, garbage: bytes) -> None:
    caplog.set_level(logging.WARNING, logger="dejavu_sdk.transports")
    reply = b""
    with _raw_socket(server) as sock, contextlib.suppress(ConnectionResetError):
        sock.sendall(garbage)
        # The server may drop us before all of the garbage is read; the kernel then resets the connection.
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        while chunk := sock.recv(4096):  # the server answers (or not) and closes
            reply += chunk
    assert not reply or reply.startswith(MAGIC)
    assert any("dropping" in record.message for record in caplog.records)
    _assert_still_serving(server)


def test_a_client_that_vanishes_mid_block_leaves_no_half_block(server, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="dejavu_sdk.transports")
    with open_transport(server.url) as good:
        good.flush(dv.BlockKey("other", layers=(0, 1), tokens=(0, 1)), torch.ones(1))
    recording = RecordingChannel()
    send_message(recording, Op.PUT, meta=str(KEY).encode(),
                 record=OutgoingRecord.from_block(str(KEY), torch.ones(1 << 20)))
    with _raw_socket(server) as sock:
        sock.sendall(HELLO)
        assert sock.recv(4096)  # greeted
        sock.sendall(bytes(recording.sent[: len(recording.sent) // 3]))  # then vanish
    _assert_still_serving(server)
    assert [k.stream_id for k in server.store.keys()] == ["other", KEY.stream_id]  # noqa: SIM118 - Store.keys()
    assert server.store.fetch(KEY).tolist() == list(range(10))  # written later, whole, by the good client
    _wait_for_log(caplog, "mid-request")  # the server's connection thread logs it on its own time


@pytest.mark.parametrize(("meta", "why"), [
    (b"5 req-1/L0-1.T0-1\n5 req-1/L0-1.T1-2", "do not add up"),
    (b"ten req-1/L0-1.T0-1", "one 'size name' line"),
    (b"8 ../outside", "not a block key"),
])
def test_records_that_misstate_themselves_are_refused(server, meta: bytes, why: str) -> None:
    with open_transport(server.url) as client:
        with pytest.raises(dv.TransportError, match=why):  # a bad request, answered as such
            client._exchange(Op.PUT_RECORDS, meta, OutgoingRecord.opaque(np.zeros(8, np.uint8)))
        assert server.store.keys() == []  # nothing half-stored
        client.flush(KEY, torch.ones(2))  # the same connection keeps working
    _assert_still_serving(server)


def test_connecting_to_nobody_fails_fast_and_clearly() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    transport = open_transport(f"tcp://127.0.0.1:{port}", connect_timeout=2)
    with pytest.raises(dv.TransportError, match="cannot connect"):
        transport.fetch(KEY)


@pytest.mark.parametrize("option", [{"timeout": 0}, {"timeout": -1}, {"connect_timeout": "soon"}])
def test_bad_timeouts_are_refused(option) -> None:
    with pytest.raises(dv.ConfigError, match="seconds"):
        open_transport("tcp://127.0.0.1:9", **option)


def test_transport_names_and_objects() -> None:
    with pytest.raises(dv.ConfigError, match="unknown transport 'carrier-pigeon'"):
        open_transport("carrier-pigeon://x:1")
    transport = open_transport("tcp://127.0.0.1:9")
    assert open_transport(transport) is transport
    with pytest.raises(dv.ConfigError, match="only when the transport is given as a URL"):
        open_transport(transport, timeout=3)


def test_several_buffers_go_out_whole_even_when_the_kernel_takes_a_few_bytes_at_a_time() -> None:
    from dejavu_sdk.transports.sockets import _send_all

    class Trickle:
        def __init__(self) -> None:
            self.received = b""

        def sendmsg(self, views: list[memoryview]) -> int:
            data = b"".join(bytes(view) for view in views)[:7]
            self.received += data
            return len(data)

    parts = [b"control-", b"", np.arange(40, dtype=np.uint8), b"-trailer"]
    sock = Trickle()
    _send_all(sock, [memoryview(part).cast("B") for part in parts])
    assert sock.received == b"".join(bytes(part) for part in parts)


class _CountingSocket:
    """A connected socket that counts the receives that reach it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.receives = sock, 0

    def recv_into(self, view: memoryview) -> int:
        self.receives += 1
        return self.sock.recv_into(view)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def test_small_messages_arrive_in_one_receive_and_back_to_back_messages_stay_in_step() -> None:
    from dejavu_sdk.transports.sockets import READ_AHEAD_BYTES, SocketChannel
    from dejavu_sdk.transports.wire import Limits, recv_message, recv_payload

    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()) as sending:
        accepted, _ = listener.accept()
        counting = _CountingSocket(accepted)
        receiver = SocketChannel(counting, "peer", timeout=10)  # type: ignore[arg-type]
        sender = SocketChannel(sending, "peer", timeout=10)
        tensors = [torch.arange(n, dtype=torch.int32) for n in (1024, 3, READ_AHEAD_BYTES // 8)]
        for tensor in tensors:  # all in the kernel's buffer before the first receive
            send_message(sender, Op.POST, record=OutgoingRecord.from_block("tensor", tensor))
        time.sleep(0.2)
        for tensor in tensors:
            before = counting.receives
            message = recv_message(receiver, Limits(), idle=True)
            payload = np.empty(message.payload_length, np.uint8)
            intact, _ = recv_payload(receiver, message, payload)
            assert intact
            assert torch.equal(torch.from_numpy(payload).view(torch.int32), tensor)
            assert counting.receives - before <= 1  # control, head, payload and trailer: one system call at most
        assert counting.receives < len(tensors)  # later messages came from what was read ahead

        big = torch.arange(READ_AHEAD_BYTES, dtype=torch.int32)  # 4x the read-ahead: lands in place
        send_message(sender, Op.POST, record=OutgoingRecord.from_block("tensor", big))
        message = recv_message(receiver, Limits(), idle=True)
        payload = np.empty(message.payload_length, np.uint8)
        assert recv_payload(receiver, message, payload)[0]
        assert torch.equal(torch.from_numpy(payload).view(torch.int32), big)
        receiver.close()


def test_a_request_whose_first_send_hits_a_closed_connection_is_sent_again_on_a_new_one(server) -> None:
    from dejavu_sdk.transports.sockets import SocketChannel
    from dejavu_sdk.transports.wire import PeerClosed

    with open_transport(server.url) as link:
        link.flush(KEY, torch.arange(4))
        stale = link._channel
        failures: list[int] = []

        def closed_while_idle(self, *buffers) -> None:  # the server's close crossed the request
            failures.append(1)
            raise PeerClosed("the server closed the connection: connection reset by peer")

        stale.send = closed_while_idle.__get__(stale, SocketChannel)
        stale.closed_by_peer = lambda: False  # not noticed before sending
        assert link.fetch(KEY).tolist() == [0, 1, 2, 3]  # no error: sent again on a new connection
        assert failures == [1]
        assert link._channel is not stale


def test_a_failure_after_the_first_send_is_not_resent(server) -> None:
    from dejavu_sdk.errors import TransportError
    from dejavu_sdk.transports.sockets import SocketChannel

    with open_transport(server.url) as link:
        link.flush(KEY, torch.arange(4))
        stale = link._channel
        calls: list[int] = []
        original = SocketChannel.send

        def fails_mid_message(self, *buffers) -> None:
            calls.append(1)
            if len(calls) > 1:
                raise TransportError("the peer died mid-message")
            original(self, *buffers)

        stale.send = fails_mid_message.__get__(stale, SocketChannel)
        stale.closed_by_peer = lambda: False
        with pytest.raises(TransportError, match="mid-message"):
            link.flush(KEY, torch.zeros(4 << 20, dtype=torch.uint8))  # large: sent in several parts
        assert len(calls) == 2  # the control frame went out, the next part failed, and nothing was resent


def test_a_refused_post_fails_the_next_call_saying_what_may_be_lost() -> None:
    """A server that takes no tensors closes the link on a posted one: the sender hears of it at its next call."""
    with dv.serve("tcp://127.0.0.1:0", dv.open_store("memory://"), accept_tensors=False) as server, \
            dv.open_transport(server.url) as transport:
        transport.post_tensor(torch.ones(4))  # returns at once: nobody answers a post that was taken
        time.sleep(0.5)  # the server refuses it and closes the connection
        with pytest.raises(dv.TransportError, match=r"1 tensor\(s\) posted since its last answer may not have"):
            transport.post_tensor(torch.ones(4))
        transport.flush(dv.BlockKey("s", layers=(0, 1), tokens=(0, 1)), torch.ones(2, 2))  # a new link works


@pytest.mark.skipif(not hasattr(os, "dup2"), reason="places a socket at a chosen descriptor")
def test_a_connection_on_a_descriptor_past_1024_knows_whether_its_peer_closed() -> None:
    """A server with a thousand sockets holds descriptors past select's FD_SETSIZE: an open connection there
    must not look closed (a GET waiting for room would be dropped)."""
    from dejavu_sdk.transports.sockets import SocketChannel

    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours = socket.create_connection(listener.getsockname(), timeout=5)
        theirs, _ = listener.accept()
    high = os.dup2(ours.fileno(), 1500)
    ours.close()
    channel = SocketChannel(socket.socket(fileno=high), "peer", timeout=5)
    try:
        assert not channel.closed_by_peer()
        theirs.close()
        assert channel.closed_by_peer()
    finally:
        channel.close()


def test_a_server_that_stops_while_peers_are_connected_warns_of_nothing(caplog) -> None:
    """Stopping closes the connections its workers read from: that ends no request of a peer's, and a server
    whose connections sat idle past `idle_timeout` closed them in the normal course: no warning either."""
    caplog.set_level(logging.INFO, logger="dejavu_sdk.transports")
    with dv.serve("tcp://127.0.0.1:0", "memory://", idle_timeout=0.3) as server:
        links = [open_transport(server.url, timeout=10) for _ in range(3)]
        for number, link in enumerate(links):
            link.flush(dv.BlockKey(f"req-{number}", layers=(0, 1), tokens=(0, 1)), torch.ones(1))
        time.sleep(0.6)  # past the idle timeout: the server closes the idle ones
        links[0].flush(dv.BlockKey("again", layers=(0, 1), tokens=(0, 1)), torch.ones(1))  # reopened
    for link in links:
        link.close()
    noisy = [record.getMessage() for record in caplog.records if record.levelno >= logging.INFO
             and ("mid-request" in record.getMessage() or "sent no request" in record.getMessage())]
    assert noisy == []
