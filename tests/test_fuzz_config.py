"""Fuzzing the files an operator writes: the keys file and the worker configuration.

Random mappings, random TOML-ish text and random bytes: ``parse_keys`` / ``load_keys`` and
``load_worker_config`` answer with a parsed value or a ``ConfigError`` that names the entry
(``keys[i].field``, ``tiers.gib`` …) — never another exception. The ``Authenticator`` turns
any ``Authorization`` header into a principal or an ``AuthError``, and no random header
authenticates as a key.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from fuzz_helpers import FUZZ, json_value, odd_number, odd_text
from kvstrata.errors import AuthError, ConfigError
from kvstrata.runtime.config import load_worker_config
from kvstrata.runtime.config_schema import BY_PATH, TABLES, TIER_NAMES
from kvstrata.security.keys import (
    ANONYMOUS,
    Authenticator,
    Role,
    generate_api_key,
    keys_entry_toml,
    load_keys,
    parse_keys,
)

pytestmark = pytest.mark.timeout(120)


def toml_text(value: Any) -> str:
    """A TOML rendering of ``value`` (inline forms; strings as JSON, which TOML mostly reads)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(f"{json.dumps(str(k))} = {toml_text(v)}" for k, v in value.items())
            + "}"
        )
    return '""'  # None: TOML has no null


