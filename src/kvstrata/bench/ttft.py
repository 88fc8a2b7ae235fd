"""Time to first token: fresh prefill vs a hit on the device tier, in the same run.

The prompt is a deterministic sequence of ordinary (non-special) token ids. Fresh and hit
runs are interleaved and the median of each is reported, so background noise hits both
alike. The hit has everything but the last block cached (the last prompt token is always
computed). Exactness is checked on the same prompt: logits of every step of a 32-token greedy
continuation, fresh vs hit.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvstrata.engine.engine import ReferenceEngine
from kvstrata.engine.sampling import SamplingParams
from kvstrata.engine.verify import verify_tokens


@dataclass(frozen=True)
class TtftResult:
    model: str
    tier: str
    prompt_tokens: int
    matched_tokens: int
    repeats: int
    ttft_fresh_s: float
    ttft_hit_s: float
    speedup: float
    max_abs_logit_diff: float
    greedy_equal: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def synthetic_prompt(engine: ReferenceEngine, n_tokens: int, seed: int = 0) -> list[int]:
    """``n_tokens`` ordinary token ids (no special tokens), reproducible from ``seed``."""
    special = set(engine.tokenizer.all_special_ids)
    vocab = len(engine.tokenizer)
    rng = np.random.default_rng(seed)
    ids = rng.integers(low=len(special) + 1, high=vocab, size=n_tokens * 2)
    return [int(i) for i in ids if int(i) not in special][:n_tokens]


def _ttft(engine: ReferenceEngine, ids: list[int], *, lookup: bool) -> tuple[float, int]:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    generation = engine.generate(ids, params, lookup=lookup, store=True).run()
    return time.perf_counter() - started, generation.record.matched_tokens


def run_ttft(
    engine: ReferenceEngine, *, model: str, n_tokens: int, repeats: int, check_tokens: int = 32
) -> TtftResult:
    ids = synthetic_prompt(engine, n_tokens)
    _ttft(engine, ids, lookup=False)  # warm-up; also stores every full block
    fresh, hit, matched = [], [], 0
    for _ in range(repeats):
        seconds, _ = _ttft(engine, ids, lookup=False)
        fresh.append(seconds)
        seconds, matched = _ttft(engine, ids, lookup=True)
        hit.append(seconds)
    _, diff, equal = verify_tokens(engine, ids, tenant="default", max_tokens=check_tokens)
    fresh_s, hit_s = statistics.median(fresh), statistics.median(hit)
    return TtftResult(
        model=model,
        tier="device",
        prompt_tokens=len(ids),
        matched_tokens=matched,
        repeats=repeats,
        ttft_fresh_s=fresh_s,
        ttft_hit_s=hit_s,
        speedup=fresh_s / hit_s if hit_s > 0 else float("inf"),
        max_abs_logit_diff=diff,
        greedy_equal=equal,
    )
