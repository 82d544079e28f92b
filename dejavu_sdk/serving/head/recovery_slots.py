"""The head's side of a continuous pipeline's recovery: where each slot goes on from, its replica's pieces back
to the replaced stages, and every decoding stage's `rewind`.

A slot goes on from right after the last round the head heard of (every stage wrote that round to its replica
before passing it on), with the row change that the next round opens with already made. The head traces the
slot there from its schedule (`slot_replicas.trace`): its rows, the pieces of the replica that hold their
columns, and the group joining then. A replaced stage gets those pieces back (from the holder of its replicas,
or from the shared replica store), and every decoding stage rewinds the slot to that point
(`worker.slot_recovery`); with no stage that holds it dead (a prompt stage died, a controller's successor takes
over) it needs no replica. A slot that cannot go on from there (a decoding stage died and `recovery="recompute"`
keeps no replica, a stage ran rounds the head never heard of, a piece is lost with two neighbouring stages, a
rewind fails) is lost:
its rows go on in other slots from their prompts followed by the tokens they have (`SlotResumes._lose_slot`);
one that made no progress since the recovery before fails its requests (the poison bound).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from ...errors import DejaVuError
from ...generation.batching import left_pad, row_fields
from ...generation.row_specs import Group, RowSpecs
from ...generation.slot_batch import SlotBatch
from ..kv.replication import assemble
from ..kv.slot_replicas import SlotBase, SlotTrace, piece_stream, trace
from ..layout import Layout
from ..options import PipelineOptions
from ..wire.messages import EpochMessage, GroupAt, Message, Paused, Restore, RewindSlot, Rewound, SendReplica, Sent
from .fleet import Fleet
from .ledger import Ledger

log = logging.getLogger(__name__)

Reply = TypeVar("Reply", bound=EpochMessage)


class RecoverySteps(Protocol):
    """What the slots' part of a recovery uses of the recovery it is part of (`recovery.Recovery`)."""

    ledger: Ledger
    fleet: Fleet
    layout: Layout
    options: PipelineOptions
    dead: set[int]
    epoch: int

    def send(self, index: int, message: Message) -> None: ...

    def wait(self, kind: type[Reply], senders: set[Any], key: Callable[[Reply], Any] = ...,
             blame: Any = None) -> dict[Any, Reply]: ...

    def dead_too(self, index: int, reason: str) -> None: ...


class SlotRecovery:
    """The slots' part of one recovery (`recovery.Recovery`, whose messages, waits and fleet it uses): `plan`,
    then `transfer`, then `rewind`; `resumed` holds each slot going on (with its trace) and `lost` each that
    cannot, with why."""

    def __init__(self, recovery: RecoverySteps) -> None:
        self.recovery = recovery
        self.resumed: dict[int, tuple[SlotBatch, SlotTrace]] = {}
        self.lost: dict[int, str] = {}
        #: Disaggregated slots whose first group had not reached the token stages: nothing to rewind, the group is
        #: sent again.
        self.unopened: list[int] = []

    def plan(self, paused: dict[str, Paused], poison: str) -> None:
        recovery = self.recovery
        layout, ledger = recovery.layout, recovery.ledger
        survivors = [index for index in layout.decoding_stages() if index not in recovery.dead]
        # recomputing keeps no replica: a slot that a dead decoding stage held cannot go on from its round
        without_replicas = (recovery.options.resilience.recovery != "replicas"
                            and len(survivors) < len(layout.decoding_stages()))
        for number, batch in ledger.resumes.slots_to_recover(recovery.epoch):
            heard = len(batch.rounds)
            if batch.seen_by_recovery == batch.steps_received:  # its group in the prompt pipeline too
                self.lost[number] = poison
                continue
            if not batch.opened:
                self.unopened.append(number)
                continue
            if without_replicas:
                self.lost[number] = "recovery='recompute' keeps no replica of what the dead stages held"
                continue
            ran = {layout.stages[index].name: paused[layout.stages[index].name].slots.get(number, 0)
                   for index in survivors}
            ahead = {name: rounds for name, rounds in ran.items() if rounds not in (heard, heard + 1)}
            if ahead:
                self.lost[number] = (f"the head heard of {heard} rounds of slot {number}; {ahead} ran another "
                                     "number, which no replica can take it back from")
                continue
            try:
                found = trace(batch.rounds, batch.next_change, _masks(batch, ledger.pad), batch.base)
            except DejaVuError as error:
                self.lost[number] = f"slot {number}'s schedule cannot be traced: {error}"
                continue
            self.resumed[number] = (batch, found)

    def transfer(self) -> None:
        """Each replaced decoding stage's pieces of every slot going on, back to it; a slot whose pieces are lost
        or damaged is lost."""
        recovery = self.recovery
        options, layout = recovery.options, recovery.layout
        for index in sorted(recovery.dead):
            if index not in layout.decoding_stages() or not self.resumed:
                continue
            stage = layout.stages[index]
            holder = layout.replica_holder(index)
            if options.resilience.replica_store is None and (holder is None or holder in recovery.dead):
                for number in list(self.resumed):
                    self._lose(number, f"{stage.name}'s replica of slot {number} was lost with its holder")
                continue
            asked: dict[str, int] = {}
            for number, (_, found) in list(self.resumed.items()):
                for piece in (piece for piece in found.pieces if piece.columns):
                    if options.resilience.replica_store is not None:
                        self._restore_from_store(index, number, piece.name, piece.columns)
                        continue
                    item = f"{number}/{piece.name}"
                    asked[item] = number
                    assert holder is not None
                    recovery.send(holder, SendReplica(
                        epoch=recovery.epoch, microbatch=number, owner=stage.number, layers=stage.layer_count,
                        positions=piece.columns, part=piece.name, item=item, to=recovery.fleet.url_of(index)))
            if not asked:
                continue
            for item, reply in recovery.wait(Sent, set(asked), lambda reply: reply.item, holder).items():
                if reply.unreachable:
                    recovery.dead_too(index, f"{stage.name}'s replacement is unreachable: {reply.error}")
                if reply.error:
                    self._lose(asked[item], f"a piece of slot {asked[item]}'s replica could not be read back: "
                                            f"{reply.error}")

    def _restore_from_store(self, index: int, number: int, name: str, columns: int) -> None:
        recovery = self.recovery
        stage, resilience = recovery.layout.stages[index], recovery.options.resilience
        store = resilience.replica_store
        assert store is not None
        try:
            block = assemble(store, piece_stream(stage.number, number, name, resilience.replica_prefix),
                             stage.layer_count, columns)
        except DejaVuError as error:
            self._lose(number, f"a piece of slot {number}'s replica could not be read back: {error}")
            return
        recovery.send(index, Restore(microbatch=number, part=name, epoch=recovery.epoch, block=block))

    def rewind(self, decoding: list[int]) -> None:
        """Every decoding stage rewinds each slot going on; a slot that a stage cannot rewind is lost."""
        recovery = self.recovery
        names = {recovery.layout.stages[index].name for index in decoding}
        for number, (batch, found) in list(self.resumed.items()):
            message = _rewind_message(batch, found, recovery.epoch, recovery.ledger.pad)
            for index in decoding:
                recovery.send(index, message)
            errors = [reply.error for reply in recovery.wait(Rewound, names).values() if reply.error]
            if errors:
                self._lose(number, "; ".join(errors))
            else:  # its replica starts over from here on every stage: a retry of this recovery traces from it
                batch.resuming = found
                batch.base = SlotBase(len(batch.rounds), found.rows, found.joining)

    def _lose(self, number: int, reason: str) -> None:
        if self.resumed.pop(number, None) is not None:
            log.warning("%s: its requests go on from their prompts and the tokens they have", reason)
            self.lost[number] = reason


