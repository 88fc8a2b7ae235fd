"""Hashing throughput: storage keys vs router hashes vs vLLM's own block hash, on the same tokens.

The question this answers is whether a router can afford to hash every incoming request: the
router hash must beat vLLM's sha256/pickle scheme (the cost a vLLM-compatible router would pay)
by a wide margin. All three hash the same Python list of token ids, as a router receives it,
so list-to-array conversion is part of every measurement. The schemes are timed in
``repeat`` rounds, one run of each per round (so a noisy moment hits all three alike); the
figures are the medians over the rounds, with every run's figure and the spread of the
per-round ratio beside them.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvstrata.errors import InvalidInput
from kvstrata.identity.keys import FingerprintDigest, TenantNamespace, chain_keys, namespace_root
from kvstrata.identity.router_hash import RouterHasher, router_seed
from kvstrata.identity.vllm_hash import vllm_block_hashes, vllm_none_hash

VOCAB_SIZE = 151_936
"""Token ids are drawn below a typical modern vocabulary size (Qwen2's)."""


@dataclass(frozen=True)
class HashBenchResult:
    """Median tokens per second of each scheme (full blocks only) and router / baseline."""

    tokens: int
    block_size: int
    repeat: int
    key_tokens_per_s: float
    router_tokens_per_s: float
    baseline_tokens_per_s: float
    ratio: float
    """Median over rounds of baseline seconds ÷ router seconds in the same round."""
    ratio_min: float
    ratio_max: float
    runs_tokens_per_s: dict[str, list[float]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return max(time.perf_counter() - start, 1e-9)


def run_hash_bench(
    tokens: int = 131_072, block_size: int = 16, repeat: int = 5, rng_seed: int = 0
) -> HashBenchResult:
    """Time the three schemes on one random token list; hashers are built outside the timing."""
    if tokens < block_size or block_size <= 0:
        raise InvalidInput("need block_size > 0 and at least one full block of tokens")
    if repeat <= 0:
        raise InvalidInput("repeat must be positive")
    rng = random.Random(rng_seed)
    token_ids = [rng.randrange(VOCAB_SIZE) for _ in range(tokens)]
    hashed_tokens = (tokens // block_size) * block_size

    root = namespace_root(
        FingerprintDigest(bytes(range(32))), TenantNamespace.for_tenant("bench", b"bench")
    )
    router = RouterHasher(router_seed(root), block_size)
    none_hash = vllm_none_hash("sha256")
    router.hashes(token_ids)  # grow its power tables and scratch once, as a live router would

    schemes: dict[str, Callable[[], object]] = {
        "keys": lambda: chain_keys(root, token_ids, block_size),
        "router": lambda: router.hashes(token_ids),
        "baseline": lambda: vllm_block_hashes(token_ids, block_size, none_hash=none_hash),
    }
    seconds: dict[str, list[float]] = {name: [] for name in schemes}
    for _ in range(repeat):
        for name, fn in schemes.items():
            seconds[name].append(_seconds(fn))
    ratios = [b / r for b, r in zip(seconds["baseline"], seconds["router"], strict=True)]
    rates = {name: [hashed_tokens / s for s in runs] for name, runs in seconds.items()}
    return HashBenchResult(
        tokens=tokens,
        block_size=block_size,
        repeat=repeat,
        key_tokens_per_s=statistics.median(rates["keys"]),
        router_tokens_per_s=statistics.median(rates["router"]),
        baseline_tokens_per_s=statistics.median(rates["baseline"]),
        ratio=statistics.median(ratios),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        runs_tokens_per_s=rates,
    )
