"""`SwappedCaches`: every in-flight microbatch's KV cache in host memory, two on the device (or all on the device).

Before microbatch x's step (`acquire`), x's cache is on the device, brought in while the previous microbatch
computed, and the copy of the next one (the least recently stepped) starts on a side copy stream; after the step
(`release`) only the new positions go back to the host (pinned when the device is a GPU), and x leaves the device.

Host copies hold every position at its index in a buffer of the microbatch's final length, so a step's
write-back is one slice per layer. A sliding-window layer keeps only its last `window - 1` positions on the
device (as `DynamicSlidingWindowLayer` does); its host buffer has those, and a swap-in brings back the same.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import attrs
import torch
from transformers import DynamicCache

from .errors import ConfigError


@attrs.define
class _HostCopy:
    """One microbatch's cache in host memory: per layer, keys and values `[capacity, B, H, D]` (position-major,
    so that a range of positions is one contiguous block: a single asynchronous copy from pinned memory), and
    how many positions each layer has seen (`length`: every position before it is in the buffer, except
    those a sliding-window layer has let go)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    windows: list[int | None]  # a sliding-window layer's window, else None
    length: int

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[0])


class SwappedCaches:
    """The KV caches of a stage's in-flight microbatches, by microbatch number; swapped or all on the device.

    `add` a microbatch's cache after its prefill (with its final length, `capacity`), `acquire` it before each
    step and `release` it after, `remove` it when it ends. Without swapping every cache stays on the device.
    `held_bytes` counts the device memory the caches hold now (their tensors' storage; `pin`ned ones
    included), `peak_bytes` the most it held after any call; `wait_seconds` is the time `acquire` spent waiting
    for swap-ins, `copy_seconds` the time spent issuing copies (on a CPU the copies themselves; on a GPU only
    their launch).
    """

    def __init__(self, config: Any, device: torch.device | str, swapping: bool) -> None:
        self.config, self.device, self.swapping = config, torch.device(device), bool(swapping)
        self._host: dict[int, _HostCopy] = {}
        self._resident: dict[int, DynamicCache] = {}
        self._ready: dict[int, Any] = {}  # a resident cache's swap-in: a CUDA event, or None once done
        self._recency: OrderedDict[int, None] = OrderedDict()  # least recently stepped first: the next to come in
        self._pinned: dict[object, DynamicCache] = {}  # caches held on the device besides, never swapped (`pin`)
        self._copies = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.peak_bytes = 0
        self.wait_seconds = 0.0
        self.copy_seconds = 0.0
        self.swap_ins = 0

    def __contains__(self, number: int) -> bool:
        return number in self._recency

    def __len__(self) -> int:
        return len(self._recency)

    def new_cache(self, number: int, cache: DynamicCache | None = None) -> DynamicCache:
        """A cache for microbatch `number`'s first step (empty, or `cache` as it arrived): it holds a device slot
        from now on."""
        if number in self._resident or number in self._recency:
            raise ConfigError(f"microbatch {number} already has a cache here")
        cache = self._resident[number] = cache if cache is not None else DynamicCache(config=self.config)
        return cache

    def add(self, number: int, capacity: int) -> None:
        """Microbatch `number` took its first step in its `new_cache`; it will reach `capacity` positions at
        most. With swapping, the cache moves to the host."""
        if number not in self._resident or number in self._recency:
            raise ConfigError(f"microbatch {number} has no new cache to add")
        self._recency[number] = None
        self._account()
        if self.swapping:
            self._host[number] = self._to_host(self._resident.pop(number), capacity)

    def acquire(self, number: int) -> DynamicCache:
        """Microbatch `number`'s cache on the device for its next step; with swapping, start bringing in the
        one after it meanwhile."""
        if number not in self._recency:
            raise ConfigError(f"microbatch {number} has no cache here")
        if not self.swapping:
            return self._resident[number]
        following = next((other for other in self._recency if other != number), None)
        for other in [other for other in self._resident if other not in (number, following)]:
            self._evict(other)  # written back at its release: nothing on the device is lost
        start = time.perf_counter()
        if number not in self._resident:
            self._swap_in(number)
        self._wait(number)
        self.wait_seconds += time.perf_counter() - start
        if following is not None and following not in self._resident:
            self._swap_in(following)
        self._account()
        return self._resident[number]

    def release(self, number: int) -> None:
        """After microbatch `number`'s step: with swapping, its new positions go back to the host and it
        leaves the device."""
        self._recency.move_to_end(number)
        if self.swapping:
            self._write_back(number, self._resident.pop(number))
        self._account()

    def pin(self, key: object, cache: DynamicCache | None) -> None:
        """Count `cache` as held on the device under `key` until it is pinned as None (a cache of its own that
        never swaps: a group's, while its prompts are prefilled and until it joins its slot); pinning it again
        after it grew counts it anew."""
        if cache is None:
            self._pinned.pop(key, None)
        else:
            self._pinned[key] = cache
        self._account()

    def positions(self, number: int) -> int:
        """The positions microbatch `number`'s cache holds, wherever it is (asking moves nothing)."""
        if number in self._resident:
            return int(self._resident[number].get_seq_length())
        if number in self._host:
            return self._host[number].length
        raise ConfigError(f"microbatch {number} has no cache here")

    def numbers(self) -> set[int]:
        """The microbatches with a cache here (on the device, on the host, or new and not stepped yet)."""
        return {*self._recency, *self._resident}

    def remove(self, number: int) -> None:
        """Microbatch `number` ended: free its cache everywhere."""
        self._recency.pop(number, None)
        self._host.pop(number, None)
        self._evict(number)

    def _evict(self, number: int) -> None:
        self._resident.pop(number, None)
        self._ready.pop(number, None)

    def stats(self) -> dict[str, Any]:
        """What the caches held and cost: device bytes now and at most, swap-ins and the time waited for them."""
        return {"swapping": self.swapping, "held_kv_bytes": self.held_bytes, "peak_kv_bytes": self.peak_bytes,
                "swap_ins": self.swap_ins, "swap_wait_seconds": self.wait_seconds, "copy_seconds": self.copy_seconds}

    @property
    def held_bytes(self) -> int:
        """Device memory the resident caches hold now: the storage of their tensors, each counted once."""
        storages: dict[int, int] = {}
        for cache in [*self._resident.values(), *self._pinned.values()]:
            for layer in _layers(cache):
                for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if isinstance(tensor, torch.Tensor) and tensor.numel():
                        storage = tensor.untyped_storage()
                        storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    # ---- copies ---------------------------------------------------------------------------------------
    def _to_host(self, cache: DynamicCache, capacity: int) -> _HostCopy:
        pinned = self.device.type == "cuda"
        keys, values, windows = [], [], []
        length = _seen(_layers(cache)[0])
        if length > capacity:
            raise ConfigError(f"a cache of {length} positions exceeds its stated capacity of {capacity}")
        with self._copy_stream():
            for layer in _layers(cache):
                kept = int(layer.keys.shape[2])
                batch, heads, _, dim = layer.keys.shape
                host_keys = torch.empty((capacity, batch, heads, dim), dtype=layer.keys.dtype, pin_memory=pinned)
                host_values = torch.empty((capacity, batch, heads, dim), dtype=layer.values.dtype, pin_memory=pinned)
                host_keys[length - kept:length].copy_(_positions_first(layer.keys), non_blocking=pinned)
                host_values[length - kept:length].copy_(_positions_first(layer.values), non_blocking=pinned)
                _keep_until_copied(self._copies, layer.keys, layer.values)
                keys.append(host_keys)
                values.append(host_values)
                windows.append(getattr(layer, "sliding_window", None))
        return _HostCopy(keys, values, windows, length)

    def _swap_in(self, number: int) -> None:
        host = self._host[number]
        cache = DynamicCache(config=self.config)
        pieces = []
        for index, layer in enumerate(_layers(cache)):
            window = host.windows[index]
            first = 0 if window is None else max(0, host.length - (window - 1))
            # Allocated for the compute stream, which reads them (the copy stream's pool would keep a third slot)
            keys = torch.empty(host.keys[index][first:host.length].shape, dtype=host.keys[index].dtype,
                               device=self.device)
            values = torch.empty_like(keys)
            pieces.append((layer, first, keys, values))
        with self._copy_stream():
            for index, (_, first, keys, values) in enumerate(pieces):
                keys.copy_(host.keys[index][first:host.length], non_blocking=True)
                values.copy_(host.values[index][first:host.length], non_blocking=True)
                _keep_until_copied(self._copies, keys, values)
            event = self._record_event()
        for layer, _, keys, values in pieces:  # outside the copy stream: nothing here waits for the copies
            _fill(layer, _heads_first(keys), _heads_first(values), host.length)
        self._resident[number], self._ready[number] = cache, event
        self.swap_ins += 1

    def _wait(self, number: int) -> None:
        event = self._ready.pop(number, None)
        if event is not None:
            event.synchronize()
            torch.cuda.current_stream(self.device).wait_event(event)

    def _write_back(self, number: int, cache: DynamicCache) -> None:
        host = self._host[number]
        seen = _seen(_layers(cache)[0])
        new = seen - host.length
        if new == 0:
            return
        if seen > host.capacity:
            raise ConfigError(f"microbatch {number} grew to {seen} positions, past its capacity of {host.capacity}")
        with self._copy_stream():
            for index, layer in enumerate(_layers(cache)):
                kept = min(new, int(layer.keys.shape[2]))  # a sliding-window layer let go of a long chunk's first
                host.keys[index][seen - kept:seen].copy_(_positions_first(layer.keys[:, :, -kept:]), non_blocking=True)
                host.values[index][seen - kept:seen].copy_(_positions_first(layer.values[:, :, -kept:]),
                                                           non_blocking=True)
                _keep_until_copied(self._copies, layer.keys, layer.values)
        host.length = seen

    @contextlib.contextmanager
    def _copy_stream(self) -> Iterator[None]:
        """Copies run on the side stream, after the work already queued on the compute stream (CUDA); the time
        spent issuing them counts in `copy_seconds`."""
        start = time.perf_counter()
        try:
            if self._copies is None:
                yield
            else:
                self._copies.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._copies):
                    yield
        finally:
            self.copy_seconds += time.perf_counter() - start

    def _record_event(self) -> Any:
        if self._copies is None:
            return None
        event = torch.cuda.Event()
        event.record(self._copies)
        return event

    def _account(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)


