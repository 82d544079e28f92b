"""What a stage worker holds between messages: where its stage sits (`Role`), each slot's state (`SlotState`), its
caches, its links to the stages around it (`open_links`), and what tells it that the
head is gone (`HeadWatch`, raising `HeadGone`).

`WorkerState` is the base of `worker.StageWorker`: both the step path (`worker`) and the head's recovery
messages (`worker.recovery`) change this state, so it sits below them both; `bootstrap` opens a new worker's
links with the same `open_links` that a recovery's `relink` uses, and its `Heartbeat` is the `HeadWatch`.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

import attrs
import torch

from ...backends import open_store, open_transport
from ...errors import TransportError
from ...generation.logprobs import Scores, prompt_scores
from ...generation.picker import TokenPicker
from ...generation.row_specs import RowSpecs
from ...generation.slot_policy import slot_policy
from ...generation.slots import Joining, SlotRows, WindowState
from ...generation.stage import Stage
from ...prefix.reuse import PrefixReuse
from ...store import Store
from ...stream import LayerPartition
from ...swapped_caches import SwappedCaches
from ...transports.base import Server, Transport
from ..kv.replication import Replicator
from ..kv.slot_replicas import SlotPieces, SlotReplicas
from ..wire.link_tls import LinkTls, link_options
from ..wire.messages import Columns, Enter, EpochMessage, Links, Message, RoundDone, pack
from .handoff import LayerSender, StagedKV
from .thread_share import ThreadShare

#: A stage's open links: to the next stage, the last stage's back to the first, a prompt stage's to the token
#: stages, and a decoding stage's to the holder of its replicas.
OpenLinks = tuple[Transport | None, Transport | None, LayerSender | None, Replicator | None]


class HeadGone(TransportError):
    """The head no longer answers: the worker stops serving its stage, whatever its recovery settings, and may
    wait for a successor (`epoch`: the one it served in, for the successor to go beyond; `held`: the microbatches
    it keeps for the successor to take over, as `Holdings`, or None)."""

    epoch = 0
    held: Holdings | None = None


@attrs.frozen
class Holdings:
    """What an orphaned worker keeps for a successor head: its slots' states, and their caches (a successor takes
    them over, or tells it to drop them)."""

    slots: dict[int, SlotState]
    caches: SwappedCaches


class HeadWatch(Protocol):
    """What tells a worker's loop that the head is gone (`bootstrap.Heartbeat`)."""

    def check(self) -> None:
        """Raise `HeadGone` once the head no longer answers."""


@attrs.frozen
class Role:
    """Where a stage sits: `kind` is "mixed" (prompts and tokens), "prompt" or "token"; `number` of `stages` in
    its own pipeline; `name` as errors show it."""

    kind: str
    number: int
    stages: int
    name: str

    @property
    def last(self) -> bool:
        return self.number == self.stages - 1

    @property
    def decodes(self) -> bool:
        return self.kind != "prompt"


@attrs.define
class SlotState:
    """What one stage keeps of a slot between rounds (its cache is in the worker's `caches` once it has rows).

    `finals` is each member's cache length at its end (the slot's capacity). The first stage keeps the groups
    waiting to enter (`queued`), and whether the slot is `parked` (a round found nothing to run: the next group
    to enter starts one); the last stage the slot's picker, which rows have ended, each member's token count
    and limit, the requests cancelled, and a finished group's picker and first tokens.

    With recovery, a stage also counts the slot's rounds it ran (`round`), keeps what the last one ran (`last`:
    whether rows decoded, and the prefill columns) and its sliding-window layers as they were before it
    (`windows`: the slot cache's, the joining group's) so that a recovery can take it back, the round at which the
    joining group's prefill began (`started`: it names the group's replica piece), and what it has written of
    the slot's replica (`pieces`)."""

    rows: SlotRows = attrs.field(factory=SlotRows)
    joining: Joining | None = None
    ready: tuple[Any, SlotRows] | None = None
    round: int = 0
    last: tuple[bool, Columns | None] | None = None
    windows: tuple[list[WindowState], list[WindowState]] = ([], [])  # the slot's and the group's, before `last`
    started: int | None = None
    pieces: SlotPieces = attrs.field(factory=SlotPieces)
    finals: dict[int, int] = attrs.field(factory=dict)
    queued: deque[Enter] = attrs.field(factory=deque)
    parked: bool = False
    # prompt prefixes (`slot_prefixes`): the joining group's chunk names; the first stage's group that started last
    # (to start it again where a stage found fewer chunks), and the most positions the next group may read
    digests: tuple[str, ...] = ()
    starting: Enter | None = None
    read_cap: int | None = None
    # the last stage's
    picker: TokenPicker | None = None
    ended: torch.Tensor = attrs.field(factory=lambda: torch.zeros(0, dtype=torch.bool))
    counts: dict[int, int] = attrs.field(factory=dict)
    limits: dict[int, int] = attrs.field(factory=dict)
    cancelled: set[int] = attrs.field(factory=set)
    joining_picker: TokenPicker | None = None
    joining_decodings: list[dict[str, Any]] = attrs.field(factory=list)  # the joining group's rows' decodings
    prompt_logprobs: dict[str, Any] = attrs.field(factory=dict)  # this round's chunk's, by member
    ready_picker: TokenPicker | None = None
    ready_tokens: torch.Tensor | None = None
    ready_ended: torch.Tensor | None = None  # which of them ended with their first token (static: they stay)
    #: The last stage's: every round's report to the head (what it did, and its tokens), so that a successor head
    #: can take the slot over; None once a recovery rebuilt the slot here (its earlier rounds are not known).
    reports: list[tuple[RoundDone, list[int], Scores]] | None = attrs.field(factory=list)


