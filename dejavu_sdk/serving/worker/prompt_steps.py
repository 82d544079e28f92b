"""A prompt stage's side of disaggregation: each microbatch (or group) of prompts prefilled a chunk of columns at
a time, the microbatches taking turns, so that a long prompt never holds the prompt pipeline for long.

The first prompt stage keeps each `Prefill` it receives (`PromptRun`: its prompts' `Joining`, with its own
cache) and its number in a queue of turns; whenever its inbox has nothing waiting, and after each message it
handles, it runs the next columns of the microbatch whose turn it is (`max_prefill_tokens` positions, as a
round of continuous batching runs a joining group's) and puts the microbatch back at the end of the queue until
its prompts are in. Each chunk goes on to the next prompt stage (`Prefill`, with its `columns`), which runs it
on its own part of the microbatch's cache; every stage streams each layer's new KV to the token stages as the
layer finishes. The last prompt stage scores the prompts' columns as they come and, after the last chunk, picks
the first tokens and reports them (`Prefilled`, with the `chunk`: the columns a step ran, which a slot's
schedule records so that `replay` runs the same steps).

Without a budget (`max_prefill_tokens` None) a group's prompts run in one step, in the order they came.
"""

from __future__ import annotations

from typing import Any

import torch

from ...generation.logprobs import Scores
from ...generation.picker import TokenPicker, next_tokens_scored
from ...generation.slots import Joining
from ..wire.messages import Prefill, Prefilled
from .state import PromptRun, WorkerState


class PromptSteps:
    """A prompt stage's handling of `Prefill`: a part of its `StageWorker`, on the worker's state (`worker`: its
    stage, links, epoch, and the prompt runs and turns that a recovery clears)."""

    def __init__(self, worker: WorkerState) -> None:
        self.worker = worker

    def prefill(self, message: Prefill) -> None:
        """A `Prefill` on a prompt stage: the first keeps it for its turns; another runs the columns it carries."""
        worker, number, inputs, mask = self.worker, message.microbatch, message.inputs, message.mask
        if worker.stage.first:
            cache = worker.stage.new_cache()
            worker.prompt_runs[number] = PromptRun(message.specs, list(message.ended),
                                                   Joining(list(range(len(mask))), mask.clone(), cache, inputs.clone()))
            worker.prompt_turns.append(number)
            return
        start, stop = message.columns or (0, mask.shape[1])
        if start == 0:
            worker.prompt_runs[number] = PromptRun(message.specs, list(message.ended), Joining(
                list(range(len(mask))), mask.clone(), worker.stage.new_cache()))
        run = worker.prompt_runs.get(number)
        if run is None:  # its first columns failed here, or a recovery dropped it
            return
        self._columns(number, run, inputs, int(start), int(stop))

    def turn(self) -> None:
        """The first prompt stage: run the next columns of the microbatch whose turn it is, then queue it again
        unless its prompts are in."""
        turns = self.worker.prompt_turns
        number = turns.popleft()
        run = self.worker.prompt_runs.get(number)
        if run is None:  # failed, or dropped by a recovery
            return
        start, stop = run.joining.columns(self.worker.max_prefill_tokens)
        assert run.joining.ids is not None  # the first stage keeps them
        self._columns(number, run, run.joining.ids[:, start:stop], start, stop)
        if not run.joining.complete:
            turns.append(number)

    def _columns(self, number: int, run: PromptRun, inputs: torch.Tensor, start: int, stop: int) -> None:
        """Run columns [start, stop) of the microbatch's prompts on this stage, stream each layer's new KV, and
        pass the chunk on (the last stage: score it, and after the last chunk report the first tokens)."""
        worker = self.worker
        stage, sender, joining, epoch = worker.stage, worker.sender, run.joining, worker.epoch
        first_layer = stage.layers[0]
        assert sender is not None  # a prompt stage streams every layer it runs
        last = stop >= joining.mask.shape[1]
        assert joining.cache is not None  # a prompt stage's group keeps its own cache
        layers: list[Any] = joining.cache.layers  # key/value layers, as the stage's model makes them
        if not (start == 0 and last) and not run.chunk:
            run.chunk = stop - start

        def stream_layer(local: int) -> None:
            layer = layers[local]
            if getattr(layer, "is_sliding", False):  # it keeps its last positions only: sent whole, at the end
                if last:
                    sender.layer_done(number, first_layer + local, layer.keys, layer.values, epoch)
                return
            sender.layer_done(number, first_layer + local, layer.keys[:, :, start:stop], layer.values[:, :, start:stop],
                              epoch, last)

        scores: dict[str, Any] = {}
        on_hidden = (worker.prompt_scorer(run.specs.decoding, start, joining.mask.shape[1], scores)
                     if stage.last else None)

        def forward(hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
            return stage.forward(hidden, mask, positions, cache, after_layer=stream_layer, on_hidden=on_hidden)

        output = joining.run(forward, inputs, start, stop)
        if last:
            del worker.prompt_runs[number]
        if not stage.last:
            worker.post(worker.following, Prefill(microbatch=number, specs=run.specs, ended=run.ended,
                                                  columns=(start, stop), inputs=output, mask=joining.mask))
            return
        _extend(run.prompt_logprobs, scores)
        if last:
            self._first_tokens(number, run, output)

    def _first_tokens(self, number: int, run: PromptRun, logits: torch.Tensor) -> None:
        """The last prompt stage, its prompts in: pick the first tokens and report them; the token stages go on."""
        worker, mask, specs = self.worker, run.joining.mask, run.specs
        picker = TokenPicker(worker.stage.adapter.model.generation_config, specs.decoding)
        ended = torch.zeros(len(mask), dtype=torch.bool)
        ended[[*run.ended, *worker.kept_cancels(number)]] = True  # ended by the head, or cancelled before
        worker.row_steps += int((~ended).sum())
        tokens, ended, failures, scores = next_tokens_scored(picker, logits, ended, 1, specs.max_new_tokens,
                                                             worker.eos, worker.pad)
        states = picker.states()
        rng = states if states is not None else torch.empty(0, dtype=torch.uint8)
        logprobs = {str(row): entry for row, entry in scores.items()}
        worker.post(worker.head, Prefilled(microbatch=number, failed=dict(failures), chunk=run.chunk,
                                        scores=Scores(logprobs, run.prompt_logprobs), tokens=tokens[:, None], mask=mask,
                                        ended=ended.to(torch.uint8), rng=rng))


def _extend(scores: dict[str, Any], chunk: dict[str, Any]) -> None:
    """Add a chunk's prompt log-probabilities (by row, wire form `[first index, entries]`) to those of the chunks
    before it: a row's entries continue where its earlier ones stopped."""
    for row, (first, entries) in chunk.items():
        if row in scores:
            scores[row][1].extend(entries)
        else:
            scores[row] = [first, list(entries)]
