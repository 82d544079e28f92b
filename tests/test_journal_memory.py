"""Finished requests cost constant memory: once as many requests have ended as are kept, 8,000 more one-token
requests through the API (a stub model, an LMDB journal) leave the controller's memory within 8 MB of where it
was, however many passed (kept without bound, they grow it by about 19 MB). Ended requests are kept as their
transcripts, at most `MAX_KEPT` of them (here 500, so that the test reaches the bound twenty times sooner), and
the journal's folded state holds at most as many answered requests, without their prompts."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
from stub_served import TOKEN, StubModel, serving

from dejavu_sdk.controller import run_book
from dejavu_sdk.controller.journal import Journal, JournalState
from dejavu_sdk.controller.limits import ApiLimits

CLIENT = str(Path(__file__).parent / "load_client.py")
MIB = 1 << 20
KEPT, REQUESTS = 500, 8_000


def _memory() -> dict[str, int]:
    """This process's resident memory after a collection, bytes: anonymous (its own) and file-backed (mapped files:
    LMDB maps the journal's data file)."""
    gc.collect()
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {name: int(fields[name].split()[0]) * 1024 for name in ("VmRSS", "RssAnon", "RssFile")}


def _send(url: str, count: int, first: int) -> None:
    subprocess.run([sys.executable, CLIENT, url, TOKEN, str(count), str(first)], check=True, timeout=600)


@pytest.mark.slow
def test_eight_thousand_finished_requests_past_the_kept_ones_leave_memory_within_8_mb(tmp_path,
                                                                                        monkeypatch) -> None:
    monkeypatch.setattr(run_book, "MAX_KEPT", KEPT)
    journal = Journal(f"lmdb://{tmp_path}/journal", keep=KEPT)
    try:
        with serving(StubModel(journal), ApiLimits(max_waiting=4096)) as url:
            _send(url, 2 * KEPT, 0)  # as many ended as are kept; the code paths and caches every request uses
            before = _memory()
            _send(url, REQUESTS, 2 * KEPT)
            assert journal.flush()
            after = _memory()
        answered = sum(request.answered is not None for request in journal.held.requests.values())
    finally:
        journal.close()
    grown = {name: (after[name] - before[name]) / MIB for name in after}
    print(f"per finished request: {(after['VmRSS'] - before['VmRSS']) / REQUESTS:.0f} B of VmRSS, "
          f"{(after['RssAnon'] - before['RssAnon']) / REQUESTS:.0f} B anonymous; grown (MiB): {grown}")
    assert grown["RssAnon"] < 8, grown  # each kept without bound: about 19 MB
    assert answered == KEPT

def test_the_journal_keeps_at_most_keep_answered_requests_and_drops_their_prompts_once_no_batch_runs_them() -> None:
    state = JournalState(keep=3)
    prompt = list(range(100))
    for number in range(10):
        state.apply({"admitted": [[f"cmpl-{number}", {"choices": [{"prompt": prompt}], "prompts": [prompt],
                                                     "stop": []}]],
                     "token": [[f"cmpl-{number}", 0, 0, number]]})
    state.apply({"slot_group": [[7, [18, 19], [["cmpl-8", 0], ["cmpl-9", 0]]]]})  # cmpl-9 runs on, beside cmpl-8
    state.apply({"answered": [[f"cmpl-{number}", "ok", 100.0 + number] for number in range(9)]})
    state.prune()
    assert list(state.requests) == ["cmpl-6", "cmpl-7", "cmpl-8", "cmpl-9"]  # the last three answered, one running
    assert state.requests["cmpl-6"].admitted["prompts"] == [[]]  # what showing it again needs, no more
    assert (state.requests["cmpl-6"].prompt_count(), state.requests["cmpl-6"].tokens) == (100, {0: [6]})
    assert state.requests["cmpl-8"].admitted["prompts"] == [prompt]  # a running batch names it: a successor may
    state.apply({"answered": [["cmpl-9", "ok", 200.0]]})  # stand it in for its row
    state.prune()
    assert list(state.requests) == ["cmpl-7", "cmpl-8", "cmpl-9"]
    assert state.slots == {}
    assert all(request.admitted["prompts"] == [[]] for request in state.requests.values())
    again = JournalState.fold([json.loads(state.snapshot())], keep=3)  # a successor holds as much, as little
    assert {request_id: (request.prompt_count(), request.answered) for request_id, request in again.requests.items()} \
        == {request_id: (100, "ok") for request_id in ("cmpl-7", "cmpl-8", "cmpl-9")}
