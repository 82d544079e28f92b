"""A store server's limits hold whoever connects: silent sockets, slow readers, bad options.

Silent sockets and slow readers are raw sockets (loopback only), the server a `dejavu serve-store` child
process whose threads, descriptors and anonymous memory are read from /proc.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.errors import ConfigError
from dejavu_sdk.stores import MemoryStore
from dejavu_sdk.testing.frames import HELLO, frame
from dejavu_sdk.testing.peers import ServedStoreProcess
from dejavu_sdk.transports import base
from dejavu_sdk.transports.wire import CONTROL, HELLO_BYTES, Op, OutgoingRecord

KEY = dv.BlockKey("req-1", layers=(0, 1), tokens=(0, 4))
TOKEN = "a-token-for-the-tests"
MIB = 1 << 20

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads and memory from /proc")


def _status(pid: int) -> dict[str, int]:
    """Threads, open descriptors and resident bytes of process `pid` that no file backs (its own memory, the
    store's memory map aside)."""
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status if ":" in line)
    memory = sum(int(fields[name].split()[0]) * 1024 for name in ("RssAnon", "RssShmem"))
    return {"threads": int(fields["Threads"]), "rss_anon": memory, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (it never sends a silent socket anything)."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@contextlib.contextmanager
def _sockets(address: tuple[str, int], count: int) -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    try:
        opened.extend(socket.create_connection(address, timeout=5) for _ in range(count))  # kept up to a failure
        yield opened
    finally:
        for sock in opened:
            sock.close()


def _wait_for(condition, what: str, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.01)


def _timed(action, limit: float) -> None:
    started = time.monotonic()
    action()
    assert time.monotonic() - started < limit, f"{action} took {time.monotonic() - started:.2f} s"


@needs_proc
@pytest.mark.slow
def test_a_token_holder_gets_in_while_1000_silent_sockets_are_open(tmp_path) -> None:
    """1000 sockets that never say HELLO: a token holder still lists, writes and reads within 1 s each, and the
    server runs a bounded number of threads, holds at most `--max-unauthenticated` of them and little memory."""
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    with ServedStoreProcess("tcp", quiet=True, options=["--token-file", str(tokens)]) as served:
        pid = served.process.pid
        with dv.open_transport(served.url, token=TOKEN) as warm:  # the first requests start the first workers
            warm.flush(KEY, torch.arange(4))
        before = _status(pid)
        with _sockets(_address(served.url), 1000) as silent:
            time.sleep(0.5)
            with dv.open_transport(served.url, token=TOKEN, connect_timeout=1, timeout=1) as holder:
                _timed(lambda: holder.names("req-1/"), 1.0)
                _timed(lambda: holder.flush(KEY, torch.arange(8)), 1.0)
                _timed(lambda: holder.fetch(KEY), 1.0)
                assert holder.fetch(KEY).tolist() == list(range(8))
            during = _status(pid)
            assert sum(_closed_within(sock, 0.01) for sock in silent[:800]) >= 800 - base.MAX_UNAUTHENTICATED
    assert during["threads"] <= before["threads"] + base.WORKERS, (before, during)
    assert during["fds"] <= before["fds"] + base.MAX_UNAUTHENTICATED + 4, (before, during)
    assert during["rss_anon"] - before["rss_anon"] < 32 * MIB, (before, during)


def test_silent_connections_go_oldest_first_when_full_and_all_of_them_after_hello_timeout() -> None:
    with dv.serve("tcp://127.0.0.1:0", MemoryStore(), token=TOKEN, hello_timeout=0.6,
                  max_unauthenticated=4) as server, _sockets(_address(server.url), 5) as silent:
        assert _closed_within(silent[0], 0.5), "the oldest silent connection was not dropped for the fifth"
        assert not _closed_within(silent[1], 0.05)
        with dv.open_transport(server.url, token=TOKEN, timeout=2) as holder:  # one more: silent[1] goes
            holder.flush(KEY, torch.arange(4))
            assert all(_closed_within(sock, 1.5) for sock in silent[1:]), "silent connections outlived hello_timeout"
            time.sleep(0.8)  # past hello_timeout: an authenticated connection stays
            assert holder.fetch(KEY).tolist() == [0, 1, 2, 3]


def test_a_hello_that_trickles_in_is_answered_once_whole_and_one_that_never_ends_is_dropped() -> None:
    with dv.serve("tcp://127.0.0.1:0", MemoryStore(), hello_timeout=0.6) as server, \
            _sockets(_address(server.url), 2) as (trickling, endless):
        for byte in HELLO:
            trickling.sendall(bytes([byte]))
        trickling.settimeout(2)
        assert trickling.recv(4096).startswith(b"DJVT")
        endless.sendall(HELLO[:-1])
        assert _closed_within(endless, 1.5)
        trickling.sendall(frame(Op.LIST, b""))
        assert trickling.recv(4096).startswith(b"DJVT")


def _slow_reader(address: tuple[str, int]) -> socket.socket:
    """A client that asks for KEY's block and then reads (almost) nothing."""
    sock = socket.create_connection(address, timeout=5)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.sendall(HELLO + frame(Op.GET, str(KEY).encode()))
    sock.setblocking(False)
    return sock


def _stalled_reader(server: dv.transports.Server) -> socket.socket:
    """A reader of KEY's block that reads nothing, once the server holds its copy."""
    reader = _slow_reader(_address(server.url))
    deadline = time.monotonic() + 5
    while server.budget.used < 12 * MIB:
        assert time.monotonic() < deadline, "the reader's copy was not counted"
        time.sleep(0.01)
    return reader


@needs_proc
@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["lmdb", "file"])
def test_100_slow_readers_of_a_16_mib_block_hold_max_inflight_bytes_and_give_it_back(tmp_path, scheme: str) -> None:
    """LMDB (blocks copied out of the map to be sent) and files (read into memory to be sent): 100 readers that
    read slowly hold at most `--max-inflight-bytes` of copies between them, not one each, and the memory goes
    back when they leave."""
    limit = 40 * MIB  # two copies of the block at a time
    block = torch.randint(0, 256, (16 * MIB,), dtype=torch.uint8)
    with ServedStoreProcess("tcp", f"{scheme}://{tmp_path / 'store'}", quiet=True,
                            options=["--max-inflight-bytes", "40MiB"]) as served:
        pid = served.process.pid
        with dv.open_transport(served.url) as writer:
            writer.flush(KEY, block)
            assert torch.equal(writer.fetch(KEY), block)
        time.sleep(0.3)
        before = _status(pid)["rss_anon"]
        readers = [_slow_reader(_address(served.url)) for _ in range(100)]
        peak, received = before, 0
        try:
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                for sock in readers:
                    with contextlib.suppress(BlockingIOError):
                        received += len(sock.recv(16 << 10))
                peak = max(peak, _status(pid)["rss_anon"])
                time.sleep(0.05)
        finally:
            for sock in readers:
                sock.close()
        assert received > 0
        assert peak - before <= limit + 24 * MIB, f"{(peak - before) / MIB:.0f} MiB held for 100 readers"
        deadline = time.monotonic() + 10
        while _status(pid)["rss_anon"] - before > 8 * MIB:
            assert time.monotonic() < deadline, f"{(_status(pid)['rss_anon'] - before) / MIB:.0f} MiB kept"
            time.sleep(0.1)
        with dv.open_transport(served.url, timeout=10) as reader:
            assert torch.equal(reader.fetch(KEY), block)