@attrs.define
class PromptRun:
    """A microbatch of prompts on a prompt stage while they are prefilled: its rows' specs, the rows the head
    ended already, the prompts' `Joining` (ids on the first stage), the columns a step runs (`chunk`, once more
    than one step runs), and on the last stage the prompt log-probabilities so far (by row)."""

    specs: RowSpecs
    ended: list[int]
    joining: Joining
    chunk: int = 0
    prompt_logprobs: dict[str, Any] = attrs.field(factory=dict)


def open_link(url: str, timeout: float | None = None) -> Transport:
    """A link to another inbox of this worker's pipeline (the token, and TLS, from the worker's environment); each
    message must reach it within `timeout` seconds (the pipeline's; None: the transport's default), so that a
    neighbour stopped or cut off holds a stage up no longer than that."""
    options = {} if timeout is None else {"timeout": timeout}
    return open_transport(url, **options, **link_options(LinkTls.from_environment()))


def open_links(links: Links, role: Role) -> OpenLinks:
    """A stage's links, as its assignment (or a recovery's `Relink`) gives them: to the next stage of its pipeline,
    the last stage's back to the first, a prompt stage's to the token stages, and a decoding stage's to the holder
    of its replicas."""
    timeout = links.link_timeout
    following = open_link(links.next, timeout) if links.next else None
    first = open_link(links.first, timeout) if role.decodes and role.last else None
    token_links = [open_link(url, timeout) for url in links.token_stages]
    sender = LayerSender(token_links, LayerPartition(links.token_boundaries)) if token_links else None
    replicator = None
    start, stop = links.layers
    prefix = links.replica_prefix
    if links.replica_store:
        replicator = Replicator(open_store(links.replica_store), role.number, stop - start, prefix)
    elif links.holder:
        replicator = Replicator(Store(open_link(links.holder, timeout)), role.number, stop - start, prefix)
    return following, first, sender, replicator


