"""A stage worker's side of a recovery: the handlers of the head's recovery messages.

The head's recovery coordinator sends these to the stage workers, a step at a time, and waits for every answer
before the next step; `StageWorker.handle` dispatches every kind in `RECOVERY` here:
- `pause` starts a new epoch (messages of older epochs are dropped from now on): finish replicating, report the
  caches held and the replicas held for the previous decoding stage; answers `paused`;
- `relink` gives the neighbours' addresses, some of them new: reconnect; answers `relinked`;
- `send_replica` asks the holder of a dead stage's replica to send it to that stage's replacement (as
  `restore`, which the replacement keeps until its `rewind`); answers `sent`;
- `drop` forgets microbatches that start over from their prompts (the head also sends it for a microbatch that
  failed, so that its other stages let it go);
- `rewind` continues a microbatch from a given position: survivors crop their caches to it, a replacement
  builds its cache from the restored replica; answers `rewound` (a slot's: `worker_slot_recovery`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import DejaVuError, TransportError
from ..generation.decoding import TokenPicker
from ..generation.stage import position_ids
from ..swapping import positions_needed
from .messages import Kind, Message, pack
from .replication import assemble, cache_from, held_positions, remove_replicas, replica_stream
from .slot_replicas import piece_stream
from .worker_slot_recovery import SlotRecoveryHandlers
from .worker_state import MicrobatchState, open_link, open_links

#: The head's recovery messages (`pause` starts a new epoch); `drop` also forgets a microbatch that failed.
RECOVERY = ("pause", "relink", "send_replica", "restore", "drop", "rewind")


class RecoveryHandlers(SlotRecoveryHandlers):
    """The handlers of the `RECOVERY` messages, one method `_<kind>` each; `StageWorker` inherits them."""

    def _pause(self, message: Message) -> None:
        """A new epoch: finish replicating, forget KV of microbatches not yet started here, and report the
        caches held (positions per microbatch) and the positions of the replicas held for `replica_of`."""
        self.epoch = int(message.fields["epoch"])
        self._reported_epoch = self.epoch  # links lost now are what the recovery mends: nothing to report
        if self.replicator is not None:
            self.replicator.finish_all()
        self.staged.clear()
        self.prompt_runs.clear()  # a prompt stage's: the head sends again what it still wants prefilled
        self.prompt_turns.clear()
        self.restored.clear()
        self.restored_pieces.clear()
        caches = {str(number): self.caches.acquire(number).get_seq_length() for number in self.microbatches
                  if number in self.caches}
        rounds = {str(number): state.round for number, state in self.slots.items()}  # continuous: rounds run
        steps: dict[str, Any] = {}
        reports: dict[str, Any] = {}
        if message.fields.get("takeover"):  # the last stage's steps, tokens and rounds: a successor goes on from them
            steps = {str(number): [state.steps, state.history] for number, state in self.microbatches.items()
                     if state.picker is not None and number in self.caches}
            reports = {str(number): state.reports for number, state in self.slots.items()
                       if self.stage.last and state.reports is not None}
        holds = {}
        owner = message.fields.get("replica_of")
        if owner is not None:
            store = self.inbox.store
            for number in message.fields["microbatches"]:
                holds[str(number)] = held_positions(store.keys(replica_stream(owner, number, self.prefix)),
                                                    int(message.fields["replica_layers"]))
        self.head.send_tensor(pack(Message(Kind.PAUSED, {"stage": self.role.name, "epoch": self.epoch,
                                                      "caches": caches, "holds": holds, "slots": rounds,
                                                      "steps": steps, "reports": reports})))

    def _relink(self, message: Message) -> None:
        """Reconnect to the neighbours at the addresses given (some of them replacements)."""
        self._close_links()
        self.following, self.first, self.sender, self.replicator = open_links(message.fields, self.role)
        self._reported_epoch = self.epoch - 1  # from here on, a lost link is news again
        self.head.send_tensor(pack(Message(Kind.RELINKED, {"stage": self.role.name, "epoch": self.epoch})))

    def _send_replica(self, message: Message) -> None:
        """Send the replica held here of stage `owner`'s microbatch back to that stage's replacement at `to`."""
        fields = message.fields
        number, positions, part = int(fields["microbatch"]), int(fields["positions"]), fields.get("part")
        answer: dict[str, Any] = {"stage": self.role.name, "microbatch": number, "epoch": self.epoch,
                                  "item": fields.get("item")}
        stream = (replica_stream(int(fields["owner"]), number, self.prefix) if part is None
                  else piece_stream(int(fields["owner"]), number, part, self.prefix))  # a piece of a slot's replica
        try:
            block = assemble(self.inbox.store, stream, int(fields["layers"]), positions)
        except DejaVuError as error:  # a replica short or damaged: that microbatch starts over
            answer["error"] = f"{type(error).__name__}: {error}"
        else:
            try:
                with open_link(fields["to"]) as replacement:
                    replacement.send_tensor(pack(Message(Kind.RESTORE, {"microbatch": number, "epoch": self.epoch,
                                                                        "part": part}, (block,))))
            except TransportError as error:  # the replacement is gone too
                answer.update(error=str(error), unreachable=True)
        self.head.send_tensor(pack(Message(Kind.SENT, answer)))

    def _restore(self, message: Message) -> None:
        number, part = int(message.fields["microbatch"]), message.fields.get("part")
        if part is None:
            self.restored[number] = message.tensors[0].clone()
        else:
            self.restored_pieces.setdefault(number, {})[str(part)] = message.tensors[0].clone()

    def _drop(self, message: Message) -> None:
        """Forget microbatches that start over from their prompts, failed, or ended meanwhile, with the replicas
        held here of them for another stage. A failed one's prompt KV still on its way is ignored when it comes (a
        recovery's own is of an older epoch)."""
        numbers = set(message.fields["microbatches"])
        kept = message.fields.get("all_but")
        if kept is not None:  # a successor head: whatever it did not take over goes
            numbers = {*numbers, *self.microbatches, *self.slots, *self.caches.numbers()} - set(kept)
        for number in sorted(numbers):
            self._forget(number)
            if message.fields.get("failed"):
                self.failed.append(number)
        dropped = numbers.__contains__ if kept is None else (lambda number: number not in set(kept))
        if self.inbox is not None:  # a worker in a test may have none
            remove_replicas(self.inbox.store, dropped, self.prefix)

    def _rewind(self, message: Message) -> None:
        """Continue microbatch `microbatch` from position `positions`, which the head will feed with the token of
        step `steps`: crop the cache held here to it (a replacement builds it from its restored replica), and
        replicate from there (from 0 to a new holder, else from where the replica reaches)."""
        if self.continuous:
            self._rewind_slot(message)
            return
        fields = message.fields
        number, positions, steps = int(fields["microbatch"]), int(fields["positions"]), int(fields["steps"])
        prompt_mask, ended, rng = message.tensors
        held = self.microbatches.get(number)
        if fields.get("keep") and (held is None or number not in self.caches
                                   or (self.stage.last and (held.picker is None or held.steps != steps))):
            self.head.send_tensor(pack(Message(Kind.REWOUND, {
                "stage": self.role.name, "microbatch": number, "epoch": self.epoch,
                "error": f"{self.role.name} cannot go on with microbatch {number} from step {steps}: it holds "
                         f"{'no such microbatch' if held is None else f'step {held.steps}'}"})))
            return
        if number in self.restored:
            cache = cache_from(self.restored.pop(number), self.stage.config)
        else:
            cache = self.caches.acquire(number)
            if cache.get_seq_length() > positions:
                cache.crop(positions - cache.get_seq_length())  # transformers crops by a negative count
        self.caches.remove(number)
        self.caches.new_cache(number, cache)
        state = MicrobatchState(positions_needed(prompt_mask.shape[1], max(fields["max_new_tokens"])),
                                torch.cat([prompt_mask, prompt_mask.new_ones(len(prompt_mask), steps - 1)], dim=1),
                                position_ids(prompt_mask)[:, -1:] + steps - 1, dict(fields))
        if self.stage.last and fields.get("keep"):  # taken over where it stands: its picker goes on
            assert held is not None  # checked above, picker and step included
            assert held.ended is not None  # set with its picker
            held.ended[self.kept_cancels(number)] = True
            state.picker, state.ended, state.steps, state.history = held.picker, held.ended, steps, held.history
        elif self.stage.last:
            state.picker = TokenPicker(self.stage.adapter.model.generation_config, fields["decoding"])
            if rng.numel():
                state.picker.set_states(rng)
            state.ended, state.steps = ended.bool().clone(), steps
            state.ended[self.kept_cancels(number)] = True
            state.history = [list(step) for step in zip(*fields.get("generated", []), strict=True)]
        self.microbatches[number] = state
        self.caches.add(number, state.capacity)
        if self.replicator is not None:
            self.replicator.start(number, cache, int(fields["replicated"]))
        self.head.send_tensor(pack(Message(Kind.REWOUND, {"stage": self.role.name, "microbatch": number,
                                                       "epoch": self.epoch})))
