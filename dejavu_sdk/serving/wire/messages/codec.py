"""Messages on the wire, and the only place where a message class meets its JSON: each message as one uint8
tensor (`pack`), and back (`unpack`).

A message travels as one tensor through a transport's `send_tensor`, so that several senders into one inbox never
interleave the parts of two messages:

    header length u32 | header (JSON: kind, fields, each tensor's dtype and shape) | padding to 8 bytes |
    each tensor's bytes, each padded to 8 bytes

The header's `fields` are the message's attributes but its tensors (value classes as objects, maps with integer
keys as objects keyed by their decimal strings); its `tensors` list the tensor attributes in the class's order,
an optional one that is None as null. `unpack` checks the kind, every field against the class's types (none
missing, none extra) and the tensors, and returns views into the received buffer (no copy). A malformed message
raises `TransportError`: it came from a peer, not from the caller.
"""

from __future__ import annotations

import json
import math
import struct
import types
import typing
from typing import Any

import attrs
import torch

from ....blocks import dtype_name, torch_dtype
from ....errors import ConfigError, TransportError
from .base import Message
from .life import (
    AskRejoin,
    AskStats,
    Assign,
    Failed,
    Fenced,
    Heartbeat,
    Join,
    Ready,
    Rejoin,
    Shutdown,
    Standby,
    Stats,
    Warm,
)
from .recovery import Drop, Pause, Paused, Relink, Relinked, Restore, RewindSlot, Rewound, SendReplica, Sent
from .steps import (
    Cancel,
    End,
    Enter,
    Freed,
    Kv,
    LinkLost,
    MicrobatchFailed,
    NotEntered,
    OpenSlot,
    Prefill,
    Prefilled,
    RoundReport,
    SlotRound,
)

_LENGTH = struct.Struct("<I")
_ALIGN = 8
#: Each class's header attributes and tensor attributes (`_attributes`).
_LAYOUTS: dict[type, tuple[tuple[attrs.Attribute[Any], ...], tuple[attrs.Attribute[Any], ...]]] = {}

#: Every message class, by its kind.
KINDS: dict[str, type[Message]] = {cls.kind: cls for cls in (
    Join, Rejoin, AskRejoin, Standby, Warm, Assign, Ready, Heartbeat, Failed, Fenced, Shutdown, AskStats, Stats,
    Prefill, OpenSlot, Enter, SlotRound, Kv, Cancel, NotEntered, End, RoundReport, Prefilled,
    Freed, MicrobatchFailed, LinkLost,
    Pause, Paused, Relink, Relinked, SendReplica, Sent, Restore, Drop, RewindSlot, Rewound)}


