"""``kvstrata bench vllm-fleet``: every routing policy through the front door in front of two
real vLLM servers, vLLM's own serving client (``bench.vllm_fleet``).

Like ``bench vllm-serving`` it re-runs itself with the vLLM venv's python when ``vllm`` cannot
be imported here (``cli.vllm_venv``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvstrata.cli.output import emit
from kvstrata.cli.vllm_venv import reexec_unless_vllm, smollm2_dir
from kvstrata.errors import InvalidInput
from kvstrata.fleet.vllm_bench import FleetWorkload

COLUMNS = (
    "policy",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "req/s",
    "hit rate",
    "requests v0/v1",
    "output mismatches",
)


def register_fleet(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "vllm-fleet",
        help="routing policies (kvstrata, round-robin, llm-d, dynamo) in front of two vLLM "
        "servers, vLLM's serving client (prefix_repetition)",
    )
    w = FleetWorkload()
    parser.add_argument("--num-prefixes", type=int, default=w.num_prefixes)
    parser.add_argument("--prefix-len", type=int, default=w.prefix_len)
    parser.add_argument("--suffix-len", type=int, default=w.suffix_len)
    parser.add_argument("--output-len", type=int, default=w.output_len)
    parser.add_argument("--num-prompts", type=int, default=w.num_prompts)
    parser.add_argument("--request-rate", type=float, default=w.request_rate, help="req/s")
    parser.add_argument(
        "--kv-cache-blocks", type=int, default=w.kv_cache_blocks, help="each server's, of 32"
    )
    parser.add_argument("--host-gib", type=float, default=w.host_gib, help="connector host tier")
    parser.add_argument(
        "--repeats", type=int, default=w.repeats, help="repetitions, policy order rotated"
    )
    parser.add_argument("--seed", type=int, default=w.seed)
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default=w.dtype,
        help="model and KV dtype (float32 on CPUs without AVX-512 BF16: bf16 is emulated there)",
    )
    parser.add_argument(
        "--policies",
        default=",".join(w.policies),
        help="comma-separated `kvstrata router --policy` names (default: all four)",
    )
    parser.add_argument("--vllm-python", type=Path, default=None, help="python of a vLLM venv")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run_fleet)


def workload_from_args(args: argparse.Namespace) -> FleetWorkload:
    from kvstrata.router.registry import POLICIES

    policies = tuple(p for p in args.policies.split(",") if p)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise InvalidInput(f"unknown policies {unknown}: choose from {sorted(POLICIES)}")
    return FleetWorkload(
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        kv_cache_blocks=args.kv_cache_blocks,
        host_gib=args.host_gib,
        repeats=args.repeats,
        seed=args.seed,
        policies=policies,
        dtype=args.dtype,
    )


def fleet_rows(data: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Human table: one row per policy (medians; min–max over the repetitions)."""

    def cell(entry: dict[str, Any], figure: str, fmt: str) -> str:
        s = entry["spread"][figure]
        if s["median"] is None:
            return "—"
        text = format(s["median"], fmt)
        if s["min"] != s["max"]:
            text += f" ({format(s['min'], fmt)}–{format(s['max'], fmt)})"
        return text

    mismatched = data["outputs"]["by_policy"]
    rows: list[tuple[Any, ...]] = []
    for policy, entry in data["policies"].items():
        per_server = " | ".join(
            "/".join(f"{int(n or 0)}" for n in counts.values())
            for counts in entry["requests_per_server"]
        )
        rows.append(
            (
                policy,
                cell(entry, "ttft_p50_ms", ".0f"),
                cell(entry, "ttft_p99_ms", ".0f"),
                cell(entry, "req_per_s", ".3f"),
                cell(entry, "hit_rate", ".3f"),
                per_server,
                len(mismatched.get(policy, [])),
            )
        )
    return rows


def run_fleet(args: argparse.Namespace) -> int:
    workload = workload_from_args(args)  # bad sizes fail before any re-exec or server start
    code = reexec_unless_vllm(args)
    if code is not None:
        return code
    from kvstrata.fleet.vllm_bench import run as run_bench

    model_dir = smollm2_dir()
    if model_dir is None:
        return 2
    data = run_bench(model_dir, workload)
    goals = ", ".join(
        f"{name}: {'met' if g['met'] else 'MISSED'}" for name, g in data["goals"].items()
    )
    emit(
        data,
        as_json=args.json,
        title=(
            f"kvstrata bench vllm-fleet (2 vLLM servers × {workload.kv_cache_blocks} blocks, "
            f"SmolLM2 bf16, prefix_repetition {workload.num_prefixes}×{workload.prefix_len} "
            f"tokens, {workload.num_prompts} requests at {workload.request_rate} req/s, "
            f"{workload.repeats} repetitions; goals — {goals})"
        ),
        columns=COLUMNS,
        rows=fleet_rows(data),
    )
    return 0
