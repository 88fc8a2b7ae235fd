"""Hashing throughput: storage keys vs router hashes vs vLLM's own block hash, on the same tokens.

The question this answers is whether a router can afford to hash every incoming request: the
router hash must beat vLLM's sha256/pickle scheme (the cost a vLLM-compatible router would pay)
by a wide margin. All three hash the same Python list of token ids, as a router receives it,
so list-to-array conversion is part of every measurement; the best of ``repeat`` runs is kept
to filter out scheduler noise.
"""

from __future__ import annotations

import random
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
    """Tokens per second of each scheme (full blocks only) and router / baseline."""

    tokens: int
    block_size: int
    repeat: int
    key_tokens_per_s: float
    router_tokens_per_s: float
    baseline_tokens_per_s: float
    ratio: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _best_seconds(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


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

    key_s = _best_seconds(lambda: chain_keys(root, token_ids, block_size), repeat)
    router_s = _best_seconds(lambda: router.hashes(token_ids), repeat)
    baseline_s = _best_seconds(
        lambda: vllm_block_hashes(token_ids, block_size, none_hash=none_hash), repeat
    )
    return HashBenchResult(
        tokens=tokens,
        block_size=block_size,
        repeat=repeat,
        key_tokens_per_s=hashed_tokens / key_s,
        router_tokens_per_s=hashed_tokens / router_s,
        baseline_tokens_per_s=hashed_tokens / baseline_s,
        ratio=baseline_s / router_s,
    )
