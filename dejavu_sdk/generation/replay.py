"""The reference for continuous batching: a slot's recorded rounds replayed through the whole model in one
process.

A row's tokens under continuous batching depend on the rows it shared its slot with (their padding and their
number change the arithmetic of a step, as they do in `model.generate` on a padded batch). `replay` runs the
rounds a slot recorded (`Result.schedule`) through the model's own forward, with a `DynamicCache` changed
between steps as the slot's was (`slots.leave`, `slots.stack`), each row picking its tokens with its own
decoding; the tokens of every request that ended in those rounds come out. A pipeline's rows equal them.

A schedule may run through several slots: a slot lost in a recovery that kept no replica of it ends with a
`lost` round, and its rows go on in another slot from their prompts followed by the tokens they had (`resumed`),
each with its generator where it stood: the replay does the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import DynamicCache

from ..errors import ConfigError
from .batching import Request, kept_tokens, left_pad
from .decoding import TokenRules
from .picker import TokenPicker
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

    def start_row(member: int, had: list[int]) -> None:
        """A row's decoding as it is prefilled: new, or going on from the tokens it `had` (as this replay gave
        them if it ran its earlier slot, with its generator where it stood; else from a picker that owes them)."""
        if member in generated:
            if generated[member] != had:
                raise ConfigError(f"request {member} goes on from {had}; its earlier rounds gave {generated[member]}")
            return
        fields = requests[member].decoding.fields()  # the counts picks are made with are the row's whole
        fields["drawn"] = len(had) if fields["do_sample"] else 0  # life's, its min_tokens too
        pickers[member] = TokenPicker(model.generation_config, [fields])
        generated[member] = had

    def pick(members: Sequence[int], logits: torch.Tensor) -> None:
        for row, member in enumerate(members):
            tokens, failures = pickers[member](logits[row:row + 1], [len(generated[member]) + 1], eos)
            if failures:  # the row ends, failed: the schedule has it leave at the next round
                failed.add(member)
            generated[member].append(int(tokens[0]))

    for number, step in enumerate(schedule):
        if step.lost:  # the slot is gone with its cache; another slot's rounds follow from its start
            rows, cache, group, ready = SlotRows(), DynamicCache(config=model.config), None, None
            continue
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
                had = dict(step.resumed)
                for member in members:
                    start_row(member, list(had.get(member, ())))
                ids, mask = left_pad([torch.cat([requests[member].ids.reshape(-1),
                                                 torch.tensor(generated[member], dtype=torch.long)])
                                      for member in members], rules.pad)
                group = Joining(list(members), mask.to(device), DynamicCache(config=model.config), ids.to(device))
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

