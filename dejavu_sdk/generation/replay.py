"""The reference for continuous batching: a slot's recorded rounds replayed through the whole model in one
process.

A row's tokens under continuous batching depend on the rows it shared its slot with (their padding and their
number change the arithmetic of a step, as they do in `model.generate` on a padded batch). `replay` runs the
rounds a slot recorded (`Result.schedule`) through the model's own forward, with a `DynamicCache` changed
between steps as the slot's was (`slots.leave`, `slots.stack`), each row picking its tokens with its own
decoding; the tokens of every request that ended in those rounds come out. A pipeline's rows equal them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import DynamicCache

from ..errors import ConfigError
from .batching import Request, kept_tokens, left_pad
from .decoding import TokenPicker, TokenRules
from .slots import Joining, Round, SlotRows, leave, stack


@torch.no_grad()
def replay(model: Any, schedule: Sequence[Round], requests: Mapping[int, Request]) -> dict[int, torch.Tensor]:
    """Each request of `schedule`'s rounds (`requests`: by number, with its prompt, `max_new_tokens` and
    decoding) and the new tokens the rounds give it, up to its end; a request whose row failed is left out."""
    rules = TokenRules.of(model)
    device = next(model.parameters()).device
    eos = torch.tensor(rules.eos, dtype=torch.long)
    pickers: dict[int, TokenPicker] = {}
    generated: dict[int, list[int]] = {}
    failed: set[int] = set()
    rows, cache = SlotRows(), DynamicCache(config=model.config)
    group: Joining | None = None
    ready: tuple[DynamicCache, SlotRows] | None = None

    def forward(inputs: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, into: DynamicCache) -> torch.Tensor:
        return model(input_ids=inputs, attention_mask=mask, position_ids=positions, cache=into,
                     use_cache=True).logits[:, -1, :].float()

    def pick(members: Sequence[int], logits: torch.Tensor) -> None:
        for row, member in enumerate(members):
            tokens, failures = pickers[member](logits[row:row + 1], [len(generated[member]) + 1], eos)
            if failures:  # the row ends, failed: the schedule has it leave at the next round
                failed.add(member)
            generated[member].append(int(tokens[0]))

    for number, step in enumerate(schedule):
        rows = leave(cache, rows, step.left)
        if step.joined:
            if ready is None:
                raise ConfigError(f"round {number} joins {step.joined}, which no round prefilled")
            group_cache, group_rows = ready
            gone = [member for member in group_rows.members if member not in step.joined]
            rows = stack(cache, rows, group_cache, leave(group_cache, group_rows, gone))
            ready = None
        if step.decoded:
            if list(step.decoded) != rows.members:
                raise ConfigError(f"round {number} decodes {list(step.decoded)}; the slot holds {rows.members}")
            mask, positions = rows.next_step()
            last = torch.tensor([[generated[member][-1]] for member in rows.members], dtype=torch.long, device=device)
            pick(rows.members, forward(last, mask, positions, cache))
        if step.prefill is not None:
            members, start, _ = step.prefill
            if start == 0:
                unknown = [member for member in members if member not in requests]
                if unknown:
                    raise ConfigError(f"round {number} prefills requests {unknown}, which were not given")
                ids, mask = left_pad([requests[member].ids for member in members], rules.pad)
                group = Joining(list(members), mask.to(device), DynamicCache(config=model.config), ids.to(device))
                for member in members:
                    pickers[member] = TokenPicker(model.generation_config, [requests[member].decoding.fields()])
                    generated[member] = []
            if group is None or group.ids is None or list(members) != group.members:
                raise ConfigError(f"round {number} goes on prefilling {list(members)}, which no round started")
            for begin, end in step.prefill_steps():
                logits = group.run(forward, group.ids[:, begin:end], begin, end)
            if group.complete:
                pick(group.members, logits)
                ready, group = (group.cache, group.rows()), None
    return {member: torch.tensor(kept_tokens(tokens, requests[member].max_new_tokens,
                                       requests[member].decoding.ends.ids(rules.eos)), dtype=torch.long)
            for member, tokens in generated.items() if member not in failed}

