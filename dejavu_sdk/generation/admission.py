"""Admission within a KV budget, as the round robin of one process and the pipeline's head both apply it.

A microbatch reserves its cache's final size (rows x (longest prompt + largest max_new_tokens - 1) positions)
from admission until its cache is freed. Without swapping every reservation in flight must fit in the budget
at once; with swapping only the two largest (any two may be on the device at once). Under continuous batching
admission counts rows (`take_rows`): a slot reserves each of its rows at its longest row's final length.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import attrs

from ..swapping import positions_needed, slots_needed
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

    def take_rows(self, waiting: deque[Request], room: int, held: Sequence[Request],
                  others: Sequence[Slot]) -> list[Request]:
        """Continuous batching: up to `room` waiting requests to enter a slot whose cache holds (or takes in)
        the rows of `held`, beside the `others` slots, as many as fit.

        A slot reserves its rows at its longest row's final length (`row_bytes`). A group's own cache, while
        its prompts are prefilled and until it joins its slot, stays on the device: with swapping, where only
        two slots' caches are on the device at once, every such group counts besides them."""
        def fits(group: list[Request]) -> bool:
            if self.budget is None:
                return True
            slot = row_bytes([*held, *group], self.bytes_per_token)
            reservations = [other.reserved for other in others] + [slot]
            entering = sum(other.entering for other in others) + row_bytes(group, self.bytes_per_token)
            return slots_needed(reservations, self.swapping) + (entering if self.swapping else 0) <= self.budget

        return take_microbatch(waiting, room, fits) if room >= 1 else []


@attrs.frozen
class Slot:
    """What a slot holds, for admission: the bytes its rows reserve (`row_bytes`), and of those, the bytes of the
    group on its way in (its own cache until it joins)."""

    reserved: int
    entering: int = 0


def row_bytes(requests: Sequence[Request], bytes_per_token: int) -> int:
    """Bytes a slot of `requests` may take under continuous batching: each row as long as the longest row's
    cache at its end (its prompt and new tokens; rows are left-padded to the longest)."""
    if not requests:
        return 0
    return len(requests) * max(positions_needed(request.ids.numel(), request.max_new_tokens)
                               for request in requests) * bytes_per_token
