"""The keys file, principals and namespace narrowing (security/keys.py), and the audit log."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from kvstrata.errors import AuthError, ConfigError
from kvstrata.runtime.config import load_worker_config
from kvstrata.security import ANONYMOUS, Action, AuditLog, Authenticator, Role
from kvstrata.security.keys import (
    OBSERVE,
    generate_api_key,
    hash_api_key,
    keys_entry_toml,
    load_keys,
)


def _keys_file(path: Path, entries: list[tuple[str, str, str, list[Role], bool]]) -> Path:
    text = "".join(keys_entry_toml(i, k, t, r, s) for i, k, t, r, s in entries)
    text += '\n[[shared]]\nnamespace = "shared-system"\ntenants = ["acme", "globex"]\n'
    path.write_text(text, encoding="utf-8")
    return path


def test_hash_is_sha256_and_keys_are_random() -> None:
    assert hash_api_key("abc") == (
        "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )
    keys = {generate_api_key() for _ in range(100)}
    assert len(keys) == 100 and all(k.startswith("kvs_") and len(k) == 47 for k in keys)


def test_file_holds_only_hashes(tmp_path: Path) -> None:
    key = generate_api_key()
    path = _keys_file(tmp_path / "keys.toml", [("a", key, "acme", [Role.TENANT], False)])
    assert key not in path.read_text()
    assert hash_api_key(key) in path.read_text()


def test_principal_from_key_and_namespace_narrowing(tmp_path: Path) -> None:
    acme, globex, obs = generate_api_key(), generate_api_key(), generate_api_key()
    path = _keys_file(
        tmp_path / "keys.toml",
        [
            ("acme-1", acme, "acme", [Role.TENANT], True),
            ("globex-1", globex, "globex", [Role.TENANT], False),
            ("obs", obs, "ops", [Role.OBSERVER], False),
        ],
    )
    auth = Authenticator(path)
    who = auth.authenticate(f"Bearer {acme}")
    assert (who.key_id, who.tenant) == ("acme-1", "acme")
    assert who.namespace(None) == "acme"
    assert who.namespace("acme") == "acme"
    assert who.namespace("acme/chat-7") == "acme/chat-7"
    assert who.namespace("shared-system") == "shared-system"
    for forbidden in ("globex", "chat-7", "globex/x", "acme/a/b", "other/chat-7", "acme/"):
        with pytest.raises(AuthError) as refused:
            who.namespace(forbidden)
        assert refused.value.status == 403
    g = auth.authenticate(f"Bearer {globex}")
    with pytest.raises(AuthError):
        g.namespace("globex/chat-7")  # no sub-namespaces for this key
    assert g.namespace("shared-system") == "shared-system"
    auth.authorize(auth.authenticate(f"Bearer {obs}"), OBSERVE, "read metrics")
    with pytest.raises(AuthError) as denied:
        auth.authorize(who, OBSERVE, "read metrics")
    assert (denied.value.status, denied.value.reason) == (403, "forbidden")


@pytest.mark.parametrize("header", [None, "Bearer ", "Basic abc", "Bearer kvs_unknown"])
def test_missing_or_unknown_key_is_401(tmp_path: Path, header: str | None) -> None:
    path = _keys_file(tmp_path / "k.toml", [("a", generate_api_key(), "acme", [Role.TENANT], 0)])
    with pytest.raises(AuthError) as refused:
        Authenticator(path).authenticate(header)
    assert refused.value.status == 401
    assert refused.value.reason in ("no_key", "unknown_key")


def test_single_tenant_is_anonymous_and_privileged_actions_are_off() -> None:
    auth = Authenticator()
    who = auth.authenticate(None)
    assert who is ANONYMOUS and who.namespace("team-a") == "team-a"
    with pytest.raises(AuthError) as off:
        auth.authorize(who, {Role.ADMIN}, "switch tiers")
    assert off.value.reason == "disabled"
    auth.authorize(who, OBSERVE, "read metrics", open_single_tenant=True)
    admin = Authenticator(admin_token="s3cret")
    assert Role.ADMIN in admin.authenticate("Bearer s3cret").roles
    assert admin.authenticate("Bearer wrong") is ANONYMOUS  # OpenAI clients send "EMPTY"


def test_reload_takes_new_keys_and_keeps_old_ones_on_a_bad_file(tmp_path: Path) -> None:
    first, second = generate_api_key(), generate_api_key()
    path = _keys_file(tmp_path / "keys.toml", [("a", first, "acme", [Role.TENANT], False)])
    auth = Authenticator(path, reload_interval_s=0.0)
    with pytest.raises(AuthError):
        auth.authenticate(f"Bearer {second}")
    _keys_file(
        path,
        [("a", first, "acme", [Role.TENANT], False), ("b", second, "globex", [Role.TENANT], 0)],
    )
    os.utime(path, ns=(1, 10**18))  # a new mtime, whatever the clock's resolution
    assert auth.maybe_reload(now=1.0)
    assert auth.authenticate(f"Bearer {second}").tenant == "globex"
    path.write_text("[[keys]]\nid = 3\n")
    os.utime(path, ns=(1, 2 * 10**18))
    assert not auth.maybe_reload(now=2.0)
    assert auth.reload_errors == 1
    assert auth.authenticate(f"Bearer {second}").tenant == "globex"


@pytest.mark.parametrize(
    "text",
    [
        "[[keys]]\nid='a'\nhash='md5:00'\ntenant='t'\n",
        "[[keys]]\nid='a'\nhash='sha256:" + "0" * 64 + "'\ntenant='a/b'\n",
        "[[keys]]\nid='a'\nhash='sha256:" + "0" * 64 + "'\ntenant='t'\nroles=['root']\n",
        "[[keys]]\nid='a'\nhash='sha256:" + "0" * 64 + "'\ntenant='t'\nkey='plain'\n",
        "[[keys]]\nid='a'\nhash='sha256:" + "0" * 64 + "'\ntenant='t'\n" * 2,
        "[keys]\n",
        "[[shared]]\nnamespace='x'\ntenants='a'\n",
        # a shared namespace that is a tenant's own, or inside it, would let others in
        "[[keys]]\nid='a'\nhash='sha256:" + "0" * 64 + "'\ntenant='t'\n"
        "[[shared]]\nnamespace='t'\ntenants=['u']\n",
        "[[keys]]\nid='a'\nhash='sha256:" + "0" * 64 + "'\ntenant='t'\n"
        "[[shared]]\nnamespace='t/x'\ntenants=['u']\n",
        "not toml = = =",
    ],
)
def test_bad_keys_files_name_the_problem(tmp_path: Path, text: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as bad:
        load_keys(path)
    assert str(path) in str(bad.value)


def test_audit_lines_are_json_with_fixed_fields(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    with AuditLog(path, component="test") as audit:
        audit.record(
            Action.DELETE,
            "prompt",
            tenant="acme",
            key_id="admin-1",
            request_id="r1",
            keys=[bytes([i]) * 32 for i in range(40)],
            counts={"host": 2, "device": 1},
        )
        audit.record(Action.AUTH_FAILURE, "unknown_key", plane="http POST /v1/completions")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["audit"] for line in lines] == ["delete", "auth_failure"]
    assert lines[0]["object_count"] == 40 and len(lines[0]["objects"]) == 32
    assert lines[0]["counts"] == {"device": 1, "host": 2}
    assert set(lines[1]) == {"audit", "reason", "component", "plane", "ts"}


def test_audit_lines_without_a_path_survive_a_warning_log_level() -> None:
    """A worker logging at WARNING (``basicConfig(level=WARNING)``, as `up` starts them)
    still writes its audit trail to the root handlers."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    root = logging.getLogger()
    handler, level = Keep(), root.level
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    try:
        with AuditLog(component="test") as audit:
            audit.record(Action.ACCESS_DENIED, "forbidden", key_id="k1")
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    assert any('"audit":"access_denied"' in line for line in lines), lines


