"""A streaming client as a resilient application writes one: it streams its completion, and when the connection
breaks it reconnects with its last event id (`GET /v1/requests/<id>/stream`, `Last-Event-ID`), or sends the
request again if the server never heard of it, until its stream ends."""

from __future__ import annotations

import json
import threading
import time

import httpx


class ResumingClient(threading.Thread):
    """Streams `body` to the controller at `url` with `token`, reconnecting until the stream's end (`[DONE]`);
    `tokens`, their `logprobs` (when it asks) and `finish` are what it got (`choices`: each choice's tokens, with
    `n`), `progress[slot]` its token count as it goes, `reconnects` how often its connection broke."""

    def __init__(self, url: str, token: str, body: dict, progress: list[int], slot: int, within: float = 240) -> None:
        super().__init__(daemon=True)
        self.url, self.token, self.body, self.within = url, token, body, within
        self.progress, self.slot = progress, slot
        self.tokens: list[int] = []
        self.choices: dict[int, list[int]] = {}
        self.done = False
        self.logprobs: list[float] = []
        self.request_id: str | None = None
        self.last: str | None = None
        self.finish: str | None = None
        self.reconnects = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            deadline = time.monotonic() + self.within
            while not self.done:
                assert time.monotonic() < deadline, f"client {self.slot} did not finish in {self.within} s"
                try:
                    self._attempt()
                except (httpx.HTTPError, OSError):
                    self.reconnects += 1
                    time.sleep(0.2)
        except BaseException as error:
            self.error = error

    def _attempt(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        if self.request_id is None:
            method, url, extra = "POST", f"{self.url}/v1/completions", {"json": {**self.body, "stream": True}}
        else:
            method, url, extra = "GET", f"{self.url}/v1/requests/{self.request_id}/stream", {}
            if self.last is not None:
                headers["Last-Event-ID"] = self.last
        with httpx.stream(method, url, headers=headers, timeout=30, **extra) as response:
            if response.status_code == 404 and not self.tokens:  # admitted, but not journaled: send it again
                self.request_id = None
                return
            if response.status_code in (502, 503):
                raise httpx.HTTPError(f"{response.status_code}: not serving yet")
            assert response.status_code == 200, response.read()
            self.request_id = response.headers["X-Dejavu-Request-Id"]
            event_id = None
            for line in response.iter_lines():
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    for choice in chunk["choices"]:
                        self.tokens += choice["token_ids"]
                        self.choices.setdefault(choice["index"], []).extend(choice["token_ids"])
                        self.logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
                        self.progress[self.slot] = len(self.tokens)
                        self.finish = choice["finish_reason"] or self.finish
                    self.last = event_id
