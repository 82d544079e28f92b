"""A Hypothesis state machine that runs random flush/fetch/delete/keys sequences against a plain dict."""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from ..blocks import BlockKey
from ..errors import BlockNotFound
from ..store import Store
from ..tensors import random_tensor, same_bits

STREAMS = st.sampled_from(["a", "b", "a.b", "a-1"])
RANGES = st.tuples(st.integers(0, 3), st.integers(1, 3)).map(lambda p: (p[0], p[0] + p[1]))
KEYS = st.builds(lambda s, layers, tokens: BlockKey(s, layers=layers, tokens=tokens), STREAMS, RANGES, RANGES)
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool])
SHAPES = st.lists(st.integers(0, 5), max_size=4).map(tuple)


class StoreStateMachine(RuleBasedStateMachine):
    """The store must behave like a dict from keys to tensors."""

    store_factory: Callable[[], Store]

    def __init__(self) -> None:
        super().__init__()
        self.store = self.store_factory()
        self.model: dict[BlockKey, torch.Tensor] = {}

    @rule(key=KEYS, shape=SHAPES, dtype=DTYPES, seed=st.integers(0, 2**16))
    def flush(self, key: BlockKey, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> None:
        block = random_tensor(shape, dtype, seed)
        self.store.flush(key, block)
        self.model[key] = block

    @rule(key=KEYS)
    def fetch(self, key: BlockKey) -> None:
        if key in self.model:
            assert same_bits(self.store.fetch(key), self.model[key])
        else:
            try:
                self.store.fetch(key)
            except BlockNotFound:
                return
            raise AssertionError(f"{key} was never flushed or was deleted, yet fetch returned it")

    @rule(stream=STREAMS)
    def delete(self, stream: str) -> None:
        doomed = [key for key in self.model if key.stream_id == stream]
        assert self.store.delete(stream) == len(doomed)
        for key in doomed:
            del self.model[key]

    @invariant()
    def keys_match(self) -> None:
        assert self.store.keys() == sorted(self.model)

    def teardown(self) -> None:
        self.store.close()


def run_store_state_machine(store_factory: Callable[[], Store], max_examples: int = 20) -> None:
    """Run the state machine on fresh stores from `store_factory` (each call must give an empty store)."""
    machine = type("StoreStateMachineUnderTest", (StoreStateMachine,), {"store_factory": staticmethod(store_factory)})
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=max_examples, stateful_step_count=15, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )
