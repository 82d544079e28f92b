"""Shared fixtures: a real S3-compatible server on 127.0.0.1 for the object-storage tests, stage processes that
import the tests' tiny models, and SmolLM2's tokenizer (loaded once: reading it from its GGUF takes seconds)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

S3_ENDPOINT_VARIABLE = "DEJAVU_TEST_S3_ENDPOINT"

if os.environ.get("PYTEST_XDIST_WORKER"):  # tests run in parallel workers, which share the cores: one thread each,
    import torch  # and so do the processes they start (a process that chooses its own threads still does)

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# The files whose tests take a minute or more each (notebooks, controller chaos, Ray, journal memory) run first:
# parallel workers then end on short tests together, rather than one of them starting a long one when the other
# has nothing left. The rest keep their order, each file's tests together (module fixtures are set up once).
LONGEST_FIRST = ("test_notebooks.py", "test_controller_chaos.py", "test_cluster_ray.py", "test_journal_memory.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_serving(endpoint: str, process: subprocess.Popen | None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the S3 server exited with code {process.returncode}")
        try:
            urllib.request.urlopen(endpoint, timeout=2).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"no S3 server answered at {endpoint} within {timeout:.0f} s")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from dejavu_sdk.models import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """An S3 endpoint on loopback: the one CI started (DEJAVU_TEST_S3_ENDPOINT), else a moto_server of our own."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    endpoint = os.environ.get(S3_ENDPOINT_VARIABLE)
    if endpoint:
        _wait_until_serving(endpoint, None)
        yield endpoint
        return
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_until_serving(endpoint, process)
        yield endpoint
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def s3_options(s3_endpoint: str) -> dict:
    """fsspec storage_options that reach the loopback server with dummy credentials."""
    return {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing", "use_listings_cache": False}


def _with_tests_on_path(patch: pytest.MonkeyPatch) -> None:
    tests = os.path.dirname(__file__)
    patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))


@pytest.fixture
def workers_import_tiny_models(monkeypatch) -> None:
    """Stage processes load `tiny_models:<family>` themselves: let them import it."""
    _with_tests_on_path(monkeypatch)


@pytest.fixture(scope="module")
def module_workers_import_tiny_models():
    """As `workers_import_tiny_models`, for the pipelines and controllers a module's tests share."""
    with pytest.MonkeyPatch.context() as patch:
        _with_tests_on_path(patch)
        yield
