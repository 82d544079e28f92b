"""One process, one model, several microbatches decoded round robin, within a device budget for their KV.

`RoundRobin` groups requests into microbatches as the pipelines do (arrival order, up to `microbatch` rows,
left padded), prefills one as soon as its cache fits in the budget, and steps the microbatches in flight in
turn until every row has ended. Their caches live in `swapped_caches.SwappedCaches`: all on the device, or with
swapping in host memory with two on the device, so that about twice the microbatches fit in the same budget.
Each microbatch's tokens equal `model.generate` on it (the model runs as one whole `Stage`).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from tqdm import tqdm

from ..errors import ConfigError, RequestFailed
from ..swapped_caches import SwappedCaches
from ..swapping import (
    SwapChoice,
    check_budget,
    check_fits_alone,
    check_swapping,
    choose_swapping,
    kv_bytes_per_token,
    measure_host_bandwidth,
    positions_needed,
)
from ..timing import measure_times
from .adapters import adapter_for
from .admission import Admission
from .batching import Microbatch, Request, Result, cache_bytes, check_new_tokens, check_prompt
from .decoding import Decoding, RowFailure, TokenRules
from .picker import TokenPicker, next_tokens
from .stage import Stage, position_ids

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class _InFlight:
    """A microbatch between steps: its mask, positions, last tokens and how its rows stand."""

    batch: Microbatch
    reserved: int
    mask: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor
    ended: torch.Tensor
    picker: TokenPicker
    steps: int = 1


class RoundRobin:
    """Decodes requests in microbatches round robin on `model`, their caches within `kv_budget_bytes` of device
    memory (None: no limit), swapped to host memory (`swapping=True`), not (`False`) or as `choose_swapping`
    decides from the measured step time and host bandwidth (`"auto"`; `choice` then says what and why).

    Admission keeps the caches' final sizes within the budget: without swapping all of the microbatches in
    flight, with swapping the two largest (any two may be on the device at once). A budget that cannot hold a
    single request's cache (two with swapping) is a ConfigError before anything runs.
    """

    def __init__(self, model: Any, *, microbatch: int = 4, kv_budget_bytes: int | None = None,
                 swapping: bool | str = "auto", progress: bool = False) -> None:
        if isinstance(microbatch, bool) or not isinstance(microbatch, int) or microbatch < 1:
            raise ConfigError(f"microbatch must be a positive integer, got {microbatch!r}")
        self.budget = check_budget(kv_budget_bytes)
        self.swapping = check_swapping(swapping)
        self.rules = TokenRules.of(model)
        self.model, self.microbatch, self.progress = model, microbatch, progress
        self.device = next(model.parameters()).device
        self.bytes_per_token = kv_bytes_per_token(model.config, next(model.parameters()).dtype)
        self.choice: SwapChoice | None = None
        self.caches: SwappedCaches | None = None
        self.most_in_flight = 0  # the most microbatches that were in flight at once
        self._stage = Stage(model, (0, _layer_count(model)))  # the whole model (ConfigError: no adapter)

    def requests(self, prompts: Sequence[Any], max_new_tokens: int | Sequence[int],
                 decoding: Decoding) -> list[Request]:
        """Checked requests for `prompts`, with one `max_new_tokens` for all or one each (ConfigError for any bad
        one, before anything runs)."""
        if decoding.do_sample and self.rules.sampling_refused is not None:
            raise self.rules.sampling_refused
        if not prompts:
            raise ConfigError("no prompts to generate from")
        limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(limits) != len(prompts):
            raise ConfigError(f"{len(limits)} max_new_tokens for {len(prompts)} prompts")
        checked = []
        for ids, limit in zip(prompts, limits, strict=True):
            prompt = check_prompt(ids, self.rules.context, self.rules.vocabulary)
            checked.append(Request(prompt, check_new_tokens(limit, prompt.numel(), self.rules.context), decoding))
        return checked

    @torch.no_grad()
    def run(self, requests: list[Request]) -> list[Result]:
        """Serve `requests` to the end; their results in the same order."""
        swapping = self._decide(requests)
        self.caches = caches = SwappedCaches(self.model.config, self.device, swapping)
        admission = Admission(self.budget, swapping, self.bytes_per_token)
        waiting, flight, results = deque(requests), deque[_InFlight](), {}
        numbers = iter(range(len(requests)))
        with tqdm(total=sum(request.max_new_tokens for request in requests), desc="round robin", unit="token",
                  disable=not self.progress) as bar:
            while waiting or flight:
                while waiting:
                    taken = admission.take(waiting, self.microbatch, [state.reserved for state in flight])
                    if not taken:
                        break
                    batch = Microbatch.of(next(numbers), taken, self.rules.pad)
                    state = self._prefill(batch, caches)
                    bar.update(len(taken))
                    if state is not None:
                        flight.append(state)
                        self.most_in_flight = max(self.most_in_flight, len(flight))
                    else:  # every row ended with its first token
                        results.update(_results(batch, self.rules.eos))
                for _ in range(len(flight)):
                    state = flight.popleft()
                    active = int((~state.ended).sum())
                    self._step(state, caches)
                    bar.update(active)
                    if bool(state.ended.all()):
                        caches.remove(state.batch.number)
                        results.update(_results(state.batch, self.rules.eos))
                    else:
                        flight.append(state)
        return [results[request.number] for request in requests]

    # ---- admission --------------------------------------------------------------------------------------
    def _decide(self, requests: list[Request]) -> bool:
        """Swap or not; ConfigError when the budget cannot hold one request (two with `swapping=True`)."""
        alone = max(cache_bytes([request], self.bytes_per_token) for request in requests)
        check_fits_alone(alone, self.budget, False)
        if self.swapping == "auto":
            self.choice = self._choose(requests, alone)
            log.info("swapping %s: %s", "on" if self.choice.swapping else "off", self.choice.reason)
            return self.choice.swapping
        check_fits_alone(alone, self.budget, bool(self.swapping))
        return bool(self.swapping)

    def _choose(self, requests: list[Request], alone: int) -> SwapChoice:
        groups = [requests[start:start + self.microbatch] for start in range(0, len(requests), self.microbatch)]
        reservations = [cache_bytes(group, self.bytes_per_token) for group in groups]
        batch = len(groups[0])
        prompt = int(statistics.median(request.ids.numel() for request in requests))
        new = int(statistics.median(request.max_new_tokens for request in requests))

        def measure() -> tuple[float, float]:
            _, token_time = measure_times(self.model, batch, prompt, repeats=2, progress=self.progress)
            return token_time, measure_host_bandwidth(self.device, max(reservations))

        return choose_swapping(fits_without=self.budget is None or sum(reservations) <= self.budget, batch=batch,
                               prompt_tokens=prompt, new_tokens=new, cache_bytes_per_token=self.bytes_per_token,
                               device_is_host=self.device.type != "cuda",
                               two_slots=self.budget is None or 2 * alone <= self.budget, measure=measure)

    # ---- steps ------------------------------------------------------------------------------------------
    def _prefill(self, batch: Microbatch, caches: SwappedCaches) -> _InFlight | None:
        """Run a new microbatch's prompt and pick its first tokens; None when every row ended with them."""
        mask = batch.mask.to(self.device)
        positions = position_ids(mask)
        cache = caches.new_cache(batch.number)
        logits = self._stage.forward(batch.ids.to(self.device), mask, positions, cache)
        caches.add(batch.number, positions_needed(batch.ids.shape[1], max(batch.max_new_tokens)))
        picker = TokenPicker(self.model.generation_config, batch.row_specs().decoding)
        ended = torch.zeros(len(batch.requests), dtype=torch.bool, device=self.device)
        tokens, ended, failures = next_tokens(picker, logits, ended, 1, batch.max_new_tokens, self._eos,
                                              self.rules.pad)
        _raise_first(batch, failures)
        batch.add_step(tokens.tolist())
        state = _InFlight(batch, cache_bytes(batch.requests, self.bytes_per_token), mask, positions[:, -1:], tokens,
                          ended, picker)
        if bool(ended.all()):
            caches.remove(batch.number)
            return None
        return state

    def _step(self, state: _InFlight, caches: SwappedCaches) -> None:
        number = state.batch.number
        state.mask = torch.cat([state.mask, state.mask.new_ones(len(state.mask), 1)], dim=1)
        state.positions = state.positions + 1
        cache = caches.acquire(number)
        logits = self._stage.forward(state.tokens[:, None], state.mask, state.positions, cache)
        caches.release(number)
        state.steps += 1
        state.tokens, state.ended, failures = next_tokens(state.picker, logits, state.ended, state.steps,
                                                          state.batch.max_new_tokens, self._eos, self.rules.pad)
        _raise_first(state.batch, failures)
        state.batch.add_step(state.tokens.tolist())

    @property
    def _eos(self) -> torch.Tensor:
        return torch.tensor(self.rules.eos, dtype=torch.long)


def _results(batch: Microbatch, eos: list[int]) -> dict[int, Result]:
    return {request.number: result for request, result in zip(batch.requests, batch.results(eos), strict=True)}


def _raise_first(batch: Microbatch, failures: dict[int, RowFailure]) -> None:
    """One process serves one call: a row that could get no token fails the call, naming its request."""
    for row, failure in failures.items():
        raise RequestFailed(failure.reason, batch.requests[row].number, failure.input_error)


def _layer_count(model: Any) -> int:
    return len(adapter_for(model).decoder_layers())
