"""A stage worker's side of a recovery: the handlers of the head's recovery messages.

The head's recovery coordinator sends these to the stage workers, a step at a time, and waits for every answer
before the next step (`StageWorker.handlers` has a handler here for each):
- `Pause` starts a new epoch (messages of older epochs are dropped from now on): finish replicating, report the
  caches held and the replicas held for the previous decoding stage; answers `Paused`;
- `Relink` gives the neighbours' addresses, some of them new: reconnect; answers `Relinked`;
- `SendReplica` asks the holder of a dead stage's replica to send it to that stage's replacement (as `Restore`,
  which the replacement keeps until its rewind); answers `Sent`;
- `Drop` forgets microbatches that start over from their prompts (the head also sends it for a microbatch that
  failed, so that its other stages let it go);
- `Rewind` continues a static microbatch from a given position: survivors crop their caches to it, a replacement
  builds its cache from the restored replica; answers `Rewound` (a slot's `RewindSlot`: `worker.slot_recovery`).
"""

from __future__ import annotations

import torch

from ...errors import DejaVuError, TransportError
from ...generation.picker import TokenPicker
from ...generation.stage import position_ids
from ...swapping import positions_needed
from ..kv.replication import assemble, cache_from, held_positions, remove_replicas, replica_stream
from ..kv.slot_replicas import piece_stream
from ..wire.messages import (
    Drop,
    Pause,
    Paused,
    Relink,
    Relinked,
    Restore,
    Rewind,
    Rewound,
    RoundDone,
    SendReplica,
    Sent,
    pack,
)
from .slot_recovery import SlotRecoveryHandlers
from .state import MicrobatchState, open_link, open_links


class RecoveryHandlers(SlotRecoveryHandlers):
    """The handlers of the head's recovery messages; `StageWorker` inherits them."""

    def _pause(self, message: Pause) -> None:
        """A new epoch: finish replicating, forget KV of microbatches not yet started here, and report the
        caches held (positions per microbatch) and the positions of the replicas held for `replica_of`."""
        self.epoch = message.epoch
        self._reported_epoch = self.epoch  # links lost now are what the recovery mends: nothing to report
        if self.replicator is not None:
            self.replicator.finish_all()
        self.staged.clear()
        self.prompt_runs.clear()  # a prompt stage's: the head sends again what it still wants prefilled
        self.prompt_turns.clear()
        self.restored.clear()
        self.restored_pieces.clear()
        caches = {number: self.caches.positions(number) for number in self.microbatches if number in self.caches}
        rounds = {number: state.round for number, state in self.slots.items()}  # continuous: rounds run
        steps: dict[int, tuple[int, list[list[int]]]] = {}
        reports: dict[int, list[tuple[RoundDone, list[int]]]] = {}
        if message.takeover:  # the last stage's steps, tokens and rounds: a successor goes on from them
            steps = {number: (state.steps, state.history) for number, state in self.microbatches.items()
                     if state.picker is not None and number in self.caches}
            reports = {number: state.reports for number, state in self.slots.items()
                       if self.stage.last and state.reports is not None}
        holds = {}
        if message.replica_of is not None:
            store = self.inbox.store
            for number in message.microbatches:
                holds[number] = held_positions(store.keys(replica_stream(message.replica_of, number, self.prefix)),
                                               message.replica_layers)
        self.head.send_tensor(pack(Paused(stage=self.role.name, epoch=self.epoch, caches=caches, holds=holds,
                                          slots=rounds, steps=steps, reports=reports)))

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
        stream = (replica_stream(message.owner, number, self.prefix) if part is None
                  else piece_stream(message.owner, number, part, self.prefix))  # a piece of a slot's replica
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
        if message.part is None:
            self.restored[message.microbatch] = message.block.clone()
        else:
            self.restored_pieces.setdefault(message.microbatch, {})[message.part] = message.block.clone()

    def _drop(self, message: Drop) -> None:
        """Forget microbatches that start over from their prompts, failed, or ended meanwhile, with the replicas
        held here of them for another stage. A failed one's prompt KV still on its way is ignored when it comes (a
        recovery's own is of an older epoch)."""
        numbers = set(message.microbatches)
        kept = message.all_but
        if kept is not None:  # a successor head: whatever it did not take over goes
            numbers = {*numbers, *self.microbatches, *self.slots, *self.caches.numbers()} - set(kept)
        for number in sorted(numbers):
            self._forget(number)
            if message.failed:
                self.failed.append(number)
        dropped = numbers.__contains__ if kept is None else (lambda number: number not in set(kept))
        if self.inbox is not None:  # a worker in a test may have none
            remove_replicas(self.inbox.store, dropped, self.prefix)

    def _rewind(self, message: Rewind) -> None:
        """Continue microbatch `microbatch` from position `positions`, which the head will feed with the token of
        step `steps`: crop the cache held here to it (a replacement builds it from its restored replica), and
        replicate from there (from 0 to a new holder, else from where the replica reaches)."""
        number, positions, steps = message.microbatch, message.positions, message.steps
        held = self.microbatches.get(number)
        if self.continuous:  # a continuous pipeline's stage holds slots, which `RewindSlot` rewinds
            self._forget(number)
            self._rewound(number, f"{self.role.name} could not rewind microbatch {number}: it holds slots")
            return
        if message.keep and (held is None or number not in self.caches
                             or (self.stage.last and (held.picker is None or held.steps != steps))):
            self._rewound(number, f"{self.role.name} cannot go on with microbatch {number} from step {steps}: it "
                                  f"holds {'no such microbatch' if held is None else f'step {held.steps}'}")
            return
        if number in self.restored:
            cache = cache_from(self.restored.pop(number), self.stage.config)
        else:
            cache = self.caches.acquire(number)
            if cache.get_seq_length() > positions:
                cache.crop(positions - cache.get_seq_length())  # transformers crops by a negative count
        self.caches.remove(number)
        self.caches.new_cache(number, cache)
        prompt_mask, specs = message.mask, message.specs
        state = MicrobatchState(positions_needed(prompt_mask.shape[1], max(specs.max_new_tokens)),
                                torch.cat([prompt_mask, prompt_mask.new_ones(len(prompt_mask), steps - 1)], dim=1),
                                position_ids(prompt_mask)[:, -1:] + steps - 1, specs)
        if self.stage.last and message.keep:  # taken over where it stands: its picker goes on
            assert held is not None  # checked above, picker and step included
            assert held.ended is not None  # set with its picker
            held.ended[self.kept_cancels(number)] = True
            state.picker, state.ended, state.steps, state.history = held.picker, held.ended, steps, held.history
        elif self.stage.last:
            state.picker = TokenPicker(self.stage.adapter.model.generation_config, specs.decoding)
            if message.rng.numel():
                state.picker.set_states(message.rng)
            state.ended, state.steps = message.ended.bool().clone(), steps
            state.ended[self.kept_cancels(number)] = True
            state.history = [list(step) for step in zip(*message.generated, strict=True)]
        self.microbatches[number] = state
        self.caches.add(number, state.capacity)
        if self.replicator is not None:
            self.replicator.start(number, cache, message.replicated)
        self._rewound(number)

    def _rewound(self, number: int, error: str | None = None) -> None:
        """Tell the head that microbatch `number` goes on from its rewind, or why it cannot (`error`)."""
        self.head.send_tensor(pack(Rewound(stage=self.role.name, microbatch=number, epoch=self.epoch, error=error)))
