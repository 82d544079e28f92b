"""The remote CPU store: a store served by another process passes the same conformance suite."""

from __future__ import annotations

import pytest

import dejavu_sdk as dv
from dejavu_sdk.stores import MemoryStore, RemoteStore
from dejavu_sdk.testing import StoreTests
from dejavu_sdk.transports import serve


@pytest.fixture
def remote_store_factory():
    servers = []

    def factory(scheme: str, **options) -> RemoteStore:
        server = serve(f"{scheme}://127.0.0.1:0", MemoryStore())
        servers.append(server)
        return dv.open_store(server.url, **options)

    yield factory
    for server in servers:
        server.close()


class TestTcpRemoteStore(StoreTests):
    @pytest.fixture
    def store_factory(self, remote_store_factory):
        return lambda: remote_store_factory("tcp", timeout=30)


class TestUcxRemoteStore(StoreTests):
    @pytest.fixture
    def store_factory(self, remote_store_factory):
        return lambda: remote_store_factory("ucx", timeout=30)