def test_a_block_larger_than_max_inflight_bytes_is_served_alone_and_intact(tmp_path) -> None:
    block = torch.arange(1 << 18, dtype=torch.int32)  # 1 MiB
    with dv.serve("tcp://127.0.0.1:0", f"lmdb://{tmp_path}", max_inflight_bytes=64 << 10) as server, \
            dv.open_transport(server.url) as client:
        client.flush(KEY, block)
        assert torch.equal(client.fetch(KEY), block)
        _wait_for(lambda: server.budget.used == 0, "the reply's memory given back")


@pytest.mark.parametrize("option", [{"hello_timeout": 0}, {"hello_timeout": None}, {"max_unauthenticated": 0},
                                    {"workers": 0}, {"workers": 2.5}, {"max_inflight_bytes": 0},
                                    {"max_inflight_bytes": True}])
def test_bad_limits_are_refused(option) -> None:
    with pytest.raises(ConfigError):
        dv.serve("tcp://127.0.0.1:0", MemoryStore(), **option)


def test_a_hello_that_lies_about_itself_costs_its_connection_only() -> None:
    """A control frame with a valid checksum but a record header, a huge declared size, or garbage: dropped
    before anything is allocated for it, and the server goes on serving."""
    lying = [frame(Op.HELLO, b"dejavu-sdk", OutgoingRecord.from_block(str(KEY), torch.zeros(2))),
             frame(Op.HELLO, b"x" * (HELLO_BYTES + 1)), frame(Op.LIST, b""), b"GET / HTTP/1.1\r\n\r\n" * 2]
    with dv.serve("tcp://127.0.0.1:0", MemoryStore()) as server:
        for garbage in lying:
            with socket.create_connection(_address(server.url), timeout=5) as sock:
                sock.sendall(garbage[:CONTROL.size + 64])
                assert _closed_within(sock, 2)
        with dv.open_transport(server.url, timeout=2) as client:
            client.flush(KEY, torch.arange(4))
            assert client.fetch(KEY).tolist() == [0, 1, 2, 3]


