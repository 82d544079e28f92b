"""Requests outlive their connection and their controller: every server-sent event has `id: <request id>:<position>`,
a client that reconnects with `Last-Event-ID` gets every later token exactly once (`GET /v1/requests/<id>/stream`),
`GET /v1/requests/<id>` answers a running or ended request to the token that made it (to any other, it does not
exist), and a controller started on the journal of one that died goes on with its requests under their ids, for
the same tokens, computing again from the prompt what no worker holds."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

import dejavu_sdk as dv
from dejavu_sdk.controller.journal import Journal, read_journal

MODEL = "tiny_models:llama_text"
TOKEN = "client-token"


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


def _controller(tokenizer, journal: str | None, **options) -> dv.Controller:
    """A controller on `journal`, answering the same client token as every other (as a restart with the same
    token file does)."""
    return dv.Controller(MODEL, stages=1, microbatch=4, port=0, timeout=60, tokenizer=tokenizer, journal=journal,
                         **{"token": TOKEN, **options})


def _events(response: httpx.Response) -> Iterator[tuple[str | None, str]]:
    """Each server-sent event's id and data."""
    event_id, data = None, None
    for line in response.iter_lines():
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
        elif not line and data is not None:
            yield event_id, data
            event_id, data = None, None


def _resume(controller, request_id: str, last: str | bytes | None, token: str | None = None,
            ) -> tuple[list[tuple[str | None, str]], int]:
    headers = {"Authorization": f"Bearer {token or controller.token}", **({"Last-Event-ID": last} if last else {})}
    with httpx.stream("GET", f"{controller.url}/v1/requests/{request_id}/stream", headers=headers,
                      timeout=60) as response:
        if response.status_code != 200:
            response.read()
            return [(None, response.text)], response.status_code
        return list(_events(response)), 200


def _tokens(events: list[tuple[str | None, str]]) -> tuple[list[int], str, list[str | None]]:
    """The tokens, text and finish reasons the completion chunks among `events` carry."""
    tokens, text, finish = [], "", []
    for _, data in events:
        if data == "[DONE]":
            continue
        for choice in json.loads(data).get("choices", []):
            tokens += choice.get("token_ids") or []
            text += choice.get("text") or ""
            finish.append(choice.get("finish_reason"))
    return tokens, text, finish


def _get(controller, request_id: str, token: str | None = None) -> tuple[int, dict]:
    response = _as(controller, f"/v1/requests/{request_id}", token or controller.token)
    return response.status_code, response.json()


def _as(controller, path: str, token: str) -> httpx.Response:
    return httpx.get(controller.url + path, headers={"Authorization": f"Bearer {token}"}, timeout=60)