def toml_document(data: dict[str, Any]) -> str:
    """Top-level scalars, then ``[table]`` for dicts and ``[[table]]`` for lists of dicts."""
    lines = [
        f"{json.dumps(str(k))} = {toml_text(v)}"
        for k, v in data.items()
        if not isinstance(v, dict) and not (isinstance(v, list) and v and isinstance(v[0], dict))
    ]
    for name, value in data.items():
        entries = [value] if isinstance(value, dict) else value
        if not (isinstance(value, list | dict) and entries and isinstance(entries[0], dict)):
            continue
        for entry in entries:
            lines.append(
                f"[{json.dumps(name)}]" if isinstance(value, dict) else f"[[{json.dumps(name)}]]"
            )
            if isinstance(entry, dict):
                lines += [f"{json.dumps(str(k))} = {toml_text(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


# ---- keys file ------------------------------------------------------------------------------
GOOD_HASH = "sha256:" + "ab" * 32
odd = json_value | odd_number | odd_text
key_entry = st.fixed_dictionaries(
    {},
    optional={
        "id": odd_text | st.just("k1"),
        "hash": st.just(GOOD_HASH) | odd_text | st.just("sha256:" + "AB" * 32),
        "tenant": odd_text | st.sampled_from(["acme", "a/b", "x" * 129]),
        "roles": st.lists(st.sampled_from([r.value for r in Role]) | odd, max_size=3) | odd,
        "sub_namespaces": st.booleans() | odd,
        "extra": odd,
    },
)
shared_entry = st.fixed_dictionaries(
    {}, optional={"namespace": odd_text, "tenants": st.lists(odd_text, max_size=3) | odd}
)
keys_data = st.fixed_dictionaries(
    {},
    optional={
        "keys": st.lists(key_entry | odd, max_size=3) | odd,
        "shared": st.lists(shared_entry | odd, max_size=2) | odd,
        "other": odd,
    },
)


@FUZZ
@given(data=keys_data)
@example(data={"keys": [{"id": "k", "hash": GOOD_HASH, "tenant": "t", "roles": [{"a": 1}]}]})
@example(data={"keys": [{"id": "k", "hash": GOOD_HASH, "tenant": "t", "roles": "tenant"}]})
@example(data={"shared": [{"namespace": "n", "tenants": [["nested"]]}]})
def test_parse_keys_raises_only_config_errors_naming_the_entry(data: dict[str, Any]) -> None:
    try:
        ring = parse_keys(data, "keys.toml")
    except ConfigError as exc:
        assert exc.source == "keys.toml"
        assert exc.key is None or exc.key.split("[")[0].split(".")[0] in ("keys", "shared")
        assert exc.key is not None or "unknown table" in str(exc)
        return
    for entry in ring.entries:
        assert entry.key_hash.startswith("sha256:") and entry.roles


@FUZZ
@given(
    text=st.one_of(
        keys_data.map(toml_document),
        st.text(max_size=200),
        st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
    ),
    raw_bytes=st.none() | st.binary(max_size=100),
)
@example(text="", raw_bytes=b"\xff\xfe[[keys]]")
@example(text="a = " + "[" * 5000 + "]" * 5000, raw_bytes=None)
@example(text="[[keys]]\nid = 'k'\nhash = 'x'\n" * 3, raw_bytes=None)
def test_load_keys_raises_only_config_errors(text: str, raw_bytes: bytes | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "keys.toml"
        if raw_bytes is None:
            path.write_text(text, encoding="utf-8", errors="surrogatepass")
        else:
            path.write_bytes(raw_bytes)
        try:
            load_keys(path)
        except ConfigError as exc:
            assert exc.source == str(path)


@FUZZ
@given(header=st.none() | odd_text | st.text(st.characters(max_codepoint=0xFF), max_size=80))
@example(header="Bearer ")
@example(header="Bearer \t kvs_x \t")
@example(header="bearer kvs_x")
def test_authenticate_any_header(header: str | None) -> None:
    key = generate_api_key()
    with tempfile.TemporaryDirectory() as tmp:
        keys_file = Path(tmp) / "keys.toml"
        keys_file.write_text(keys_entry_toml("k1", key, "acme", [Role.TENANT], True))
        modes = (
            Authenticator(keys_file),
            Authenticator(None, admin_token="adm1n"),
            Authenticator(None),
        )
        for auth in modes:
            try:
                principal = auth.authenticate(header)
            except AuthError as exc:
                assert exc.status == 401
                continue
            # a random header is never a key; single-tenant callers are anonymous
            assert principal is ANONYMOUS or principal.key_id == "admin-token"
            assert principal.key_id != "admin-token" or "adm1n" in (header or "")
            try:
                principal.namespace(header)
            except AuthError as exc:
                assert exc.status in (400, 403)


# ---- worker configuration -------------------------------------------------------------------
def _table_keys(table: str) -> list[str]:
    return [p[len(table) + 1 :] for p in BY_PATH if p.startswith(table + ".")]


TOP_KEYS = [p for p in BY_PATH if "." not in p]
odd_path = st.sampled_from(["~no-such-user-kvstrata/x", "a\x00b", "", "~", ".", "/nonexistent"])
config_value = odd | odd_path | st.sampled_from(["1", "0", "true", "nan", "-inf", "1e400"])


def _table(table: str) -> st.SearchStrategy[dict[str, Any]]:
    names = [n for n in _table_keys(table) if not n.startswith("rollout.")]
    optional: dict[str, Any] = {name: config_value for name in names}
    if table == "tiers":
        optional["name"] = st.sampled_from(TIER_NAMES) | config_value
        optional["rollout"] = (
            st.fixed_dictionaries(
                {},
                optional={
                    n[len("rollout.") :]: config_value
                    for n in _table_keys("tiers")
                    if n.startswith("rollout.")
                },
            )
            | config_value
        )
    return st.fixed_dictionaries({}, optional=optional)


raw_config = st.fixed_dictionaries(
    {},
    optional={
        **{name: config_value for name in TOP_KEYS},
        **{table: _table(table) | config_value for table in TABLES if table != "tiers"},
        "tiers": st.lists(_table("tiers") | config_value, max_size=3) | config_value,
        "unknown": config_value,
    },
)


@FUZZ
@given(raw=raw_config)
@example(raw={"pool": {"gib": None}})  # null in a mapping: the default, not a TypeError
@example(raw={"pool": {"gib": float("nan")}})
@example(raw={"pool": {"gib": 10**400}})
@example(raw={"pool": {"gib": "1e400"}})
@example(raw={"tiers": [{"name": "host", "gib": float("inf")}]})
@example(raw={"tiers": [{"name": "host", "gib": 1, "quota_gib": {"a": float("nan")}}]})
@example(raw={"tiers": [{"name": "host", "gib": 1, "write_back_max_mib": float("inf")}]})
@example(raw={"tenant_secret_file": "a\x00b"})
@example(raw={"admin_token_file": "~no-such-user-kvstrata/token"})
def test_load_worker_config_raises_only_config_errors(raw: dict[str, Any]) -> None:
    try:
        load_worker_config(raw=raw, source="fuzz")
    except ConfigError as exc:
        assert exc.source is not None and exc.source.startswith("fuzz")


@FUZZ
@given(content=st.binary(max_size=200) | raw_config.map(lambda r: toml_document(r).encode()))
@example(content=b"model = 'tiny'\n\xff")
@example(content=b"[pool]\ngib = nan\n")
@example(content=b"[[tiers]]\nname = 0\n")
def test_config_files_of_random_bytes(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "worker.toml"
        path.write_bytes(content)
        try:
            load_worker_config(path)
        except ConfigError as exc:
            # the file, then where in it for array entries: "worker.toml (tiers[0])"
            assert exc.source is not None and exc.source.startswith(str(path)), exc.source


@FUZZ
@given(secret=st.binary(max_size=40))
@example(secret=b"\xff\xfe token")
def test_secret_files_of_random_bytes(secret: bytes) -> None:
    """Token and password files hold text; random bytes are a ConfigError, not a crash."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "secret"
        path.write_bytes(secret)
        remote = {
            "name": "remote",
            "gib": 1,
            "url": "redis://127.0.0.1:1",
            "password_file": str(path),
        }
        for raw in ({"admin_token_file": str(path)}, {"tiers": [remote]}):
            try:
                load_worker_config(raw=raw, source="fuzz")
            except ConfigError as exc:
                assert exc.key in ("admin_token_file", "tiers.password_file")
