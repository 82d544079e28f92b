"""The OpenAI front door with prompt prefixes: a request that finds its prompt's chunks reports them as OpenAI
reports cached tokens (`usage.prompt_tokens_details.cached_tokens`) and answers as the request that computed them
did; each client token's chunks are its own, a body's `cache_salt` names a tenant of its choice, and `/metrics`
counts the tokens read and each stage's tiers."""

from __future__ import annotations

import urllib.request

import openai
import pytest
import torch

import dejavu_sdk as dv

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("workers_import_tiny_models")]

MODEL = "tiny_models:llama"
CHUNK = 8


def _client(controller, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=controller.url + "/v1", api_key=token, max_retries=0, timeout=120)


def _complete(client: openai.OpenAI, prompt: list[int], **extra) -> tuple[list[int], int]:
    """The answer's token ids, and the prompt positions it read from the prefixes."""
    answer = client.completions.create(model=MODEL, prompt=[prompt], max_tokens=4, temperature=0,
                                       extra_body=extra or None)
    return answer.choices[0].token_ids, answer.usage.prompt_tokens_details.cached_tokens


def _metrics(controller) -> dict[str, float]:
    """`GET /metrics`, each sample by its name and labels."""
    request = urllib.request.Request(controller.url + "/metrics", headers={"Authorization": "Bearer tenant-a"})
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = response.read().decode().splitlines()
    return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in lines if not line.startswith("#")}


def test_cached_tokens_are_reported_and_tenants_are_kept_apart() -> None:
    prompt = torch.randint(1, 90, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    with dv.Controller(MODEL, stages=2, microbatch=2, port=0, timeout=60, token="tenant-a", tokens=["tenant-b"],
                       prefix_cache="memory://", prefix_chunk=CHUNK, max_prefill_tokens=CHUNK) as controller:
        first, second = _client(controller, "tenant-a"), _client(controller, "tenant-b")
        cold, cold_read = _complete(first, prompt)
        warm, warm_read = _complete(first, prompt)
        other, other_read = _complete(second, prompt)  # tenant b's own chunks: none yet
        _complete(first, prompt, cache_salt="shared")
        shared, shared_read = _complete(second, prompt, cache_salt="shared")
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            _complete(first, prompt, cache_salt=7)
        metrics = _metrics(controller)
    assert (cold_read, warm_read, other_read, shared_read) == (0, 24, 0, 24)
    assert metrics["dejavu_prompt_tokens_cached_total"] == 48.0
    for stage in ("stage 0", "stage 1"):  # each stage kept its layers' 3 chunks under each of 3 salts
        assert metrics[f'dejavu_prefix_cache_writes_total{{stage="{stage}",tier="memory://"}}'] == 9.0
        assert metrics[f'dejavu_prefix_cache_chunks{{stage="{stage}",tier="memory://"}}'] == 9.0
    assert metrics['dejavu_prefix_cache_misses_total{stage="stage 0",tier="memory://"}'] == 3.0  # one per salt
    assert warm == cold
    assert other == cold
    assert shared == cold
