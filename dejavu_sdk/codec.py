"""Block records: a small self-describing header, the raw payload, and a checksum trailer.

Layout (little endian); the header is padded so that the payload starts on a 64-byte boundary:

    header:  magic "DJVB" | version u8 | dtype code u8 | ndim u8 | flags u8 | label length u32 |
             payload length u64 | shape: ndim x u64 | label (utf-8) | zero padding
    payload: the tensor's bytes, C order
    trailer: XXH3-64 of header and payload, u64

The label is the block's key (`str(key)`), so a record stored or sent under another name is detected.
The checksum comes last, so a network sender can stream the payload and append the checksum it computed
on the way, with no second pass. A torn, truncated or altered record raises `CorruptBlock`, never wrong KV.
Stores use `encode_block`/`decode_block`; transports stream `RecordHeader`, payload and trailer.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import math
import struct
import weakref
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch
import xxhash

from .blocks import DTYPE_CODES, DTYPE_NAMES, dtype_name, torch_dtype
from .errors import ConfigError, CorruptBlock

MAGIC = b"DJVB"
FORMAT_VERSION = 1
FIXED = struct.Struct("<4sBBBBIQ")
TRAILER = struct.Struct("<Q")
_ALIGN = 64
_ITEMSIZE = {name: torch_dtype(name).itemsize for name in DTYPE_CODES}
MAX_NDIM = 16
MAX_LABEL_BYTES = 4096

#: Returns a writable, uninitialised uint8 array of the given length; stores override it (pinned memory).
Allocator = Callable[[int], np.ndarray]


def new_checksum() -> Any:
    """A streaming XXH3-64 hasher: `update(buffer)` as bytes pass, `intdigest()` at the end."""
    return xxhash.xxh3_64()


def corrupt(label: str, reason: str) -> CorruptBlock:
    return CorruptBlock(f"block {label} is corrupt: {reason}; it must not be used (delete and re-replicate)")


@attrs.frozen
class RecordHeader:
    """What a record says about its payload: the label it was written under, dtype and shape."""

    label: str
    dtype: str
    shape: tuple[int, ...]

    # Cached: a fetch reads these several times, and per-call costs matter for small blocks.
    @functools.cached_property
    def payload_length(self) -> int:
        return _header_layout(self.dtype, self.shape, len(self.label.encode()))[1]

    @functools.cached_property
    def length(self) -> int:
        return _header_layout(self.dtype, self.shape, len(self.label.encode()))[2]

    @functools.cached_property
    def record_length(self) -> int:
        return self.length + self.payload_length + TRAILER.size

    def pack(self) -> bytes:
        return pack_header(self.label, self.dtype, self.shape)[0]

    @staticmethod
    def length_from_fixed(data: Any, label: str) -> int:
        """The whole header's length, from its first `FIXED.size` bytes (for readers of a byte stream)."""
        magic, version, code, ndim, _flags, label_length, _payload = FIXED.unpack_from(data, 0)
        if magic != MAGIC:
            raise corrupt(label, "not a DejaVu block (bad magic)")
        if version != FORMAT_VERSION:
            raise corrupt(label, f"format version {version}, this SDK reads version {FORMAT_VERSION}")
        if code not in DTYPE_NAMES or ndim > MAX_NDIM or label_length > MAX_LABEL_BYTES:
            raise corrupt(label, f"unknown dtype code {code}, {ndim} dimensions or a {label_length}-byte label")
        return _header_length(ndim, label_length)

    @classmethod
    def unpack(cls, data: Any, label: str) -> RecordHeader:
        """Parse and check a header; `label` is what the caller expected (named in errors)."""
        if len(data) < FIXED.size:
            raise corrupt(label, f"only {len(data)} bytes, shorter than a block header")
        length = cls.length_from_fixed(data, label)
        if len(data) < length:
            raise corrupt(label, f"{len(data)} bytes, shorter than its {length}-byte header")
        header = _parse_header(bytes(data[:length]))
        if header is None:
            _magic, _version, code, ndim, _flags, _label_length, payload_length = FIXED.unpack_from(data, 0)
            shape = struct.unpack_from(f"<{ndim}Q", data, FIXED.size)
            raise corrupt(label, f"shape {shape} of {DTYPE_NAMES[code]} does not match {payload_length} payload bytes")
        return header


