"""What a worker's time to first token is made of, and how it is learned from measurements.

``PrefillModel`` is the prefill time of ``new`` tokens after ``cached`` context tokens:
``overhead + new · per_token + new · (cached + new / 2) · per_token_ctx`` — the linear part is
the MLP and projections, the quadratic part attention over the growing context. The live
router refits it per worker from the time-to-first-token of the requests it served
(:class:`OnlinePrefillFit`); the simulator uses the same class calibrated from the reference
engine (or a published GPU profile), so both price a request the same way.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Final

import numpy as np

MEDIA: Final = 4  # device, host, disk, remote (kvstrata.index.Medium order)


@dataclass(frozen=True, slots=True)
class PrefillModel:
    overhead_s: float = 0.01
    per_token_s: float = 1e-4
    per_token_ctx_s: float = 0.0

    def seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return self.overhead_s
        attention = new_tokens * (cached_tokens + new_tokens / 2.0)
        return self.overhead_s + new_tokens * self.per_token_s + attention * self.per_token_ctx_s

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.per_token_s if self.per_token_s > 0 else float("inf")


@dataclass(frozen=True, slots=True)
class CostProfile:
    """One worker's cost figures: prefill model, per-block fetch seconds by tier, decode cost.

    ``fetch_s_per_block[m]`` is what it costs to bring one block from medium ``m`` into the
    device pool (0 for the device itself); ``decode_interference_s`` is the prefill slow-down
    each running decode adds (they share the forward passes).

    Chunked prefill (``prefill_chunk_tokens > 0``, as vLLM and Sarathi-Serve schedule it): a
    prefill of ``n`` new tokens runs as ``ceil(n / chunk)`` iterations, each of which also
    runs one decode step of the worker's batch, ``decode_step_base_s +
    decode_interference_s · active_decodes``; with no decode running nothing is added.
    ``prefill_chunk_tokens = 0`` keeps the unchunked rule ``active · decode_interference_s``.
    """

    prefill: PrefillModel = field(default_factory=PrefillModel)
    fetch_s_per_block: tuple[float, float, float, float] = (0.0, 2e-4, 1e-3, 4e-3)
    decode_interference_s: float = 0.0
    block_size: int = 16
    decode_step_base_s: float = 0.0
    prefill_chunk_tokens: int = 0

    def fetch_s(self, tier_blocks: tuple[int, int, int, int]) -> float:
        return sum(n * s for n, s in zip(tier_blocks, self.fetch_s_per_block, strict=True))

    def decode_step_s(self, active_decodes: int) -> float:
        """One decode iteration of a batch of ``active_decodes`` sequences."""
        return self.decode_step_base_s + self.decode_interference_s * active_decodes

    def interference_s(self, new_tokens: int, active_decodes: int) -> float:
        """What running decodes add to a prefill of ``new_tokens`` (see the class docstring)."""
        if active_decodes <= 0:
            return 0.0
        if self.prefill_chunk_tokens <= 0:
            return active_decodes * self.decode_interference_s
        chunks = -(-max(new_tokens, 1) // self.prefill_chunk_tokens)
        return chunks * self.decode_step_s(active_decodes)

    def with_prefill(self, prefill: PrefillModel) -> CostProfile:
        return replace(self, prefill=prefill)


class OnlinePrefillFit:
    """Least-squares refit of a :class:`PrefillModel` over the last ``window`` observations.

    Coefficients are clamped at zero (time never shrinks with more tokens); until
    ``min_samples`` observations exist the prior model is returned unchanged.
    """

    def __init__(self, prior: PrefillModel, *, window: int = 256, min_samples: int = 8) -> None:
        self.prior = prior
        self._samples: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._min = min_samples
        self._model = prior
        self._dirty = False

    def observe(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        if new_tokens < 0 or seconds <= 0 or not np.isfinite(seconds):
            return
        attention = new_tokens * (cached_tokens + new_tokens / 2.0)
        self._samples.append((1.0, float(new_tokens), attention, seconds))
        self._dirty = True

    @property
    def samples(self) -> int:
        return len(self._samples)

    def model(self) -> PrefillModel:
        if self._dirty and len(self._samples) >= self._min:
            data = np.array(self._samples, dtype=np.float64)
            coef = _nonnegative_lstsq(data[:, :3], data[:, 3])
            self._model = PrefillModel(float(coef[0]), float(coef[1]), float(coef[2]))
            self._dirty = False
        return self._model


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Ordinary least squares, then refit without any coefficient that came out negative."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active = [a for a, s in zip(active, sol, strict=True) if s > 0]
    return coef
