"""Test support shipped with the SDK, so every backend (ours and third parties') passes the same tests.

    from dejavu_sdk.testing import StoreTests, TransportTests

    stores.py       StoreTests: the conformance suite of every store backend (and a Store over a transport)
    transports.py   TransportContractTests (every transport, `local` too), TransportFailureTests (peers
                    that die or hang), and TransportTests, both together, for networked transports
    stateful.py     a Hypothesis state machine that checks a store against a plain dict
    security.py     ServerSecurityTests: tokens, tenants, connection floods, full inboxes, malformed names
    peers.py        ServedStoreProcess: `dejavu serve-store` in a child process, to kill or to time
    certificates.py self_signed_certificate: a throwaway TLS certificate for loopback
    frames.py       wire messages as bytes, for tests that speak to a server over a plain socket

The suites need pytest and hypothesis (extra: dev); `peers` and the tensor helpers need neither, so
benchmarks can use them. Names are imported on first use.
"""

from __future__ import annotations

import importlib

_MODULES = {
    "StoreTests": ".stores",
    "TransportContractTests": ".transports",
    "TransportFailureTests": ".transports",
    "TransportTests": ".transports",
    "ServedStoreProcess": ".peers",
    "ServerSecurityTests": ".security",
    "self_signed_certificate": ".certificates",
    "random_tensor": "..tensors",
    "same_bits": "..tensors",
}

__all__ = ["ServedStoreProcess", "ServerSecurityTests", "StoreTests", "TransportContractTests",
           "TransportFailureTests", "TransportTests", "random_tensor", "same_bits", "self_signed_certificate"]


def __getattr__(name: str) -> object:
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