def _masks(batch: SlotBatch, pad: int) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """A group's prompts' mask, left-padded to each other, by its members."""
    def mask_of(members: tuple[int, ...]) -> torch.Tensor:
        return left_pad([_request(batch, member).ids for member in members], pad)[1]
    return mask_of


def _request(batch: SlotBatch, member: int) -> Any:
    return batch.requests[batch.rows_of[member]]


def _rewind_message(batch: SlotBatch, found: SlotTrace, epoch: int, pad: int) -> RewindSlot:
    """The `RewindSlot` of a slot: where it goes on from, its rows and their pieces, the group joining, and what the
    last stage needs of each row (decoding, generator state, tokens so far, limit, whether cancelled)."""
    rows, joining = found.rows, found.joining
    members = list(rows.members)
    everyone = members + (list(joining.members) if joining is not None else [])
    requests = {member: _request(batch, member) for member in everyone}
    known = [batch.states[member] for member in members if member in batch.states]
    states = (torch.stack([batch.states.get(member, torch.zeros_like(known[0])) for member in members]) if known
              else torch.empty(0, dtype=torch.uint8))
    group_ids = group_mask = torch.zeros((0, 0), dtype=torch.long)
    joining_at = None
    if joining is not None:
        group_ids, group_mask = left_pad([requests[member].ids for member in joining.members], pad)
        specs = RowSpecs([requests[member].max_new_tokens for member in joining.members],
                         [row_fields(requests[member]) for member in joining.members])
        joining_at = GroupAt(Group(list(joining.members), specs), joining.done, joining.started)
    return RewindSlot(
        microbatch=batch.number, epoch=epoch, round=len(batch.rounds), parked=batch.idle, left=batch.next_change[0],
        joined=batch.next_change[1], members=members, pieces=list(found.pieces),
        decodings=[requests[member].decoding.fields() for member in members],
        counts={member: len(batch.generated[batch.rows_of[member]]) for member in members},
        limits={member: requests[member].max_new_tokens for member in everyone},
        cancelled=[member for member in everyone if batch.rows_of[member] in batch.dropped
                   or (not batch.policy.refills and batch.rows_of[member] in batch.settled)],  # static: ended ones pad
        finals=dict(zip(requests, batch.policy.finals([request.ids.numel() for request in requests.values()],
                                                      [request.max_new_tokens for request in requests.values()]),
                        strict=True)),
        joining=joining_at, mask=rows.mask, positions=rows.positions, index=found.index, group_mask=group_mask,
        group_ids=group_ids, states=states)

