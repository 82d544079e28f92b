"""The base classes of the pipeline's messages, and the tensors they carry.

A message is a frozen attrs class: its `kind` names its class on the wire (`codec`), its attributes are small
JSON values (or value classes of them) and tensors (compared `BY_VALUE`). A message of an epoch (`EpochMessage`)
is dropped by a stage worker whose epoch is past it: a recovery began since, and decided where its microbatch
goes on from. One about a microbatch (`MicrobatchMessage`) names it: a static microbatch, a slot, or a group in
the prompt pipeline, by its number.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch


def same_tensor(first: torch.Tensor | None, second: torch.Tensor | None) -> bool:
    """Whether two tensors (or Nones) are equal: dtype, shape and values."""
    if first is None or second is None:
        return first is second
    return first.dtype == second.dtype and first.shape == second.shape and bool(torch.equal(first, second))


#: How tensor attributes compare: by dtype, shape and values.
BY_VALUE = attrs.cmp_using(eq=same_tensor)


def empty_tensor() -> torch.Tensor:
    """The default of a tensor attribute that a message of its class may have nothing in."""
    return torch.zeros(0)


@attrs.frozen(kw_only=True)
class Message:
    """A message between the pipeline's head and its stage workers (or between two workers)."""

    kind: ClassVar[str] = ""


@attrs.frozen(kw_only=True)
class EpochMessage(Message):
    """A message sent in `epoch`: a stage worker drops it once its own epoch is later."""

    epoch: int = 0


@attrs.frozen(kw_only=True)
class MicrobatchMessage(EpochMessage):
    """A message about microbatch `microbatch` (a static microbatch, a slot, or a group in the prompt pipeline)."""

    microbatch: int
