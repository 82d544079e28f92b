"""Requests and microbatches, as the paper's baseline schedules them, each row with a life of its own.

Requests wait in arrival order; a microbatch takes up to `size` of them, taking turns between the submissions
they came in (`turns`: one large submission does not hold back a later one), left-pads their prompts to the longest,
and runs until every row has ended. Each row has its own decoding and its own end: its end-of-sequence token,
its own `max_new_tokens`, a failure of its own or a cancellation; its request is answered at that step. A row
that ended keeps producing padding until the microbatch ends, as in `model.generate`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from typing import Any

import attrs
import torch

from ..errors import ConfigError, quoted
from ..swapping import positions_needed
from .decoding import Decoding
from .logprobs import PromptLogprobs, Scores, TokenLogprobs
from .slots import Round


class _Numbers:
    """Request numbers: unique within the process, and past those of a predecessor head a successor goes on with."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def __call__(self) -> int:
        return next(self._next)

    def skip_to(self, first: int) -> None:
        self._next = itertools.count(max(next(self._next), first))


_ids = _Numbers()


def new_request_number() -> int:
    """A request number no other request of this process has."""
    return _ids()


def number_requests_from(first: int) -> None:
    """Number new requests from `first` on, at least: a successor head goes on with its predecessor's requests
    under their former numbers, which no new one may take."""
    _ids.skip_to(first)


@attrs.define(eq=False)
class Request:
    """One prompt `[T]` (token ids) to continue by up to `max_new_tokens` tokens; `future` gets its `Result`."""

    ids: torch.Tensor
    max_new_tokens: int
    decoding: Decoding = attrs.field(factory=Decoding)
    future: Future[Result] = attrs.field(factory=Future)
    number: int = attrs.field(factory=_ids)
    submitted: float = attrs.field(factory=time.monotonic)
    #: Called with each of the request's new token ids as it arrives (on the head's receiver thread).
    on_token: Callable[[int], None] | None = None
    #: With `decoding.prompt_logprobs`: called with the prompt's (`PromptLogprobs`) before its first token; with
    #: `decoding.logprobs`: with each new token's (`TokenLogprobs`), just before `on_token` gets it (if set).
    on_logprobs: Callable[[TokenLogprobs | PromptLogprobs], None] | None = None
    streamed: int = 0  # tokens given to `on_token` so far
    #: When it first left the waiting queue for a microbatch or slot (`time.monotonic()`; None: not yet).
    started: float | None = None
    #: The submission it came in (requests submitted together share it): admission takes turns between them.
    group: int = attrs.field(default=attrs.Factory(lambda self: self.number, takes_self=True))
    #: What its submitter calls it (the controller: its request id and choice), for records that outlive the head.
    tag: Any = None
    #: Its tenant's salt for the prompt prefixes it reads and keeps (`dejavu_sdk.prefix`).
    cache_salt: str = ""
    #: The prompt positions it read from the prompt prefixes (set as the round that read them is reported).
    cached: int = 0
    #: What it had when a slot it ran in was lost (it goes on from its prompt followed by those tokens).
    earlier: Earlier | None = None
    #: The tokens it had when the last slot it ran in was lost (None: none was): lost again with no more, it is
    #: taken for what kills the stages (the poison bound).
    lost_with: int | None = None

    def going_on(self, tokens: Sequence[int], stamps: Sequence[float], schedule: Sequence[Round],
                 scores: dict[str, Any]) -> Request:
        """This request as it goes on in another slot after the one it ran in was lost before its end, with
        `tokens` of its own (arrived at `stamps`) from that slot's rounds `schedule` and their log-probabilities
        (`scores`: `Microbatch.scores_of`): its prompt is its own followed by every token it has, its limit what is
        left, its generator where it stood; its future, callbacks and number stay, so its answer and stream go on
        where they were."""
        before = self.earlier or Earlier(self.ids, self.max_new_tokens)
        logprobs = scores.get("logprobs")
        earlier = Earlier(before.prompt, before.max_new_tokens, (*before.tokens, *tokens), (*before.stamps, *stamps),
                          (*before.schedule, *schedule, Round(lost=True)),
                          None if before.logprobs is None or logprobs is None else (*before.logprobs, *logprobs),
                          before.prompt_logprobs if self.earlier else scores.get("prompt_logprobs"))
        return attrs.evolve(self, ids=torch.cat([before.prompt, torch.tensor(earlier.tokens, dtype=torch.long)]),
                            max_new_tokens=self.max_new_tokens - len(tokens),
                            decoding=self.decoding.going_on(len(tokens)), streamed=0, earlier=earlier)


