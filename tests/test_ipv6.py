"""IPv6 hosts keep their brackets in every URL a server reports, so clients can connect back to it."""

from __future__ import annotations

import re

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.urls import join_host_port, parse_url

KEY = dv.BlockKey("req-1", layers=(0, 1), tokens=(0, 2))


def test_hosts_and_ports_are_joined_as_urls_write_them() -> None:
    assert join_host_port("::1", 7000) == "[::1]:7000"
    assert join_host_port("127.0.0.1", 7000) == "127.0.0.1:7000"
    url = parse_url(f"tcp://{join_host_port('fe80::1', 9)}")
    assert (url.host, url.port) == ("fe80::1", 9)


@pytest.mark.parametrize("scheme", ["tcp", "gloo"])
def test_servers_on_ipv6_loopback_report_bracketed_urls_that_work(scheme: str) -> None:
    with dv.serve(f"{scheme}://[::1]:0", "memory://") as server:
        assert re.fullmatch(rf"{scheme}://\[::1\]:\d+", server.url), server.url
        with dv.open_transport(server.url, timeout=10, connect_timeout=5) as transport:
            transport.flush(KEY, torch.arange(4))
            assert transport.fetch(KEY).tolist() == [0, 1, 2, 3]
