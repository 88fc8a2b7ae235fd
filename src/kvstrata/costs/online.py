"""The one online refit of a :class:`~kvstrata.costs.model.PrefillModel` from timed forwards.

Used by the reference engine (it times every prefill forward: new tokens, cached tokens,
seconds) and by the router's live view of each worker (it times each request's first token).
Both need *this* model on *this* device, not a constant, so both keep a sliding window of
observations and refit the three-term model with :func:`kvstrata.costs.model.fit`.

The rule (one for both callers):

* **window** of the last 256 observations: large enough that one slow outlier (a GC pause,
  a neighbour's burst) moves the fit little, small enough to follow a change of device load
  within a few hundred requests;
* **refit lazily**, when the model is read and observations arrived since the last fit.
  ``observe`` runs on the engine's forward path and the router's response path, so it only
  appends (O(1)); reads after a burst of observations refit once. (An eager refit every
  k-th observation would put the least-squares solve on the forward path and lag by up to
  k samples.)
* **prior until determined**: the prior model is returned until the window holds at least 8
  observations *and* 4 distinct (new, cached) shapes. The sample count keeps a handful of
  noisy timings from replacing a calibrated prior; the shape count keeps three unknowns from
  being fitted to fewer distinct points than it takes to pin them (repeated identical
  prompts would otherwise give an arbitrary minimum-norm split of time between the terms).
* **spread**: the model returned carries ``spread`` (:class:`PrefillModel`), how far it
  can be trusted, for risk-aware callers (the router prices a quantile of TTFT, not its
  mean): a fit's degrees-of-freedom-corrected RMS log residual over the window; the prior's
  RMS log error on the observations seen so far (out of sample for it), with
  ``unknown_spread`` counted as one more squared error (default 0.5: a prior taken from one
  timing is trusted to a factor of e^0.5 ≈ 1.65 until timings say more; the prior's own
  spread if that is larger), so with no observation the spread is ``unknown_spread``.
* observations with a negative token count, or a duration that is not a finite positive
  number, are ignored. Zero new tokens is kept: it measures the overhead alone.

Thread-safe: ``observe`` and ``model`` may be called from any thread; one lock guards the
window and the cached fit (the solve is small: 256 × 3).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import replace

from kvstrata.costs.model import PrefillModel, fit
from kvstrata.errors import InvalidInput

DEFAULT_WINDOW = 256
DEFAULT_MIN_SAMPLES = 8
DEFAULT_MIN_SHAPES = 4
DEFAULT_UNKNOWN_SPREAD = 0.5


class OnlinePrefillFit:
    """Sliding-window least-squares refit of a :class:`PrefillModel` (see the module docstring)."""

    def __init__(
        self,
        prior: PrefillModel,
        *,
        window: int = DEFAULT_WINDOW,
        min_samples: int = DEFAULT_MIN_SAMPLES,
        min_shapes: int = DEFAULT_MIN_SHAPES,
        unknown_spread: float = DEFAULT_UNKNOWN_SPREAD,
    ) -> None:
        if not (math.isfinite(unknown_spread) and unknown_spread >= 0):
            raise InvalidInput(f"unknown_spread must be >= 0, got {unknown_spread}")
        if window < 1 or min_samples < 3 or min_shapes < 1:
            raise InvalidInput(
                f"need window >= 1, min_samples >= 3, min_shapes >= 1; got "
                f"{window}, {min_samples}, {min_shapes}"
            )
        self.prior = prior
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._min_samples = min_samples
        self._min_shapes = min_shapes
        self._unknown_spread = unknown_spread
        self._model = replace(prior, spread=max(prior.spread, unknown_spread))
        self._dirty = False
        self._lock = threading.Lock()

    def observe(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        """Record one forward that computed ``new_tokens`` after ``cached_tokens``."""
        if new_tokens < 0 or cached_tokens < 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        with self._lock:
            self._samples.append((new_tokens, cached_tokens, seconds))
            self._dirty = True

    @property
    def samples(self) -> int:
        with self._lock:
            return len(self._samples)

    def model(self) -> PrefillModel:
        """The current fit, or the prior while the window does not determine one."""
        with self._lock:
            if not self._dirty:
                return self._model
            window = list(self._samples)
            determined = (
                len(window) >= self._min_samples
                and len({(n, c) for n, c, _ in window}) >= self._min_shapes
            )
            if determined:
                self._model = fit(
                    window, kv_bytes_per_token=self.prior.kv_bytes_per_token, name="online"
                )
            else:  # still the prior, judged on what it has seen (out of sample for it)
                self._model = replace(self.prior, spread=self._prior_spread(window))
            self._dirty = False
            return self._model

    def _prior_spread(self, window: list[tuple[int, int, float]]) -> float:
        """The prior's RMS log error on ``window``, ``unknown_spread`` counted as one more
        squared error: one lucky timing does not make the prior exact."""
        seen = self.prior.log_spread(window) ** 2 * len(window)
        unknown = max(self.prior.spread, self._unknown_spread) ** 2
        return math.sqrt((seen + unknown) / (len(window) + 1))

    def seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """:meth:`PrefillModel.seconds` of the current fit."""
        return self.model().seconds(new_tokens, cached_tokens)

    def marginal_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """:meth:`PrefillModel.marginal_s` of the current fit (the engine's recompute estimate)."""
        return self.model().marginal_s(new_tokens, cached_tokens)
