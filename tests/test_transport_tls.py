"""TLS on tcp://: blocks travel encrypted to a server that proves who it is, and only to such a server."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.stores import MemoryStore
from dejavu_sdk.testing import ServedStoreProcess, random_tensor, same_bits, self_signed_certificate
from dejavu_sdk.testing.frames import frame
from dejavu_sdk.transports.wire import Op

KEY = dv.BlockKey("req-1", layers=(0, 1), tokens=(0, 64))


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def tls_server(certificate: tuple[str, str]) -> Iterator[dv.transports.Server]:
    cert, key = certificate
    with dv.serve("tcp://127.0.0.1:0", MemoryStore(), tls_cert=cert, tls_key=key, token="t0ken") as server:
        yield server


def test_blocks_round_trip_over_tls_with_a_token(tls_server, certificate) -> None:
    block = random_tensor((3 << 20,), torch.float16)  # several 1 MiB pieces
    with dv.open_transport(tls_server.url, tls=True, ca=certificate[0], token="t0ken") as link:
        link.flush(KEY, block)
        out = torch.empty_like(block)
        link.fetch(KEY, out=out)
        assert same_bits(out, block)
        link.put_records([("req-2/manifest", b"\x00" * 10)])  # small multi-part messages too
        assert sorted(link.names("")) == ["req-1/L0-1.T0-64", "req-2/manifest"]
    store = dv.open_store(tls_server.url, tls=True, ca=certificate[0], token="t0ken")
    assert store.keys() == [KEY]
    store.close()


def test_a_server_that_cannot_prove_who_it_is_is_refused(tls_server) -> None:
    with dv.open_transport(tls_server.url, tls=True, token="t0ken") as link, \
            pytest.raises(dv.AccessDenied, match="did not prove who it is"):
        link.names("")  # the system's CAs do not vouch for a self-signed certificate


def test_plain_tcp_to_a_tls_server_fails_cleanly(tls_server) -> None:
    with dv.open_transport(tls_server.url, token="t0ken", timeout=5) as link, pytest.raises(dv.TransportError):
        link.names("")


def test_tls_options_are_refused_where_there_is_no_tls(certificate) -> None:
    cert, key = certificate
    with pytest.raises(dv.ConfigError, match="no TLS"):
        dv.open_transport("gloo://127.0.0.1:1", tls=True)
    with pytest.raises(dv.ConfigError, match="no TLS"):
        dv.serve("gloo://127.0.0.1:0", "memory://", tls_cert=cert, tls_key=key)
    with pytest.raises(dv.ConfigError, match="both"):
        dv.serve("tcp://127.0.0.1:0", "memory://", tls_cert=cert)
    with pytest.raises(dv.ConfigError, match="cannot load"):
        dv.serve("tcp://127.0.0.1:0", "memory://", tls_cert=cert, tls_key=cert)


@pytest.mark.slow  # a Python process of its own
def test_serve_store_speaks_tls_with_a_token_from_the_environment(certificate) -> None:
    cert, key = certificate
    options = ["--tls-cert", cert, "--tls-key", key]
    with ServedStoreProcess("tcp", quiet=True, options=options, token="env-token") as peer:
        with dv.open_transport(peer.url, tls=True, ca=cert, token="env-token") as link:
            link.flush(KEY, torch.ones(2))
            assert link.fetch(KEY).tolist() == [1.0, 1.0]
            with pytest.raises(dv.TransportError, match="takes no tensors"):
                link.send_tensor(torch.ones(1))  # nobody reads a store server's inbox
        with dv.open_transport(peer.url, tls=True, ca=cert, token="other") as link, pytest.raises(dv.AccessDenied):
            link.names("")


def test_sockets_that_never_finish_a_handshake_cost_nothing_and_go_after_hello_timeout(certificate) -> None:
    """The handshake runs without blocking anyone: 200 sockets that connect and send nothing (or half a
    ClientHello) leave a TLS client with a token served at once, and are dropped after `hello_timeout`."""
    cert, key = certificate
    with dv.serve("tcp://127.0.0.1:0", MemoryStore(), tls_cert=cert, tls_key=key, token="t0ken",
                  hello_timeout=1.0) as server:
        host, port = server.url.removeprefix("tcp://").rsplit(":", 1)
        silent = [socket.create_connection((host, int(port)), timeout=5) for _ in range(200)]
        try:
            silent[0].sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc")  # the start of a ClientHello, no more
            started = time.monotonic()
            with dv.open_transport(server.url, tls=True, ca=cert, token="t0ken", timeout=2) as link:
                link.flush(KEY, torch.arange(64))
                assert link.fetch(KEY).tolist() == list(range(64))
            assert time.monotonic() - started < 1
            for sock in (silent[0], silent[-1]):
                sock.settimeout(3)
                assert sock.recv(1) == b""
        finally:
            for sock in silent:
                sock.close()


def test_a_large_reply_to_a_reader_that_pauses_arrives_whole_over_tls(tls_server, certificate) -> None:
    """The part of a reply the kernel cannot take at once is sent by the server's watcher as the reader drains
    it: over TLS, a reader that stops for a while still gets every bit."""
    block = random_tensor((12 << 20,), torch.uint8)
    with dv.open_transport(tls_server.url, tls=True, ca=certificate[0], token="t0ken", timeout=10) as link:
        link.flush(KEY, block)
    host, port = tls_server.url.removeprefix("tcp://").rsplit(":", 1)
    context = ssl.create_default_context(cafile=certificate[0])
    raw = socket.create_connection((host, int(port)), timeout=10)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    with context.wrap_socket(raw, server_hostname=host) as sock:
        sock.sendall(frame(Op.HELLO, b"dejavu-sdk\nt0ken") + frame(Op.GET, str(KEY).encode()))
        received = bytearray(sock.recv(65536))
        time.sleep(1.0)  # the server's send blocks: the watcher takes over the rest
        deadline = time.monotonic() + 10
        while len(received) < block.numel():
            assert time.monotonic() < deadline
            received += sock.recv(1 << 20)
            if len(received) > block.numel() + 200:
                break
    payload = bytes(received)
    start = payload.index(bytes(block[:64].numpy()))
    assert payload[start:start + block.numel()] == bytes(block.numpy())
