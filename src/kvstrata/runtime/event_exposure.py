"""Who may listen to a worker's KV events: CURVE keys, and no plaintext beyond this machine.

The events carry every tenant's token ids. ``exposure_check`` refuses plaintext sockets that
other machines can reach (a ``ConfigError`` naming the fix) and warns about plaintext ones on
loopback; ``curve_server_of`` reads the CURVE keys of an ``[events]`` table once, at the edge.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import TYPE_CHECKING

from kvstrata.errors import ConfigError
from kvstrata.events.curve import CurveKeyError, CurveServer

if TYPE_CHECKING:
    from kvstrata.runtime.events import KVEventsConfig

_log = logging.getLogger("kvstrata.runtime.events")


def is_local_endpoint(endpoint: str) -> bool:
    """Can only this machine reach ``endpoint``? (``ipc``/``inproc``, or tcp on loopback.)"""
    transport, _, rest = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name, a hostname or "*": reachable from elsewhere


def exposure_check(config: KVEventsConfig) -> None:
    """Refuse plaintext event sockets reachable from other machines (``ConfigError``); warn
    about plaintext ones on loopback (any local process may read every tenant's tokens)."""
    if config.curve:
        return
    endpoints = [e for e in (config.endpoint, config.replay_endpoint) if e is not None]
    exposed = [e for e in endpoints if not is_local_endpoint(e)]
    if exposed:
        raise ConfigError(
            f"the KV event sockets {', '.join(exposed)} would publish every tenant's token "
            "ids in plaintext beyond this machine: set events.curve_secret_file and "
            "events.curve_clients_dir (serve: --curve-secret-file, --curve-clients-dir; "
            "`kvstrata up` generates them), or bind to 127.0.0.1 / ipc://",
            key="events.endpoint",
        )
    _log.warning(
        "KV events on %s without CURVE: any local process can read them "
        "(set events.curve_secret_file and events.curve_clients_dir to encrypt)",
        ", ".join(endpoints),
    )


def curve_server_of(config: KVEventsConfig) -> CurveServer | None:
    """The CURVE keys of ``config`` (read once, at the edge); ``ConfigError`` if unusable."""
    if config.curve_secret_file is None or config.curve_clients_dir is None:
        return None
    try:
        return CurveServer.from_files(config.curve_secret_file, config.curve_clients_dir)
    except CurveKeyError as exc:
        raise ConfigError(str(exc), key="events.curve_secret_file") from exc
