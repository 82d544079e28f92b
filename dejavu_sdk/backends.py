"""Choosing backends by URL: `open_store`, `open_transport` and `serve`, over two lazy registries.

    open_store("lmdb:///var/kv")        a Store over the record store the URL names (a local backend,
                                        or a transport reaching a store another process serves)
    open_transport("tcp://host:7000")   a connection to a peer; open_transport("local", store=...)
    serve("tcp://0.0.0.0:7000", store)  serve a store to peers until the Server is closed

This module sits above both backend packages: `stores/` and `transports/` know nothing of each other,
and only the chosen backend's module is imported (a missing optional dependency names its extra).
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError
from .records import RecordStore
from .registry import Backend, Registry, call_with_options
from .store import Store
from .transports.base import Server, ServingTransport, Transport
from .urls import FSSPEC_PREFIX, ParsedURL, parse_url

STORES = Registry(
    "store",
    "dejavu_sdk.stores",
    {
        "memory": Backend("dejavu_sdk.stores.memory:MemoryRecords"),
        "lmdb": Backend("dejavu_sdk.stores.lmdb_store:LmdbRecords", extra="lmdb"),
        "tcp": Backend("dejavu_sdk.transports.tcp:TcpTransport"),
        "ucx": Backend("dejavu_sdk.transports.ucx:UcxTransport", extra="ucx"),
    },
)
FSSPEC_STORE = Backend("dejavu_sdk.stores.fsspec_store:FsspecRecords")

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


def open_store(store: str | Store, **options: Any) -> Store:
    """Open the store a URL names, with backend `options`; a ready `Store` is returned as it is.

    Options a backend would not use are an error, as are options given together with a ready store.
    """
    if isinstance(store, Store):
        if options:
            raise ConfigError(f"options {sorted(options)} apply only when the store is given as a URL, not {store!r}")
        return store
    url = parse_url(store)
    records_class: type[RecordStore] = STORES.load(url.scheme, _store_backend(url), RecordStore)
    return Store(call_with_options(records_class.from_url, f"{url.scheme}:// stores", options, url))


def open_transport(transport: str | Transport, **options: Any) -> Transport:
    """Connect to the peer a URL names (`tcp://host:port`, ...), or open `local` (with `store=`, a URL or a
    Store); a ready Transport is returned as it is."""
    if isinstance(transport, Transport):
        if options:
            raise ConfigError(f"options {sorted(options)} apply only when the transport is given as a URL")
        return transport
    if not isinstance(transport, str):
        raise ConfigError(f"expected a transport URL or name, got {transport!r}")
    url, transport_class = _transport_class(transport)
    if isinstance(options.get("store"), str):  # opened here, so closed with the transport
        options["store"] = open_store(options["store"])
        options.setdefault("close_store", True)
    return call_with_options(transport_class.from_url, f"{url.scheme} transports", options, url)


def serve(url: str, store: str | Store = "memory://", **options: Any) -> Server:
    """Serve `store` (a URL or a Store) to peers at `url` until the returned Server is closed.

    A store given as a URL is closed with the server; a Store the caller passed stays open."""
    parsed, transport_class = _transport_class(url)
    if not issubclass(transport_class, ServingTransport):
        raise ConfigError(f"{parsed.scheme} transports connect within one process and serve no peers")
    server: Server = call_with_options(transport_class.serve, f"{parsed.scheme} servers", options, parsed,
                                       open_store(store))
    server.close_store = isinstance(store, str)  # a store opened here from a URL belongs to the server
    return server


def _store_backend(url: ParsedURL) -> Backend:
    if url.scheme.startswith(FSSPEC_PREFIX):
        return FSSPEC_STORE
    found = STORES.find(url.scheme)
    if found is not None:
        return found
    import fsspec

    if url.scheme in fsspec.available_protocols():
        return FSSPEC_STORE
    raise ConfigError(
        f"unknown store scheme {url.scheme!r} in {url.text!r}; use one of "
        f"{', '.join(s + '://' for s in STORES.names())} or any fsspec protocol (file://, s3://, gs://, ...)"
    )


def _transport_class(text: str) -> tuple[ParsedURL, type[Transport]]:
    url = parse_url(text if "://" in text else f"{text}://")
    backend = TRANSPORTS.find(url.scheme)
    if backend is None:
        raise ConfigError(f"unknown transport {url.scheme!r} in {text!r}; use one of "
                          f"{', '.join(TRANSPORTS.names())}")
    return url, TRANSPORTS.load(url.scheme, backend, Transport)
