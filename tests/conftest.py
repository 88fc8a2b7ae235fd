"""Shared fixtures: the real tiny model (random weights, fixed seed) and SmolLM2 when asked."""

from __future__ import annotations

import pytest

from kvstrata.engine.model_loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    """Read-only: tests that modify weights (adapters) load their own copy."""
    return load_model("tiny")


@pytest.fixture(scope="session")
def smollm2_model() -> LoadedModel:
    return load_model("smollm2")
