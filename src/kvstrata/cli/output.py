"""Printing results: one JSON object with ``--json``, otherwise a human table."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table


def emit(
    result: Mapping[str, Any],
    *,
    as_json: bool,
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result, sort_keys=False) + "\n")
        sys.stdout.flush()
        return
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(_fmt(v) for v in row))
    Console().print(table)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
