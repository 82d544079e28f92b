"""The Ray launcher on a one-node Ray started here: stage workers as Ray actors, a dead one replaced by a new
actor, and the controller as an actor too, restarted by Ray from its journal."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import expectations
import httpx
import openai
import pytest
import ray
import torch
from resuming_clients import ResumingClient
from test_recovery import NEW, _expected, _stage_pid, _wait_for_recoveries, _wait_for_steps

from dejavu_sdk.cluster.ray import RayWorkers, serve_on_ray
from dejavu_sdk.errors import ConfigError
from dejavu_sdk.serving import Pipeline

TESTS = str(Path(__file__).parent)


@pytest.fixture(scope="module")
def one_node_ray():
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": TESTS}},
             log_to_driver=False)
    yield
    ray.shutdown()


def _is_ray_actor(pid: int) -> bool:
    """Ray names its actor processes `ray::<class>`."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::_StageWorkerActor")


@pytest.mark.slow
def test_stage_workers_are_ray_actors_and_a_killed_one_is_replaced_by_a_new_actor(one_node_ray) -> None:
    prompts = expectations.prompts(4, seed=14)
    with Pipeline("tiny_models:llama", prompt_stages=1, token_stages=2, microbatch=2, heartbeat=0.5,
                  recovery="replicas", batching="static", launch=RayWorkers(host="127.0.0.1")) as pipe:
        assert all(_is_ray_actor(stage["pid"]) for stage in pipe.status()["stages"])
        victim = _stage_pid(pipe, "token stage 1")
        futures = pipe.submit_all(prompts, NEW)
        _wait_for_steps(pipe, 30)
        os.kill(victim, signal.SIGKILL)
        _wait_for_recoveries(pipe, 1)
        results = [future.result(timeout=120) for future in futures]
        replacement = _stage_pid(pipe, "token stage 1")
        assert replacement != victim
        assert _is_ray_actor(replacement)  # a new actor, started by the launcher
        (report,) = pipe.recoveries
        assert report.resumed
        pad, eos = pipe.pad, pipe.eos
    expected = _expected(results, prompts, pad, eos, {})
    assert all(torch.equal(result.tokens, want) for result, want in zip(results, expected, strict=True))


@pytest.mark.slow
@pytest.mark.matrix  # the costliest test (2-3 minutes): stage actors replaced by Ray stay in the slow tier
def test_the_controller_actor_killed_is_restarted_by_ray_and_goes_on_from_its_journal(one_node_ray, tmp_path) -> None:
    """The controller serves from a Ray actor (its token asked for, its stages alive); killed, Ray starts it
    again, and it goes on with every request from its journal."""
    with pytest.raises(ConfigError, match="journal"):
        serve_on_ray("tiny_models:llama_text", max_restarts=1, port=8123)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    served = serve_on_ray("tiny_models:llama_text", stages=1, microbatch=4, port=port, host="127.0.0.1",
                          journal=f"file://{tmp_path}/journal", max_restarts=1)
    try:
        assert [stage["alive"] for stage in served.status()["stages"]] == [True]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=served.url + "/v1", api_key="guess", max_retries=0).models.list()
        bodies = [{"model": "tiny_models:llama_text", "prompt": [9 + client, 4, 5], "max_tokens": 40,
                   "ignore_eos": True, "temperature": 1.0 if client % 2 else 0, "seed": 70 + client}
                  for client in range(4)]
        headers = {"Authorization": f"Bearer {served.token}"}
        expected = [httpx.post(served.url + "/v1/completions", json=body, headers=headers,
                               timeout=120).json()["choices"][0]["token_ids"] for body in bodies]
        progress = [0] * len(bodies)
        clients = [ResumingClient(served.url, served.token, body, progress, slot) for slot, body in enumerate(bodies)]
        for client in clients:
            client.start()
        deadline = time.monotonic() + 120
        while sum(progress) < 12:
            assert time.monotonic() < deadline, "the clients got no tokens"
            time.sleep(0.005)
        ray.kill(served.actor, no_restart=False)  # its process dies; Ray starts it again
        for client in clients:
            client.join(timeout=300)
        for slot, client in enumerate(clients):
            assert client.error is None, f"client {slot}: {client.error!r}"
            assert client.tokens == expected[slot], f"client {slot} (reconnected {client.reconnects} times)"
        assert sum(client.reconnects for client in clients) > 0
        assert served.status()["adopted"]["going_on"]  # the restarted actor took the requests over
    finally:
        served.close()
