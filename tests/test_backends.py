"""Choosing backends by URL: who owns a store that `serve` or `open_transport` opened from a URL, and
addresses of schemes the URL parser does not know."""

from __future__ import annotations

import pytest

import dejavu_sdk as dv
from dejavu_sdk.stores import MemoryStore
from dejavu_sdk.urls import network_address, parse_url


def test_a_store_served_from_a_url_is_closed_with_its_server() -> None:
    server = dv.serve("tcp://127.0.0.1:0", "memory://")
    server.close()
    assert server.store.closed


def test_a_store_the_caller_passes_stays_open_after_the_server_closes() -> None:
    store = MemoryStore()
    with dv.serve("tcp://127.0.0.1:0", store):
        pass
    assert not store.closed
    store.close()


def test_the_local_transport_closes_only_a_store_it_opened() -> None:
    opened_here = dv.open_transport("local", store="memory://")
    opened_here.close()
    assert opened_here.store.closed
    mine = MemoryStore()
    dv.open_transport("local", store=mine).close()
    assert not mine.closed


@pytest.mark.parametrize(("text", "address"), [("yours://10.1.2.3:7000", ("10.1.2.3", 7000)),
                                               ("yours://[::1]:9", ("::1", 9)),
                                               ("tcp://127.0.0.1:0", ("127.0.0.1", 0))])
def test_peer_addresses_are_read_from_any_scheme(text: str, address: tuple[str, int]) -> None:
    assert network_address(parse_url(text)) == address


def test_an_address_without_a_port_is_refused() -> None:
    with pytest.raises(dv.ConfigError, match="host:port"):
        network_address(parse_url("yours://somewhere"))
