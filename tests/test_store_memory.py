from __future__ import annotations

import weakref

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.codec import decode_block
from dejavu_sdk.stores import MemoryStore
from dejavu_sdk.stores import memory as memory_module
from dejavu_sdk.testing import StoreTests


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store_factory(self):
        return MemoryStore


def test_pinning_without_cuda_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(dv.ConfigError, match="CUDA"):
        MemoryStore(pin_memory=True)
    assert MemoryStore().records.pin_memory is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_pinned_records_round_trip_device_tensors() -> None:
    store = MemoryStore()
    assert store.records.pin_memory
    key = dv.BlockKey("gpu", layers=(0, 2), tokens=(0, 16))
    block = torch.randn(2, 2, 1, 4, 16, 64, device="cuda", dtype=torch.bfloat16)
    store.flush(key, block)
    with store.records.get_record(str(key)) as record:
        assert torch.from_numpy(record).is_pinned()
    out = torch.empty_like(block)
    store.fetch(key, out=out)
    assert torch.equal(out, block)


def test_a_deleted_streams_memory_holds_the_next_streams_blocks(monkeypatch) -> None:
    """A finished stream's records are reused by the next stream's blocks (fresh memory costs a page fault
    per page), up to SPARE_BYTES in all, and what is written into reused memory reads back exactly."""
    store = MemoryStore()
    blocks = [torch.full((1, 2, 1, 4, 4, 64), float(i)) for i in range(12)]
    first = [dv.BlockKey("a", layers=(0, 1), tokens=(i, i + 1)) for i in range(12)]
    for key, block in zip(first, blocks, strict=True):
        store.flush(key, block)
    freed = []
    for key in first:
        with store.records.get_record(str(key)) as record:
            freed.append(weakref.ref(record))
    del record  # no reader holds any of them now
    monkeypatch.setattr(memory_module, "SPARE_BYTES", 8 * freed[0]().size)  # room for 8 of the 12
    store.delete("a")
    assert sum(ref() is not None for ref in freed) == 8
    second = [dv.BlockKey("b", layers=(0, 1), tokens=(i, i + 1)) for i in range(12)]
    for key, block in zip(second, reversed(blocks), strict=True):
        store.flush(key, block)
    reused = 0
    for key in second:
        with store.records.get_record(str(key)) as record:
            reused += any(ref() is record for ref in freed)
    assert reused == 8
    for key, block in zip(second, reversed(blocks), strict=True):
        assert torch.equal(store.fetch(key), block)


def test_a_record_still_being_read_is_not_reused() -> None:
    store = MemoryStore()
    key = dv.BlockKey("a", layers=(0, 1), tokens=(0, 1))
    store.flush(key, torch.ones(1, 2, 1, 4, 1, 8))
    with store.records.get_record(str(key)) as held:
        store.delete("a")
        store.flush(dv.BlockKey("b", layers=(0, 1), tokens=(0, 1)), torch.zeros(1, 2, 1, 4, 1, 8))
        assert store.fetch(dv.BlockKey("b", layers=(0, 1), tokens=(0, 1))).sum() == 0
        assert decode_block(str(key), held).sum() == 8 * 2 * 4  # the reader's record is untouched
