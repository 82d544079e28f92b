from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.codec import HostBlock, KVPair, decode_block, encode_block, flat_bytes
from dejavu_sdk.testing import random_tensor, same_bits

KEY = dv.BlockKey("s", layers=(0, 2), tokens=(0, 3))


def test_payload_starts_aligned_and_header_is_small() -> None:
    block = random_tensor((2, 2, 1, 4, 3, 64), torch.float16)
    record = encode_block(KEY, block)
    header = record.nbytes - block.numel() * 2 - 8  # 8: the checksum trailer
    assert header % 64 == 0
    assert header <= 128
    assert same_bits(decode_block(KEY, record), block)


def test_a_flipped_bit_anywhere_in_the_record_is_detected() -> None:
    record = encode_block(KEY, random_tensor((3, 5), torch.bfloat16))
    for position in range(record.nbytes):
        damaged = record.copy()
        damaged[position] ^= 0x10
        with pytest.raises(dv.CorruptBlock):
            decode_block(KEY, damaged)


def test_allocator_receives_the_record_size() -> None:
    sizes = []

    def allocate(n: int) -> np.ndarray:
        sizes.append(n)
        return np.empty(n, np.uint8)

    record = encode_block(KEY, torch.ones(10), allocate)
    assert sizes == [record.nbytes]


def test_too_many_dimensions_are_refused() -> None:
    with pytest.raises(dv.ConfigError, match="dimensions"):
        encode_block(KEY, torch.ones((1,) * 17))


def test_fetching_into_an_out_whose_memory_moved_writes_the_new_memory() -> None:
    block = random_tensor((8, 8), torch.float32, seed=1)
    record = encode_block("s/L0-1.T0-1", block)
    out = torch.zeros_like(block)
    decode_block("s/L0-1.T0-1", record, out)
    old_memory = out.clone()
    out.set_(torch.zeros_like(block))  # same tensor object, new storage
    decode_block("s/L0-1.T0-1", record, out)
    assert same_bits(out, block)
    assert same_bits(old_memory, block)
    out.t_()  # same tensor and memory, no longer contiguous
    out.zero_()
    decode_block("s/L0-1.T0-1", record, out)
    assert same_bits(out, block)


def test_fetching_into_out_does_not_keep_it_alive() -> None:
    block = random_tensor((256, 64), torch.float32, seed=2)
    record = encode_block("s/L0-1.T0-1", block)
    out = torch.zeros_like(block)
    decode_block("s/L0-1.T0-1", record, out)
    assert same_bits(out, block)
    gone = weakref.ref(out)
    del out
    gc.collect()
    assert gone() is None
    assert same_bits(decode_block("s/L0-1.T0-1", record, torch.zeros_like(block)), block)
    empty = torch.empty(0)
    assert decode_block("s/L0-1.T0-1", encode_block("s/L0-1.T0-1", empty), empty).numel() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_a_host_block_encodes_to_the_same_record_as_its_tensor(dtype) -> None:
    tensor = random_tensor((2, 2, 1, 4, 3, 64), dtype)
    host = HostBlock.of(tensor)
    assert bytes(encode_block(KEY, host)) == bytes(encode_block(KEY, tensor))
    assert same_bits(decode_block(KEY, encode_block(KEY, host)), tensor)
    name, shape, _write, flat = flat_bytes(host)  # what transports stream
    assert (name, shape) == (dv.blocks.dtype_name(dtype), tuple(tensor.shape))
    assert flat.tobytes() == tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_host_block_sees_its_tensor_change() -> None:
    """A staging buffer is described once and refilled every step: the description must follow the memory."""
    tensor = torch.zeros(2, 3)
    host = HostBlock.of(tensor)
    tensor.copy_(torch.arange(6.0).view(2, 3))
    assert torch.equal(decode_block(KEY, encode_block(KEY, host)), tensor)


@pytest.mark.parametrize("tensor", [torch.zeros(4, 4)[:, :2], torch.zeros(4, 4).to_sparse()],
                         ids=["strided view", "sparse"])
def test_a_host_block_must_be_contiguous_dense_cpu_memory(tensor) -> None:
    with pytest.raises(dv.ConfigError, match="HostBlock"):
        HostBlock.of(tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_a_kv_pair_encodes_to_the_same_record_as_its_stack(dtype) -> None:
    """A prompt layer's keys and values, as a model makes them (values a transposed view), are encoded
    without being stacked first, into the very record their stack makes."""
    keys = random_tensor((2, 3, 5, 8), dtype)
    values = random_tensor((2, 5, 3, 8), dtype).transpose(1, 2)  # strided, as v_proj(...).transpose(1, 2)
    pair, stacked = KVPair.of(keys, values), torch.stack((keys, values)).unsqueeze(0)
    assert pair.shape == tuple(stacked.shape)
    assert same_bits(pair.tensor, stacked)
    assert bytes(encode_block(KEY, pair)) == bytes(encode_block(KEY, stacked))
    name, shape, write, flat = flat_bytes(pair)  # what transports stream
    payload = np.empty(pair.nbytes, np.uint8)
    write(payload)
    assert (name, shape, flat) == (dv.blocks.dtype_name(dtype), tuple(stacked.shape), None)
    assert payload.tobytes() == stacked.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(("keys", "values"), [(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 4, 4)),
                                              (torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4, dtype=torch.float16)),
                                              (torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))],
                         ids=["shapes differ", "dtypes differ", "not 4-d"])
def test_a_kv_pair_is_one_layers_keys_and_values(keys, values) -> None:
    with pytest.raises(dv.ConfigError, match="KVPair"):
        KVPair.of(keys, values)


def test_bytes_encode_as_uint8() -> None:
    record = encode_block("s/manifest", b"{}")
    assert decode_block("s/manifest", record).numpy().tobytes() == b"{}"
    assert bytes(record) == bytes(encode_block("s/manifest", bytearray(b"{}")))
