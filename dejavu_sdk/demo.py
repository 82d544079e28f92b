"""`dejavu demo`: replicate a KV cache to a store block by block, reopen the store, and verify every byte.

The cache has the geometry of SmolLM2-135M (30 layers, 3 KV heads of 64, bfloat16): one block per layer
for the prompt, as prefill would stream it, then one block per decode step over all layers.
"""

from __future__ import annotations

import tempfile
import time

import torch
from tqdm import tqdm

from .blocks import BlockKey, KVSpec
from .stores import open_store
from .tensors import random_tensor, same_bits

SPEC = KVSpec(layers=30, kv_heads=3, head_dim=64, dtype="bfloat16")


def _blocks(stream_id: str, prompt_length: int, new_tokens: int) -> list[tuple[BlockKey, torch.Tensor]]:
    cache = random_tensor((SPEC.layers, 2, 1, SPEC.kv_heads, prompt_length + new_tokens, SPEC.head_dim),
                          SPEC.torch_dtype, seed=0)
    prompt = [(BlockKey.for_prompt_layer(stream_id, layer, prompt_length),
               cache[layer:layer + 1, :, :, :, :prompt_length]) for layer in range(SPEC.layers)]
    positions = range(prompt_length, prompt_length + new_tokens)
    steps = [(BlockKey.for_decode_steps(stream_id, (0, SPEC.layers), position),
              cache[:, :, :, :, position:position + 1]) for position in positions]
    return prompt + steps


def run_demo(store_url: str | None = None, prompt_length: int = 512, new_tokens: int = 128) -> bool:
    """Run the demo and print a summary; True when every block came back identical."""
    with tempfile.TemporaryDirectory(prefix="dejavu-demo-") as scratch:
        url = store_url or f"lmdb://{scratch}/kv"
        blocks = _blocks("demo", prompt_length, new_tokens)
        total = sum(block.numel() * block.element_size() for _, block in blocks)
        print(f"Replicating a {SPEC.layers}-layer KV cache ({prompt_length} prompt + {new_tokens} generated "
              f"tokens, {total / 2**20:.1f} MiB in {len(blocks)} blocks) to {url}")
        store = open_store(url)
        store.delete("demo")
        start = time.perf_counter()
        for key, block in tqdm(blocks, desc="flush", unit="block"):
            store.flush(key, block)
        flush_seconds = time.perf_counter() - start
        if store.persistent:  # read through a fresh handle, as a recovering process would
            store.close()
            store = open_store(url)
        with store:
            start = time.perf_counter()
            identical = len(store.keys("demo")) == len(blocks) and all(
                same_bits(store.fetch(key), block) for key, block in tqdm(blocks, desc="fetch", unit="block"))
            fetch_seconds = time.perf_counter() - start
            store.delete("demo")
    print(f"flush: {total / flush_seconds / 1e6:,.0f} MB/s   fetch and verify: {total / fetch_seconds / 1e6:,.0f} MB/s")
    print("Every block came back bit for bit." if identical else "MISMATCH: blocks differ after the round trip.")
    return identical
