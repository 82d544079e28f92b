"""Block encoding: a small self-describing header, then the raw payload, verified on every read.

Layout (little endian), padded so that the payload starts on a 64-byte boundary:

    magic "DJVB" | version u8 | dtype code u8 | ndim u8 | flags u8 | key length u32 | payload length u64
    shape: ndim x u64 | key text (utf-8) | zero padding | checksum u64 | payload

The checksum is XXH3-64 over everything before it and the payload, so a torn, truncated or altered
record, or one stored under another key, raises `CorruptBlock` instead of yielding wrong KV.
Stores call `encode_block` on flush and `decode_block` on fetch; nothing else needs this module.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import xxhash

from .blocks import DTYPE_CODES, DTYPE_NAMES, BlockKey, dtype_name, torch_dtype
from .errors import ConfigError, CorruptBlock

MAGIC = b"DJVB"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sBBBBIQ")
_CHECKSUM = struct.Struct("<Q")
_ALIGN = 64
_MAX_NDIM = 16

#: Returns a writable, uninitialised uint8 array of the given length; stores override it (pinned memory).
Allocator = Callable[[int], np.ndarray]


def _header_length(ndim: int, key_length: int) -> int:
    unpadded = _FIXED.size + 8 * ndim + key_length + _CHECKSUM.size
    return -(-unpadded // _ALIGN) * _ALIGN


def _payload_writer(block: Any) -> tuple[str, tuple[int, ...], Callable[[np.ndarray], None]]:
    """Normalise a tensor, numpy array or buffer to (dtype name, shape, copy-into-uint8-destination)."""
    if isinstance(block, torch.Tensor):
        if block.layout != torch.strided:
            raise ConfigError(f"cannot store a {block.layout} tensor; convert it to a dense tensor first")
        tensor = block.detach()
        name = dtype_name(tensor.dtype)

        def write_tensor(dst: np.ndarray) -> None:
            torch.from_numpy(dst).view(tensor.dtype).view(tensor.shape).copy_(tensor)

        return name, tuple(tensor.shape), write_tensor
    if isinstance(block, np.ndarray):
        array = np.ascontiguousarray(block)
        name = dtype_name(array.dtype.name)
        return name, array.shape, lambda dst: np.copyto(dst, array.reshape(-1).view(np.uint8))
    try:
        view = memoryview(block).cast("B")
    except TypeError:
        raise ConfigError(
            f"cannot store a {type(block).__name__}: pass a torch.Tensor, a numpy array or a bytes-like buffer"
        ) from None
    return "uint8", (view.nbytes,), lambda dst: np.copyto(dst, np.frombuffer(view, dtype=np.uint8))


def encode_block(key: BlockKey, block: Any, allocate: Allocator = lambda n: np.empty(n, np.uint8)) -> np.ndarray:
    """Encode `block` stored under `key` into one uint8 record from `allocate` (one copy of the payload)."""
    name, shape, write_payload = _payload_writer(block)
    key_text = str(key).encode()
    payload_length = math.prod(shape) * torch_dtype(name).itemsize
    header_length = _header_length(len(shape), len(key_text))
    if len(shape) > _MAX_NDIM:
        raise ConfigError(f"blocks have at most {_MAX_NDIM} dimensions, got {len(shape)}")
    record = allocate(header_length + payload_length)
    _FIXED.pack_into(record, 0, MAGIC, FORMAT_VERSION, DTYPE_CODES[name], len(shape), 0, len(key_text),
                     payload_length)
    offset = _FIXED.size
    struct.pack_into(f"<{len(shape)}Q", record, offset, *shape)
    offset += 8 * len(shape)
    record[offset:offset + len(key_text)] = np.frombuffer(key_text, np.uint8)
    record[offset + len(key_text):header_length - _CHECKSUM.size] = 0
    payload = record[header_length:]
    write_payload(payload)
    checksum = _checksum(record[:header_length - _CHECKSUM.size], payload)
    _CHECKSUM.pack_into(record, header_length - _CHECKSUM.size, checksum)
    return record


def _checksum(header: Any, payload: Any) -> int:
    hasher = xxhash.xxh3_64()
    hasher.update(header)
    hasher.update(payload)
    return hasher.intdigest()


def _parse(key: BlockKey, record: Any) -> tuple[str, tuple[int, ...], np.ndarray]:
    """Validate a record read back for `key`; return (dtype name, shape, payload as uint8)."""
    data = np.frombuffer(record, dtype=np.uint8)

    def corrupt(reason: str) -> CorruptBlock:
        return CorruptBlock(f"block {key} is corrupt: {reason}; it must not be used (delete and re-replicate)")

    if data.size < _FIXED.size:
        raise corrupt(f"only {data.size} bytes, shorter than a block header")
    magic, version, code, ndim, _flags, key_length, payload_length = _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        raise corrupt("not a DejaVu block (bad magic)")
    if version != FORMAT_VERSION:
        raise corrupt(f"format version {version}, this SDK reads version {FORMAT_VERSION}")
    if code not in DTYPE_NAMES or ndim > _MAX_NDIM:
        raise corrupt(f"unknown dtype code {code} or {ndim} dimensions")
    header_length = _header_length(ndim, key_length)
    if data.size != header_length + payload_length:
        raise corrupt(f"{data.size} bytes where the header promises {header_length + payload_length} (truncated?)")
    shape = struct.unpack_from(f"<{ndim}Q", data, _FIXED.size)
    name = DTYPE_NAMES[code]
    if math.prod(shape) * torch_dtype(name).itemsize != payload_length:
        raise corrupt(f"shape {shape} of {name} does not match {payload_length} payload bytes")
    key_start = _FIXED.size + 8 * ndim
    stored_key = data[key_start:key_start + key_length].tobytes().decode(errors="replace")
    if stored_key != str(key):
        raise corrupt(f"the record holds block {stored_key!r}")
    payload = data[header_length:]
    (expected,) = _CHECKSUM.unpack_from(data, header_length - _CHECKSUM.size)
    if _checksum(data[:header_length - _CHECKSUM.size], payload) != expected:
        raise corrupt("checksum mismatch")
    return name, shape, payload


def decode_block(key: BlockKey, record: Any, out: torch.Tensor | None = None) -> torch.Tensor:
    """Verify a record read back for `key` and copy its payload into `out` (or a new CPU tensor)."""
    name, shape, payload = _parse(key, record)
    dtype = torch_dtype(name)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    elif not isinstance(out, torch.Tensor):
        raise ConfigError(f"out must be a torch.Tensor, got {type(out).__name__}")
    elif out.dtype != dtype or tuple(out.shape) != shape:
        raise ConfigError(
            f"out is {out.dtype} {tuple(out.shape)} but block {key} holds {dtype} {shape}; "
            "allocate out with the block's shape and dtype, or omit it"
        )
    if out.device.type == "cpu" and out.is_contiguous():
        np.copyto(out.detach().reshape(-1).view(torch.uint8).numpy(), payload)
    else:
        staging = torch.empty(payload.size, dtype=torch.uint8, pin_memory=out.device.type == "cuda")
        np.copyto(staging.numpy(), payload)
        out.copy_(staging.view(dtype).view(shape))
    return out
