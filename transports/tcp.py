"""`tcp://host:port`: blocks over TCP sockets (TLS optional), received straight into their final buffers.

The client here opens one `SocketChannel` (see `sockets.py`) per transport and reopens it after any failure;
the server (`TcpServer`, see `tcp_server.py`) watches every connection from one thread and answers requests
on a bounded pool. `tls=True` (client) and `tls_cert`/`tls_key` (server) use the standard library's `ssl`.
"""

from __future__ import annotations

import functools
import socket
import ssl

from ..errors import AccessDenied, TransportError
from .channel import AddressedTransport
from .sockets import SocketChannel, client_tls_context
from .tcp_server import TcpServer
from .wire import Channel


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
