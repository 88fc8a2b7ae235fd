"""``kvstrata keys add``: mint an API key and append its hash to a keys file.

The key is printed once, on stdout, and never stored: the file gets only its ``sha256:``
hash (``security.keys.keys_entry_toml``). The file is created 0600; before anything is
written, the file as it would become is parsed, so a bad tenant name or a duplicate id never
leaves a keys file that servers would refuse to reload.
"""

from __future__ import annotations

import argparse
import os
import secrets
import tomllib
from pathlib import Path
from typing import Any

from kvstrata.errors import ConfigError, InvalidInput
from kvstrata.security import Role, generate_api_key
from kvstrata.security.keys import keys_entry_toml, parse_keys, valid_namespace


def register(sub: Any) -> None:
    keys = sub.add_parser("keys", help="manage API keys (keys file of hashes)")
    actions = keys.add_subparsers(dest="keys_command", required=True)
    add = actions.add_parser(
        "add",
        help="mint a key for a tenant, append its hash to the keys file, print the key once",
    )
    add.add_argument("--file", type=Path, required=True, help="the keys file (created 0600)")
    add.add_argument("--tenant", required=True, help="the tenant whose namespace the key uses")
    add.add_argument(
        "--role",
        action="append",
        choices=[r.value for r in Role],
        default=None,
        help="a role of the key (repeatable; default: tenant)",
    )
    add.add_argument(
        "--sub-namespaces",
        action="store_true",
        help="X-Kvstrata-Tenant may narrow to TENANT/<sub> (e.g. one per conversation)",
    )
    add.add_argument("--id", default=None, help="the key's id in audit records (default: random)")
    add.set_defaults(func=run_add)


def run_add(args: argparse.Namespace) -> int:
    tenant: str = args.tenant
    if not valid_namespace(tenant) or '"' in tenant or "\\" in tenant:
        raise InvalidInput("--tenant must be 1..128 printable characters, no quotes")
    key_id: str = args.id or f"{tenant}-{secrets.token_hex(4)}"
    if '"' in key_id or "\\" in key_id:
        raise InvalidInput("--id may not hold quotes or backslashes")
    roles = [Role(r) for r in dict.fromkeys(args.role or [Role.TENANT.value])]
    key = generate_api_key()
    path: Path = args.file
    existing = path.read_text(encoding="utf-8") if path.exists() else ""
    entry = keys_entry_toml(key_id, key, tenant, roles, args.sub_namespaces)
    try:  # the file as it will be, parsed before anything is written
        parse_keys(tomllib.loads(existing + entry), str(path))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}", source=str(path)) from exc
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as out:
        out.write(entry)
    print(key)
    return 0