@attrs.frozen
class Earlier:
    """What a request going on in another slot (`Request.going_on`) had from the slots it ran in before: its own
    prompt and limit, its tokens and when each reached the head, those slots' rounds (each closed by a
    `Round(lost=True)`), and its tokens' and prompt's log-probabilities where asked."""

    prompt: torch.Tensor
    max_new_tokens: int
    tokens: tuple[int, ...] = ()
    stamps: tuple[float, ...] = ()
    schedule: tuple[Round, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] | None = ()
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    def before(self, result: Result) -> Result:
        """`result` (of the slot it went on in) with what came before it in front."""
        tokens = torch.cat([torch.tensor(self.tokens, dtype=torch.long), result.tokens])
        logprobs = None if self.logprobs is None or result.logprobs is None else (*self.logprobs, *result.logprobs)
        return attrs.evolve(result, tokens=tokens, first_token=self.stamps[0] if self.stamps else result.first_token,
                            finished=result.finished if result.tokens.numel() else self.stamps[-1],
                            schedule=(*self.schedule, *result.schedule), logprobs=logprobs,
                            prompt_logprobs=self.prompt_logprobs)


@attrs.frozen
class Result:
    """A request's new token ids (prompt excluded, up to and including its end-of-sequence token) and where
    it was served: microbatch `microbatch`, row `row` of `rows`, its prompt left-padded by `padding`
    positions to the microbatch's longest; sampled from a generator seeded with `seed` (None: greedy).
    `logprobs` (a token each) and `prompt_logprobs` (None for the first prompt token, then one each) when its
    decoding asked for them (`generation.logprobs`); None if a recovery lost some.

    `submitted`, `first_token` and `finished` are `time.monotonic()` readings at the head: when the request
    was queued, when its first token and its last token arrived (time to first token, time per output token).

    Under continuous batching `microbatch` is the slot it was served in, `row` the order it entered the slot
    in, of `rows` requests that entered it so far (its rows in the cache move as others leave), `padding` 0
    (it changes with every join), `request` its request's number there, and `schedule` the slot's rounds
    (`slots.Round`) up to its end: `replay.replay` gives its tokens from them. Static microbatches have no
    schedule: they are `model.generate` on the microbatch. `cached_positions`: its prompt's leading positions
    read from a prefix cache instead of computed (0: none).
    """

    tokens: torch.Tensor
    microbatch: int
    row: int
    rows: int
    padding: int
    seed: int | None = None
    submitted: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    request: int = -1
    schedule: tuple[Round, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    cached_positions: int = 0


def left_pad(prompts: Sequence[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts `[T_i]` as one batch `[rows, longest]` left-padded with `pad`, and its attention mask (0 at
    padding), as `generate` takes a batch of unequal prompts."""
    longest = max(prompt.numel() for prompt in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - prompt.numel():] = prompt
        mask[row, longest - prompt.numel():] = 1
    return ids, mask


def check_prompt(ids: Any, context: int | None, vocabulary: int | None = None) -> torch.Tensor:
    """A prompt as a 1-D int64 tensor of at least one token id of the vocabulary, fitting the model's context;
    ConfigError otherwise (a bad id would otherwise fail the first stage, and every request with it)."""
    if not isinstance(ids, torch.Tensor):
        try:
            ids = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError):
            raise ConfigError(f"a prompt is a sequence of token ids, got {type(ids).__name__}") from None
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ConfigError(f"a prompt is a non-empty 1-D tensor of token ids, got {ids.dtype} {tuple(ids.shape)}")
    if context is not None and ids.numel() > context:
        raise ConfigError(f"a prompt of {ids.numel()} tokens is longer than the model's context of {context}")
    if vocabulary is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocabulary):
        raise ConfigError(f"a prompt holds token ids from {int(ids.min())} to {int(ids.max())}; the model's "
                          f"vocabulary has ids 0 to {vocabulary - 1}")
    return ids.long()


def check_new_tokens(max_new_tokens: Any, prompt: int, context: int | None) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be a positive integer, got {quoted(max_new_tokens)}")
    if context is not None and prompt + max_new_tokens > context:
        raise ConfigError(f"a prompt of {prompt} tokens and {quoted(max_new_tokens)} new tokens exceed the model's "
                          f"context of {context}")
    return max_new_tokens


@attrs.define(eq=False)
class Microbatch:
    """Requests decoded together: `ids` and `mask` `[rows, longest prompt]`, left-padded with `pad`."""

    number: int
    requests: list[Request]
    ids: torch.Tensor
    mask: torch.Tensor
    pad: int
    generated: list[list[int]] = attrs.field(factory=list)
    #: Rows whose request is answered: with its tokens (its end came), an error of its own, or cancelled.
    settled: set[int] = attrs.field(factory=set)
    #: Rows the last stage must end before their own end: failed or cancelled.
    dropped: set[int] = attrs.field(factory=set)
    #: Steps that reached the head, rewinds included: a recovery tells from it whether the microbatch progressed.
    steps_received: int = 0
    #: `steps_received` when the last recovery found it in flight (None: no recovery did).
    seen_by_recovery: int | None = None
    #: The log-probabilities of rows that ask for them: by (row, token index), and of their prompts' tokens by
    #: (row, prompt index).
    logprobs: dict[tuple[int, int], TokenLogprobs] = attrs.field(factory=dict)
    prompt_logprobs: dict[tuple[int, int], TokenLogprobs] = attrs.field(factory=dict)
    #: Rows whose prompt log-probabilities another row of the same prompt asks for (`shared_prompts`): row -> it.
    prompt_sources: dict[int, int] = attrs.field(factory=dict)

    def add_scores(self, scores: Scores | None, row_of: Callable[[str], int]) -> None:
        """A step report's log-probabilities, keyed as `row_of` maps them to rows, after its tokens."""
        if scores is None:
            return
        for key, entry in scores.logprobs.items():
            row = row_of(key)
            self.logprobs[row, len(self.generated[row]) - 1] = TokenLogprobs.of_wire(entry)
        for key, (first, entries) in scores.prompt_logprobs.items():
            row = row_of(key)
            for index, entry in enumerate(entries, start=int(first)):
                self.prompt_logprobs[row, index] = TokenLogprobs.of_wire(entry)

    def prompt_entries(self, row: int) -> tuple[TokenLogprobs | None, ...] | None:
        """Row `row`'s prompt log-probabilities (None for its first token; those its source row got, where another
        row of its prompt asked for them), or None if some are missing."""
        length = self.requests[row].ids.numel()
        for scored in (self.prompt_sources.get(row, row), row):
            if all((scored, index) in self.prompt_logprobs for index in range(1, length)):
                return (None, *(self.prompt_logprobs[scored, index] for index in range(1, length)))
        return None

    def unstreamed(self, eos: Sequence[int]) -> list[tuple[Callable[[Any], None], Any]]:
        """Each request's tokens not yet given to its `on_token` (up to its end at any of the `eos` ids or its
        `max_new_tokens`), with the callback to give them to (each after its log-probabilities to `on_logprobs`,
        where asked); they count as given from now on."""
        calls: list[tuple[Callable[[Any], None], Any]] = []
        for index, (request, row) in enumerate(zip(self.requests, self.generated, strict=True)):
            if (request.on_token is None and request.on_logprobs is None) or index in self.dropped:
                continue
            kept = kept_tokens(row, request.max_new_tokens, request.decoding.ends.ids(eos))
            scores = request.on_logprobs
            if scores is not None and request.streamed == 0 and kept and request.decoding.prompt_logprobs is not None:
                calls.append((scores, PromptLogprobs(self.prompt_entries(index))))
            for position in range(request.streamed, len(kept)):
                entry = self.logprobs.get((index, position))
                if scores is not None and entry is not None:
                    calls.append((scores, entry))
                if request.on_token is not None:
                    calls.append((request.on_token, kept[position]))
            request.streamed = max(request.streamed, len(kept))  # after a rewind, the same tokens come again
        return calls

    def row_ended(self, row: int, eos: Sequence[int]) -> bool:
        """Whether row `row` has all its tokens: its end-of-sequence token (any of `eos`) or its own
        `max_new_tokens`."""
        limit, ends = self.requests[row].max_new_tokens, self.requests[row].decoding.ends.ids(eos)
        kept = kept_tokens(self.generated[row], limit, ends)
        return len(kept) == limit or bool(kept and kept[-1] in ends)

    def ended_rows(self, eos: Sequence[int]) -> list[int]:
        """The rows not answered yet whose tokens have come to their end."""
        return [row for row in range(len(self.requests)) if row not in self.settled and self.row_ended(row, eos)]

    def scores_of(self, row: int, kept: int) -> dict[str, Any]:
        """A row's log-probabilities for its `Result`, where asked: those of its `kept` tokens and of its prompt
        (None if some are missing)."""
        decoding, out = self.requests[row].decoding, dict[str, Any]()
        if decoding.logprobs is not None:
            entries = [self.logprobs.get((row, index)) for index in range(kept)]
            out["logprobs"] = None if None in entries else tuple(entries)
        if decoding.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_entries(row)
        return out


def cache_bytes(requests: Sequence[Request], bytes_per_position: int) -> int:
    """Bytes a microbatch of `requests` takes in a KV cache of `bytes_per_position` per row and position at
    its end: rows x (longest prompt + largest `max_new_tokens` - 1)."""
    longest = max(request.ids.numel() for request in requests)
    new = max(request.max_new_tokens for request in requests)
    return len(requests) * positions_needed(longest, new) * bytes_per_position


def row_fields(request: Request, scores_prompt: bool = True) -> dict[str, Any]:
    """What the last stage needs of a request's row: its decoding, and its prompt where it asks for the prompt's
    log-probabilities (the last stage sees hidden states, not ids) and no other row of its prompt asks for them
    (`scores_prompt`)."""
    fields = request.decoding.fields()
    if request.decoding.prompt_logprobs is not None and scores_prompt:
        fields["prompt"] = request.ids.tolist()
    return fields


def kept_tokens(tokens: list[int], max_new_tokens: int, ends: Collection[int]) -> list[int]:
    """A row's tokens up to its own end: its first end id (kept; `ends`: its request's), or `max_new_tokens`."""
    kept = tokens[:max_new_tokens]
    end = next((index for index, token in enumerate(kept) if token in ends), None)
    return kept if end is None else kept[:end + 1]


def check_max_prefill_tokens(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"max_prefill_tokens must be a positive integer or None, got {value!r}")
    return value


#: How microbatches are formed: drained before new requests come in, or refilled between steps.
BATCHING = ("continuous", "static")


def check_batching(batching: Any) -> str:
    if batching not in BATCHING:
        raise ConfigError(f"batching must be one of {', '.join(map(repr, BATCHING))}, got {batching!r}")
    return str(batching)
