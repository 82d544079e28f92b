"""Replica stores: where KV blocks live. Choose one by URL with `open_store`, or build one directly.

    memory://            MemoryStore   this process's CPU memory (pinned when CUDA is present)
    lmdb:///path         LmdbStore     LMDB on local disk (extra: lmdb)
    file:///path, s3://bucket/prefix, fsspec+memory://name, any fsspec protocol
                         FsspecStore   object storage and files through fsspec (s3 needs the extra: s3)
    tcp://host:port, ucx://host:port
                         RemoteStore   a store another process serves (`dejavu serve-store`)

Backend classes are imported lazily, so `import dejavu_sdk.stores` pulls in no optional dependency.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..registry import Backend, Registry, call_with_options
from ..urls import FSSPEC_PREFIX, ParsedURL, parse_url
from .base import Store

STORES = Registry(
    "store",
    "dejavu_sdk.stores",
    {
        "memory": Backend("dejavu_sdk.stores.memory:MemoryStore"),
        "lmdb": Backend("dejavu_sdk.stores.lmdb_store:LmdbStore", extra="lmdb"),
        "tcp": Backend("dejavu_sdk.stores.remote:RemoteStore"),
        "ucx": Backend("dejavu_sdk.stores.remote:RemoteStore", extra="ucx"),
    },
)
_FSSPEC = Backend("dejavu_sdk.stores.fsspec_store:FsspecStore")
_LAZY = {"MemoryStore": "memory", "LmdbStore": "lmdb", "RemoteStore": "tcp"}

__all__ = ["STORES", "FsspecStore", "LmdbStore", "MemoryStore", "RemoteStore", "Store", "open_store"]


def open_store(store: str | Store, **options: Any) -> Store:
    """Open the store a URL names, with backend `options`; a ready `Store` is returned as it is.

    Options a backend would not use are an error, as are options given together with a ready store.
    """
    if isinstance(store, Store):
        if options:
            raise ConfigError(f"options {sorted(options)} apply only when the store is given as a URL, not {store!r}")
        return store
    url = parse_url(store)
    backend = _backend_for(url)
    store_class = STORES.load(url.scheme, backend)
    return call_with_options(store_class.from_url, f"{url.scheme}:// stores", options, url)


def _backend_for(url: ParsedURL) -> Backend:
    if url.scheme.startswith(FSSPEC_PREFIX):
        return _FSSPEC
    found = STORES.find(url.scheme)
    if found is not None:
        return found
    import fsspec

    if url.scheme in fsspec.available_protocols():
        return _FSSPEC
    raise ConfigError(
        f"unknown store scheme {url.scheme!r} in {url.text!r}; use one of "
        f"{', '.join(s + '://' for s in STORES.names())} or any fsspec protocol (file://, s3://, gs://, ...)"
    )


def __getattr__(name: str) -> type:
    if name in _LAZY:
        scheme = _LAZY[name]
        return STORES.load(scheme, STORES.builtins[scheme])
    if name == "FsspecStore":
        return STORES.load("fsspec", _FSSPEC)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
