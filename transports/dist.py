"""`nccl://host:port` and `gloo://host:port`: blocks over torch.distributed point-to-point links.

Every link is a two-rank process group of its own (server rank 0, client rank 1), created through the
server's long-lived TCPStore under a fresh prefix, so a broken link is replaced by a new one without
touching other links or any global process group. `nccl://` uses NCCL when CUDA is available and gloo
otherwise (the same code path, tested on CPU); `gloo://` always uses gloo.

Failure behaviour of gloo (see the docs): a dead peer surfaces in tens of milliseconds, a hung one only
through the timeout, and any timeout closes the link for good; the next call opens a new one.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import TransportError
from ..store import Store
from ..urls import join_host_port
from .channel import AddressedTransport, ChannelServer, ServerOptions
from .wire import Channel, PeerClosed
from .wire import one_array as _one_array

_TAG = 0
_SERVER_RANK, _CLIENT_RANK = 0, 1
_IDLE_TIMEOUT = datetime.timedelta(days=7)  # a server waits this long for a client's next request
_SKIP_LINK_AFTER = 30.0  # seconds a server waits for a client that took a link number, then moves on


def _uses_nccl(scheme: str) -> bool:
    return scheme == "nccl" and torch.cuda.is_available() and dist.is_nccl_available()


def _seconds(value: float | None) -> datetime.timedelta:
    return _IDLE_TIMEOUT if value is None else datetime.timedelta(seconds=value)


def _link_group(scheme: str, store: Any, rank: int, host: str, timeout: datetime.timedelta) -> Any:
    """A two-rank process group over `store` (a per-link prefix of the server's TCPStore)."""
    if _uses_nccl(scheme):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    # torch's stubs omit ProcessGroupGloo._Options, which exists at runtime (and is what gloo needs here)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, 2, options)


class DistChannel(Channel):
    """One two-rank process group; each send and receive is one point-to-point message."""

    chunk_size = 1 << 62  # whole payloads: each message costs a round of gloo/NCCL bookkeeping

    def __init__(self, group: Any, peer_rank: int, peer: str, timeout: float | None, device: torch.device) -> None:
        self._group = group
        self._peer_rank = peer_rank
        self.peer = peer
        self._timeout = timeout
        self._device = device

    def _wait(self, start: Callable[[], Any], what: str, idle: bool = False) -> None:
        """Start an operation (`start()`: its work) and wait for it; gloo raises from either when the peer is gone."""
        try:
            work = start()
            if idle or self._timeout is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=self._timeout))
        except RuntimeError as error:
            text = str(error)
            if idle and ("closed" in text.lower() or "reset" in text.lower()):
                raise PeerClosed(f"{self.peer} closed the link") from None
            raise TransportError(f"{what} {self.peer} failed: {text.splitlines()[0]}") from error

    def send(self, *buffers: Any) -> None:
        array = _one_array(buffers)
        tensor = torch.from_numpy(array)
        if self._device.type != "cpu":
            tensor = tensor.to(self._device)
        self._wait(lambda: self._group.send([tensor], self._peer_rank, _TAG), "sending to")

    def recv_into(self, buffer: np.ndarray, idle: bool = False) -> None:
        target = torch.from_numpy(buffer)
        landing = target if self._device.type == "cpu" else torch.empty_like(target, device=self._device)
        self._wait(lambda: self._group.recv([landing], self._peer_rank, _TAG), "receiving from", idle)
        if landing is not target:
            target.copy_(landing)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._group.abort()


class DistServer(ChannelServer):
    """Hosts the TCPStore peers rendezvous through and serves each link on its own thread."""

    def __init__(self, store: Store, host: str = "127.0.0.1", port: int = 0, *, scheme: str = "gloo",
                 options: ServerOptions | None = None) -> None:
        super().__init__(store, options or ServerOptions())
        self.scheme, self.host = scheme, host
        try:
            self._rendezvous = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                             timeout=datetime.timedelta(seconds=30))
        except RuntimeError as error:
            raise TransportError(f"cannot listen on {scheme}://{join_host_port(host, port)}: {error}") from error
        self.url = f"{scheme}://{join_host_port(host, self._rendezvous.port)}"
        self._stopping = threading.Event()
        self._channels: set[DistChannel] = set()
        self._acceptor = threading.Thread(target=self._accept_links, name=f"dejavu-serve {self.url}", daemon=True)
        self._acceptor.start()

    def _accept_links(self) -> None:
        """Serve each link number a client took once that client says it is ready, in any order: a client that
        took a number and died before joining is given up after `_SKIP_LINK_AFTER` seconds without holding
        back the clients that came after it."""
        awaited: dict[int, float] = {}  # link number taken -> since when its client is awaited
        numbered = 0
        while not self._stopping.is_set():
            taken, now = self._rendezvous.add("links", 0), time.monotonic()
            awaited.update(dict.fromkeys(range(numbered + 1, taken + 1), now))
            numbered = max(numbered, taken)
            for link, since in list(awaited.items()):
                if self._rendezvous.check([f"link/{link}/ready"]):
                    del awaited[link]
                    threading.Thread(target=self._serve_link, args=(link,), daemon=True).start()
                elif now - since > _SKIP_LINK_AFTER:
                    del awaited[link]  # that client died before joining
            time.sleep(0.02)

    def _serve_link(self, link: int) -> None:
        try:
            group = _link_group(self.scheme, dist.PrefixStore(f"link/{link}", self._rendezvous), _SERVER_RANK,
                                self.host, _IDLE_TIMEOUT)
        except RuntimeError as error:
            self.log.warning("link %d to %s failed to form: %s", link, self.url, error)
            return
        device = torch.device("cuda", torch.cuda.current_device()) if _uses_nccl(self.scheme) else torch.device("cpu")
        channel = DistChannel(group, _CLIENT_RANK, f"{self.url} link {link}", self.timeout, device)
        self._channels.add(channel)
        try:
            self.serve_channel(channel)
        finally:
            self._channels.discard(channel)

    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _stop(self) -> None:
        self._stopping.set()
        self._acceptor.join(timeout=10)
        for channel in list(self._channels):
            channel.close()


class DistTransport(AddressedTransport):
    """A link to a `DistServer`; a broken link is replaced by a new process group on the next call."""

    server_class = DistServer

    @property
    def backend(self) -> str:
        return "nccl" if _uses_nccl(self.scheme) else "gloo"

    def _connect(self) -> Channel:
        try:
            rendezvous = dist.TCPStore(self.host, self.port, is_master=False,
                                       timeout=_seconds(self.connect_timeout))
            link = rendezvous.add("links", 1)
            rendezvous.set(f"link/{link}/ready", self.backend)
            group = _link_group(self.scheme, dist.PrefixStore(f"link/{link}", rendezvous), _CLIENT_RANK,
                                self.host, _seconds(self.connect_timeout))
        except RuntimeError as error:
            raise TransportError(f"cannot connect to {self.url}: {str(error).splitlines()[0]}") from error
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        return DistChannel(group, _SERVER_RANK, self.url, self.timeout, device)
