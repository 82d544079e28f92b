from __future__ import annotations

import errno
import os
import uuid

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.stores import FsspecStore, fsspec_store
from dejavu_sdk.testing import StoreTests, same_bits


class TestFileStore(StoreTests):
    @pytest.fixture
    def store_factory(self, tmp_path):
        return lambda: dv.open_store(f"file://{tmp_path / uuid.uuid4().hex}")

    @pytest.fixture
    def reopen(self):
        return lambda store: dv.open_store(store.url)


class TestFsspecMemoryStore(StoreTests):
    @pytest.fixture
    def store_factory(self):
        return lambda: dv.open_store(f"fsspec+memory://{uuid.uuid4().hex}")

    @pytest.fixture
    def reopen(self):
        return lambda store: dv.open_store(f"fsspec+{store.url}")


@pytest.mark.slow
class TestS3Store(StoreTests):
    @pytest.fixture
    def store_factory(self, s3_options):
        return lambda: dv.open_store(f"s3://dejavu-tests/{uuid.uuid4().hex}", storage_options=s3_options)

    @pytest.fixture
    def reopen(self, s3_options):
        return lambda store: dv.open_store(store.url, storage_options=s3_options)


def test_s3_blocks_are_visible_to_a_second_client(s3_options) -> None:
    url = f"s3://dejavu-shared/{uuid.uuid4().hex}"
    key = dv.BlockKey("req-1", layers=(0, 1), tokens=(0, 16))
    block = torch.randn(1, 2, 1, 4, 16, 8)
    with dv.open_store(url, storage_options=s3_options) as writer:
        writer.flush(key, block)
    with dv.open_store(url, storage_options=s3_options) as reader:
        assert reader.keys() == [key]
        assert same_bits(reader.fetch(key), block)


def test_file_store_writes_leave_no_temporary_files(tmp_path) -> None:
    store = FsspecStore(f"file://{tmp_path}")
    key = dv.BlockKey("req-1", layers=(0, 1), tokens=(0, 16))
    store.flush(key, torch.ones(8))
    store.flush(key, torch.zeros(8))
    assert [p.name for p in (tmp_path / "req-1").iterdir()] == ["L0-1.T0-16"]
    assert store.delete("req-1") == 1
    assert not (tmp_path / "req-1").exists()


def test_unreachable_object_store_raises_store_error() -> None:
    options = {"endpoint_url": "http://127.0.0.1:9", "key": "x", "secret": "y", "config_kwargs": {
        "connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}}}
    with pytest.raises(dv.StoreError, match="s3://"):
        dv.open_store("s3://nowhere/prefix", storage_options=options)


def _disk_full() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _fail_disk_full(*args: object, **kwargs: object) -> None:
    raise _disk_full()


class _HalfWritten:
    """A file that takes half of what is written to it, then finds the disk full."""

    def __init__(self, file) -> None:
        self._file = file

    def __enter__(self) -> _HalfWritten:
        return self

    def __exit__(self, *failure: object) -> None:
        self._file.close()

    def write(self, data) -> int:
        raw = memoryview(data).cast("B")
        self._file.write(raw[:len(raw) // 2])
        raise _disk_full()


def _full_disk_open(path, mode="r", *args, **kwargs):
    file = open(path, mode, *args, **kwargs)  # noqa: SIM115 - the caller closes it, through _HalfWritten or not
    return _HalfWritten(file) if "w" in mode else file


@pytest.mark.parametrize("failing", ["write", "rename"])
def test_a_failed_file_write_leaves_no_temporary_file(tmp_path, monkeypatch, failing: str) -> None:
    store = FsspecStore(f"file://{tmp_path / 'store'}")
    key = dv.BlockKey("req-1", layers=(0, 1), tokens=(0, 16))
    earlier, block = torch.zeros(1, 2, 1, 4, 16, 8), torch.randn(1, 2, 1, 4, 16, 8)
    store.flush(key, earlier)
    with monkeypatch.context() as patched:
        if failing == "write":
            patched.setattr(fsspec_store, "open", _full_disk_open, raising=False)
        else:
            patched.setattr(os, "replace", _fail_disk_full)
        with pytest.raises(dv.StoreError, match="No space left") as raised:
            store.flush(key, block)
    assert isinstance(raised.value.__cause__, OSError)
    assert raised.value.__cause__.errno == errno.ENOSPC
    assert [path.name for path in (tmp_path / "store" / "req-1").iterdir()] == ["L0-1.T0-16"]
    assert same_bits(store.fetch(key), earlier)

    store.flush(key, block)
    clean = FsspecStore(f"file://{tmp_path / 'clean'}")
    clean.flush(key, block)
    assert same_bits(store.fetch(key), block)
    written, expected = (tmp_path / "store" / "req-1" / "L0-1.T0-16"), (tmp_path / "clean" / "req-1" / "L0-1.T0-16")
    assert written.read_bytes() == expected.read_bytes()
    assert store.delete("req-1") == 1


def test_a_failed_object_write_raises_store_error_and_stores_nothing(monkeypatch) -> None:
    store = dv.open_store(f"fsspec+memory://{uuid.uuid4().hex}")
    key = dv.BlockKey("req-1", layers=(0, 1), tokens=(0, 16))
    block = torch.randn(1, 2, 1, 4, 16, 8)
    with monkeypatch.context() as patched:
        patched.setattr(store.records._fs, "pipe_file", _fail_disk_full)
        with pytest.raises(dv.StoreError, match="No space left"):
            store.flush(key, block)
    assert store.keys("req-1") == []
    store.flush(key, block)
    assert same_bits(store.fetch(key), block)
