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
from .state import WorkerState, open_link, open_links


class RecoverySteps:
    """A stage's side of the head's recovery messages (`Pause`, `Relink`, `SendReplica`, `Restore`, `Drop`): a
    part of its `StageWorker`, on the worker's state (`worker`)."""

    def __init__(self, worker: WorkerState) -> None:
        self.worker = worker

    def pause(self, message: Pause) -> None:
        """A new epoch: forget KV of groups not yet started here and prompts still to run, and report the rounds of
        each slot held (a takeover: the last stage's round reports too)."""
        worker = self.worker
        worker.epoch = message.epoch
        worker.reported_epoch = worker.epoch  # links lost now are what the recovery mends: nothing to report
        worker.staged.clear()
        worker.prompt_runs.clear()  # a prompt stage's: the head sends again what it still wants prefilled
        worker.prompt_turns.clear()
        worker.restored_pieces.clear()
        rounds = {number: state.round for number, state in worker.slots.items()}
        reports: dict[int, list[tuple[RoundDone, list[int], Scores]]] = {}
        if message.takeover:  # the last stage's rounds: a successor goes on from them
            reports = {number: state.reports for number, state in worker.slots.items()
                       if worker.stage.last and state.reports is not None}
        worker.head.send_tensor(pack(Paused(stage=worker.role.name, epoch=worker.epoch, slots=rounds, reports=reports)))

    def relink(self, message: Relink) -> None:
        """Reconnect to the neighbours at the addresses given (some of them replacements)."""
        worker = self.worker
        worker.close_links()
        worker.following, worker.first, worker.sender, worker.replicator = open_links(message.links, worker.role)
        worker.reported_epoch = worker.epoch - 1  # from here on, a lost link is news again
        worker.head.send_tensor(pack(Relinked(stage=worker.role.name, epoch=worker.epoch)))

    def send_replica(self, message: SendReplica) -> None:
        """Send the replica held here of stage `owner`'s microbatch back to that stage's replacement at `to`."""
        worker = self.worker
        number, part = message.microbatch, message.part
        error, unreachable = None, False
        stream = piece_stream(message.owner, number, part, worker.prefix)
        try:
            block = assemble(worker.inbox.store, stream, message.layers, message.positions)
        except DejaVuError as failure:  # a replica short or damaged: that microbatch starts over
            error = f"{type(failure).__name__}: {failure}"
        else:
            try:
                with open_link(message.to) as replacement:
                    replacement.send_tensor(pack(Restore(microbatch=number, epoch=worker.epoch, part=part,
                                                         block=block)))
            except TransportError as failure:  # the replacement is gone too
                error, unreachable = str(failure), True
        worker.head.send_tensor(pack(Sent(stage=worker.role.name, microbatch=number, epoch=worker.epoch,
                                          item=message.item, error=error, unreachable=unreachable)))

    def restore(self, message: Restore) -> None:
        self.worker.restored_pieces.setdefault(message.microbatch, {})[message.part] = message.block.clone()

    def drop(self, message: Drop) -> None:
        """Forget microbatches that start over from their prompts, failed, or ended meanwhile, with the replicas
        held here of them for another stage. A failed one's prompt KV still on its way is ignored when it comes (a
        recovery's own is of an older epoch)."""
        worker = self.worker
        numbers = set(message.microbatches)
        kept = message.all_but
        if kept is not None:  # a successor head: whatever it did not take over goes
            numbers = {*numbers, *worker.slots, *worker.caches.numbers()} - set(kept)
        for number in sorted(numbers):
            worker.forget(number)
            if message.failed:
                worker.failed.append(number)
        dropped = numbers.__contains__ if kept is None else (lambda number: number not in set(kept))
        if worker.inbox is not None:  # a worker in a test may have none
            remove_replicas(worker.inbox.store, dropped, worker.prefix)
