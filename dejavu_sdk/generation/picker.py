"""Each row's next token at the last stage (`TokenPicker`): greedy, or drawn as `model.generate` draws it, from
the row's own generator seeded with its seed and warped by generate's warpers in generate's order (`decoding`
says what a request asks for)."""

from __future__ import annotations

import copy
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

from .decoding import Ends, RowFailure
from .logprobs import step_entries


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


def _unset_defaults(config: Any) -> dict[str, Any]:
    """Transformers' own defaults (top_k 50, ...) for the settings `config` leaves unset, as `generate` fills
    them in; read from transformers where it says them, so that a change there is followed here."""
    defaults = dict(_DEFAULTS)
    read = getattr(GenerationConfig, "_get_default_generation_params", None)
    if callable(read):
        defaults.update({name: value for name, value in read().items() if name in defaults})
    return {name: value for name, value in defaults.items() if getattr(config, name, None) is None}


#: What `generate` uses for a sampling setting that neither the request nor the model's config sets.
_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None}
