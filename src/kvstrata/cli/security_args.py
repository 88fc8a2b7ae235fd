"""The security flags of ``serve``, ``router`` and ``up`` and what they build.

One place for them, so the worker and the front door read keys, audit and HTTPS settings the
same way: ``worker_auth`` / ``frontdoor_auth`` build the ``HttpAuth`` guard (and print the
start-up line that says how callers are authenticated), ``tls_files`` is what uvicorn serves
HTTPS with, ``read_key_file`` reads a key a process presents (the router's fleet key).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvstrata.errors import ConfigError
from kvstrata.security import AuditLog, Authenticator, SecurityConfig
from kvstrata.security.files import check_credential_file
from kvstrata.serve.auth import HttpAuth


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "security (API keys, audit records, HTTPS; see docs/security.md)"
    )
    group.add_argument(
        "--keys-file",
        type=Path,
        default=None,
        help="API keys file (hashes → tenant, roles; `kvstrata keys add` writes it); unset: "
        "single-tenant, admin/debug/dump endpoints off",
    )
    group.add_argument(
        "--fleet-key-file",
        type=Path,
        default=None,
        help="file holding the router's fleet key (one more credential, role fleet)",
    )
    group.add_argument("--audit-path", type=Path, default=None, help="audit JSON lines file")
    _tls_arguments(group)


def add_router_arguments(parser: argparse.ArgumentParser, *, fleet_key_flag: bool) -> None:
    group = parser.add_argument_group(
        "security (API keys, audit records, HTTPS; see docs/security.md)"
    )
    group.add_argument(
        "--keys-file",
        type=Path,
        default=None,
        help="API keys file the front door authenticates clients with (the workers' own)",
    )
    if fleet_key_flag:
        group.add_argument(
            "--api-key-file",
            type=Path,
            default=None,
            help="the fleet key this router presents to workers' /kv/info and /kv/dump",
        )
    group.add_argument(
        "--audit-path", type=Path, default=None, help="the front door's audit JSON lines file"
    )
    group.add_argument(
        "--tls-ca-file",
        type=Path,
        default=None,
        help="CA bundle that verifies workers' HTTPS (default: the system CAs)",
    )
    _tls_arguments(group)


def _tls_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--tls-cert-file", type=Path, default=None, help="serve HTTPS: cert (PEM)")
    group.add_argument("--tls-key-file", type=Path, default=None, help="serve HTTPS: key (PEM)")


def tls_files(security: SecurityConfig) -> tuple[str | None, str | None]:
    """uvicorn's ``ssl_certfile`` / ``ssl_keyfile`` (both None: plain HTTP)."""
    if security.tls_cert_file is None or security.tls_key_file is None:
        return None, None
    return str(security.tls_cert_file), str(security.tls_key_file)


def read_key_file(path: Path, what: str) -> str:
    check_credential_file(path, f"the {what}", secret=True)
    try:
        key = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the {what}: {exc}", source=str(path)) from exc
    if not key:
        raise ConfigError(f"the {what} is empty", source=str(path))
    return key


def worker_auth(config: SecurityConfig, admin_token: str | None, audit: AuditLog) -> HttpAuth:
    """The worker's guard; prints how it authenticates."""
    authenticator = Authenticator(
        config.keys_file, admin_token=admin_token, fleet_key=config.fleet_key
    )
    extra = [n for n, on in (("admin token", admin_token), ("fleet key", config.fleet_key)) if on]
    _announce(authenticator, config.keys_file, extra)
    return HttpAuth(authenticator, audit)


def frontdoor_auth(keys_file: Path | None, audit: AuditLog) -> HttpAuth:
    """The front door's guard (the operator's keys file, no extra credential)."""
    authenticator = Authenticator(keys_file)
    _announce(authenticator, keys_file, [])
    return HttpAuth(authenticator, audit)


def _announce(authenticator: Authenticator, keys_file: Path | None, extra: list[str]) -> None:
    also = f" (+ {', '.join(extra)})" if extra else ""
    if keys_file is not None:
        print(
            f"  security: {authenticator.key_count} keys, {authenticator.tenant_count} tenants"
            f"{also} from {keys_file}",
            flush=True,
        )
    elif extra:
        print(f"  security: single-tenant: no keys file, clients are anonymous{also}", flush=True)
    else:
        print(
            "  security: single-tenant: no keys file (admin, debug and dump endpoints are off)",
            flush=True,
        )
