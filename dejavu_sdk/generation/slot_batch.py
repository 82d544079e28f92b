"""A pipeline's slot as the head keeps it (`SlotBatch`): the requests that entered it, their tokens, and the slot's
rounds, from which every continuous result's schedule comes (a static slot's results are `model.generate`'s on its
one microbatch, and carry none)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from .batching import Microbatch, Request, Result, kept_tokens, left_pad, row_fields
from .logprobs import Scores
from .row_specs import Group, RowSpecs
from .shared_prompts import prompt_sources
from .slot_policy import CONTINUOUS, SlotPolicy
from .slots import Round


@attrs.define(eq=False)
class SlotBatch(Microbatch):
    """A slot of a pipeline, as the head keeps it: every request that entered it (a row each, in the
    order they entered), their tokens and when each arrived, the slot's rounds so far (its schedule), which
    rows are in the slot's cache (`present`) or on their way in (`entering`: sent, not joined yet), and whether
    its last round was `idle` (nothing left to run: the slot waits on its first stage for a group)."""

    rounds: list[Round] = attrs.field(factory=list)
    stamps: list[list[float]] = attrs.field(factory=list)
    rows_of: dict[int, int] = attrs.field(factory=dict)  # request number -> row
    present: set[int] = attrs.field(factory=set)
    entering: set[int] = attrs.field(factory=set)
    completed: set[int] = attrs.field(factory=set)  # a group whose prompts are in: it joins at the next round
    opened: bool = False  # whether its first group went to the (token) pipeline's first stage
    idle: bool = False  # its last round ran nothing, and no group went to its first stage since
    #: Disaggregated: the groups prefilled by the prompt pipeline that have not joined yet (their KV is staged on
    #: the token stages under the group's number), by number.
    staged: dict[int, tuple[int, ...]] = attrs.field(factory=dict)
    #: Disaggregated: the prefill of a group whose first tokens came from the prompt pipeline, for the results
    #: of its rows that end with them (the slot reports that prefill with its next round).
    prefilled: Round | None = None
    #: Every group sent into the slot, in order: its fields, prompts and mask (a recovery sends again those whose
    #: prefill had not begun).
    groups: list[tuple[Group, torch.Tensor, torch.Tensor]] = attrs.field(factory=list)
    #: A static slot's microbatches (its groups, one after another), each by the number its results carry.
    numbers: list[int] = attrs.field(factory=list)
    #: The row change the slot's next round opens with (rows that left, the group that joined), as the last stage
    #: reported it with the slot's latest round.
    next_change: tuple[list[int], list[int] | None] = ([], None)
    #: With recovery, each member's generator state after its latest token (sampled rows).
    states: dict[int, torch.Tensor] = attrs.field(factory=dict)
    #: With recovery: the epoch of the last recovery that planned where the slot goes on (rounds reported
    #: before it are not taken after it), where the slot's replica starts over (`serving.slot_replicas.SlotBase`),
    #: and, while a recovery resumes it, the slot as it goes on (`serving.slot_replicas.SlotTrace`).
    plan_epoch: int = 0
    base: Any = None
    resuming: Any = None
    #: The slot's policy (`slot_policy`): continuous batching refills it as rows end; a static slot takes one
    #: group, whose rows stay (ended ones as padding) until the last ends: `model.generate` on that microbatch.
    policy: SlotPolicy = CONTINUOUS

    @classmethod
    def open(cls, number: int, pad: int, policy: SlotPolicy = CONTINUOUS) -> SlotBatch:
        empty = torch.zeros((0, 0), dtype=torch.long)
        return cls(number, [], empty, empty, pad, policy=policy)

    def enter(self, requests: Sequence[Request]) -> tuple[Group, torch.Tensor, torch.Tensor]:
        """Take `requests` in as new rows: what the stages need of them (the group, and their prompts left-padded
        to each other with their mask)."""
        first = len(self.requests)
        sources = prompt_sources(requests, first)
        self.prompt_sources.update(sources)
        for row, request in enumerate(requests, start=first):
            self.requests.append(request)
            self.generated.append([])
            self.stamps.append([])
            self.rows_of[request.number] = row
            self.entering.add(row)
        ids, mask = left_pad([request.ids for request in requests], self.pad)
        specs = RowSpecs([request.max_new_tokens for request in requests],
                         [row_fields(request, row not in sources) for row, request in enumerate(requests, first)])
        return Group([request.number for request in requests], specs), ids, mask

    def leave_unentered(self, members: Sequence[int]) -> list[Request]:
        """The requests of `members` that did not get in (taken out of their group on the first stage, or their
        slot was gone), still unanswered: no longer this slot's to answer."""
        back = []
        for member in members:
            row = self.rows_of[member]
            self.entering.discard(row)
            if row not in self.settled:
                self.settled.add(row)
                self.dropped.add(row)
                back.append(self.requests[row])
        return back

    def add_round(self, step: Round, members: Sequence[int], tokens: Sequence[int], complete: Sequence[int] = (),
                  scores: Scores | None = None) -> None:
        """A round as the last stage reports it: rows left, a group joined, a group's prompt columns ran (and
        whether that was its last: `complete`, its members), each member's new token and log-probabilities."""
        self.rounds.append(self.with_resumed(step))
        self.steps_received += 1
        if step.cached and step.prefill is not None:  # read from the prompt prefixes: the request says so at once
            for member in step.prefill[0]:
                self.requests[self.rows_of[member]].cached = step.cached
        self.present -= {self.rows_of[member] for member in step.left}
        self.present |= self.completed & {self.rows_of[member] for member in step.joined}
        self.entering -= self.completed
        self.completed = {self.rows_of[member] for member in complete}
        if complete:
            self.staged = {number: group for number, group in self.staged.items() if set(group) - set(complete)}
        self.add_tokens(members, tokens, scores)

    def add_tokens(self, members: Sequence[int], tokens: Sequence[int], scores: Scores | None = None) -> None:
        """New tokens of some members (a round's, or a group's first ones from the prompt pipeline), and the
        report's log-probabilities (by member)."""
        now = time.monotonic()
        for member, token in zip(members, tokens, strict=True):
            row = self.rows_of[member]
            self.generated[row].append(token)
            self.stamps[row].append(now)
        self.add_scores(scores, lambda member: self.rows_of[int(member)])

    def held(self) -> list[Request]:
        """The requests whose rows the slot's caches hold or are taking in."""
        return [self.requests[row] for row in sorted(self.present | self.entering)]

    def result(self, row: int, eos: Sequence[int]) -> Result:
        request, stamps = self.requests[row], self.stamps[row]
        kept = kept_tokens(self.generated[row], request.max_new_tokens, request.decoding.ends.ids(eos))
        if not self.policy.refills:  # a microbatch's row: where it sat and its padding, and no schedule
            index, first = 0, 0
            while first + len(self.groups[index][0].members) <= row:
                first += len(self.groups[index][0].members)
                index += 1
            group, _, mask = self.groups[index]
            number = self.numbers[index] if index < len(self.numbers) else self.number
            return Result(torch.tensor(kept, dtype=torch.long), number, row - first, len(group.members),
                          int((mask[row - first] == 0).sum()), request.decoding.seed, request.submitted,
                          stamps[0] if stamps else 0.0, stamps[len(kept) - 1] if kept else 0.0,
                          **self.scores_of(row, len(kept)), cached_positions=request.cached)
        result = Result(torch.tensor(kept, dtype=torch.long), self.number, row, len(self.requests), 0,
                        request.decoding.seed, request.submitted, stamps[0] if stamps else 0.0,
                        stamps[len(kept) - 1] if kept else 0.0, request.number,
                        (*self.rounds, *([self.prefilled] if self.prefilled is not None else [])),
                        **self.scores_of(row, len(kept)), cached_positions=request.cached)
        return result if request.earlier is None else request.earlier.before(result)

    def going_on(self, row: int) -> Request:
        """Row `row`'s request as it goes on in another slot, this slot lost (`Request.going_on`)."""
        kept = len(self.generated[row])
        return self.requests[row].going_on(self.generated[row], self.stamps[row], self.rounds,
                                           self.scores_of(row, kept))

    def with_resumed(self, step: Round) -> Round:
        """`step` with the tokens its prefill's members that go on from earlier slots had (`Round.resumed`)."""
        if step.prefill is None or step.prefill[1] != 0:
            return step
        resumed = tuple((member, earlier.tokens) for member in step.prefill[0]
                        if (earlier := self.requests[self.rows_of[member]].earlier) is not None)
        return attrs.evolve(step, resumed=resumed) if resumed else step
