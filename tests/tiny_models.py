"""Small random models shared by tests and the child processes they start (same seed, same weights)."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM, LogitsProcessor

from dejavu_sdk.models import random_llama


def tiny_llama(layers: int = 4) -> LlamaForCausalLM:
    """`random_llama`'s default model (vocabulary of 96 tokens, width 64), with `layers` layers."""
    return random_llama(layers=layers)


def prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 96, (2, 24), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


class Crash(LogitsProcessor):
    """Raises in the middle of decoding, like a process dying between two steps."""

    def __init__(self, after_steps: int) -> None:
        self.steps, self.after_steps = 0, after_steps

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        if self.steps > self.after_steps:
            raise KeyboardInterrupt("crash")
        return scores
