"""What the stages need of a microbatch's rows (`RowSpecs`), and of a group of requests entering a slot together
(`Group`): the values that travel with a microbatch's or a group's prompts, one per row."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch


@attrs.frozen
class RowSpecs:
    """Each row's `max_new_tokens` and `decoding` (`batching.row_fields`: its decoding's settings as
    `TokenPicker` takes them, with its prompt where the last stage scores the prompt's log-probabilities)."""

    max_new_tokens: list[int]
    decoding: list[dict[str, Any]]

    def only(self, rows: Sequence[int]) -> RowSpecs:
        """These specs for `rows` alone, in that order."""
        return RowSpecs([self.max_new_tokens[row] for row in rows], [self.decoding[row] for row in rows])


@attrs.frozen
class Group:
    """Requests that enter a slot together: their numbers (`members`, as the stages know them) and their rows'
    specs."""

    members: list[int]
    specs: RowSpecs

    def only(self, rows: Sequence[int]) -> Group:
        """This group with only its `rows` (by position), in that order."""
        return Group([self.members[row] for row in rows], self.specs.only(rows))


def group_rows(group: Group, ids: torch.Tensor, mask: torch.Tensor,
               rows: list[int]) -> tuple[Group, torch.Tensor, torch.Tensor]:
    """A group, its prompts and mask with only `rows`, left-padded to the longest of them."""
    ids, mask = ids[rows], mask[rows]
    trim = int((mask == 0).all(0).long().cumprod(0).sum())
    return group.only(rows), ids[:, trim:], mask[:, trim:]
