"""Transport backends: how KV blocks and activations move between live workers.

    tcp://host:port     TcpTransport    sockets, zero-copy receive, timeouts, per-link reconnect
    ucx://host:port     UcxTransport    UCX through ucxx: tcp, shared memory, RDMA, GPU memory (extra: ucx)
    nccl://host:port    DistTransport   torch.distributed point to point: NCCL with CUDA, gloo without
    gloo://host:port    DistTransport   the same, gloo forced
    local               LocalTransport  device<->host copies into a store in this process

`dejavu_sdk.open_transport(url)` connects to a peer and `dejavu_sdk.serve(url, store)` serves a store
for peers to connect to. Backend modules are imported lazily, so an unused backend's dependency need not
be installed.
"""

from __future__ import annotations

import importlib

from .base import Server, ServingTransport, Transport

_MODULES = {"TcpTransport": "tcp", "UcxTransport": "ucx", "DistTransport": "dist", "LocalTransport": "local"}

__all__ = ["DistTransport", "LocalTransport", "Server", "ServingTransport", "TcpTransport", "Transport",
           "UcxTransport"]


def __getattr__(name: str) -> type:
    if name in _MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
