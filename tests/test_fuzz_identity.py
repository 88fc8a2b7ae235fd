"""Fuzzing identity inputs that come from outside: vLLM's ``cache_salt`` (any JSON string).

Every salt, lone surrogates included (a JSON ``"\\ud800"``), maps to a namespace without
raising, the same salt always to the same namespace, distinct salts to distinct ones, and the
salt itself never appears in the namespace's name (it may be a per-user secret).
"""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from fuzz_helpers import FUZZ, odd_text
from kvstrata.connectors.vllm_identity import tenant_for_salt


@FUZZ
@given(a=st.none() | odd_text, b=st.none() | odd_text)
@example(a="\ud800", b="\udc00")
@example(a="salt", b="salt\x00")
def test_any_cache_salt_has_its_own_namespace(a: str | None, b: str | None) -> None:
    first, second = tenant_for_salt(a, b"secret"), tenant_for_salt(b, b"secret")
    assert first == tenant_for_salt(a, b"secret")
    assert (first == second) == ((a or None) == (b or None))
    if a and len(a) >= 8:
        assert a not in first.name.removeprefix("salt-")
