"""The remote CPU store: a Store over a transport to another process passes the same conformance suite."""

from __future__ import annotations

import pytest

import dejavu_sdk as dv
from dejavu_sdk.stores import MemoryStore
from dejavu_sdk.testing import StoreTests
from dejavu_sdk.transports import TcpTransport


@pytest.fixture
def remote_store_factory():
    servers = []

    def factory(scheme: str, **options) -> dv.Store:
        server = dv.serve(f"{scheme}://127.0.0.1:0", MemoryStore())
        servers.append(server)
        return dv.open_store(server.url, **options)

    yield factory
    for server in servers:
        server.close()


class TestTcpRemoteStore(StoreTests):
    @pytest.fixture
    def store_factory(self, remote_store_factory):
        return lambda: remote_store_factory("tcp", timeout=30)

    @pytest.fixture
    def reopen(self):
        return lambda store: dv.open_store(store.url, timeout=30)  # another connection to the same server


class TestUcxRemoteStore(StoreTests):
    @pytest.fixture
    def store_factory(self, remote_store_factory):
        return lambda: remote_store_factory("ucx", timeout=30)

    @pytest.fixture
    def reopen(self):
        return lambda store: dv.open_store(store.url, timeout=30)


def test_a_remote_store_is_a_store_over_the_transport_itself(remote_store_factory) -> None:
    store = remote_store_factory("tcp")
    assert type(store) is dv.Store
    assert isinstance(store.records, TcpTransport)
    assert store.url == store.records.url
    store.close()
    assert store.records._closed  # closing the store closes its connection
