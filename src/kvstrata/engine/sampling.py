"""Sampling parameters and next-token selection (greedy, temperature, top-k, top-p).

Temperatures below ``SAMPLING_EPS`` are greedy, as in vLLM (its ``_SAMPLING_EPS``): dividing
logits by a temperature that small overflows to ``inf`` and the softmax turns ``nan``, and the
distribution such a temperature describes is the argmax anyway. ``SamplingParams`` stores them
as ``0.0``, so every caller that checks for greedy sampling sees it. Above the threshold the
logits are shifted by their maximum before they are divided, so every scaled score lies in
``[-inf, 0]`` and no temperature can overflow them.

Seeds are what ``torch.Generator.manual_seed`` accepts: ``SEED_MIN`` to ``SEED_MAX`` inclusive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch

from kvstrata.errors import InvalidInput

SAMPLING_EPS: Final = 1e-5
"""Temperatures in ``[0, SAMPLING_EPS)`` mean greedy decoding."""
SEED_MIN: Final = -(1 << 63)
SEED_MAX: Final = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 (or anything below SAMPLING_EPS) → greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 → off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if 0.0 < self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise InvalidInput("max_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidInput("temperature must lie in [0, 2]")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInput("top_p must lie in (0, 1]")
        if self.top_k < 0:
            raise InvalidInput("top_k must be >= 0")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidInput(f"seed must lie in [{SEED_MIN}, {SEED_MAX}]")


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick the next token from last-position logits ``[vocab]``."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    scores = logits.float().cpu()
    scores = (scores - scores.max()) / params.temperature  # in [-inf, 0]: cannot overflow
    if params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        drop = probs.cumsum(dim=-1) - probs > params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
