"""How the last stage picks each row's next token: greedy, or sampled as `model.generate` samples.

Sampling follows `generate`: the model's generation config, updated by the request's settings, gives the
warpers in generate's order (temperature, top-k, top-p, min-p), then softmax and one multinomial draw per
row. Each row draws from its own generator seeded with its request's `seed`, so rows of different settings
and seeds share a microbatch, and a request alone in its microbatch gets the tokens of `torch.manual_seed(seed)`
followed by `model.generate(..., do_sample=True, ...)`. A row whose logits or probabilities are not finite
fails alone (`RowFailure`); the other rows of its microbatch go on.
"""

from __future__ import annotations

import copy
import math
import secrets
from collections.abc import Sequence
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

from ..errors import ConfigError, quoted
from .logprobs import check_count, step_entries

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


def next_tokens(picker: TokenPicker, logits: torch.Tensor, ended: torch.Tensor, steps: int | Sequence[int],
                limits: list[int], eos: torch.Tensor,
                pad: int) -> tuple[torch.Tensor, torch.Tensor, dict[int, RowFailure]]:
    """The `steps`-th new token of each row (one count for all, or a count per row: rows of a slot joined at
    different steps), padding for rows that ended before; which rows have ended with it (at any of their end ids:
    the model's `eos` ids and their own `Ends`, at their own `limits` (max_new_tokens), or failed), and why each row
    that failed now did. A failed row ends: the others go on."""
    counts = [steps] * len(limits) if isinstance(steps, int) else list(steps)
    tokens, failures = picker(logits, counts, eos)
    failures = {row: failure for row, failure in failures.items() if not bool(ended[row])}
    failed = torch.zeros_like(ended)
    failed[list(failures)] = True
    tokens = tokens.masked_fill(ended | failed, pad)
    ended = ended | failed | picker.ends_at(tokens, eos)
    reached = [count >= limit for count, limit in zip(counts, limits, strict=True)]
    return tokens, ended | torch.tensor(reached, dtype=torch.bool, device=ended.device), failures


def next_tokens_scored(picker: TokenPicker, logits: torch.Tensor, ended: torch.Tensor, steps: int | Sequence[int],
                       limits: list[int], eos: torch.Tensor, pad: int,
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[int, RowFailure], dict[int, Any]]:
    """`next_tokens`, with the step's log-probabilities (`TokenPicker.logprobs`, by row) of the rows that ask for
    them and had not ended before it: what a serving stage reports with each step's tokens."""
    tokens, now_ended, failures = next_tokens(picker, logits, ended, steps, limits, eos, pad)
    return tokens, now_ended, failures, picker.logprobs(logits, tokens, ended)


@attrs.define
class _Sampler:
    """A sampled row's warpers and generator. `owed`: draws its generator made for the row elsewhere (a row
    that goes on from the tokens it had when its slot was lost), made before its next one on a distribution of
    the same size (a draw consumes the generator by the size alone), so that it goes on where it stood."""

    warpers: LogitsProcessorList
    generator: torch.Generator
    owed: int = 0


