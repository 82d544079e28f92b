"""The wire format shared by the tcp, ucx and nccl/gloo transports, over any `Channel`.

A message is at most four sends, always in this order:

    control   magic "DJVT" | version u8 | op u8 | status u16 | meta length u32 | header length u32 |
              payload length u64 | XXH3-64 of the preceding 24 bytes, the metadata and the header, u64
    head      the metadata (utf-8: a block name, a list of names, an error) then a block record's header
    payload   the record's payload, in `channel.chunk_size` pieces
    trailer   u64: for a block record, its own checksum (header and payload, see `dejavu_sdk.codec`);
              for an opaque record (header length 0), XXH3-64 of the payload

Sizes always follow from the control frame, so message-oriented channels (UCX, torch.distributed),
whose receives must match sends, work exactly like a byte stream. On a byte stream a small message
(a decode step's block, a reply) goes out in one send: one system call and one segment instead of four.
Each payload piece is hashed once, on each side, while it is in cache. A block record keeps its own
checksum end to end: a server stores the bytes it verified, and a client fetching them verifies them
again as they arrive.
"""

from __future__ import annotations

import enum
import struct
from abc import ABC, abstractmethod
from typing import Any

import attrs
import numpy as np

from ..codec import MAX_HEADER_BYTES, TRAILER, RecordHeader, corrupt, flat_bytes, new_checksum
from ..errors import TransportError

MAGIC = b"DJVT"
PROTOCOL_VERSION = 1
CONTROL = struct.Struct("<4sBBHIIQQ")
_UNCHECKED = CONTROL.size - 8
MAX_RECORD_BYTES = 4 << 30
MERGED_PAYLOAD_BYTES = 256 << 10  # on byte streams, messages with payloads up to this go out in one send
#: The most bytes a HELLO (control frame, version and token) may take; more is no HELLO.
HELLO_BYTES = 64 << 10


class Op(enum.IntEnum):
    HELLO = 1
    PUT = 2
    GET = 3
    LIST = 4
    REMOVE = 5
    TENSOR = 6
    REPLY = 7
    PUT_RECORDS = 8  # encoded records as opaque bytes, stored exactly as sent; meta: "size name" per line
    POST = 9  # a tensor for the inbox, not answered when taken (a refusal closes the connection)


