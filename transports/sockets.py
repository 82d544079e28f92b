"""The channel over a TCP socket (TLS optional) that `tcp://` clients and servers use, and their TLS contexts.

Sends go out from the tensor's own memory (`sendall` on memoryviews); receives land in preallocated
buffers (`recv_into`), in 1 MiB pieces hashed while in cache; a small message arrives in one system call
(read ahead into a buffer of the connection's, then copied). Every message has a deadline: a peer that
dies gives `TransportError` at once (connection reset or EOF), one that hangs or trickles when the
timeout ends. TLS uses the standard library's `ssl`.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import time
from typing import Any

import numpy as np

from ..errors import ConfigError, TransportError
from .wire import MERGED_PAYLOAD_BYTES, Channel, IdleTimeout, PeerClosed

#: Receives shorter than this read whatever has arrived into a buffer of this size, so that a small
#: message (control frame, head, payload, trailer) costs one system call instead of four.
READ_AHEAD_BYTES = 256 << 10


def _send_all(sock: socket.socket, views: list[memoryview]) -> None:
    """`sendall` for several buffers: `sendmsg` until every byte is out."""
    while views:
        _advance(views, sock.sendmsg(views))


def _readable_now(sock: socket.socket) -> bool:
    """Whether `sock` has bytes (or its peer's close) to read now. poll, where there is one: a server's
    descriptors pass select's FD_SETSIZE (1024), and select would fail on them."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([sock], [], [], 0)[0])


def _advance(views: list[memoryview], sent: int) -> None:
    """Drop the first `sent` bytes of `views`, which went out."""
    while views and sent >= views[0].nbytes:
        sent -= views[0].nbytes
        views.pop(0)
    if views and sent:
        views[0] = views[0][sent:]


class SocketChannel(Channel):
    """A connected TCP (or TLS) socket. Each message must be sent or received whole within `timeout`
    (None: no limit); a server waits `idle_timeout` for the next message to begin (None: forever).

    A client's read-ahead buffer is made on its first small receive; a server's workers lend theirs while
    they serve a connection (`lend_read_ahead`), so that a connection between requests costs no buffer.
    """

    chunk_size = 1 << 20
    byte_stream = True

    def __init__(self, sock: socket.socket, peer: str, timeout: float | None,
                 idle_timeout: float | None = None) -> None:
        self._sock = sock
        self.peer = peer
        self._timeout, self._idle_timeout = timeout, idle_timeout
        self._deadline: float | None = None
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._ahead: memoryview | None = None  # bytes received beyond the last buffer filled
        self._ahead_start = self._ahead_end = 0
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def start_deadline(self) -> None:
        self._deadline = None if self._timeout is None else time.monotonic() + self._timeout

    def _remaining(self) -> float | None:
        """Seconds left of this message's deadline; TimeoutError once it has passed."""
        if self._deadline is None:
            return None
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left

    def set_idle_timeout(self, seconds: float | None) -> None:
        self._idle_timeout = seconds

    def closed_by_peer(self) -> bool:
        # Between requests the server sends nothing: readable means its close (or a protocol error), except
        # on TLS, where the socket may hold protocol records (session tickets) that carry no data.
        try:
            if self._ahead_end > self._ahead_start:
                return True  # the server sent something unasked: its close reply, or a protocol error
            if not _readable_now(self._sock):
                return False
            if not self._tls:
                return True
            self._sock.setblocking(False)
            try:
                self._sock.recv(1)
            except ssl.SSLWantReadError:
                return False
            return True
        except (OSError, ValueError):
            return True

    def send(self, *buffers: Any) -> None:
        try:
            self._sock.settimeout(self._remaining())
            if len(buffers) == 1:
                self._sock.sendall(buffers[0])
            elif self._tls:  # TLS sockets have no sendmsg: one joined buffer (small parts only)
                self._sock.sendall(b"".join(bytes(buffer) for buffer in buffers))
            else:  # small parts: one segment, one system call, no copy
                _send_all(self._sock, [memoryview(buffer).cast("B") for buffer in buffers])
        except TimeoutError:
            raise TransportError(f"sending to {self.peer} took longer than {self._timeout} s") from None
        except (BrokenPipeError, ConnectionResetError) as error:
            raise PeerClosed(f"{self.peer} closed the connection: {error}") from error
        except OSError as error:
            raise TransportError(f"sending to {self.peer} failed: {error}") from error

    def recv_into(self, buffer: np.ndarray, idle: bool = False) -> None:
        view = buffer.data.cast("B")
        received = self._take_ahead(view)
        waiting = idle and not received  # for the first byte of a message, with the idle timeout
        if idle and received:
            self.start_deadline()
        while received < view.nbytes:
            missing = view.nbytes - received
            small = missing < READ_AHEAD_BYTES  # read ahead: the rest of a small message comes in this call
            if small and self._ahead is None:
                self._ahead = memoryview(bytearray(READ_AHEAD_BYTES))
            try:
                self._sock.settimeout(self._idle_timeout if waiting else self._remaining())
                count = self._sock.recv_into(self._ahead if small and self._ahead is not None else view[received:])
            except TimeoutError:
                if waiting:
                    raise IdleTimeout(f"{self.peer} sent nothing for {self._idle_timeout} s") from None
                raise TransportError(f"{self.peer} took longer than {self._timeout} s to send a message") from None
            except OSError as error:
                raise TransportError(f"receiving from {self.peer} failed: {error}") from error
            if count == 0:
                if waiting:
                    raise PeerClosed(f"{self.peer} closed the connection")
                raise TransportError(f"{self.peer} closed the connection mid-message")
            if waiting:
                waiting = False
                self.start_deadline()  # the rest of the message must follow within the timeout
            if small:
                self._ahead_start, self._ahead_end = 0, count
                count = self._take_ahead(view[received:])
            received += count

    def _take_ahead(self, view: memoryview) -> int:
        """Copy bytes read ahead into the start of `view`; how many."""
        count = min(self._ahead_end - self._ahead_start, view.nbytes)
        if count and self._ahead is not None:
            view[:count] = self._ahead[self._ahead_start:self._ahead_start + count]
            self._ahead_start += count
        return count

    def buffered(self) -> bool:
        """Whether bytes of a next message were already received (read ahead, or held by TLS): a server then
        serves it at once instead of waiting for the socket to become readable again."""
        if self._ahead_end > self._ahead_start:
            return True
        return self._tls and self._sock.pending() > 0  # type: ignore[attr-defined]

    def prefill(self, data: bytes) -> None:
        """Bytes received before this channel existed (after a HELLO read elsewhere): the next to be read."""
        self._ahead = memoryview(bytearray(data)) if data else None
        self._ahead_start, self._ahead_end = 0, len(data)

    def lend_read_ahead(self, buffer: memoryview) -> None:
        """Read ahead into `buffer` (a server worker's, `READ_AHEAD_BYTES` long) until `keep_unread`; bytes
        received and not yet read move into it."""
        unread = self._unread()
        buffer[:len(unread)] = unread
        self._ahead, self._ahead_start, self._ahead_end = buffer, 0, len(unread)

    def keep_unread(self) -> None:
        """Stop using a lent buffer: bytes received and not yet read stay with the channel, in a buffer of
        just their size (an idle server connection holds none)."""
        self.prefill(self._unread())

    def _unread(self) -> bytes:
        if self._ahead is None:
            return b""
        return bytes(self._ahead[self._ahead_start:self._ahead_end])

    def send_within(self, views: list[memoryview], seconds: float) -> list[memoryview]:
        """Send as much of `views` as the socket takes within `seconds` (0: without waiting); what is left."""
        deadline = time.monotonic() + seconds
        if self._tls and len(views) > 1 and sum(view.nbytes for view in views) <= MERGED_PAYLOAD_BYTES:
            views = [memoryview(b"".join(views))]  # one TLS record, one system call
        try:
            while views:
                self._sock.settimeout(max(0.0, deadline - time.monotonic()) if seconds else 0.0)
                # TLS sockets have no sendmsg; large views go 1 MiB at a time, as `send` sends them
                _advance(views, self._sock.send(views[0][:self.chunk_size])
                         if self._tls or views[0].nbytes > self.chunk_size else self._sock.sendmsg(views[:64]))
        except (BlockingIOError, TimeoutError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            return views
        except (BrokenPipeError, ConnectionResetError) as error:
            raise PeerClosed(f"{self.peer} closed the connection: {error}") from error
        except OSError as error:
            raise TransportError(f"sending to {self.peer} failed: {error}") from error
        return views

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()


def server_tls_context(cert: str, key: str) -> ssl.SSLContext:
    """A server-side TLS context for the PEM certificate chain `cert` and its private key `key`."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as error:
        raise ConfigError(f"cannot load the TLS certificate {cert!r} and key {key!r}: {error}") from error
    return context


def client_tls_context(ca: str | None) -> ssl.SSLContext:
    """A client-side TLS context that verifies the server: against `ca` (a PEM file) or the system's CAs."""
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as error:
        raise ConfigError(f"cannot load the CA file {ca!r}: {error}") from error
