"""The credentials ``kvstrata up`` mints for one run, in a run directory (0700) removed when
``up`` returns.

* **Fleet key** (:func:`mint_fleet_key`): always; every worker gets it as ``--fleet-key-file`` (one
  more credential, role fleet, beside the operator's ``--keys-file`` if any, which the workers
  and the front door read in place, so editing it takes effect without a restart); the router
  presents it to read ``/kv/info`` and ``/kv/dump``.
* **CURVE certificates** (:func:`fleet_curve`): the event streams' keys.
* **Tenant secret** (:func:`mint_tenant_secret`): only for a fleet with decode workers and no
  configured ``tenant_secret_file``. A decode worker's transfer listener authenticates every
  sender's intro with the tenant secret, and refuses to start without one (anyone reaching its
  port could otherwise write KV for any tenant). A minted secret changes every tenant's keys,
  so KV a shared or persistent tier keeps across runs is not found again: set one to keep it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.fleet.curve_keys import FleetKeys


def mint_fleet_key(cleanup: contextlib.ExitStack) -> tuple[str, Path]:
    """A new fleet key and the file holding it, in a run directory removed at exit."""
    from kvstrata.security import generate_api_key

    run_dir = Path(tempfile.mkdtemp(prefix="kvstrata-up-"))  # mode 0700
    cleanup.callback(shutil.rmtree, run_dir, ignore_errors=True)
    key = generate_api_key()
    return key, _write_private(run_dir / "fleet.key", key)


def fleet_curve(cleanup: contextlib.ExitStack) -> FleetKeys:
    """The fleet's CURVE certificates, in a 0700 run directory removed when ``up`` exits."""
    from kvstrata.fleet.curve_keys import FleetKeys

    keys = FleetKeys.generate()
    cleanup.callback(keys.remove)
    return keys


def mint_valkey_password(run_dir: Path) -> tuple[str, Path]:
    """A random password for ``--remote embedded``'s server, and the 0600 file holding it."""
    password = secrets.token_hex(32)
    return password, _write_private(run_dir / "valkey.password", password)


def mint_tenant_secret(run_dir: Path) -> Path:
    """A tenant secret for this run (decode workers' transfer listeners authenticate with it),
    when none is configured; KV that outlives the run in a shared tier is not found again."""
    path = _write_private(run_dir / "tenant.secret", secrets.token_hex(32))
    print(
        "kvstrata up: no tenant_secret_file: minted one for this run's transfers (set one to"
        " find stored KV again after a restart)",
        file=sys.stderr,
    )
    return path


def security_worker_args(args: argparse.Namespace, fleet_key_file: Path) -> list[str]:
    """What every worker of ``up`` gets: the fleet key and the operator's keys file."""
    extra = ["--fleet-key-file", str(fleet_key_file)]
    if args.keys_file is not None:
        extra += ["--keys-file", str(args.keys_file.resolve())]
    return extra


def _write_private(path: Path, text: str) -> Path:
    """A new file readable by its owner only (0600), holding ``text`` and a newline."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text + "\n")
    return path
