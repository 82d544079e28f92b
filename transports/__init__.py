"""Transports: how KV blocks and activations move between live workers. Choose one by name or URL.

    tcp://host:port     TcpTransport    sockets, zero-copy receive, timeouts, per-link reconnect
    ucx://host:port     UcxTransport    UCX through ucxx: tcp, shared memory, RDMA, GPU memory (extra: ucx)
    nccl://host:port    DistTransport   torch.distributed point to point: NCCL with CUDA, gloo without
    gloo://host:port    DistTransport   the same, gloo forced
    local               LocalTransport  device<->host copies into a store in this process

`open_transport(url)` connects to a peer; `serve(url, store)` serves a store for peers to connect to.
Backend modules are imported lazily, so an unused backend's dependency need not be installed.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..registry import Backend, Registry, call_with_options
from ..stores import Store, open_store
from ..urls import parse_url
from .base import Server, Transport

TRANSPORTS = Registry(
    "transport",
    "dejavu_sdk.transports",
    {
        "tcp": Backend("dejavu_sdk.transports.tcp:TcpTransport"),
        "ucx": Backend("dejavu_sdk.transports.ucx:UcxTransport", extra="ucx"),
        "nccl": Backend("dejavu_sdk.transports.dist:DistTransport"),
        "gloo": Backend("dejavu_sdk.transports.dist:DistTransport"),
        "local": Backend("dejavu_sdk.transports.local:LocalTransport"),
    },
)

__all__ = ["TRANSPORTS", "Server", "Transport", "open_transport", "serve"]


def _transport_class(text: str) -> tuple[Any, type]:
    url = parse_url(text if "://" in text else f"{text}://")
    backend = TRANSPORTS.find(url.scheme)
    if backend is None:
        raise ConfigError(f"unknown transport {url.scheme!r} in {text!r}; use one of "
                          f"{', '.join(TRANSPORTS.names())}")
    return url, TRANSPORTS.load(url.scheme, backend)


def open_transport(transport: str | Transport, **options: Any) -> Transport:
    """Connect to the peer a URL names (`tcp://host:port`, ...) or open `local`; a Transport passes through."""
    if isinstance(transport, Transport):
        if options:
            raise ConfigError(f"options {sorted(options)} apply only when the transport is given as a URL")
        return transport
    if not isinstance(transport, str):
        raise ConfigError(f"expected a transport URL or name, got {transport!r}")
    url, transport_class = _transport_class(transport)
    return call_with_options(transport_class.from_url, f"{url.scheme} transports", options, url)


def serve(url: str, store: str | Store = "memory://", **options: Any) -> Server:
    """Serve `store` (a URL or a Store) to peers at `url` until the returned Server is closed."""
    parsed, transport_class = _transport_class(url)
    if not hasattr(transport_class, "serve"):
        raise ConfigError(f"{parsed.scheme} transports connect within one process and serve no peers")
    return call_with_options(transport_class.serve, f"{parsed.scheme} servers", options, parsed, open_store(store))
