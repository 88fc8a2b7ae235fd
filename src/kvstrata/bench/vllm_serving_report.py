"""The pure half of ``kvstrata bench vllm-serving``: run order, spreads, ratios, goals, outputs.

- ``rotated(modes, r)``: round ``r`` runs the modes rotated by ``r`` (no mode always first);
- ``spread``: median, min and max of one figure over the repetitions;
- ``compare_outputs``: every request's generated text (greedy, temperature 0) compared, per
  prompt, with the first run of the same workload; any difference is a mismatch, counted per
  mode and reported (the first few with where they happened);
- ``ratios``: per workload, the peers' median TTFT p50 ÷ kvstrata's (above 1: kvstrata is
  faster) and kvstrata's median TPOT p50 ÷ ``plain_small``'s;
- ``goals``: issue 13's goals for this benchmark (items 3 and 2), each with its figure and
  ``met`` (``None`` when a mode it needs did not run);
- ``client_figures``, ``parse_metrics``: what is kept of the client's result and the server's
  ``/metrics``;
- ``summarize``: the JSON (raw figures per run beside the medians) and ``table_rows``.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from kvstrata.telemetry.prom_text import samples

FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "request_throughput")
PEERS = {
    "p50_vs_plain_small": "plain_small",
    "p50_vs_equal_memory": "plain_equal_memory",
    "p50_vs_example_connector": "example_connector",
    "p50_vs_equal_memory_capped": "plain_equal_memory_capped",
}
MAX_EXAMPLES = 5


def client_figures(result: dict[str, Any]) -> dict[str, Any]:
    """The fields kept from ``vllm.benchmarks.serve.main``'s result."""
    return {
        "completed": result.get("completed"),
        "failed": result.get("failed"),
        "duration_s": result.get("duration"),
        "ttft_p50_ms": result.get("median_ttft_ms"),
        "ttft_p90_ms": result.get("p90_ttft_ms"),
        "ttft_p99_ms": result.get("p99_ttft_ms"),
        "ttft_mean_ms": result.get("mean_ttft_ms"),
        "tpot_p50_ms": result.get("median_tpot_ms"),
        "e2el_p50_ms": result.get("median_e2el_ms"),
        "request_throughput": result.get("request_throughput"),
        "output_throughput": result.get("output_throughput"),
        "total_input_tokens": result.get("total_input_tokens"),
        "total_output_tokens": result.get("total_output_tokens"),
    }


def parse_metrics(text: str) -> dict[str, float]:
    """Sum the Prometheus samples we report (labels other than ``source`` folded)."""
    wanted = {
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:prefix_cache_hits_total": "vllm_prefix_cache_hit_tokens",
        "vllm:external_prefix_cache_hits_total": "external_hit_tokens",
        "vllm:request_prefill_time_seconds_sum": "prefill_seconds_sum",
        "vllm:request_prefill_time_seconds_count": "prefill_count",
        "vllm:num_preemptions_total": "preemptions",
    }
    out: dict[str, float] = {}
    for name, name_labels, number in samples(text):
        if name in wanted:
            key = wanted[name]
            out[key] = out.get(key, 0.0) + number
        elif name == "vllm:prompt_tokens_by_source_total" and 'source="' in name_labels:
            source = name_labels.split('source="', 1)[1].split('"', 1)[0]
            key = f"prompt_tokens_{source}"
            out[key] = out.get(key, 0.0) + number
    return out


def queue_gauges(text: str) -> tuple[float, float]:
    """(running, waiting) requests in a ``/metrics`` text, summed over engines."""
    running = waiting = 0.0
    for name, _, number in samples(text):
        if name == "vllm:num_requests_running":
            running += number
        elif name == "vllm:num_requests_waiting":
            waiting += number
    return running, waiting


