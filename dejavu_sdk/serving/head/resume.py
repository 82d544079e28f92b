"""Where each microbatch in flight goes on from after a recovery: a pure function of what the survivors and the
replicas hold, tested without processes."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import attrs
import torch

from ...generation.batching import Microbatch
from ..layout import Layout


def resume_point(prompt: int, tokens: int, replicas: Sequence[int]) -> int | None:
    """The cache positions a microbatch resumes from: its `prompt` (padded) positions and the `tokens` the head
    holds give P + tokens - 1 positions on every surviving stage; each dead stage's replica reaches
    `replicas[i]`. None when some replica lacks part of the prompt (the microbatch starts over)."""
    positions = min([prompt + tokens - 1, *replicas])
    return positions if positions >= prompt and tokens >= 1 else None


def ended_rows(generated: Sequence[Sequence[int]], steps: int, limits: Sequence[int], eos: Sequence[int],
               dropped: Collection[int] = ()) -> torch.Tensor:
    """Which rows had ended once `steps` tokens were picked (as the last stage tracks it), the `dropped` ones
    (failed or cancelled) included."""
    return torch.tensor([any(token in eos for token in row[:steps]) or steps >= limit or index in dropped
                         for index, (row, limit) in enumerate(zip(generated, limits, strict=True))],
                        dtype=torch.uint8)


@attrs.frozen
class ResumePlan:
    """Where each microbatch in flight goes on from: `resumed` (microbatch -> the step whose token it is fed
    again), `recomputed` (from its prompt), `finished` (every row had ended), `failed` (poison)."""

    resumed: dict[int, int]
    recomputed: list[int]
    finished: list[int]
    failed: list[int]


def plan_resume(in_flight: Sequence[tuple[int, Microbatch, str]], dead: Collection[int], layout: Layout,
                mode: str | None, eos: Sequence[int], survivors_hold: Callable[[int], bool],
                reach: Callable[[int, int], int]) -> ResumePlan:
    """The plan for the microbatches `in_flight` (number, batch, phase) when the stages `dead` are replaced,
    recovering by `mode` ("replicas" or "recompute"): `survivors_hold(number)` says whether every surviving
    decoding stage still holds the microbatch's cache, `reach(stage, number)` how far a dead stage's replica of
    it reaches (-1: gone). A microbatch in flight at the previous recovery too with no new step since fails
    (one staged waits: it computes nothing to blame)."""
    plan = ResumePlan({}, [], [], [])
    for number, batch, phase in in_flight:
        prompt, tokens = batch.mask.shape[1], len(batch.generated[0])
        if tokens and bool(ended_rows(batch.generated, tokens, batch.max_new_tokens, eos, batch.dropped).all()):
            plan.finished.append(number)
            continue
        if phase != "staged" and batch.seen_by_recovery == batch.steps_received:
            plan.failed.append(number)
            continue
        point: int | None = None
        if mode == "replicas" and phase == "decoding" and survivors_hold(number):
            point = resume_point(prompt, tokens, [reach(index, number) for index in layout.decoding_stages()
                                                  if index in dead])
            if point is not None and batch.sampled and point - prompt + 1 not in batch.rng_states:
                point = None  # the generators' states at that step are not known: start over
        if point is None:
            plan.recomputed.append(number)
        else:
            plan.resumed[number] = point - prompt + 1
    return plan
