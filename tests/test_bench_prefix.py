"""`dejavu bench prefix` on a small random model: its workloads are what it says, the cache is read where they
share a prefix and never where they do not, and the report, JSON and plot come out."""

from __future__ import annotations

import json

import pytest

import dejavu_sdk as dv
from dejavu_sdk.bench.prefix import chat_turns, run_prefix_bench, shared_turns
from dejavu_sdk.cli import main
from dejavu_sdk.models import random_llama


def test_each_chat_turn_is_the_conversation_so_far_and_a_new_message() -> None:
    turns = chat_turns(vocab=96, message_tokens=40, context_tokens=150, new_tokens=4, conversations=2)
    conversations = 0
    for before, after in zip([None, *turns[:-1]], turns, strict=True):
        assert len(after.ids) <= 150
        if before is not None and after.ids[:len(before.ids)] == before.ids:
            assert len(after.ids) > len(before.ids) + 4  # its answer (4 tokens) and a new message
        else:
            conversations += 1
    assert conversations == 2


def test_the_system_workload_shares_its_head_and_the_unique_one_nothing() -> None:
    shared = shared_turns(vocab=96, system_tokens=48, question_tokens=8, requests=3, shared=True)
    unique = shared_turns(vocab=96, system_tokens=48, question_tokens=8, requests=3, shared=False)
    assert len({turn.ids[:48] for turn in shared}) == 1
    assert len({turn.ids for turn in shared}) == 3
    assert len({turn.ids[:16] for turn in unique}) == 3


def test_the_bench_reads_the_cache_where_prompts_share_a_prefix(tmp_path) -> None:
    report = run_prefix_bench(random_llama(layers=2), "tiny", repeats=1, new_tokens=3, message_tokens=40,
                              context_tokens=150, conversations=1, system_tokens=48, question_tokens=8, requests=3,
                              chunk=16, long_hit=32, progress=False)
    (chat_without, chat_with), = report.runs["chat"]
    assert chat_without.cached == (0,) * len(chat_without.cached)
    assert chat_with.cached[0] == 0
    assert all(cached > 0 for cached in chat_with.cached[1:])
    assert report.runs["system"][0][1].cached == (0, 48, 48)
    assert report.runs["unique"][0][1].cached == (0, 0, 0)
    assert all(run.tokens == 3 * len(run.cached) for pairs in report.runs.values() for pair in pairs for run in pair)
    assert set(report.tier_ms_per_1000) == {"memory://", "lmdb://", "file://", "tcp:// store server"}
    text = report.to_markdown()
    assert "| chat | " in text
    assert "tcp:// store server" in text
    assert json.loads(json.dumps(report.to_json()))["settings"]["chunk"] == 16


def test_bad_workloads_and_numbers_are_refused() -> None:
    with pytest.raises(dv.ConfigError, match="workloads"):
        run_prefix_bench(random_llama(layers=2), "tiny", workloads=["chats"], progress=False)
    assert main(["bench", "prefix", "--repeats", "0"]) == 2


@pytest.mark.slow
@pytest.mark.usefixtures("workers_import_tiny_models")
def test_the_bench_sends_its_requests_to_dejavu_serve_and_reads_what_the_usage_reports() -> None:
    report = run_prefix_bench("tiny_models:llama", "tiny_models:llama", workloads=["system"], repeats=1, new_tokens=3,
                              system_tokens=48, question_tokens=8, requests=3, chunk=16, serve_stages=2,
                              progress=False)
    (without, with_cache), = report.runs["system"]
    assert without.cached == (0, 0, 0)
    assert with_cache.cached == (0, 48, 48)
    assert without.tokens == with_cache.tokens == 9
    assert report.settings["serve_stages"] == 2
    with pytest.raises(dv.ConfigError, match="serve_stages"):
        run_prefix_bench("tiny_models:llama", "tiny", serve_stages=0, progress=False)
