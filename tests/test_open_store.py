from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import dejavu_sdk as dv
from dejavu_sdk.backends import STORES
from dejavu_sdk.stores import FsspecRecords, LmdbRecords, MemoryRecords, MemoryStore
from dejavu_sdk.urls import parse_url


@pytest.mark.parametrize(
    ("text", "scheme", "path"),
    [
        ("lmdb:///var/kv", "lmdb", "/var/kv"),
        ("lmdb://kv/store", "lmdb", "kv/store"),
        ("lmdb://./kv", "lmdb", "./kv"),
        ("LMDB:///var/kv", "lmdb", "/var/kv"),
        ("file:///tmp/blocks", "file", "/tmp/blocks"),
        ("s3://bucket/some/prefix", "s3", "bucket/some/prefix"),
        ("fsspec+memory://scratch", "fsspec+memory", "scratch"),
        ("memory://", "memory", ""),
    ],
)
def test_paths_are_split_from_schemes(text: str, scheme: str, path: str) -> None:
    url = parse_url(text)
    assert (url.scheme, url.path) == (scheme, path)


def test_home_is_expanded_in_local_paths() -> None:
    assert parse_url("lmdb://~/kv").path == os.path.expanduser("~/kv")


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [("tcp://127.0.0.1:7000", "127.0.0.1", 7000), ("ucx://[::1]:9", "::1", 9), ("gloo://localhost:0", "localhost", 0)],
)
def test_network_urls_give_host_and_port(text: str, host: str, port: int) -> None:
    url = parse_url(text)
    assert (url.host, url.port) == (host, port)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected a URL"),
        (None, "expected a URL"),
        ("/var/kv", "no scheme"),
        ("kv", "no scheme"),
        ("lmdb://", "needs a path"),
        ("1db://x", "invalid scheme"),
        ("lmdb:///kv?sync=0", "keyword arguments"),
        ("tcp://127.0.0.1", "host:port"),
        ("tcp://127.0.0.1:99999", "host:port"),
        ("tcp://127.0.0.1:7000/path", "host:port"),
    ],
)
def test_malformed_urls_say_what_to_write(text: object, message: str) -> None:
    with pytest.raises(dv.ConfigError, match=message):
        parse_url(text)


def test_open_store_picks_the_backend_by_scheme(tmp_path) -> None:
    assert isinstance(dv.open_store("memory://").records, MemoryRecords)
    store = dv.open_store(f"lmdb://{tmp_path}")
    assert isinstance(store, dv.Store)
    assert isinstance(store.records, LmdbRecords)
    assert store.records.path == str(tmp_path)
    assert isinstance(dv.open_store(f"file://{tmp_path / 'f'}").records, FsspecRecords)


def test_relative_paths_are_relative_to_the_working_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    dv.open_store("lmdb://relative/kv").close()
    assert (tmp_path / "relative" / "kv" / "data.mdb").exists()


@pytest.mark.parametrize(
    ("url", "options", "message"),
    [
        ("memory://", {"sync": False}, "sync would not be used by memory:// stores; it accepts: pin_memory"),
        ("lmdb:///tmp/x", {"storage_options": {}}, "storage_options would not be used"),
        ("file:///tmp/x", {"sync": True}, "sync would not be used"),
    ],
)
def test_options_that_would_go_unused_are_refused(url: str, options: dict, message: str) -> None:
    with pytest.raises(dv.ConfigError, match=message):
        dv.open_store(url, **options)


def test_unknown_schemes_list_the_known_ones() -> None:
    with pytest.raises(dv.ConfigError, match=r"unknown store scheme 'nosuch'.*lmdb://.*memory://"):
        dv.open_store("nosuch://x")


def test_memory_urls_take_no_path() -> None:
    with pytest.raises(dv.ConfigError, match="no path"):
        dv.open_store("memory://somewhere")


def test_a_ready_store_passes_through_but_not_with_options() -> None:
    store = MemoryStore()
    assert dv.open_store(store) is store
    with pytest.raises(dv.ConfigError, match="only when the store is given as a URL"):
        dv.open_store(store, pin_memory=False)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # a Python process of its own
def test_only_the_chosen_backend_is_imported() -> None:
    result = _run("""
        import sys, dejavu_sdk as dv
        dv.open_store("memory://")
        import dejavu_sdk.stores
        loaded = [m for m in ("lmdb", "s3fs", "dejavu_sdk.stores.lmdb_store", "dejavu_sdk.stores.fsspec_store")
                  if m in sys.modules]
        print(loaded)
    """)
    assert result.stdout.strip() == "[]", result.stderr


@pytest.mark.slow  # a Python process of its own
def test_a_missing_dependency_gives_an_install_hint() -> None:
    result = _run("""
        import sys
        sys.modules["lmdb"] = None
        sys.modules["s3fs"] = None
        import dejavu_sdk as dv
        for url in ("lmdb:///tmp/never", "s3://bucket/prefix"):
            try:
                dv.open_store(url)
            except dv.BackendUnavailable as error:
                assert isinstance(error, ImportError)
                print(error.hint)
    """)
    hints = ["pip install 'dejavu-sdk[lmdb]'", "pip install 'dejavu-sdk[s3]'"]
    assert result.stdout.splitlines() == hints, result.stderr


def test_third_party_stores_register_through_entry_points(tmp_path, monkeypatch) -> None:
    package = tmp_path / "kvplugin"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent("""
        from dejavu_sdk.stores.memory import MemoryRecords

        class PluginRecords(MemoryRecords):
            @classmethod
            def from_url(cls, url, *, tag="none"):
                records = cls()
                records.tag = (url.path, tag)
                return records

        class NotRecords:
            @classmethod
            def from_url(cls, url):
                return cls()
    """))
    info = tmp_path / "kvplugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvplugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[dejavu_sdk.stores]\nplugin = kvplugin:PluginRecords\n"
                                           "odd = kvplugin:NotRecords\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "plugin" in STORES.names()
    store = dv.open_store("plugin://shelf", tag="x")
    assert type(store.records).__name__ == "PluginRecords"
    assert store.records.tag == ("shelf", "x")
    with pytest.raises(dv.ConfigError, match="it accepts: tag"):
        dv.open_store("plugin://shelf", colour="red")
    with pytest.raises(dv.ConfigError, match="is not a RecordStore"):
        dv.open_store("odd://shelf")