class WorkerState:
    """One assigned stage's state: its microbatches, their caches and the KV received for them, its links.

    `following` is the next stage of its pipeline; `first` the last stage's way back to its pipeline's first
    stage (the next step's tokens); `sender` a prompt stage's link to the token stages.
    """

    def __init__(self, stage: Stage, role: Role, inbox: Server, head: Transport, following: Transport | None,
                 first: Transport | None, eos: list[int], pad: int, sender: LayerSender | None = None,
                 swapping: bool = False, heartbeat: HeadWatch | None = None, replicator: Replicator | None = None,
                 recovery: bool = False, epoch: int = 0, replica_prefix: str = "", batching: str = "static",
                 max_prefill_tokens: int | None = None) -> None:
        self.stage, self.role, self.inbox, self.head, self.heartbeat = stage, role, inbox, head, heartbeat
        self.following, self.first, self.sender, self.pad = following, first, sender, pad
        #: Where the worker's threads follow the cores the machine's other processes leave idle (else None).
        self.thread_share: ThreadShare | None = None
        #: Decoding stages with recovery: streams each microbatch's cache to the next decoding stage.
        self.replicator = replicator
        #: With recovery, a lost neighbour is reported and waited out; the head's `pause` starts a new `epoch`.
        self.recovery, self.epoch = recovery, epoch
        self.prefix = replica_prefix  # of the replica streams, this pipeline's
        #: The tiers this stage reads its layers' prompt prefixes from and keeps them in (`slot_prefixes`; None: none).
        self.prefixes: PrefixReuse | None = None
        self.reported_epoch = -1  # the epoch in which a lost link was last reported
        self.restored_pieces: dict[int, dict[str, torch.Tensor]] = {}  # a replacement's: its slots' replica pieces
        self.eos = torch.tensor(eos, dtype=torch.long)  # a row ends at any of them
        #: Each microbatch is a slot (`worker.slots`) under the batching's policy (`generation.slot_policy`), a
        #: joining group prefilled `max_prefill_tokens` positions a round (None: at once). A static slot keeps its
        #: one group's rows (ended ones as padding) until the last ends, its prompts prefilled in chunks of the same
        #: budget, as `model.generate` runs a batch with `prefill_chunk_size` (one step without a budget).
        self.policy = slot_policy(batching)
        self.max_prefill_tokens = max_prefill_tokens
        self.slots: dict[int, SlotState] = {}
        #: The decoding microbatches' KV caches: on the device, or swapped to host memory with two on the device.
        self.caches = SwappedCaches(stage.config, next(stage.adapter.model.parameters()).device,
                                    swapping and role.kind != "prompt")  # a prompt stage keeps no cache
        self.staged: dict[int, StagedKV] = {}  # a token stage's: KV received for microbatches not started yet
        self.prompt_runs: dict[int, PromptRun] = {}  # a prompt stage's: microbatches whose prompts it prefills
        self.prompt_turns: deque[int] = deque()  # the first prompt stage's: whose columns run next
        self.row_steps = 0  # the last stage's: rows given a token while live (ended and cancelled rows are not)
        self.failed: deque[int] = deque(maxlen=1024)  # microbatches that failed lately (numbers are never reused)
        self._cancels: dict[int, set[int]] = {}  # the last stage's: rows cancelled before their microbatch came
        self.stopped = False  # the head said `Shutdown` (or `Fenced`): the worker's loop returns

    def keep_cancel(self, number: int, rows: list[int]) -> None:
        """Keep the rows of a microbatch not here yet (its start may be waiting for its prompt KV elsewhere);
        the oldest are let go past a few hundred (a microbatch that never comes: it ended or failed)."""
        self._cancels.setdefault(number, set()).update(rows)
        while len(self._cancels) > 256:
            del self._cancels[next(iter(self._cancels))]

    def kept_cancels(self, number: int) -> list[int]:
        """The rows of microbatch `number` cancelled before it came, now taken."""
        return sorted(self._cancels.pop(number, ()))

    def _staged(self, number: int) -> StagedKV:
        """The prompt KV received for microbatch (or group) `number`, kept until its first step takes it."""
        return self.staged.setdefault(number, StagedKV(self.stage.layers[1] - self.stage.layers[0]))

    def forget(self, number: int) -> None:
        """Let go of everything held for microbatch (slot, or group) `number`: its state, cache, KV received, prompts
        to run, replica."""
        slot = self.slots.pop(number, None)
        self.caches.remove(number)
        self.caches.pin(("group", number), None)
        self.restored_pieces.pop(number, None)
        self.staged.pop(number, None)
        self.prompt_runs.pop(number, None)
        if self.replicator is not None and slot is not None:
            self.slot_replicas().end(number, slot.pieces)

    def slot_replicas(self) -> SlotReplicas:
        """The writer of the slots' replicas, through the replicator of the links now."""
        assert self.replicator is not None  # only asked for with recovery from replicas
        return SlotReplicas(self.replicator)

    def prompt_scorer(self, decodings: list[dict[str, Any]], start: int, width: int, into: dict[str, Any],
                      keys: list[int] | None = None) -> Callable[[torch.Tensor], None] | None:
        """The last stage's `on_hidden` for the prompt columns [start, ...) of rows left-padded to `width`: it
        puts the prompt log-probabilities of these columns (wire form) of the rows that ask (`decodings[row]`: a
        `prompt` and its `prompt_logprobs`) in `into`, by row (or by `keys[row]`) as a string key (`Scores`); None
        when none asks."""
        asks = {row: (fields["prompt"], int(fields["prompt_logprobs"])) for row, fields in enumerate(decodings)
                if fields.get("prompt") is not None}
        if not asks:
            return None
        head = functools.partial(self.stage.adapter.head, every_position=True)

        def score(hidden: torch.Tensor) -> None:
            for row, entries in prompt_scores(head, hidden, start, width, asks).items():
                into[str(row if keys is None else keys[row])] = entries

        return score

    def post(self, link: Transport | None, message: EpochMessage) -> None:
        """Post a step's message, stamped with the worker's epoch: no round trip per hop. A lost one fails the next
        post on that link, or the head's progress watchdog."""
        assert link is not None  # set for every message this stage sends on
        try:
            link.post_tensor(pack(attrs.evolve(message, epoch=self.epoch)))
        except TransportError as error:
            if link is self.head:  # the head is gone: no stage failure to report, to no one
                raise HeadGone(f"the head lost what the stage posted to it: {error}") from error
            raise

    def _unexpected(self, message: Message) -> NoReturn:
        """A message this stage has no use for (its role's, or its batching's, is another)."""
        raise TransportError(f"{self.role.name} got a message of unexpected kind {message.kind!r}")

    def close(self) -> None:
        self.close_links()

    def close_links(self) -> None:
        """Close every link to another stage (not the head's), the replicas' holder's included."""
        if self.replicator is not None:
            self.replicator.holder.close()
        links = [self.following, self.first, *(self.sender.links if self.sender is not None else [])]
        if self.sender is not None:
            self.sender.close()
        for link in links:
            if link is not None:
                link.close()
