"""One large request beside others at the front door: a request with n=128 choices, log-probabilities and echo
takes turns, so a greedy request sent as it starts gets its first token about as soon as alone; a request whose KV
cache could never fit the budget is a 400 at once, never queued, and one just within it is served exactly."""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import threading
import time
from urllib.parse import urlsplit

import openai
import pytest
import tiny_models
import torch

import dejavu_sdk as dv
from dejavu_sdk.swapping import kv_bytes_per_token, positions_needed

pytestmark = pytest.mark.slow

MODEL = "tiny_models:llama_text"
PROMPT = "Once upon a time, in a land far away,"
#: One stage whose process runs one torch thread: the CPUs are shared with the controller and the clients.
SERVER = {"stages": 1, "microbatch": 4, "port": 0, "timeout": 60, "served_model_name": "text", "threads": 1}
#: 128 seeded choices (a seed each), their top-20 log-probabilities, and the prompt's (echo), 16 tokens each:
#: 32 microbatches of four rows one after another, were they alone.
LARGE = {"model": "text", "prompt": PROMPT, "n": 128, "logprobs": 20, "echo": True, "max_tokens": 16, "seed": 5}


def _client(controller) -> openai.OpenAI:
    return openai.OpenAI(base_url=controller.url + "/v1", api_key=controller.token, max_retries=0, timeout=120)


def _greedy(client: openai.OpenAI) -> tuple[float, list[int]]:
    """A short greedy completion, streamed: the seconds its client waits for its first token, and its tokens."""
    started, first, tokens = time.monotonic(), None, []
    for chunk in client.completions.create(model="text", prompt="Paris is", max_tokens=4, temperature=0, stream=True):
        for choice in chunk.choices:
            first = time.monotonic() - started if first is None else first
            tokens += choice.token_ids or []
    assert first is not None
    return first, tokens


class _LargeRequest:
    """The large request, sent from a thread of its own over a connection this test can cut (its client leaving
    cancels it)."""

    def __init__(self, controller) -> None:
        address = urlsplit(controller.url)
        self.connection = http.client.HTTPConnection(address.hostname, address.port, timeout=120)
        headers = {"Authorization": f"Bearer {controller.token}", "Content-Type": "application/json"}
        self.thread = threading.Thread(target=self._send, args=(json.dumps(LARGE), headers), daemon=True)
        self.thread.start()

    def _send(self, body: str, headers: dict[str, str]) -> None:
        try:
            self.connection.request("POST", "/v1/completions", body, headers)
            self.connection.getresponse().read()
        except OSError:  # cut by `leave`
            pass

    def leave(self) -> None:
        if self.connection.sock is not None:
            self.connection.sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(timeout=30)


def _decoding_beside(controller) -> bool:
    """Whether the large request has its first four rows decoding (their first tokens out), and choices waiting."""
    return controller.waiting() > 0 and any(microbatch["rows"] == 4 and microbatch["steps"] >= 1
                                            for microbatch in controller.pipeline.status()["microbatches"])


def _wait(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {seconds:.0f} s"
        time.sleep(0.002)


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_a_large_request_takes_turns_and_a_greedy_one_beside_it_gets_its_first_token_about_as_soon_as_alone(
        workers_import_tiny_models, smollm2_tokenizer, batching) -> None:
    """Static microbatches and continuous slots alike. The greedy request is sent as the
    large one's first tokens are out: it does not wait for the large one's microbatch to end (16 steps), nor for
    its 124 waiting choices (a seed each, yet one submission, which takes one turn at a time); it gets a
    microbatch beside it, after at most the large one's step in flight."""
    options = {"batching": batching, "recovery": None if batching == "continuous" else "auto"}
    with dv.Controller(MODEL, tokenizer=smollm2_tokenizer, **SERVER, **options) as controller:
        assert controller.pipeline.batching == batching
        client = _client(controller)
        _greedy(client)  # the first request of a server warms its caches
        alone = [_greedy(client) for _ in range(5)]
        large = _LargeRequest(controller)
        try:
            _wait(lambda: _decoding_beside(controller), 60, "first tokens of the large request")
            beside, tokens = _greedy(client)
            still_waiting = controller.waiting()
        finally:
            large.leave()
        _wait(controller.pipeline.idle, 60, "cancelled choices left")
    first = statistics.median(seconds for seconds, _ in alone)
    assert beside < 5 * first, f"{beside * 1000:.0f} ms to the first token beside it, {first * 1000:.0f} ms alone"
    assert still_waiting > 0, "the large request was not beside the greedy one to its end"
    assert tokens == alone[0][1]


def test_a_request_whose_kv_could_never_fit_is_a_400_at_once_and_one_just_within_is_served_exactly(
        workers_import_tiny_models, smollm2_tokenizer) -> None:
    """n=3 choices of a prompt and 6 new tokens each fill the budget alone (each choice is a row of its own, and
    waits for the others' rows to end): served, each equal to `model.generate`; 7 new tokens never fit."""
    prompt = smollm2_tokenizer(PROMPT)["input_ids"]
    model = tiny_models.llama_text()
    per_position = kv_bytes_per_token(model.config, torch.float32, layers=2)  # one stage holds both layers
    budget = positions_needed(len(prompt), 6) * per_position
    with dv.Controller(MODEL, tokenizer=smollm2_tokenizer, kv_budget_bytes=budget, **SERVER) as controller:
        client = _client(controller)
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="text", prompt=prompt, max_tokens=7, n=3, temperature=0)
        error = refused.value
        assert (error.code, error.param, error.type) == ("kv_budget_exceeded", "max_tokens", "invalid_request_error")
        needed = positions_needed(len(prompt), 7) * per_position
        assert f"needs {needed} bytes" in error.message
        assert f"the {budget} bytes each stage gives (kv_budget_bytes): at most 6 new tokens fit" in error.message
        assert controller.waiting() == 0
        assert controller.pipeline.idle()
        with pytest.raises(openai.BadRequestError) as refused:  # a prompt alone over the budget: its messages
            client.chat.completions.create(model="text", messages=[{"role": "user", "content": PROMPT * 3}],
                                           max_tokens=1)
        assert (refused.value.code, refused.value.param) == ("kv_budget_exceeded", "messages")
        served = client.completions.create(model="text", prompt=prompt, max_tokens=6, n=3, temperature=0)
    ids = torch.tensor([prompt])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)[0, len(prompt):]
    end = next((index + 1 for index, token in enumerate(want.tolist()) if token == 2), len(want))
    assert [choice.token_ids for choice in served.choices] == [want[:end].tolist()] * 3