def test_a_request_sent_with_its_hello_is_served() -> None:
    put = frame(Op.PUT, str(KEY).encode(), OutgoingRecord.from_block(str(KEY), torch.arange(1 << 18)))
    with dv.serve("tcp://127.0.0.1:0", MemoryStore()) as server, \
            socket.create_connection(_address(server.url), timeout=5) as sock:
        sock.sendall(HELLO + put)  # 2 MiB behind the HELLO, without waiting for its answer
        with dv.open_transport(server.url, timeout=5) as client:
            deadline = time.monotonic() + 5
            while client.names("") != [str(KEY)]:
                assert time.monotonic() < deadline, "the request behind the HELLO was not stored"
                time.sleep(0.02)
            assert torch.equal(client.fetch(KEY), torch.arange(1 << 18))


@pytest.mark.slow
@pytest.mark.parametrize("store", ["lmdb", "file"])
def test_writes_and_reads_wait_for_room_without_holding_workers(tmp_path, store: str) -> None:
    """One reader that does not read holds the whole budget (LMDB copies and files' reads both count); two
    writes and a read wait for room, a listing is answered meanwhile by the only two workers, and once the
    reader leaves everyone is served at once; a write that finds no room within the timeout gets ServerBusy."""
    block = torch.randint(0, 256, (12 * MIB,), dtype=torch.uint8)  # more than the kernel's socket buffers take
    url = f"lmdb://{tmp_path}" if store == "lmdb" else f"file://{tmp_path}"
    with dv.serve("tcp://127.0.0.1:0", url, max_inflight_bytes=13 * MIB, workers=2, timeout=3) as server:
        with dv.open_transport(server.url) as writer:
            writer.flush(KEY, block)
        stalled = _stalled_reader(server)
        results: dict[str, object] = {}

        def run(name: str, action) -> None:
            with dv.open_transport(server.url, timeout=10) as client:
                try:
                    results[name] = action(client)
                except dv.DejaVuError as error:
                    results[name] = error

        waiting = [threading.Thread(target=run, args=(f"put{index}", functools.partial(
            lambda client, key: client.flush(key, block) or "stored",
            key=dv.BlockKey(f"w{index}", layers=(0, 1), tokens=(0, 4))))) for index in range(2)]
        waiting.append(threading.Thread(target=run, args=("get", lambda client: torch.equal(client.fetch(KEY), block))))
        for thread in waiting:
            thread.start()
        time.sleep(0.3)
        _timed(lambda: run("list", lambda client: client.names("")), 1.0)
        stalled.close()
        started = time.monotonic()
        for thread in waiting:
            thread.join(10)
        assert time.monotonic() - started < 2
        assert results["put0"] == results["put1"] == "stored"
        assert results["get"] is True
        _wait_for(lambda: server.budget.used == 0, "every reply's memory given back")
        stalled = _stalled_reader(server)  # dropped at its timeout; then the next reader holds the room as long
        time.sleep(0.5)  # so that the next reader still waits when the first is dropped
        with _slow_reader(_address(server.url)):
            time.sleep(0.2)
            run("busy", lambda client: client.flush(KEY, block))
        assert isinstance(results["busy"], dv.ServerBusy), results["busy"]
        stalled.close()
