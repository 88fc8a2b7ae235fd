"""What a prefill forward costs: one model for every caller, and its least-squares fit.

Model (one forward pass that computes ``n`` new tokens on top of ``c`` cached ones)::

    seconds(n, c) = overhead_s + per_token_s · n + per_token_ctx_s · n · (c + n / 2)

* ``per_token_s`` (a): the projections and the MLP, linear in the new tokens;
* ``per_token_ctx_s`` (b): attention — each new token attends to the ``c`` cached tokens and
  to half of the new ones on average (causal mask), so the term is ``n · (c + n/2)``
  (seconds per new token per context token);
* ``overhead_s`` (t0): a fixed cost per forward (streaming the weights once, kernel
  launches, scheduling).

Two questions are asked of it, under two names, because their edge cases differ:

* :meth:`PrefillModel.seconds` — how long a forward takes (TTFT estimates, the simulator's
  prefill durations). A forward with no new tokens still runs, so ``seconds(0)`` is the
  overhead.
* :meth:`PrefillModel.marginal_s` — what computing ``n`` tokens *adds* to a forward that runs
  anyway: the ``recompute_s`` that eviction weighs and the engine's fetch-or-recompute
  break-even. The overhead never enters it (it is paid with or without a hit), and
  ``marginal_s(0)`` is 0.

Why three terms and not two: a short forward is dominated by fixed cost. On SmolLM2-135M on a
2-core CPU, fitting ``a·n + b·n·(c + n/2)`` alone to a fresh long prefill and a short forward
over a long context gives a *negative* ``a`` (see :mod:`kvstrata.costs.profiles`).

:func:`fit` is the one non-negative least-squares fit (used by :func:`calibrate` and by
:class:`kvstrata.costs.online.OnlinePrefillFit`): ordinary least squares over the three
terms, then, while a coefficient is negative, drop the most negative one and refit the rest.
A negative cost would make a policy value losing a block as a gain, and make time shrink
with more tokens. Dropping one term at a time (not every non-positive one at once) keeps a
term that only went negative because another one absorbed its share.

``kv_bytes_per_token`` travels with the model because eviction prices a block by what it
saves per byte it occupies; the default is SmolLM2-135M's (the reference engine).

``spread`` says how far the model can be trusted: the root-mean-square of
``log(measured / predicted)`` over the timings it was judged on (:func:`fit` inflates the
in-sample figure by ``sqrt(n / (n − k))`` for the ``k`` fitted terms, the usual degrees-of-
freedom correction, so it estimates the out-of-sample error). A risk-aware caller prices a
quantile instead of the mean: ``seconds · exp(z · spread)``. 0 means "not measured".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from kvstrata.errors import InvalidInput

SMOLLM2_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4
"""46,080: K and V, 30 layers, 3 KV heads, head_dim 64, fp32 (SmolLM2-135M ``config.json``)."""

DEFAULT_CALIBRATION_POINTS: tuple[tuple[int, int], ...] = (
    (16, 0),
    (16, 2032),
    (256, 0),
    (512, 0),
    (512, 1536),
    (1024, 0),
    (2048, 0),
)
"""(new tokens, cached tokens) points timed by ``calibrate``: short and long forwards at
short and long contexts, so that t0, a and b are each well determined; all fit a 2,048-token
context window (SmolLM2 allows 8,192)."""


def point_label(new_tokens: int, cached_tokens: int) -> str:
    """A timed point as ``bench prefill --points`` writes it: ``NEW``, or ``CACHED+NEW``."""
    return f"{cached_tokens}+{new_tokens}" if cached_tokens else str(new_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillModel:
    """Seconds of one prefill forward of one model on one device (module docstring)."""

    overhead_s: float = 0.0
    per_token_s: float
    per_token_ctx_s: float = 0.0
    kv_bytes_per_token: int = SMOLLM2_KV_BYTES_PER_TOKEN
    name: str = "custom"
    spread: float = 0.0
    """RMS log error of the model on measured timings (module docstring); 0: unknown."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.spread) and self.spread >= 0):
            raise InvalidInput(f"spread must be a finite number >= 0, got {self.spread}")
        if not all(term >= 0 for term in (self.overhead_s, self.per_token_s, self.per_token_ctx_s)):
            raise InvalidInput(f"prefill model terms must be >= 0: {self}")
        if self.kv_bytes_per_token <= 0:
            raise InvalidInput(f"kv_bytes_per_token must be > 0, got {self.kv_bytes_per_token}")

    def seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Duration of one forward over ``new_tokens`` after ``cached_tokens`` (>= overhead)."""
        if new_tokens <= 0:
            return self.overhead_s
        attention = new_tokens * (cached_tokens + new_tokens / 2.0)
        return self.overhead_s + new_tokens * self.per_token_s + attention * self.per_token_ctx_s

    def marginal_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """What ``new_tokens`` after ``cached_tokens`` add to a forward: no overhead; 0 for 0."""
        if new_tokens <= 0:
            return 0.0
        attention = new_tokens * (cached_tokens + new_tokens / 2.0)
        return new_tokens * self.per_token_s + attention * self.per_token_ctx_s

    def terms(self) -> dict[str, float]:
        """The three fitted terms by name (what reports print of a model)."""
        return {
            "overhead_s": self.overhead_s,
            "per_token_s": self.per_token_s,
            "per_token_ctx_s": self.per_token_ctx_s,
        }

    def kv_bytes(self, tokens: int) -> int:
        return self.kv_bytes_per_token * tokens

    def log_spread(self, samples: Sequence[tuple[int, int, float]], fitted_terms: int = 0) -> float:
        """RMS of ``log(measured / seconds(n, c))`` over ``samples``; with ``fitted_terms``
        > 0 (the samples fitted the model), × ``sqrt(n / (n − fitted_terms))``."""
        logs = [
            math.log(s / predicted)
            for n, c, s in samples
            if s > 0 and (predicted := self.seconds(n, c)) > 0
        ]
        if not logs:
            return 0.0
        mean_square = sum(x * x for x in logs) / len(logs)
        if 0 < fitted_terms < len(logs):
            mean_square *= len(logs) / (len(logs) - fitted_terms)
        return math.sqrt(mean_square)


def fit(
    samples: Sequence[tuple[int, int, float]],
    *,
    kv_bytes_per_token: int = SMOLLM2_KV_BYTES_PER_TOKEN,
    name: str = "calibrated",
) -> PrefillModel:
    """Non-negative least-squares (t0, a, b) from ``(new_tokens, cached_tokens, seconds)``."""
    if len(samples) < 3:
        raise InvalidInput(f"need at least 3 samples to fit 3 terms, got {len(samples)}")
    rows = np.array(
        [[1.0, float(n), float(n) * (c + n / 2.0)] for n, c, _ in samples], dtype=np.float64
    )
    seconds = np.array([s for _, _, s in samples], dtype=np.float64)
    active = [0, 1, 2]
    coefficients = np.zeros(3)
    while active:
        solution, *_ = np.linalg.lstsq(rows[:, active], seconds, rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    overhead_s, per_token_s, per_token_ctx_s = (float(x) for x in coefficients)
    model = PrefillModel(
        overhead_s=overhead_s,
        per_token_s=per_token_s,
        per_token_ctx_s=per_token_ctx_s,
        kv_bytes_per_token=kv_bytes_per_token,
        name=name,
    )
    return replace(model, spread=model.log_spread(samples, fitted_terms=len(active)))


def calibrate(
    measure_fn: Callable[[int, int], float],
    points: Sequence[tuple[int, int]] = DEFAULT_CALIBRATION_POINTS,
    *,
    repeats: int = 3,
    kv_bytes_per_token: int = SMOLLM2_KV_BYTES_PER_TOKEN,
    name: str = "calibrated",
) -> PrefillModel:
    """Fit the model to a live engine: ``measure_fn(new_tokens, cached_tokens) -> seconds``.

    Each point is timed ``repeats`` times and the minimum kept: background load only ever
    adds time, so the minimum is the least biased estimate of the engine's own cost.
    """
    if repeats < 1:
        raise InvalidInput(f"repeats must be >= 1, got {repeats}")
    samples = [(n, c, min(measure_fn(n, c) for _ in range(repeats))) for n, c in points]
    return fit(samples, kv_bytes_per_token=kv_bytes_per_token, name=name)
