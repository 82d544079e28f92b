"""A stage's part in cancelling a slot's rows (`worker.slots`): the first stage takes cancelled requests out of the
groups queued there, and the last stage ends their rows at their next round."""

from __future__ import annotations

from collections import deque

import attrs

from ...generation.row_specs import group_rows
from ..wire.messages import Cancel, Enter, NotEntered
from .state import SlotState, WorkerState


class SlotCancels:
    """Cancelled rows of a stage's slots: a part of its `StageWorker`, on the worker's state (`worker`)."""

    def __init__(self, worker: WorkerState) -> None:
        self.worker = worker

    def cancel_rows(self, number: int, members: list[int]) -> None:
        """Requests cancelled (the head tells the first decoding stage): the first stage takes them out of a
        group queued there whose prompts it would compute, and tells the head they never entered; the others
        go on to the last stage, which ends their rows (a joining group's once its first tokens come). One
        that overtook its slot (opened by a group still in the prompt pipeline) is kept until the slot comes."""
        worker = self.worker
        state = worker.slots.get(number)
        if state is not None and worker.stage.first and worker.policy.refills:  # a static group keeps its rows
            members = self._unqueue(number, state, set(members))
        if not members:
            return
        if not self.worker.stage.last:
            self.worker.post(self.worker.following, Cancel(microbatch=number, rows=members))
            return
        if state is None:
            self.worker.keep_cancel(number, members)
            return
        state.cancelled.update(members)
        for row, member in enumerate(state.rows.members):
            if member in state.cancelled:
                state.ended[row] = True

    def _unqueue(self, number: int, state: SlotState, cancelled: set[int]) -> list[int]:
        """Take the `cancelled` requests out of the queued groups whose prompts this stage would compute (a
        group the prompt pipeline prefilled keeps them: its KV is staged for all its rows, and the last stage
        ends theirs as it joins); the head hears which left (`NotEntered`). Those not taken out here."""
        kept: deque[Enter] = deque()
        taken: list[int] = []
        for enter in state.queued:
            members = enter.group.members
            rows = [row for row, member in enumerate(members) if member not in cancelled]
            if enter.staged is not None or len(rows) == len(members):
                kept.append(enter)
                continue
            if rows:
                group, ids, mask = group_rows(enter.group, enter.ids, enter.mask, rows)
                kept.append(attrs.evolve(enter, group=group, ids=ids, mask=mask))
            taken += [member for member in members if member in cancelled]
        state.queued = kept
        if taken:
            self.worker.post(self.worker.head, NotEntered(microbatch=number, members=taken))
        return sorted(cancelled - set(taken))