class Status(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    CORRUPT = 2
    BAD_REQUEST = 3
    FAILED = 4
    DENIED = 5  # no token, a wrong one, or a name outside the token's streams
    BUSY = 6  # too many connections, or the inbox is full or closed to tensors


class ProtocolError(TransportError):
    """The peer sent something that is not a valid message; the channel cannot be trusted any more."""


class PeerClosed(TransportError):
    """The peer closed the channel."""


class IdleTimeout(TransportError):
    """No message began within the channel's idle timeout."""


class NotSent(TransportError):
    """A message's first send found the channel closed by the peer: the peer cannot have acted on it."""


@attrs.frozen
class Limits:
    """The largest message parts a receiver accepts before allocating anything."""

    max_record_bytes: int = MAX_RECORD_BYTES
    max_meta_bytes: int = 64 << 20


class Channel(ABC):
    """An ordered, reliable link to one peer. Each `recv_into` fills exactly one buffer, matching one `send`
    of the same total size on the other side (byte streams trivially do)."""

    #: Largest payload piece per send; byte streams use small pieces so each is hashed while in cache.
    chunk_size: int = 1 << 20
    #: True for byte streams (TCP): a small message's parts may then go out in one send, since the
    #: receiver reads exact sizes anyway. Message channels (UCX, torch.distributed) keep one send per part.
    byte_stream: bool = False
    peer: str = "?"

    @abstractmethod
    def send(self, *buffers: Any) -> None:
        """Send the buffers as one message; TransportError if the peer is gone or the send times out."""

    @abstractmethod
    def recv_into(self, buffer: np.ndarray, idle: bool = False) -> None:
        """Fill `buffer`; PeerClosed on a clean close, TransportError on failure or timeout.
        `idle=True` waits for the first byte of a message with the idle timeout instead (a server waiting
        for its next request), IdleTimeout when it passes; the message's deadline starts with that byte."""

    def start_deadline(self) -> None:  # noqa: B027 - optional: channels whose every call is bounded need none
        """Start the deadline of one message: the rest of it must be sent or received within the timeout."""

    def set_idle_timeout(self, seconds: float | None) -> None:  # noqa: B027 - optional, as above
        """How long `recv_into(idle=True)` waits for a message's first byte from now on (None: forever);
        channels whose links fix their waits when they form (torch.distributed) keep theirs."""

    def closed_by_peer(self) -> bool:
        """Whether the peer has already closed this channel, between requests (an idle timeout): a client
        then opens a new one instead of sending into a dead one. Channels that cannot tell say False."""
        return False

    @abstractmethod
    def close(self) -> None:
        """Release the link; the peer sees it closed."""


def one_array(buffers: tuple[Any, ...]) -> np.ndarray:
    """The buffers of one send as a single writable uint8 array (copied only when they must be)."""
    if len(buffers) == 1:
        array = np.frombuffer(buffers[0], dtype=np.uint8)
        return array if array.flags.writeable else array.copy()
    return np.frombuffer(b"".join(bytes(buffer) for buffer in buffers), dtype=np.uint8).copy()


@attrs.frozen
class OutgoingRecord:
    """A record to send: header bytes (empty for opaque bytes), payload and, if already known, its trailer."""

    header: bytes | np.ndarray
    payload: np.ndarray
    trailer: bytes | np.ndarray | None = None

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
        """Send an encoded record as it is stored, trailer included (it is checked by the receiver)."""
        data = np.frombuffer(record, dtype=np.uint8)
        header = RecordHeader.unpack(data, label)  # CorruptBlock if the stored header is damaged
        if data.size != header.record_length:
            raise corrupt(label, f"{data.size} bytes where the header promises {header.record_length}")
        end = data.size - TRAILER.size
        return cls(data[:header.length], data[header.length:end], data[end:])

    @classmethod
    def opaque(cls, data: Any) -> OutgoingRecord:
        """Bytes the receiver stores without parsing (a record as some store holds it, damage and all)."""
        return cls(b"", np.frombuffer(data, dtype=np.uint8))


def send_message(channel: Channel, op: Op, *, status: Status = Status.OK, meta: bytes = b"",
                 record: OutgoingRecord | None = None) -> None:
    """Send one message, all of it within the channel's timeout; a record's payload is streamed and hashed
    chunk by chunk."""
    channel.start_deadline()
    header = bytes(record.header) if record is not None else b""
    payload = record.payload if record is not None else np.empty(0, np.uint8)
    if channel.byte_stream and payload.size <= MERGED_PAYLOAD_BYTES:  # one system call, one segment
        _first_send(channel, *message_parts(op, status=status, meta=meta, record=record))
        return
    _first_send(channel, _control(op, status, meta, header, payload.size))
    if meta or header:
        channel.send(meta, header)
    if record is None:
        return
    trailer = bytes(record.trailer) if record.trailer is not None else None  # None: hashed as the payload goes
    payload_checksum = new_checksum() if trailer is None else None
    if payload_checksum is not None and header:
        payload_checksum.update(header)
    step = channel.chunk_size
    for start in range(0, payload.size, step):
        piece = payload[start:start + step]
        channel.send(piece)
        if payload_checksum is not None:
            payload_checksum.update(piece)  # after the send, which left the piece in cache
    if payload_checksum is not None:
        trailer = TRAILER.pack(payload_checksum.intdigest())
    channel.send(trailer)


def message_parts(op: Op, *, status: Status = Status.OK, meta: bytes = b"",
                  record: OutgoingRecord | None = None) -> list[bytes | np.ndarray]:
    """One message as the non-empty buffers a byte stream sends, in order (a record's trailer computed here
    when it does not come with the record): for a sender that writes them out as the socket takes them."""
    header = bytes(record.header) if record is not None else b""
    payload_length = 0 if record is None else record.payload.size
    parts: list[bytes | np.ndarray] = [_control(op, status, meta, header, payload_length), meta, header]
    if record is not None:
        trailer = bytes(record.trailer) if record.trailer is not None else _trailer(header, record.payload)
        parts += [record.payload, trailer]
    return [part for part in parts if len(part)]


def _control(op: Op, status: Status, meta: bytes, header: bytes, payload_length: int) -> bytes:
    """The control frame of a message, its checksum over itself, the metadata and the header."""
    unchecked = CONTROL.pack(MAGIC, PROTOCOL_VERSION, op, status, len(meta), len(header), payload_length, 0)
    checksum = new_checksum()
    for part in (unchecked[:_UNCHECKED], meta, header):
        checksum.update(part)
    return unchecked[:_UNCHECKED] + struct.pack("<Q", checksum.intdigest())


def _first_send(channel: Channel, *buffers: Any) -> None:
    try:
        channel.send(*buffers)
    except PeerClosed as error:  # closed, not slow: a peer that hangs is no reason to send again
        raise NotSent(str(error)) from error


def _trailer(header: bytes, payload: np.ndarray) -> bytes:
    checksum = new_checksum()
    checksum.update(header)
    checksum.update(payload)
    return TRAILER.pack(checksum.intdigest())


@attrs.frozen
class Message:
    """A received control frame and head; a record's payload is still to be read with `recv_payload`."""

    op: Op
    status: Status
    meta: bytes
    header: RecordHeader | None
    header_bytes: np.ndarray
    payload_length: int

    @property
    def text(self) -> str:
        return self.meta.decode(errors="replace")

    @property
    def has_record(self) -> bool:
        return self.header is not None or self.payload_length > 0


def recv_message(channel: Channel, limits: Limits, idle: bool = False) -> Message:
    """Receive the control frame and head of the next message; ProtocolError if they are not valid.
    The whole message must arrive within the channel's timeout, from its first byte (`idle`) or from now."""
    if not idle:
        channel.start_deadline()
    control = np.empty(CONTROL.size, dtype=np.uint8)
    channel.recv_into(control, idle=idle)
    magic, version, op, status, meta_length, header_length, payload_length, expected = CONTROL.unpack(
        control.tobytes())
    if magic != MAGIC:
        raise ProtocolError(f"{channel.peer} sent a frame that does not start with {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"{channel.peer} speaks protocol version {version}, this SDK {PROTOCOL_VERSION}")
    if meta_length > limits.max_meta_bytes or header_length > MAX_HEADER_BYTES \
            or payload_length > limits.max_record_bytes:
        raise ProtocolError(f"{channel.peer} sent a frame of {meta_length} + {header_length} + {payload_length} "
                            f"bytes, over the limit of {limits.max_meta_bytes} + {MAX_HEADER_BYTES} + "
                            f"{limits.max_record_bytes}")
    head = np.empty(meta_length + header_length, dtype=np.uint8)
    if head.size:
        channel.recv_into(head)
    checksum = new_checksum()
    checksum.update(control[:_UNCHECKED])
    checksum.update(head)
    if checksum.intdigest() != expected:
        raise ProtocolError(f"{channel.peer} sent a control frame that fails its checksum")
    try:
        kind, state = Op(op), Status(status)
    except ValueError:
        raise ProtocolError(f"{channel.peer} sent unknown op {op} or status {status}") from None
    header_bytes = head[meta_length:]
    header = None
    if header_length:
        header = RecordHeader.unpack(header_bytes, "from " + channel.peer)
        if header.length != header_length or header.payload_length != payload_length:
            raise ProtocolError(f"{channel.peer} sent a record header that does not match its frame")
    return Message(kind, state, head[:meta_length].tobytes(), header, header_bytes, payload_length)


def discard_payload(channel: Channel, message: Message) -> None:
    """Read and drop the payload and trailer `message` announced, so the channel stays in step."""
    step = channel.chunk_size
    scratch = np.empty(min(step, message.payload_length), dtype=np.uint8)
    for start in range(0, message.payload_length, step):
        channel.recv_into(scratch[:min(step, message.payload_length - start)])
    channel.recv_into(np.empty(TRAILER.size, dtype=np.uint8))


def recv_payload(channel: Channel, message: Message, target: np.ndarray) -> tuple[bool, bytes]:
    """Receive the payload `message` announced into `target`, then its trailer.

    Returns whether the checksum holds (over header and payload for a block record, the payload alone
    for an opaque one) and the trailer as received.
    """
    checksum = new_checksum()
    if message.header is not None:
        checksum.update(message.header_bytes)
    step = channel.chunk_size
    target = target[:message.payload_length]
    for start in range(0, message.payload_length, step):
        piece = target[start:start + step]
        channel.recv_into(piece)
        checksum.update(piece)
    trailer = np.empty(TRAILER.size, dtype=np.uint8)
    channel.recv_into(trailer)
    return checksum.intdigest() == TRAILER.unpack(trailer.tobytes())[0], trailer.tobytes()
