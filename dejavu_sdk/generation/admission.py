"""Admission within a KV budget, as the round robin of one process and the pipeline's head both apply it.

A microbatch reserves its cache's final size (rows x (longest prompt + largest max_new_tokens - 1) positions)
from admission until its cache is freed. Without swapping every reservation in flight must fit in the budget
at once; with swapping only the two largest (any two may be on the device at once). Under continuous batching
admission counts rows (`take_rows`): a slot reserves each of its rows at its longest row's final length. Which
waiting requests come first is `turns`' rule; a request that could not be admitted even alone is refused when it is
submitted (`check_alone`), never left waiting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping, Sequence

import attrs

from ..errors import RequestTooLarge
from ..swapping import positions_needed, slots_needed
from .batching import Request, cache_bytes
from .turns import take_microbatch


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

    def take(self, waiting: deque[Request], size: int, in_flight: list[int], shares: Mapping[int, int] | None = None,
             barred: Collection[int] = ()) -> list[Request]:
        """The next microbatch of up to `size` waiting requests whose cache fits beside those `in_flight` (as
        many rows as fit; none when the first alone does not), in turns between submissions (`shares`: the rows
        each holds in flight, and `barred`, as `turns.take_microbatch` takes them)."""
        return take_microbatch(waiting, size, lambda rows: self.fits([*in_flight, self.reserve(rows)]), shares,
                               barred)

    def take_rows(self, waiting: deque[Request], room: int, held: Sequence[Request], others: Sequence[Slot],
                  shares: Mapping[int, int] | None = None, barred: Collection[int] = (),
                  most_positions: int | None = None) -> list[Request]:
        """Continuous batching: up to `room` waiting requests to enter a slot whose cache holds (or takes in)
        the rows of `held`, beside the `others` slots, as many as fit, in turns between submissions (`shares`
        and `barred`, as `turns.take_microbatch` takes them); with `most_positions`, no more than their padded
        prompts hold that many positions (one request at least)."""
        def fits(group: list[Request]) -> bool:
            if most_positions is not None and len(group) > 1 and prompt_positions(group) > most_positions:
                return False
            return self.budget is None or self.rows_need(group, held, others) <= self.budget

        return take_microbatch(waiting, room, fits, shares, barred) if room >= 1 else []

    def rows_need(self, group: Sequence[Request], held: Sequence[Request], others: Sequence[Slot]) -> int:
        """Continuous batching: the device bytes a stage needs at most once `group` enters a slot that holds
        `held`, beside the `others` slots.

        A slot reserves its rows at its longest row's final length (`row_bytes`). A group's own cache, while
        its prompts are prefilled and until it joins its slot, stays on the device: with swapping, where only
        two slots' caches are on the device at once, every such group counts besides them."""
        slot = row_bytes([*held, *group], self.bytes_per_token)
        reservations = [other.reserved for other in others] + [slot]
        entering = sum(other.entering for other in others) + row_bytes(group, self.bytes_per_token)
        return slots_needed(reservations, self.swapping) + (entering if self.swapping else 0)

    def check_alone(self, request: Request, needed: int, joining: bool) -> None:
        """RequestTooLarge when `request`, which needs `needed` bytes alone (`joining`: its own cache while it
        joins a slot among them), could never be admitted: it would wait for ever (`SlotPolicy.check_alone`)."""
        if self.budget is None or needed <= self.budget:
            return
        prompt = request.ids.numel()
        # what it needs grows with its positions: the positions of one row that the budget holds, counted alike
        positions = self.budget * positions_needed(prompt, request.max_new_tokens) // needed
        most = positions - prompt + 1 if positions >= prompt else None
        swapped = " (with swapping, its cache and its own while it joins)" if self.swapping and joining else ""
        advice = f"at most {most} new tokens fit beside its prompt" if most else "even its prompt alone does not fit"
        raise RequestTooLarge(
            f"a request of {prompt} prompt tokens and {request.max_new_tokens} new tokens needs {needed} bytes of KV "
            f"cache on a stage{swapped}, more than the {self.budget} bytes each stage gives (kv_budget_bytes): "
            f"{advice}", needed, self.budget, most)


def prompt_positions(group: Sequence[Request]) -> int:
    """The positions a group's prompts take left-padded to each other (rows x its longest prompt)."""
    return len(group) * max((request.ids.numel() for request in group), default=0)


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
