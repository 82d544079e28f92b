"""The wire format shared by the tcp, ucx and nccl/gloo transports, over any `Channel`.

A message is a control frame, optional metadata, and an optional record:

    control  magic "DJVT" | version u8 | op u8 | status u16 | meta length u32 | record length u64 |
             XXH3-64 of the preceding 20 bytes and the metadata, u64
    meta     utf-8: a block name, a list of names, or an error message
    record   a block record (see `dejavu_sdk.codec`), sent as: fixed header | rest of the header |
             payload chunks | record trailer, then a frame trailer: XXH3-64 of the record bytes as sent
             (PUT_RECORD sends its record as opaque chunks and the frame trailer, unparsed)

Both ends cut a record into the same pieces, so message-oriented channels (UCX, torch.distributed),
whose receives must match sends, work exactly like a byte stream. Every chunk is hashed while in cache.
The frame trailer proves the bytes crossed intact; the record's own checksum is verified end to end by
whoever decodes the block, so a store behind a server keeps records exactly as they were sent.
"""

from __future__ import annotations

import enum
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from ..codec import FIXED, TRAILER, RecordHeader, corrupt, flat_bytes, new_checksum
from ..errors import TransportError

MAGIC = b"DJVT"
PROTOCOL_VERSION = 1
CONTROL = struct.Struct("<4sBBHIQQ")
_UNCHECKED = CONTROL.size - 8


class Op(enum.IntEnum):
    HELLO = 1
    PUT = 2
    GET = 3
    LIST = 4
    REMOVE = 5
    TENSOR = 6
    REPLY = 7
    PUT_RECORD = 8  # an encoded record as opaque bytes, stored exactly as sent


