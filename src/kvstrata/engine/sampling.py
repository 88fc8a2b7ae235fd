"""Sampling parameters and next-token selection (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.errors import InvalidInput


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 → greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 → off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise InvalidInput("max_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidInput("temperature must lie in [0, 2]")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInput("top_p must lie in (0, 1]")
        if self.top_k < 0:
            raise InvalidInput("top_k must be >= 0")


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick the next token from last-position logits ``[vocab]``."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits).item())
    scores = logits.float().cpu() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_scores, dim=-1) > params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
