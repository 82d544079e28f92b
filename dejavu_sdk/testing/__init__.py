"""Conformance suites shipped with the SDK, so every backend (ours and third parties') passes the same tests.

    from dejavu_sdk.testing import StoreTests

Needs pytest and hypothesis (extra: dev).
"""

from ..tensors import random_tensor, same_bits
from .stores import StoreTests

__all__ = ["StoreTests", "random_tensor", "same_bits"]
