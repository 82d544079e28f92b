"""The controller's journal (`journal=`, `--journal`): every admitted request (with the seed each sampled choice
draws from), every streamed token and every end, written off the event loop in grouped records to a store that
outlives the process; read back whole after a clean close, and as a gapless prefix after a kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import openai
import pytest

import dejavu_sdk as dv
from dejavu_sdk.cli import build_parser
from dejavu_sdk.controller.journal import Journal, JournalState, read_journal
from dejavu_sdk.generation.logprobs import TokenLogprobs


def test_what_is_written_is_read_back_and_a_journal_must_outlive_the_process(tmp_path) -> None:
    url = f"lmdb://{tmp_path}/journal"
    journal = Journal(url, interval=0.01)
    journal.admitted("cmpl-1", {"choices": [{"prompt": [1, 2]}, {"prompt": [3]}]})
    for index, token in enumerate([5, 6, 7]):
        journal.token("cmpl-1", 0, index, token)
    journal.token("cmpl-1", 1, 0, 9)
    journal.finished("cmpl-1", 0, "length")
    journal.answered("cmpl-1", "ok")
    journal.admitted("cmpl-2", {"choices": [{"prompt": [4]}]})
    journal.close()
    journal.close()  # twice: harmless
    requests = read_journal(url)
    assert list(requests) == ["cmpl-1", "cmpl-2"]
    first = requests["cmpl-1"]
    assert (first.tokens, first.finish, first.answered) == ({0: [5, 6, 7], 1: [9]}, {0: "length"}, "ok")
    assert first.admitted == {"choices": [{"prompt": [1, 2]}, {"prompt": [3]}]}
    assert (requests["cmpl-2"].tokens, requests["cmpl-2"].answered) == ({}, None)
    with pytest.raises(dv.ConfigError, match="outlive"):
        Journal("memory://")


def test_a_journal_that_cannot_hold_an_entry_stops_and_says_why_without_raising(tmp_path) -> None:
    journal = Journal(f"lmdb://{tmp_path}/journal", interval=0.01)
    journal.admitted("cmpl-1", {"unwritable": object()})
    assert not journal.flush(timeout=10)  # never written
    assert "not JSON serializable" in journal.failure
    assert journal.health() == ("journal_failed", journal.failure)
    told = []
    journal.when_written(journal.token("cmpl-1", 0, 0, 5), told.append)  # queued and dropped: the caller is never
    assert not journal.flush(timeout=10)  # held up nor failed, and a waiter is told it will never be written
    assert told == [False]
    journal.close()


WRITER = """
import sys, time
sys.path.insert(0, {tests!r})
from dejavu_sdk.controller.journal import Journal
journal = Journal({url!r}, interval=0.005)
journal.admitted("cmpl-1", {{"choices": [{{"prompt": [1]}}]}})
for index in range(100000):
    journal.token("cmpl-1", 0, index, index * 7 % 1000)
    if index % 50 == 0:
        print(index, flush=True)
        time.sleep(0.002)
