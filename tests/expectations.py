"""What a served request should get: `model.generate` on the microbatch it was served in (tests of the
pipelines and of round-robin serving share these)."""

from __future__ import annotations

from collections import defaultdict

import tiny_models
import torch


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


def expected(model, microbatches, prompts, max_new_tokens, pad: int, eos: list[int]) -> list[torch.Tensor]:
    """For each request, `model.generate` on its microbatch (left-padded rows), cut at its own end."""
    expected: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    for members in microbatches:
        ids, mask = left_padded(prompts, members, pad)
        longest = ids.shape[1]
        out = model.generate(ids, attention_mask=mask, do_sample=False,
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
