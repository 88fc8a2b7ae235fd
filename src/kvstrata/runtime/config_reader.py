"""The generic machinery that reads a worker's TOML, before any section means anything.

``merge`` lays a parsed mapping over a file's tables; ``check_keys`` checks every key against
the schema (``config_schema.BY_PATH``) so a typo is an error, not a silent default; ``Reader``
gives typed access to one table (coercing by the schema's type, defaulting absent and null
keys) and names ``prefix.key`` and the file in every ``ConfigError``. ``read_secret`` and
``text`` read the secret files a config names (tenant secret, tokens, passwords).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvstrata.errors import ConfigError
from kvstrata.runtime.config_schema import BY_PATH, TABLES
from kvstrata.runtime.read_layouts import READ_LAYOUTS
from kvstrata.security.files import check_credential_file


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for name, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(name), dict):
            out[name] = merge(out[name], value)
        else:
            out[name] = value
    return out


def check_keys(data: Mapping[str, Any], where: str) -> None:
    for name, value in data.items():
        if name in TABLES:
            entries = value if name == "tiers" else [value]
            if name == "tiers" and not isinstance(value, list):
                raise ConfigError("must be an array of tables ([[tiers]])", key=name, source=where)
            for entry in entries:
                if not isinstance(entry, Mapping):
                    raise ConfigError("must be a table", key=name, source=where)
                _check_table(name, entry, where)
        elif name not in BY_PATH:
            raise ConfigError("unknown key", key=name, source=where)


def _check_table(prefix: str, table: Mapping[str, Any], where: str) -> None:
    for name, value in table.items():
        path = f"{prefix}.{name}"
        if path == "tiers.rollout":
            if not isinstance(value, Mapping):
                raise ConfigError("must be a table", key=path, source=where)
            _check_table(path, value, where)
        elif path == READ_LAYOUTS:
            if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
                raise ConfigError("must be an array of tables", key=path, source=where)
            for entry in value:
                _check_table(path, entry, where)
        elif path not in BY_PATH:
            raise ConfigError("unknown key", key=path, source=where)


class Reader:
    """Typed access to one table of the raw data, naming ``prefix.key`` in every error."""

    def __init__(self, table: Mapping[str, Any], prefix: str, where: str, base: Path) -> None:
        self.table, self.prefix, self.where, self.base = table, prefix, where, base

    def get(self, name: str) -> Any:
        path = f"{self.prefix}{name}"
        key = BY_PATH[path]
        value = self.table.get(name)
        if value is None:  # absent, or null in a parsed mapping: the default
            value = key.default
        if value is None:
            return None
        try:
            return _coerce(key.type, value, self.base)
        except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: float(10**400)
            raise ConfigError(f"{exc} (got {value!r})", key=path, source=self.where) from None

    def fail(self, name: str, message: str) -> ConfigError:
        return ConfigError(message, key=f"{self.prefix}{name}", source=self.where)


def _coerce(kind: str, value: Any, base: Path) -> Any:
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise TypeError("expected true or false")
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise TypeError("expected an integer")
        return int(value)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise TypeError("expected a number")
        number = float(value)
        if not math.isfinite(number):  # nan and inf pass every comparison check below
            raise ValueError("expected a finite number")
        return number
    if kind == "str":
        if not isinstance(value, str):
            raise TypeError("expected a string")
        return value
    if kind == "path":
        if not isinstance(value, str | Path):
            raise TypeError("expected a path")
        if "\0" in str(value):
            raise ValueError("a path cannot hold a NUL character")
        try:
            path = Path(value).expanduser()
        except RuntimeError:  # "~user" of no such user
            raise ValueError("cannot expand '~' in this path") from None
        return path if path.is_absolute() else base / path
    if kind == "list[str]":
        if isinstance(value, str):
            value = [part for part in value.split(",") if part]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise TypeError("expected a list of strings")
        return list(value)
    if kind == "table[float]":
        if not isinstance(value, Mapping):
            raise TypeError("expected a table of numbers")
        return {str(k): _coerce("float", v, base) for k, v in value.items()}
    raise AssertionError(kind)


def read_secret(path: Path | None, key: str, where: str) -> bytes:
    if path is None:
        return b""
    check_credential_file(path, key, secret=True)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}", key=key, source=where) from exc
    if not raw.strip():  # an empty secret would silently mean none (or no admin at all)
        raise ConfigError(f"{path} is empty", key=key, source=where)
    return raw


def text(secret: bytes, key: str, where: str) -> str:
    """A token or password file's text (stripped); not UTF-8 is a ConfigError."""
    try:
        return secret.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError("the file is not UTF-8 text", key=key, source=where) from None
