"""What a served request should get: `model.generate` on the microbatch it was served in (tests of the
pipelines and of round-robin serving share these)."""

from __future__ import annotations

from collections import defaultdict

import tiny_models
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def prompts(count: int, seed: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, tiny_models.VOCAB, (int(length),), generator=generator)
            for length in torch.randint(3, 12, (count,), generator=generator)]


def microbatches(results) -> list[list[int]]:
    """The requests (by index) of each microbatch, in row order, as the results say."""
    batches: dict[int, dict[int, int]] = defaultdict(dict)
    for index, result in enumerate(results):
        batches[result.microbatch][result.row] = index
    return [[rows[row] for row in sorted(rows)] for _, rows in sorted(batches.items())]


def left_padded(prompts, members, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The microbatch of `prompts[members]`, left-padded to the longest: ids and mask."""
    longest = max(prompts[index].numel() for index in members)
    ids = torch.full((len(members), longest), pad)
    mask = torch.zeros((len(members), longest), dtype=torch.long)
    for row, index in enumerate(members):
        ids[row, longest - prompts[index].numel():] = prompts[index]
        mask[row, longest - prompts[index].numel():] = 1
    return ids, mask


def expected(model, microbatches, prompts, max_new_tokens, pad: int, eos: list[int],
             max_prefill_tokens: int | None = None) -> list[torch.Tensor]:
    """For each request, `model.generate` on its microbatch (left-padded rows), cut at its own end; with
    `max_prefill_tokens`, its prompts prefilled in chunks of that many positions over the rows, as a static slot
    runs them (`prefill_chunk_size`: max_prefill_tokens // rows columns)."""
    expected: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    for members in microbatches:
        ids, mask = left_padded(prompts, members, pad)
        longest = ids.shape[1]
        columns = None if max_prefill_tokens is None else max(1, max_prefill_tokens // len(members))
        chunks = {} if columns is None else {"prefill_chunk_size": columns}
        out = model.generate(ids, attention_mask=mask, do_sample=False, **chunks,
                             max_new_tokens=max(max_new_tokens[index] for index in members))[:, longest:]
        for row, index in enumerate(members):
            tokens = out[row, :max_new_tokens[index]].tolist()
            end = next((position for position, token in enumerate(tokens) if token in eos), None)
            if end is not None:
                tokens = tokens[:end + 1]
            expected[index] = torch.tensor(tokens, dtype=torch.long)
    return expected


def sampled(model, prompts, members, new_tokens, pad, eos, seed, **settings) -> list[torch.Tensor]:
    """`torch.manual_seed(seed)` then `model.generate(do_sample=True)` on one microbatch, cut per row."""
    ids, mask = left_padded(prompts, members, pad)
    longest = ids.shape[1]
    torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=new_tokens, **settings)[:, longest:]
    rows = []
    for row in range(len(members)):
        tokens = out[row].tolist()
        end = next((position for position, token in enumerate(tokens) if token in eos), None)
        rows.append(torch.tensor(tokens if end is None else tokens[:end + 1], dtype=torch.long))
    return rows


class _RowDraws(LogitsProcessor):
    """Makes `generate` pick each row's token its own way: greedy rows keep their logits (generate's argmax picks),
    a sampled row's token is drawn from its own `torch.Generator().manual_seed(seed)` over its logits warped by
    transformers' warpers in generate's order; the drawn token is then the only one left."""

    def __init__(self, decodings: list[dict]) -> None:
        self.rows = []
        for decoding in decodings:
            if not decoding.get("do_sample"):
                self.rows.append(None)
                continue
            warpers = LogitsProcessorList()
            if decoding.get("temperature", 1.0) != 1.0:
                warpers.append(TemperatureLogitsWarper(decoding["temperature"]))
            if decoding.get("top_k", 0):
                warpers.append(TopKLogitsWarper(decoding["top_k"]))
            if decoding.get("top_p", 1.0) < 1.0:
                warpers.append(TopPLogitsWarper(decoding["top_p"]))
            if decoding.get("min_p"):
                warpers.append(MinPLogitsWarper(decoding["min_p"]))
            self.rows.append((warpers, torch.Generator().manual_seed(decoding["seed"])))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        picked = scores.clone()
        for row, sampler in enumerate(self.rows):
            if sampler is not None:
                warpers, generator = sampler
                probabilities = torch.softmax(warpers(input_ids[row:row + 1], scores[row:row + 1]), dim=-1)
                token = int(torch.multinomial(probabilities, 1, generator=generator))
                picked[row] = float("-inf")
                picked[row, token] = 0.0
        return picked


def replayed(model, prompts, members, decodings: list[dict], max_new_tokens: list[int], pad: int,
             eos: list[int]) -> list[torch.Tensor]:
    """Each row of one microbatch (`prompts[members]`, left-padded) run through `model` in this process, every
    row decoded its own way (`decodings`: greedy, or `do_sample` with explicit `temperature`, `top_k`, `top_p`,
    `min_p` and a `seed`), cut at its own end (any of `eos`, or its `max_new_tokens`)."""
    ids, mask = left_padded(prompts, members, pad)
    longest = ids.shape[1]
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(max_new_tokens),
                         logits_processor=LogitsProcessorList([_RowDraws(decodings)]), pad_token_id=pad)[:, longest:]
    rows = []
    for row, limit in enumerate(max_new_tokens):
        tokens = out[row, :limit].tolist()
        end = next((position for position, token in enumerate(tokens) if token in eos), None)
        rows.append(torch.tensor(tokens if end is None else tokens[:end + 1], dtype=torch.long))
    return rows
