"""What the head's ledger holds, below its decisions: each microbatch in flight (`Flight`, with its `Phase`),
what a decision asks the pipeline to do (`Outcome`), and the ledger's state with the helpers that its
decisions (`ledger.Ledger` and its parts, `ledger_slots.SlotDecisions` and `ledger_slot_resumes.SlotResumes`)
use."""

from __future__ import annotations

import enum
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import attrs
import torch

from ...errors import RequestFailed, TransportError
from ...generation.admission import Admission
from ...generation.batching import Request, Result
from ...generation.decoding import RowFailure
from ...generation.row_specs import Group
from ...generation.slot_batch import SlotBatch
from ...generation.slot_policy import CONTINUOUS, SlotPolicy
from ...generation.turns import shares_of
from ..layout import Layout
from ..wire.messages import Message

#: Why a microbatch in flight at two recoveries in a row, without a new token between them, fails: whatever
#: it carries may be what kills the stages, and it must not hold the pipeline in recoveries.
POISON = ("it was in flight at two recoveries in a row without making progress; it is not tried again, so that "
          "no request can hold the pipeline in recoveries")


class Phase(enum.Enum):
    """Where a microbatch in flight is."""

    DECODING = "decoding"  # in the mixed or token pipeline (its groups may still be in the prompt pipeline)
    ENDED = "ended"  # every row ended; its caches are being freed


@attrs.define(eq=False)
class Flight:
    """One microbatch (slot) in flight: its rows, phase, reserved KV bytes (per stage, at its end), the time of its
    last progress (None: not watched), whether every stage freed its cache already, and whether it was opened
    `beside` the layout's microbatches for the submissions held back (`LedgerState.held_back`): only requests of
    submissions with no row elsewhere join it."""

    batch: SlotBatch
    phase: Phase
    reserved: int
    progress: float | None
    freed: bool = False
    beside: bool = False


Answer = tuple["Future[Result]", Any]  # a future and its result or error


@attrs.define
class Outcome:
    """What a decision asks the pipeline to do: `sends` (stage index, message), `answers` (future, result or
    error) and `calls` (a request's `on_token` with a token, or its `on_logprobs` with log-probabilities)."""

    sends: list[tuple[int, Message]] = attrs.field(factory=list)
    answers: list[Answer] = attrs.field(factory=list)
    calls: list[tuple[Callable[[Any], None], Any]] = attrs.field(factory=list)


@attrs.frozen
class PromptGroup:
    """Disaggregated: a group of requests in the prompt pipeline, bound for slot `slot`: what its slot's first
    token stage needs of it (`group`: its members, limits and decodings) and its prompts' mask."""

    slot: int
    group: Group
    mask: torch.Tensor


