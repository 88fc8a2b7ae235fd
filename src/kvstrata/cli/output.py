"""Printing results: one JSON object with ``--json``, otherwise a human table.

When ``KVSTRATA_BENCH_RECORD`` names a file, :func:`emit` also writes the table *and* the
result there as one JSON object (``title``, ``columns``, ``rows`` as printed, ``result``):
``kvstrata bench all`` runs every benchmark as a subprocess with it set, so the results page
shows each benchmark's own table, formatted by the one :func:`format_cell`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

RECORD_ENV = "KVSTRATA_BENCH_RECORD"


def emit(
    result: Mapping[str, Any],
    *,
    as_json: bool,
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
) -> None:
    table_rows = [tuple(row) for row in rows]
    record = os.environ.get(RECORD_ENV)
    if record:
        with open(record, "w", encoding="utf-8") as out:
            json.dump(
                {
                    "title": title,
                    "columns": list(columns),
                    "rows": [[format_cell(v) for v in row] for row in table_rows],
                    "result": result,
                },
                out,
            )
    if as_json:
        sys.stdout.write(json.dumps(result, sort_keys=False) + "\n")
        sys.stdout.flush()
        return
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in table_rows:
        table.add_row(*(format_cell(v) for v in row))
    Console().print(table)


def format_cell(value: Any) -> str:
    """How a table cell prints: floats to 6 significant digits, everything else as ``str``."""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
