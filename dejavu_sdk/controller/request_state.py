"""Where a request being served stands (`RequestState`), what each of its choices has so far (`ChoiceState`: its
tokens, its text as `TextStream` makes it, where it ends), and the updates its clients are sent (`Update`).

The lifecycle (runs.py) moves a request through its states; the transcript (transcripts.py) and the OpenAI shapes
(openai_responses.py) read them. Nothing here speaks HTTP.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Sequence
from typing import Any

import attrs

from ..generation.decoding import ENDS, Ends
from ..generation.logprobs import PromptLogprobs, TokenLogprobs
from .detokenizer import TextStream
from .openai_requests import Choice


class RequestState(enum.Enum):
    """A request's state: running (its choices wait or compute, or it was adopted and goes on), then how it ended,
    decided once. An ended state's value is its outcome as the metrics label it and the journal records it
    (`answered`); a request that ended well is `FINISHED` ("ok")."""

    RUNNING = "running"
    FINISHED = "ok"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    #: A request taken over from a journal that the pipeline refused when it was queued again.
    REFUSED = "refused"

    @property
    def ended(self) -> bool:
        return self is not RequestState.RUNNING


@attrs.frozen
class Update:
    """New text and tokens of choice `index` (with their log-probabilities, in the API's shape, where asked);
    `finish` set on its last. `position`: the choice's tokens through this update, and its end as one more."""

    index: int
    text: str
    tokens: list[int]
    finish: str | None
    logprobs: dict[str, Any] | None = None
    position: int = 0

    def past(self, delivered: int) -> Update:
        """What of this update a client that has `delivered` positions of its choice has not had: all of it, or
        (a position inside it, which a client can only name after an update of another controller) the tokens
        and end past it, without text."""
        first = self.position - len(self.tokens) - (self.finish is not None)
        if delivered <= first:
            return self
        return attrs.evolve(self, text="", tokens=self.tokens[delivered - first:], logprobs=None)


@attrs.define
class ChoiceState:
    """What one choice has so far: its tokens, its text, and its finish reason once it ended ("stop": an end id or
    a stop string; "length": its `limit` of tokens). `ends`: the ids it ends at; `silent`: its stop token ids,
    whose own text is left out."""

    stream: TextStream | None
    ends: frozenset[int]
    silent: frozenset[int]
    limit: int
    tokens: list[int] = attrs.field(factory=list)
    text: str = ""
    finish: str | None = None
    #: Where asked: each token's log-probabilities (None: lost), those that arrived before their token (on the
    #: receiver thread), the prompt's (echo), and the characters of the token texts listed so far (the next
    #: one's text offset, streamed).
    logprobs: list[TokenLogprobs | None] = attrs.field(factory=list)
    arriving: collections.deque[TokenLogprobs] = attrs.field(factory=collections.deque)
    prompt: PromptLogprobs | None = None
    listed: int = 0

    @classmethod
    def of(cls, choice: Choice, tokenizer: Any | None, stop: Sequence[str], eos: list[int]) -> ChoiceState:
        """A choice not started: it ends at the model's end-of-sequence ids `eos` (unless it ignores them) and its
        own, at its `max_tokens`, or at the first of `stop` in its text (with a tokenizer)."""
        decoding = choice.decoding
        ends = Ends.of(**{name: decoding[name] for name in ENDS if name in decoding}).ids(eos)
        return cls(None if tokenizer is None else TextStream(tokenizer, stop), frozenset(ends),
                   frozenset(decoding.get("stop_token_ids", ())), choice.max_tokens)

    @property
    def stopped(self) -> bool:
        """Whether it ended at a stop string (nothing more need be computed for it)."""
        return self.stream is not None and self.stream.stopped is not None

    def advance(self, tokens: list[int], entries: list[TokenLogprobs | None]
                ) -> tuple[str, list[int], list[TokenLogprobs | None]]:
        """Take the new tokens up to the choice's end: the text that can go out now, the tokens taken and their
        log-probabilities (`finish` says whether it ended)."""
        text, taken, scores = "", [], []
        for token, entry in zip(tokens, entries, strict=True):
            taken.append(token)
            self.tokens.append(token)
            scores.append(entry)
            if self.stream is not None and token not in self.silent:
                text += self.stream.add([token])
                if self.stream.stopped is not None:
                    self.finish = "stop"
                    break
            if token in self.ends:
                self.finish = "stop"
                break
            if len(self.tokens) >= self.limit:
                self.finish = "length"
                break
        if self.finish is not None and self.stream is not None:
            text += self.stream.finish()
        self.text += text
        self.logprobs += scores
        return text, taken, scores

    def close(self, finish: str | None = None) -> str:
        """End a choice its tokens did not end (the pipeline ended it: done, cancelled); `finish` where known, else
        by its last token. The rest of its text."""
        self.finish = finish or ("stop" if self.tokens and self.tokens[-1] in self.ends else "length")
        text = "" if self.stream is None else self.stream.finish()
        self.text += text
        return text
