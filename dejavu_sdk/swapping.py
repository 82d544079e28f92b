"""Microbatch swapping: every in-flight microbatch's KV cache in host memory, two on the device.

A decode stage steps its microbatches round robin. With swapping, `SwappedCaches` keeps each one's cache in
host memory (pinned when the device is a GPU) and at most two on the device: before microbatch x's step
(`acquire`), x's cache is there, brought in while the previous microbatch computed, and the copy of the next
one (the least recently stepped) starts on a side copy stream; after the step (`release`) only the new
positions go back to the host, and x leaves the device. The device then holds two caches where it would
hold all of them, so twice the microbatches fit in the same memory, as long as bringing a cache in is
cheaper than a step (`choose_swapping`: the planner's condition, `planner.swapping_pays_off`).

On a CPU the device and the host are the same memory: the copies are real, the gain is not.

Host copies hold every position at its index in a buffer of the microbatch's final length, so a step's
write-back is one slice per layer. A sliding-window layer keeps only its last `window - 1` positions on the
device (as `DynamicSlidingWindowLayer` does); its host buffer has those, and a swap-in brings back the same.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from transformers import DynamicCache

from .errors import ConfigError
from .planner import swapping_pays_off

log = logging.getLogger(__name__)

#: How swapping may be set: on, off, or decided from measured step time and host bandwidth.
SWAPPING_CHOICES = (True, False, "auto")


def kv_bytes_per_token(config: Any, dtype: torch.dtype, layers: int | None = None) -> int:
    """Bytes of KV cache one position of one row takes over `layers` decoder layers (default: all of them)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    count = config.num_hidden_layers if layers is None else layers
    return 2 * count * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def check_swapping(swapping: Any) -> bool | str:
    if swapping not in SWAPPING_CHOICES or not isinstance(swapping, (bool, str)):
        raise ConfigError(f"swapping must be True, False or 'auto', got {swapping!r}")
    return swapping


def check_budget(budget: Any) -> int | None:
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ConfigError(f"kv_budget_bytes must be a positive integer (bytes) or None, got {budget!r}")
    return budget


@attrs.frozen
class SwapChoice:
    """Whether to swap, and why: the measured step time and host bandwidth that decided it, when they did."""

    swapping: bool
    reason: str
    token_time: float | None = None
    host_bandwidth: float | None = None


def choose_swapping(*, fits_without: bool, batch: int, prompt_tokens: int, new_tokens: int,
                    cache_bytes_per_token: float, device_is_host: bool = False, two_slots: bool = True,
                    measure: Callable[[], tuple[float, float]] | None = None, token_time: float | None = None,
                    host_bandwidth: float | None = None) -> SwapChoice:
    """Swap only when it is needed, possible and pays off; `measure()` gives (step seconds, host bytes/s) when
    the numbers are needed and not given.

    Not needed when every microbatch's cache fits in the device budget at once (`fits_without`); pointless
    when the device is the host (a CPU: host copies take the same memory); impossible when two device slots
    of one request's cache do not fit the budget (`two_slots`). Otherwise the planner's condition decides:
    over a microbatch's `new_tokens` steps, bringing back caches of `prompt_tokens` and more positions of
    `batch` rows (`cache_bytes_per_token` each) at `host_bandwidth` bytes/s must take no longer than twice
    the steps (`token_time` s each), or the device waits on copies.
    """
    if fits_without:
        return SwapChoice(False, "every microbatch's cache fits in the device budget at once: nothing to swap")
    if device_is_host:
        return SwapChoice(False, "the device is the CPU: host copies would take the same memory and save none")
    if not two_slots:
        return SwapChoice(False, "two device slots of one request's cache do not fit the budget: fewer "
                          "microbatches in flight instead")
    if token_time is None or host_bandwidth is None:
        if measure is None:
            raise ConfigError("deciding whether swapping pays off needs the step time and the host bandwidth")
        token_time, host_bandwidth = measure()
    pays = swapping_pays_off(new_tokens, prompt_tokens, token_time, batch, cache_bytes_per_token, host_bandwidth)
    longest = (prompt_tokens + new_tokens) * batch * cache_bytes_per_token / host_bandwidth
    numbers = (f"a step takes {token_time * 1e3:.2f} ms; bringing in a cache of {prompt_tokens + new_tokens} "
               f"positions x {batch} rows takes {longest * 1e3:.2f} ms at {host_bandwidth / 1e9:.2f} GB/s")
    if pays:
        return SwapChoice(True, f"swapping pays off: {numbers}", token_time, host_bandwidth)
    return SwapChoice(False, f"swapping would stall the device on copies ({numbers}): off, and fewer "
                      "microbatches in flight", token_time, host_bandwidth)


def measure_host_bandwidth(device: torch.device, nbytes: int, repeats: int = 3) -> float:
    """Bytes/s of a host-to-device copy of `nbytes` (at most 256 MiB), from pinned memory on a GPU (a plain
    memory copy on a CPU), median of `repeats` after one unmeasured copy."""
    size = max(1, min(int(nbytes), 256 << 20))
    source = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    source.fill_(1)
    target = torch.empty(size, dtype=torch.uint8, device=device)
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        target.copy_(source, non_blocking=True)
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
    return size / max(statistics.median(seconds[1:]), 1e-9)


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
                host.keys[index][host.length:seen].copy_(_positions_first(layer.keys[:, :, -new:]), non_blocking=True)
                host.values[index][host.length:seen].copy_(_positions_first(layer.values[:, :, -new:]),
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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_fits_alone(alone: int, budget: int | None, swapping: bool) -> None:
    """ConfigError when a budget cannot hold the cache of one request alone (`alone` bytes at its end), or with
    swapping two device slots of it."""
    if budget is None:
        return
    if alone > budget:
        raise ConfigError(f"kv_budget_bytes={budget} cannot hold the KV cache of one request ({alone} bytes at "
                          "its end)")
    if swapping and 2 * alone > budget:
        raise ConfigError(f"kv_budget_bytes={budget} cannot hold two device slots for swapping: one request's KV "
                          f"cache alone takes {alone} bytes at its end; give at least {2 * alone}, or swapping=False")


def slots_needed(reservations: list[int], swapping: bool) -> int:
    """Device bytes the caches of microbatches with these final sizes need at most: all of them, or with
    swapping the two largest (any two may be on the device at once)."""
    if not swapping:
        return sum(reservations)
    return sum(sorted(reservations, reverse=True)[:2])


def positions_needed(prompt_tokens: int, new_tokens: int) -> int:
    """Cache positions a row reaches: the prompt, and every new token but the last (never fed back)."""
    return prompt_tokens + max(new_tokens - 1, 0)


__all__ = ["SWAPPING_CHOICES", "SwapChoice", "SwappedCaches", "check_budget", "check_fits_alone", "check_swapping",
           "choose_swapping",
           "kv_bytes_per_token", "measure_host_bandwidth", "positions_needed", "slots_needed"]
