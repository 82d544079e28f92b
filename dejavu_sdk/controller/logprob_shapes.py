"""Log-probabilities in the shapes of OpenAI's two APIs: the completions' `{tokens, token_logprobs, top_logprobs,
text_offset}` (the chosen token listed among the top ones, as OpenAI lists it) and the chat's
`{content: [{token, logprob, bytes, top_logprobs}]}`. A token's text is its own decoding; a model served without a
tokenizer names tokens `token_id:<id>` (as vLLM does). JSON has no infinity: -inf is written as `FLOOR`. An entry
a recovery lost is a null log-probability with no top tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..generation.logprobs import FLOOR, TokenLogprobs


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


def _chat_token(tokenizer: Any | None, token: int, logprob: float | None) -> dict[str, Any]:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": None if logprob is None else _finite(logprob),
            "bytes": list(text.encode("utf-8", "surrogatepass"))}


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR
