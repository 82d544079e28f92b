"""How the last stage picks each row's next token: greedy, or sampled as `model.generate` samples.

Sampling follows `generate`: the model's generation config, updated by the request's settings, gives the
warpers in generate's order (temperature, top-k, top-p, min-p), then softmax and one multinomial draw per
row. Each microbatch draws from its own generator seeded with its `seed`, so a microbatch's tokens equal
`torch.manual_seed(seed)` followed by `model.generate(..., do_sample=True, ...)` on that microbatch.
"""

from __future__ import annotations

import copy
import secrets
from typing import Any, cast

import attrs
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..errors import ConfigError

#: The sampling settings a request may give (as `engine.generate` takes them).
SETTINGS = ("temperature", "top_k", "top_p", "min_p")


@attrs.frozen
class Decoding:
    """A request's decoding: greedy, or sampled with `settings` (unset ones come from the model's generation
    config) from a generator seeded with `seed`. Requests share a microbatch only with equal decodings."""

    do_sample: bool = False
    settings: tuple[tuple[str, float | int], ...] = ()
    seed: int | None = None

    @classmethod
    def of(cls, do_sample: bool = False, seed: int | None = None, **settings: Any) -> Decoding:
        """Check a request's decoding arguments; sampled requests without a seed get a random one."""
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ConfigError(f"unknown decoding settings {unknown}; pipelines take do_sample, seed and "
                              f"{', '.join(SETTINGS)}")
        given = {name: value for name, value in settings.items() if value is not None}
        if not do_sample:
            if given or seed is not None:
                raise ConfigError(f"{', '.join(sorted(given) + (['seed'] if seed is not None else []))} apply to "
                                  "sampling: pass do_sample=True as well")
            return cls()
        for name, value in given.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{name} must be a non-negative number, got {value!r}")
        if seed is None:
            seed = secrets.randbits(63)
        elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ConfigError(f"seed must be an integer from 0 to 2**63 - 1, got {seed!r}")
        return cls(True, tuple(sorted(given.items())), seed)

    def fields(self) -> dict[str, Any]:
        """As message fields, for the last stage."""
        return {"do_sample": self.do_sample, "settings": dict(self.settings), "seed": self.seed}


@attrs.frozen
class TokenRules:
    """What a model's configuration says about its tokens: every end-of-sequence id (a row ends at any),
    the padding id, the context length, the vocabulary size; and why sampled requests are refused, if they are
    (settings of its generation config that the last stage does not apply)."""

    eos: list[int]
    pad: int
    context: int | None
    vocabulary: int
    sampling_refused: ConfigError | None

    @classmethod
    def of(cls, model: Any) -> TokenRules:
        """ConfigError when the model's generation config asks for greedy processing no stage applies."""
        config, generation = model.config, model.generation_config
        check_unsupported(generation, GREEDY_UNSUPPORTED, "decoding greedily")
        try:
            check_unsupported(generation, SAMPLING_UNSUPPORTED, "sampling")
            refused = None
        except ConfigError as refusal:  # greedy requests are still served
            refused = refusal
        context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        eos = generation.eos_token_id
        eos_ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
        pad = generation.pad_token_id if generation.pad_token_id is not None else config.pad_token_id
        return cls(eos_ids, pad if pad is not None else (eos_ids[0] if eos_ids else 0), context, config.vocab_size,
                   refused)


def next_tokens(picker: TokenPicker, logits: torch.Tensor, ended: torch.Tensor, steps: int, limits: list[int],
                eos: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `steps`-th new token of each row (padding for rows that ended before), and which rows have ended
    with it: at any of the `eos` ids, or at their own `limits` (max_new_tokens)."""
    tokens = picker(logits).masked_fill(ended, pad)
    ended = ended | torch.isin(tokens, eos.to(tokens.device))
    return tokens, ended | torch.tensor([steps >= limit for limit in limits], device=ended.device)


class TokenPicker:
    """One microbatch's next-token choice at the last stage (greedy, or sampled from its own generator)."""

    def __init__(self, generation_config: Any, fields: dict[str, Any]) -> None:
        self.sampled = bool(fields.get("do_sample"))
        self.warpers = LogitsProcessorList()
        self.generator: torch.Generator | None = None
        if self.sampled:
            config = copy.deepcopy(generation_config)
            for name, value in {**_unset_defaults(config), **fields.get("settings", {})}.items():
                setattr(config, name, value)
            self.warpers = _warpers(config)
            self.generator = torch.Generator().manual_seed(int(fields["seed"]))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's next token from float32 logits `[B, vocab]` (the warpers here read no input ids)."""
        if not self.sampled:
            return logits.argmax(-1)
        no_ids = cast(torch.LongTensor, torch.empty((len(logits), 0), dtype=torch.long))
        scores = self.warpers(no_ids, logits)
        probabilities = torch.nn.functional.softmax(scores, dim=-1)
        # The draw is on the CPU generator's side, wherever the logits are: reproducible from the seed (on a GPU
        # it does not repeat `generate`, which draws from the GPU's generator).
        draw = torch.multinomial(probabilities.cpu(), num_samples=1, generator=self.generator).squeeze(1)
        return draw.to(logits.device)


def _warpers(config: Any) -> LogitsProcessorList:
    """The warpers `generate` applies when sampling with one beam, in its order and with its conditions."""
    warpers = LogitsProcessorList()
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    if config.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
    return warpers


#: Generation settings that change greedy decoding's tokens, with the value that changes nothing: the last
#: stage applies no such logits processing yet.
GREEDY_UNSUPPORTED = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                      "min_length": 0, "min_new_tokens": None, "bad_words_ids": None, "suppress_tokens": None,
                      "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
                      "sequence_bias": None, "exponential_decay_length_penalty": None}
#: Sampling settings that the last stage does not apply yet, with their neutral values.
SAMPLING_UNSUPPORTED = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None}


def check_unsupported(generation_config: Any, unsupported: dict[str, Any], what: str) -> None:
    """ConfigError naming the settings of `unsupported` that the model's generation config sets: the
    pipeline's tokens would differ from `model.generate`'s. `what` says which decoding they affect."""
    changed = sorted(name for name, neutral in unsupported.items()
                     if getattr(generation_config, name, neutral) not in (neutral, None))
    if changed:
        raise ConfigError(f"the model's generation config sets {', '.join(changed)}, which pipelines do not apply "
                          f"when {what}: their tokens would differ from model.generate's; reset them in the "
                          "model's generation_config")


#: What `generate` uses for a sampling setting that neither the request nor the model's config sets.
_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None}


def _unset_defaults(config: Any) -> dict[str, Any]:
    """Transformers' own defaults (top_k 50, ...) for the settings `config` leaves unset, as `generate` fills
    them in; read from transformers where it says them, so that a change there is followed here."""
    defaults = dict(_DEFAULTS)
    read = getattr(GenerationConfig, "_get_default_generation_params", None)
    if callable(read):
        defaults.update({name: value for name, value in read().items() if name in defaults})
    return {name: value for name, value in defaults.items() if getattr(config, name, None) is None}
