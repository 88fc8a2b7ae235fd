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
* **determined** also means the window's distinct shapes pin all three terms (their rows
  ``[1, n, n·(c + n/2)]`` have rank 3): shapes that all compute the same number of new
  tokens cannot tell the overhead from the per-token cost, however many cached lengths
  they cover;
* **one outlier moves nothing**: a least-squares fit in seconds follows one stalled forward
  (a 120 s GC or swap pause among 256 good timings multiplied a 2,048-token price by 4.4).
  So the fit drops its worst sample while that sample is off by more than ``OUTLIER_FACTOR``
  (4×) and refits, at most ``window // 16`` times (iterative outlier deletion): a device that
  really became several times slower is followed after that many timings;
* observations with a negative token count, or a duration that is not a finite positive
  number below ``MAX_SECONDS`` (an hour: no forward takes that long; a larger figure is a
  bad header, and would overflow a risk factor), are ignored. Zero new tokens is kept: it
  measures the overhead alone.

Thread-safe: ``observe`` and ``model`` may be called from any thread; one lock guards the
window and the cached fit (the solve is small: 256 × 3).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import replace

import numpy as np

from kvstrata.costs.model import PrefillModel, fit
from kvstrata.errors import InvalidInput

DEFAULT_WINDOW = 256
DEFAULT_MIN_SAMPLES = 8
DEFAULT_MIN_SHAPES = 4
DEFAULT_UNKNOWN_SPREAD = 0.5
OUTLIER_FACTOR = 4.0
MAX_SECONDS = 3600.0


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
        if new_tokens < 0 or cached_tokens < 0 or not 0 < seconds < MAX_SECONDS:
            return  # (NaN fails the comparison too)
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
            shapes = {(n, c) for n, c, _ in window}
            determined = (
                len(window) >= self._min_samples
                and len(shapes) >= self._min_shapes
                and _pins_three_terms(shapes)
            )
            if determined:
                self._model = self._trimmed_fit(window)
            else:  # still the prior, judged on what it has seen (out of sample for it)
                self._model = replace(self.prior, spread=self._prior_spread(window))
            self._dirty = False
            return self._model

    def _trimmed_fit(self, window: list[tuple[int, int, float]]) -> PrefillModel:
        """The fit without its outliers (module docstring)."""
        kept = list(window)
        limit = math.log(OUTLIER_FACTOR)
        for _ in range(max(1, (self._samples.maxlen or len(window)) // 16)):
            model = fit(kept, kv_bytes_per_token=self.prior.kv_bytes_per_token, name="online")
            if len(kept) <= self._min_samples:
                return model
            errors = [abs(math.log(s / max(model.seconds(n, c), 1e-12))) for n, c, s in kept]
            worst = max(range(len(kept)), key=errors.__getitem__)
            if errors[worst] <= limit:
                return model
            del kept[worst]
            if not _pins_three_terms({(n, c) for n, c, _ in kept}):
                return model
        return fit(kept, kv_bytes_per_token=self.prior.kv_bytes_per_token, name="online")

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


def _pins_three_terms(shapes: set[tuple[int, int]]) -> bool:
    """Whether fitting over ``shapes`` determines overhead, per-token and attention terms."""
    rows = np.array([[1.0, float(n), float(n) * (c + n / 2.0)] for n, c in shapes])
    if len(rows) < 3:
        return False
    scaled = rows / np.maximum(np.abs(rows).max(axis=0), 1e-300)  # columns differ by 1e6
    return bool(np.linalg.matrix_rank(scaled) == 3)
