"""One process, one model, continuous batching: rows join and leave slots between steps.

`Continuous` serves requests as `RoundRobin` does (slots of up to `microbatch` rows stepped in turn, their caches
within a KV budget, swapped or not), except that a slot is never drained: a row that ended leaves at the
next round and a waiting request joins as soon as the slot has room (`slots`: its prompt prefilled beside
the slot's decode steps, `max_prefill_tokens` positions per round). Every result carries its slot's rounds
(`Result.schedule`); `replay.replay` gives the same tokens from them.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import attrs
import torch
from tqdm import tqdm

from ..errors import ConfigError, RequestFailed
from ..swapped_caches import SwappedCaches
from .admission import Admission, Slot, row_bytes
from .batching import Request, Result, left_pad
from .picker import TokenPicker, next_tokens
from .roundrobin import RoundRobin
from .slots import Joining, Round, SlotRows, leave, stack


def check_max_prefill_tokens(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"max_prefill_tokens must be a positive integer or None, got {value!r}")
    return value


#: How microbatches are formed: drained before new requests come in, or refilled between steps.
BATCHING = ("continuous", "static")


def check_batching(batching: Any) -> str:
    if batching not in BATCHING:
        raise ConfigError(f"batching must be one of {', '.join(map(repr, BATCHING))}, got {batching!r}")
    return str(batching)


def runner_for(batching: str, model: Any, *, max_prefill_tokens: int | None = None, **options: Any) -> RoundRobin:
    """The one-process runner of `batching`: `Continuous`, or `RoundRobin` for static microbatches."""
    if check_batching(batching) == "continuous":
        return Continuous(model, max_prefill_tokens=max_prefill_tokens, **options)
    check_max_prefill_tokens(max_prefill_tokens)
    return RoundRobin(model, **options)


@attrs.define(eq=False)
class _Slot:
    """A slot between rounds: its rows, their next input tokens, which have ended (they leave at the next round),
    a group prefilling (`joining`, with its picker) and a group prefilled that joins at the next round
    (`ready`: its rows' cache and rows, picker and first tokens), and the rounds so far."""

    number: int
    rows: SlotRows = attrs.field(factory=SlotRows)
    picker: TokenPicker | None = None
    tokens: torch.Tensor = attrs.field(factory=lambda: torch.zeros(0, dtype=torch.long))
    ended: torch.Tensor = attrs.field(factory=lambda: torch.zeros(0, dtype=torch.bool))
    joining: tuple[Joining, TokenPicker] | None = None
    ready: tuple[Any, SlotRows, TokenPicker, torch.Tensor] | None = None
    rounds: list[Round] = attrs.field(factory=list)

    @property
    def members(self) -> list[int]:
        """Every request the slot holds or is taking in."""
        joining = self.joining[0].members if self.joining is not None else []
        ready = self.ready[1].members if self.ready is not None else []
        return [*self.rows.members, *joining, *ready]

    @property
    def busy(self) -> bool:
        return bool(self.members)


class Continuous(RoundRobin):
    """`RoundRobin` with continuous batching; `max_prefill_tokens` bounds a joining group's prefill per round
    while rows decode beside it (None: all at once)."""

    def __init__(self, model: Any, *, max_prefill_tokens: int | None = None, **options: Any) -> None:
        super().__init__(model, **options)
        self.max_prefill_tokens = check_max_prefill_tokens(max_prefill_tokens)
        self._requests: dict[int, Request] = {}
        self._generated: dict[int, list[int]] = {}
        self._arrived: dict[int, list[float]] = {}

    @torch.no_grad()
    def run(self, requests: list[Request]) -> list[Result]:
        swapping = self._decide(requests)
        self.caches = caches = SwappedCaches(self.model.config, self.device, swapping)
        admission = Admission(self.budget, swapping, self.bytes_per_token)
        self._requests = {request.number: request for request in requests}
        self._generated = {request.number: [] for request in requests}
        self._arrived = {request.number: [] for request in requests}
        waiting, slots, results = deque(requests), deque[_Slot](), {}
        opened = 0  # slots opened so far: the next one's number
        with tqdm(total=sum(request.max_new_tokens for request in requests), desc="continuous", unit="token",
                  disable=not self.progress) as bar:
            while waiting or slots:
                for slot in slots:  # a slot with room takes a group (one at a time)
                    if waiting and slot.joining is None and slot.ready is None:
                        self._join(slot, waiting, admission, slots)
                while waiting:  # new slots while the budget holds them
                    slot = _Slot(opened)
                    if not self._join(slot, waiting, admission, slots):
                        break
                    opened += 1
                    slots.append(slot)
                    self.most_in_flight = max(self.most_in_flight, len(slots))
                for _ in range(len(slots)):
                    slot = slots.popleft()
                    done = self._round(slot, caches)
                    bar.update(sum(len(self._generated[member]) for member in done))
                    results.update({member: self._result(member, slot) for member in done})
                    if slot.busy:
                        slots.append(slot)
        return [results[request.number] for request in requests]

    # ---- admission --------------------------------------------------------------------------------------
    def _join(self, slot: _Slot, waiting: deque[Request], admission: Admission, slots: Any) -> bool:
        """Start prefilling a group of waiting requests in `slot`, as many as it has room for and the budget
        holds beside every other slot's rows; whether any did."""
        others = [self._admitted(other) for other in slots if other is not slot]
        held = [self._requests[member] for member in slot.members]
        taken = admission.take_rows(waiting, self.microbatch - len(held), held, others)
        if not taken:
            return False
        ids, mask = left_pad([request.ids for request in taken], self.rules.pad)
        group = Joining([request.number for request in taken], mask.to(self.device), self._stage.new_cache(),
                        ids.to(self.device))
        slot.joining = (group, TokenPicker(self.model.generation_config,
                                           [request.decoding.fields() for request in taken]))
        return True

    def _admitted(self, slot: _Slot) -> Slot:
        """What `slot` holds, for admission: all its rows, and the group on its way in."""
        entering = [*(slot.joining[0].members if slot.joining is not None else []),
                    *(slot.ready[1].members if slot.ready is not None else [])]
        return Slot(row_bytes([self._requests[member] for member in slot.members], self.bytes_per_token),
                    row_bytes([self._requests[member] for member in entering], self.bytes_per_token))

    # ---- a round ----------------------------------------------------------------------------------------
    def _round(self, slot: _Slot, caches: SwappedCaches) -> list[int]:
        """One round of `slot`: rows that ended leave, a prefilled group joins, the rows decode, and the joining
        group runs its next columns. The requests whose rows ended in it."""
        left = [member for member, ended in zip(slot.rows.members, slot.ended.tolist(), strict=True) if ended]
        joined = list(slot.ready[1].members) if slot.ready is not None else []
        cache = caches.acquire(slot.number) if slot.number in caches else None
        if cache is not None:
            self._leave(slot, cache, left)
        if slot.ready is not None:
            cache = cache if cache is not None else self._stage.new_cache()
            self._stack(slot, cache)
            caches.pin(("group", slot.number), None)
        decoded = tuple(slot.rows.members)
        done = self._decode(slot, cache) if decoded else []
        prefill = None
        if slot.joining is not None:
            group, picker = slot.joining
            start, stop = group.columns(self.max_prefill_tokens)
            prefill = (tuple(group.members), start, stop)
            assert group.ids is not None  # one process: the group keeps its ids
            logits = group.run(self._stage.forward, group.ids[:, start:stop], start, stop)
            caches.pin(("group", slot.number), group.cache)  # on the device until it joins
            if group.complete:
                done += self._first_tokens(slot, group, picker, logits)
                caches.pin(("group", slot.number), slot.ready[0] if slot.ready is not None else None)
        slot.rounds.append(Round(tuple(left), tuple(joined), decoded, prefill))
        if cache is not None:
            self._put_back(slot, caches, cache, changed=bool(left or joined))
        return done

    def _put_back(self, slot: _Slot, caches: SwappedCaches, cache: Any, changed: bool) -> None:
        """Hand the slot's cache back after a round: gone with its last row; swapped as it is now when its rows
        changed (a swapped cache's host copy has the shape it had)."""
        if not slot.rows.members:
            caches.remove(slot.number)
        elif changed:
            caches.remove(slot.number)
            caches.new_cache(slot.number, cache)
            caches.add(slot.number, self._capacity(slot))
        else:
            caches.release(slot.number)

    def _leave(self, slot: _Slot, cache: Any, left: list[int]) -> None:
        if not left:
            return
        keep = [row for row, member in enumerate(slot.rows.members) if member not in set(left)]
        slot.rows = leave(cache, slot.rows, left)
        assert slot.picker is not None  # rows decoded
        slot.picker.keep(keep)
        slot.tokens, slot.ended = slot.tokens[keep], slot.ended[keep]

    def _stack(self, slot: _Slot, cache: Any) -> None:
        if slot.ready is None:
            return
        group_cache, rows, picker, tokens = slot.ready
        slot.rows = stack(cache, slot.rows, group_cache, rows)
        if slot.picker is None or not len(slot.tokens):
            slot.picker = picker
        else:
            slot.picker.extend(picker)
        slot.tokens = torch.cat([slot.tokens, tokens])
        slot.ended = torch.cat([slot.ended, torch.zeros(len(tokens), dtype=torch.bool)])
        slot.ready = None

    def _decode(self, slot: _Slot, cache: Any) -> list[int]:
        mask, positions = slot.rows.next_step()
        logits = self._stage.forward(slot.tokens[:, None], mask, positions, cache)
        counts = [len(self._generated[member]) + 1 for member in slot.rows.members]
        limits = [self._requests[member].max_new_tokens for member in slot.rows.members]
        assert slot.picker is not None
        tokens, ended, failures = next_tokens(slot.picker, logits, slot.ended, counts, limits, self._eos,
                                              self.rules.pad)
        self._raise_first(slot.rows.members, failures)
        self._add(slot.rows.members, tokens.tolist())
        slot.tokens, slot.ended = tokens, ended
        return [member for member, done in zip(slot.rows.members, ended.tolist(), strict=True) if done]

    def _first_tokens(self, slot: _Slot, group: Joining, picker: TokenPicker, logits: torch.Tensor) -> list[int]:
        """The joining group's prompts are in: pick their first tokens. Rows that ended with them leave the group
        at once (the requests returned); the others join at the next round."""
        limits = [self._requests[member].max_new_tokens for member in group.members]
        ended = torch.zeros(len(group.members), dtype=torch.bool)
        tokens, ended, failures = next_tokens(picker, logits, ended, 1, limits, self._eos, self.rules.pad)
        self._raise_first(group.members, failures)
        self._add(group.members, tokens.tolist())
        done = [member for member, end in zip(group.members, ended.tolist(), strict=True) if end]
        keep = [row for row, end in enumerate(ended.tolist()) if not end]
        rows = leave(group.cache, group.rows(), done)
        picker.keep(keep)
        slot.joining = None
        slot.ready = (group.cache, rows, picker, tokens[keep]) if keep else None
        return done

    def _add(self, members: list[int], tokens: list[int]) -> None:
        now = time.monotonic()
        for member, token in zip(members, tokens, strict=True):
            self._generated[member].append(token)
            self._arrived[member].append(now)

    # ---- results ----------------------------------------------------------------------------------------
    def _result(self, member: int, slot: _Slot) -> Result:
        request, arrived = self._requests[member], self._arrived[member]
        return Result(torch.tensor(self._generated[member], dtype=torch.long), slot.number, 0, 0, 0,
                      request.decoding.seed, request.submitted, arrived[0], arrived[-1], member, tuple(slot.rounds))

    def _capacity(self, slot: _Slot) -> int:
        """The positions the slot's cache may reach (its longest row at its end)."""
        return max((row_bytes([self._requests[member]], 1) for member in slot.members), default=0)

    @staticmethod
    def _raise_first(members: list[int], failures: dict[int, Any]) -> None:
        """One process serves one call: a row that could get no token fails the call, naming its request."""
        for row, failure in failures.items():
            raise RequestFailed(failure.reason, members[row], failure.input_error)
