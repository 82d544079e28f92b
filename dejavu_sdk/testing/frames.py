"""Wire messages as bytes, for tests that speak to a server over a plain socket (garbage, trickles, stalls)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..transports.wire import Channel, Op, OutgoingRecord, send_message


class RecordingChannel(Channel):
    """A channel that keeps what would be sent: a well-formed message, to replay whole or in part."""

    def __init__(self) -> None:
        self.sent = bytearray()

    def send(self, *buffers: Any) -> None:
        for buffer in buffers:
            self.sent += bytes(buffer)

    def recv_into(self, buffer: np.ndarray, idle: bool = False) -> None:
        raise AssertionError("a recording channel receives nothing")

    def close(self) -> None:
        pass


def frame(op: Op, meta: bytes = b"", record: OutgoingRecord | None = None) -> bytes:
    """One message, as a client would send it."""
    recording = RecordingChannel()
    send_message(recording, op, meta=meta, record=record)
    return bytes(recording.sent)


#: The HELLO that opens every connection (no token).
HELLO = frame(Op.HELLO, b"dejavu-sdk")