class TokenPicker:
    """One microbatch's next-token choice at the last stage: each row greedy, or sampled with its own settings
    from its own generator seeded with its seed, and ended at its own end ids (`rows`: each row's
    `Decoding.fields()`)."""

    def __init__(self, generation_config: Any, rows: list[dict[str, Any]]) -> None:
        self.samplers: list[_Sampler | None] = []
        self.refused: dict[int, RowFailure] = {}  # rows whose settings the warpers refuse
        self.ends = [Ends.of(**(fields.get("ends") or {})) for fields in rows]
        self.asks: list[int | None] = [fields.get("logprobs") for fields in rows]  # top counts of rows that ask
        built: dict[str, LogitsProcessorList] = {}  # rows of equal settings share their warpers
        for row, fields in enumerate(rows):
            if not fields.get("do_sample"):
                self.samplers.append(None)
                continue
            settings = dict(fields.get("settings", {}))
            key = repr(sorted(settings.items()))
            try:
                if key not in built:
                    config = copy.deepcopy(generation_config)
                    for name, value in {**_unset_defaults(config), **settings}.items():
                        setattr(config, name, value)
                    built[key] = _warpers(config)
            except (ValueError, TypeError) as error:
                self.refused[row] = RowFailure(f"its sampling settings are refused: {error}", input_error=True)
                self.samplers.append(None)
                continue
            self.samplers.append(_Sampler(built[key], torch.Generator().manual_seed(int(fields["seed"])),
                                          int(fields.get("drawn") or 0)))

    @property
    def sampled(self) -> bool:
        return any(sampler is not None for sampler in self.samplers)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only `rows`, in that order (the others left a slot)."""
        self.refused = {new: self.refused[old] for new, old in enumerate(rows) if old in self.refused}
        self.samplers = [self.samplers[row] for row in rows]
        self.ends = [self.ends[row] for row in rows]
        self.asks = [self.asks[row] for row in rows]

    def extend(self, other: TokenPicker) -> None:
        """Take `other`'s rows after these (a group joined a slot), with their generators as they stand."""
        offset = len(self.samplers)
        self.refused.update({offset + row: failure for row, failure in other.refused.items()})
        self.samplers += other.samplers
        self.ends += other.ends
        self.asks += other.asks

    def states(self) -> torch.Tensor | None:
        """Every row's generator state `[rows, n]` (zeros for greedy rows); None when no row samples."""
        states = [None if sampler is None else sampler.generator.get_state() for sampler in self.samplers]
        size = next((state.numel() for state in states if state is not None), None)
        if size is None:
            return None
        return torch.stack([torch.zeros(size, dtype=torch.uint8) if state is None else state for state in states])

    def set_states(self, states: torch.Tensor) -> None:
        """Put each sampled row's generator back in the state `states()` gave (a recovery resumes there)."""
        for sampler, state in zip(self.samplers, states, strict=True):
            if sampler is not None:
                sampler.generator.set_state(state.clone())
                sampler.owed = 0

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, ended_before: torch.Tensor) -> dict[int, Any]:
        """The step's log-probabilities (wire form) of the rows that ask for them and got a token (not ended
        before the step), by row."""
        if not any(ask is not None for ask in self.asks):
            return {}
        return step_entries(logits, tokens, self.asks, [not done for done in ended_before.tolist()])

    def ends_at(self, tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
        """Which rows end with `tokens` (a row each): at one of their end ids, given the model's `eos` ids."""
        if not any(ends.stop_token_ids or ends.ignore_eos for ends in self.ends):
            return torch.isin(tokens, eos.to(tokens.device))
        model_eos = eos.tolist()
        return torch.tensor([int(token) in ends.ids(model_eos) for token, ends in zip(tokens.tolist(), self.ends,
                                                                                       strict=True)],
                            dtype=torch.bool, device=tokens.device)

    def __call__(self, logits: torch.Tensor, counts: Sequence[int] | None = None,
                 eos: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, RowFailure]]:
        """Each row's next token from float32 logits `[B, vocab]` (the `counts[row]`-th of its row: its end ids
        are masked while that is at most its `min_tokens`, as `generate`'s `min_new_tokens` masks them), and the
        rows that could get none (their token is then meaningless). The warpers here read no input ids."""
        if counts is not None and eos is not None and any(ends.min_tokens for ends in self.ends):
            logits = logits.clone()
            model_eos = eos.tolist()
            for row, (count, ends) in enumerate(zip(counts, self.ends, strict=True)):
                masked = sorted(ends.ids(model_eos))
                if count <= ends.min_tokens and masked:
                    logits[row, masked] = float("-inf")
        tokens = logits.argmax(-1)
        failures = dict(self.refused)
        broken = (torch.isnan(logits) | torch.isposinf(logits)).any(-1).tolist()
        for row, sampler in enumerate(self.samplers):
            if broken[row]:
                failures[row] = RowFailure("the model's logits for it are not finite (NaN or +inf)")
            elif sampler is not None and row not in failures:
                drawn = _draw(sampler, logits[row:row + 1])
                if isinstance(drawn, RowFailure):
                    failures[row] = drawn
                else:
                    tokens[row] = drawn
        return tokens, failures


def _draw(sampler: _Sampler, logits: torch.Tensor) -> int | RowFailure:
    """One row's token drawn from its warped distribution with its own generator, as `generate` draws it."""
    no_ids = cast(torch.LongTensor, torch.empty((1, 0), dtype=torch.long))
    try:
        scores = sampler.warpers(no_ids, logits)
        probabilities = torch.nn.functional.softmax(scores, dim=-1).cpu()
        if sampler.owed:
            uniform = torch.ones_like(probabilities)
            for _ in range(sampler.owed):
                torch.multinomial(uniform, num_samples=1, generator=sampler.generator)
            sampler.owed = 0
        # On the CPU generator's side, wherever the logits are: reproducible from the seed (on a GPU it does not
        # repeat `generate`, which draws from the GPU's generator).
        return int(torch.multinomial(probabilities, num_samples=1, generator=sampler.generator))
    except (RuntimeError, ValueError) as error:  # non-finite or negative probabilities, a warper's refusal
        return RowFailure(f"its next token could not be drawn: {error}")


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
