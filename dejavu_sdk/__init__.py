"""dejavu-sdk: fast, fault-tolerant LLM serving by streaming the KV cache.

    import dejavu_sdk as dv
    store = dv.open_store("lmdb:///var/kv")
    key = dv.BlockKey("req-1", layers=(0, 1), tokens=(0, 512))
    store.flush(key, kv_block); again = store.fetch(key)
"""

from ._version import __version__
from .blocks import BlockKey, KVSpec
from .errors import (
    BackendUnavailable,
    BlockNotFound,
    ConfigError,
    CorruptBlock,
    DejaVuError,
    ReplicationError,
    StoreClosed,
    StoreError,
    TransportError,
)
from .stores import Store, open_store

__all__ = [
    "BackendUnavailable",
    "BlockKey",
    "BlockNotFound",
    "ConfigError",
    "CorruptBlock",
    "DejaVuError",
    "KVSpec",
    "ReplicationError",
    "Store",
    "StoreClosed",
    "StoreError",
    "TransportError",
    "__version__",
    "open_store",
]
