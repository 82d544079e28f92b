"""Streamed text: the pieces a choice streams add up, byte for byte, to the decode of all its tokens (with a
tokenizer that cleans up spaces too, and characters split across tokens), cut before the first stop string."""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dejavu_sdk.controller.detokenizer import CLEANUP_REACH, TextStream, cleans_up_spaces

TEXTS = ["I do n't know , it 's fine . Is it ? Yes !", "Ünïcödé: 日本語のテキスト 🙂🚀 and more",
         "Spaces   and\ttabs\nnew lines ' quoted ' , done .", "x" * 50 + " end", "We 're here , we 've been ."]


@pytest.fixture(scope="module")
def plain(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def cleaning(plain):
    """SmolLM2's tokenizer made to clean up spaces (" ." to "."), as WordPiece tokenizers do."""
    tokenizer = copy.deepcopy(plain)
    tokenizer.clean_up_tokenization_spaces = True
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    return tokenizer


def _stream(tokenizer, tokens: list[int], stop: tuple[str, ...] = (), seed: int = 0) -> tuple[list[str], TextStream]:
    """Feed `tokens` in random-sized steps; the pieces sent, the last one `finish`'s."""
    pick = random.Random(seed)
    stream = TextStream(tokenizer, stop)
    pieces, at = [], 0
    while at < len(tokens):
        step = pick.choice([1, 1, 1, 2, 3])
        pieces.append(stream.add(tokens[at:at + step]))
        at += step
    pieces.append(stream.finish())
    return pieces, stream


def test_the_probe_tells_a_cleaning_tokenizer_apart(plain, cleaning) -> None:
    assert not cleans_up_spaces(plain)
    assert cleans_up_spaces(cleaning)


@pytest.mark.parametrize("kind", ["plain", "cleaning"])
def test_pieces_add_up_to_the_decode_of_texts_and_of_random_tokens(kind, request) -> None:
    tokenizer = request.getfixturevalue(kind)
    pick = random.Random(7)
    sequences = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    sequences += [[pick.randrange(len(tokenizer)) for _ in range(pick.randrange(1, 60))] for _ in range(60)]
    sequences.append(tokenizer.encode("é", add_special_tokens=False) * 5 + [0, 1, 2])  # special tokens skipped
    for seed, tokens in enumerate(sequences):
        pieces, _ = _stream(tokenizer, tokens, seed=seed)
        assert "".join(pieces) == tokenizer.decode(tokens, skip_special_tokens=True), tokens


def test_text_streams_as_it_comes_not_all_at_the_end(plain, cleaning) -> None:
    tokens = plain.encode(TEXTS[0] + " " + TEXTS[2], add_special_tokens=False)
    for tokenizer in (plain, cleaning):
        stream = TextStream(tokenizer)
        early = [stream.add([token]) for token in tokens]
        sent_early = sum(map(len, early))
        assert sent_early >= len(tokenizer.decode(tokens)) * 0.6  # held back: at most a word or two


def test_a_character_split_across_tokens_is_sent_whole(plain) -> None:
    tokens = plain.encode("🙂", add_special_tokens=False)
    assert len(tokens) > 1  # the emoji's bytes take several tokens
    stream = TextStream(plain)
    pieces = [stream.add([token]) for token in tokens]
    assert pieces[:-1] == [""] * (len(tokens) - 1)
    assert pieces[-1] == "🙂"


@pytest.mark.parametrize("kind", ["plain", "cleaning"])
def test_text_is_cut_before_the_first_stop_string_and_no_part_of_it_is_sent(kind, request) -> None:
    tokenizer = request.getfixturevalue(kind)
    text = "One two three. Four five six. Seven"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(tokens)
    for stop in [("five",), ("ree. F", "Seven"), ("\n", "six."), ("o t",)]:
        pieces, stream = _stream(tokenizer, tokens, stop)
        first = min(full.find(s) for s in stop if s in full)
        assert "".join(pieces) == full[:first] == stream.text()
        assert stream.stopped in stop
        assert full[first:].startswith(stream.stopped)
        assert stream.add(tokens[:3]) == ""  # nothing is taken after the stop
    pieces, stream = _stream(tokenizer, tokens, ("absent",))
    assert "".join(pieces) == full
    assert stream.stopped is None


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=" .?!,'nstmvera\n", max_size=30), st.text(alphabet=" .?!,'nstmvera", max_size=12))
def test_what_the_cleanup_hold_back_sends_is_never_rewritten_by_what_follows(head: str, tail: str) -> None:
    """The rule `add` applies to a cleaning tokenizer: the clean text but its last CLEANUP_REACH characters stays
    the start of the clean text whatever is appended."""
    from transformers import PreTrainedTokenizerBase

    clean = PreTrainedTokenizerBase.clean_up_tokenization
    now = clean(None, head)
    safe = now[:max(0, len(now) - CLEANUP_REACH)]
    assert clean(None, head + tail).startswith(safe)
