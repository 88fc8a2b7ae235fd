"""Time to first token: fresh prefill vs a hit on the device tier, in the same run.

The prompt is a deterministic sequence of ordinary (non-special) token ids. Fresh and hit
runs are interleaved and the median of each is reported, so background noise hits both
alike. The hit has everything but the last block cached (the last prompt token is always
computed) in the chosen tier: ``device`` (the engine's pool), ``host`` (the pool is cleared
before each hit, so every block is promoted from host DRAM), ``disk`` (the pool is cleared
and the host tier switched off; ``--cold`` also drops the files from the page cache) or
``remote`` (a Redis/Valkey remote tier is the only tier below the pool, written through; the
pool is cleared before each hit, so every block is probed, read ahead and loaded over the
network, digest verified).
Exactness is checked on the same prompt and tier: logits of every step of a 32-token greedy
continuation, fresh vs hit.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvstrata.engine.engine import ReferenceEngine
from kvstrata.engine.sampling import SamplingParams
from kvstrata.errors import InvalidInput
from kvstrata.tiers.disk import DiskTier


@dataclass(frozen=True)
class TtftResult:
    model: str
    tier: str
    prompt_tokens: int
    matched_tokens: int
    matched_by_tier: dict[str, int]
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


def _ttft(engine: ReferenceEngine, ids: list[int], *, lookup: bool) -> tuple[float, dict[str, int]]:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    generation = engine.generate(ids, params, lookup=lookup, store=True).run()
    return time.perf_counter() - started, generation.record.matched_by_tier


def hit_preparation(engine: ReferenceEngine, tier: str, *, cold: bool) -> Callable[[], None]:
    """What must happen before a hit so that it is served from ``tier`` (not timed)."""
    if tier == "device":
        return lambda: None
    bridge = engine.bridge
    if bridge is None:
        raise InvalidInput(f"--tier {tier} needs an engine with that tier")
    store = bridge.store
    if tier == "disk":
        store.flush()
        store.set_enabled("host", False) if len(store.levels) > 1 else None

    def prepare() -> None:
        engine.pool.clear()
        if tier == "disk" and cold:
            drop_page_cache(store.levels[store.level_index("disk")].tier)

    return prepare


def drop_page_cache(tier: object) -> None:
    """Ask the kernel to forget the tier's (clean, fsynced) pages: reads then hit the device."""
    if not isinstance(tier, DiskTier):
        return
    stored = tier.keys()
    for key in stored:
        path = tier.path_of(key)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_ttft(
    engine: ReferenceEngine,
    *,
    model: str,
    n_tokens: int,
    repeats: int,
    tier: str = "device",
    cold: bool = False,
    check_tokens: int = 32,
) -> TtftResult:
    ids = synthetic_prompt(engine, n_tokens)
    _ttft(engine, ids, lookup=False)  # warm-up; also stores every full block
    prepare = hit_preparation(engine, tier, cold=cold)
    fresh: list[float] = []
    hit: list[float] = []
    by_tier: dict[str, int] = {}
    for _ in range(repeats):
        seconds, _ = _ttft(engine, ids, lookup=False)
        fresh.append(seconds)
        prepare()
        seconds, by_tier = _ttft(engine, ids, lookup=True)
        hit.append(seconds)
    greedy = SamplingParams(max_tokens=check_tokens, temperature=0.0, ignore_eos=True)
    reference = engine.generate(ids, greedy, use_cache=False, keep_logits=True).run()
    prepare()
    cached = engine.generate(ids, greedy, keep_logits=True).run()
    diff = max(
        float((a - b).abs().max())
        for a, b in zip(reference.step_logits, cached.step_logits, strict=True)
    )
    fresh_s, hit_s = statistics.median(fresh), statistics.median(hit)
    return TtftResult(
        model=model,
        tier=tier,
        prompt_tokens=len(ids),
        matched_tokens=sum(by_tier.values()),
        matched_by_tier=by_tier,
        repeats=repeats,
        ttft_fresh_s=fresh_s,
        ttft_hit_s=hit_s,
        speedup=fresh_s / hit_s if hit_s > 0 else float("inf"),
        max_abs_logit_diff=diff,
        greedy_equal=reference.output_ids == cached.output_ids,
    )
