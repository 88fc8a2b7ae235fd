"""``kvstrata bench prefill``: the reference engine's prefill cost curve and its fitted model.

Run pinned to one core (``OMP_NUM_THREADS=1 taskset -c 0 kvstrata bench prefill``) it
measures what one ``kvstrata up --pin-cpus`` worker costs: the samples the ``reference-cpu``
simulator profile is fitted to (:mod:`kvstrata.costs.profiles`). With ``--decode BATCHES``
(engine alone only) it also times the engine's decode steps by batch size and fits their line
(:mod:`kvstrata.bench.decode`), the profile's decode terms.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from kvstrata.cli.output import emit
from kvstrata.costs import point_label
from kvstrata.errors import InvalidInput

if TYPE_CHECKING:
    from kvstrata.bench.decode import DecodeCurve
    from kvstrata.bench.prefill import PrefillCurve


def _batches(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(item) for item in text.split(",") if item.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: want batch sizes, e.g. 1,2,4,8") from exc


def _points(text: str) -> tuple[tuple[int, int], ...]:
    """``NEW`` or ``CACHED+NEW`` items → ``(new_tokens, cached_tokens)`` points."""
    points: list[tuple[int, int]] = []
    for item in text.split(","):
        first, sep, second = item.strip().partition("+")
        try:
            points.append((int(second), int(first)) if sep else (int(first), 0))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"{item!r}: want NEW (a fresh prefill) or CACHED+NEW (new tokens after a hit)"
            ) from exc
    return tuple(points)


def register(sub: Any) -> None:
    from kvstrata.costs import DEFAULT_CALIBRATION_POINTS

    default = ",".join(point_label(n, c) for n, c in DEFAULT_CALIBRATION_POINTS)
    parser: argparse.ArgumentParser = sub.add_parser(
        "prefill", help="the reference engine's prefill cost at several lengths, and its fit"
    )
    parser.add_argument("--model", default="smollm2", help="smollm2 | tiny | a model directory")
    parser.add_argument(
        "--points",
        type=_points,
        default=DEFAULT_CALIBRATION_POINTS,
        help=f"NEW or CACHED+NEW, comma-separated (default {default})",
    )
    parser.add_argument("--repeat", type=int, default=3, help="timings per point")
    parser.add_argument(
        "--stat",
        choices=["min", "median"],
        default="min",
        help="which of a point's timings is its sample: min (the engine's own cost; the pinned "
        "profiles' statistic) or median (a typical forward)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--decode",
        type=_batches,
        default=(),
        help="also time decode-only steps at these batch sizes (comma-separated, e.g. "
        "1,2,4,8; engine alone) and fit seconds = base + per sequence x batch",
    )
    parser.add_argument(
        "--decode-context", type=int, default=512, help="--decode: prompt tokens per sequence"
    )
    parser.add_argument(
        "--decode-steps", type=int, default=8, help="--decode: tokens decoded per sequence"
    )
    parser.add_argument(
        "--served",
        action="store_true",
        help="time the points through a live `kvstrata up --pin-cpus` fleet's front door"
        " (TTFT of one request at a time) instead of the engine alone",
    )
    parser.add_argument("--workers", type=int, default=2, help="--served: the fleet's workers")
    parser.add_argument("--pool-gib", type=float, default=1.0, help="--served: pool per worker")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def _engine_curve(args: argparse.Namespace) -> tuple[PrefillCurve, DecodeCurve | None]:
    from kvstrata.bench.decode import check_decode, pool_blocks_for, run_decode_curve
    from kvstrata.bench.prefill import run_prefill_curve
    from kvstrata.engine.engine import EngineConfig
    from kvstrata.engine.factory import build_engine
    from kvstrata.engine.model_loader import load_model
    from kvstrata.runtime.scheduler import SchedulerConfig

    longest = max(n + c for n, c in args.points)
    pool_blocks = 2 * (longest + args.block_size) // args.block_size + 8
    if args.decode:
        check_decode(args.decode, args.decode_context, args.decode_steps, args.stat)
        step_tokens = SchedulerConfig().max_num_batched_tokens  # build_engine's default
        needed = pool_blocks_for(
            args.decode, args.decode_context, args.decode_steps, args.block_size, step_tokens
        )
        pool_blocks = max(pool_blocks, needed)
    loaded = load_model(args.model)
    engine = build_engine(loaded, EngineConfig(block_size=args.block_size, pool_blocks=pool_blocks))
    try:
        curve = run_prefill_curve(
            engine, args.points, model=args.model, repeats=args.repeat, stat=args.stat
        )
        decode = None
        if args.decode:
            decode = run_decode_curve(
                engine,
                args.decode,
                context=args.decode_context,
                steps=args.decode_steps,
                stat=args.stat,
            )
        return curve, decode
    finally:
        engine.close()


def run(args: argparse.Namespace) -> int:
    from kvstrata.bench.prefill import run_served_curve

    if not args.points:
        raise InvalidInput("--points: give at least 3 points")
    if args.decode and args.served:
        raise InvalidInput("--decode times the engine alone: leave out --served")
    decode: DecodeCurve | None = None
    if args.served:
        curve = run_served_curve(
            args.points,
            repeats=args.repeat,
            workers=args.workers,
            pool_gib=args.pool_gib,
            model=args.model,
            stat=args.stat,
        )
    else:
        curve, decode = _engine_curve(args)
    data = curve.to_dict()
    fitted = data["fit"]
    rows: list[tuple[str, str]] = [
        (point_label(n, c), f"{s:.4f} s  (model {curve.fitted.seconds(n, c):.4f} s)")
        for n, c, s in curve.samples
    ]
    rows += [
        ("fit overhead", f"{fitted['overhead_s'] * 1e3:.1f} ms"),
        ("fit per token", f"{fitted['per_token_s'] * 1e3:.3f} ms"),
        ("fit per token²", f"{fitted['per_token_ctx_s'] * 1e6:.3f} µs"),
        ("fit spread (RMS log)", f"{fitted['spread']:.3f}"),
    ]
    if decode is not None:
        data["decode"] = decode.to_dict()
        rows += [(f"decode, batch {b}", f"{s:.4f} s / step") for b, s in decode.samples]
        rows += [
            ("decode fit base", f"{decode.base_s * 1e3:.1f} ms"),
            ("decode fit per sequence", f"{decode.per_sequence_s * 1e3:.2f} ms"),
        ]
    emit(
        data,
        as_json=args.json,
        title=f"kvstrata bench prefill ({curve.model}, {args.stat} of {args.repeat})",
        columns=("point (cached+new)", "seconds"),
        rows=rows,
    )
    return 0
