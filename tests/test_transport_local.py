from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.stores import MemoryStore
from dejavu_sdk.testing import TransportContractTests, random_tensor, same_bits
from dejavu_sdk.transports import LocalTransport

KEY = dv.BlockKey("req-1", layers=(0, 2), tokens=(0, 16))
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="side streams and pinned memory need CUDA")


class TestLocalTransport(TransportContractTests):
    """The local transport keeps the contract every transport keeps, over a store in this process."""

    @pytest.fixture
    def backing(self) -> dv.Store:
        return MemoryStore()

    @pytest.fixture
    def transport_factory(self, backing: dv.Store) -> Callable[[], dv.Transport]:
        return lambda: dv.open_transport("local", store=backing)

    @pytest.fixture
    def inbox(self, transport: LocalTransport) -> LocalTransport:
        return transport  # the local transport is its own peer


@pytest.mark.parametrize("store", ["memory://", "lmdb://{tmp}/kv"])
def test_blocks_and_records_reach_the_store_itself(tmp_path, store: str) -> None:
    backing = dv.open_store(store.format(tmp=tmp_path))
    transport = dv.open_transport("local", store=backing)
    block = random_tensor((2, 2, 1, 4, 16, 8), torch.bfloat16)
    transport.flush(KEY, block)
    assert same_bits(backing.fetch(KEY), block)
    with transport.get_record(str(KEY)) as record:
        transport.put_records([("req-2/L0-2.T0-16", bytes(record))])
    assert [k.stream_id for k in backing.keys()] == ["req-1", "req-2"]  # noqa: SIM118 - Store.keys(), not a dict
    transport.close()
    assert not backing.closed  # the store belongs to the caller


def test_the_local_transport_needs_a_store_and_no_address() -> None:
    with pytest.raises(dv.ConfigError, match="store"):
        dv.open_transport("local")
    with pytest.raises(dv.ConfigError, match="no address"):
        dv.open_transport("local://somewhere", store="memory://")
    with pytest.raises(dv.ConfigError, match="Store"):
        LocalTransport("memory://")  # type: ignore[arg-type]


@cuda
def test_device_blocks_are_copied_on_a_side_stream() -> None:
    transport = LocalTransport(MemoryStore())
    block = torch.randn(2, 2, 1, 8, 512, 64, device="cuda", dtype=torch.float16)
    transport.flush(KEY, block)
    out = torch.zeros_like(block)
    transport.fetch(KEY, out=out)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(out, block)
    assert len(transport._side_streams) == 1
