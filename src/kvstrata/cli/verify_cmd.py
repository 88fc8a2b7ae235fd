"""``kvstrata verify``: check that cached prefill is exact for a model before enabling it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvstrata.cli.output import emit


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "verify", help="compare cached and fresh prefill on your prompts"
    )
    parser.add_argument(
        "--prompts", type=Path, required=True, help="JSONL: prompt|messages[,tenant]"
    )
    parser.add_argument("--model", default="smollm2", help="smollm2 | tiny | a model directory")
    parser.add_argument(
        "--max-tokens", type=positive_int, default=32, help="greedy tokens to compare"
    )
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max |Δlogit| allowed")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--pool-blocks", type=positive_int, default=2048)
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=1,
        help="also replay N prompts at a time in shared engine steps (fresh and cached runs "
        "side by side), each compared with its reference run alone",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvstrata.engine.engine import EngineConfig, ReferenceEngine
    from kvstrata.engine.model_loader import load_model
    from kvstrata.engine.verify import read_prompts, summarise, verdict_dict, verify_prompts

    prompts = read_prompts(args.prompts)  # fail on malformed input before loading the model
    engine = ReferenceEngine(
        load_model(args.model),
        EngineConfig(block_size=args.block_size, pool_blocks=args.pool_blocks),
    )
    verdicts = list(
        verify_prompts(engine, prompts, max_tokens=args.max_tokens, concurrency=args.concurrency)
    )
    summary = summarise(verdicts, args.tolerance)
    result = {
        "model": args.model,
        "tolerance": args.tolerance,
        "concurrency": args.concurrency,
        "reuse_disabled": (
            engine.reuse_disabled.reason.value if engine.reuse_disabled is not None else None
        ),
        "results": [verdict_dict(v) for v in verdicts],
        "summary": summary,
    }
    rows: list[tuple[object, ...]] = [
        (v.line, v.tenant, v.prompt_tokens, v.matched_tokens, v.max_abs_logit_diff, v.greedy_equal)
        for v in verdicts
    ]
    rows.append(
        (
            "all",
            "",
            "",
            summary["min_matched_tokens"],
            summary["max_abs_logit_diff"],
            summary["all_exact"],
        )
    )
    emit(
        result,
        as_json=args.json,
        title=f"kvstrata verify ({args.model})",
        columns=(
            "line",
            "tenant",
            "prompt_tokens",
            "matched_tokens",
            "max_abs_logit_diff",
            "greedy_equal",
        ),
        rows=rows,
    )
    return 0 if summary["all_exact"] else 1