def _layers(cache: DynamicCache) -> list[Any]:
    """A cache's layers (key/value layers: other kinds are refused by the stages that use them)."""
    return list(cache.layers)


def _seen(layer: Any) -> int:
    """Positions a cache layer has seen (a sliding-window layer keeps fewer)."""
    return int(getattr(layer, "cumulative_length", 0) or layer.keys.shape[2])


def _positions_first(tensor: torch.Tensor) -> torch.Tensor:
    """`[B, H, S, D]` seen as `[S, B, H, D]` (a view)."""
    return tensor.permute(2, 0, 1, 3)


def _heads_first(tensor: torch.Tensor) -> torch.Tensor:
    """`[S, B, H, D]` seen as `[B, H, S, D]` (a view), as cache layers hold them."""
    return tensor.permute(1, 2, 0, 3)


def _fill(layer: Any, keys: torch.Tensor, values: torch.Tensor, seen: int) -> None:
    """Make an empty cache layer hold `keys`/`values` (no further copy), having seen `seen` positions."""
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = seen


def _keep_until_copied(stream: Any, *tensors: torch.Tensor) -> None:
    """Device tensors another stream uses must not be reused before it ran (CUDA's caching allocator)."""
    if stream is not None:
        for tensor in tensors:
            if tensor.device.type == "cuda":
                tensor.record_stream(stream)