"""


@pytest.mark.slow
def test_a_journal_killed_mid_write_reads_back_a_gapless_prefix(tmp_path) -> None:
    url = f"lmdb://{tmp_path}/journal"
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER.format(tests=str(tmp_path), url=url))],
                             stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while int(child.stdout.readline() or -1) < 2000:  # well into its writing
            assert time.monotonic() < deadline, "the writer did not get going"
            assert child.poll() is None, "the writer ended"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    tokens = read_journal(url)["cmpl-1"].tokens[0]
    assert len(tokens) > 1000
    assert tokens == [index * 7 % 1000 for index in range(len(tokens))]


@pytest.mark.slow
def test_a_journaled_controller_records_each_request_as_its_client_got_it(workers_import_tiny_models,
                                                                           tmp_path) -> None:
    url = f"lmdb://{tmp_path}/journal"
    with dv.Controller("tiny_models:llama", stages=1, microbatch=4, port=0, timeout=60, journal=url) as controller:
        client = openai.OpenAI(base_url=controller.url + "/v1", api_key=controller.token, max_retries=0, timeout=60)
        greedy = client.completions.create(model="tiny_models:llama", prompt=[[5, 17, 33], [8, 61]], max_tokens=8,
                                           temperature=0)
        sampled = client.completions.create(model="tiny_models:llama", prompt=[5, 17, 33], max_tokens=8, n=2,
                                            temperature=1.0)  # no seed: the journal holds the ones drawn
        streamed = list(client.completions.create(model="tiny_models:llama", prompt=[9, 9, 2], max_tokens=6,
                                                  temperature=0, stream=True))
        controller.journal.flush()
        requests = read_journal(controller.journal.store)  # the controller's own open store
        assert set(requests) >= {greedy.id, sampled.id}
        for answer in (greedy, sampled):
            journaled = requests[answer.id]
            assert journaled.tokens == {choice.index: choice.token_ids for choice in answer.choices}
            assert journaled.finish == {choice.index: choice.finish_reason for choice in answer.choices}
            assert journaled.answered == "ok"
        seeds = [choice["decoding"]["seed"] for choice in requests[sampled.id].admitted["choices"]]
        assert all(isinstance(seed, int) for seed in seeds)
        for choice, seed in zip(sampled.choices, seeds, strict=True):  # the journaled seed gives the same tokens
            again = client.completions.create(model="tiny_models:llama", prompt=[5, 17, 33], max_tokens=8,
                                              temperature=1.0, seed=seed)
            assert again.choices[0].token_ids == choice.token_ids
        stream_id = streamed[0].id
        assert requests[stream_id].tokens[0] == [token for chunk in streamed for choice in chunk.choices
                                                 for token in choice.token_ids or []]


def test_serve_and_controller_take_a_journal() -> None:
    parser = build_parser()
    for command in ("serve", "controller"):
        assert parser.parse_args([command, "--model", "smollm2", "--journal", "lmdb:///j"]).journal == "lmdb:///j"


def test_snapshots_bound_the_journal_and_a_successor_keeps_its_predecessors_requests(tmp_path) -> None:
    """Past `compact_bytes` the writer writes a snapshot and removes what came before it: the records left stay
    few, a request answered more than keep_finished ago is gone, a running one keeps every token, and a successor
    (another Journal on the URL) keeps the requests of the one before it through its own snapshots."""
    url = f"lmdb://{tmp_path}/journal"
    first = Journal(url, interval=0.0, keep_finished=0.0, compact_bytes=2000)
    first.head("tcp://127.0.0.1:5000", None)
    first.admitted("cmpl-done", {"choices": [{"prompt": [1]}]})
    first.token("cmpl-done", 0, 0, 3)
    first.answered("cmpl-done", "ok")
    first.admitted("cmpl-running", {"choices": [{"prompt": [2]}]})
    first.slot_group(5, [11, 12], [["cmpl-running", 0], ["cmpl-done", 0]])  # a slot's groups, with their members
    first.slot_group(6, [13], [["cmpl-done", 0]])
    for index in range(600):
        first.token("cmpl-running", 0, index, index % 97)
        if index % 10 == 0:
            assert first.flush()  # a record every ten tokens
    first.close()
    store = dv.open_store(url)
    try:
        kept = store.progress_keys("dejavu-journal")
    finally:
        store.close()
    assert max(key.log for key in kept) >= 3  # snapshots were written (600 token records, a few KB of them)
    assert {key.log for key in kept} == {max(key.log for key in kept)}  # nothing before the last one is left
    assert min(key.step for key in kept) == 0  # the snapshot itself
    held = read_journal(url)
    assert list(held) == ["cmpl-running"]  # answered, and past keep_finished at the last snapshot
    assert held["cmpl-running"].tokens == {0: [index % 97 for index in range(600)]}
    second = Journal(url, interval=0.0, compact_bytes=2000)
    assert second.found.slots == {5: [([11, 12], [("cmpl-running", 0), ("cmpl-done", 0)])]}
    assert second.found.head == first.held.head
    assert second.found.head.url == "tcp://127.0.0.1:5000"
    for index in range(600, 1200):
        second.token("cmpl-running", 0, index, index % 97)
        if index % 10 == 0:
            assert second.flush()
    second.close()
    held = read_journal(url)
    assert held["cmpl-running"].admitted == {"choices": [{"prompt": [2]}]}  # written by the first only
    assert held["cmpl-running"].tokens == {0: [index % 97 for index in range(1200)]}
    store = dv.open_store(url)
    try:
        assert {key.run for key in store.progress_keys("dejavu-journal")} == {second.run}  # the first's are gone
    finally:
        store.close()


def test_a_journal_opened_on_a_clock_behind_its_predecessors_sorts_after_it(tmp_path) -> None:
    """Run ids sort by their start: one opened on a machine whose clock is behind the predecessor's still sorts
    after it, so its records (and snapshots) are read after the predecessor's, never before."""
    url = f"lmdb://{tmp_path}/journal"
    store = dv.open_store(url)
    future = int(time.time() * 1000) + 10 * 24 * 3600 * 1000  # a predecessor ten days ahead
    store.put_progress(dv.ProgressKey("dejavu-journal", f"{future:012x}00000001", 0, 0),
                       b'{"head": [[null, null]], "admitted": [["cmpl-old", {"choices": []}]]}')
    store.close()
    journal = Journal(url, interval=0.0, compact_bytes=1)  # a snapshot after every record
    assert int(journal.run[:12], 16) > future
    journal.admitted("cmpl-new", {"choices": []})
    journal.answered("cmpl-old", "ok")
    journal.close()
    held = read_journal(url)
    assert list(held) == ["cmpl-old", "cmpl-new"]
    assert held["cmpl-old"].answered == "ok"  # the successor's word is the last


