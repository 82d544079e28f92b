"""`tcp://host:port`: blocks over TCP sockets (TLS optional), received straight into their final buffers.

Sends go out from the tensor's own memory (`sendall` on memoryviews); receives land in preallocated
buffers (`recv_into`), in 1 MiB pieces hashed while in cache; a small message arrives in one system call
(read ahead into a per-connection buffer, then copied). Every message has a deadline: a peer that
dies gives `TransportError` at once (connection reset or EOF), one that hangs or trickles when the
timeout ends. `tls=True` (client) and `tls_cert`/`tls_key` (server) use the standard library's `ssl`.
"""

from __future__ import annotations

import contextlib
import functools
import select
import socket
import socketserver
import ssl
import threading
import time
from typing import Any

import numpy as np

from ..errors import AccessDenied, ConfigError, TransportError
from ..store import Store
from ..urls import join_host_port
from .channel import AddressedTransport, ChannelServer, ServerOptions
from .wire import Channel, IdleTimeout, PeerClosed

#: Connections the kernel queues before the server accepts them.
LISTEN_BACKLOG = 128
#: Receives shorter than this read whatever has arrived into a buffer of this size, so that a small
#: message (control frame, head, payload, trailer) costs one system call instead of four.
READ_AHEAD_BYTES = 256 << 10


def _send_all(sock: socket.socket, views: list[memoryview]) -> None:
    """`sendall` for several buffers: `sendmsg` until every byte is out."""
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


class SocketChannel(Channel):
    """A connected TCP (or TLS) socket. Each message must be sent or received whole within `timeout`
    (None: no limit); a server waits `idle_timeout` for the next message to begin (None: forever)."""

    chunk_size = 1 << 20
    byte_stream = True

    def __init__(self, sock: socket.socket, peer: str, timeout: float | None,
                 idle_timeout: float | None = None) -> None:
        self._sock = sock
        self.peer = peer
        self._timeout, self._idle_timeout = timeout, idle_timeout
        self._deadline: float | None = None
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._ahead = memoryview(bytearray(READ_AHEAD_BYTES))  # bytes received beyond the last buffer filled
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

    def closed_by_peer(self) -> bool:
        # Between requests the server sends nothing: readable means its close (or a protocol error), except
        # on TLS, where the socket may hold protocol records (session tickets) that carry no data.
        try:
            if self._ahead_end > self._ahead_start:
                return True  # the server sent something unasked: its close reply, or a protocol error
            readable, _, _ = select.select([self._sock], [], [], 0)
            if not readable:
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
            small = missing < self._ahead.nbytes  # read ahead: the rest of a small message comes in this call
            try:
                self._sock.settimeout(self._idle_timeout if waiting else self._remaining())
                count = self._sock.recv_into(self._ahead if small else view[received:])
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
        if count:
            view[:count] = self._ahead[self._ahead_start:self._ahead_start + count]
            self._ahead_start += count
        return count

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


class TcpServer(ChannelServer):
    """Serves a store on a TCP port, one thread per connection. Port 0 picks a free port (see `url`).

    With `options.tls_cert`, every connection is TLS; the handshake runs on the connection's own thread,
    bounded by the timeout, so a client that never finishes it holds nobody else up.
    """

    def __init__(self, store: Store, host: str = "127.0.0.1", port: int = 0, *, scheme: str = "tcp",
                 options: ServerOptions | None = None) -> None:
        settings = options or ServerOptions()
        super().__init__(store, settings)
        tls = None if settings.tls_cert is None or settings.tls_key is None else \
            server_tls_context(settings.tls_cert, settings.tls_key)
        channels: set[SocketChannel] = set()
        self._channels = channels
        serve_channel, log = self.serve_channel, self.log

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                peer = "tcp://" + join_host_port(*self.client_address[:2])
                sock = self.request
                if tls is not None:
                    try:
                        sock.settimeout(settings.timeout)
                        sock = tls.wrap_socket(sock, server_side=True)
                    except (OSError, ssl.SSLError) as error:
                        log.warning("TLS handshake with %s failed: %s", peer, error)
                        return
                channel = SocketChannel(sock, peer, settings.timeout, settings.idle_timeout)
                channels.add(channel)
                try:
                    serve_channel(channel)
                finally:
                    channels.discard(channel)

        server_class = _Ipv6Server if ":" in host else _Ipv4Server
        try:
            self._server = server_class((host, port), Handler)
        except OSError as error:
            raise TransportError(f"cannot listen on {scheme}://{join_host_port(host, port)}: {error}") from error
        self.url = f"{scheme}://{join_host_port(host, self._server.server_address[1])}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name=f"dejavu-serve {self.url}", daemon=True)
        self._thread.start()

    def _stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        for channel in list(self._channels):
            channel.close()
        self._thread.join(timeout=10)


class _Ipv4Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG


class _Ipv6Server(_Ipv4Server):
    address_family = socket.AF_INET6


class TcpTransport(AddressedTransport):
    """A connection to a `TcpServer`, reopened on the next call after any failure."""

    server_class = TcpServer
    supports_tls = True

    def _connect(self) -> Channel:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except OSError as error:
            raise TransportError(f"cannot connect to {self.url}: {error}") from error
        if self.tls:
            try:
                sock = self._client_tls.wrap_socket(sock, server_hostname=self.host)
            except ssl.SSLCertVerificationError as error:
                sock.close()
                raise AccessDenied(f"{self.url} did not prove who it is: {error.verify_message}") from error
            except (OSError, ssl.SSLError) as error:
                sock.close()
                raise TransportError(f"TLS with {self.url} failed: {error}") from error
        return SocketChannel(sock, self.url, self.timeout)

    @functools.cached_property
    def _client_tls(self) -> ssl.SSLContext:
        return client_tls_context(self.ca)