class LedgerState:
    """The state of every request the pipeline holds, under one lock. `eos` are the ids a row ends at, `pad`
    the padding id, `admission` the KV budget's rule, `token_slots` the microbatches the token side may hold,
    `policy` the slots' (`generation.slot_policy`: batching), `prefill_tokens` the positions of a joining
    group's prompts a round runs, and `prefixes` whether the stages read prompt prefixes (a continuous slot's
    groups then take one prompt each, so that each reads its own)."""

    def __init__(self, layout: Layout, microbatch: int, token_slots: int, eos: list[int], pad: int,
                 admission: Admission, epoch: Callable[[], int] = lambda: 0, policy: SlotPolicy = CONTINUOUS,
                 prefill_tokens: int | None = None, prefixes: bool = False) -> None:
        self.layout, self.microbatch, self.token_slots = layout, microbatch, token_slots
        #: Every microbatch is a slot (`ledger_slots`), under one policy; a joining group is prefilled
        #: `prefill_tokens` positions a round (None: at once).
        self.policy, self.prefill_tokens, self.prefixes = policy, prefill_tokens, prefixes
        self.eos, self.pad, self.admission = eos, pad, admission
        #: The pipeline's epoch now: every message the ledger decides carries the epoch it was decided in (a
        #: recovery raises it under this lock, so a decision made before it is dropped by the stages after it).
        self.epoch = epoch
        self.lock = threading.Lock()
        self.waiting: deque[Request] = deque()
        self.flights: dict[int, Flight] = {}
        self.failure: TransportError | None = None
        self.held = False  # a recovery is under way: nothing new starts
        #: The most microbatches that held rows at once (in their caches, or on their way in).
        self.most_in_flight = 0
        self.next_number = 0
        #: Disaggregated: the groups in the prompt pipeline, by their microbatch number.
        self.prompting: dict[int, PromptGroup] = {}

    def renumber_from(self, number: int) -> None:
        """Number new microbatches from `number` on, at least (those below are held by stages already; under the
        lock)."""
        self.next_number = max(self.next_number, number)

    def holding(self) -> list[Flight]:
        """Microbatches whose caches some stage may hold: in flight, or ended and not yet freed everywhere."""
        return [flight for flight in self.flights.values() if not flight.freed]

    # ---- under the lock ---------------------------------------------------------------------------------
    def shares(self, besides: Flight | None = None) -> Counter[int]:
        """The rows each submission holds in flight, not yet answered (in every microbatch but `besides`)."""
        rows: list[Request] = []
        for flight in self.holding():
            batch = flight.batch
            if flight is besides:
                continue
            live = batch.present | batch.entering
            rows += [batch.requests[row] for row in live if row not in batch.settled]
        return shares_of(rows)

    def held_back(self) -> bool:
        """Whether a waiting submission holds no row while another holds more than its fair share of the rows the
        layout's microbatches have (one per stage, or per token slot; shared by every submission in flight or
        waiting): a microbatch may then open beside them for the former (`Flight.beside`)."""
        shares = self.shares()
        waiting = {request.group for request in self.waiting if not request.future.cancelled()}
        fair = max(1, self.microbatch * self.layout_microbatches() // max(1, len(waiting | set(shares))))
        return any(group not in shares for group in waiting) and any(rows > fair for rows in shares.values())

    def layout_microbatches(self) -> int:
        """The microbatches the layout keeps in flight: a slot per stage (per token stage, disaggregated), or a
        static microbatch per stage (per token slot, disaggregated)."""
        if not self.layout.disaggregated:
            return len(self.layout.stages)
        return self.layout.token_depth if self.policy.refills else self.token_slots

    def barred(self, flight: Flight | None) -> set[int]:
        """The submissions that may not take rows in `flight` (opened beside the others, or about to be): those
        holding rows in another microbatch."""
        return set(self.shares(besides=flight)) if flight is not None and flight.beside else set()

    @staticmethod
    def failed_rows(batch: SlotBatch, failures: dict[int, RowFailure]) -> list[Answer]:
        """The errors due to the rows of `batch` that failed (by row, as the last stage reported them); they
        count as answered, and dropped, from now on."""
        answers: list[Answer] = []
        for row, failure in failures.items():
            if row not in batch.settled:
                batch.settled.add(row)
                batch.dropped.add(row)
                error = RequestFailed(failure.reason, batch.requests[row].number, failure.input_error)
                answers.append((batch.requests[row].future, error))
        return answers

    def ended_rows(self, batch: SlotBatch) -> list[Answer]:
        """The results due to the rows of `batch` that came to their end with its latest step."""
        rows = batch.ended_rows(self.eos)
        batch.settled.update(rows)
        return [(batch.requests[row].future, batch.result(row, self.eos)) for row in rows]


def _fail_rows(batch: SlotBatch, error: str, rows: Sequence[int] | None = None) -> list[Answer]:
    """A `RequestFailed` for each row of `batch` (of `rows`) not answered yet, which now are."""
    rows = [row for row in (range(len(batch.requests)) if rows is None else rows) if row not in batch.settled]
    batch.settled.update(rows)
    return [(batch.requests[row].future, RequestFailed(error, batch.requests[row].number)) for row in rows]


