"""Every test file of this suite is collected: no plugin may drop one silently.

ai-dynamo (the optional Dynamo cross-check, installed into the same venv) registers pytest
plugins whose ``pytest_ignore_collect`` ignores every ``test_vllm_*.py`` file when vllm cannot
be imported; from 2026-12-01 until they were blocked (``addopts`` in ``pyproject.toml``),
eleven of our files (115 tests) never ran in ``make test``, and one of them had been failing
unseen for a day."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def test_no_plugin_ignores_any_of_our_test_files(pytestconfig: pytest.Config) -> None:
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 100
    ignored = [
        str(path.relative_to(TESTS))
        for path in files
        if pytestconfig.hook.pytest_ignore_collect(collection_path=path, config=pytestconfig)
    ]
    assert ignored == []
