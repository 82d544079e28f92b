"""Log-probabilities of tokens, as the last stage reports them: of each picked token and of each prompt token.

A row that asks for them (`Decoding.logprobs`, `Decoding.prompt_logprobs`: how many of the most likely tokens to
list beside the chosen one, 0 to `MAX_LOGPROBS`) gets, at each step, the log-probability of its token under the
log-softmax of the logits the step computed (the model's raw logits, before temperature or top-k/p: what vLLM
reports by default), and the `top` most likely tokens with theirs. Prompt log-probabilities come from the logits
of every prompt position, as one forward pass of the model over the prompt gives them; the first prompt token
has none.

On the wire (message fields, JSON) an entry is `[logprob, [ids], [logprobs]]`; a prompt's entries come as
`[index, [entries]]`, the entries of its tokens from `index` on (a prompt run in chunks sends each chunk's with
the round that ran it: a recovery that runs a chunk again sends the same entries again).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from ..errors import ConfigError, quoted

#: The most top tokens a request may ask for at each position (vLLM's default `max_logprobs`).
MAX_LOGPROBS = 20
#: What a JSON answer says for a log-probability of -inf (JSON has no infinity): vLLM's floor.
FLOOR = -9999.0
#: Prompt positions whose logits are made at once (a long prompt's logits over a large vocabulary take GBs).
SCORED_COLUMNS = 256


@attrs.frozen
class TokenLogprobs:
    """A token's log-probability, and the `top` most likely tokens at its position with theirs (most likely
    first)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def wire(self) -> list[Any]:
        return [self.logprob, [token for token, _ in self.top], [value for _, value in self.top]]

    @classmethod
    def of_wire(cls, entry: Sequence[Any]) -> TokenLogprobs:
        logprob, ids, values = entry
        return cls(float(logprob), tuple((int(token), float(value)) for token, value in zip(ids, values, strict=True)))


@attrs.frozen
class PromptLogprobs:
    """A prompt's log-probabilities, given to a request's `on_logprobs` before its first token: None for the first
    prompt token, then a `TokenLogprobs` each (`entries` None: a recovery lost some)."""

    entries: tuple[TokenLogprobs | None, ...] | None


@attrs.frozen
class Scores:
    """A step report's log-probabilities on the wire, of the rows that ask: of each picked token (`logprobs`) and of
    the prompt's tokens (`prompt_logprobs`), keyed by row (in a slot, by member) as a string."""

    logprobs: dict[str, Any] = attrs.field(factory=dict)
    prompt_logprobs: dict[str, Any] = attrs.field(factory=dict)


def scored(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprobs]:
    """Each position's entry: logits `[N, vocab]`, the token `[N]` taken at each position, the count of top tokens."""
    values = torch.log_softmax(logits.float(), dim=-1)
    chosen = values.gather(-1, tokens.long()[:, None])[:, 0].tolist()
    if top:
        best, ids = values.topk(top, dim=-1)
        tops = [tuple(zip(row_ids, row_best, strict=True)) for row_ids, row_best in zip(ids.tolist(), best.tolist(),
                                                                                          strict=True)]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprobs(value, pairs) for value, pairs in zip(chosen, tops, strict=True)]


def step_entries(logits: torch.Tensor, tokens: torch.Tensor, asks: Sequence[int | None],
                 live: Sequence[bool]) -> dict[int, list[Any]]:
    """A step's entries (wire form) of the rows that ask for them (`asks[row]`: their top count) and are `live`
    (they got a token at this step), by row."""
    rows = [row for row, (ask, alive) in enumerate(zip(asks, live, strict=True)) if ask is not None and alive]
    if not rows:
        return {}
    entries = scored(logits[rows], tokens[rows], max(int(asks[row] or 0) for row in rows))
    return {row: _cut(entry, int(asks[row] or 0)).wire() for row, entry in zip(rows, entries, strict=True)}


def prompt_scores(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, start: int, width: int,
                  prompts: Mapping[int, tuple[Sequence[int], int]]) -> dict[int, list[Any]]:
    """The prompt entries (wire form `[index, [entries]]`) that columns [start, start + T) of prompts left-padded
    to `width` give: `hidden` `[B, T, H]` their final hidden states, `head` the last stage's head over every
    position, `prompts` the rows that ask (row: its prompt's ids and top count). Position p gives the entry of
    prompt token p + 1; rows with none in these columns are left out. The logits are made `SCORED_COLUMNS`
    positions at a time."""
    stop = start + hidden.shape[1]
    out: dict[int, list[Any]] = {}
    for row, (ids, top) in prompts.items():
        first = width - len(ids)  # the column of the prompt's first token
        low, high = max(start, first), min(stop, width - 1)  # the columns whose next token is a prompt token
        if low >= high:
            continue
        entries: list[list[Any]] = []
        for column in range(low, high, SCORED_COLUMNS):
            end = min(column + SCORED_COLUMNS, high)
            logits = head(hidden[row:row + 1, column - start:end - start])[0]
            following = torch.as_tensor(list(ids[column + 1 - first:end + 1 - first]), dtype=torch.long,
                                        device=logits.device)
            entries += [entry.wire() for entry in scored(logits, following, top)]
        out[row] = [low + 1 - first, entries]
    return out


def _cut(entry: TokenLogprobs, top: int) -> TokenLogprobs:
    return entry if len(entry.top) == top else TokenLogprobs(entry.logprob, entry.top[:top])


def check_count(name: str, value: Any) -> int | None:
    """A request's `logprobs`-like count: None (none asked), or an integer 0 to `MAX_LOGPROBS`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise ConfigError(f"{name} must be an integer from 0 to {MAX_LOGPROBS}, got {quoted(value)}")
    return value
