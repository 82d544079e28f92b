"""Microbatch swapping: deciding whether it pays (`choose_swapping`), and what it needs of a KV budget.

A decode stage steps its microbatches round robin. With swapping, each one's cache lives in host memory and at most
two on the device (`swapped_caches.SwappedCaches`), so twice the microbatches fit in the same memory, as long as
bringing a cache in is cheaper than a step (`choose_swapping`: the planner's condition,
`planner.swapping_pays_off`). On a CPU the device and the host are the same memory: the copies are real, the gain is
not.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

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


__all__ = ["SWAPPING_CHOICES", "SwapChoice", "check_budget", "check_fits_alone", "check_swapping",
           "choose_swapping",
           "kv_bytes_per_token", "measure_host_bandwidth", "positions_needed", "slots_needed"]
