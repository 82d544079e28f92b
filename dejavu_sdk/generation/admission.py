"""Admission within a KV budget, as the round robin of one process and the pipeline's head both apply it.

A microbatch reserves its cache's final size (rows x (longest prompt + largest max_new_tokens - 1) positions)
from admission until its cache is freed. Without swapping every reservation in flight must fit in the budget
at once; with swapping only the two largest (any two may be on the device at once).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ..swapping import slots_needed
from .batching import Request, cache_bytes, take_microbatch


class Admission:
    """Admits microbatches within `budget` bytes of KV per stage (None: no cap), each position of a row taking
    `bytes_per_token`; `swapping` says whether caches live in host memory with two on the device."""

    def __init__(self, budget: int | None, swapping: bool, bytes_per_token: int) -> None:
        self.budget, self.swapping, self.bytes_per_token = budget, swapping, bytes_per_token

    def reserve(self, requests: Sequence[Request]) -> int:
        """The bytes a microbatch of `requests` takes at its end."""
        return cache_bytes(requests, self.bytes_per_token)

    def fits(self, reservations: list[int]) -> bool:
        """Whether microbatches of these reservations fit in the budget together."""
        return self.budget is None or slots_needed(reservations, self.swapping) <= self.budget

    def take(self, waiting: deque[Request], size: int, in_flight: list[int]) -> list[Request]:
        """The next microbatch of up to `size` waiting requests whose cache fits beside those `in_flight` (as
        many rows as fit; none when the first alone does not)."""
        return take_microbatch(waiting, size, lambda rows: self.fits([*in_flight, self.reserve(rows)]))
