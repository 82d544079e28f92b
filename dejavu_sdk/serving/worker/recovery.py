"""A stage worker's side of a recovery: the handlers of the head's recovery messages.

The head's recovery coordinator sends these to the stage workers, a step at a time, and waits for every answer
before the next step (`StageWorker.handlers` has a handler here for each):
- `Pause` starts a new epoch (messages of older epochs are dropped from now on): report the rounds of each slot
  held (and, for a successor head, the last stage's round reports); answers `Paused`;
- `Relink` gives the neighbours' addresses, some of them new: reconnect; answers `Relinked`;
- `SendReplica` asks the holder of a dead stage's replica to send a piece of it to that stage's replacement (as
  `Restore`, which the replacement keeps until its rewind); answers `Sent`;
- `Drop` forgets microbatches that start over from their prompts (the head also sends it for a microbatch that
  failed, so that its other stages let it go);
- `RewindSlot` continues a slot from a given round (`worker.slot_recovery`); answers `Rewound`.
"""

from __future__ import annotations

from ...errors import DejaVuError, TransportError
from ...generation.logprobs import Scores
from ..kv.replication import assemble, remove_replicas
from ..kv.slot_replicas import piece_stream
from ..wire.messages import (
    Drop,
    Pause,
    Paused,
    Relink,
    Relinked,
    Restore,
    RoundDone,
    SendReplica,
    Sent,
    pack,
)
from .slot_recovery import SlotRecoveryHandlers
from .state import open_link, open_links


class RecoveryHandlers(SlotRecoveryHandlers):
    """The handlers of the head's recovery messages; `StageWorker` inherits them."""

    def _pause(self, message: Pause) -> None:
        """A new epoch: forget KV of groups not yet started here and prompts still to run, and report the rounds of
        each slot held (a takeover: the last stage's round reports too)."""
        self.epoch = message.epoch
        self._reported_epoch = self.epoch  # links lost now are what the recovery mends: nothing to report
        self.staged.clear()
        self.prompt_runs.clear()  # a prompt stage's: the head sends again what it still wants prefilled
        self.prompt_turns.clear()
        self.restored_pieces.clear()
        rounds = {number: state.round for number, state in self.slots.items()}
        reports: dict[int, list[tuple[RoundDone, list[int], Scores]]] = {}
        if message.takeover:  # the last stage's rounds: a successor goes on from them
            reports = {number: state.reports for number, state in self.slots.items()
                       if self.stage.last and state.reports is not None}
        self.head.send_tensor(pack(Paused(stage=self.role.name, epoch=self.epoch, slots=rounds, reports=reports)))

    def _relink(self, message: Relink) -> None:
        """Reconnect to the neighbours at the addresses given (some of them replacements)."""
        self._close_links()
        self.following, self.first, self.sender, self.replicator = open_links(message.links, self.role)
        self._reported_epoch = self.epoch - 1  # from here on, a lost link is news again
        self.head.send_tensor(pack(Relinked(stage=self.role.name, epoch=self.epoch)))

    def _send_replica(self, message: SendReplica) -> None:
        """Send the replica held here of stage `owner`'s microbatch back to that stage's replacement at `to`."""
        number, part = message.microbatch, message.part
        error, unreachable = None, False
        stream = piece_stream(message.owner, number, part, self.prefix)
        try:
            block = assemble(self.inbox.store, stream, message.layers, message.positions)
        except DejaVuError as failure:  # a replica short or damaged: that microbatch starts over
            error = f"{type(failure).__name__}: {failure}"
        else:
            try:
                with open_link(message.to) as replacement:
                    replacement.send_tensor(pack(Restore(microbatch=number, epoch=self.epoch, part=part, block=block)))
            except TransportError as failure:  # the replacement is gone too
                error, unreachable = str(failure), True
        self.head.send_tensor(pack(Sent(stage=self.role.name, microbatch=number, epoch=self.epoch, item=message.item,
                                        error=error, unreachable=unreachable)))

    def _restore(self, message: Restore) -> None:
        self.restored_pieces.setdefault(message.microbatch, {})[message.part] = message.block.clone()

    def _drop(self, message: Drop) -> None:
        """Forget microbatches that start over from their prompts, failed, or ended meanwhile, with the replicas
        held here of them for another stage. A failed one's prompt KV still on its way is ignored when it comes (a
        recovery's own is of an older epoch)."""
        numbers = set(message.microbatches)
        kept = message.all_but
        if kept is not None:  # a successor head: whatever it did not take over goes
            numbers = {*numbers, *self.slots, *self.caches.numbers()} - set(kept)
        for number in sorted(numbers):
            self._forget(number)
            if message.failed:
                self.failed.append(number)
        dropped = numbers.__contains__ if kept is None else (lambda number: number not in set(kept))
        if self.inbox is not None:  # a worker in a test may have none
            remove_replicas(self.inbox.store, dropped, self.prefix)