def pack(message: Message) -> torch.Tensor:
    """`message` as one uint8 tensor (one copy of each tensor's bytes)."""
    fields, tensor_fields = _attributes(type(message))
    tensors = [getattr(message, field.name) for field in tensor_fields]
    tensors = [None if tensor is None else tensor.detach().contiguous().cpu() for tensor in tensors]
    header = json.dumps({"kind": message.kind,
                         "fields": {field.name: _plain(getattr(message, field.name)) for field in fields},
                         "tensors": [None if tensor is None else [dtype_name(tensor.dtype), list(tensor.shape)]
                                     for tensor in tensors]},
                        separators=(",", ":")).encode()
    present = [tensor for tensor in tensors if tensor is not None]
    start = _padded(_LENGTH.size + len(header))
    sizes = [_padded(tensor.nbytes) for tensor in present]
    packed = torch.zeros(start + sum(sizes), dtype=torch.uint8)
    packed[:_LENGTH.size] = torch.frombuffer(bytearray(_LENGTH.pack(len(header))), dtype=torch.uint8)
    packed[_LENGTH.size:_LENGTH.size + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    offset = start
    for tensor, size in zip(present, sizes, strict=True):
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
        if not isinstance(header, dict) or set(header) != {"kind", "fields", "tensors"}:
            raise ValueError("a header without exactly a kind, fields and tensors")
        cls = KINDS.get(header["kind"]) if isinstance(header["kind"], str) else None
        if cls is None:
            raise ValueError(f"a message of unknown kind {str(header['kind'])[:64]!r}")
        tensors = _tensors(packed, header["tensors"], _padded(_LENGTH.size + length))
        return _message(cls, header["fields"], tensors)
    except (ValueError, KeyError, TypeError, struct.error, ConfigError, RuntimeError, RecursionError) as error:
        raise TransportError(f"a peer sent something that is not a pipeline message: {error}") from None


def _tensors(packed: torch.Tensor, listed: Any, offset: int) -> list[torch.Tensor | None]:
    """The tensors a header lists (None for a null), as views into `packed` from `offset` on."""
    if not isinstance(listed, list):
        raise ValueError("a tensor list that is not a list")
    tensors: list[torch.Tensor | None] = []
    for entry in listed:
        if entry is None:
            tensors.append(None)
            continue
        name, shape = entry
        if not isinstance(shape, list) or not all(isinstance(size, int) and not isinstance(size, bool) and size >= 0
                                                  for size in shape):
            raise ValueError(f"a tensor of shape {shape!r}")
        dtype = torch_dtype(name)
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > packed.numel():
            raise ValueError("shorter than the tensors its header lists")
        tensors.append(packed[offset:offset + nbytes].view(dtype).view(shape))
        offset += _padded(nbytes)
    return tensors


def _message(cls: type[Message], fields: Any, tensors: list[torch.Tensor | None]) -> Message:
    """A `cls` of the header's `fields` and the `tensors` that followed it, each checked against the class."""
    values = _object(cls, fields, "fields")
    _, tensor_fields = _attributes(cls)
    if len(tensors) != len(tensor_fields):
        raise ValueError(f"{len(tensors)} tensors for a {cls.kind} message, which has {len(tensor_fields)}")
    for field, tensor in zip(tensor_fields, tensors, strict=True):
        if tensor is None and field.type is torch.Tensor:
            raise ValueError(f"no tensor for a {cls.kind} message's {field.name}")
        values[field.name] = tensor
    return cls(**values)


def _attributes(cls: type) -> tuple[tuple[attrs.Attribute[Any], ...], tuple[attrs.Attribute[Any], ...]]:
    """A class's attributes that travel in the header, and its tensors (in its order), their types resolved."""
    if cls not in _LAYOUTS:
        attrs.resolve_types(cls)
        every = attrs.fields(cls)
        tensors = tuple(field for field in every if field.type in (torch.Tensor, torch.Tensor | None))
        _LAYOUTS[cls] = tuple(field for field in every if field not in tensors), tensors
    return _LAYOUTS[cls]


def _object(cls: type, value: Any, where: str) -> dict[str, Any]:
    """The checked attributes of a `cls` given as a JSON object: every one it has, and no other."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {_shown(value)} where an object was due")
    fields, _ = _attributes(cls)
    names = {field.name for field in fields}
    if set(value) != names:
        missing, extra = sorted(names - set(value)), sorted(set(value) - names)
        raise ValueError(f"{where} of a {cls.__name__}: missing {missing}, unknown {extra}"[:200])
    return {field.name: _checked(value[field.name], field.type, f"{where}.{field.name}") for field in fields}


def _checked(value: Any, kind: Any, where: str) -> Any:
    """`value` (from JSON) as a `kind`: a value class, a list, tuple or map of them, or a JSON scalar (`Any`: as it
    came); ValueError, saying `where`, if it is not one."""
    if kind is Any:
        return value
    if attrs.has(kind):
        return kind(**_object(kind, value, where))
    origin, arguments = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in arguments:
            return None
        (other,) = [argument for argument in arguments if argument is not type(None)]
        return _checked(value, other, where)
    if origin is list:
        return [_checked(item, arguments[0], f"{where}[{index}]") for index, item in enumerate(_list(value, where))]
    if origin is tuple:
        items = _list(value, where)
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            return tuple(_checked(item, arguments[0], f"{where}[{index}]") for index, item in enumerate(items))
        if len(items) != len(arguments):
            raise ValueError(f"{where}: {len(items)} items where {len(arguments)} were due")
        return tuple(_checked(item, argument, f"{where}[{index}]")
                     for index, (item, argument) in enumerate(zip(items, arguments, strict=True)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {_shown(value)} where an object was due")
        key_kind, item_kind = arguments
        return {_key(key, key_kind, where): _checked(item, item_kind, f"{where}[{key!r}]")
                for key, item in value.items()}
    return _scalar(value, kind, where)


_SCALARS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", type(None): "null"}


def _scalar(value: Any, kind: Any, where: str) -> Any:
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, str):
        return value
    if kind is type(None) and value is None:
        return None
    raise ValueError(f"{where}: {_shown(value)} where {_SCALARS.get(kind, kind)} was due")


def _key(key: str, kind: Any, where: str) -> Any:
    """A map's key as a `kind`: a string, or an integer written in decimal."""
    if kind is int:
        try:
            number = int(key)
        except ValueError:
            number = None
        if number is None or str(number) != key:
            raise ValueError(f"{where}: a key {key[:32]!r} where an integer was due")
        return number
    return key


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: {_shown(value)} where a list was due")
    return value


def _shown(value: Any) -> str:
    return repr(value)[:64]


def _plain(value: Any) -> Any:
    """A header field's value as JSON holds it: value classes as objects, integer keys as strings."""
    if attrs.has(type(value)):
        return {field.name: _plain(getattr(value, field.name)) for field in attrs.fields(type(value))}
    if isinstance(value, dict):
        return {str(key) if isinstance(key, int) else key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _padded(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN
