"""One process, one model, one scheduler: requests served in slots of up to `microbatch` rows, the slots
stepped in turn (round robin), their caches within a device budget for their KV, all on the device or swapped
(`swapped_caches.SwappedCaches`: in host memory with two on the device, so that about twice as many fit).

Each batching is a policy of the same slots:
- `"static"`: a slot takes its rows in only while it is empty, all at once (arrival order, left padded, its
  prompts prefilled `max_prefill_tokens` positions a round: one step without a budget), and keeps the rows that
  ended as padding (fed the pad token) until its longest row ends: each slot is `model.generate` on its rows
  (with `prefill_chunk_size=max_prefill_tokens // rows`), and its results are a microbatch's (row, padding). The
  group's cache is the slot's from its first chunk, so with swapping it waits in host memory between chunks;
- `"continuous"`: a slot is never drained: a row that ended leaves at the next round and a waiting request joins
  as soon as the slot has room (`slots`: its prompt prefilled beside the slot's decode steps,
  `max_prefill_tokens` positions per round). Every result carries its slot's rounds (`Result.schedule`);
  `replay.replay` gives the same tokens from them.

With a prefix cache (`prefix`, a `PrefixReuse`) a group of one prompt starts from the chunks it finds there and
keeps its new ones (a padded group of several neither reads nor keeps: its chunk boundaries are not its rows'
positions), every prompt is prefilled one chunk a round (`max_prefill_tokens` is the chunk), and continuous
batching takes waiting prompts into a slot one at a time, so that each can read and keep. A group's chunks read
are its first round's prefill (`slots.Round`), so replaying the schedule computes them as they were kept.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from tqdm import tqdm

from ..errors import ConfigError, RequestFailed
from ..prefix.reuse import PrefixReuse
from ..swapped_caches import SwappedCaches
from ..swapping import (
    SwapChoice,
    check_budget,
    check_fits_alone,
    check_swapping,
    choose_swapping,
    kv_bytes_per_token,
    measure_host_bandwidth,
)
from ..timing import measure_times
from .adapters import adapter_for
from .admission import Admission, Slot
from .batching import (
    Request,
    Result,
    cache_bytes,
    check_batching,
    check_max_prefill_tokens,
    check_new_tokens,
    check_prompt,
    left_pad,
)
from .decoding import Decoding, TokenRules
from .picker import TokenPicker, next_tokens
from .slot_policy import slot_policy
from .slots import Joining, Round, SlotRows, leave, stack
from .stage import Stage

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class _Slot:
    """A slot between rounds: its rows, their next input tokens, which have ended (they leave at the next round),
    a group prefilling (`joining`, with its picker) and a group prefilled that joins at the next round
    (`ready`: its rows' cache and rows, picker, first tokens and which rows ended with them), and the rounds so
    far."""

    number: int
    rows: SlotRows = attrs.field(factory=SlotRows)
    picker: TokenPicker | None = None
    tokens: torch.Tensor = attrs.field(factory=lambda: torch.zeros(0, dtype=torch.long))
    ended: torch.Tensor = attrs.field(factory=lambda: torch.zeros(0, dtype=torch.bool))
    joining: tuple[Joining, TokenPicker] | None = None
    ready: tuple[Any, SlotRows, TokenPicker, torch.Tensor, torch.Tensor] | None = None
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


class RoundRobin:
    """Serves requests in slots stepped in turn on `model`, batched `batching` ("static" or "continuous", as the
    module says; `max_prefill_tokens` bounds a slot's prefill per round, None: all at once),
    their caches within `kv_budget_bytes` of device memory (None: no limit), swapped to host memory
    (`swapping=True`), not (`False`) or as `choose_swapping` decides from the measured step time and host
    bandwidth (`"auto"`; `choice` then says what and why). `prefix` and `salt`: the prefix cache prompts read
    from and keep in, with their tenant's salt (the module).

    Admission keeps the caches' final sizes within the budget: without swapping all of the slots in flight, with
    swapping the two largest (any two may be on the device at once). A static slot reserves its microbatch's
    cache (rows x (longest prompt + largest max_new_tokens - 1)); a continuous one each row at its longest row's
    final length, and a group on its way in its own cache (`Admission.take_rows`). A budget that cannot hold a
    single request's cache (two with swapping) is a ConfigError before anything runs.
    """

    def __init__(self, model: Any, *, microbatch: int = 4, kv_budget_bytes: int | None = None,
                 swapping: bool | str = "auto", progress: bool = False, batching: str = "static",
                 max_prefill_tokens: int | None = None, prefix: PrefixReuse | None = None, salt: str = "") -> None:
        #: "static" or "continuous": whether a slot refills between steps (see the module).
        self.batching = check_batching(batching)
        self.policy = slot_policy(self.batching)
        self.max_prefill_tokens = check_max_prefill_tokens(max_prefill_tokens)
        self.prefix, self.salt = prefix, salt
        if prefix is not None:
            if self.max_prefill_tokens not in (None, prefix.chunk):
                raise ConfigError(f"max_prefill_tokens={max_prefill_tokens!r} with a prefix cache of {prefix.chunk}-"
                                  "position chunks: prompts are prefilled a chunk a round (leave it out)")
            self.max_prefill_tokens = prefix.chunk
        if isinstance(microbatch, bool) or not isinstance(microbatch, int) or microbatch < 1:
            raise ConfigError(f"microbatch must be a positive integer, got {microbatch!r}")
        self.budget = check_budget(kv_budget_bytes)
        self.swapping = check_swapping(swapping)
        self.rules = TokenRules.of(model)
        self.model, self.microbatch, self.progress = model, microbatch, progress
        self.device = next(model.parameters()).device
        self.bytes_per_token = kv_bytes_per_token(model.config, next(model.parameters()).dtype)
        self.choice: SwapChoice | None = None
        self.caches: SwappedCaches | None = None
        self.most_in_flight = 0  # the most microbatches that were in flight at once
        self._stage = Stage(model, (0, _layer_count(model)))  # the whole model (ConfigError: no adapter)
        self._requests: dict[int, Request] = {}
        self._generated: dict[int, list[int]] = {}
        self._arrived: dict[int, list[float]] = {}
        self._placed: dict[int, tuple[int, int, int]] = {}  # a static slot's member: its row, the rows, its padding
        self._cached: dict[int, int] = {}  # each request's prompt positions read from the prefix cache

    def requests(self, prompts: Sequence[Any], max_new_tokens: int | Sequence[int],
                 decoding: Decoding) -> list[Request]:
        """Checked requests for `prompts`, with one `max_new_tokens` for all or one each (ConfigError for any bad
        one, before anything runs)."""
        if decoding.do_sample and self.rules.sampling_refused is not None:
            raise self.rules.sampling_refused
        if not prompts:
            raise ConfigError("no prompts to generate from")
        limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(limits) != len(prompts):
            raise ConfigError(f"{len(limits)} max_new_tokens for {len(prompts)} prompts")
        checked = []
        for ids, limit in zip(prompts, limits, strict=True):
            prompt = check_prompt(ids, self.rules.context, self.rules.vocabulary)
            checked.append(Request(prompt, check_new_tokens(limit, prompt.numel(), self.rules.context), decoding))
        return checked

    @torch.no_grad()
    def run(self, requests: list[Request]) -> list[Result]:
        """Serve `requests` to the end; their results in the same order."""
        swapping = self._decide(requests)
        self.caches = caches = SwappedCaches(self.model.config, self.device, swapping)
        admission = Admission(self.budget, swapping, self.bytes_per_token)
        self._requests = {request.number: request for request in requests}
        self._generated = {request.number: [] for request in requests}
        self._arrived = {request.number: [] for request in requests}
        waiting, slots, results = deque(requests), deque[_Slot](), {}
        opened = 0  # slots opened so far: the next one's number
        with tqdm(total=sum(request.max_new_tokens for request in requests),
                  desc=self.batching, unit="token", disable=not self.progress) as bar:
            while waiting or slots:
                for slot in slots:  # a slot with room takes a group (one at a time), as its policy admits
                    if waiting and self.policy.admits(slot.members) and slot.joining is None and slot.ready is None:
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

    # ---- swapping --------------------------------------------------------------------------------------
    def _decide(self, requests: list[Request]) -> bool:
        """Swap or not; ConfigError when the budget cannot hold one request (two with `swapping=True`)."""
        alone = max(cache_bytes([request], self.bytes_per_token) for request in requests)
        check_fits_alone(alone, self.budget, False)
        if self.swapping == "auto":
            self.choice = self._choose(requests, alone)
            log.info("swapping %s: %s", "on" if self.choice.swapping else "off", self.choice.reason)
            return self.choice.swapping
        check_fits_alone(alone, self.budget, bool(self.swapping))
        return bool(self.swapping)

    def _choose(self, requests: list[Request], alone: int) -> SwapChoice:
        groups = [requests[start:start + self.microbatch] for start in range(0, len(requests), self.microbatch)]
        reservations = [cache_bytes(group, self.bytes_per_token) for group in groups]
        batch = len(groups[0])
        prompt = int(statistics.median(request.ids.numel() for request in requests))
        new = int(statistics.median(request.max_new_tokens for request in requests))

        def measure() -> tuple[float, float]:
            _, token_time = measure_times(self.model, batch, prompt, repeats=2, progress=self.progress)
            return token_time, measure_host_bandwidth(self.device, max(reservations))

        return choose_swapping(fits_without=self.budget is None or sum(reservations) <= self.budget, batch=batch,
                               prompt_tokens=prompt, new_tokens=new, cache_bytes_per_token=self.bytes_per_token,
                               device_is_host=self.device.type != "cuda",
                               two_slots=self.budget is None or 2 * alone <= self.budget, measure=measure)

    # ---- slots taking rows in --------------------------------------------------------------------------------------
    def _join(self, slot: _Slot, waiting: deque[Request], admission: Admission, slots: Any) -> bool:
        """Start prefilling a group of waiting requests in `slot`, as many as it has room for and the budget
        holds beside every other slot's rows; whether any did."""
        others = [self._admitted(other) for other in slots if other is not slot]
        held = [self._requests[member] for member in slot.members]
        room = self.microbatch - len(held)
        if self.prefix is not None and self.policy.refills:
            room = min(room, 1)  # one prompt a group: each reads and keeps its own chunks
        taken = self.policy.take(admission, waiting, room, held, others)
        if not taken:
            return False
        ids, mask = left_pad([request.ids for request in taken], self.rules.pad)
        self._placed.update({request.number: (row, len(taken), int((mask[row] == 0).sum()))
                             for row, request in enumerate(taken)})
        assert self.caches is not None  # running
        ids, mask, cache = ids.to(self.device), mask.to(self.device), self._stage.new_cache()
        read = self.prefix.restore(ids, mask, cache, self.salt) if self.prefix is not None and len(taken) == 1 else 0
        group = Joining([request.number for request in taken], mask, cache, ids, done=read, cached=read)
        slot.joining = (group, TokenPicker(self.model.generation_config,
                                           [request.decoding.fields() for request in taken]))
        return True

    def _admitted(self, slot: _Slot) -> Slot:
        """What `slot` holds, for admission: all its rows, and the group on its way in."""
        entering = [*(slot.joining[0].members if slot.joining is not None else []),
                    *(slot.ready[1].members if slot.ready is not None else [])]
        return self.policy.admitted([self._requests[member] for member in slot.members],
                                    [self._requests[member] for member in entering], self.bytes_per_token)

    # ---- a round ----------------------------------------------------------------------------------------
    def _round(self, slot: _Slot, caches: SwappedCaches) -> list[int]:
        """One round of `slot`: rows that ended leave, a prefilled group joins, the rows decode, and the joining
        group runs its next columns (static: the rows leave together once the last ended, and a group becomes
        the rows as its prompts are in). The requests whose rows ended in it."""
        left = self.policy.leaving(slot.rows.members, slot.ended.tolist())  # (static: all left after their round)
        joined = list(slot.ready[1].members) if slot.ready is not None else []
        cache = caches.acquire(slot.number) if slot.number in caches else None
        acquired = cache is not None
        if cache is not None:
            self._leave(slot, cache, left)
        if slot.ready is not None:
            cache = cache if cache is not None else self._stage.new_cache()
            self._stack(slot, cache)
            caches.pin(("group", slot.number), None)
        decoded = tuple(slot.rows.members)
        done = self._decode(slot, cache) if decoded else []
        if not self.policy.refills:  # a static slot's rows leave together, right after the round they all ended in
            self._leave(slot, cache, self.policy.leaving(decoded, slot.ended.tolist()))
        prefill, cached = None, 0  # (cached: the positions a group starting this round read)
        if slot.joining is not None:
            group, picker = slot.joining
            start, stop = group.columns(self.max_prefill_tokens)
            cached = group.cached if start == group.cached > 0 else 0  # its first round: those columns count too
            prefill = (tuple(group.members), start - cached, stop)
            assert group.ids is not None  # one process: the group keeps its ids
            if not self.policy.refills:  # a static slot is empty: its group's cache is the slot's from its first
                # columns on (new then, brought back at the others), held and swapped as every slot's
                cache = group.cache = cache if cache is not None else caches.new_cache(slot.number, group.cache)
            logits = group.run(self._stage.forward, group.ids[:, start:stop], start, stop)
            if self.policy.refills:
                caches.pin(("group", slot.number), group.cache)  # on the device until it joins
            if group.complete:
                self._keep(group)
            if group.complete and not self.policy.refills:
                done += self._fill(slot, group, picker, logits)
            elif group.complete:
                done += self._first_tokens(slot, group, picker, logits)
                caches.pin(("group", slot.number), slot.ready[0] if slot.ready is not None else None)
        chunk = self.prefix.chunk if self.prefix is not None and cached else 0
        slot.rounds.append(Round(tuple(left), tuple(joined), decoded, prefill, chunk, cached=cached))
        if cache is not None:
            self._put_back(slot, caches, cache, changed=bool(left or joined) or not acquired)
        if slot.joining is not None and not self.policy.refills:
            slot.joining[0].cache = None  # the slot holds it (and may swap it out) until the next round
        return done

    def _keep(self, group: Joining) -> None:
        """A group whose prompts are in: what each read from the prefix cache, and a group of one prompt keeps its
        whole chunks past those there."""
        self._cached.update(dict.fromkeys(group.members, group.cached))
        if self.prefix is not None and len(group.members) == 1:
            assert group.ids is not None  # one process: the group keeps its ids
            assert group.cache is not None  # it ran its last columns
            self.prefix.keep(group.ids, group.mask, group.cache, group.cached, self.salt)

    def _put_back(self, slot: _Slot, caches: SwappedCaches, cache: Any, changed: bool) -> None:
        """Hand the slot's cache back after a round: gone with its last row; swapped as it is now when its rows
        changed (a swapped cache's host copy has the shape it had)."""
        if not slot.rows.members and (self.policy.refills or slot.joining is None):  # (a static group held is no loss)
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
        group_cache, rows, picker, tokens, ended = slot.ready
        slot.rows = stack(cache, slot.rows, group_cache, rows)
        if slot.picker is None or not len(slot.tokens):
            slot.picker = picker
        else:
            slot.picker.extend(picker)
        slot.tokens = torch.cat([slot.tokens, tokens])
        slot.ended = torch.cat([slot.ended, ended])
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
        live = [row for row, was in enumerate(slot.ended.tolist()) if not was]  # a static slot's ended rows pad
        self._add([slot.rows.members[row] for row in live], [int(tokens[row]) for row in live])
        slot.tokens, slot.ended = tokens, ended
        return [slot.rows.members[row] for row in live if bool(ended[row])]

    def _first_tokens(self, slot: _Slot, group: Joining, picker: TokenPicker, logits: torch.Tensor) -> list[int]:
        """The joining group's prompts are in: pick their first tokens. Rows that ended with them leave the group
        at once (the requests returned); the others join at the next round."""
        tokens, ended = self._pick_first(group, picker, logits)
        done = [member for member, end in zip(group.members, ended.tolist(), strict=True) if end]
        slot.joining = None
        keep = [row for row, end in enumerate(ended.tolist()) if not end]
        rows = leave(group.cache, group.rows(), done)
        picker.keep(keep)
        slot.ready = (group.cache, rows, picker, tokens[keep], ended[keep]) if keep else None
        return done

    def _fill(self, slot: _Slot, group: Joining, picker: TokenPicker, logits: torch.Tensor) -> list[int]:
        """A static slot's prompts are in: its group becomes its rows at once (its cache is the slot's already),
        ended or not; the requests that ended with their first tokens."""
        tokens, ended = self._pick_first(group, picker, logits)
        slot.joining = None
        if not bool(ended.all()):
            slot.rows, slot.picker, slot.tokens, slot.ended = group.rows(), picker, tokens, ended
        return [member for member, end in zip(group.members, ended.tolist(), strict=True) if end]

    def _pick_first(self, group: Joining, picker: TokenPicker, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A group's first tokens, and which rows ended with them."""
        limits = [self._requests[member].max_new_tokens for member in group.members]
        tokens, ended, failures = next_tokens(picker, logits, torch.zeros(len(limits), dtype=torch.bool), 1, limits,
                                              self._eos, self.rules.pad)
        self._raise_first(group.members, failures)
        self._add(group.members, tokens.tolist())
        return tokens, ended

    def _add(self, members: list[int], tokens: list[int]) -> None:
        now = time.monotonic()
        for member, token in zip(members, tokens, strict=True):
            self._generated[member].append(token)
            self._arrived[member].append(now)

    # ---- results ----------------------------------------------------------------------------------------
    def _result(self, member: int, slot: _Slot) -> Result:
        request, arrived = self._requests[member], self._arrived[member]
        tokens = torch.tensor(self._generated[member], dtype=torch.long)
        if not self.policy.refills:  # a microbatch's row: where it sat and its padding, and no schedule
            row, rows, padding = self._placed[member]
            return Result(tokens, slot.number, row, rows, padding, request.decoding.seed, request.submitted,
                          arrived[0], arrived[-1], cached_positions=self._cached.get(member, 0))
        return Result(tokens, slot.number, 0, 0, 0, request.decoding.seed, request.submitted, arrived[0],
                      arrived[-1], member, tuple(slot.rounds), cached_positions=self._cached.get(member, 0))

    def _capacity(self, slot: _Slot) -> int:
        """The positions the slot's cache may reach: its longest row at its end (static: its longest prompt and
        its largest max_new_tokens, as its rows are padded)."""
        requests = [self._requests[member] for member in slot.members]
        return max(self.policy.finals([request.ids.numel() for request in requests],
                                      [request.max_new_tokens for request in requests]), default=0)

    @staticmethod
    def _raise_first(members: list[int], failures: dict[int, Any]) -> None:
        """One process serves one call: a row that could get no token fails the call, naming its request."""
        for row, failure in failures.items():
            raise RequestFailed(failure.reason, members[row], failure.input_error)

    @property
    def _eos(self) -> torch.Tensor:
        return torch.tensor(self.rules.eos, dtype=torch.long)


def _layer_count(model: Any) -> int:
    return len(adapter_for(model).decoder_layers())
