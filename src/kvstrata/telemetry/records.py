"""Per-request records: what a lookup found and what it saved. Never holds prompt text."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request's cache outcome; joins lookup result, matched tokens and latency."""

    request_id: str
    tenant: str
    prompt_tokens: int
    matched_tokens: int = 0
    computed_tokens: int = 0
    matched_by_tier: dict[str, int] = field(default_factory=dict)
    reuse_disabled_reason: str | None = None
    queue_s: float = 0.0  # arrival → first scheduled
    ttft_s: float = 0.0
    prefill_s: float = 0.0  # first scheduled → first token (shares steps with other requests)
    prefill_compute_s: float = 0.0  # its own share of those steps: its prefill alone (0: unknown)
    preemptions: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def hit_ratio(self) -> float:
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hit_ratio"] = self.hit_ratio
        return out
