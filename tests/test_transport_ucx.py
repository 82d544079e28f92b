from __future__ import annotations

import contextlib
import logging
import time

import torch

import dejavu_sdk as dv
from dejavu_sdk.testing.transports import TransportTests
from dejavu_sdk.transports.wire import HELLO_BYTES, Op, send_message


class TestUcxTransport(TransportTests):
    scheme = "ucx"


def test_an_idle_connection_is_closed_and_the_client_reopens_it(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="dejavu_sdk.transports")  # a normal close says so at debug level
    key = dv.BlockKey("req-1", layers=(0, 1), tokens=(0, 4))
    with dv.serve("ucx://127.0.0.1:0", "memory://", idle_timeout=0.5) as server, \
            dv.open_transport(server.url, timeout=10) as link:
        link.flush(key, torch.arange(4))
        deadline = time.monotonic() + 10
        while not any("sent no request" in record.message for record in caplog.records):
            assert time.monotonic() < deadline, "the server never closed the idle connection"
            time.sleep(0.05)
        time.sleep(1.0)  # UCX tells the client's endpoint of the close asynchronously
        assert link.fetch(key).tolist() == [0, 1, 2, 3]  # reopened, no error


def _wait_for_log(caplog, text: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in record.message for record in caplog.records):
        assert time.monotonic() < deadline, f"the server never logged {text!r}"
        time.sleep(0.05)


def test_a_connection_that_never_says_hello_is_dropped_after_hello_timeout(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="dejavu_sdk.transports")
    with dv.serve("ucx://127.0.0.1:0", "memory://", hello_timeout=0.5) as server, \
            dv.open_transport(server.url, timeout=10) as silent, dv.open_transport(server.url, timeout=10) as link:
        channel = silent._connect()  # connected, and nothing sent
        try:
            link.flush(dv.BlockKey("req-1", layers=(0, 1), tokens=(0, 4)), torch.arange(4))  # others are served
            _wait_for_log(caplog, "no HELLO within 0.5 s")
        finally:
            channel.close()


def test_a_hello_larger_than_any_hello_is_refused_before_it_is_read(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="dejavu_sdk.transports")
    with dv.serve("ucx://127.0.0.1:0", "memory://") as server, dv.open_transport(server.url, timeout=10) as client:
        channel = client._connect()
        try:
            with contextlib.suppress(dv.TransportError):  # refused after its control frame: the rest may bounce
                send_message(channel, Op.HELLO, meta=b"x" * (HELLO_BYTES + 1))
            _wait_for_log(caplog, "over the limit")
        finally:
            channel.close()
        client.flush(dv.BlockKey("req-1", layers=(0, 1), tokens=(0, 4)), torch.arange(4))  # others are served
