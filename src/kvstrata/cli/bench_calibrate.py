"""``kvstrata bench calibrate``: the same Mooncake slice on a live fleet and in ``kvstrata sim``.

1. A slice of the Mooncake conversation trace (``--start-s``, ``--limit``) is scaled to the
   SmolLM2 reference engine (:mod:`kvstrata.bench.calibrate`: ``--block-tokens`` live tokens
   per trace block, prompts cut at ``--max-prompt-tokens``, outputs at ``--max-output-tokens``).
2. A live ``kvstrata up --workers N --pin-cpus`` fleet (each worker owns its share of the
   CPUs, one core each on the 2-core reference machine, as ``reference-cpu`` assumes;
   ``--no-pin-cpus`` lets them float) is started and probed one request at a time
   (:mod:`kvstrata.bench.calibrate_live`); the probes' fit is the ``measured`` prefill model.
   Arrivals are spread so the workers run at ``--utilisation`` by that model
   (``--scale-with measured``, the default: the machine's real speed sets the rate) or by
   ``reference-cpu``'s. The slice is replayed through the front door; with ``--repeats R`` the
   fleet is restarted (empty caches) for every further repetition of the same requests.
3. The same scaled requests are simulated with the ``reference-cpu`` profile of the CPU the
   fleet runs on (``headline``: ``reference-cpu`` on an Intel Xeon, ``reference-cpu-epyc`` on
   an AMD EPYC, from timings measured beforehand with ``kvstrata bench prefill``,
   :mod:`kvstrata.costs.profiles`; a CPU without timings of its own gets the Xeon's, and
   ``reference_profile.cpu_family`` is null), with every other CPU's reference profile, and
   with the headline's prefill replaced by the fit (``measured``), and, with
   ``--fresh-profile`` (the default), replaced by the reference timings re-measured by their
   own command just before the first fleet starts (``fresh``; measured again after the last
   fleet stops: ``fresh_profile.after_vs_before`` says how far the engine's speed moved
   meanwhile; :mod:`kvstrata.bench.fresh_profile`). Both replace the prefill model only
   (decode terms stay the pinned profile's). Same workers, routing policy and device pool
   (``--pool-gib`` in both), no host tier on either side.
4. Both TTFT distributions (p10/p50/p90/p99, mean) and sim ÷ live at p50 and p90. The goal
   (issue 15 item 2) is both within 0.8–1.25 for the headline profile and no failed request. With
   repetitions, the live figures are the median over repetitions of each percentile, each
   repetition's ratios are listed (``live_runs``) and ``ratio_spread`` gives their min/max.
   Each live run and each simulated profile gives its split over the workers
   (``per_worker``: requests, prompt tokens, TTFT p50 / p90); each live run, the router's
   view of every worker after the replay (``router``: ``/fleet/workers``, its online prefill
   fit) and its decisions by worker and reason (``decisions``, from ``/metrics``), and how
   well it predicted each request's TTFT (``prediction``: measured ÷ predicted, p10 / p50 /
   p90, and the share within 2×; the prediction from the front door's
   ``X-Kvstrata-Predicted-Ttft-S``), and how often two requests on one worker got their first
   tokens in the opposite order to their placements (``placement_order``: inverted pairs of
   all pairs, ``bench.calibrate.placement_order``); with ``--per-request``, every request of
   each live run (``requests``: arrival, worker, prompt and cached tokens, TTFT, prediction,
   placement and first-token times). Each live run also says how much of the machine
   processes outside the benchmark used meanwhile, and the hypervisor's steal
   (``foreign_load``, :mod:`kvstrata.bench.foreign_load`); ``machine_to_itself`` is false,
   and the title says so, when they took more than 5 % in a run: its figures measure a
   shared machine.

Recalibrating: when ``measured`` meets the goal and the headline profile does not, its
timings are off for this machine; re-measure them with ``kvstrata bench prefill`` (the command
in :mod:`kvstrata.costs.profiles`), apart from the calibration (never from its probes). Both
need the machine to themselves (``foreign_load`` says whether a run had it), and even then
the machine's speed moves: three calibrations within two hours on one EPYC gave 0.852 /
0.774, 0.930 / 0.920 and 0.789 / 0.756 with the same pinned profile (``docs/results-history.md``,
stop 41).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstrata.bench import fresh_profile
from kvstrata.bench.calibrate import (
    GOAL_HI,
    GOAL_LO,
    Scaling,
    compare,
    per_worker,
    percentiles,
    placement_order,
    predictions,
    scale_trace,
    sim_profile,
    sim_requests,
)
from kvstrata.bench.foreign_load import BUSY_SHARE, ForeignLoad
from kvstrata.cli.machine import cpu_model
from kvstrata.cli.output import RECORD_ENV, emit
from kvstrata.costs import SMOLLM2_KV_BYTES_PER_TOKEN, PrefillModel, fit
from kvstrata.errors import InvalidInput
from kvstrata.runtime.config_schema import GIB
from kvstrata.sim.cluster import SimConfig, simulate
from kvstrata.sim.profiles import REFERENCE_CPU, reference_cpu, reference_for
from kvstrata.sim.trace import select_window
from kvstrata.workloads.mooncake import read_trace

DEFAULT_TRACE = Path("..") / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
HEADLINE = "reference-cpu"
"""``--scale-with``'s name for the headline profile (the reference profile of this CPU)."""


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "calibrate",
        help="a Mooncake slice on a live `kvstrata up` fleet vs `kvstrata sim` (reference-cpu)",
    )
    s = Scaling()
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--start-s", type=float, default=600.0, help="slice start (trace s)")
    parser.add_argument("--limit", type=int, default=160, help="requests in the slice")
    parser.add_argument("--block-tokens", type=int, default=s.block_tokens)
    parser.add_argument("--max-prompt-tokens", type=int, default=s.max_prompt_tokens)
    parser.add_argument("--max-output-tokens", type=int, default=s.max_output_tokens)
    parser.add_argument("--utilisation", type=float, default=s.target_utilisation)
    parser.add_argument("--workers", type=int, default=s.workers)
    parser.add_argument("--policy", default="kvstrata", help="routing policy (both sides)")
    parser.add_argument("--pool-gib", type=float, default=1.0, help="device pool per worker")
    parser.add_argument(
        "--probe-rounds", type=int, default=2, help="rounds of prefill probes (0: no fit)"
    )
    parser.add_argument(
        "--scale-with",
        choices=["measured", HEADLINE],
        default="measured",
        help="prefill model that sets the arrival rate (measured: the probes' fit, if any; "
        "reference-cpu: the reference profile of this CPU)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="live runs (fresh fleet each)")
    parser.add_argument("--omp-threads", type=int, default=1, help="OMP_NUM_THREADS of the fleet")
    parser.add_argument(
        "--pin-cpus",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each worker owns its share of the CPUs (`up --pin-cpus`), as reference-cpu assumes",
    )
    parser.add_argument(
        "--fresh-profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="re-measure the reference timings (engine alone, one pinned core) just before the "
        "fleets and after them, and simulate with them too (`fresh`; kvstrata.bench.fresh_profile)",
    )
    parser.add_argument(
        "--fresh-points",
        default=fresh_profile.FRESH_POINTS,
        help="--fresh-profile's points, NEW or CACHED+NEW (default: the pinned profile's)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the simulator's seed")
    parser.add_argument(
        "--per-request",
        action="store_true",
        help="list every replayed request of each live run (arrival, worker, tokens, TTFT, "
        "the router's prediction) in the JSON",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def device_blocks(pool_gib: float, block_tokens: int) -> int:
    """Live blocks of ``block_tokens`` SmolLM2 fp32 tokens in ``pool_gib``."""
    return int(pool_gib * GIB) // (block_tokens * SMOLLM2_KV_BYTES_PER_TOKEN)


def run(args: argparse.Namespace) -> int:
    if args.limit < 2 or args.repeats < 1 or args.probe_rounds < 0:
        raise InvalidInput("--limit must be >= 2, --repeats >= 1, --probe-rounds >= 0")
    from kvstrata.bench.calibrate_live import LiveResult, live_fleet
    from kvstrata.router import POLICIES

    if args.policy not in POLICIES:
        raise InvalidInput(f"--policy must be one of {', '.join(POLICIES)}")
    scaling = Scaling(
        block_tokens=args.block_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        target_utilisation=args.utilisation,
        workers=args.workers,
    )
    window = select_window(read_trace(args.trace), args.start_s, None)
    window = sorted(window, key=lambda r: r.timestamp_ms)[: args.limit]
    cpu = cpu_model()
    headline, family = reference_for(cpu)
    references = {name: reference_cpu(f) for f, name in REFERENCE_CPU.items()}
    base = references[headline]
    requests, _ = scale_trace(window, scaling, base.cost.prefill)  # a bad slice fails here
    blocks = device_blocks(args.pool_gib, args.block_tokens)
    wall = time.perf_counter()
    start = functools.partial(
        live_fleet,
        workers=args.workers,
        policy=args.policy,
        pool_gib=args.pool_gib,
        omp_threads=args.omp_threads,
        pin_cpus=args.pin_cpus,
    )
    fresh = functools.partial(fresh_profile.measure, args.fresh_points, hide=(RECORD_ENV,))
    before = fresh() if args.fresh_profile else None  # a failure here stops before any fleet
    lives: list[LiveResult] = []
    loads: list[ForeignLoad] = []
    with ForeignLoad() as load, start() as fleet:
        loads.append(load)
        probes = fleet.probe(args.probe_rounds, max(r.prompt_tokens for r in requests))
        measured = fit(probes, name="reference-cpu-measured") if len(probes) >= 3 else None
        by_measured = args.scale_with == "measured" and measured is not None
        work_model = measured if by_measured and measured is not None else base.cost.prefill
        requests, record = scale_trace(window, scaling, work_model)
        record["work_model_source"] = "measured" if by_measured else headline
        lives.append(fleet.replay(requests, args.block_tokens, probes))
    for _ in range(1, args.repeats):
        with ForeignLoad() as load, start() as fleet:
            loads.append(load)
            lives.append(fleet.replay(requests, args.block_tokens))
    after = _after(fresh) if args.fresh_profile else None
    profiles = {
        name: sim_profile(references[name], args.block_tokens, blocks)
        for name in sorted(references, key=lambda n: n != headline)  # the headline first
    }
    if measured is not None:
        profiles["measured"] = sim_profile(base, args.block_tokens, blocks, prefill=measured)
    if before is not None:
        today = fresh_profile.model_of(before, f"{headline}-fresh")
        profiles["fresh"] = sim_profile(base, args.block_tokens, blocks, prefill=today)
    sims = {}
    sim_hit = {}
    sim_split = {}
    scaled = sim_requests(requests, args.block_tokens)
    for name, prof in profiles.items():
        result = simulate(
            scaled, args.policy, SimConfig(profile=prof, workers=args.workers, seed=args.seed)
        )
        sims[name] = result.ttft_s
        sim_hit[name] = result.hit_tokens / max(result.prompt_tokens, 1)
        sim_split[name] = per_worker(
            (f"w{n}", r.prompt_tokens, t)
            for n, r, t in zip(result.worker_of, requests, result.ttft_s, strict=True)
        )
    models = {name: prof.cost.prefill for name, prof in profiles.items()}
    data = _report(lives, sims, sim_hit, args, record, blocks, models, headline)
    data["reference_profile"] = {"name": headline, "cpu": cpu, "cpu_family": family}
    if before is not None and after is not None:
        drift = None if "error" in after else fresh_profile.drift(before, after)
        data["fresh_profile"] = {"before": before, "after": after, "after_vs_before": drift}
    for run, load in zip(data["live_runs"], loads, strict=True):
        run["foreign_load"] = load.figures()
    fresh_runs = [r for r in (before, after) if r is not None]  # each watched too
    taken = [_taken(run) for run in [*data["live_runs"], *fresh_runs]]
    data["machine_to_itself"] = all(t is None or t <= BUSY_SHARE for t in taken)
    for name, split in sim_split.items():
        data["sim"][name]["per_worker"] = split
    data["wall_s"] = round(time.perf_counter() - wall, 1)
    _emit(data, args)
    return 0


def _report(
    lives: list[Any],
    sims: dict[str, list[float]],
    sim_hit: dict[str, float],
    args: argparse.Namespace,
    record: dict[str, Any],
    blocks: int,
    models: dict[str, PrefillModel],
    headline: str = HEADLINE,
) -> dict[str, Any]:
    per_repeat = [compare(live.ttft_s, sims) for live in lives]
    stats = [percentiles(live.ttft_s) for live in lives]
    live_stats = {
        key: (
            statistics.median(s[key] for s in stats)  # type: ignore[type-var]
            if all(s[key] is not None for s in stats)
            else None
        )
        for key in stats[0]
    }
    live_stats["n"] = min(int(s["n"] or 0) for s in stats)  # answered in every repetition
    data: dict[str, Any] = {"live": {"ttft_s": live_stats}, "sim": {}}
    for name, values in sims.items():
        sim_stats = percentiles(values)
        p50 = _ratio(sim_stats["p50"], live_stats["p50"])
        p90 = _ratio(sim_stats["p90"], live_stats["p90"])
        ratios = [(r["sim"][name]["ratio_p50"], r["sim"][name]["ratio_p90"]) for r in per_repeat]
        data["sim"][name] = {
            "ttft_s": sim_stats,
            "ratio_p50": p50,
            "ratio_p90": p90,
            "goal_met": all(x is not None and GOAL_LO <= x <= GOAL_HI for x in (p50, p90)),
            "hit_rate": sim_hit[name],
            "ratio_spread": _spread(ratios),
        }
    head = data["sim"][headline]
    failures = [f for live in lives for f in live.failures]
    return data | {
        "ratio_p50": head["ratio_p50"],
        "ratio_p90": head["ratio_p90"],
        "goal": f"{GOAL_LO} <= sim/live <= {GOAL_HI} at p50 and p90 ({headline})",
        "goal_met": bool(head["goal_met"]) and not failures,
        "scaling": record,
        "policy": args.policy,
        "workers": args.workers,
        "pin_cpus": args.pin_cpus,
        "omp_threads": args.omp_threads,
        "cache": {
            "pool_gib": args.pool_gib,
            "device_blocks": blocks,
            "block_tokens": args.block_tokens,
            "host_tier": "none on either side",
        },
        "live_runs": [
            {
                "ttft_s": s,
                "hit_rate": live.cached_tokens / max(live.prompt_tokens, 1),
                "served_by": live.workers,
                "per_worker": per_worker(live.answered),
                "prediction": predictions(live.predicted),
                "placement_order": placement_order(live.placements),
                "router": live.router,
                "decisions": live.decisions,
                "failures": live.failures,
                "fleet_ready_s": round(live.fleet_ready_s, 1),
                "replay_wall_s": round(live.replay_wall_s, 1),
                "replay_cpu": live.cpu,
                "ratios": {n: (r["sim"][n]["ratio_p50"], r["sim"][n]["ratio_p90"]) for n in sims},
            }
            | ({"requests": live.per_request} if args.per_request else {})
            for live, s, r in zip(lives, stats, per_repeat, strict=True)
        ],
        "failures": len(failures),
        "probes": [
            {"new_tokens": n, "cached_tokens": c, "ttft_s": t}
            for live in lives
            for n, c, t in live.probes
        ],
        "prefill_models": {name: model.terms() for name, model in models.items()},
        "source": f"{args.trace} from {args.start_s:g} s, first {args.limit}",
        "repeats": args.repeats,
    }


def _ratio(a: float | int | None, b: float | int | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return float(a) / float(b)


def _spread(pairs: list[tuple[float | None, float | None]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, key in enumerate(("p50", "p90")):
        values = [v for v in (p[i] for p in pairs) if v is not None]
        out[key] = {"min": min(values), "max": max(values)} if values else None
    return out


def _taken(run: dict[str, Any]) -> float | None:
    """The share of the machine that others took during a live run: other processes and the
    hypervisor's other guests (steal); None when not measured."""
    load = run.get("foreign_load", {})
    if load.get("foreign_share") is None:
        return None
    return float(load["foreign_share"]) + float(load.get("steal_share") or 0.0)


def _busy_note(data: dict[str, Any]) -> str:
    """The title's warning when others took a share of the machine during a run."""
    if data.get("machine_to_itself", True):
        return ""

    def listed(runs: list[dict[str, Any]]) -> str:
        return ", ".join("?" if x is None else f"{100 * x:.0f} %" for x in map(_taken, runs))

    note = "; NOT the machine to itself: others (processes, steal) took "
    note += f"{listed(data['live_runs'])} per live run"
    fresh = data.get("fresh_profile", {})
    runs = [fresh[k] for k in ("before", "after") if "foreign_load" in fresh.get(k, {})]
    return note + (f", {listed(runs)} of the fresh timings (before, after)" if runs else "")


def _after(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The fresh timings after the fleets; a failure is recorded, not raised: the live runs
    before it stand on their own."""
    try:
        return measure()
    except InvalidInput as exc:
        return {"error": str(exc)}


def _fresh_note(data: dict[str, Any]) -> str:
    """The title's figures for the profile measured just before the fleets (``fresh``): its
    ratios, whether it was pinned, and how the longest fresh point moved by the end."""
    fresh = data["sim"].get("fresh")
    if fresh is None or fresh["ratio_p50"] is None or fresh["ratio_p90"] is None:
        return ""
    record = data.get("fresh_profile", {})
    pinned = record.get("before", {}).get("pinned", True)
    note = f"; fresh ({'' if pinned else 'UNPINNED '}timings measured just before): "
    note += f"{fresh['ratio_p50']:.3f} / {fresh['ratio_p90']:.3f}, goal "
    note += "met" if fresh["goal_met"] else "NOT met"
    moved = record.get("after_vs_before") or {}
    if moved:
        longest = max(moved, key=lambda label: sum(int(t) for t in label.split("+")))
        note += f", {longest} tokens after ÷ before {moved[longest]:.3f}"
    return note


def _emit(data: dict[str, Any], args: argparse.Namespace) -> None:
    names = list(data["sim"])
    rows = []
    for key in ("p10", "p50", "p90", "p99", "mean"):
        rows.append(
            (
                f"TTFT {key} (s)",
                data["live"]["ttft_s"][key],
                *tuple(data["sim"][n]["ttft_s"][key] for n in names),
            )
        )
    for key in ("ratio_p50", "ratio_p90"):
        rows.append((f"sim ÷ live {key[6:]}", "", *tuple(data["sim"][n][key] for n in names)))
    live_hit = statistics.median(run["hit_rate"] for run in data["live_runs"])
    rows.append(("hit rate", live_hit, *tuple(data["sim"][n]["hit_rate"] for n in names)))
    scaling = data["scaling"]
    emit(
        data,
        as_json=args.json,
        title=(
            f"kvstrata bench calibrate: {data['source']}, {scaling['requests']} requests, "
            f"{args.workers} workers, policy {args.policy}, {args.block_tokens} tokens per trace "
            f"block, rate ×{scaling['rate_scale']:.3g} (target utilisation {args.utilisation}); "
            f"goal {data['goal']}: {'met' if data['goal_met'] else 'NOT met'}"
            f"; failures {data['failures']}" + _fresh_note(data) + _busy_note(data)
        ),
        columns=("figure", "live fleet", *(f"sim {n}" for n in names)),
        rows=rows,
    )
