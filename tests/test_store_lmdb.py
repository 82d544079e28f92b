from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import attrs
import lmdb
import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.stores import LmdbStore
from dejavu_sdk.testing import StoreTests, random_tensor, same_bits
from dejavu_sdk.testing.frames import frame
from dejavu_sdk.transports.wire import CONTROL, Op


class TestLmdbStore(StoreTests):
    @pytest.fixture
    def store_factory(self, tmp_path):
        return lambda: dv.open_store(f"lmdb://{tmp_path / uuid.uuid4().hex}")

    @pytest.fixture
    def reopen(self):
        return lambda store: dv.open_store(store.url)


class TestLmdbStoreWithoutSync(StoreTests):
    @pytest.fixture
    def store_factory(self, tmp_path):
        return lambda: dv.open_store(f"lmdb://{tmp_path / uuid.uuid4().hex}", sync=False, map_size=1 << 16)

    @pytest.fixture
    def reopen(self):
        return lambda store: dv.open_store(store.url, sync=False)


def _key(step: int) -> dv.BlockKey:
    return dv.BlockKey("req-1", layers=(0, 4), tokens=(step, step + 1))


def _block(step: int) -> torch.Tensor:
    return random_tensor((4, 2, 1, 8, 1, 64), torch.bfloat16, seed=step)


def test_the_map_grows_when_full(tmp_path) -> None:
    store = LmdbStore(tmp_path, map_size=1 << 16)
    blocks = {step: random_tensor((256, 1024), torch.float32, seed=step) for step in range(8)}  # 1 MiB each
    for step, block in blocks.items():
        store.flush(_key(step), block)
    assert store.records.map_size >= 8 << 20
    for step, block in blocks.items():
        assert same_bits(store.fetch(_key(step)), block)


def test_sync_defaults_on_and_is_an_option(tmp_path) -> None:
    assert LmdbStore(tmp_path / "a").records.sync is True
    assert dv.open_store(f"lmdb://{tmp_path / 'b'}", sync=False).records.sync is False


