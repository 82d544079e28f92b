"""Tensor helpers for tests, demos and benchmarks: random bit patterns of any dtype, bitwise comparison."""

from __future__ import annotations

import numpy as np
import torch


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns of `dtype` (NaNs, infinities and subnormals included)."""
    generator = torch.Generator().manual_seed(seed)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    bits = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        bits = bits % 2
    return bits.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when both tensors have the same dtype, shape and bytes (NaN == NaN here)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
