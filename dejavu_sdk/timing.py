"""Measure a model's prompt time Y and per-token time t on this machine, for the planner (`dejavu plan --measure`)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from tqdm import tqdm

from .errors import ConfigError


def load_causal_lm(name: str) -> Any:
    """`smollm2` (the bundled SmolLM2-135M-Instruct) or a local Hugging Face model directory."""
    if name.lower() == "smollm2":
        from .models import load_smollm2

        return load_smollm2()[0]
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot load a causal LM from {name!r} (give 'smollm2' or a local model "
                          f"directory): {error}") from None


@torch.inference_mode()
def measure_times(model: Any, batch: int, prompt_tokens: int, repeats: int = 3,
                  progress: bool = True, threads: int | None = None) -> tuple[float, float]:
    """Median seconds of one prefill of `batch` x `prompt_tokens` tokens (Y) and of one decode step after it (t),
    with `threads` torch threads (default: as set), as a stage process with that share of the cores runs them.

    One unmeasured round warms up first; a progress bar counts the rounds (a large prefill on a CPU takes a while).
    """
    if threads is not None:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return measure_times(model, batch, prompt_tokens, repeats, progress)
        finally:
            torch.set_num_threads(previous)
    if batch < 1 or prompt_tokens < 1 or repeats < 1:
        raise ConfigError("batch, prompt tokens and repeats must be positive")
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (batch, prompt_tokens), generator=torch.Generator().manual_seed(0)).to(device)
    prompt_times, token_times = [], []
    rounds = tqdm(range(repeats + 1), desc=f"timing {batch} x {prompt_tokens} tokens", unit="round",
                  disable=not progress)
    for _ in rounds:  # the first round warms up and is not counted
        start = time.perf_counter()
        output = model(prompt, use_cache=True)
        _synchronize(device)
        prefill = time.perf_counter() - start
        next_token = output.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        model(next_token, cache=output.cache, use_cache=True)
        _synchronize(device)
        prompt_times.append(prefill)
        token_times.append(time.perf_counter() - start)
    return statistics.median(prompt_times[1:]), statistics.median(token_times[1:])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
