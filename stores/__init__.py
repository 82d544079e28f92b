"""Replica-store backends: where KV blocks live. Each is a `RecordStore`, with a `Store` over it.

    memory://            MemoryRecords   MemoryStore   this process's CPU memory (pinned when CUDA is present)
    lmdb:///path         LmdbRecords     LmdbStore     LMDB on local disk (extra: lmdb)
    file:///path, s3://bucket/prefix, fsspec+memory://name, any fsspec protocol
                         FsspecRecords   FsspecStore   object storage and files through fsspec (s3: extra s3)

`dejavu_sdk.open_store(url)` picks one by URL (and reaches a store in another process through a
transport, `tcp://host:port`). Backend classes are imported lazily, so `import dejavu_sdk.stores` pulls
in no optional dependency.
"""

from __future__ import annotations

import importlib

from ..store import Store

_MODULES = {
    "MemoryRecords": "memory", "MemoryStore": "memory",
    "LmdbRecords": "lmdb_store", "LmdbStore": "lmdb_store",
    "FsspecRecords": "fsspec_store", "FsspecStore": "fsspec_store",
}

__all__ = ["FsspecRecords", "FsspecStore", "LmdbRecords", "LmdbStore", "MemoryRecords", "MemoryStore", "Store"]


def __getattr__(name: str) -> type:
    if name in _MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
