"""Fixtures of the server tests: one shared engine and server (the tests that share it leave
it as they found it: no request running, every KV block free) and TLS certificates."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pipeline.server.serving import TEST_KEYS, Certificate, ServedEngine, make_certificate

#: KV blocks of the shared engine: room for 50 short requests at once
SHARED_NUM_BLOCKS = 256


@pytest.fixture(scope="package")
def served(tiny_model_dir: Path) -> Iterator[ServedEngine]:
    """The tiny model behind a Generation server (engine in its own process, over zmq)."""
    engine = ServedEngine(tiny_model_dir, keys=TEST_KEYS, num_blocks=SHARED_NUM_BLOCKS)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def server_certificate(tmp_path_factory: pytest.TempPathFactory) -> Certificate:
    return make_certificate(tmp_path_factory.mktemp("tls"), "server")


@pytest.fixture(scope="session")
def client_certificate(tmp_path_factory: pytest.TempPathFactory) -> Certificate:
    return make_certificate(tmp_path_factory.mktemp("tls-client"), "client")
