"""A slot's batching policy: how the one scheduler's slots take rows in, grow, and let them go.

Every microbatch is a slot, in one process (`roundrobin.RoundRobin`) and in a pipeline (the head's ledger, the
stage workers); `batching=` chooses the policy, and nothing else differs:

- `CONTINUOUS` refills a slot between rounds: a group of waiting requests joins while other rows decode, each row
  leaves as it ends, and grows to its own final length. A joining group's cache stands beside the slot's until it
  joins (`Admission.take_rows` counts both).
- `STATIC` takes one group into an empty slot; its rows stay, ended ones as padding, until the last ends and they
  leave together, so that the slot is `model.generate` on that microbatch: every row grows to the microbatch's
  longest prompt and largest limit, and the group's cache is the slot's from its first prompt chunk on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import attrs

from ..swapping import positions_needed, slots_needed
from .admission import Admission, Slot, row_bytes
from .batching import Request, cache_bytes


@attrs.frozen
class SlotPolicy:
    """One of the two policies (`CONTINUOUS`, `STATIC`; `slot_policy(batching)`)."""

    #: "continuous" or "static", as `batching=` names it.
    batching: str
    #: Whether rows join and leave between rounds (continuous), or a slot holds one group until its last row ends.
    refills: bool

    def admits(self, held: Collection[Any]) -> bool:
        """Whether a slot holding (or taking in) the rows `held` may take a group now."""
        return self.refills or not held

    def leaving(self, members: Sequence[int], ended: Sequence[bool]) -> list[int]:
        """Which of a slot's rows (`members`, whether each `ended`) leave it: each ended one, or (static) all of
        them once every one ended."""
        if self.refills:
            return [member for member, done in zip(members, ended, strict=True) if done]
        return list(members) if all(ended) else []

    def finals(self, prompts: Sequence[int], limits: Sequence[int]) -> list[int]:
        """The positions each row's cache reaches at its end, for rows of these prompt lengths and new-token
        limits (static: the rows of one microbatch, which keep their padding)."""
        if self.refills or not prompts:
            return [positions_needed(prompt, limit) for prompt, limit in zip(prompts, limits, strict=True)]
        return [positions_needed(max(prompts), max(limits))] * len(prompts)

    def reserve(self, requests: Sequence[Request], bytes_per_token: int) -> int:
        """The bytes a slot of `requests` may take at its end: every row as long as its longest at its end (rows
        are left-padded to each other): `admission.row_bytes`, or a static microbatch's `batching.cache_bytes`."""
        if self.refills:
            return row_bytes(requests, bytes_per_token)
        return cache_bytes(requests, bytes_per_token) if requests else 0

    def admitted(self, held: Sequence[Request], entering: Sequence[Request], bytes_per_token: int) -> Slot:
        """What a slot holding the rows `held` (with `entering`, those on their way in, among them) takes, for
        admission: its reservation, and a joining group's own cache beside it (static: the slot's already)."""
        return Slot(self.reserve(held, bytes_per_token),
                    self.reserve(entering, bytes_per_token) if self.refills else 0)

    def take(self, admission: Admission, waiting: deque[Request], room: int, held: Sequence[Request],
             others: Sequence[Slot], shares: Mapping[int, int] | None = None,
             barred: Collection[int] = (), most_positions: int | None = None) -> list[Request]:
        """Up to `room` waiting requests for a slot holding `held`, that fit beside the `others` slots, in turns
        between submissions (`shares`, `barred`): rows that join it (continuous; a group of prompts of at most
        `most_positions` positions, one request at least), or a microbatch into an empty one (static)."""
        if self.refills:
            return admission.take_rows(waiting, room, held, others, shares, barred, most_positions)
        if held:
            return []
        return admission.take(waiting, room, [other.reserved for other in others], shares, barred)

    def check_alone(self, admission: Admission, request: Request) -> None:
        """RequestTooLarge when `request` could never be admitted, even alone (in a slot of its own, or a
        microbatch of its own): it would wait for ever. Each of a submission's requests (a request's choices) is
        a row of its own, admitted without the others where they do not fit together, so each is checked alone."""
        needed = (admission.rows_need([request], [], []) if self.refills else
                  slots_needed([admission.reserve([request])], admission.swapping))
        admission.check_alone(request, needed, joining=self.refills)


CONTINUOUS = SlotPolicy("continuous", refills=True)
STATIC = SlotPolicy("static", refills=False)


def slot_policy(batching: str) -> SlotPolicy:
    """The policy `batching` (checked: `batching.check_batching`) names."""
    return CONTINUOUS if batching == "continuous" else STATIC
