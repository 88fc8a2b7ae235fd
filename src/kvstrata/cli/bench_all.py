"""``kvstrata bench all`` and ``kvstrata bench render``: every benchmark, one results page.

``bench all`` runs the plan (:mod:`kvstrata.cli.bench_plan`), each entry as its own
``kvstrata`` subprocess (so one benchmark's crash, memory or threads cannot touch the next),
with ``KVSTRATA_BENCH_RECORD`` set so the benchmark's own table and JSON land in a record
(:mod:`kvstrata.cli.output`). It prints one bundle (``--json``) or a summary table, and
writes the plots it can draw under ``--plots``. ``bench render BUNDLE --out docs/results.md``
turns a bundle into the page (:mod:`kvstrata.bench.results_page`), so the page is always
regenerated from measurements, never edited::

    kvstrata bench all --json --plots docs/img > results.json
    kvstrata bench render results.json --out docs/results.md

``--quick`` runs every entry on small inputs (a smoke test of the whole pipeline, minutes);
its figures are not the published ones. ``--only``/``--skip`` select entries by name. An
entry whose prerequisite is missing (the vLLM venv, the trace file) is recorded as *skipped*
with the reason; one that exits non-zero is recorded as *failed* with its stderr's last line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvstrata.bench.results_page import render_page
from kvstrata.cli.bench_plan import MOONCAKE, PLAN, PLOTS, Entry
from kvstrata.cli.machine import cpu_detail, cpu_model, memory_gib
from kvstrata.cli.output import RECORD_ENV, emit
from kvstrata.cli.vllm_venv import vllm_python
from kvstrata.errors import InvalidInput

__all__ = ["MOONCAKE", "PLAN", "PLOTS", "Entry", "merge_bundles", "register", "run_entry", "select"]


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "all", help="run every benchmark and print one bundle for `kvstrata bench render`"
    )
    parser.add_argument("--quick", action="store_true", help="small inputs (a smoke test)")
    parser.add_argument("--only", help="comma-separated entry names")
    parser.add_argument("--skip", help="comma-separated entry names")
    parser.add_argument("--plots", default="docs/img", help="directory for plots")
    parser.add_argument("--list", action="store_true", help="print the plan and exit")
    parser.add_argument("--json", action="store_true", help="print the bundle as JSON")
    parser.set_defaults(func=run_all)
    render = sub.add_parser("render", help="render a `bench all` bundle to Markdown")
    render.add_argument(
        "bundle", nargs="+", help="JSON file(s) printed by `kvstrata bench all --json`"
    )
    render.add_argument("--out", help="write the page here (default: stdout)")
    render.set_defaults(func=run_render)


def select(plan: Sequence[Entry], only: str | None, skip: str | None) -> list[Entry]:
    names = {entry.name for entry in plan}
    wanted = set(_names(only)) if only else names
    unwanted = set(_names(skip)) if skip else set()
    unknown = (wanted | unwanted) - names
    if unknown:
        raise InvalidInput(f"unknown benchmark(s) {sorted(unknown)}; known: {sorted(names)}")
    return [entry for entry in plan if entry.name in wanted - unwanted]


def run_all(args: argparse.Namespace) -> int:
    entries = select(PLAN, args.only, args.skip)
    plots = Path(args.plots)
    if args.list:
        for entry in entries:
            print(f"{entry.name}: kvstrata {shlex.join(entry.argv(quick=args.quick, plots=plots))}")
        return 0
    plots.mkdir(parents=True, exist_ok=True)
    vllm_ok = vllm_python(args).is_file()
    meta = machine_meta(quick=args.quick)
    benches = []
    for entry in entries:
        print(f"bench all: {entry.name} …", file=sys.stderr, flush=True)
        run = run_entry(entry, quick=args.quick, plots=plots, vllm_ok=vllm_ok)
        benches.append({**run, "commit": meta["commit"], "date": _now()})
    bundle = {"meta": meta, "benches": benches}
    emit(
        bundle,
        as_json=args.json,
        title="kvstrata bench all" + (" (quick: smoke-test inputs)" if args.quick else ""),
        columns=("benchmark", "status", "seconds"),
        rows=[(b["name"], b["status"], b["seconds"]) for b in benches],
    )
    return 0 if all(b["status"] != "failed" for b in benches) else 1


def run_entry(
    entry: Entry,
    *,
    quick: bool,
    plots: Path,
    vllm_ok: bool,
    runner: Callable[[list[str], dict[str, str]], tuple[int, str]] | None = None,
) -> dict[str, Any]:
    argv = entry.argv(quick=quick, plots=plots)
    out: dict[str, Any] = {
        "name": entry.name,
        "command": "kvstrata " + shlex.join(argv),
        "about": entry.about,
        "plots": [],
        "seconds": None,
    }
    missing = [path for path in entry.needs if not Path(path).exists()]
    if missing or (entry.needs_vllm and not vllm_ok):
        reason = f"missing {missing[0]}" if missing else "no vLLM venv (`make vllm-venv`)"
        return {**out, "status": "skipped", "reason": reason}
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-") as scratch:
        record_path = Path(scratch) / "record.json"
        env = {**os.environ, RECORD_ENV: str(record_path)}
        start = time.monotonic()
        code, stderr_tail = (runner or _subprocess)(argv, env)
        out["seconds"] = round(time.monotonic() - start, 1)
        record = json.loads(record_path.read_text()) if record_path.is_file() else None
    if code != 0 or record is None:
        reason = stderr_tail or f"exit status {code}, no record written"
        return {**out, "status": "failed", "reason": reason}
    out["record"] = record
    out["plots"] = [f"{plots.name}/{name}" for name in entry.plots if (plots / name).is_file()]
    if entry.eviction_plot:
        name = f"{entry.name}.png"
        from kvstrata.bench.plots import plot_eviction_curves

        plot_eviction_curves(record["result"], plots / name, title=entry.name)
        out["plots"].append(f"{plots.name}/{name}")
    return {**out, "status": "ok"}


def _subprocess(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "kvstrata.cli.main", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return done.returncode, (lines[-1][:300] if lines else "")


def machine_meta(*, quick: bool) -> dict[str, Any]:
    """Where and when the figures were taken: machine, date, commit, versions."""
    return {
        "date": _now(),
        "commit": _git("rev-parse", "--short", "HEAD") + (" (dirty)" if _git_dirty() else ""),
        "cpu": cpu_model(),
        "cpu_detail": cpu_detail(),
        "cores": os.cpu_count(),
        "memory_gib": memory_gib(),
        "gpu": "none" if not Path("/dev/nvidia0").exists() else "present",
        "python": platform.python_version(),
        "inputs": "quick (smoke test, not published figures)" if quick else "full",
    }


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")


def run_render(args: argparse.Namespace) -> int:
    bundle = merge_bundles([json.loads(Path(p).read_text()) for p in args.bundle])
    page = render_page(bundle, plan=[entry.name for entry in PLAN])
    if args.out:
        Path(args.out).write_text(page)
    else:
        sys.stdout.write(page)
    return 0


def merge_bundles(bundles: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several ``bench all`` runs as one page: benchmarks in plan order (a later run of the
    same name replaces an earlier one: runs are taken in the order of their ``meta.date``,
    then as given, so the page does not depend on the order of the files), the machine of
    the last run; each benchmark keeps the date, commit and CPU of its own run (runs from
    several machines can share a page)."""
    bundles = sorted(bundles, key=lambda bundle: str(bundle.get("meta", {}).get("date", "")))
    benches: dict[str, dict[str, Any]] = {}
    for bundle in bundles:
        cpu = bundle.get("meta", {}).get("cpu")
        if cpu and bundle["meta"].get("cpu_detail"):
            cpu = f"{cpu} ({bundle['meta']['cpu_detail']})"
        for bench in bundle.get("benches", []):
            benches.pop(bench["name"], None)
            benches[bench["name"]] = {"cpu": cpu, **bench} if cpu else bench
    meta = dict(bundles[-1].get("meta", {})) if bundles else {}
    meta.pop("date", None)
    meta.pop("commit", None)
    order = {entry.name: index for index, entry in enumerate(PLAN)}
    ordered = sorted(benches.values(), key=lambda bench: order.get(bench["name"], len(order)))
    return {"meta": meta, "benches": ordered}


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def _git_dirty() -> bool:
    return bool(_git("status", "--porcelain", "--untracked-files=no").replace("unknown", ""))
