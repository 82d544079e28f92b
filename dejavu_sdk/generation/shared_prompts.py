"""Prompt log-probabilities computed once per prompt of a microbatch: rows of one prompt (a request's n choices
with echo) are left-padded alike in their microbatch (or their group entering a slot), so their prompt's
log-probabilities are the same; the first such row asks the last stage for them, and the others read its
entries (`Microbatch.prompt_entries`). A step then scores each distinct prompt once, not once per choice."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .decoding import Decoding


class Prompted(Protocol):
    """What scoring needs of a request (`batching.Request` is one): its prompt's ids and its decoding."""

    ids: torch.Tensor
    decoding: Decoding


def prompt_sources(requests: Sequence[Prompted], first_row: int = 0) -> dict[int, int]:
    """Rows of `requests` (numbered from `first_row`, as they are prefilled together) that ask for the same
    prompt log-probabilities as an earlier one of them (the same prompt and top count): row -> that earlier
    row."""
    askers: dict[tuple[tuple[int, ...], int], int] = {}
    sources: dict[int, int] = {}
    for row, request in enumerate(requests, start=first_row):
        top = request.decoding.prompt_logprobs
        if top is None:
            continue
        key = (tuple(request.ids.tolist()), top)
        if key in askers:
            sources[row] = askers[key]
        else:
            askers[key] = row
    return sources