@functools.lru_cache(maxsize=1024)
def _parse_header(packed: bytes) -> RecordHeader | None:
    """The header these bytes describe, or None when its shape and payload length disagree.

    Cached: fetches of the same blocks parse the same bytes again and again, and for small blocks the
    parse costs as much as hashing a fifth of the payload. `length_from_fixed` has checked the fixed part.
    """
    _magic, _version, code, ndim, _flags, label_length, payload_length = FIXED.unpack_from(packed, 0)
    shape = struct.unpack_from(f"<{ndim}Q", packed, FIXED.size)
    start = FIXED.size + 8 * ndim
    header = RecordHeader(packed[start:start + label_length].decode(errors="replace"), DTYPE_NAMES[code], shape)
    return header if header.payload_length == payload_length else None


def pack_header(label: str, dtype: str, shape: tuple[int, ...]) -> tuple[bytes, int]:
    """The packed header of a record of `dtype` x `shape` under `label`, and its payload's length."""
    encoded = label.encode()
    start, payload_length, length = _header_layout(dtype, shape, len(encoded))
    return start + encoded + bytes(length - len(start) - len(encoded)), payload_length


@functools.lru_cache(maxsize=256)
def _header_layout(dtype: str, shape: tuple[int, ...], label_length: int) -> tuple[bytes, int, int]:
    """A header's fixed part and shape, packed, with the payload's and the whole header's lengths.

    Cached: a stream's decode blocks share dtype, shape and label length, and a header is packed per block.
    """
    if len(shape) > MAX_NDIM:
        raise ConfigError(f"blocks have at most {MAX_NDIM} dimensions, got {len(shape)}")
    payload_length = math.prod(shape) * _ITEMSIZE[dtype]
    start = FIXED.pack(MAGIC, FORMAT_VERSION, DTYPE_CODES[dtype], len(shape), 0, label_length, payload_length)
    return start + struct.pack(f"<{len(shape)}Q", *shape), payload_length, _header_length(len(shape), label_length)


