"""What a prefill costs, so that eviction can price what a cache hit saves.

Model (one forward pass that computes ``n`` new tokens on top of ``c`` cached ones)::

    t(n, c) = overhead_s + per_token_s · n + attention_s · n · (c + n / 2)

* ``per_token_s`` (a): the projections and the MLP, linear in the new tokens;
* ``attention_s`` (b): each new token attends to the ``c`` cached tokens and to half of the
  new ones on average (causal mask), so the attention term is ``n · (c + n/2)``;
* ``overhead_s`` (t0): a fixed cost per forward (streaming the weights once, kernel
  launches). It is paid whether or not a prefix was cached, so it never enters what a hit
  saves: ``block_recompute_s`` is the *marginal* cost of the block's tokens at its position.

Why three terms and not two: the two reference measurements cannot be fitted by
``a·n + b·n·(c + n/2)`` alone. A fresh 2,048-token prefill of SmolLM2-135M on this 2-core
CPU takes 3.9–6 s and a 16-token forward over 2,032 cached tokens 0.14 s; solving the
two-term model for them gives a *negative* ``a`` for any value in that range (16 tokens cost
8.8 ms each, 2,048 tokens 1.9 ms each — the short forward is dominated by fixed cost).
Two measurements cannot pin three unknowns either, so the default fixes the ratio b / a from
the architecture and fits ``a`` and ``t0`` to the two measurements:

* b / a = attention FLOPs per (new token, context token) / linear FLOPs per new token
  = (4 · hidden · layers) / (2 · params incl. the tied LM head)
  = (4 · 576 · 30) / (2 · 134.5 M) = 2.57e-4 for SmolLM2-135M (hidden 576, 30 layers,
  106.2 M non-embedding parameters + a 49,152 × 576 LM head);
* with the faster (less contended) end of the range, t(2048, 0) = 3.9 s and
  t(16, 2032) = 0.14 s: a = 1.468e-3 s/token, t0 = 0.104 s, b = 3.77e-7 s/token².

``calibrate`` replaces these defaults with a least-squares fit of (t0, a, b) to forward
passes timed on a live engine; the tiered store calls it with the real engine.

``kv_bytes_per_token``: SmolLM2-135M in fp32 keeps 2 (K and V) · 30 layers · 3 KV heads ·
64 head dims · 4 bytes = 46,080 bytes per token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from kvstrata.errors import InvalidInput

SMOLLM2_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4
"""46,080: K and V, 30 layers, 3 KV heads, head_dim 64, fp32."""

SMOLLM2_ATTENTION_TO_LINEAR = (4 * 576 * 30) / (2 * (106_168_320 + 49_152 * 576))
"""b / a from FLOP counts of SmolLM2-135M (see the module docstring): about 2.57e-4."""

_REF_FRESH_TOKENS, _REF_FRESH_S = 2048, 3.9
_REF_STEP_TOKENS, _REF_STEP_CONTEXT, _REF_STEP_S = 16, 2032, 0.14

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


@dataclass(frozen=True)
class PrefillCostModel:
    """Seconds to prefill, and KV bytes per token, of one model on one device."""

    per_token_s: float
    attention_s: float
    overhead_s: float = 0.0
    kv_bytes_per_token: int = SMOLLM2_KV_BYTES_PER_TOKEN
    name: str = "custom"

    def __post_init__(self) -> None:
        if min(self.per_token_s, self.attention_s, self.overhead_s) < 0:
            raise InvalidInput(f"cost model terms must be >= 0: {self}")
        if self.kv_bytes_per_token <= 0:
            raise InvalidInput(f"kv_bytes_per_token must be > 0, got {self.kv_bytes_per_token}")

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Predicted seconds of one forward over ``new_tokens`` after ``cached_tokens``."""
        if new_tokens <= 0:
            return 0.0
        return self.overhead_s + self.marginal_s(new_tokens, cached_tokens)

    def marginal_s(self, new_tokens: int, cached_tokens: int) -> float:
        """``prefill_s`` without the fixed per-forward overhead."""
        n = float(new_tokens)
        return self.per_token_s * n + self.attention_s * n * (cached_tokens + n / 2.0)

    def block_recompute_s(self, tokens: int, position: int) -> float:
        """What losing one block costs: its ``tokens`` recomputed after ``position`` tokens.

        This is the ``recompute_s`` of a ``KVObjectMeta``: the overhead is excluded because
        the request runs a forward anyway, with or without the hit.
        """
        if tokens <= 0:
            return 0.0
        return self.marginal_s(tokens, position)

    def kv_bytes(self, tokens: int) -> int:
        return self.kv_bytes_per_token * tokens


