"""A store whose writes fail as a full disk fails them (`StoreError` from `put_progress`), while `failing` is set or
once `fail_after` more writes have gone through; reads go on. `patch_journal_store` makes a journal opened on a URL
(`dv.Controller(journal=...)`, `Journal(...)`) write through one."""

from __future__ import annotations

import threading

import pytest

import dejavu_sdk as dv
from dejavu_sdk.blocks import ProgressKey
from dejavu_sdk.controller import journal as journal_module
from dejavu_sdk.errors import StoreError
from dejavu_sdk.store import Store


class FailingStore(Store):
    """`records`' store, whose progress records fail to be written while `failing` is set."""

    def __init__(self, store: Store, fail_after: int | None = None) -> None:
        super().__init__(store.records)
        self.failing = threading.Event()
        self.fail_after = fail_after
        self.failed = 0

    def put_progress(self, progress: ProgressKey, record: bytes) -> None:
        if self.fail_after is not None:
            if self.fail_after <= 0:
                self.failing.set()
            self.fail_after -= 1
        if self.failing.is_set():
            self.failed += 1
            raise StoreError(f"LMDB store at {self.url!r}: mdb_txn_commit: Input/output error")
        super().put_progress(progress, record)


def patch_journal_store(monkeypatch: pytest.MonkeyPatch, url: str, fail_after: int | None = None) -> FailingStore:
    """The failing store a journal opened on `url` writes through."""
    store = FailingStore(dv.open_store(url), fail_after)
    monkeypatch.setattr(journal_module, "open_store", lambda opened: store if opened == url else dv.open_store(opened))
    return store
