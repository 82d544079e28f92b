"""The last stage's part of a continuous pipeline's round (`worker.slots`): pick each decoding row's token and a
finished group's first tokens (or take those the prompt pipeline picked), report the round to the head
(`RoundReport`), and send the next round to the first stage (`SlotRound`).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ...generation.decoding import RowFailure
from ...generation.logprobs import Scores
from ...generation.picker import next_tokens_scored
from ...generation.slots import Round
from ..wire.messages import RoundDone, RoundReport, SlotRound
from .state import SlotState, WorkerState


class SlotPicks:
    """The last stage's picks of a slot's round: a part of its `StageWorker`, on the worker's state (`worker`)."""

    def __init__(self, worker: WorkerState) -> None:
        self.worker = worker

    def pick_round(self, number: int, state: SlotState, message: SlotRound, decoded: list[int],
                   logits: torch.Tensor, first_logits: torch.Tensor) -> None:
        """Pick the round's tokens, report the round, and start the next one (or end the slot)."""
        worker = self.worker
        members: list[int] = []
        tokens: list[torch.Tensor] = []
        failed: dict[int, RowFailure] = {}
        logprobs: dict[str, Any] = {}  # by member
        prompt_logprobs, state.prompt_logprobs = state.prompt_logprobs, {}  # of the chunk this round ran
        pickers: list[tuple[int, torch.Tensor | None]] = []  # rows picked for, and their generators' states after
        decode_picks = torch.zeros(0, dtype=torch.long)  # every decoded row's, padding included: the next inputs
        if decoded:
            assert state.picker is not None
            counts = [state.counts[member] + 1 for member in decoded]
            limits = [state.limits[member] for member in decoded]
            live = [row for row, ended in enumerate(state.ended.tolist()) if not ended]  # the others pad
            worker.row_steps += len(live)
            decode_picks, state.ended, failures, scores = next_tokens_scored(state.picker, logits, state.ended,
                                                                             counts, limits, worker.eos, worker.pad)
            logprobs.update(_by_member(decoded, scores))
            members += [decoded[row] for row in live]
            tokens.append(decode_picks[live])
            failed.update((decoded[row], failure) for row, failure in failures.items())
            for member in decoded:
                state.counts[member] += 1
            states = state.picker.states() if worker.recovery else None
            pickers.append((len(live), None if states is None else states[live]))
        joined: list[int] | None = None
        complete: list[int] = []
        staged_first: list[int] | None = None  # a staged group's first tokens, as the prompt pipeline picked them
        staged_scores = Scores()  # and their log-probabilities (and its prompts')
        if state.ready is not None and state.ready_picker is None:  # the group's prompts are in: its first tokens
            group_members = complete = state.ready[1].members
            picker = state.joining_picker
            assert picker is not None
            cancelled = torch.tensor([member in state.cancelled for member in group_members])
            staged = message.starting.staged if message.starting is not None else None
            if staged is not None:  # the prompt pipeline picked them, and the head has them
                staged_first, staged_scores = staged.first, staged.scores
                picked = torch.tensor(staged.first, dtype=torch.long)
                ended = cancelled | torch.tensor([member in staged.ended for member in group_members])
            else:
                limits = [state.limits[member] for member in group_members]
                worker.row_steps += int((~cancelled).sum())
                picked, ended, failures, scores = next_tokens_scored(picker, first_logits, cancelled, 1, limits,
                                                                     worker.eos, worker.pad)
                logprobs.update(_by_member(group_members, scores))
                members += group_members
                tokens.append(picked)
                failed.update((group_members[row], failure) for row, failure in failures.items())
                pickers.append((len(group_members), picker.states() if worker.recovery else None))
            leaving = set(worker.policy.leaving(range(len(group_members)), ended.tolist()))  # (continuous: at once)
            keep = [row for row in range(len(group_members)) if row not in leaving]
            state.counts.update((group_members[row], 1) for row in keep)
            picker.keep(keep)
            state.ready_picker, state.ready_tokens, state.joining_picker = picker, picked[keep], None
            state.ready_ended = ended[keep]
            state.joining_decodings = []
            joined = [group_members[row] for row in keep]
            _let_go(state, [member for member in group_members if member not in set(joined)])
        state.last = None  # tokens were picked: a recovery cannot take this round back
        step = _round_of(message, decoded, worker.prefixes.chunk if worker.prefixes is not None else 0)
        idle = not decoded and message.prefill is None  # parked on the first stage
        left = [] if idle else worker.policy.leaving(decoded, state.ended.tolist())
        report = torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.long)
        done = RoundDone(step, members, list(complete), idle, (left, None if idle else joined), failed)
        if state.reports is not None:  # what a successor head goes on from
            first = staged_first or []  # a staged group's first tokens, which the head had from the prompt pipeline
            kept = Scores({**logprobs, **staged_scores.logprobs}, {**prompt_logprobs, **staged_scores.prompt_logprobs})
            state.reports.append((attrs.evolve(done, members=[*members, *(complete if first else [])]),
                                  [*report.tolist(), *first], kept))
        worker.post(worker.head, RoundReport(microbatch=number, done=done, scores=Scores(logprobs, prompt_logprobs),
                                          tokens=report, states=_states(pickers)))
        if idle:
            return
        _let_go(state, left)
        staying = [row for row, member in enumerate(decoded) if member not in set(left)]
        following = [decode for decode in (decode_picks[staying] if decoded else None, state.ready_tokens if joined
                                           else None) if decode is not None and len(decode)]
        if joined is not None and not joined:
            state.ready, state.ready_picker, state.ready_tokens, state.ready_ended = None, None, None, None
        next_tokens_in = torch.cat(following)[:, None] if following else torch.zeros((0, 1), dtype=torch.long)
        worker.post(worker.first, SlotRound(microbatch=number, left=left, joined=joined, inputs=next_tokens_in,
                                            restart=message.missed))


def _round_of(message: SlotRound, decoded: list[int], chunk: int) -> Round:
    """The round the last stage reports: a staged group's columns ran `chunk` a step in the prompt pipeline; a
    group that read its first columns from the prompt prefixes (`chunk` positions each) has them in its prefill; a
    group that a stage missed ran nothing."""
    starting, prefill, step = message.starting, message.prefill, 0
    cached = starting.cached if starting is not None and message.missed is None else 0
    if message.missed is not None:
        prefill = None
    elif cached and prefill is not None:
        prefill, step = (prefill[0], 0, prefill[2]), chunk
    elif starting is not None and starting.staged is not None:
        step = starting.staged.chunk
    return Round(tuple(message.left), tuple(message.joined or ()), tuple(decoded), prefill, step, cached=cached)



def _let_go(state: SlotState, members: list[int]) -> None:
    """The last stage: forget what it kept of members whose rows ended."""
    for member in members:
        state.counts.pop(member, None)
        state.limits.pop(member, None)
        state.cancelled.discard(member)


def _states(pickers: list[tuple[int, torch.Tensor | None]]) -> torch.Tensor | None:
    """The generators' states of a round's picks, a row each in the report's order (zeros for greedy rows);
    None when no row samples."""
    size = next((states.shape[1] for _, states in pickers if states is not None), None)
    if size is None:
        return None
    return torch.cat([torch.zeros((rows, size), dtype=torch.uint8) if states is None else states
                      for rows, states in pickers])


def _by_member(members: list[int], by_row: dict[int, Any]) -> dict[str, Any]:
    """Entries by row of a pick over `members`, keyed by member as a string (`Scores`)."""
    return {str(members[row]): entry for row, entry in by_row.items()}
