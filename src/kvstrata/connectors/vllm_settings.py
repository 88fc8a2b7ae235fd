"""``kv_connector_extra_config`` of the vLLM connector → the one ``WorkerConfig``.

The connector is configured like every kvstrata worker (``docs/configuration.md``):

- ``config``: a worker configuration file (TOML), e.g. the one ``kvstrata serve`` uses;
- any override name of ``kvstrata.runtime.config.OVERRIDES`` as a flat key, applied on top of
  the file — the keys this connector has always taken are among them: ``host_gib``,
  ``disk_dir``, ``disk_gib``, ``disk_write``, ``durable``, ``policy``, ``tenant_secret_file``,
  ``events_endpoint``, ``events_replay_endpoint``, ``events_topic``, ``worker_id``,
  ``stats_path``, ``lookup_timeout_ms``; a shared remote tier: ``remote_url`` (or
  ``remote_cluster``), ``remote_gib``, ``remote_namespace``, ``remote_write_policy``.

Security: ``lookup_curve_secret_file`` (``[connector]``) makes the scheduler → worker lookup
socket a CURVE pair (``vllm_lookup``); ``security.audit_path`` is where the worker side's
store writes its audit lines (component ``vllm-connector``).

At least one tier must be configured (a remote tier alone will do: vLLM instances sharing its
url and namespace reuse each other's prefixes). A remote tier unreachable at start-up is left
out with a warning; without any tier left, vLLM runs without kvstrata's KV. ``pool`` and
``model`` settings are the reference engine's and are ignored here (vLLM owns its pool and
model).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvstrata.errors import ConfigError
from kvstrata.events.curve import CurveKeyError, KeyPair
from kvstrata.runtime.config import WorkerConfig, load_worker_config
from kvstrata.security.audit import AuditLog

SOURCE = "kv_connector_extra_config"


def connector_config(extra: Mapping[str, Any] | None) -> WorkerConfig:
    settings = dict(extra or {})
    path = settings.pop("config", None)
    config = load_worker_config(
        Path(path) if path else None, settings, source=None if path else SOURCE
    )
    if not config.tiers:
        raise ConfigError(
            "the kvstrata connector needs a tier: host_gib, disk_dir + disk_gib and/or "
            "remote_url + remote_gib, or [[tiers]] in the config file",
            source=SOURCE,
        )
    return config


def lookup_keys(config: WorkerConfig) -> KeyPair | None:
    """The lookup socket's CURVE certificate (read once, by each connector side)."""
    path = config.lookup_curve_secret_file
    if path is None:
        return None
    try:
        return KeyPair.from_file(path)
    except CurveKeyError as exc:
        raise ConfigError(str(exc), key="connector.lookup_curve_secret_file") from exc


def connector_audit(config: WorkerConfig) -> AuditLog:
    """The worker side's audit log (``security.audit_path``; unset: the ``kvstrata.audit``
    logger), not started: the connector starts it with its store and closes it after."""
    return AuditLog(config.security.audit_path, component="vllm-connector")
