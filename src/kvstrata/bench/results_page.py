"""The results page: one bundle of benchmark records → ``docs/results.md``.

A *bundle* is what ``kvstrata bench all --json`` prints: ``{"meta": {...}, "benches": [...]}``
with one entry per benchmark run, in plan order::

    {"name": "eviction-mooncake", "command": "kvstrata bench eviction --trace …",
     "about": "what it measures and against which peer",
     "status": "ok" | "failed" | "skipped", "reason": "…",        # reason unless ok
     "seconds": 12.3,                                              # wall time of the run
     "record": {"title", "columns", "rows", "result"},             # as ``emit`` wrote it
     "plots": ["eviction-mooncake.png", …]}                        # relative to the page

:func:`render_page` is pure (bundle in, Markdown out): the page shows each benchmark's own
table exactly as the benchmark printed it (the title states its peer), the command that
produced it, and what the benchmark itself reports about repetitions and spread
(:func:`method_line`, read from the result's ``repeats``/``repetitions`` and spread fields). A
benchmark that failed or was skipped is listed with its reason: a missing figure stays visible.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

REPEAT_FIELDS: Final = ("repeats", "repetitions", "repeat", "runs")
SPREAD_WORDS: Final = frozenset({"spread", "lo", "hi", "iqr", "stdev", "interval", "samples"})
"""Words of a result key (split at ``_``) that mark a spread figure."""
SPREAD_NAMES: Final = frozenset({"min", "max", "runs"})
"""Whole key names that do (``{"median", "min", "max"}``-style objects, per-run lists)."""
SPREAD_SUFFIX: Final = re.compile(r"(ratio|p\d+|_s|_ms|gbps)_(min|max)$")
"""``…_ratio_min``, ``…_p99_max``: the extremes of a repeated figure (not ``tokens_max``)."""


def render_page(bundle: Mapping[str, Any], plan: Sequence[str] = ()) -> str:
    """The whole Markdown page of one bundle; ``plan`` names every benchmark of the plan, so
    one the bundle lacks is listed as not run."""
    meta = bundle.get("meta", {})
    benches: Sequence[Mapping[str, Any]] = bundle.get("benches", [])
    ran = {bench["name"] for bench in benches}
    missing = [name for name in plan if name not in ran]
    lines = [
        "# Measured results",
        "",
        "Generated from `kvstrata bench all --json` bundles (this page's are kept in "
        "`docs/bench/`) by `kvstrata bench render BUNDLE… --out docs/results.md`; do not edit "
        "by hand. Each benchmark's own commit, date and CPU are in the table below (the machine "
        "table describes the last run; timings compare only within one CPU's runs); the narrative "
        "history of earlier measurements is in `docs/results-history.md`.",
        "",
        _meta_table(meta),
        "",
        "| benchmark | status | seconds | commit | date | cpu |",
        "|---|---|---|---|---|---|",
    ]
    for bench in benches:
        status = bench.get("status", "?")
        if status != "ok":
            status = f"{status}: {bench.get('reason', '')}"
        lines.append(
            f"| {bench['name']} | {_cell(status)} | {_seconds(bench.get('seconds'))} "
            f"| {bench.get('commit', '-')} | {bench.get('date', '-')} "
            f"| {bench.get('cpu', meta.get('cpu', '-'))} |"
        )
    lines.extend(f"| {name} | not run in this bundle | - | - | - | - |" for name in missing)
    for bench in benches:
        lines.extend(["", *render_bench(bench)])
    return "\n".join(lines) + "\n"


def render_bench(bench: Mapping[str, Any]) -> list[str]:
    """One benchmark's section: heading, command, what it compares, table, method, plots."""
    lines = [f"## {bench['name']}", ""]
    if bench.get("about"):
        lines.extend([str(bench["about"]), ""])
    lines.extend([f"`{bench.get('command', '')}`", ""])
    record = bench.get("record")
    if bench.get("status") != "ok" or not record:
        lines.append(f"**Not measured** ({bench.get('status', '?')}): {bench.get('reason', '')}")
        return lines
    lines.append(f"**{_cell(record.get('title', ''))}**")
    lines.append("")
    lines.extend(markdown_table(record.get("columns", []), record.get("rows", [])))
    lines.extend(["", method_line(record.get("result", {}))])
    for plot in bench.get("plots", []):
        lines.extend(["", f"![{bench['name']}]({plot})"])
    return lines


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = [
        "| " + " | ".join(_cell(c) for c in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines.extend("| " + " | ".join(_cell(v) for v in row) + " |" for row in rows)
    return lines


def method_line(result: Mapping[str, Any]) -> str:
    """What the result says about its repetitions and spread (or that it says nothing),
    after its own ``method`` sentence when it has one."""
    repeats = next((result[k] for k in REPEAT_FIELDS if k in result), None)
    spread = sorted(key for key in _flat_keys(result) if _is_spread(key))
    parts = [
        f"repetitions: {repeats}" if repeats is not None else "repetitions: not reported",
        ("spread fields: " + ", ".join(f"`{k}`" for k in spread[:8]))
        + (f" (+{len(spread) - 8} more)" if len(spread) > 8 else "")
        if spread
        else "spread: not reported",
    ]
    if isinstance(result.get("method"), str):
        parts.insert(0, result["method"])
    return "*" + "; ".join(parts) + ".*"


def _is_spread(key: str) -> bool:
    last = key.rsplit(".", 1)[-1].lower()
    return (
        last in SPREAD_NAMES
        or bool(SPREAD_WORDS.intersection(last.split("_")))
        or SPREAD_SUFFIX.search(last) is not None
    )


def _flat_keys(value: Any, prefix: str = "", depth: int = 0) -> set[str]:
    if not isinstance(value, Mapping) or depth > 3:
        return set()
    keys: set[str] = set()
    for key, inner in value.items():
        name = f"{prefix}{key}"
        keys.add(name)
        keys |= _flat_keys(inner, f"{name}.", depth + 1)
    return keys


def _meta_table(meta: Mapping[str, Any]) -> str:
    rows = [(str(k), str(v)) for k, v in meta.items()]
    return "\n".join(markdown_table(("machine and run", ""), rows))


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _seconds(value: Any) -> str:
    return "-" if value is None else f"{float(value):.0f}"
