"""`dejavu serve-store` refuses to serve other machines without a token, and takes tokens from a file."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import dejavu_sdk as dv
from dejavu_sdk.testing import ServedStoreProcess

KEY = dv.BlockKey("team-a.req", layers=(0, 1), tokens=(0, 2))


def _serve_store(*arguments: str) -> subprocess.CompletedProcess:
    environment = {"PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "dejavu_sdk.cli", "serve-store", *arguments], capture_output=True,
                          text=True, timeout=60, env=environment)


@pytest.mark.slow  # a Python process of its own
@pytest.mark.parametrize("listen", ["tcp://0.0.0.0:0", "tcp://[::]:0"])
def test_an_open_server_beyond_loopback_is_refused_and_says_why(listen: str) -> None:
    result = _serve_store("--listen", listen)
    assert result.returncode == 2
    assert "without a token" in result.stderr
    assert "--token-file" in result.stderr
    assert "--insecure" in result.stderr


@pytest.mark.slow  # a Python process of its own
def test_a_token_file_gives_each_token_its_streams(tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# token  stream-id prefix\nroot-secret\nteam-a-secret team-a.\n")
    with ServedStoreProcess("tcp", quiet=True, options=["--token-file", str(tokens)]) as peer:
        with dv.open_transport(peer.url, token="team-a-secret") as team:
            team.flush(KEY, torch.ones(2))
            with pytest.raises(dv.AccessDenied):
                team.flush(dv.BlockKey("team-b.req", layers=(0, 1), tokens=(0, 2)), torch.ones(2))
        with dv.open_transport(peer.url, token="root-secret") as root:
            assert root.names("") == [str(KEY)]
        with dv.open_transport(peer.url) as stranger, pytest.raises(dv.AccessDenied):
            stranger.names("")


@pytest.mark.slow
def test_a_bad_token_file_is_a_clear_error(tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    result = _serve_store("--listen", "tcp://127.0.0.1:0", "--token-file", str(empty))
    assert result.returncode == 2
    assert "holds no token" in result.stderr
    result = _serve_store("--listen", "tcp://127.0.0.1:0", "--token-file", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert "cannot read the token file" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "said"), [(["--workers", "0"], "workers"),
                                             (["--max-inflight-bytes", "lots"], "--max-inflight-bytes"),
                                             (["--hello-timeout", "0"], "hello_timeout"),
                                             (["--max-unauthenticated", "-1"], "max_unauthenticated")])
def test_bad_limits_are_clear_errors(flags: list[str], said: str) -> None:
    result = _serve_store("--listen", "tcp://127.0.0.1:0", *flags)
    assert result.returncode == 2
    assert said in result.stderr


@pytest.mark.slow
def test_limits_given_as_flags_hold(tmp_path) -> None:
    """--max-inflight-bytes smaller than a block: the block is still served, alone; --hello-timeout drops a
    silent socket."""
    import socket
    import time

    with ServedStoreProcess("tcp", f"lmdb://{tmp_path}", quiet=True,
                            options=["--max-inflight-bytes", "64KiB", "--hello-timeout", "0.5", "--workers", "2"]) \
            as peer:
        block = torch.arange(1 << 16, dtype=torch.float32)  # 256 KiB
        with dv.open_transport(peer.url) as client:
            client.flush(KEY, block)
            assert torch.equal(client.fetch(KEY), block)
        host, port = peer.url.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as silent:
            started = time.monotonic()
            assert silent.recv(1) == b""
            assert 0.3 < time.monotonic() - started < 3
