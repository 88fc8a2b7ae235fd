"""Shared pieces of the fuzz tests (issue 12, item 5): Hypothesis settings and strategies.

Every fuzz test runs with ``FUZZ`` or ``FEW`` (no deadline: the first example pays for
warm-up; a modest number of examples so the whole set stays around a minute on one core). The
strategies lean towards what breaks parsers: JSON values with huge or non-finite numbers,
lone surrogates and deep nesting, bytes that are not UTF-8, header values of any latin-1
character.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SCALE = int(os.environ.get("KVSTRATA_FUZZ_SCALE", "1"))
"""Multiplies every test's examples: ``KVSTRATA_FUZZ_SCALE=20 pytest tests/test_fuzz_*.py``
for a long hunt; the default keeps ``make test`` fast."""
FUZZ = settings(
    deadline=None,
    max_examples=100 * SCALE,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
FEW = settings(FUZZ, max_examples=50 * SCALE)
"""For boundaries where one example costs a real request (HTTP): ~25 ms each."""

# Unicode text including lone surrogates (what a "\ud800" JSON escape decodes to).
odd_text = st.text(st.characters(exclude_categories=()), max_size=20) | st.sampled_from(
    ["", "\ud800", "a\udfffb", "\x00", "\u202e", "ﬀ", "²", "1e400", "NaN", "-0", "9" * 5000]
)
odd_number = st.one_of(
    st.integers(),
    st.integers(min_value=1 << 63, max_value=1 << 200),
    st.sampled_from([-(1 << 64), 1 << 64, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
)
json_scalar = st.none() | st.booleans() | odd_number | odd_text
json_value = st.recursive(
    json_scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(odd_text, inner, max_size=4),
    max_leaves=12,
)
"""JSON-shaped values (Python side); ``dumps`` writes NaN/Infinity, as Python's json does."""


def dumps(value: Any) -> bytes:
    """JSON text of ``value``; lone surrogates escaped (``"\\ud800"``), huge ints as digits."""
    return json.dumps(value).encode("ascii")


def deeply_nested(depth: int = 100_000) -> bytes:
    """A JSON array nested ``depth`` deep: recursive parsers run out of stack on it."""
    return b"[" * depth + b"]" * depth


def finite(value: object) -> bool:
    return not isinstance(value, float) or math.isfinite(value)
