"""dejavu-sdk: fast, fault-tolerant LLM serving by streaming the KV cache.

    import dejavu_sdk as dv
    store = dv.open_store("lmdb:///var/kv")
    key = dv.BlockKey("req-1", layers=(0, 1), tokens=(0, 512))
    store.flush(key, kv_block); again = store.fetch(key)

    engine = dv.DejaVuEngine(model, store="lmdb:///var/kv")
    out = engine.generate(input_ids, attention_mask=mask, max_new_tokens=256, stream_id="req-1")
    out = dv.DejaVuEngine(model, store="lmdb:///var/kv").resume("req-1")    # after a crash, in a new process

    remote = dv.open_store("tcp://10.0.0.2:7000")    # a `dejavu serve-store` process's CPU memory
    link = dv.open_transport("tcp://10.0.0.2:7001")  # or move blocks and activations to a peer directly

    with dv.Pipeline("smollm2", stages=2, microbatch=4) as pipe:    # stage processes, serving microbatches
        outs = pipe.generate([ids_a, ids_b], max_new_tokens=64)
"""

from ._version import __version__
from .backends import open_store, open_transport, serve
from .blocks import BlockKey, KVSpec, ProgressKey
from .errors import (
    AccessDenied,
    BackendUnavailable,
    BlockNotFound,
    ConfigError,
    CorruptBlock,
    DejaVuError,
    JournalInUse,
    ReplicationError,
    RequestFailed,
    RequestTooLarge,
    ServerBusy,
    StoreClosed,
    StoreError,
    TransportError,
)
from .planner import Plan, plan
from .prefix import PrefixCache
from .records import RecordStore
from .store import Store
from .transports import Transport

# These import transformers: only on first use.
_LAZY = {"DejaVuEngine": "engine", "load_smollm2": "models", "Pipeline": "serving", "Controller": "controller"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "AccessDenied",
    "BackendUnavailable",
    "BlockKey",
    "BlockNotFound",
    "ConfigError",
    "Controller",
    "CorruptBlock",
    "DejaVuEngine",
    "DejaVuError",
    "JournalInUse",
    "KVSpec",
    "Pipeline",
    "Plan",
    "PrefixCache",
    "ProgressKey",
    "RecordStore",
    "ReplicationError",
    "RequestFailed",
    "RequestTooLarge",
    "ServerBusy",
    "Store",
    "StoreClosed",
    "StoreError",
    "Transport",
    "TransportError",
    "__version__",
    "load_smollm2",
    "open_store",
    "open_transport",
    "plan",
    "serve",
]
