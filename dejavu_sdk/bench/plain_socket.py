"""The plain-socket ceiling for `dejavu bench transports`: the least work a TCP transfer can be.

Bytes move in 1 MiB sends and receives, the fastest way found for loopback TCP here.

Run as a child process (`python -m dejavu_sdk.bench.plain_socket`); it prints its port and serves one
connection. Each command is one byte and a u64 size:
    R  receive `size` bytes into one reused buffer (then ack 1 byte)
    V  the same, then hash them with XXH3-64 before the ack (as a receiver verifying a checksum must)
    S  send `size` bytes from one buffer
    E  receive `size` bytes, and send them back (a round trip)
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys

import numpy as np
import xxhash

COMMAND = struct.Struct("<cQ")


PIECE = 1 << 20  # loopback TCP moves 1 MiB sends faster than one huge send (measured: 3.4 vs 2.5 GB/s)


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    received = 0
    while received < view.nbytes:
        count = sock.recv_into(view[received:received + PIECE])
        if count == 0:
            raise ConnectionError("peer closed")
        received += count


def _send_in_pieces(sock: socket.socket, view: memoryview) -> None:
    for start in range(0, view.nbytes, PIECE):
        sock.sendall(view[start:start + PIECE])


def serve_one_connection() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        print(listener.getsockname()[1], flush=True)
        connection, _ = listener.accept()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reused = np.empty(0, np.uint8)
    command = bytearray(COMMAND.size)
    with connection:
        while True:
            try:
                _recv_exactly(connection, memoryview(command))
            except ConnectionError:
                return
            kind, size = COMMAND.unpack(command)
            if reused.size < size:
                reused = np.ones(size, np.uint8)
            if kind in (b"R", b"V"):
                _recv_exactly(connection, reused.data[:size])
                if kind == b"V":
                    xxhash.xxh3_64_intdigest(reused.data[:size])
                connection.sendall(b"k")
            elif kind == b"E":
                _recv_exactly(connection, reused.data[:size])
                _send_in_pieces(connection, reused.data[:size])
            else:
                _send_in_pieces(connection, reused.data[:size])


class PlainSocketPeer:
    """Starts the child and speaks to it: `send` a block to it, `receive` one from it."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "dejavu_sdk.bench.plain_socket"],
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None  # a pipe: stdout=PIPE
        port = int(self.process.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._ack = bytearray(1)
        self._echoed = np.empty(0, np.uint8)

    def send(self, block: np.ndarray, checksums: bool = False) -> None:
        """Send `block`; with `checksums`, hash it first and have the child hash what it received."""
        if checksums:
            xxhash.xxh3_64_intdigest(block.data)
        self.sock.sendall(COMMAND.pack(b"V" if checksums else b"R", block.size))
        _send_in_pieces(self.sock, block.data)
        _recv_exactly(self.sock, memoryview(self._ack))

    def receive(self, out: np.ndarray) -> None:
        self.sock.sendall(COMMAND.pack(b"S", out.size))
        _recv_exactly(self.sock, out.data)

    def echo(self, block: np.ndarray) -> None:
        """Send `block` and receive it back into a buffer of its size (a round trip)."""
        if self._echoed.size != block.size:
            self._echoed = np.empty(block.size, np.uint8)
        self.sock.sendall(COMMAND.pack(b"E", block.size))
        _send_in_pieces(self.sock, block.data)
        _recv_exactly(self.sock, self._echoed.data)

    def close(self) -> None:
        self.sock.close()
        self.process.wait(timeout=30)


if __name__ == "__main__":
    serve_one_connection()