def smollm2_cpu() -> PrefillCostModel:
    """SmolLM2-135M fp32 on this machine's 2-core CPU, from the two reference timings."""
    ratio = SMOLLM2_ATTENTION_TO_LINEAR
    fresh_units = _REF_FRESH_TOKENS * (1.0 + ratio * _REF_FRESH_TOKENS / 2.0)
    step_units = _REF_STEP_TOKENS * (1.0 + ratio * (_REF_STEP_CONTEXT + _REF_STEP_TOKENS / 2.0))
    per_token_s = (_REF_FRESH_S - _REF_STEP_S) / (fresh_units - step_units)
    overhead_s = _REF_STEP_S - per_token_s * step_units
    return PrefillCostModel(
        per_token_s=per_token_s,
        attention_s=per_token_s * ratio,
        overhead_s=overhead_s,
        kv_bytes_per_token=SMOLLM2_KV_BYTES_PER_TOKEN,
        name="smollm2-cpu",
    )


DEFAULT_COST_MODEL = smollm2_cpu()


def fit(
    samples: Sequence[tuple[int, int, float]],
    *,
    kv_bytes_per_token: int = SMOLLM2_KV_BYTES_PER_TOKEN,
    name: str = "calibrated",
) -> PrefillCostModel:
    """Least-squares (t0, a, b) from ``(new_tokens, cached_tokens, seconds)`` samples.

    Non-negative by construction: a term whose unconstrained estimate is negative (noise on
    a tiny term) is dropped and the rest refitted, because a negative cost would make a
    policy value losing a block as a gain.
    """
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
    overhead_s, per_token_s, attention_s = (float(x) for x in coefficients)
    return PrefillCostModel(
        per_token_s=per_token_s,
        attention_s=attention_s,
        overhead_s=overhead_s,
        kv_bytes_per_token=kv_bytes_per_token,
        name=name,
    )


def calibrate(
    measure_fn: Callable[[int, int], float],
    points: Sequence[tuple[int, int]] = DEFAULT_CALIBRATION_POINTS,
    *,
    repeats: int = 3,
    kv_bytes_per_token: int = SMOLLM2_KV_BYTES_PER_TOKEN,
    name: str = "calibrated",
) -> PrefillCostModel:
    """Fit the model to a live engine: ``measure_fn(new_tokens, cached_tokens) -> seconds``.

    Each point is timed ``repeats`` times and the minimum kept: background load only ever
    adds time, so the minimum is the least biased estimate of the engine's own cost.
    """
    if repeats < 1:
        raise InvalidInput(f"repeats must be >= 1, got {repeats}")
    samples = [(n, c, min(measure_fn(n, c) for _ in range(repeats))) for n, c in points]
    return fit(samples, kv_bytes_per_token=kv_bytes_per_token, name=name)


def per_token(base: PrefillCostModel = DEFAULT_COST_MODEL) -> PrefillCostModel:
    """``base`` without its attention term: every prompt token costs the same.

    Under it a policy that maximises saved seconds maximises saved tokens, which is what
    ``bench eviction`` counts; it is also the regime of large models at moderate context,
    where the attention share of prefill is small.
    """
    return replace(base, attention_s=0.0, overhead_s=0.0, name="per-token")


def llama3_8b_h100(mfu: float = 0.5) -> PrefillCostModel:
    """A GPU-class profile from published numbers, not from a measurement here.

    Llama-3.1-8B (8.03 B parameters, hidden 4,096, 32 layers, 8 KV heads of 128) in bf16 on
    one H100 SXM (989 TFLOP/s dense bf16 peak), at ``mfu`` of peak — an assumption: prefill
    of long prompts typically reaches about half of peak. Linear FLOPs 2 · params per token,
    attention FLOPs 4 · hidden · layers per (token, context token); KV bytes per token
    2 · 32 · 8 · 128 · 2 = 131,072.
    """
    flops_per_s = 989e12 * mfu
    return PrefillCostModel(
        per_token_s=2 * 8.03e9 / flops_per_s,
        attention_s=4 * 4096 * 32 / flops_per_s,
        overhead_s=0.0,
        kv_bytes_per_token=2 * 32 * 8 * 128 * 2,
        name="llama3-8b-h100",
    )


PROFILES: dict[str, Callable[[], PrefillCostModel]] = {
    "smollm2-cpu": smollm2_cpu,
    "per-token": per_token,
    "llama3-8b-h100": llama3_8b_h100,
}
"""Cost models by name, for the command line."""
