"""A journal that cannot write fails closed: new requests get 503 `journal_failed`, `/health` says so, the metrics
and `/v1/status` too, and no client is ever sent a token the journal does not hold (a stream waiting for it ends
with an error event); once the store writes again, admission reopens. With `journal_failure="serve"` the controller
serves on, `/health` saying `degraded`. A request the pipeline refuses is not journaled."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from failing_store import patch_journal_store
from stub_served import TOKEN, StubModel, serving

import dejavu_sdk as dv
from dejavu_sdk.controller import runs
from dejavu_sdk.controller.journal import Journal, read_journal

MODEL = "tiny_models:llama"


def _until(condition, within: float, what: str):
    deadline = time.monotonic() + within
    while not (found := condition()):
        assert time.monotonic() < deadline, f"{what} within {within} s"
        time.sleep(0.05)
    return found


def _stream(url: str, token: str, body: dict, on_tokens) -> tuple[str, list[int], dict | None]:
    """Stream `body`; its request id, the tokens got, and the error event if one came (`on_tokens(tokens)` after each
    chunk)."""
    got, error = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60,
                      headers={"Authorization": f"Bearer {token}"}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                got += [token for choice in chunk["choices"] for token in choice["token_ids"]]
                on_tokens(got)
        return response.headers["X-Dejavu-Request-Id"], got, error


def _metric(url: str, token: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


@pytest.mark.slow
def test_a_journal_that_cannot_write_takes_no_request_and_sends_no_token_it_does_not_hold_until_it_heals(
        workers_import_tiny_models, monkeypatch, tmp_path) -> None:
    url = f"lmdb://{tmp_path}/journal"
    store = patch_journal_store(monkeypatch, url)
    monkeypatch.setattr(runs, "JOURNAL_WAIT", 3.0)
    body = {"model": MODEL, "prompt": [5, 17, 33], "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    with dv.Controller(MODEL, stages=1, microbatch=4, port=0, timeout=60, journal=url) as controller:
        headers = {"Authorization": f"Bearer {controller.token}"}
        request_id, got, error = _stream(controller.url, controller.token, body,
                                         lambda tokens: len(tokens) >= 5 and store.failing.set())
        assert error is not None  # the stream ends, and says why
        assert error["code"] == "journal_failed"
        assert "Input/output error" in error["message"]
        assert 5 <= len(got) < 1500  # what the journal could not hold was held back
        health = httpx.get(f"{controller.url}/health", timeout=30)
        assert (health.status_code, health.json()["status"]) == (503, "journal_failed")
        assert "Input/output error" in health.json()["reason"]
        refused = httpx.post(f"{controller.url}/v1/completions", json=body, headers=headers, timeout=60)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "journal_failed"
        assert refused.headers["Retry-After"] == "5"
        assert _metric(controller.url, controller.token, "dejavu_journal_healthy") == 0
        assert _metric(controller.url, controller.token, "dejavu_journal_failed_writes_total") >= 1
        status = httpx.get(f"{controller.url}/v1/status", headers=headers, timeout=30).json()["journal"]
        assert status["state"] == "failed"
        store.failing.clear()  # the disk has room again: the journal writes what it held, and admission reopens
        _until(lambda: httpx.get(f"{controller.url}/health", timeout=30).status_code == 200, 30, "serving again")
        assert _metric(controller.url, controller.token, "dejavu_journal_healthy") == 1
        again = httpx.post(f"{controller.url}/v1/completions", json={**body, "max_tokens": 4}, headers=headers,
                           timeout=60)
        assert again.status_code == 200
        assert controller.journal.flush()
        held = read_journal(controller.journal.store)
    assert held[request_id].tokens[0][:len(got)] == got  # every token a client got, the journal holds
    assert held[request_id].answered == "failed"
    assert held[again.json()["id"]].tokens[0] == again.json()["choices"][0]["token_ids"]


@pytest.mark.slow
def test_with_journal_failure_serve_the_controller_serves_on_and_says_it_is_degraded(
        workers_import_tiny_models, monkeypatch, tmp_path) -> None:
    url = f"lmdb://{tmp_path}/journal"
    store = patch_journal_store(monkeypatch, url)
    body = {"model": MODEL, "prompt": [5, 17, 33], "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    with dv.Controller(MODEL, stages=1, microbatch=4, port=0, timeout=60, journal=url,
                       journal_failure="serve") as controller:
        headers = {"Authorization": f"Bearer {controller.token}"}
        expected = httpx.post(f"{controller.url}/v1/completions", json=body, headers=headers, timeout=60).json()
        store.failing.set()
        health = _until(lambda: (answer := httpx.get(f"{controller.url}/health", timeout=30)).json()["status"]
                        == "degraded" and answer, 10, "degraded")  # its next write or lease renewal fails
        assert health.status_code == 200
        assert "Input/output error" in health.json()["reason"]
        answer = httpx.post(f"{controller.url}/v1/completions", json=body, headers=headers, timeout=60)
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
        _, got, error = _stream(controller.url, controller.token, body, lambda _: None)
        assert (got, error) == (expected["choices"][0]["token_ids"], None)


def test_a_request_the_pipeline_refuses_is_not_journaled(tmp_path) -> None:
    url = f"lmdb://{tmp_path}/journal"
    journal = Journal(url, interval=0.01)
    try:
        with serving(StubModel(journal)) as api:
            refused = httpx.post(f"{api}/v1/completions", json={"model": "stub", "prompt": [4242, 1], "max_tokens": 1},
                                 headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
            assert refused.status_code == 400
            assert "vocabulary" in refused.json()["error"]["message"]
            served = httpx.post(f"{api}/v1/completions", json={"model": "stub", "prompt": [42, 1], "max_tokens": 1},
                                headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
            assert served.status_code == 200
        assert journal.flush()
        assert list(read_journal(journal.store)) == [served.json()["id"]]
        records = [journal.store.read_progress(key) for key in journal.store.progress_keys("dejavu-journal")]
        assert not any(b"4242" in record for record in records)  # its body is written nowhere
    finally:
        journal.close()