def concurrency(polled: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """What the server ran at once while it had work: mean and max of the running requests
    over the samples with any request running or waiting, and the mean waiting there."""
    busy = [(r, w) for r, w in polled if r + w > 0]
    return {
        "samples": len(polled),
        "busy_samples": len(busy),
        "running_mean": statistics.fmean(r for r, _ in busy) if busy else None,
        "running_max": max((r for r, _ in busy), default=None),
        "waiting_mean": statistics.fmean(w for _, w in busy) if busy else None,
    }


def prompt_digest(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()[:16]


def rotated(modes: Sequence[str], r: int) -> list[str]:
    if not modes:
        return []
    k = r % len(modes)
    return [*modes[k:], *modes[:k]]


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    got = [float(v) for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "values": list(values)}
    return {
        "median": statistics.median(got),
        "min": min(got),
        "max": max(got),
        "values": list(values),
    }


def compare_outputs(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``runs``: dicts with ``workload``, ``mode``, ``rep``, ``prompts`` (digests) and
    ``texts`` (same order). The reference for a prompt is its text in the workload's first run."""
    reference: dict[tuple[str, str], tuple[str, str]] = {}  # → (text, the run that gave it)
    compared = mismatches = 0
    by_mode: dict[str, int] = {}
    examples: list[dict[str, Any]] = []
    for run in runs:
        mode = str(run["mode"])
        by_mode.setdefault(mode, 0)
        prompts, texts = list(run["prompts"]), list(run["texts"])
        if len(prompts) != len(texts):  # a run that lost texts cannot be called equal
            mismatches += max(len(prompts), len(texts))
            by_mode[mode] += max(len(prompts), len(texts))
            continue
        for index, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
            key = (str(run["workload"]), prompt)
            if key not in reference:
                reference[key] = (text, f"{mode} rep {run['rep']}")
                continue
            compared += 1
            expected, source = reference[key]
            if text != expected:
                mismatches += 1
                by_mode[mode] += 1
                if len(examples) < MAX_EXAMPLES:  # with both texts, to see where they part
                    examples.append(
                        {"workload": key[0], "mode": mode, "rep": run["rep"], "request": index,
                         "text": text, "reference": expected, "reference_run": source}
                    )  # fmt: skip
    return {
        "outputs_equal": mismatches == 0 and compared > 0,
        "compared": compared,
        "mismatches": mismatches,
        "mismatches_by_mode": by_mode,
        "mismatch_examples": examples,
    }


def per_mode(runs: Sequence[Mapping[str, Any]], workload: str, mode: str) -> dict[str, Any]:
    """Median and spread of each figure over the repetitions of ``mode`` on ``workload``."""
    mine = sorted(
        (r for r in runs if r["workload"] == workload and r["mode"] == mode),
        key=lambda r: int(r["rep"]),
    )
    return {f: spread([r["figures"].get(f) for r in mine]) for f in FIGURES} | {
        "repeats": len(mine)
    }


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return top / bottom if top is not None and bottom else None


def ratios(summary: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """``summary``: mode → ``per_mode`` of one workload."""

    def median(mode: str, figure: str) -> float | None:
        entry = summary.get(mode)
        value = entry[figure]["median"] if entry else None
        return float(value) if value is not None else None

    ours = median("kvstrata", "ttft_p50_ms")
    out = {name: _ratio(median(peer, "ttft_p50_ms"), ours) for name, peer in PEERS.items()}
    out["tpot_vs_plain_small"] = _ratio(
        median("kvstrata", "tpot_p50_ms"), median("plain_small", "tpot_p50_ms")
    )
    return out


# (workload, ratio, comparison, target, what the issue says)
GOALS = (
    ("fits", "p50_vs_plain_small", ">=", 3.0, "≥ 3× median TTFT over plain_small"),
    ("exceeds", "p50_vs_plain_small", ">=", 3.0, "≥ 3× median TTFT over plain_small"),
    ("fits", "p50_vs_equal_memory", ">=", 1 / 1.2, "≤ 1.2× plain_equal_memory when it fits"),
    ("exceeds", "p50_vs_equal_memory", ">=", 2.0, "≥ 2× better than plain_equal_memory"),
    ("fits", "p50_vs_example_connector", ">", 1.0, "better than example_connector"),
    ("exceeds", "p50_vs_example_connector", ">", 1.0, "better than example_connector"),
    ("fits", "tpot_vs_plain_small", "<=", 1.1, "TPOT within 1.1× of plain (item 2)"),
    ("exceeds", "tpot_vs_plain_small", "<=", 1.1, "TPOT within 1.1× of plain (item 2)"),
)


def goals(
    all_ratios: Mapping[str, Mapping[str, float | None]], outputs_equal: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for workload, name, op, target, text in GOALS:
        if workload not in all_ratios:
            continue
        value = all_ratios[workload].get(name)
        met: bool | None = None
        if value is not None:
            met = (
                value >= target if op == ">=" else value > target if op == ">" else value <= target
            )
        out[f"{workload}.{name}"] = {
            "figure": value,
            "target": f"{op} {target:.4g}",
            "goal": text,
            "met": met,
        }
    out["outputs_equal"] = {
        "figure": outputs_equal,
        "target": "true",
        "goal": "outputs equal at temperature 0",
        "met": outputs_equal,
    }
    return out


def summarize(
    workloads: Mapping[str, Mapping[str, Any]],
    runs: Sequence[Mapping[str, Any]],
    *,
    modes: Sequence[str],
    repeats: int,
    bytes_per_token: int,
    block_bytes: int,
    wall_s: float,
) -> dict[str, Any]:
    """The reported JSON: workloads, medians and spreads, ratios, goals, outputs, raw runs."""
    dtypes = sorted({str(w.get("dtype", "bfloat16")) for w in workloads.values()}) or ["bfloat16"]
    summary = {w: {m: per_mode(runs, w, m) for m in modes} for w in workloads}
    all_ratios = {w: ratios(summary[w]) for w in workloads}
    outputs = compare_outputs(runs)
    return {
        "model": f"SmolLM2-135M {'/'.join(dtypes)}",
        "kv_bytes_per_token": bytes_per_token,
        "block_bytes": block_bytes,
        "modes": list(modes),
        "repeats": repeats,
        "workloads": dict(workloads),
        "order": [[r["rep"], r["workload"], r["mode"]] for r in runs],
        "ratios": all_ratios,
        "goals": goals(all_ratios, bool(outputs["outputs_equal"])),
        "outputs_equal": outputs["outputs_equal"],
        "output_mismatches": outputs["mismatches"],
        "outputs": outputs,
        "summary": summary,
        "runs": [
            {k: r[k] for k in ("workload", "mode", "rep", "order")} | {"figures": r["figures"]}
            for r in runs
        ],
        "wall_s": round(wall_s, 1),
    }


def _cell(entry: Mapping[str, Any]) -> str:
    if entry["median"] is None:
        return "–"
    return f"{entry['median']:.4g} [{entry['min']:.4g}–{entry['max']:.4g}]"


def table_rows(data: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    """One row per workload × mode: median [min–max] of each figure; then the ratios."""
    rows: list[tuple[Any, ...]] = []
    for workload, by_mode in data["summary"].items():
        for mode, entry in by_mode.items():
            rows.append((workload, mode, *(_cell(entry[f]) for f in FIGURES)))
    for workload, values in data["ratios"].items():
        for name, value in values.items():
            rows.append((workload, name, value, "", "", ""))
    for name, goal in data["goals"].items():
        rows.append(("goal", name, goal["figure"], goal["target"], f"met: {goal['met']}", ""))
    return rows
