"""`local`: blocks between the model's device and a store in this same process.

With CUDA, device->host copies run on a side stream into page-locked buffers, ordered after the work
already queued on the caller's stream, so they overlap compute that the caller queues next; host->device
copies of fetched blocks are queued the same way and the caller's stream waits for them on the device,
not on the host. Without CUDA the same calls are plain copies into and out of the store.
Records go to the store's own record store unchanged; the local transport serves no peers.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..blocks import BlockKey, ProgressGroup, ProgressKey, check_key
from ..errors import ConfigError, StoreClosed, TransportError
from ..records import NamedRecord
from ..store import Store
from ..urls import ParsedURL
from .base import Transport


class LocalTransport(Transport):
    """Copies blocks between any device and `store`, a Store in this process.

    `close_store`: closing the transport closes the store too (`open_transport` sets it when it opened
    the store from a URL); by default the store stays open, as it may be shared.
    """

    def __init__(self, store: Store, *, close_store: bool = False) -> None:
        if not isinstance(store, Store):
            raise ConfigError(f"the local transport copies into a Store in this process (store=dejavu_sdk.open_store"
                              f"(url), or a URL through open_transport), got {store!r}")
        self.store, self.close_store = store, close_store
        self.url = f"local+{store.url}"
        # The records are the store's own: so are its promises.
        self.atomic_batches = store.records.atomic_batches
        self.persistent, self.shared = store.records.persistent, store.records.shared
        self.lends_buffers, self.resident = store.records.lends_buffers, store.records.resident
        self._side_streams: dict[torch.device, Any] = {}
        self._inbox: queue.Queue[torch.Tensor] = queue.Queue()
        self._closed = False

    @classmethod
    def from_url(cls, url: ParsedURL, *, store: Store | None = None, close_store: bool = False) -> LocalTransport:
        if url.path:
            raise ConfigError(f"the local transport takes no address, got {url.text!r}; pass store=... instead")
        if store is None:
            raise ConfigError("the local transport copies into a store in this process: pass store=URL or a Store")
        return cls(store, close_store=close_store)

    # ---- blocks ----------------------------------------------------------------------------
    def flush(self, key: BlockKey, block: Any) -> None:
        self.store.flush(key, self.on_host(key, block))

    def flush_with_progress(self, key: BlockKey, block: Any, progress: ProgressKey, record: bytes) -> None:
        """`flush`, with a progress record written together with the block (see `Store.flush_with_progress`)."""
        self.store.flush_with_progress(key, self.on_host(key, block), progress, record)

    def flush_group(self, blocks: Sequence[tuple[BlockKey, Any]]) -> None:
        """Several `flush` in one request to the store (one LMDB transaction)."""
        self.store.flush_group([(key, self.on_host(key, block)) for key, block in blocks])

    def flush_group_with_progress(self, group: ProgressGroup) -> None:
        """Several `flush_with_progress` in one request to the store (one LMDB transaction)."""
        self.store.flush_group_with_progress([(key, self.on_host(key, block), progress, record)
                                              for key, block, progress, record in group])

    def on_host(self, key: BlockKey, block: Any) -> Any:
        """`block` as the store can take it: a device tensor is copied to pinned host memory first."""
        self._check_open()
        check_key(key)
        if isinstance(block, torch.Tensor) and block.device.type == "cuda":
            return self._to_host(block)
        return block

    def _to_host(self, block: torch.Tensor) -> torch.Tensor:
        """Copy on the side stream, after the caller's queued work; wait for that copy alone."""
        side = self._side_stream(block.device)
        side.wait_stream(torch.cuda.current_stream(block.device))
        staging = torch.empty(block.shape, dtype=block.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            staging.copy_(block, non_blocking=True)
            block.record_stream(side)  # the caching allocator must not reuse block's memory until done
            done = torch.cuda.Event()
            done.record(side)
        done.synchronize()
        return staging

    def fetch(self, key: BlockKey, out: torch.Tensor | None = None) -> torch.Tensor:
        self._check_open()
        check_key(key)
        if out is None or out.device.type != "cuda":
            return self.store.fetch(key, out)
        staging = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        self.store.fetch(key, out=staging)
        side = self._side_stream(out.device)
        side.wait_stream(torch.cuda.current_stream(out.device))  # out may still be in use by queued work
        with torch.cuda.stream(side):
            out.copy_(staging, non_blocking=True)
            out.record_stream(side)
        torch.cuda.current_stream(out.device).wait_stream(side)  # later work on the caller's stream sees it
        return out

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device=device)
        return self._side_streams[device]

    # ---- tensors ---------------------------------------------------------------------------
    def send_tensor(self, tensor: torch.Tensor) -> None:
        self._check_open()
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"send_tensor takes a torch.Tensor, got {type(tensor).__name__}")
        self._inbox.put(tensor.detach().clone())

    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor:
        """The next tensor this process sent to itself (the local transport is its own peer)."""
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise TransportError(f"no tensor arrived within {timeout} s") from None

    # ---- the record interface: the store's own records ------------------------------------
    def put_records(self, records: Sequence[NamedRecord]) -> None:
        self._check_open()
        self.store.records.put_records(records)

    def get_record(self, name: str) -> contextlib.AbstractContextManager[Any]:
        self._check_open()
        return self.store.records.get_record(name)

    def record_size(self, name: str) -> int | None:
        self._check_open()
        return self.store.records.record_size(name)

    def names(self, prefix: str) -> list[str]:
        self._check_open()
        return self.store.records.names(prefix)

    def remove(self, names: Sequence[str]) -> None:
        self._check_open()
        self.store.records.remove(names)

    def allocate(self, nbytes: int) -> np.ndarray:
        return self.store.records.allocate(nbytes)

    def close(self) -> None:
        """Close the transport, and its store if `close_store` says so."""
        if not self._closed:
            self._closed = True
            if self.close_store:
                self.store.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"{self!r} is closed")
