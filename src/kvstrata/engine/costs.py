"""Prefill cost measured on this engine, refitted online from its own forward passes.

Break-even decisions (fetch from a slower tier, or recompute?) and the ``recompute_s`` that
eviction policies weigh must reflect *this* model on *this* device, not a constant. The
engine times every prefill forward (new tokens, cached tokens, seconds) and refits the
three-term model of ``kvstrata.store.costmodel`` over a sliding window. Until enough distinct
samples exist, the initial model is used (the SmolLM2-on-2-cores default, or one passed in).
"""

from __future__ import annotations

import threading
from collections import deque

from kvstrata.store.costmodel import PrefillCostModel, fit

_MIN_DISTINCT_SAMPLES = 4


class OnlineCostModel:
    def __init__(self, initial: PrefillCostModel, *, window: int = 128, refit_every: int = 8):
        self.model = initial
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._refit_every = refit_every
        self._since_fit = 0
        self._lock = threading.Lock()

    def observe(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        if new_tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            self._samples.append((new_tokens, cached_tokens, seconds))
            self._since_fit += 1
            if self._since_fit < self._refit_every:
                return
            self._since_fit = 0
            shapes = {(n, c) for n, c, _ in self._samples}
            if len(shapes) < _MIN_DISTINCT_SAMPLES:
                return
            self.model = fit(
                list(self._samples),
                kv_bytes_per_token=self.model.kv_bytes_per_token,
                name="online",
            )

    def marginal_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds that recomputing ``new_tokens`` after ``cached_tokens`` adds to a forward."""
        return self.model.marginal_s(new_tokens, cached_tokens)
