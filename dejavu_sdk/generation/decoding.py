"""A request's decoding (`Decoding`: greedy, or sampled as `model.generate` samples), its ends (`Ends`), and what a
row's failure says (`RowFailure`); `picker.TokenPicker` picks each row's next token from them.

Sampling follows `generate`: the model's generation config, updated by the request's settings, gives the
warpers in generate's order (temperature, top-k, top-p, min-p), then softmax and one multinomial draw per
row. Each row draws from its own generator seeded with its request's `seed`, so rows of different settings
and seeds share a microbatch, and a request alone in its microbatch gets the tokens of `torch.manual_seed(seed)`
followed by `model.generate(..., do_sample=True, ...)`. A row whose logits or probabilities are not finite
fails alone (`RowFailure`); the other rows of its microbatch go on.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from ..errors import ConfigError, quoted
from .logprobs import check_count

#: The sampling settings a request may give (as `engine.generate` takes them).
SETTINGS = ("temperature", "top_k", "top_p", "min_p")
#: How a request may end besides its limit (`Ends`).
ENDS = ("stop_token_ids", "ignore_eos", "min_tokens")


#: Below this temperature a request is decoded greedily (as vLLM does): dividing logits by less overflows them.
GREEDY_BELOW = 1e-5


@attrs.frozen
class Ends:
    """How a request's row ends besides its `max_new_tokens`: at the model's end-of-sequence ids (unless
    `ignore_eos`) or any of `stop_token_ids`, never before `min_tokens` new tokens (those ids are masked until
    then, as `generate`'s `min_new_tokens` masks them)."""

    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0

    @classmethod
    def of(cls, stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False, min_tokens: int = 0) -> Ends:
        """ConfigError for ids that are not non-negative integers, a `min_tokens` below 0."""
        stops = tuple(stop_token_ids or ())
        if not all(isinstance(token, int) and not isinstance(token, bool) and token >= 0 for token in stops):
            raise ConfigError(f"stop_token_ids must be token ids (integers of at least 0), got "
                              f"{quoted(stop_token_ids)}")
        if not isinstance(ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be true or false, got {quoted(ignore_eos)}")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise ConfigError(f"min_tokens must be an integer of at least 0, got {quoted(min_tokens)}")
        return cls(tuple(sorted(set(stops))), ignore_eos, min_tokens)

    def ids(self, eos: Sequence[int]) -> set[int]:
        """The ids a row ends at, given the model's end-of-sequence ids."""
        return (set() if self.ignore_eos else set(eos)) | set(self.stop_token_ids)


@attrs.frozen
class Decoding:
    """A request's decoding: greedy, or sampled with `settings` (unset ones come from the model's generation
    config) from a generator of its own seeded with `seed`; and how its row ends (`ends`). Rows of different
    decodings share a microbatch. `logprobs` and `prompt_logprobs` (None: not asked): the log-probability of
    each new (prompt) token reported with the tokens this many most likely at its position (`generation.logprobs`).
    """

    do_sample: bool = False
    settings: tuple[tuple[str, float | int], ...] = ()
    seed: int | None = None
    ends: Ends = Ends()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    #: Tokens its generator drew before (`going_on`).
    drawn: int = 0

    @classmethod
    def of(cls, do_sample: bool = False, seed: int | None = None, *, stop_token_ids: Sequence[int] | None = None,
           ignore_eos: bool = False, min_tokens: int = 0, logprobs: int | None = None,
           prompt_logprobs: int | None = None, **settings: Any) -> Decoding:
        """Check a request's decoding arguments as vLLM checks them (ConfigError): `temperature` >= 0, below
        1e-5 greedy; `top_p` in (0, 1]; `top_k` -1 or 0 (off) or >= 1; `min_p` in [0, 1]; `seed` any integer a
        `torch.Generator` takes; `stop_token_ids`, `ignore_eos`, `min_tokens` as `Ends.of`; `logprobs`,
        `prompt_logprobs` 0 to `MAX_LOGPROBS`. Sampled requests without a seed get a random one."""
        ends = Ends.of(stop_token_ids, ignore_eos, min_tokens)
        logprobs, prompt_logprobs = check_count("logprobs", logprobs), check_count("prompt_logprobs", prompt_logprobs)
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ConfigError(f"unknown decoding settings {unknown}; pipelines take do_sample, seed, stop_token_ids, "
                              f"ignore_eos, min_tokens, logprobs, prompt_logprobs and {', '.join(SETTINGS)}")
        given = {name: _checked(name, value) for name, value in settings.items() if value is not None}
        if not do_sample:
            if given or seed is not None:
                raise ConfigError(f"{', '.join(sorted(given) + (['seed'] if seed is not None else []))} apply to "
                                  "sampling: pass do_sample=True as well")
            return cls(ends=ends, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        if given.get("temperature", 1.0) < GREEDY_BELOW:
            return cls(ends=ends, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        if seed is None:
            seed = secrets.randbits(63)
        else:
            _check_seed(seed)
        return cls(True, tuple(sorted(given.items())), seed, ends, logprobs, prompt_logprobs)

    def fields(self) -> dict[str, Any]:
        """As the last stage takes it (`TokenPicker`), in a message's JSON."""
        return {"do_sample": self.do_sample, "settings": dict(self.settings), "seed": self.seed,
                "ends": attrs.asdict(self.ends), "logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs,
                "drawn": self.drawn}

    def going_on(self, had: int) -> Decoding:
        """This decoding for a row that goes on from `had` tokens it already has (its prompt followed by them):
        its generator as it stood after drawing them, its `min_tokens` less them, and no prompt log-probabilities
        (they were given with the first)."""
        ends = attrs.evolve(self.ends, min_tokens=max(0, self.ends.min_tokens - had))
        return attrs.evolve(self, ends=ends, prompt_logprobs=None, drawn=self.drawn + (had if self.do_sample else 0))


def _checked(name: str, value: Any) -> float | int:
    """One sampling setting, in the range vLLM accepts (top_k -1 becomes 0: off, as transformers reads it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {quoted(value)}")
    if name == "temperature" and value < 0:
        raise ConfigError(f"temperature must be 0 or more (below {GREEDY_BELOW} is greedy), got {quoted(value)}")
    if name == "top_p" and not 0 < value <= 1:
        raise ConfigError(f"top_p must be in (0, 1], got {quoted(value)}")
    if name == "min_p" and not 0 <= value <= 1:
        raise ConfigError(f"min_p must be in [0, 1], got {quoted(value)}")
    if name == "top_k":
        if value != int(value) or value < -1:
            raise ConfigError(f"top_k must be -1 or 0 (off) or a positive integer, got {quoted(value)}")
        return max(int(value), 0)
    return value


def _check_seed(seed: Any) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {quoted(seed)}")
    try:
        torch.Generator().manual_seed(seed)
    except (ValueError, RuntimeError, OverflowError):
        raise ConfigError(f"seed must be an integer from -2**63 to 2**64 - 1, got {quoted(seed)}") from None


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


@attrs.frozen
class RowFailure:
    """Why a row could not get its next token: `reason`, and whether its input caused it (`input_error`: a setting
    the warpers refuse) or its computation did (non-finite logits or probabilities)."""

    reason: str
    input_error: bool = False


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
