"""A short or truncated LMDB data file: refused with StoreError only where LMDB would read a missing page,
at open and under a live store (a server keeps serving), and never killed by SIGBUS."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.testing import random_tensor, same_bits

TESTS = Path(__file__).parent


def _key(stream_id: str, step: int) -> dv.BlockKey:
    return dv.BlockKey(stream_id, layers=(0, 1), tokens=(step, step + 1))


def _block(step: int, rows: int = 4) -> torch.Tensor:
    return random_tensor((rows, 1024), torch.float32, seed=step)


def write_a_run(path: str, seed: int, run: str) -> None:
    """What one generation does to its stream `s` in an LMDB store: replace any earlier run, write the
    manifest, prompt blocks and decode steps with their progress records, the finished manifest, and remove
    the progress records (one transaction of many small deletes: LMDB frees pages it allocated in it)."""
    chance = random.Random(seed)
    store = dv.open_store(f"lmdb://{path}", sync=False)
    try:
        store.read_manifest("s")
        store.delete("s")
    except dv.BlockNotFound:
        pass
    store.write_manifest("s", b"m" * chance.randint(50, 400))
    prompt = chance.randint(8, 40)
    for layer in range(4):
        key = dv.BlockKey("s", layers=(layer, layer + 1), tokens=(0, prompt), run=run)
        store.flush_with_progress(key, _written(key), dv.ProgressKey("s", run, 0, layer),
                                  b"p" * chance.randint(20, 900))
    for step in range(prompt, prompt + chance.randint(20, 120)):
        key = dv.BlockKey("s", layers=(0, 4), tokens=(step, step + 1), run=run)
        store.flush_with_progress(key, _written(key), dv.ProgressKey("s", run, 0, step),
                                  b"p" * chance.randint(20, 900))
    store.write_manifest("s", b"m" * chance.randint(50, 900))
    store.remove_progress("s", run)
    store.close()


def _written(key: dv.BlockKey) -> torch.Tensor:
    """The block `write_a_run` stores under `key`: a prompt layer's, or a decode step's over four layers."""
    layers, tokens = key.layers[1] - key.layers[0], key.tokens[1] - key.tokens[0]
    return random_tensor((layers, 2, 2, tokens, 16), torch.float32, seed=key.layers[0] + key.tokens[0])


def _shorter_than_its_pages(path: Path) -> bool:
    """Whether data.mdb is shorter than LMDB's last page number says (pages it counts but never wrote)."""
    env = lmdb.open(str(path), max_dbs=0, readonly=True, lock=False)
    try:
        return (path / "data.mdb").stat().st_size < (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    finally:
        env.close()


def _read_everything(url: str) -> int:
    """Open the store at `url`, read its manifest and check every block's bits; how many blocks."""
    with dv.open_store(url) as store:
        store.read_manifest("s")
        keys = store.keys("s")
        assert all(same_bits(store.fetch(key), _written(key)) for key in keys)
        return len(keys)


def test_pages_lmdb_counts_but_never_wrote_leave_a_store_that_opens(tmp_path) -> None:
    for run in range(6):
        path = tmp_path / str(run)
        write_a_run(str(path), 2 * run, "a")
        write_a_run(str(path), 2 * run + 1, "b")
        if _shorter_than_its_pages(path):
            assert _read_everything(f"lmdb://{path}") > 0
            return
    pytest.fail("no run left data.mdb shorter than its last page: this test no longer tests what it should")


@pytest.mark.slow  # a Python process of its own, which forks the writers
def test_two_processes_writing_one_stream_in_turn_leave_stores_that_open(tmp_path) -> None:
    writers = f"""
        import os, sys
        sys.path.insert(0, {str(TESTS)!r})
        from test_store_lmdb_damage import write_a_run
        for run in range(20):
            for seed, name in ((2 * run, "a"), (2 * run + 1, "b")):  # one process, then the other
                child = os.fork()
                if child == 0:
                    try:
                        write_a_run(os.path.join({str(tmp_path)!r}, str(run)), seed, name)
                    finally:
                        os._exit(0)
                assert os.waitpid(child, 0)[1] == 0
        print("ok")
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(writers)], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip() == "ok", result.stderr
    short = [run for run in range(20) if _shorter_than_its_pages(tmp_path / str(run))]
    assert short, "no run left data.mdb shorter than its last page: this test no longer tests what it should"
    for run in range(20):
        assert _read_everything(f"lmdb://{tmp_path / str(run)}") > 0


def _kept_then_gone(path: Path) -> int:
    """A store holding stream "kept", and after it the pages of a deleted record: free pages at the file's
    end that no tree reaches. Returns where they begin, the size to cut the file to."""
    with dv.open_store(f"lmdb://{path}", sync=False) as store:
        env, data = store.records._env, path / "data.mdb"
        for step in range(20):
            store.flush(_key("kept", step), _block(step))
        for size in range(3):  # rewrites: pages that the delete below can reuse
            store.write_manifest("kept", b"m" * 100 * size)
        kept_end = data.stat().st_size
        assert kept_end == (env.info()["last_pgno"] + 1) * env.stat()["psize"]  # LMDB wrote every page so far
        store.flush(_key("gone", 0), _block(0, rows=64))  # 65 pages, all appended
        gone_end = data.stat().st_size
        store.delete("gone")
        assert data.stat().st_size == gone_end  # the delete wrote no page after them
    return kept_end


def _assert_kept_reads(store: dv.Store) -> None:
    assert store.keys("kept") == [_key("kept", step) for step in range(20)]
    for step in range(20):
        assert same_bits(store.fetch(_key("kept", step)), _block(step))


def test_a_file_cut_only_in_its_free_tail_pages_opens(tmp_path) -> None:
    kept_end = _kept_then_gone(tmp_path)
    os.truncate(tmp_path / "data.mdb", kept_end)
    with dv.open_store(f"lmdb://{tmp_path}") as store:
        _assert_kept_reads(store)
        store.flush(_key("kept", 99), _block(99))
        assert same_bits(store.fetch(_key("kept", 99)), _block(99))


def test_a_live_store_whose_file_loses_only_free_tail_pages_keeps_working(tmp_path) -> None:
    kept_end = _kept_then_gone(tmp_path)
    with dv.open_store(f"lmdb://{tmp_path}") as store:
        os.truncate(tmp_path / "data.mdb", kept_end)
        _assert_kept_reads(store)
        store.flush(_key("kept", 99), _block(99))
        assert same_bits(store.fetch(_key("kept", 99)), _block(99))


def test_a_file_missing_pages_that_lmdb_reads_is_refused_at_open(tmp_path) -> None:
    kept_end = _kept_then_gone(tmp_path)
    os.truncate(tmp_path / "data.mdb", kept_end // 2)  # "kept"'s last blocks are in the half cut off
    with pytest.raises(dv.StoreError, match=r"damaged: data.mdb is missing pages? \d+.*truncated.*restore it"):
        dv.open_store(f"lmdb://{tmp_path}")


def test_a_garbage_page_in_a_short_file_is_refused_at_open(tmp_path) -> None:
    kept_end = _kept_then_gone(tmp_path)
    with open(tmp_path / "data.mdb", "r+b") as data:
        data.truncate(kept_end)  # short: the page walk runs
        data.seek(2 * 4096)  # the first pages after the meta pages: "kept"'s first records
        data.write(bytes(kept_end // 2))
    with pytest.raises(dv.StoreError, match=r"damaged: data.mdb has garbage in page \d+"):
        dv.open_store(f"lmdb://{tmp_path}")


_TWO_STORES = """
    import sys, dejavu_sdk as dv
    servers = [dv.serve("tcp://127.0.0.1:0", "lmdb://" + path) for path in sys.argv[1:]]
    print(" ".join(server.url for server in servers), flush=True)
    sys.stdin.read()  # serve until the test closes stdin
"""


@pytest.mark.slow  # a server process of its own
def test_a_data_file_truncated_under_a_server_gives_store_errors_and_the_server_goes_on(tmp_path) -> None:
    damaged, healthy = tmp_path / "damaged", tmp_path / "healthy"
    server = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_TWO_STORES), str(damaged), str(healthy)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        assert server.stdin is not None
        damaged_url, healthy_url = server.stdout.readline().split()
        with dv.open_store(damaged_url, timeout=10) as remote, dv.open_store(healthy_url, timeout=10) as other:
            for step in range(8):
                remote.flush(_key("s", step), _block(step, rows=64))
                other.flush(_key("s", step), _block(step, rows=64))
            data = damaged / "data.mdb"
            whole = data.read_bytes()
            os.truncate(data, len(whole) // 2)  # under the open store: its reads would raise SIGBUS

            for request in (lambda: remote.keys("s"), lambda: remote.fetch(_key("s", 7)),
                            lambda: remote.flush(_key("s", 9), _block(9))):
                with pytest.raises((dv.StoreError, dv.CorruptBlock), match="missing page"):
                    request()
                assert server.poll() is None, f"the server died with exit code {server.returncode}"
            assert same_bits(other.fetch(_key("s", 3)), _block(3, rows=64))  # the other store is served
            other.flush(_key("s", 9), _block(9))
            assert same_bits(other.fetch(_key("s", 9)), _block(9))

            with open(data, "r+b") as restore:  # the store is whole again
                restore.seek(len(whole) // 2)
                restore.write(whole[len(whole) // 2:])
            assert remote.keys("s") == [_key("s", step) for step in range(8)]
            assert same_bits(remote.fetch(_key("s", 7)), _block(7, rows=64))
        server.stdin.close()
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)