def test_a_file_rewritten_in_place_is_not_half_applied_and_a_deleted_one_keeps_no_key(
    tmp_path: Path,
) -> None:
    """A rewrite truncates first and an empty file is valid TOML: a reload in that gap
    installed an empty ring (every key refused, no error counted). A deleted file kept every
    old key working forever. Review findings, stop 35."""
    first, second = generate_api_key(), generate_api_key()
    entries = [
        ("a", first, "acme", [Role.TENANT], False),
        ("b", second, "globex", [Role.TENANT], 0),
    ]
    path = _keys_file(tmp_path / "keys.toml", entries)
    auth = Authenticator(path, reload_interval_s=0.0)
    path.write_text("")  # the writer truncated; its bytes are not there yet
    assert not auth.maybe_reload(now=1.0)
    assert auth.authenticate(f"Bearer {first}").tenant == "acme"
    _keys_file(path, entries)  # the rewrite completes: the same ring, nothing lost
    os.utime(path, ns=(1, 10**18))
    assert auth.maybe_reload(now=2.0)
    assert auth.authenticate(f"Bearer {second}").tenant == "globex"
    _keys_file(path, entries[:1])  # a real revocation: applied once the file stays still
    os.utime(path, ns=(1, 2 * 10**18))
    assert not auth.maybe_reload(now=3.0)
    assert auth.maybe_reload(now=4.0)
    with pytest.raises(AuthError):
        auth.authenticate(f"Bearer {second}")
    path.unlink()
    assert not auth.maybe_reload(now=5.0)
    assert auth.authenticate(f"Bearer {first}").tenant == "acme"  # maybe being replaced
    assert auth.maybe_reload(now=6.0) and auth.reload_errors == 1
    with pytest.raises(AuthError):
        auth.authenticate(f"Bearer {first}")


def test_a_credential_file_every_user_may_write_is_refused(tmp_path: Path) -> None:
    """Anyone could add a key of their own to a world-writable keys file, or replace a
    secret with one they know; both were read silently (review finding, stop 35)."""
    path = _keys_file(tmp_path / "keys.toml", [("a", generate_api_key(), "acme", [Role.TENANT], 0)])
    path.chmod(0o666)
    with pytest.raises(ConfigError, match="writable by every user"):
        load_keys(path)
    path.chmod(0o644)
    assert load_keys(path).entries
    secret = tmp_path / "tenant.secret"
    secret.write_bytes(b"s3cret")
    secret.chmod(0o646)
    with pytest.raises(ConfigError, match="writable by every user"):
        load_worker_config(raw={"tenant_secret_file": str(secret)}, source="test")
    secret.chmod(0o600)
    assert load_worker_config(raw={"tenant_secret_file": str(secret)}, source="test").tenant_secret
