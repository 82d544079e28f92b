"""`tcp://host:port`: blocks over plain TCP sockets, received straight into their final buffers.

Sends go out from the tensor's own memory (`sendall` on memoryviews); receives land in preallocated
buffers (`recv_into`), in 1 MiB pieces hashed while in cache. Every blocking call has a timeout: a peer
that dies gives `TransportError` at once (connection reset or EOF), one that hangs when the timeout ends.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
from typing import Any

import numpy as np

from ..errors import TransportError
from ..store import Store
from ..urls import join_host_port
from .base import SERVER_TIMEOUT
from .channel import AddressedTransport, ChannelServer
from .wire import MAX_RECORD_BYTES, Channel, PeerClosed


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
    """A connected TCP socket; `timeout` bounds every send and receive (None: wait forever)."""

    chunk_size = 1 << 20
    byte_stream = True

    def __init__(self, sock: socket.socket, peer: str, timeout: float | None) -> None:
        self._sock = sock
        self.peer = peer
        self._timeout = timeout
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, *buffers: Any) -> None:
        try:
            self._sock.settimeout(self._timeout)
            if len(buffers) == 1:
                self._sock.sendall(buffers[0])
            else:  # small parts: one segment, one system call, no copy
                _send_all(self._sock, [memoryview(buffer).cast("B") for buffer in buffers])
        except TimeoutError:
            raise TransportError(f"sending to {self.peer} timed out after {self._timeout} s") from None
        except OSError as error:
            raise TransportError(f"sending to {self.peer} failed: {error}") from error

    def recv_into(self, buffer: np.ndarray, idle: bool = False) -> None:
        view = buffer.data.cast("B")
        received = 0
        self._sock.settimeout(None if idle else self._timeout)
        while received < view.nbytes:
            try:
                count = self._sock.recv_into(view[received:])
            except TimeoutError:
                raise TransportError(f"{self.peer} sent nothing for {self._timeout} s") from None
            except OSError as error:
                raise TransportError(f"receiving from {self.peer} failed: {error}") from error
            if count == 0:
                if idle and received == 0:
                    raise PeerClosed(f"{self.peer} closed the connection")
                raise TransportError(f"{self.peer} closed the connection mid-message")
            if idle and received == 0:
                self._sock.settimeout(self._timeout)  # the rest of a message must follow promptly
            received += count

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()


class TcpServer(ChannelServer):
    """Serves a store on a TCP port, one thread per connection. Port 0 picks a free port (see `url`)."""

    def __init__(self, store: Store, host: str = "127.0.0.1", port: int = 0, *, scheme: str = "tcp",
                 timeout: float | None = SERVER_TIMEOUT, max_record_bytes: int = MAX_RECORD_BYTES) -> None:
        super().__init__(store, timeout=timeout, max_record_bytes=max_record_bytes)
        timeout = self.timeout
        channels: set[SocketChannel] = set()
        self._channels = channels
        serve_channel = self.serve_channel

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                channel = SocketChannel(self.request, "tcp://" + join_host_port(*self.client_address[:2]), timeout)
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


class _Ipv6Server(_Ipv4Server):
    address_family = socket.AF_INET6


class TcpTransport(AddressedTransport):
    """A connection to a `TcpServer`, reopened on the next call after any failure."""

    server_class = TcpServer

    def _connect(self) -> Channel:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except OSError as error:
            raise TransportError(f"cannot connect to {self.url}: {error}") from error
        return SocketChannel(sock, self.url, self.timeout)
