"""One controller writes a journal at a time: a second one opened on a live journal is refused (JournalInUse;
`dejavu serve` exits with status 2 and a one-line reason), a successor takes over once the holder's lease lapses
or at once with `take_over` (the holder, finding its lease taken, writes no more and fails closed). A journal that
lost its records (an LMDB data file of 0 bytes, records without their head) is refused unless reset."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dejavu_sdk as dv
from dejavu_sdk.controller.journal import Journal, read_journal

TESTS = str(Path(__file__).parent)


def test_a_journal_whose_lease_is_renewed_is_refused_and_one_released_is_taken_at_once(tmp_path) -> None:
    url = f"lmdb://{tmp_path}/journal"
    first = Journal(url, lease=1.0)
    try:
        began = time.monotonic()
        with pytest.raises(dv.JournalInUse, match=r"serves from this journal.*--take-over-journal"):
            Journal(url, lease=1.0)
        assert time.monotonic() - began < 1.5  # within the holder's lease: a renewal was seen
    finally:
        first.close()  # released
    began = time.monotonic()
    second = Journal(url, lease=1.0)
    assert time.monotonic() - began < 0.5
    assert second.lease_seconds == 0.0
    second.close()


def test_a_successor_takes_a_journal_whose_holder_stopped_renewing_once_its_lease_lapsed(tmp_path) -> None:
    url = f"lmdb://{tmp_path}/journal"
    first = Journal(url, lease=1.0, interval=0.0)
    first.admitted("cmpl-1", {"choices": []})
    assert first.flush()
    first._entries.put(None)  # its writer stops, as a controller killed: no renewal, no release
    first._thread.join(timeout=10)
    second = Journal(url, lease=1.0)
    try:
        assert second.lease_seconds >= 0.5  # it watched the lease (half of it at least) before taking it
        assert list(second.found.requests) == ["cmpl-1"]
        assert second.lease.record.epoch == first.lease.record.epoch + 1
    finally:
        second.close()
        first.store.close()


def test_taking_a_journal_over_fences_its_holder_which_sends_nothing_more(tmp_path) -> None:
    url = f"lmdb://{tmp_path}/journal"
    holder = Journal(url, lease=0.4, interval=0.0)
    holder.admitted("cmpl-1", {"choices": []})
    assert holder.flush()
    successor = Journal(url, lease=0.4, take_over=True)
    try:
        assert successor.lease_seconds == 0.0
        deadline = time.monotonic() + 10
        while not holder.fenced:  # its next renewal finds the lease taken
            assert time.monotonic() < deadline, "the holder did not find its lease taken"
            time.sleep(0.02)
        told = []
        holder.when_written(holder.token("cmpl-1", 0, 0, 7), told.append)
        assert told == [False]  # never written: never sent
        state, why = holder.health()
        assert state == "journal_failed"
        assert "took the journal" in why
        successor.token("cmpl-1", 0, 0, 9)
        assert successor.flush()
        assert read_journal(successor.store)["cmpl-1"].tokens == {0: [9]}  # the successor's, not the holder's
    finally:
        successor.close()
        holder.close()


def test_a_journal_that_lost_its_records_is_refused_unless_reset(tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "data.mdb").write_bytes(b"")  # a full disk, a copy that failed
    with pytest.raises(dv.ConfigError, match=r"0 bytes.*--journal-reset"):
        Journal(f"lmdb://{empty}")
    with pytest.raises(dv.ConfigError, match=r"0 bytes.*--journal-reset"):
        dv.Controller("tiny_models:llama", journal=f"lmdb://{empty}")  # before anything starts
    Journal(f"lmdb://{empty}", reset=True).close()
    assert (empty / "data.mdb").stat().st_size > 0
    Journal(f"lmdb://{empty}").close()  # an LMDB journal again
    headless = f"lmdb://{tmp_path}/headless"
    store = dv.open_store(headless)
    store.put_progress(dv.ProgressKey("dejavu-journal", "0123456789ab00000001", 0, 5),
                       b'{"token": [["cmpl-1", 0, 3, 42]]}')  # what follows a head that is gone
    store.close()
    with pytest.raises(dv.ConfigError, match="not the head record"):
        Journal(headless)
    journal = Journal(headless, reset=True)
    assert journal.found.requests == {}
    journal.close()
    assert read_journal(headless) == {}


def _serve(journal: str, tmp_path: Path, name: str) -> subprocess.Popen:
    """`dejavu serve` on `journal`, its stderr in the file `name` (its workers stop as soon as it dies)."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
    with open(tmp_path / name, "w") as errors:
        return subprocess.Popen([sys.executable, "-m", "dejavu_sdk.cli", "serve", "--model", "tiny_models:llama",
                                 "--listen", "127.0.0.1:0", "--journal", journal, "--journal-lease", "1",
                                 "--orphan-timeout", "0"], stdout=subprocess.PIPE, stderr=errors, text=True,
                                env=environment)


def _serving(process: subprocess.Popen) -> None:
    line = process.stdout.readline()
    assert re.search(r"serving .* at http://127\.0\.0\.1:\d+/v1", line), (line, process.poll())


@pytest.mark.slow
def test_a_second_dejavu_serve_on_a_live_journal_exits_with_a_clear_error_and_a_successor_takes_over(
        tmp_path) -> None:
    journal = f"lmdb://{tmp_path}/journal"
    first = _serve(journal, tmp_path, "first")
    processes = [first]
    try:
        _serving(first)
        second = _serve(journal, tmp_path, "second")
        processes.append(second)
        assert second.wait(timeout=120) == 2
        last = (tmp_path / "second").read_text().strip().splitlines()[-1]
        assert re.fullmatch(r"dejavu: error: another controller \(pid \d+ on .+\) serves from this journal: .*"
                            r"--take-over-journal.*", last), last
        os.kill(first.pid, signal.SIGKILL)  # the first dies: a successor takes over once its lease lapsed
        first.wait(timeout=30)
        third = _serve(journal, tmp_path, "third")
        processes.append(third)
        _serving(third)
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            process.stdout.close()
