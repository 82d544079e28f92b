"""A choice's text as its tokens arrive: pieces to stream whose concatenation is, byte for byte, the text of the
whole answer, cut before the first stop string.

The text of an answer is `tokenizer.decode(tokens, skip_special_tokens=True)` with the tokenizer's own clean-up
of spaces. Decoding every token's whole output again costs a decode of the whole text per token; instead the
raw text (no clean-up) grows by the difference between the decodes of a short window of the last tokens with
and without the new ones, as vLLM's incremental detokenizer does: a window that starts a token early keeps a
SentencePiece word's leading space, and a window whose text ends in U+FFFD waits for the bytes that complete
its character. Clean-up then runs over the raw text (plain string replacements, cheap beside a decode).

What is sent must stay a prefix of the final text whatever comes next, so three things are held back: a
character not yet complete, the end of the text where a stop string may be starting (its longest length less
one character), and for a tokenizer that cleans up spaces the last three characters, which a clean-up pattern
(" 's", " n't", ...) completed by the next token could still rewrite. `finish` sends the rest of the exact text.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

#: Characters at the end of the text that a clean-up of spaces may still change: its patterns (" n't" the
#: longest) start with a space and span at most four characters, so one completed by what comes next starts
#: within the last three.
CLEANUP_REACH = 3


class TextStream:
    """The text of one choice's tokens, streamed in pieces (`add` each step's tokens, `finish` at the end), cut
    before the first of `stop` (then `stopped` names it and nothing more is taken)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [text for text in stop if text]
        self.tokens: list[int] = []
        self.raw = ""  # the text of tokens[:read], before clean-up
        self.prefix = self.read = 0  # the decoding window: tokens[prefix:read] gave the end of `raw`
        self.sent = ""  # what went out so far, always a prefix of the final text
        self.stopped: str | None = None
        self.cleans_up = cleans_up_spaces(tokenizer)
        self.hold = max((len(text) for text in self.stop), default=1) - 1

    def add(self, tokens: Sequence[int]) -> str:
        """Take the next tokens (none once stopped); the text that can go out now (maybe empty)."""
        if self.stopped is not None:
            return ""
        self.tokens += tokens
        before = self._decode(self.tokens[self.prefix:self.read])
        after = self._decode(self.tokens[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.raw += after[len(before):]
            self.prefix, self.read = self.read, len(self.tokens)
        text = self._clean(self.raw)
        stop = self._first_stop(text)
        if stop is not None:
            self.stopped = stop[1]
            return self._send(text[:stop[0]])
        hold = max(self.hold, CLEANUP_REACH) if self.cleans_up else self.hold
        return self._send(text[:max(len(text) - hold, 0)])

    def finish(self) -> str:
        """The rest of the text: the final text is the exact decode of the tokens taken, cut before a stop
        string; what was sent is its prefix."""
        return self._send(self.text(), final=True)

    def text(self) -> str:
        """The whole answer's text: the decode of the tokens taken (with clean-up), cut before a stop string."""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        stop = self._first_stop(text) if self.stopped is not None else None
        return text if stop is None else text[:stop[0]]

    def _send(self, text: str, final: bool = False) -> str:
        if not text.startswith(self.sent):  # a held-back rule missed a rewrite: keep the final text exact
            if final:
                log.warning("streamed text %r is not a prefix of the final text %r", self.sent, text)
            return ""
        piece = text[len(self.sent):]
        self.sent = text
        return piece

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """Where the first stop string in `text` starts, and which it is (None: there is none)."""
        found = [(position, stop) for stop in self.stop if (position := text.find(stop)) >= 0]
        return min(found) if found else None

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _clean(self, raw: str) -> str:
        return self.tokenizer.clean_up_tokenization(raw) if self.cleans_up else raw


def cleans_up_spaces(tokenizer: Any) -> bool:
    """Whether `tokenizer.decode` cleans up spaces (" ." to "."): asked of the tokenizer by decoding a probe with
    and without it, since whether it does depends on its settings and its kind (transformers skips it for BPE
    unless forced)."""
    probe = tokenizer.encode("a . b 's", add_special_tokens=False)
    return bool(tokenizer.decode(probe) != tokenizer.decode(probe, clean_up_tokenization_spaces=False))
