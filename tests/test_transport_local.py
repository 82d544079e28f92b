from __future__ import annotations

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.testing import random_tensor, same_bits
from dejavu_sdk.transports import open_transport, serve
from dejavu_sdk.transports.local import LocalTransport

KEY = dv.BlockKey("req-1", layers=(0, 2), tokens=(0, 16))
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="side streams and pinned memory need CUDA")


@pytest.mark.parametrize("store", ["memory://", "lmdb://{tmp}/kv"])
def test_blocks_round_trip_through_the_store(tmp_path, store: str) -> None:
    backing = dv.open_store(store.format(tmp=tmp_path))
    transport = open_transport("local", store=backing)
    block = random_tensor((2, 2, 1, 4, 16, 8), torch.bfloat16)
    transport.flush(KEY, block)
    assert same_bits(backing.fetch(KEY), block)
    out = torch.empty_like(block)
    assert transport.fetch(KEY, out=out) is out and same_bits(out, block)
    assert transport.names("req-1/") == [str(KEY)]
    transport.put_records([("req-2/L0-2.T0-16", transport.get_record(str(KEY)))])
    assert [k.stream_id for k in backing.keys()] == ["req-1", "req-2"]
    transport.remove([str(KEY)])
    assert [k.stream_id for k in backing.keys()] == ["req-2"]


def test_tensors_loop_back_and_misuse_is_refused() -> None:
    transport = open_transport("local")
    transport.send_tensor(torch.arange(3))
    assert transport.recv_tensor(timeout=1).tolist() == [0, 1, 2]
    with pytest.raises(dv.TransportError):
        transport.recv_tensor(timeout=0.05)
    with pytest.raises(dv.ConfigError, match="no address"):
        open_transport("local://somewhere")
    with pytest.raises(dv.ConfigError, match="serve no peers"):
        serve("local://", "memory://")
    transport.close()
    with pytest.raises(dv.StoreClosed):
        transport.flush(KEY, torch.ones(1))


@cuda
def test_device_blocks_are_copied_on_a_side_stream() -> None:
    transport = LocalTransport()
    block = torch.randn(2, 2, 1, 8, 512, 64, device="cuda", dtype=torch.float16)
    transport.flush(KEY, block)
    out = torch.zeros_like(block)
    transport.fetch(KEY, out=out)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(out, block)
    assert len(transport._side_streams) == 1
