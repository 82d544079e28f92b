from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.stores import LmdbStore
from dejavu_sdk.testing import StoreTests, random_tensor, same_bits


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


def test_a_block_and_its_manifest_commit_in_one_transaction(tmp_path) -> None:
    store = LmdbStore(tmp_path)
    before = store.records._env.info()["last_txnid"]
    store.flush_with_manifest(_key(0), _block(0), b'{"step": 0}')
    assert store.records._env.info()["last_txnid"] == before + 1
    store.flush(_key(1), _block(1))
    store.write_manifest("req-1", b'{"step": 1}')
    assert store.records._env.info()["last_txnid"] == before + 3


def test_the_engine_commits_each_block_with_its_manifest(tmp_path) -> None:
    from tiny_models import prompt, tiny_llama

    model = tiny_llama(layers=4)
    ids, mask = prompt()
    with dv.DejaVuEngine(model, store=f"lmdb://{tmp_path}/kv", keep_finished=True) as engine:
        before = engine.store.records._env.info()["last_txnid"]
        engine.generate(ids, attention_mask=mask, max_new_tokens=12, stream_id="one-commit")
        commits = engine.store.records._env.info()["last_txnid"] - before
        blocks = len(engine.store.keys("one-commit"))
    assert blocks == 4 + 11  # the prompt's 4 layer blocks, then one block per decode step
    assert commits == blocks + 2  # plus the first manifest and the finished one
