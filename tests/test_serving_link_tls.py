"""TLS on a pipeline's own links (`link_tls_cert`, `link_tls_key`, `link_tls_ca`; `--link-tls-*`): every inbox, the
head's and each stage worker's, speaks TLS only, requests decode exactly through it, and a killed stage is replaced
and restored from its replica over it."""

from __future__ import annotations

import os
import signal
import time

import pytest
import tiny_models
import torch

import dejavu_sdk as dv
from dejavu_sdk.cli import build_parser
from dejavu_sdk.serving import Pipeline
from dejavu_sdk.serving.wire.link_tls import CA_VARIABLE, CERT_VARIABLE, KEY_VARIABLE, LinkTls
from dejavu_sdk.testing import self_signed_certificate

PROMPT = torch.tensor([5, 17, 33, 8, 61, 12])
NEW = 40


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return self_signed_certificate(tmp_path_factory.mktemp("link-tls"))


def _generate() -> list[int]:
    model = tiny_models.llama()
    return model.generate(PROMPT[None], attention_mask=torch.ones(1, PROMPT.numel(), dtype=torch.long),
                          do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0,
                          eos_token_id=None)[0, PROMPT.numel():].tolist()


def _send_twice(link) -> None:
    """Two messages: a refused connection shows by the second at most."""
    for _ in range(2):
        link.send_tensor(torch.zeros(8, dtype=torch.uint8))


@pytest.mark.slow
def test_every_link_speaks_tls_and_a_killed_stage_is_restored_over_it(workers_import_tiny_models,
                                                                       certificate) -> None:
    cert, key = certificate
    want = _generate()
    with Pipeline("tiny_models:llama", stages=2, microbatch=2, timeout=60, recovery="replicas", heartbeat=0.5,
                  link_tls_cert=cert, link_tls_key=key, link_tls_ca=cert) as pipe:
        assert pipe.submit(PROMPT, NEW, ignore_eos=True).result(timeout=60).tokens.tolist() == want
        for url in [pipe.url, *pipe.fleet.urls]:  # the head's inbox and each worker's
            with dv.open_transport(url, token=pipe.options.links.token, timeout=5, connect_timeout=5) as plain, \
                    pytest.raises(dv.TransportError):
                _send_twice(plain)
        arrived: list[int] = []
        future = pipe.submit(PROMPT, NEW, ignore_eos=True, on_token=arrived.append)
        deadline = time.monotonic() + 60
        while len(arrived) < 8:
            assert time.monotonic() < deadline, "no 8 tokens within 60 s"
            time.sleep(0.01)
        victim = next(stage["pid"] for stage in pipe.status()["stages"] if stage["name"] == "stage 1")
        os.kill(victim, signal.SIGKILL)
        assert future.result(timeout=120).tokens.tolist() == want
        (report,) = pipe.recoveries
        assert report.resumed  # the slot went on from its replica, restored over a TLS link,
        assert report.recomputed == {}  # and nothing was computed again
    assert arrived == want


def test_link_tls_needs_all_three_files_and_tcp(certificate, tmp_path) -> None:
    cert, key = certificate
    assert LinkTls.of(None, None, None) is None
    with pytest.raises(dv.ConfigError, match="link_tls_ca missing"):
        LinkTls.of(cert, key, None)
    with pytest.raises(dv.ConfigError, match="not a file"):
        LinkTls.of(cert, key, str(tmp_path / "nowhere.pem"))
    with pytest.raises(dv.ConfigError, match="transport='tcp'"):
        LinkTls.of(cert, key, cert, "gloo")
    tls = LinkTls.of(cert, key, cert)
    assert LinkTls.from_environment(tls.environment()) == tls
    assert LinkTls.from_environment({CERT_VARIABLE: "", KEY_VARIABLE: "", CA_VARIABLE: ""}) is None
    with pytest.raises(dv.ConfigError, match="go together"):
        LinkTls.from_environment({CERT_VARIABLE: cert})
    with pytest.raises(dv.ConfigError, match="link_tls"):
        Pipeline("tiny_models:llama", stages=1, link_tls_cert=cert)


def test_the_commands_take_the_link_tls_files() -> None:
    parser = build_parser()
    files = ["--link-tls-cert", "c.pem", "--link-tls-key", "k.pem", "--link-tls-ca", "ca.pem"]
    for command in (["serve", "--model", "smollm2"], ["controller", "--model", "smollm2"],
                    ["worker", "--join", "tcp://127.0.0.1:1"]):
        args = parser.parse_args([*command, *files])
        assert (args.link_tls_cert, args.link_tls_key, args.link_tls_ca) == ("c.pem", "k.pem", "ca.pem")
