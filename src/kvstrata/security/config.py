"""The security settings of one server (the worker configuration's ``[security]`` table)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

DEFAULT_TOMBSTONE_TTL_S: Final = 24 * 3600.0


@dataclass(frozen=True)
class SecurityConfig:
    """``keys_file``: API key hashes → tenants and roles (unset: single-tenant);
    ``audit_path``: where audit lines go (unset: the ``kvstrata.audit`` logger);
    ``tombstone_ttl_s``: how long a deleted key refuses late writes and events (longer than
    any write-back delay or event lag); ``tls_cert_file``/``tls_key_file``: serve HTTPS;
    ``tls_ca_file``: the CA a router trusts for its workers' HTTPS."""

    keys_file: Path | None = None
    fleet_key: str | None = field(default=None, repr=False)
    audit_path: Path | None = None
    tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_ca_file: Path | None = None

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None