def test_each_token_s_log_probabilities_are_folded_with_it_and_kept_through_snapshots() -> None:
    """A request that asked for log-probabilities has each token's entry journaled beside it (None: lost); the
    folded state, and a snapshot of it folded again, keep them aligned with the tokens, also once the request is
    answered and its prompts dropped. A request that did not ask keeps none."""
    entry = TokenLogprobs(-0.25, ((7, -0.25), (3, -1.5)))
    state = JournalState(keep=4)
    state.apply({"admitted": [["cmpl-1", {"choices": [{"prompt": [1, 2]}], "prompts": [[1, 2]], "stop": []}],
                              ["cmpl-2", {"choices": [{"prompt": [5]}], "prompts": [[5]], "stop": []}]],
                 "token": [["cmpl-1", 0, 0, 7, entry.wire()], ["cmpl-1", 0, 1, 9, None], ["cmpl-2", 0, 0, 4],
                           ["cmpl-1", 0, 1, 9, entry.wire()]]})  # a token sent twice is folded once
    assert state.requests["cmpl-1"].logprobs == {0: [entry.wire(), None]}
    assert state.requests["cmpl-2"].logprobs == {}
    for answered in (False, True):
        if answered:
            state.apply({"answered": [["cmpl-1", "ok", 1.0]]})
            state.prune()
        again = JournalState.fold([json.loads(state.snapshot())], keep=4)
        assert {request_id: (request.tokens, request.logprobs, request.prompt_count())
                for request_id, request in again.requests.items()} == \
            {"cmpl-1": ({0: [7, 9]}, {0: [entry.wire(), None]}, 2), "cmpl-2": ({0: [4]}, {}, 1)}
    assert TokenLogprobs.of_wire(again.requests["cmpl-1"].logprobs[0][0]) == entry
