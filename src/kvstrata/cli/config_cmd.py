"""``kvstrata config``: check a worker configuration file, or print the reference page."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvstrata.runtime.config import WorkerConfig, load_worker_config
from kvstrata.runtime.config_reference import reference_markdown


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "config",
        help="check a worker configuration file, or print the configuration reference",
        description="Validate FILE as `kvstrata serve --config FILE` would and print the "
        "resolved settings (secrets shown as digests), or print docs/configuration.md.",
    )
    parser.add_argument("file", type=Path, nargs="?", default=None, help="worker config (TOML)")
    parser.add_argument("--reference", action="store_true", help="print the reference page")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.reference:
        sys.stdout.write(reference_markdown())
        return 0
    config = load_worker_config(args.file)
    print(json.dumps(describe(config), indent=2, sort_keys=True))
    return 0


def describe(config: WorkerConfig) -> dict[str, Any]:
    """The resolved configuration as plain data, with the secret replaced by its digest."""
    return {
        "model": config.model,
        "served_model_name": config.served_model_name,
        "pool_bytes": config.pool_bytes,
        "block_size": config.block_size,
        "tiers": [
            {
                "name": spec.name,
                "capacity_bytes": spec.capacity_bytes,
                "path": str(spec.path) if spec.path else None,
                "durable": spec.durable,
                "eviction_policy": spec.eviction_policy,
                "verify_reads": spec.config.verify_reads,
                "write_policy": spec.config.write_policy.value,
                "ttl_s": spec.config.ttl_s,
                "tenant_quota_bytes": dict(spec.config.tenant_quota_bytes),
                "default_tenant_quota_bytes": spec.config.default_tenant_quota_bytes,
                "selective_min_uses": spec.config.selective_min_uses,
                "write_back_max_bytes": spec.config.write_back_max_bytes,
                "rollout": {
                    "enabled": spec.config.rollout.enabled,
                    "tenants": sorted(spec.config.rollout.tenants or []) or None,
                    "models": sorted(spec.config.rollout.models or []) or None,
                    "canary": spec.config.rollout.canary_fraction,
                    "min_reusable_tokens": spec.config.rollout.min_reusable_tokens,
                },
            }
            for spec in config.tiers
        ],
        "events": None
        if config.events is None
        else {
            "endpoint": config.events.endpoint,
            "replay_endpoint": config.events.replay_endpoint,
            "worker_id": config.events.worker_id,
            "topic": config.events.topic,
            "buffer_steps": config.events.buffer_steps,
        },
        "secret_digest": config.secret_digest,
        "admin_token": "set" if config.admin_token else None,
        "debug_endpoints": config.debug_endpoints,
        "limits": {
            "max_tokens": config.limits.max_tokens,
            "max_body_bytes": config.limits.max_body_bytes,
            "body_timeout_s": config.limits.body_timeout_s,
        },
        "lookup_timeout_ms": config.lookup_timeout_ms,
        "stats_path": str(config.stats_path) if config.stats_path else None,
    }
