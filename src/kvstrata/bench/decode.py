"""The reference engine's decode step: seconds per step by batch size, and its linear fit.

The simulator prices a step that only decodes ``b`` sequences at ``decode_step_base_s +
decode_interference_s · b`` (``router.costs.CostProfile``). For the ``reference-cpu`` profiles
those two terms used to be derived from the prefill fit (its intercept, and one token plus
attention over ~1k context), never measured; measured on the 2-core EPYC they were 2–3×
too low (a one-sequence step 57–76 ms against 33 ms priced), in the engine alone and in a
live fleet's steps alike.

:func:`run_decode_curve` measures them. For each batch size ``b``: the pool emptied, ``b``
different prompts of ``context`` tokens queued at once (nothing looked up or stored), each
asked for enough tokens that all ``b`` still decode for ``steps`` steps or more once the last
prefill is done (``answer_tokens``), and the engine stepped by hand. Every step that computed
exactly one token for each of the ``b`` sequences is a decode step of batch ``b``
(``BatchRunner.last_step``); the prefill steps and the steps where the batch was still
filling or draining are left out. A batch's sample is the ``stat`` of its decode steps (the
minimum by default in ``bench prefill``, as for its prefill points). The fit is the
least-squares line through the samples, ``seconds = base + per_sequence · b``: what
``reference_cpu`` pins.

What the line leaves out: attention over the context (a decode step of 8 sequences grows by
about 15 ms per 1,000 context tokens each on the EPYC), and the CPU's matrix kernels, whose
cost is not linear in ``b`` at small batches (2 and 3 sequences took longer than 4 there).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Final

from kvstrata.bench.prefill import STATS
from kvstrata.bench.ttft import synthetic_prompt
from kvstrata.engine.engine import ReferenceEngine
from kvstrata.engine.sampling import SamplingParams
from kvstrata.errors import InvalidInput

DEFAULT_BATCHES: Final = (1, 2, 4, 8)
DEFAULT_CONTEXT: Final = 512
"""Prompt tokens per sequence: near the calibration replay's prompts (390 tokens on average)."""
DEFAULT_STEPS: Final = 8


@dataclass(frozen=True)
class DecodeCurve:
    context: int
    stat: str
    timings: tuple[tuple[int, tuple[float, ...]], ...]
    """``(batch, every decode step's seconds)``."""
    samples: tuple[tuple[int, float], ...] = field(init=False)
    base_s: float = field(init=False)
    per_sequence_s: float = field(init=False)

    def __post_init__(self) -> None:
        pick = STATS[self.stat]
        samples = tuple((b, float(pick(seconds))) for b, seconds in self.timings)
        fit = statistics.linear_regression([float(b) for b, _ in samples], [s for _, s in samples])
        base, slope = fit.intercept, fit.slope
        object.__setattr__(self, "samples", samples)
        object.__setattr__(self, "base_s", base)
        object.__setattr__(self, "per_sequence_s", slope)

    def to_dict(self) -> dict[str, Any]:
        return {
            "context_tokens": self.context,
            "stat": self.stat,
            "samples": [
                {"batch": b, "seconds": s, "timings": list(t)}
                for (b, s), (_, t) in zip(self.samples, self.timings, strict=True)
            ],
            "fit": {
                "decode_step_base_s": self.base_s,
                "decode_per_sequence_s": self.per_sequence_s,
            },
        }


def check_decode(batches: tuple[int, ...], context: int, steps: int, stat: str) -> None:
    """Before any timing: bad arguments fail now, not after minutes of forwards."""
    if len(set(batches)) < 2 or min(batches) < 1:
        raise InvalidInput("decode batches: give at least two different sizes, each >= 1")
    if context < 1 or steps < 1:
        raise InvalidInput("decode context and steps must be >= 1")
    if stat not in STATS:
        raise InvalidInput(f"stat must be one of {', '.join(STATS)}, got {stat!r}")


def answer_tokens(batch: int, context: int, steps: int, step_tokens: int) -> int:
    """Tokens each sequence of ``batch`` is asked for: the first sequences decode while the
    later ones still prefill (``step_tokens`` a step), and every one must still be decoding
    for ``steps`` steps once the last prefill is done."""
    return steps + 2 + -(-batch * context // step_tokens)


def pool_blocks_for(
    batches: tuple[int, ...], context: int, steps: int, block_size: int, step_tokens: int
) -> int:
    """Device blocks the largest batch needs (every sequence's prompt and answer)."""
    batch = max(batches)
    tokens = context + answer_tokens(batch, context, steps, step_tokens)
    return batch * -(-tokens // block_size) + 8


def run_decode_curve(
    engine: ReferenceEngine,
    batches: tuple[int, ...] = DEFAULT_BATCHES,
    *,
    context: int = DEFAULT_CONTEXT,
    steps: int = DEFAULT_STEPS,
    stat: str = "min",
) -> DecodeCurve:
    """Time the decode steps of every batch size (module docstring) and fit the line."""
    check_decode(batches, context, steps, stat)
    step_tokens = engine.batch.scheduler.config.max_num_batched_tokens
    needed = pool_blocks_for(batches, context, steps, engine.config.block_size, step_tokens)
    if engine.pool.config.num_blocks < needed:
        raise InvalidInput(f"the engine's pool has fewer than the {needed} blocks needed")
    source = synthetic_prompt(engine, context + max(batches))
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate(source[:64], warm, lookup=False, store=False).run()  # first-call costs
    timings = []
    for batch in batches:
        answer = answer_tokens(batch, context, steps, step_tokens)
        params = SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True)
        engine.pool.clear()
        for i in range(batch):  # a different prompt each: nothing shared, nothing looked up
            engine.generate(source[i : i + context], params, lookup=False, store=False)
        seconds: list[float] = []
        while engine.step():
            shape = engine.batch.last_step
            if shape is not None and shape.sequences == shape.tokens == batch:
                seconds.append(shape.seconds)
        if not seconds:
            raise InvalidInput(f"no step decoded all {batch} sequences at once")
        timings.append((batch, tuple(seconds)))
    return DecodeCurve(context, stat, tuple(timings))
