from __future__ import annotations

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.stores import MemoryStore
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
