"""`dejavu bench serving`'s controller variants: the one-stage continuous pipeline behind `dv.Controller`, each
request streamed over HTTP by a client of its own, without (`controller`) and with a journal
(`controller-journal`, in LMDB on local disk: every token is written there before its client gets it). Their
ratio is what the journal costs a workload."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

#: The controller variants, and whether each keeps a journal.
CONTROLLERS = {"controller": False, "controller-journal": True}
#: The least tokens/s `controller-journal` should keep of `controller`'s.
JOURNAL_TARGET = 0.98


class ControllerServer:
    """A started controller for one variant (`close` stops it and removes its journal)."""

    def __init__(self, spec: str, variant: str, rows: int, threads: int, max_prefill_tokens: int,
                 transport: str) -> None:
        from ..controller import Controller

        self._folder = tempfile.mkdtemp(prefix="dejavu-bench-journal-") if CONTROLLERS[variant] else None
        journal = None if self._folder is None else f"lmdb://{self._folder}/journal"
        self.controller = Controller(spec, stages=1, batching="continuous", microbatch=rows, threads=threads,
                                     max_prefill_tokens=max_prefill_tokens, transport=transport, timeout=600,
                                     port=0, tokenizer=None, journal=journal, max_waiting=100_000, recovery=None)
        self._http = threading.local()

    def start(self) -> None:
        self.controller.start()

    def serve(self, prompts: list[torch.Tensor], new_tokens: Sequence[int], arrivals: Sequence[float],
              seeds: Sequence[int] | None) -> tuple[float, list[tuple[float, float, int]]]:
        """Each request streamed at its arrival by a client thread of its own; the makespan and each request's
        (first token, last token) seconds from its sending, as its client read them, and its tokens."""
        start = time.monotonic()

        def one(number: int) -> tuple[tuple[float, float, int], float]:
            delay = start + arrivals[number] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            sent = time.monotonic()
            sampled = {} if seeds is None else {"temperature": 1.0, "top_p": 1.0, "seed": seeds[number]}
            body = {"model": self.controller.model_id, "prompt": prompts[number].tolist(), "stream": True,
                    "max_tokens": int(new_tokens[number]), "ignore_eos": True, "temperature": 0, **sampled}
            first, tokens = None, 0
            with self._client().stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        count = sum(len(choice["token_ids"]) for choice in json.loads(line[6:])["choices"])
                        if count and first is None:
                            first = time.monotonic() - sent
                        tokens += count
            done = time.monotonic()
            return (first if first is not None else done - sent, done - sent, tokens), done

        with ThreadPoolExecutor(len(prompts), thread_name_prefix="dejavu-bench-client") as clients:
            answers = list(clients.map(one, range(len(prompts))))
        return max(done for _, done in answers) - start, [served for served, _ in answers]

    def _client(self) -> Any:
        import httpx

        client = getattr(self._http, "client", None)
        if client is None:
            client = self._http.client = httpx.Client(
                base_url=self.controller.url, timeout=600,
                headers={"Authorization": f"Bearer {self.controller.token}"})
        return client

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.controller.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