@pytest.mark.slow
def test_a_stream_cut_short_resumes_past_its_last_event_id_with_every_later_token_once(
        workers_import_tiny_models, tokenizer, tmp_path) -> None:
    with _controller(tokenizer, f"file://{tmp_path}/journal") as controller:
        client = openai.OpenAI(base_url=controller.url + "/v1", api_key=controller.token, max_retries=0, timeout=60)
        asked = {"model": MODEL, "prompt": "The weather today", "max_tokens": 40, "temperature": 0,
                 "extra_body": {"ignore_eos": True}}
        whole = client.completions.create(**asked).choices[0]
        body = {**{k: v for k, v in asked.items() if k != "extra_body"}, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        seen: list[tuple[str | None, str]] = []
        with httpx.stream("POST", controller.url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {controller.token}"}) as response:
            for event in _events(response):
                seen.append(event)
                if len(_tokens(seen)[0]) >= 5:
                    break  # the client's connection breaks here
        request_id = json.loads(seen[0][1])["id"]
        got, _, _ = _tokens(seen)
        positions = [int(event_id.rpartition(":")[2]) for event_id, _ in seen]
        assert all(event_id.startswith(request_id + ":") for event_id, _ in seen)
        assert positions == [len(_tokens(seen[:at + 1])[0]) for at in range(len(seen))]  # tokens so far
        # The request goes on without its client (a journal is kept); the client comes back.
        rest, status = _resume(controller, request_id, seen[-1][0])
        assert status == 200
        assert rest[-1] == (None, "[DONE]")
        more, text, finish = _tokens(rest)
        assert got + more == whole.token_ids  # every token once
        assert finish[-1] == "length"
        usage = [json.loads(data)["usage"]["completion_tokens"] for _, data in rest[:-2]]
        assert usage == [len(got) + len(_tokens(rest[:at + 1])[0]) for at in range(len(rest) - 2)]  # from its start
        assert rest[-3][0] == f"{request_id}:{len(whole.token_ids) + 1}"  # its end counts as one more position
        assert _tokens(seen)[1] + text == whole.text
        status, now = _get(controller, request_id)
        assert (status, now["status"], now["choices"][0]["token_ids"]) == (200, "finished", whole.token_ids)
        assert now["choices"][0]["text"] == whole.text
        # From its last event: nothing more. Without an id: all of it. A wrong id, or an unknown request: refused.
        after_end = _resume(controller, request_id, rest[-3][0])[0]
        assert [data for _, data in after_end][-1] == "[DONE]"
        assert _tokens(after_end)[0] == []
        assert _tokens(_resume(controller, request_id, None)[0])[0] == whole.token_ids
        assert _resume(controller, request_id, "cmpl-other:3")[1] == 400
        assert _resume(controller, request_id, f"{request_id}:x")[1] == 400
        for forged in ("+5", "1_0", "\uff15", " 5", "-0"):  # what int() reads, and no position is
            assert _resume(controller, request_id, f"{request_id}:{forged}".encode())[1] == 400, forged
        assert _get(controller, "cmpl-unknown")[0] == 404


def _first_run(tokenizer, tmp_path, *asks: dict) -> tuple[list, dict]:
    """Each of `asks` (completions arguments) answered by a journaled controller (every token, ignoring
    end-of-sequence); the answers, and the requests its journal holds."""
    with _controller(tokenizer, f"file://{tmp_path}/first") as first:
        client = openai.OpenAI(base_url=first.url + "/v1", api_key=first.token, max_retries=0, timeout=60)
        answers = [client.completions.create(model=MODEL, extra_body={"ignore_eos": True}, **ask) for ask in asks]
        first.journal.flush()
        return answers, read_journal(first.journal.store)


def _cut(held, request_id: str, keep: int, url: str, wrong_at: int | None = None,
         answered: str | None = None) -> None:
    """Write to `url` the journal a controller killed after `keep` tokens of `request_id` leaves (the token at
    `wrong_at` changed: what a computation that went another way streamed; `answered`: the request's outcome,
    written before the kill)."""
    journal, request = Journal(url), held[request_id]
    journal.admitted(request_id, request.admitted)
    for index, token in enumerate(request.tokens[0][:keep]):
        logprobs = [request.logprobs[0][index]] if request.logprobs else []
        journal.token(request_id, 0, index, token + (1 if index == wrong_at else 0), *logprobs)
    if answered is not None:
        journal.answered(request_id, answered)
    journal.close()


@pytest.mark.slow
def test_a_successor_goes_on_with_the_journal_s_requests_and_their_clients_resume_exactly(
        workers_import_tiny_models, tokenizer, tmp_path) -> None:
    (greedy, sampled), held = _first_run(
        tokenizer, tmp_path, {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0},
        {"prompt": "Paris is", "max_tokens": 16, "temperature": 1.0, "seed": 7})
    _cut(held, greedy.id, 9, f"file://{tmp_path}/cut")
    _cut(held, sampled.id, 5, f"file://{tmp_path}/cut")  # the same journal, a second incarnation: both in it
    with _controller(tokenizer, f"file://{tmp_path}/cut") as successor:
        assert sorted(successor.adoption.going_on) == sorted([greedy.id, sampled.id])
        assert successor.adoption.recomputed == {greedy.id: 9, sampled.id: 5}  # the report says what is redone
        for answer, had in ((greedy, 7), (sampled, 5)):  # a client may have had fewer tokens than the journal
            events, status = _resume(successor, answer.id, f"{answer.id}:{had}")
            assert status == 200
            tokens, _, finish = _tokens(events)
            assert tokens == answer.choices[0].token_ids[had:]
            assert finish[-1] == "length"
            status, now = _get(successor, answer.id)
            assert (now["status"], now["choices"][0]["token_ids"]) == ("finished", answer.choices[0].token_ids)
            assert now["choices"][0]["text"] == answer.choices[0].text
        successor.journal.flush()
        again = read_journal(successor.journal.store)
        assert again[greedy.id].tokens[0] == greedy.choices[0].token_ids  # both incarnations' tokens, in order
        assert again[greedy.id].answered == "ok"
    with _controller(tokenizer, f"file://{tmp_path}/cut") as third:  # answered: kept for reading, not computed
        assert third.adoption.going_on == []
        assert sorted(third.adoption.kept) == sorted([greedy.id, sampled.id])
        assert _get(third, greedy.id)[1]["choices"][0]["token_ids"] == greedy.choices[0].token_ids
    _cut(held, sampled.id, 3, f"file://{tmp_path}/left", answered="cancelled")  # its client left, no journal kept
    with _controller(tokenizer, f"file://{tmp_path}/left") as fourth:  # an unfinished choice of an ended request
        assert (fourth.adoption.going_on, fourth.adoption.kept) == ([], [sampled.id])
        now = _get(fourth, sampled.id)[1]
        assert (now["status"], now["choices"][0]["token_ids"]) == ("cancelled", sampled.choices[0].token_ids[:3])
        assert fourth.pipeline.idle()  # nothing computed for it


@pytest.mark.slow
def test_a_successor_streams_the_log_probabilities_its_predecessor_journaled(
        workers_import_tiny_models, tokenizer, tmp_path) -> None:
    """The journal keeps each token's log-probabilities: a client that resumes from a successor gets those of the
    tokens the journal held (which it computes again only to check them) as they were first streamed."""
    (answer,), held = _first_run(tokenizer, tmp_path, {"prompt": "The sky is", "max_tokens": 12, "temperature": 0,
                                                       "logprobs": 2})
    whole = answer.choices[0].logprobs
    assert [entry[0] for entry in held[answer.id].logprobs[0]] == whole.token_logprobs
    _cut(held, answer.id, 8, f"file://{tmp_path}/cut")
    with _controller(tokenizer, f"file://{tmp_path}/cut") as successor:
        events, status = _resume(successor, answer.id, f"{answer.id}:3")
        assert status == 200
        chunks = [choice["logprobs"] for _, data in events if data != "[DONE]"
                  for choice in json.loads(data)["choices"] if choice["logprobs"]]
        assert [value for chunk in chunks for value in chunk["token_logprobs"]] == whole.token_logprobs[3:]
        assert [top for chunk in chunks for top in chunk["top_logprobs"]] == whole.top_logprobs[3:]  # five that the
        # journal held, four computed


@pytest.mark.slow
def test_a_recomputation_that_differs_from_what_was_streamed_fails_the_request_and_says_why(
        workers_import_tiny_models, tokenizer, tmp_path) -> None:
    (answer,), held = _first_run(tokenizer, tmp_path, {"prompt": "def main():", "max_tokens": 12, "temperature": 0})
    _cut(held, answer.id, 6, f"file://{tmp_path}/cut", wrong_at=3)
    with _controller(tokenizer, f"file://{tmp_path}/cut") as successor:
        events, status = _resume(successor, answer.id, f"{answer.id}:6")
        assert status == 200
        error = json.loads(events[-2][1])["error"]
        assert error["code"] == "recomputation_diverged"
        assert "token 3" in error["message"]
        status, now = _get(successor, answer.id)
        assert (now["status"], now["error"]["code"]) == ("failed", "recomputation_diverged")


def test_keep_finished_must_be_seconds_from_zero_on() -> None:
    for wrong in (-1, float("inf"), "60", True):
        with pytest.raises(dv.ConfigError, match="keep_finished"):
            dv.Controller(MODEL, keep_finished=wrong)


@pytest.mark.slow
def test_a_request_is_its_token_s_alone_and_stays_so_for_a_successor(workers_import_tiny_models, tokenizer,
                                                                     tmp_path) -> None:
    mine, other = "client-a-token", "client-b-token"
    with _controller(tokenizer, f"file://{tmp_path}/first", token=mine, tokens=[other]) as first:
        client = openai.OpenAI(base_url=first.url + "/v1", api_key=mine, max_retries=0, timeout=60)
        answer = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
        tokens = answer.choices[0].token_ids
        status, now = _get(first, answer.id, mine)
        assert (status, now["choices"][0]["token_ids"]) == (200, tokens)
        assert _tokens(_resume(first, answer.id, None, mine)[0])[0] == tokens
        _same_as_unknown(first, answer.id, other)
        first.journal.flush()
        held = read_journal(first.journal.store)
    assert mine not in json.dumps(held[answer.id].admitted)  # the journal holds a digest of it, never the token
    _cut(held, answer.id, 5, f"file://{tmp_path}/cut")  # killed after 5 tokens: a successor goes on with it
    with _controller(tokenizer, f"file://{tmp_path}/cut", token=mine, tokens=[other]) as successor:
        assert successor.adoption.going_on == [answer.id]
        adopted = {token: _as(successor, "/v1/status", token).json()["adopted"] for token in (mine, other)}
        assert (adopted[mine]["going_on"], adopted[mine]["recomputed"]) == ([answer.id], {answer.id: 5})
        assert (adopted[other]["going_on"], adopted[other]["recomputed"], adopted[other]["kept"]) == ([], {}, [])
        events, status = _resume(successor, answer.id, f"{answer.id}:5", mine)
        assert (status, _tokens(events)[0]) == (200, tokens[5:])
        _same_as_unknown(successor, answer.id, other)


def _same_as_unknown(controller, request_id: str, token: str) -> None:
    """`token` gets for `request_id`, read or resumed, what it gets for an id nobody made."""
    unknown = "cmpl-" + "0" * 32
    for suffix in ("", "/stream"):
        got, never = (_as(controller, f"/v1/requests/{name}{suffix}", token) for name in (request_id, unknown))
        assert got.status_code == never.status_code == 404
        assert got.text.replace(request_id, unknown) == never.text
