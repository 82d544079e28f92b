"""Small random models shared by tests and the child processes they start (same seed, same weights)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from dejavu_sdk.models import random_llama


def tiny_llama(layers: int = 4) -> LlamaForCausalLM:
    """`random_llama`'s default model (vocabulary of 96 tokens, width 64), with `layers` layers."""
    return random_llama(layers=layers)


def prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 96, (2, 24), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


VOCAB = 96
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4}

#: Five architectures, random weights with a large init range: a position bug changes the tokens.
MODELS: dict[str, Callable[[], Any]] = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=128,
                                               initializer_range=0.2, pad_token_id=0)),
    "opt": lambda: OPTForCausalLM(OPTConfig(**SMALL, ffn_dim=128, max_position_embeddings=128,
                                            word_embed_proj_dim=64, init_std=0.2, pad_token_id=0)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL, intermediate_size=128, num_key_value_heads=2,
                                                  initializer_range=0.2, pad_token_id=0)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SMALL, intermediate_size=128, num_key_value_heads=2,
                                                        sliding_window=5, initializer_range=0.2, pad_token_id=0)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, intermediate_size=128, num_key_value_heads=2,
                                                  initializer_range=0.2, pad_token_id=0)),
}


class Crash(LogitsProcessor):
    """Raises in the middle of decoding, like a process dying between two steps."""

    def __init__(self, after_steps: int) -> None:
        self.steps, self.after_steps = 0, after_steps

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        if self.steps > self.after_steps:
            raise KeyboardInterrupt("crash")
        return scores


def seeded(name: str) -> Any:
    """`MODELS[name]` built after `torch.manual_seed(0)`: every process that builds it gets the same weights."""
    torch.manual_seed(0)
    return MODELS[name]().eval()


# Named as `tiny_models:<family>` by pipeline tests, whose stage processes load the model themselves.
def gpt2() -> Any:
    return seeded("gpt2")


def opt() -> Any:
    return seeded("opt")


def llama() -> Any:
    return seeded("llama")


def mistral() -> Any:
    return seeded("mistral")


def qwen2() -> Any:
    return seeded("qwen2")


def llama_text() -> Any:
    """A two-layer random llama over SmolLM2's vocabulary (49152 tokens; end-of-sequence `<|im_end|>`, 2), served
    with SmolLM2's tokenizer: its random tokens decode to text of every kind (words, split characters, specials)."""
    torch.manual_seed(0)
    model = random_llama(layers=2, vocab_size=49152, max_positions=1024)
    model.generation_config.eos_token_id = 2
    return model


def llama_two_ends() -> Any:
    """The llama of `llama()`, with two end-of-sequence tokens (as Llama 3 and Qwen2.5 instruct models have)."""
    model = seeded("llama")
    model.generation_config.eos_token_id = [2, 49]
    return model


def llama_repetition_penalty() -> Any:
    """The llama of `llama()`, whose generation config penalises repetitions (a logits processor)."""
    model = seeded("llama")
    model.generation_config.repetition_penalty = 1.3
    return model


#: A prompt holding this id makes `llama_poisoned`'s logits NaN for its row (and only its row).
POISON = 95
#: A prompt holding this id makes `llama_fatal`'s first stage process exit, every time it runs it.
FATAL = 94


def llama_poisoned() -> Any:
    """The llama of `llama()`, whose embeddings are NaN for every position of a prompt holding `POISON` (a
    decode step's token never poisons): its row gets non-finite logits, as a numerically broken request would,
    while the other rows of its microbatch are untouched."""
    model = seeded("llama")

    def poison(_: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        ids = inputs[0]
        if ids.shape[1] > 1:
            output = output.masked_fill((ids == POISON).any(1)[:, None, None], float("nan"))
        return output

    model.get_input_embeddings().register_forward_hook(poison)
    return model


def llama_fatal() -> Any:
    """The llama of `llama()`, whose process exits when its embedding sees a prompt holding `FATAL` (a decode
    step's token never kills): a request that kills the stage running it, as a poison input to a buggy kernel
    would, every time it is run."""
    model = seeded("llama")

    def exit_on_fatal(_: Any, inputs: tuple[torch.Tensor, ...]) -> None:
        ids = inputs[0]
        if ids.shape[1] > 1 and bool((ids == FATAL).any()):
            os._exit(3)

    model.get_input_embeddings().register_forward_pre_hook(exit_on_fatal)
    return model


def long_llama() -> Any:
    """A llama of 12 random layers with a context of 8,192 positions, whose prefill of an 8,000-token prompt takes
    seconds on a CPU (a fraction of a second each layer): long work, to tell from a stage that is stuck."""
    return random_llama(layers=12, max_positions=8192)


def qwen2_sliding() -> Any:
    """A Qwen2 whose later layers attend through a sliding window of 4 positions and whose first attends to the
    whole sequence: a family that mixes both kinds of layers (as Gemma and gpt-oss alternate them)."""
    torch.manual_seed(0)
    config = Qwen2Config(**SMALL, intermediate_size=128, num_key_value_heads=2, use_sliding_window=True,
                         sliding_window=4, max_window_layers=1, initializer_range=0.2, pad_token_id=0)
    return Qwen2ForCausalLM(config).eval()
