"""The worker configuration's reference page (``docs/configuration.md``), rendered from the
schema's ``KEYS`` and the ``OVERRIDES``."""

from __future__ import annotations

from typing import Any

from kvstrata.runtime.config_overrides import OVERRIDE_LIST
from kvstrata.runtime.config_schema import KEYS


def reference_markdown() -> str:
    """``docs/configuration.md``, generated from ``KEYS`` and ``OVERRIDES``."""
    lines = [
        "# Worker configuration reference",
        "",
        "Generated from `kvstrata.runtime.config_schema` and `config_overrides`",
        "(`tests/test_worker_config.py` checks that this page is current; regenerate with",
        "`kvstrata config --reference > docs/configuration.md`).",
        "",
        "One TOML file configures `kvstrata serve --config F`, `kvstrata up --config F` (every",
        "worker gets the same file) and the vLLM connector",
        '(`kv_connector_extra_config = {"config": F}`). Command-line flags and flat connector',
        "keys override it (table at the end).",
        "See `examples/worker.toml`.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for key in KEYS:
        default = "—" if key.default is None else f"`{_toml_value(key.default)}`"
        path = key.path.replace("tiers.", "[[tiers]] ", 1)
        meaning = key.help.replace("|", "\\|")
        lines.append(f"| `{path}` | {key.type} | {default} | {meaning} |")
    lines += [
        "",
        "## Overrides",
        "",
        "`kvstrata serve` flags are these names with dashes (`--host-gib`); the connector takes",
        "them as flat keys of `kv_connector_extra_config` beside `config`. They apply whatever",
        "order they come in: an override of every tier reaches every tier, one that a size adds",
        "included, and a size of 0 removes its tier even when another override names it.",
        "",
        "| override | sets |",
        "|---|---|",
    ]
    lines += [f"| `{o.name}` | {o.help} |" for o in OVERRIDE_LIST]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{}"
    return str(value)
