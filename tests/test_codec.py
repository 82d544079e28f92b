from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.codec import decode_block, encode_block
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
