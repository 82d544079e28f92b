"""Where a controller's journal lives in its store: its records (progress records of the stream `JOURNAL_STREAM`,
a run id per controller that sorts by its start), read from the last snapshot on, and removed before a snapshot or
when the journal starts afresh; and the check that refuses an LMDB journal whose data file lost what it held."""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from typing import Any

from ..backends import open_store
from ..blocks import ProgressKey
from ..errors import ConfigError
from ..store import Store
from ..urls import parse_url

log = logging.getLogger(__name__)

#: The stream id the journal's records live under.
JOURNAL_STREAM = "dejavu-journal"


def read_records(url: str | Store) -> list[dict[str, Any]]:
    """The journal's records from its last snapshot on, in the order they were written."""
    store = open_store(url)
    try:
        keys = store.progress_keys(JOURNAL_STREAM)
        snapshots = [index for index, key in enumerate(keys) if key.log > 0 and key.step == 0]
        return [json.loads(store.read_progress(key)) for key in keys[snapshots[-1] if snapshots else 0:]]
    finally:
        if isinstance(url, str):
            store.close()


def new_run(store: Store) -> str:
    """A run id for a new controller's records: it sorts after every run before it (by its start, or past the last
    run's when this clock is behind)."""
    runs = [key.run for key in store.progress_keys(JOURNAL_STREAM)]
    start = max(time.time_ns() // 1_000_000, max((int(run[:12], 16) + 1 for run in runs), default=0))
    return f"{start:012x}{secrets.token_hex(4)}"


def discard_records(store: Store) -> None:
    """Remove every record of the journal: it starts afresh."""
    for run in {key.run for key in store.progress_keys(JOURNAL_STREAM)}:
        store.remove_progress(JOURNAL_STREAM, run)


def remove_before(store: Store, snapshot: ProgressKey) -> None:
    """Remove every record before `snapshot` (its own run's earlier logs, and every earlier run)."""
    for run in sorted({older.run for older in store.progress_keys(JOURNAL_STREAM) if older < snapshot}):
        store.remove_progress(JOURNAL_STREAM, run, below_log=snapshot.log if run == snapshot.run else None)


def check_data_file(url: str, reset: bool) -> None:
    """Refuse an LMDB journal whose data file is empty (LMDB writes 8 KiB into a new one at once: an empty one
    lost what it held), unless `reset` starts it afresh."""
    if parse_url(url).scheme != "lmdb":
        return
    data = os.path.join(parse_url(url).path, "data.mdb")
    if os.path.isfile(data) and os.path.getsize(data) == 0:
        if not reset:
            raise ConfigError(f"the journal {url!r} is empty where one was expected: {data} is 0 bytes (its records "
                              "were lost: a full disk, a copy that failed?); restore it, or pass --journal-reset "
                              "(journal_reset=True) to start an empty journal there")
        log.warning("the journal's data file %s is 0 bytes: starting an empty journal there (journal_reset)", data)
        os.remove(data)  # LMDB starts a new one
