"""Prefetch from the shared remote tier into host while a request waits (tiny model, real
Valkey).

A writer engine serves a prompt, which its store writes through to host and to the remote
tier. A second engine (another store: its own host tier, the same remote namespace) gets the
same prompt while its step thread is busy (held inside ``engine.call``): the prompt's blocks
are prefetched into its host tier before the request is admitted, admission then loads them
from host (none from remote), the output is exactly a fresh prefill's, and the prefetched
bytes count as used. Prefetched blocks that are evicted, or still unused at shutdown, count
as wasted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.factory import build_engine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.engine.sampling import SamplingParams
from kvstrata.runtime.config import WorkerConfig, host_tier, remote_tier
from kvstrata.runtime.valkey_server import ValkeyServer
from kvstrata.store.prefetch import Prefetcher
from kvstrata.tiers.remote_client import RemoteConfig

B = 16
BLOCK = 2 * 2 * 2 * B * 16 * 4  # tiny: 2 layers, K+V, 2 heads, 16 tokens, head dim 16, fp32
TIMEOUT_S = 20.0
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, 40000, size=n)]


def engine_on(
    loaded: LoadedModel,
    server: ValkeyServer,
    namespace: str,
    *,
    host_blocks: int = 64,
    host_policy: str = "kvstrata",
) -> ReferenceEngine:
    tiers = WorkerConfig(
        tiers=(
            host_tier(host_blocks * BLOCK, eviction_policy=host_policy),
            remote_tier(RemoteConfig(url=server.url, namespace=namespace), 256 * BLOCK),
        )
    )
    return build_engine(loaded, EngineConfig(block_size=B, pool_blocks=64), tiers)


def write_to_remote(loaded: LoadedModel, server: ValkeyServer, ns: str, prompt: list[int]) -> None:
    writer = engine_on(loaded, server, ns)
    try:
        writer.generate(prompt, ONE).run()
    finally:
        writer.close()


@contextmanager
def busy(engine: ReferenceEngine) -> Iterator[None]:
    """Hold the engine's step thread inside a step (as a long forward would)."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        assert release.wait(TIMEOUT_S)

    engine.call(hold)
    assert entered.wait(TIMEOUT_S), "the loop did not take the call"
    try:
        yield
    finally:
        release.set()


def prefetcher(engine: ReferenceEngine) -> Prefetcher:
    assert engine.bridge is not None and engine.bridge.prefetcher is not None
    return engine.bridge.prefetcher


def metric(engine: ReferenceEngine, name: str, **labels: str) -> float:
    assert engine.bridge is not None
    return engine.bridge.store.metrics.value(name, labels)


def test_a_queued_request_finds_its_remote_prefix_prefetched_into_host(
    tiny_model: LoadedModel, remote_server: ValkeyServer, remote_namespace: str
) -> None:
    prompt = tokens(6 * B, seed=1)  # 6 full blocks: 5 looked up, the 6th the tail's donor
    write_to_remote(tiny_model, remote_server, remote_namespace, prompt)
    reader = engine_on(tiny_model, remote_server, remote_namespace)
    reader.start_loop()
    try:
        assert reader.bridge is not None
        host = reader.bridge.store.levels[0].tier
        keys = reader.block_keys(prompt)
        assert not any(host.contains(k) for k in keys)
        with busy(reader):
            cached = reader.generate(prompt, GREEDY, keep_logits=True)
            assert prefetcher(reader).wait_idle(TIMEOUT_S)
            assert all(host.contains(k) for k in keys)  # before admission
            assert metric(reader, "kvstrata_prefetch_bytes_total", tier="host") == 6 * BLOCK
            assert metric(reader, "kvstrata_prefetch_used_bytes_total", tier="host") == 0
        cached.run()
        assert cached.record.matched_by_tier == {"host": len(prompt) - 1}
        assert metric(reader, "kvstrata_tier_hits_total", tier="host") == 6
        assert metric(reader, "kvstrata_tier_hits_total", tier="remote") == 0
        assert metric(reader, "kvstrata_prefetch_used_bytes_total", tier="host") == 6 * BLOCK
        assert metric(reader, "kvstrata_prefetch_requests_total", outcome="copied") == 1
        fresh = reader.generate(prompt, GREEDY, use_cache=False, keep_logits=True).run()
        assert cached.output_ids == fresh.output_ids
        diff = max(
            float((a - b).abs().max())
            for a, b in zip(fresh.step_logits, cached.step_logits, strict=True)
        )
        assert diff <= 1e-4
    finally:
        reader.close()
    wasted = sum(
        metric(reader, "kvstrata_prefetch_wasted_bytes_total", tier="host", reason=reason)
        for reason in ("removed", "unused_at_close")
    )
    assert wasted == 0


def test_prefetched_blocks_left_unused_count_as_waste(
    tiny_model: LoadedModel, remote_server: ValkeyServer, remote_namespace: str
) -> None:
    """Prefetched, then the request is cancelled: 3 of the 6 blocks are evicted from host by
    later traffic (LRU: the prefetched chain's leaves go first), the other 3 are still unused
    when the engine closes. All 6 count as wasted, none as used."""
    prompt, other = tokens(6 * B, seed=2), tokens(5 * B, seed=3)
    write_to_remote(tiny_model, remote_server, remote_namespace, prompt)
    reader = engine_on(
        tiny_model, remote_server, remote_namespace, host_blocks=8, host_policy="lru"
    )
    reader.start_loop()
    try:
        with busy(reader):
            queued = reader.generate(prompt, GREEDY)
            assert prefetcher(reader).wait_idle(TIMEOUT_S)
            assert metric(reader, "kvstrata_prefetch_bytes_total", tier="host") == 6 * BLOCK
            queued.close()  # leaves the queue before admission
        reader.call(lambda: None).result(TIMEOUT_S)  # the cancellation was processed
        reader.generate(other, ONE).run()  # 5 blocks written through: 3 evictions
        assert metric(reader, "kvstrata_prefetch_wasted_bytes_total", tier="host", reason="removed")
        assert (
            metric(reader, "kvstrata_prefetch_wasted_bytes_total", tier="host", reason="removed")
            == 3 * BLOCK
        )
    finally:
        reader.close()
    assert (
        metric(
            reader, "kvstrata_prefetch_wasted_bytes_total", tier="host", reason="unused_at_close"
        )
        == 3 * BLOCK
    )
    assert metric(reader, "kvstrata_prefetch_used_bytes_total", tier="host") == 0


def test_an_idle_engine_or_an_engine_without_a_loop_does_not_prefetch(
    tiny_model: LoadedModel, remote_server: ValkeyServer, remote_namespace: str
) -> None:
    """Without a loop (the caller steps) the request is admitted at once: no prefetch."""
    prompt = tokens(3 * B, seed=4)
    write_to_remote(tiny_model, remote_server, remote_namespace, prompt)
    reader = engine_on(tiny_model, remote_server, remote_namespace)
    try:
        done = reader.generate(prompt, ONE).run()
        assert done.record.matched_by_tier == {"remote": len(prompt) - 1}
        assert metric(reader, "kvstrata_prefetch_bytes_total", tier="host") == 0
    finally:
        reader.close()
