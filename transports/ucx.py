"""`ucx://host:port`: blocks over UCX through ucxx (extra: ucx), the maintained successor of ucx-py.

UCX picks the fastest path it has: TCP on any machine, InfiniBand/RoCE RDMA where the UCX build has
verbs, and CUDA memory where a GPU exists. ucxx is asynchronous; one event-loop thread per process runs
every UCX call, and the methods here block on it with timeouts, like every other transport.
Endpoints use UCX's error handling, so a peer that dies shows up as an error instead of a hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Coroutine
from typing import Any

import numpy as np

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets variables some UCX builds do not know
import ucxx

from ..errors import TransportError
from ..store import Store
from ..urls import join_host_port
from .channel import AddressedTransport, ChannelServer, ServerOptions
from .wire import Channel, IdleTimeout, PeerClosed
from .wire import one_array as _one_array


class _EventLoop:
    """The process's one asyncio loop for UCX, on a daemon thread."""

    _instance: _EventLoop | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="dejavu-ucx", daemon=True).start()

    @classmethod
    def get(cls) -> _EventLoop:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout: float | None, what: str) -> Any:
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise _TimedOut(f"{what} timed out after {timeout} s") from None
        except ucxx.exceptions.UCXError as error:
            raise TransportError(f"{what} failed: {error}") from error


class _TimedOut(TransportError):
    """A UCX call did not finish within its timeout."""


async def _call(function: Any, *args: Any) -> Any:
    """Run a synchronous ucxx call on the loop thread (ucxx binds objects to the running loop)."""
    return function(*args)


class UcxChannel(Channel):
    """One UCX endpoint; messages are matched in order, each receive the size of one send."""

    chunk_size = 1 << 62  # UCX moves a whole payload in one rendezvous transfer

    def __init__(self, endpoint: Any, peer: str, timeout: float | None, idle_timeout: float | None = None) -> None:
        self._endpoint = endpoint
        self._loop = _EventLoop.get()
        self.peer = peer
        self._timeout, self._idle_timeout = timeout, idle_timeout

    def set_idle_timeout(self, seconds: float | None) -> None:
        self._idle_timeout = seconds

    def closed_by_peer(self) -> bool:
        return bool(self._endpoint.closed)

    def send(self, *buffers: Any) -> None:
        array = _one_array(buffers)
        try:
            self._loop.run(self._endpoint.send(array), self._timeout, f"sending to {self.peer}")
        except TransportError as error:
            if isinstance(error.__cause__, (ucxx.exceptions.UCXConnectionResetError, ucxx.exceptions.UCXCloseError)):
                raise PeerClosed(f"{self.peer} closed the connection") from error
            raise

    def recv_into(self, buffer: np.ndarray, idle: bool = False) -> None:
        if idle and self._endpoint.closed:  # a reply already sent may still be waiting to be read
            raise PeerClosed(f"{self.peer} closed the connection")
        try:
            self._loop.run(self._endpoint.recv(buffer), self._idle_timeout if idle else self._timeout,
                           f"receiving from {self.peer}")
        except _TimedOut:
            if idle:
                raise IdleTimeout(f"{self.peer} sent nothing for {self._idle_timeout} s") from None
            raise
        except TransportError as error:
            if idle and isinstance(error.__cause__, (ucxx.exceptions.UCXCanceledError,
                                                     ucxx.exceptions.UCXConnectionResetError,
                                                     ucxx.exceptions.UCXCloseError)):
                raise PeerClosed(f"{self.peer} closed the connection") from None
            raise

    def close(self) -> None:
        with contextlib.suppress(TransportError):
            self._loop.run(self._endpoint.close(), 5.0, f"closing {self.peer}")


class UcxServer(ChannelServer):
    """Listens for UCX endpoints and serves each on a thread of its own."""

    def __init__(self, store: Store, host: str = "127.0.0.1", port: int = 0, *, scheme: str = "ucx",
                 options: ServerOptions | None = None) -> None:
        super().__init__(store, options or ServerOptions())
        self._loop = _EventLoop.get()
        self._channels: set[UcxChannel] = set()
        try:
            self._listener = self._loop.run(_call(ucxx.create_listener, self._accept, port or None), 30,
                                            f"listening on {scheme}://{join_host_port(host, port)}")
        except TransportError as error:
            raise TransportError(f"cannot listen on {scheme}://{join_host_port(host, port)}: {error}") from error
        self.url = f"{scheme}://{join_host_port(host, self._listener.port)}"

    async def _accept(self, endpoint: Any) -> None:
        channel = UcxChannel(endpoint, f"{self.url} peer {endpoint.uid:x}", self.timeout, self.options.idle_timeout)
        self._channels.add(channel)
        finished = asyncio.get_running_loop().create_future()

        def serve() -> None:
            try:
                self.serve_channel(channel)
            finally:
                self._channels.discard(channel)
                self._loop.loop.call_soon_threadsafe(finished.set_result, None)

        threading.Thread(target=serve, name=f"dejavu-serve {channel.peer}", daemon=True).start()
        await finished

    def _stop(self) -> None:
        self._loop.run(_call(self._listener.close), 10, f"closing {self.url}")
        for channel in list(self._channels):
            channel.close()


class UcxTransport(AddressedTransport):
    """A connection to a `UcxServer`, reopened on the next call after any failure."""

    server_class = UcxServer

    def _connect(self) -> Channel:
        connect = ucxx.create_endpoint(self.host, self.port, connect_timeout=self.connect_timeout)
        try:
            endpoint = _EventLoop.get().run(connect, self.connect_timeout + 5, f"connecting to {self.url}")
        except TransportError as error:
            raise TransportError(f"cannot connect to {self.url}: {error}") from error
        return UcxChannel(endpoint, self.url, self.timeout)
