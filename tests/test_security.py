"""The server threat suite, run against every server transport."""

from __future__ import annotations

from dejavu_sdk.testing import ServerSecurityTests


class TestTcpSecurity(ServerSecurityTests):
    scheme = "tcp"


class TestUcxSecurity(ServerSecurityTests):
    scheme = "ucx"


class TestGlooSecurity(ServerSecurityTests):
    scheme = "gloo"