class Status(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    CORRUPT = 2
    BAD_REQUEST = 3
    FAILED = 4


class ProtocolError(TransportError):
    """The peer sent something that is not a valid message; the channel cannot be trusted any more."""


class PeerClosed(TransportError):
    """The peer closed the channel."""


MAX_RECORD_BYTES = 4 << 30


@attrs.frozen
class Limits:
    """The largest message parts a receiver accepts before allocating anything."""

    max_record_bytes: int = MAX_RECORD_BYTES
    max_meta_bytes: int = 64 << 20


class Channel(ABC):
    """An ordered, reliable link to one peer. Each `recv_into` fills exactly one buffer, matching one `send`
    of the same size on the other side (byte streams trivially do)."""

    #: Largest payload piece per send; byte streams use small pieces so each is hashed while in cache.
    chunk_size: int = 1 << 20
    peer: str = "?"

    @abstractmethod
    def send(self, buffer: Any) -> None:
        """Send a contiguous buffer; TransportError if the peer is gone or the send times out."""

    @abstractmethod
    def recv_into(self, buffer: np.ndarray, idle: bool = False) -> None:
        """Fill `buffer`; PeerClosed on a clean close, TransportError on failure or timeout.
        `idle=True` waits without the timeout (a server waiting for its next request)."""

    @abstractmethod
    def close(self) -> None:
        """Release the link; the peer sees it closed."""


@attrs.frozen
class Message:
    op: Op
    status: Status
    meta: bytes
    record_length: int

    @property
    def text(self) -> str:
        return self.meta.decode(errors="replace")


@attrs.frozen
class OutgoingRecord:
    """A record to send: its header bytes, payload bytes and, if already known, its trailer.

    An opaque record (`header` empty) is sent as bytes the receiver does not parse.
    """

    header: bytes | np.ndarray
    payload: np.ndarray
    trailer: bytes | np.ndarray | None = None

    @property
    def opaque(self) -> bool:
        return len(self.header) == 0

    @property
    def length(self) -> int:
        return self.payload.size if self.opaque else len(self.header) + self.payload.size + TRAILER.size

    @classmethod
    def raw(cls, data: Any) -> OutgoingRecord:
        return cls(b"", np.frombuffer(data, dtype=np.uint8))

    @classmethod
    def from_block(cls, label: str, block: Any) -> OutgoingRecord:
        """Stream a tensor, array or buffer straight from its memory (a host copy only if it must)."""
        name, shape, write_payload, flat = flat_bytes(block)
        header = RecordHeader(label, name, tuple(shape))
        if flat is None:
            flat = np.empty(header.payload_length, np.uint8)
            write_payload(flat)
        return cls(header.pack(), flat)

    @classmethod
    def from_record(cls, record: Any, label: str) -> OutgoingRecord:
        """Send an encoded record as it is stored (its trailer included, damage and all)."""
        data = np.frombuffer(record, dtype=np.uint8)
        header = RecordHeader.unpack(data, label)  # CorruptBlock if the stored header is damaged
        if data.size != header.record_length:
            raise corrupt(label, f"{data.size} bytes where the header promises {header.record_length}")
        end = data.size - TRAILER.size
        return cls(data[:header.length], data[header.length:end], data[end:])


def send_message(channel: Channel, op: Op, *, status: Status = Status.OK, meta: bytes = b"",
                 record: OutgoingRecord | None = None) -> None:
    """Send one message; the record, if any, is streamed chunk by chunk."""
    length = record.length if record is not None else 0
    unchecked = CONTROL.pack(MAGIC, PROTOCOL_VERSION, op, status, len(meta), length, 0)[:_UNCHECKED]
    checksum = new_checksum()
    checksum.update(unchecked)
    checksum.update(meta)
    channel.send(unchecked + struct.pack("<Q", checksum.intdigest()))
    if meta:
        channel.send(meta)
    if record is not None:
        _send_record(channel, record)


def _send_record(channel: Channel, record: OutgoingRecord) -> None:
    frame = new_checksum()
    if record.opaque:
        _send_chunks(channel, record.payload, frame)
        channel.send(TRAILER.pack(frame.intdigest()))
        return
    header = np.frombuffer(record.header, dtype=np.uint8)
    own = new_checksum() if record.trailer is None else None
    for piece in (header[:FIXED.size], header[FIXED.size:]):
        frame.update(piece)
        channel.send(piece)
    if own is not None:
        own.update(header)
    _send_chunks(channel, record.payload, frame, own)
    trailer = TRAILER.pack(own.intdigest()) if own is not None else bytes(record.trailer)
    frame.update(trailer)
    channel.send(trailer)
    channel.send(TRAILER.pack(frame.intdigest()))


def _send_chunks(channel: Channel, payload: np.ndarray, *checksums: Any) -> None:
    step = channel.chunk_size
    for start in range(0, payload.size, step):
        piece = payload[start:start + step]
        for checksum in checksums:
            if checksum is not None:
                checksum.update(piece)
        channel.send(piece)


def recv_message(channel: Channel, limits: Limits, idle: bool = False) -> Message:
    """Receive the control frame and metadata of the next message; ProtocolError if it is not valid."""
    control = np.empty(CONTROL.size, dtype=np.uint8)
    channel.recv_into(control, idle=idle)
    magic, version, op, status, meta_length, record_length, expected = CONTROL.unpack(control.tobytes())
    if magic != MAGIC:
        raise ProtocolError(f"{channel.peer} sent a frame that does not start with {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"{channel.peer} speaks protocol version {version}, this SDK {PROTOCOL_VERSION}")
    if meta_length > limits.max_meta_bytes or record_length > limits.max_record_bytes:
        raise ProtocolError(
            f"{channel.peer} sent a frame of {meta_length} + {record_length} bytes, over the limit of "
            f"{limits.max_meta_bytes} + {limits.max_record_bytes}")
    meta = np.empty(meta_length, dtype=np.uint8)
    if meta_length:
        channel.recv_into(meta)
    checksum = new_checksum()
    checksum.update(control[:_UNCHECKED])
    checksum.update(meta)
    if checksum.intdigest() != expected:
        raise ProtocolError(f"{channel.peer} sent a control frame that fails its checksum")
    try:
        return Message(Op(op), Status(status), meta.tobytes(), record_length)
    except ValueError:
        raise ProtocolError(f"{channel.peer} sent unknown op {op} or status {status}") from None


@attrs.frozen
class ReceivedRecord:
    header: RecordHeader
    header_bytes: np.ndarray
    trailer: bytes
    intact: bool  # the record's own checksum holds

    def check_label(self, label: str) -> bool:
        return self.header.label == label


def recv_record(channel: Channel, message: Message, label: str,
                payload_target: Callable[[RecordHeader], np.ndarray]) -> ReceivedRecord:
    """Receive the record `message` announced, its payload into `payload_target(header)`.

    ProtocolError if the bytes were damaged in transit or do not add up; CorruptBlock if the header itself
    is damaged (the channel is out of step then and must be closed).
    """
    fixed = np.empty(FIXED.size, dtype=np.uint8)
    channel.recv_into(fixed)
    header_bytes = np.empty(RecordHeader.length_from_fixed(fixed, label), dtype=np.uint8)
    header_bytes[:FIXED.size] = fixed
    channel.recv_into(header_bytes[FIXED.size:])
    header = RecordHeader.unpack(header_bytes, label)
    if header.record_length != message.record_length:
        raise ProtocolError(f"{channel.peer} announced {message.record_length} record bytes but sent "
                            f"a header for {header.record_length}")
    frame, own = new_checksum(), new_checksum()
    frame.update(header_bytes)
    own.update(header_bytes)
    _recv_chunks(channel, payload_target(header)[:header.payload_length], frame, own)
    trailers = np.empty(2 * TRAILER.size, dtype=np.uint8)
    channel.recv_into(trailers[:TRAILER.size])
    channel.recv_into(trailers[TRAILER.size:])
    trailer = trailers[:TRAILER.size].tobytes()
    frame.update(trailer)
    if frame.intdigest() != TRAILER.unpack(trailers[TRAILER.size:].tobytes())[0]:
        raise ProtocolError(f"a record from {channel.peer} was damaged in transit (frame checksum mismatch)")
    return ReceivedRecord(header, header_bytes, trailer, own.intdigest() == TRAILER.unpack(trailer)[0])


def recv_opaque(channel: Channel, message: Message, target: np.ndarray) -> None:
    """Receive an opaque record into `target` (of `message.record_length` bytes); ProtocolError if damaged."""
    frame = new_checksum()
    _recv_chunks(channel, target, frame)
    trailer = np.empty(TRAILER.size, dtype=np.uint8)
    channel.recv_into(trailer)
    if frame.intdigest() != TRAILER.unpack(trailer.tobytes())[0]:
        raise ProtocolError(f"a record from {channel.peer} was damaged in transit (frame checksum mismatch)")


def _recv_chunks(channel: Channel, target: np.ndarray, *checksums: Any) -> None:
    step = channel.chunk_size
    for start in range(0, target.size, step):
        piece = target[start:start + step]
        channel.recv_into(piece)
        for checksum in checksums:
            checksum.update(piece)