def test_a_path_that_is_a_file_raises_store_error(tmp_path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(dv.StoreError, match="cannot open LMDB"):
        LmdbStore(tmp_path / "file")


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


_HELPERS = """
    import sys, torch, dejavu_sdk as dv
    from dejavu_sdk.testing import random_tensor
    def key(step): return dv.BlockKey("req-1", layers=(0, 4), tokens=(step, step + 1))
    def block(step): return random_tensor((4, 2, 1, 8, 1, 64), torch.bfloat16, seed=step)
"""


@pytest.mark.slow  # a Python process of its own
def test_other_processes_read_committed_blocks(tmp_path) -> None:
    store = LmdbStore(tmp_path, map_size=1 << 16)
    for step in range(20):
        store.flush(_key(step), _block(step))
    reader = _HELPERS + f"""
    from dejavu_sdk.testing import same_bits
    store = dv.open_store("lmdb://{tmp_path}")
    assert len(store.keys("req-1")) == 20
    assert all(same_bits(store.fetch(key(s)), block(s)) for s in range(20))
    print("ok")
    """
    result = subprocess.run(_python(reader), capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sync", [True, False])
def test_a_writer_killed_with_sigkill_loses_no_committed_block(tmp_path, sync: bool) -> None:
    writer = _HELPERS + f"""
    store = dv.open_store("lmdb://{tmp_path}", sync={sync}, map_size=1 << 16)
    for step in range(1_000_000):
        store.flush(key(step), block(step))
        print(step, flush=True)
    """
    process = subprocess.Popen(_python(writer), stdout=subprocess.PIPE, text=True)
    committed = -1
    deadline = time.monotonic() + 120
    while committed < 150 and time.monotonic() < deadline:
        line = process.stdout.readline()
        assert line, "the writer exited early"
        committed = int(line)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert committed >= 150

    store = LmdbStore(tmp_path)
    steps = [key.tokens[0] for key in store.keys("req-1")]
    assert set(range(committed + 1)) <= set(steps)
    for step in steps:  # every stored block is whole, including any committed after the last print
        assert same_bits(store.fetch(_key(step)), _block(step))
    store.flush(_key(10**6), _block(0))
    assert same_bits(store.fetch(_key(10**6)), _block(0))


def test_one_directory_can_be_opened_twice_in_a_process(tmp_path) -> None:
    first, second = LmdbStore(tmp_path), dv.open_store(f"lmdb://{tmp_path}")
    first.flush(_key(0), _block(0))
    assert same_bits(second.fetch(_key(0)), _block(0))
    first.close()
    assert same_bits(second.fetch(_key(0)), _block(0))  # still open for the other handle
    second.close()
    with pytest.raises(dv.ConfigError, match="sync=True"), LmdbStore(tmp_path):
        LmdbStore(tmp_path, sync=False)
    third = LmdbStore(tmp_path, sync=False)  # every handle closed: any setting again
    assert same_bits(third.fetch(_key(0)), _block(0))


def test_a_block_and_its_progress_record_commit_in_one_transaction(tmp_path) -> None:
    store = LmdbStore(tmp_path)
    before = store.records._env.info()["last_txnid"]
    key = attrs.evolve(_key(0), run="abc")
    store.flush_with_progress(key, _block(0), dv.ProgressKey(key.stream_id, "abc", 0, 0), b'{"step": 0}')
    assert store.records._env.info()["last_txnid"] == before + 1
    store.flush(_key(1), _block(1))
    store.write_manifest("req-1", b'{"step": 1}')
    assert store.records._env.info()["last_txnid"] == before + 3


@pytest.mark.parametrize(("prompt_streaming", "prompt_commits"), [("layerwise", 4), ("after", 1)])
def test_the_engine_commits_each_block_with_its_manifest(tmp_path, prompt_streaming: str, prompt_commits: int) -> None:
    from tiny_models import prompt, tiny_llama

    model = tiny_llama(layers=4)
    ids, mask = prompt()
    with dv.DejaVuEngine(model, store=f"lmdb://{tmp_path}/kv", keep_finished=True,
                         prompt_streaming=prompt_streaming) as engine:
        before = engine.store.records._env.info()["last_txnid"]
        engine.generate(ids, attention_mask=mask, max_new_tokens=12, stream_id="one-commit")
        commits = engine.store.records._env.info()["last_txnid"] - before
        blocks = len(engine.store.keys("one-commit"))
    assert blocks == 4 + 11  # the prompt's 4 layer blocks, then one block per decode step
    # Each block commits with its progress record, the prompt's layer by layer or all at once; blocks that
    # wait for the streamer go together (group commit). Plus the first manifest, the finished one, and the
    # removal of the progress records it holds.
    assert 1 + 3 < commits <= prompt_commits + 11 + 3


@pytest.mark.parametrize("max_readers", [0, -1, 1.5, "8", True, 1 << 40])
def test_max_readers_must_be_a_positive_int(tmp_path, max_readers) -> None:
    with pytest.raises(dv.ConfigError, match="max_readers"):
        LmdbStore(tmp_path, max_readers=max_readers)
    with pytest.raises(dv.ConfigError, match="max_readers"):
        dv.open_store(f"lmdb://{tmp_path}", max_readers=max_readers)


@pytest.mark.parametrize("map_size", [0, 1 << 10, 1.5 * (1 << 30), "1GiB", True])
def test_map_size_must_be_an_int_of_at_least_64_kib(tmp_path, map_size) -> None:
    with pytest.raises(dv.ConfigError, match="map_size"):
        LmdbStore(tmp_path, map_size=map_size)


def test_running_out_of_reader_slots_raises_store_error_until_readers_are_released(tmp_path) -> None:
    store = LmdbStore(tmp_path, max_readers=2)
    store.flush(_key(0), _block(0))

    def hold_readers(held: contextlib.ExitStack) -> None:
        for _ in range(10):  # each open record holds a read transaction, and with it a reader slot
            held.enter_context(store.records.get_record(str(_key(0))))

    with contextlib.ExitStack() as held:
        with pytest.raises(dv.StoreError, match="max_readers") as raised:
            hold_readers(held)
        assert not isinstance(raised.value, lmdb.Error)
        assert isinstance(raised.value.__cause__, lmdb.ReadersFullError)
        assert str(tmp_path) in str(raised.value)
        assert "too many concurrent readers" in str(raised.value)
        with pytest.raises(dv.StoreError, match="max_readers"):
            store.keys("req-1")
        store.flush(_key(1), _block(1))  # a writer needs no reader slot
    assert same_bits(store.fetch(_key(0)), _block(0))  # the readers are gone: reading works again
    assert store.keys("req-1") == [_key(0), _key(1)]


@pytest.mark.slow  # a Python process of its own
def test_a_truncated_data_file_is_refused_at_open_instead_of_crashing_on_read(tmp_path) -> None:
    with LmdbStore(tmp_path, sync=False) as store:
        for step in range(16):
            store.flush(_key(step), random_tensor((64, 1024), torch.float32, seed=step))  # 256 KiB each
    data = tmp_path / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    reader = _HELPERS + f"""
    try:
        store = dv.open_store("lmdb://{tmp_path}")
        for step in range(16):
            store.fetch(key(step))
    except dv.StoreError as error:
        print("StoreError:", error)
    else:
        print("read everything")
    """
    result = subprocess.run(_python(reader), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"the reader died with {result.returncode}: {result.stderr}"
    assert result.stdout.startswith("StoreError:"), result.stdout + result.stderr
    assert "damaged: data.mdb is missing page" in result.stdout


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    received = b""
    while len(received) < size:
        part = sock.recv(size - len(received))
        assert part, "the server closed the connection"
        received += part
    return received


def _stalled_get(url: str, name: str) -> socket.socket:
    """A client that asks for a record and reads none of the reply, on a socket with a tiny receive buffer."""
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: it sets the window
    sock.settimeout(10)
    sock.connect((host, int(port)))
    sock.sendall(frame(Op.HELLO, f"dejavu-sdk {dv.__version__}".encode()))
    reply = CONTROL.unpack(_recv_exactly(sock, CONTROL.size))
    _recv_exactly(sock, reply[4] + reply[5])  # the HELLO reply's meta and header, if any
    assert reply[3] == 0, "the server refused the HELLO"
    sock.sendall(frame(Op.GET, name.encode()))
    sock.recv(1, socket.MSG_PEEK)  # the reply has begun: the server is sending, and stuck on this client
    return sock


def _active_readers(store: LmdbStore) -> list[str]:
    rows = store.records._env.readers().splitlines()[1:]
    return [row for row in rows if row.split() and row.split()[0].isdigit()]


def test_a_client_that_reads_slowly_holds_no_lmdb_reader_and_stalls_nobody(tmp_path) -> None:
    store = LmdbStore(tmp_path, sync=False, map_size=1 << 16)
    big = random_tensor((4096, 1024), torch.float32, seed=1)  # 16 MiB: far more than the socket buffers hold
    store.flush(_key(0), big)
    with dv.serve("tcp://127.0.0.1:0", store) as server, dv.open_store(server.url, timeout=10) as other:
        slow, writer = _stalled_get(server.url, str(_key(0))), None
        try:
            assert _active_readers(store) == []  # the server sends a copy, outside any read transaction

            info, psize = store.records._env.info(), store.records._env.stat()["psize"]
            free = info["map_size"] - (info["last_pgno"] + 1) * psize
            grows = torch.zeros((free + (1 << 20)) // 4, dtype=torch.float32)  # more than the map has left
            done = threading.Event()
            errors: list[BaseException] = []

            def flush() -> None:
                try:
                    other.flush(_key(1), grows)
                except BaseException as error:  # reported by the test below
                    errors.append(error)
                done.set()

            writer = threading.Thread(target=flush, daemon=True)
            writer.start()
            assert done.wait(1.0), "another client's flush (which grows the map) waited on the slow client"
            assert errors == []
            assert store.records.map_size > info["map_size"]
        finally:
            slow.close()
            if writer is not None:
                writer.join(timeout=120)
        assert same_bits(other.fetch(_key(0)), big)
        assert same_bits(store.fetch(_key(1)), grows)
