"""Responses in the shapes of OpenAI's two APIs, chosen by a request's kind (`shape_of`): `CompletionShape`
(`/v1/completions`: `text_completion` bodies and chunks, each choice with its `text` and `token_ids`) and
`ChatShape` (`/v1/chat/completions`: a `message` per choice, streamed as `delta`s after an opening one that gives
the assistant's role, in `chat.completion.chunk`s). Both share the usage, and `GET /v1/requests/<id>`'s body
(`snapshot`) is read from a transcript alike.

Log-probabilities come in each API's shape: the completions' `{tokens, token_logprobs, top_logprobs,
text_offset}` (the chosen token listed among the top ones, as OpenAI lists it) and the chat's
`{content: [{token, logprob, bytes, top_logprobs}]}`. A token's text is its own decoding; a model served without a
tokenizer names tokens `token_id:<id>` (as vLLM does). JSON has no infinity: -inf is written as `FLOOR`. An entry
a recovery lost is a null log-probability with no top tokens.
"""

from __future__ import annotations

import abc
import math
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar

from ..generation.logprobs import FLOOR, TokenLogprobs
from .api_errors import ApiError
from .request_state import ChoiceState, Update
from .transcripts import Transcript


class ResponseShape(abc.ABC):
    """What one of OpenAI's APIs answers: its ids, objects, chunks and whole bodies; the argument that carries a
    request's prompt (`prompt_argument`, which an error names)."""

    id_prefix: ClassVar[str]
    body_object: ClassVar[str]
    chunk_object: ClassVar[str]
    prompt_argument: ClassVar[str]

    def new_id(self) -> str:
        return f"{self.id_prefix}-{uuid.uuid4().hex}"

    def head(self, transcript: Transcript, chunk: bool = False) -> dict[str, Any]:
        return {"id": transcript.id, "object": self.chunk_object if chunk else self.body_object,
                "created": transcript.created, "model": transcript.model}

    def answer(self, transcript: Transcript, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole answer, its `choices` shaped by `whole_choice`."""
        return {**self.head(transcript), "choices": choices, "usage": usage(transcript)}

    def chunk(self, transcript: Transcript, choices: list[dict[str, Any]],
              usage: dict[str, int] | None = None) -> dict[str, Any]:
        """A streamed chunk of `choices` (shaped by `chunk_choice`); with the usage where the stream ends with it
        (null until then, unless every chunk carries it)."""
        extra = {"usage": usage} if transcript.include_usage else {}
        return {**self.head(transcript, chunk=True), "choices": choices, **extra}

    def openings(self, choices: int) -> list[dict[str, Any]]:
        """The chunk choices a stream opens with, each sent alone (before any update)."""
        return []

    @abc.abstractmethod
    def chunk_choice(self, update: Update) -> dict[str, Any]:
        """An update of one choice, as a chunk lists it."""

    @abc.abstractmethod
    def chunk_logprobs(self, tokenizer: Any | None, state: ChoiceState, tokens: list[int],
                       entries: list[TokenLogprobs | None]) -> dict[str, Any]:
        """A chunk's log-probabilities of a choice's new `tokens`, going on from its earlier chunks."""

    @abc.abstractmethod
    def whole_choice(self, index: int, state: ChoiceState, tokenizer: Any | None, logprobs: bool,
                     echo: list[int] | None) -> dict[str, Any]:
        """Choice `index` as the whole answer lists it (its log-probabilities where asked; `echo`: the prompt, where
        its answer repeats it)."""


class CompletionShape(ResponseShape):
    id_prefix, body_object, chunk_object, prompt_argument = "cmpl", "text_completion", "text_completion", "prompt"

    def chunk_choice(self, update: Update) -> dict[str, Any]:
        return {"index": update.index, "text": update.text, "logprobs": update.logprobs,
                "finish_reason": update.finish, "token_ids": update.tokens}

    def chunk_logprobs(self, tokenizer: Any | None, state: ChoiceState, tokens: list[int],
                       entries: list[TokenLogprobs | None]) -> dict[str, Any]:
        shaped = completion_logprobs(tokenizer, tokens, entries, state.listed)
        state.listed += sum(len(text) for text in shaped["tokens"])
        return shaped

    def whole_choice(self, index: int, state: ChoiceState, tokenizer: Any | None, logprobs: bool,
                     echo: list[int] | None) -> dict[str, Any]:
        text, tokens, entries = state.text, state.tokens, state.logprobs
        if echo is not None:
            text = ("" if tokenizer is None else tokenizer.decode(echo, skip_special_tokens=True)) + text
            tokens = [*echo, *tokens]
            if logprobs:
                entries = [*_prompt_entries(state, len(echo)), *entries]
        return {"index": index, "text": text, "finish_reason": state.finish, "token_ids": state.tokens,
                "logprobs": completion_logprobs(tokenizer, tokens, entries) if logprobs else None}


class ChatShape(ResponseShape):
    id_prefix, body_object, chunk_object, prompt_argument = ("chatcmpl", "chat.completion", "chat.completion.chunk",
                                                             "messages")

    def openings(self, choices: int) -> list[dict[str, Any]]:
        """The assistant's turn opens every choice, as OpenAI's does."""
        return [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for index in range(choices)]

    def chunk_choice(self, update: Update) -> dict[str, Any]:
        delta = {"content": update.text} if update.text or update.finish is None else {}
        return {"index": update.index, "delta": delta, "finish_reason": update.finish, "logprobs": update.logprobs}

    def chunk_logprobs(self, tokenizer: Any | None, state: ChoiceState, tokens: list[int],
                       entries: list[TokenLogprobs | None]) -> dict[str, Any]:
        return chat_logprobs(tokenizer, tokens, entries)

    def whole_choice(self, index: int, state: ChoiceState, tokenizer: Any | None, logprobs: bool,
                     echo: list[int] | None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": state.text},
                "logprobs": chat_logprobs(tokenizer, state.tokens, state.logprobs) if logprobs else None,
                "finish_reason": state.finish}


#: The shape of each API, by the kind of request it takes (`GenerationRequest.kind`).
SHAPES: dict[str, ResponseShape] = {"completion": CompletionShape(), "chat": ChatShape()}


def shape_of(kind: str) -> ResponseShape:
    return SHAPES[kind]


def usage(transcript: Transcript, generated: int | None = None) -> dict[str, Any]:
    """The request's usage: its prompt tokens (with those read from the prompt prefixes, as OpenAI reports its
    cached ones), and the tokens it `generated` (default: all sent so far)."""
    generated = transcript.generated_tokens() if generated is None else generated
    return {"prompt_tokens": transcript.prompt_tokens, "completion_tokens": generated,
            "total_tokens": transcript.prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": transcript.cached_tokens}}


def error_event(error: ApiError) -> dict[str, Any]:
    """A request's failure as its stream's last event and its snapshot tell it."""
    return {"error": {"message": error.message, "type": error.kind, "code": error.code}}


def snapshot(transcript: Transcript) -> dict[str, Any]:
    """The request as `GET /v1/requests/<id>` answers it: its status (running, or how it ended), each choice's
    text, tokens and finish reason so far, the usage, and its error where it failed."""
    texts: list[str] = ["" for _ in range(transcript.choices)]
    tokens: list[list[int]] = [[] for _ in range(transcript.choices)]
    finish: list[str | None] = [None for _ in range(transcript.choices)]
    for update in transcript.log:
        texts[update.index] += update.text
        tokens[update.index] += update.tokens
        finish[update.index] = update.finish or finish[update.index]
    answer = {**shape_of(transcript.kind).head(transcript), "object": "request", "status": transcript.status(),
              "choices": [{"index": index, "text": texts[index], "token_ids": tokens[index],
                           "finish_reason": finish[index]} for index in range(transcript.choices)],
              "usage": usage(transcript)}
    if transcript.error is not None:
        answer.update(error_event(transcript.error))
    return answer


# ---- log-probabilities ---------------------------------------------------------------------------------------
def token_text(tokenizer: Any | None, token: int) -> str:
    if tokenizer is None:
        return f"token_id:{token}"
    return str(tokenizer.decode([token]))


def completion_logprobs(tokenizer: Any | None, tokens: Sequence[int], entries: Sequence[TokenLogprobs | None],
                        offset: int = 0) -> dict[str, Any]:
    """The completions' `logprobs` of `tokens` (an entry each; None: the first prompt token, which has none),
    their text offsets counted from `offset`."""
    texts = [token_text(tokenizer, token) for token in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    tops: list[dict[str, float] | None] = []
    for text, entry in zip(texts, entries, strict=True):
        if entry is None:
            tops.append(None)
            continue
        top = {token_text(tokenizer, other): _finite(value) for other, value in entry.top}
        top.setdefault(text, _finite(entry.logprob))
        tops.append(top)
    return {"tokens": texts, "token_logprobs": [None if entry is None else _finite(entry.logprob) for entry in entries],
            "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Any | None, tokens: Sequence[int],
                  entries: Sequence[TokenLogprobs | None]) -> dict[str, Any]:
    """The chat's `logprobs` of `tokens` (an entry each)."""
    return {"content": [{**_chat_token(tokenizer, token, None if entry is None else entry.logprob),
                         "top_logprobs": [] if entry is None else [_chat_token(tokenizer, other, value)
                                                                   for other, value in entry.top]}
                        for token, entry in zip(tokens, entries, strict=True)]}


def _prompt_entries(state: ChoiceState, length: int) -> list[TokenLogprobs | None]:
    """A choice's prompt's log-probabilities (`length` tokens, the first None); 503 where a recovery lost them."""
    found = state.prompt
    if found is None or found.entries is None or len(found.entries) != length:
        raise ApiError(503, "the prompt's log-probabilities were lost in a recovery: send the request again",
                       "server_error", "prompt_logprobs_lost", 1.0)
    return list(found.entries)


def _chat_token(tokenizer: Any | None, token: int, logprob: float | None) -> dict[str, Any]:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": None if logprob is None else _finite(logprob),
            "bytes": list(text.encode("utf-8", "surrogatepass"))}


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR
