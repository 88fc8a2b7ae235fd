"""API keys → principals: who a caller is, what it may do, which namespace its cache lives in.

The keys file (TOML, referenced by ``security.keys_file``) holds only key *hashes*, so a
copy of it lets nobody in::

    [[keys]]
    id = "acme-prod"          # names the key in audit records (never the key itself)
    hash = "sha256:<64 hex>"  # SHA-256 of the key's UTF-8 bytes (`kvstrata keys add` writes it)
    tenant = "acme"
    roles = ["tenant"]        # tenant | observer | admin | fleet
    sub_namespaces = true     # X-Kvstrata-Tenant may narrow to "acme/<sub>" (e.g. per chat)

    [[shared]]                # a namespace several tenants read and write (a system prompt)
    namespace = "shared-system"
    tenants = ["acme", "globex"]

Roles: ``tenant`` may run completions in its own namespace; ``observer`` may read
``/metrics``, ``/kv/info`` and ``/debug/route`` (its own tenant only); ``fleet`` (the router's
key) may also read ``/kv/dump``; ``admin`` may do all of that plus ``/admin/*`` (tier
switches, deletion) and the debug endpoints. Keys are compared by hash with
``hmac.compare_digest``; generated keys carry 256 random bits, so a fast hash is enough.

Namespaces: the tenant of a request comes from its key, never from what the client writes.
A ``X-Kvstrata-Tenant`` header may only *narrow* it: to the tenant itself, to a shared
namespace the tenant belongs to, or (``sub_namespaces``) to ``tenant/<sub>``; anything else
is a 403. Without a keys file the server is single-tenant: every caller is the anonymous
principal of the default tenant, and the header names a sub-namespace as it always did
(one trust domain; isolation like vLLM's ``cache_salt``, not authentication).

``Authenticator`` re-reads the file when it changes (its modification time, size or inode;
checked at most once per ``reload_interval_s``, time passed in). A file that became malformed
keeps the last good ring and is reported. A file being rewritten in place reads, mid-write,
as a valid subset of itself (an empty file is valid TOML), so a change that *takes away*
access (a key, a shared-namespace membership) applies only once the file has stayed the same
for one more check; a change that only adds applies at once. A keys file that disappears
(and stays gone for one more check) leaves no key valid, and is reported: removing it is not
a way to keep every key working forever.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
import secrets
import threading
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvstrata.errors import AuthError, ConfigError
from kvstrata.security.files import check_credential_file

MAX_NAMESPACE_CHARS: Final = 128
KEY_PREFIX: Final = "kvs_"
BEARER: Final = "Bearer "
_HASH_PREFIX: Final = "sha256:"
_DEFAULT_TENANT: Final = "default"
ADMIN_TOKEN_ID: Final = "admin-token"
FLEET_KEY_ID: Final = "fleet-key"


logger = logging.getLogger("kvstrata.security")


class _Unset(enum.Enum):
    UNSET = 0


_UNSET: Final = _Unset.UNSET


class Role(enum.StrEnum):
    TENANT = "tenant"
    OBSERVER = "observer"
    FLEET = "fleet"
    ADMIN = "admin"


OBSERVE: Final = frozenset({Role.OBSERVER, Role.FLEET, Role.ADMIN})
"""Roles that may read metrics, ``/kv/info`` and ``/debug/route``."""
DUMP: Final = frozenset({Role.FLEET, Role.ADMIN})
"""Roles that may read ``/kv/dump`` (every tenant's token ids: the router's index needs them)."""
ADMINISTER: Final = frozenset({Role.ADMIN})


def hash_api_key(key: str) -> str:
    """``sha256:<hex>`` of the key's UTF-8 bytes: what a keys file stores."""
    return _HASH_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()


def generate_api_key() -> str:
    """A new key: ``kvs_`` and 43 URL-safe characters (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def valid_namespace(name: str) -> bool:
    return 0 < len(name) <= MAX_NAMESPACE_CHARS and name.isprintable()


@dataclass(frozen=True)
class Principal:
    """An authenticated caller (or the anonymous one of a single-tenant server)."""

    key_id: str
    tenant: str
    roles: frozenset[Role]
    sub_namespaces: bool = False
    shared: frozenset[str] = frozenset()
    open_namespaces: bool = False
    """Single-tenant mode: the header names the namespace as-is (no keys file)."""

    def has(self, allowed: Iterable[Role]) -> bool:
        return not self.roles.isdisjoint(allowed)

    def namespace(self, requested: str | None) -> str:
        """The namespace a request runs in; ``requested`` is the client's header (or body
        field). Raises ``AuthError`` (403) for one the key does not allow."""
        if requested is None or requested == self.tenant:
            return self.tenant
        if not valid_namespace(requested):
            raise AuthError(
                400 if self.open_namespaces else 403,
                f"X-Kvstrata-Tenant must be 1..{MAX_NAMESPACE_CHARS} printable characters",
                reason="bad_namespace",
            )
        if self.open_namespaces:
            return requested
        if requested in self.shared:
            return requested
        prefix = self.tenant + "/"
        if self.sub_namespaces and requested.startswith(prefix):
            sub = requested[len(prefix) :]
            if sub and "/" not in sub:
                return requested
        raise AuthError(
            403,
            "this key may not use that namespace (a header may only narrow the key's tenant)",
            reason="namespace_denied",
        )


ANONYMOUS: Final = Principal(
    key_id="anonymous",
    tenant=_DEFAULT_TENANT,
    roles=frozenset({Role.TENANT}),
    open_namespaces=True,
)
"""Every caller of a server without a keys file."""


@dataclass(frozen=True)
class KeyEntry:
    key_id: str
    key_hash: str
    tenant: str
    roles: frozenset[Role]
    sub_namespaces: bool = False


@dataclass(frozen=True)
class KeyRing:
    """One parsed keys file: entries by hash and the shared namespaces' members."""

    entries: tuple[KeyEntry, ...] = ()
    shared: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def grants_all_of(self, other: KeyRing) -> bool:
        """Whether this ring keeps every key and shared-namespace membership of ``other``."""
        if not set(other.entries) <= set(self.entries):
            return False
        return all(
            members <= self.shared.get(ns, frozenset()) for ns, members in other.shared.items()
        )

    def principal(self, entry: KeyEntry) -> Principal:
        member_of = frozenset(ns for ns, tenants in self.shared.items() if entry.tenant in tenants)
        return Principal(entry.key_id, entry.tenant, entry.roles, entry.sub_namespaces, member_of)

    def find(self, key: str) -> KeyEntry | None:
        digest = hash_api_key(key)
        found = None
        for entry in self.entries:  # constant work per entry: no early exit on a match
            if hmac.compare_digest(entry.key_hash, digest):
                found = entry
        return found


def parse_keys(data: Mapping[str, Any], source: str) -> KeyRing:
    """Validate a parsed keys file; every error names the entry and the key."""
    unknown = set(data) - {"keys", "shared"}
    if unknown:
        raise ConfigError(f"unknown table {sorted(unknown)[0]!r}", source=source)
    raw_keys = data.get("keys", [])
    if not isinstance(raw_keys, list):
        raise ConfigError("must be an array of tables ([[keys]])", key="keys", source=source)
    entries: list[KeyEntry] = []
    seen_ids: set[str] = set()
    seen_hashes: set[str] = set()
    for i, raw in enumerate(raw_keys):
        where = f"keys[{i}]"
        if not isinstance(raw, Mapping):
            raise ConfigError("must be a table", key=where, source=source)
        extra = set(raw) - {"id", "hash", "tenant", "roles", "sub_namespaces"}
        if extra:
            raise ConfigError(f"unknown key {sorted(extra)[0]!r}", key=where, source=source)
        key_id, key_hash, tenant = raw.get("id"), raw.get("hash"), raw.get("tenant")
        if not isinstance(key_id, str) or not valid_namespace(key_id) or key_id in seen_ids:
            raise ConfigError("needs a unique, printable id", key=f"{where}.id", source=source)
        if not (
            isinstance(key_hash, str)
            and key_hash.startswith(_HASH_PREFIX)
            and len(key_hash) == len(_HASH_PREFIX) + 64
            and all(c in "0123456789abcdef" for c in key_hash[len(_HASH_PREFIX) :])
        ):
            raise ConfigError(
                "must be 'sha256:' and 64 lowercase hex digits", key=f"{where}.hash", source=source
            )
        if key_hash in seen_hashes:
            raise ConfigError("the same key appears twice", key=f"{where}.hash", source=source)
        if not isinstance(tenant, str) or not valid_namespace(tenant) or "/" in tenant:
            raise ConfigError(
                "must be a printable name without '/'", key=f"{where}.tenant", source=source
            )
        roles_raw = raw.get("roles", [Role.TENANT.value])
        try:
            if not isinstance(roles_raw, list) or not roles_raw:
                raise ValueError
            roles = frozenset(Role(str(r)) for r in roles_raw)
        except ValueError:
            known = ", ".join(r.value for r in Role)
            raise ConfigError(
                f"must be a non-empty list of {known}", key=f"{where}.roles", source=source
            ) from None
        sub = raw.get("sub_namespaces", False)
        if not isinstance(sub, bool):
            raise ConfigError("must be true or false", key=f"{where}.sub_namespaces", source=source)
        seen_ids.add(key_id)
        seen_hashes.add(key_hash)
        entries.append(KeyEntry(key_id, key_hash, tenant, roles, sub))
    shared: dict[str, frozenset[str]] = {}
    raw_shared = data.get("shared", [])
    if not isinstance(raw_shared, list):
        raise ConfigError("must be an array of tables ([[shared]])", key="shared", source=source)
    for i, raw in enumerate(raw_shared):
        where = f"shared[{i}]"
        if not isinstance(raw, Mapping) or set(raw) - {"namespace", "tenants"}:
            raise ConfigError("must be a table of namespace and tenants", key=where, source=source)
        name, tenants = raw.get("namespace"), raw.get("tenants")
        if not isinstance(name, str) or not valid_namespace(name) or name in shared:
            raise ConfigError(
                "needs a unique, printable name", key=f"{where}.namespace", source=source
            )
        if not isinstance(tenants, list) or not all(isinstance(t, str) for t in tenants):
            raise ConfigError(
                "must be a list of tenant names", key=f"{where}.tenants", source=source
            )
        owner = name.split("/", 1)[0]
        if any(entry.tenant == owner for entry in entries):
            # Its members would read and write that tenant's own (or sub-) namespace.
            raise ConfigError(
                f"{name!r} is a tenant's namespace (or inside one), not a shared one",
                key=f"{where}.namespace",
                source=source,
            )
        shared[name] = frozenset(tenants)
    return KeyRing(tuple(entries), shared)


def load_keys(path: Path) -> KeyRing:
    check_credential_file(path, "the keys file", secret=False)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the keys file: {exc.strerror}", source=str(path)) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError("the keys file is not UTF-8", source=str(path)) from exc
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise ConfigError(f"not valid TOML: {exc}", source=str(path)) from exc
    return parse_keys(data, str(path))


def keys_entry_toml(key_id: str, key: str, tenant: str, roles: Iterable[Role], sub: bool) -> str:
    """The ``[[keys]]`` table for ``key`` (only its hash), as ``kvstrata keys add`` appends."""
    role_list = ", ".join(f'"{Role(r).value}"' for r in roles)
    return (
        f'\n[[keys]]\nid = "{key_id}"\nhash = "{hash_api_key(key)}"\ntenant = "{tenant}"\n'
        f"roles = [{role_list}]\nsub_namespaces = {'true' if sub else 'false'}\n"
    )


class Authenticator:
    """Turns an ``Authorization`` header into a ``Principal``; thread-safe; reloadable.

    ``keys_file`` None: single-tenant (every caller is ``ANONYMOUS``, whatever it sends).
    Two extra credentials work with or without a keys file: ``admin_token`` (every role, key
    id ``admin-token``: the legacy ``--admin-token``) and ``fleet_key`` (role ``fleet``, key id
    ``fleet-key``: what ``kvstrata up`` gives its router, so the router can read ``/kv/dump``
    while the fleet's clients stay anonymous).
    """

    def __init__(
        self,
        keys_file: Path | None = None,
        *,
        admin_token: str | None = None,
        fleet_key: str | None = None,
        reload_interval_s: float = 1.0,
    ) -> None:
        self.keys_file = keys_file
        self.admin_token = admin_token
        self.reload_interval_s = reload_interval_s
        single = keys_file is None  # one trust domain: the header names the namespace as-is
        self._extra: tuple[tuple[bytes, Principal], ...] = tuple(
            (token.encode(), Principal(key_id, _DEFAULT_TENANT, roles, open_namespaces=single))
            for token, key_id, roles in (
                (admin_token, ADMIN_TOKEN_ID, frozenset(Role)),
                (fleet_key, FLEET_KEY_ID, frozenset({Role.FLEET})),
            )
            if token
        )
        self._lock = threading.Lock()
        self._ring = load_keys(keys_file) if keys_file is not None else KeyRing()
        self._applied = self._signature()  # of the file the ring in effect was read from
        self._pending: tuple[int, int, int] | _Unset | None = _UNSET  # changed, not applied
        self._checked_at = float("-inf")
        self.reload_errors = 0
        self.reloads = 0

    @property
    def multi_tenant(self) -> bool:
        return self.keys_file is not None

    @property
    def has_credentials(self) -> bool:
        """Is any privileged credential configured? (Without one, admin, debug and dump
        endpoints are off, not open.)"""
        return self.keys_file is not None or bool(self._extra)

    @property
    def key_count(self) -> int:
        with self._lock:
            return len(self._ring.entries)

    @property
    def tenant_count(self) -> int:
        with self._lock:
            return len({entry.tenant for entry in self._ring.entries})

    def _signature(self) -> tuple[int, int, int] | None:
        """(mtime, size, inode) of the keys file; None when it cannot be read."""
        if self.keys_file is None:
            return None
        try:
            stat = os.stat(self.keys_file)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size, stat.st_ino

    def maybe_reload(self, now: float) -> bool:
        """Re-read the file if it changed; True when a new ring took effect (module
        docstring). A bad file keeps the old ring (``reload_errors`` counts it)."""
        if self.keys_file is None:
            return False
        with self._lock:
            if now - self._checked_at < self.reload_interval_s:
                return False
            self._checked_at = now
        signature = self._signature()  # I/O outside the lock
        with self._lock:
            if signature == self._applied:
                self._pending = _UNSET
                return False
            settled = signature == self._pending
            self._pending = signature
        if signature is None:  # gone: once it stays gone, no key is valid
            ring, error = KeyRing(), True
        else:
            try:
                ring, error = load_keys(self.keys_file), False
            except ConfigError:
                with self._lock:
                    self.reload_errors += 1
                    self._applied, self._pending = signature, _UNSET
                return False
        with self._lock:
            if not settled and not ring.grants_all_of(self._ring):
                return False  # maybe a rewrite in progress: apply once the file is still
            self._ring, self._applied, self._pending = ring, signature, _UNSET
            self.reloads += 1
            self.reload_errors += int(error)
        if error:
            logger.error("keys file %s is gone: no tenant key is valid", self.keys_file)
        return True

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller behind ``Authorization: Bearer <key>``; raises ``AuthError`` (401).

        Single-tenant: any caller without one of the extra credentials is the anonymous
        principal (an OpenAI client always sends some key; here it names nobody).
        Multi-tenant: a missing or unknown key is a 401."""
        token = None
        # The scheme is case-insensitive (RFC 9110 §11.1): "bearer KEY" is the same credential.
        if authorization is not None and authorization[: len(BEARER)].lower() == BEARER.lower():
            token = authorization[len(BEARER) :].strip()
        if token:
            found = None
            for secret, principal in self._extra:  # no early exit on a match
                if hmac.compare_digest(token.encode(), secret):
                    found = principal
            if found is not None:
                return found
        if self.keys_file is None:
            return ANONYMOUS
        if not token:
            message = "an API key is required (Authorization: Bearer …)"
            raise AuthError(401, message, reason="no_key")
        with self._lock:
            ring = self._ring
        entry = ring.find(token)
        if entry is None:
            raise AuthError(401, "unknown API key", reason="unknown_key")
        return ring.principal(entry)

    def authorize(
        self,
        principal: Principal,
        allowed: Iterable[Role],
        action: str,
        *,
        open_single_tenant: bool = False,
    ) -> None:
        """Raise ``AuthError`` 403 unless ``principal`` holds one of ``allowed``.

        On a server with no credential configured, privileged actions are off (403) for
        everyone, except those marked ``open_single_tenant`` (``/metrics``, ``/kv/info``: one
        trust domain, bound to loopback by default); with an admin token or fleet key but no
        keys file, the anonymous caller of a privileged action is a 401 (present one)."""
        allowed = frozenset(allowed)
        if principal is ANONYMOUS and open_single_tenant:
            return
        if principal is ANONYMOUS and allowed != {Role.TENANT}:
            if self.has_credentials:
                raise AuthError(401, f"{action} needs a credential", reason="no_key")
            raise AuthError(
                403,
                f"{action} is off: this server has no keys file or admin token configured",
                reason="disabled",
            )
        if not principal.has(allowed):
            raise AuthError(403, f"this key may not {action}", reason="forbidden")


__all__ = [
    "ADMINISTER",
    "ADMIN_TOKEN_ID",
    "ANONYMOUS",
    "DUMP",
    "FLEET_KEY_ID",
    "OBSERVE",
    "Authenticator",
    "KeyEntry",
    "KeyRing",
    "Principal",
    "Role",
    "generate_api_key",
    "hash_api_key",
    "keys_entry_toml",
    "load_keys",
    "parse_keys",
]
