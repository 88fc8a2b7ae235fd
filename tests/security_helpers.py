"""Credentials for tests of servers that are secure by default.

Without a keys file or admin token, a server's ``/admin/*``, ``/kv/dump`` and debug endpoints
are off; tests that need them use these fixed keys. ``write_keys_file`` writes a keys file
(hashes only) with an admin key (tenant ``default``, roles tenant + admin), the router's
fleet key and a second tenant's key (``someone-else``, tenant + observer).
"""

from __future__ import annotations

from pathlib import Path

from kvstrata.security import Authenticator, Role
from kvstrata.security.keys import keys_entry_toml
from kvstrata.serve.auth import HttpAuth

ADMIN_KEY = "kvs_test-admin-key-0000000000000000000000000000"
FLEET_KEY = "kvs_test-fleet-key-0000000000000000000000000000"
OTHER_KEY = "kvs_test-other-key-0000000000000000000000000000"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def write_keys_file(path: Path, extra: str = "") -> Path:
    path.write_text(
        keys_entry_toml("test-admin", ADMIN_KEY, "default", [Role.TENANT, Role.ADMIN], False)
        + keys_entry_toml("test-fleet", FLEET_KEY, "default", [Role.FLEET], False)
        + keys_entry_toml(
            "test-other", OTHER_KEY, "someone-else", [Role.TENANT, Role.OBSERVER], False
        )
        + extra
    )
    path.chmod(0o600)
    return path


def write_key(path: Path, key: str) -> Path:
    """A file holding one key (``--api-key-file``, ``--fleet-key-file``)."""
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


def admin_auth() -> HttpAuth:
    """A single-tenant guard with the admin token ``ADMIN_KEY`` (every role)."""
    return HttpAuth(Authenticator(admin_token=ADMIN_KEY))


def fleet_security(directory: Path) -> tuple[str, list[str]]:
    """For a fleet under test: the ``[security]`` table every worker's (and the router's)
    configuration gets (the keys file above) and the router's ``--api-key-file`` flags
    (``FLEET_KEY``). Clients then send ``bearer(ADMIN_KEY)``."""
    keys = write_keys_file(directory / "keys.toml")
    fleet_key = write_key(directory / "fleet.key", FLEET_KEY)
    return f'[security]\nkeys_file = "{keys}"\n', ["--api-key-file", str(fleet_key)]