def _header_length(ndim: int, label_length: int) -> int:
    unpadded = FIXED.size + 8 * ndim + label_length
    return -(-unpadded // _ALIGN) * _ALIGN


#: The longest header any valid record has: receivers refuse longer ones before allocating.
MAX_HEADER_BYTES = _header_length(MAX_NDIM, MAX_LABEL_BYTES)


@attrs.frozen
class HostBlock:
    """A block in contiguous CPU memory, described once so that it can be handed off again and again.

    A decode step's staging buffer is one: each step, the streamer thread encodes it with plain buffer
    copies and no numpy or torch call. That thread wakes once per step into caches the model just filled,
    and code it shares with the model's thread (the interpreter's) is warm there, a library's is not.
    `tensor` is the buffer itself, for sinks that want a tensor; `data` its bytes; `dtype` a header name.
    """

    tensor: torch.Tensor
    data: memoryview
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> HostBlock:
        """Describe a contiguous CPU tensor (any dtype blocks can hold); ConfigError for any other."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.layout != torch.strided:
            raise ConfigError(f"a HostBlock is contiguous CPU memory, got a {tensor.layout} {tensor.device} tensor"
                              f"{'' if tensor.is_contiguous() else ' (not contiguous)'}")
        data = tensor.detach().reshape(-1).view(torch.uint8).numpy().data
        return cls(tensor, data, dtype_name(tensor.dtype), tuple(tensor.shape))


@attrs.frozen
class KVPair:
    """One layer's keys and values `[B, H_kv, T, D]` in CPU memory, as the block `[1, 2, B, H_kv, T, D]` they
    make together, without stacking them first: the encoder copies each straight into the record, with numpy
    (one thread, not the model's), so the model's thread hands a prompt layer off without a copy. The
    tensors may be strided views; nothing may write to them afterwards. `tensor` stacks them, for sinks
    that want a tensor."""

    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor) -> KVPair:
        if keys.device.type != "cpu" or values.device.type != "cpu" or keys.shape != values.shape \
                or keys.dtype != values.dtype or keys.dim() != 4:
            raise ConfigError(f"a KVPair is one layer's keys and values of one shape and dtype in CPU memory, got "
                              f"{keys.dtype} {tuple(keys.shape)} on {keys.device} and {values.dtype} "
                              f"{tuple(values.shape)} on {values.device}")
        return cls(keys.detach(), values.detach())

    @property
    def shape(self) -> tuple[int, ...]:
        return (1, 2, *self.keys.shape)

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    @property
    def tensor(self) -> torch.Tensor:
        return torch.stack((self.keys, self.values)).unsqueeze(0)

    def write_into(self, destination: np.ndarray) -> None:
        """Write the block's bytes, C order, into `destination` (uint8, `nbytes` long)."""
        half = self.nbytes // 2
        for part, tensor in ((destination[:half], self.keys), (destination[half:], self.values)):
            source = tensor.view(_SAME_SIZE_INTEGER[tensor.element_size()]).numpy()  # numpy has no bfloat16
            np.copyto(part.view(source.dtype).reshape(source.shape), source)


#: A dtype of each item size that numpy knows, to move any tensor's bytes with numpy.
_SAME_SIZE_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flat_bytes(block: Any) -> tuple[str, tuple[int, ...], Callable[[np.ndarray], None], np.ndarray | None]:
    """Normalise a tensor, `KVPair`, numpy array or buffer to (dtype name, shape, copy-into-destination, flat view).

    The flat view is the payload as CPU uint8 without a copy, or None when the source is not contiguous
    host memory (a device tensor, a strided view); the copy function writes the payload in either case.
    """
    if isinstance(block, HostBlock):
        host = np.frombuffer(block.data, np.uint8)
        return block.dtype, block.shape, lambda dst: np.copyto(dst, host), host
    if isinstance(block, KVPair):
        return dtype_name(block.keys.dtype), block.shape, block.write_into, None
    if isinstance(block, torch.Tensor):
        if block.layout != torch.strided:
            raise ConfigError(f"cannot store a {block.layout} tensor; convert it to a dense tensor first")
        tensor = block.detach()
        name = dtype_name(tensor.dtype)
        flat = None
        if tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg():
            flat = tensor.reshape(-1).view(torch.uint8).numpy()

        def write_tensor(dst: np.ndarray) -> None:
            if flat is not None:  # numpy copies on one thread: they never compete for the model's OpenMP threads
                np.copyto(dst, flat)
            else:
                torch.from_numpy(dst).view(tensor.dtype).view(tensor.shape).copy_(tensor)

        return name, tuple(tensor.shape), write_tensor, flat
    if isinstance(block, np.ndarray):
        name = dtype_name(block.dtype.name)
        array = np.ascontiguousarray(block)
        flat = array.reshape(-1).view(np.uint8)
        return name, array.shape, lambda dst: np.copyto(dst, flat), flat
    try:
        view = memoryview(block).cast("B")
    except TypeError:
        raise ConfigError(
            f"cannot store a {type(block).__name__}: pass a torch.Tensor, a numpy array or a bytes-like buffer"
        ) from None
    flat = np.frombuffer(view, dtype=np.uint8)
    return "uint8", (view.nbytes,), lambda dst: np.copyto(dst, flat), flat


def encode_block(label: Any, block: Any, allocate: Allocator = lambda n: np.empty(n, np.uint8)) -> np.ndarray:
    """Encode `block` under `label` (a BlockKey or name) into one uint8 record from `allocate`.

    A `HostBlock` or `bytes` (a decode step, a progress record) is copied with buffer copies alone."""
    source: Any = None
    if isinstance(block, HostBlock):
        name, shape, source = block.dtype, block.shape, block.data
    elif isinstance(block, bytes):
        name, shape, source = "uint8", (len(block),), block
    else:
        name, shape, write_payload, _flat = flat_bytes(block)
    packed, payload_length = pack_header(str(label), name, tuple(shape))
    body_length = len(packed) + payload_length
    record = allocate(body_length + TRAILER.size)
    view = record.data
    view[:len(packed)] = packed
    if source is not None:
        view[len(packed):body_length] = source
    else:
        write_payload(record[len(packed):body_length])
    TRAILER.pack_into(view, body_length, xxhash.xxh3_64_intdigest(view[:body_length]))
    return record


def check_out(label: str, header: RecordHeader, out: Any) -> torch.Tensor:
    """`out` if it can receive the block `header` describes, else ConfigError; a new tensor when None."""
    dtype = torch_dtype(header.dtype)
    if out is None:
        return torch.empty(header.shape, dtype=dtype)
    if not isinstance(out, torch.Tensor):
        raise ConfigError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype or out.shape != header.shape:
        raise ConfigError(
            f"out is {out.dtype} {tuple(out.shape)} but block {label} holds {dtype} {header.shape}; "
            "allocate out with the block's shape and dtype, or omit it"
        )
    return out


_VIEWS: collections.OrderedDict[int, tuple[weakref.ref, int, np.ndarray]] = collections.OrderedDict()
_VIEWS_KEPT = 4


def host_view(tensor: torch.Tensor) -> np.ndarray | None:
    """The bytes of `tensor` as a writable uint8 array, or None when it is not contiguous host memory.

    Use the array at once, while `tensor` is alive: it does not keep the tensor's memory alive.

    Views of the last few tensors are kept: fetches into the same preallocated `out` are the hot path, and
    building a view through torch costs tens of microseconds there. An entry holds only a weak reference,
    so the cache never keeps a caller's tensor alive. It is used only when that reference still gives
    this very tensor and the tensor's memory is where it was (`set_` or `resize_` can move it).
    """
    if not tensor.is_contiguous():
        return None
    kept = _VIEWS.get(id(tensor))
    address, nbytes = tensor.data_ptr(), tensor.nbytes
    if kept is not None and kept[0]() is tensor and kept[1] == address and kept[2].size == nbytes:
        return kept[2]
    if tensor.device.type != "cpu":
        return None
    if nbytes == 0:
        return np.empty(0, np.uint8)
    view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
    _VIEWS[id(tensor)] = (weakref.ref(tensor), address, view)
    if len(_VIEWS) > _VIEWS_KEPT:
        _VIEWS.popitem(last=False)
    return view


def copy_payload(payload: np.ndarray, out: torch.Tensor) -> None:
    """Copy verified payload bytes into `out`, through a (pinned) staging buffer when out is not host memory."""
    target = host_view(out)
    if target is not None:
        np.copyto(target, payload)
        return
    staging = torch.empty(payload.size, dtype=torch.uint8, pin_memory=out.device.type == "cuda")
    np.copyto(staging.numpy(), payload)
    out.copy_(staging.view(out.dtype).view(out.shape))


def decode_block(label: Any, record: Any, out: torch.Tensor | None = None) -> torch.Tensor:
    """Verify a record read back for `label` and copy its payload into `out` (or a new CPU tensor).

    Nothing is written into `out` unless the whole record checks out.
    """
    label = str(label)
    data = record if isinstance(record, np.ndarray) and record.dtype == np.uint8 else np.frombuffer(record, np.uint8)
    header = RecordHeader.unpack(data, label)
    if data.size != header.record_length:
        raise corrupt(label, f"{data.size} bytes where the header promises {header.record_length} (truncated?)")
    if header.label != label:
        raise corrupt(label, f"the record holds block {header.label!r}")
    out = check_out(label, header, out)
    body = data[:header.record_length - TRAILER.size]
    if xxhash.xxh3_64_intdigest(body.data) != TRAILER.unpack_from(data.data, body.size)[0]:
        raise corrupt(label, "checksum mismatch")
    copy_payload(body[header.length:], out)
    return out
