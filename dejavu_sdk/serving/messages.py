"""Messages between the pipeline's head and its stage workers: a kind, a few fields and some tensors.

A message travels as one uint8 tensor through a transport's `send_tensor`, so that several senders into one
inbox never interleave the parts of two messages:

    header length u32 | header (JSON: kind, fields, each tensor's dtype and shape) | padding to 8 bytes |
    each tensor's bytes, each padded to 8 bytes

`unpack` returns views into the received buffer (no copy). A malformed message raises `TransportError`:
it came from a peer, not from the caller.
"""

from __future__ import annotations

import enum
import json
import math
import struct
from collections.abc import Iterable
from typing import Any

import attrs
import torch

from ..blocks import dtype_name, torch_dtype
from ..errors import ConfigError, TransportError

_LENGTH = struct.Struct("<I")
_ALIGN = 8


class Kind(str, enum.Enum):
    """Every kind of message, by who sends it to whom. A kind travels as its string value."""

    # a worker's life: worker -> head, head -> worker
    JOIN = "join"  # a worker's inbox, pid and launcher-given id
    # a worker whose head died, to the head now at its address: take my stage back (its name, layers, epoch);
    # head -> such a worker whose heartbeats reached it unasked: ask for that
    REJOIN = "rejoin"
    STANDBY = "standby"  # head: load the model and wait as a spare
    WARM = "warm"  # a spare has loaded the model
    ASSIGN = "assign"  # head: be this stage, with these links
    READY = "ready"  # the stage is loaded and linked
    HEARTBEAT = "heartbeat"
    FAILED = "failed"  # a stage could not go on (its process stops)
    SHUTDOWN = "shutdown"
    FENCED = "fenced"  # head -> a replaced worker that still speaks: another worker has its stage; exit
    STATS = "stats"  # head: report your caches; stage: here they are
    # a microbatch's steps: head -> first stage, stage -> stage, last stage -> head
    PREFILL = "prefill"
    DECODE = "decode"
    START = "start"  # head -> first token stage: decode a microbatch the prompt pipeline prefilled
    KV = "kv"  # prompt stage -> token stage: a layer's prompt KV
    CANCEL = "cancel"  # end some rows at their next step
    ENTER = "enter"  # head -> first stage: a group of requests joins a slot (continuous batching)
    NOT_ENTERED = "not_entered"  # first stage -> head: the slot ended before the group could join
    END = "end"  # free the microbatch's cache
    TOKENS = "tokens"
    PREFILLED = "prefilled"
    ENDED = "ended"
    FREED = "freed"
    MICROBATCH_FAILED = "microbatch_failed"  # its computation raised: it fails, the stage goes on
    LINK_LOST = "link_lost"
    # a recovery: head -> stage, and each step's answer
    PAUSE = "pause"
    PAUSED = "paused"
    RELINK = "relink"
    RELINKED = "relinked"
    SEND_REPLICA = "send_replica"
    SENT = "sent"
    RESTORE = "restore"  # replica holder -> replacement
    DROP = "drop"
    REWIND = "rewind"
    REWOUND = "rewound"

    def __str__(self) -> str:
        return self.value


@attrs.frozen
class Message:
    """`kind` says what the receiver does; `fields` are small JSON values; `tensors` go as they are."""

    kind: str
    fields: dict[str, Any] = attrs.field(factory=dict)
    tensors: tuple[torch.Tensor, ...] = attrs.field(default=(), converter=lambda value: _tensors(value))


def _tensors(value: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(value)


def pack(message: Message) -> torch.Tensor:
    """`message` as one uint8 tensor (one copy of each tensor's bytes)."""
    tensors = [tensor.detach().contiguous().cpu() for tensor in message.tensors]
    header = json.dumps({"kind": message.kind, "fields": message.fields,
                         "tensors": [[dtype_name(t.dtype), list(t.shape)] for t in tensors]},
                        separators=(",", ":")).encode()
    start = _padded(_LENGTH.size + len(header))
    sizes = [_padded(tensor.nbytes) for tensor in tensors]
    packed = torch.zeros(start + sum(sizes), dtype=torch.uint8)
    packed[:_LENGTH.size] = torch.frombuffer(bytearray(_LENGTH.pack(len(header))), dtype=torch.uint8)
    packed[_LENGTH.size:_LENGTH.size + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    offset = start
    for tensor, size in zip(tensors, sizes, strict=True):
        if tensor.nbytes:
            packed[offset:offset + tensor.nbytes] = tensor.reshape(-1).view(torch.uint8)
        offset += size
    return packed


def unpack(packed: torch.Tensor) -> Message:
    """The message in a received uint8 tensor; TransportError if it is not one."""
    try:
        if packed.dtype != torch.uint8 or packed.dim() != 1:
            raise ValueError(f"a {packed.dtype} tensor of shape {tuple(packed.shape)}")
        data = packed.numpy()
        (length,) = _LENGTH.unpack_from(data.data, 0)
        if length > packed.numel() - _LENGTH.size:
            raise ValueError(f"a header of {length} bytes in a message of {packed.numel()}")
        header = json.loads(bytes(data[_LENGTH.size:_LENGTH.size + length]))
        offset = _padded(_LENGTH.size + length)
        tensors = []
        for name, shape in header["tensors"]:
            if not all(isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shape):
                raise ValueError(f"a tensor of shape {shape!r}")
            dtype = torch_dtype(name)
            nbytes = math.prod(shape) * dtype.itemsize
            if offset + nbytes > packed.numel():
                raise ValueError("shorter than the tensors its header lists")
            tensors.append(packed[offset:offset + nbytes].view(dtype).view(shape))
            offset += _padded(nbytes)
        return Message(str(header["kind"]), dict(header["fields"]), tuple(tensors))
    except (ValueError, KeyError, TypeError, struct.error, ConfigError, RuntimeError, RecursionError) as error:
        raise TransportError(f"a peer sent something that is not a pipeline message: {error}") from None


def _padded(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN
