from __future__ import annotations

import uuid

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.stores import FsspecStore
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
