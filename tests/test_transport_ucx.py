from __future__ import annotations

from dejavu_sdk.testing.transports import TransportTests


class TestUcxTransport(TransportTests):
    scheme = "ucx"
