"""Prometheus metrics of kvstrata, bound to a registry the owner passes in.

Nothing here touches the process-global default registry: a server creates one registry,
hands this object to its engine and exposes exactly that registry on ``/metrics``. Tests
create their own and read values back with ``value()``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 512, 1024, 2048, 4096, 8192)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class KvMetrics:
    """Counters and gauges for requests, reuse and the device pool."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvstrata_requests",
            "Requests finished, by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvstrata_prompt_tokens", "Prompt tokens of served requests", registry=r
        )
        self.matched_tokens = Counter(
            "kvstrata_matched_tokens", "Prompt tokens served from cached KV", ["tier"], registry=r
        )
        self.computed_tokens = Counter(
            "kvstrata_computed_tokens", "Prompt tokens prefilled by the model", registry=r
        )
        self.hit_ratio = Gauge(
            "kvstrata_token_hit_ratio", "matched / prompt tokens since start", registry=r
        )
        self.ttft = Histogram(
            "kvstrata_ttft_seconds", "Time to first token", buckets=_TTFT_BUCKETS, registry=r
        )
        self.prefill = Histogram(
            "kvstrata_prefill_seconds",
            "Prefill time (lookup + gather + forward)",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.pool_blocks_used = Gauge(
            "kvstrata_pool_blocks_used", "Device pool blocks holding KV", registry=r
        )
        self.pool_blocks_free = Gauge(
            "kvstrata_pool_blocks_free", "Device pool blocks free", registry=r
        )
        self.pool_evictions = Counter(
            "kvstrata_pool_evictions", "Device pool blocks evicted (leaf first)", registry=r
        )
        self.reuse_disabled = Counter(
            "kvstrata_reuse_disabled_requests",
            "Requests served without reuse because identity was unsafe",
            ["reason"],
            registry=r,
        )
        self.relayout_blocks = Counter(
            "kvstrata_relayout_blocks",
            "Stored blocks of another layout converted into the pool's (counted in own blocks)",
            ["from_layout", "to_layout"],
            registry=r,
        )
        self.relayout_tokens = Counter(
            "kvstrata_relayout_tokens",
            "Prompt tokens served from stored objects of another layout, converted",
            ["from_layout", "to_layout"],
            registry=r,
        )
        self.relayout_refused = Counter(
            "kvstrata_relayout_refused",
            "Stored prefixes of another layout not used: lossy_not_allowed, a failed load "
            "(missing, digest_mismatch, incompatible, tier_error) or conversion_error",
            ["from_layout", "reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "kvstrata_queue_depth", "Requests waiting for their first engine step", registry=r
        )
        self.running = Gauge(
            "kvstrata_running_sequences", "Sequences in the engine's running batch", registry=r
        )
        self.queue_delay = Histogram(
            "kvstrata_queue_delay_seconds",
            "Arrival to first engine step, per request",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.step = Histogram(
            "kvstrata_step_seconds",
            "Engine step time (one batched forward)",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.batch_sequences = Histogram(
            "kvstrata_batch_sequences",
            "Sequences per engine step",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            "kvstrata_batch_tokens",
            "Tokens computed per engine step",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.preemptions = Counter(
            "kvstrata_preemptions",
            "Running sequences sent back to the queue (pool full)",
            registry=r,
        )
        self.deferred = Counter(
            "kvstrata_admissions_deferred",
            "Admissions put off one step: the prompt's next block was being computed by a "
            "running request (hit it instead of computing it twice)",
            registry=r,
        )
        self.cancelled = Counter(
            "kvstrata_cancelled_requests", "Requests cancelled before their end", registry=r
        )
        self.rejected = Counter(
            "kvstrata_rejected_requests",
            "Requests refused because the queue was full (429)",
            registry=r,
        )
        self._prompt_total = 0
        self._matched_total = 0

    def observe_prefill(self, *, prompt_tokens: int, matched_by_tier: dict[str, int]) -> None:
        matched = sum(matched_by_tier.values())
        self.prompt_tokens.inc(prompt_tokens)
        for tier, tokens in matched_by_tier.items():
            self.matched_tokens.labels(tier=tier).inc(tokens)
        self.computed_tokens.inc(prompt_tokens - matched)
        self._prompt_total += prompt_tokens
        self._matched_total += matched
        if self._prompt_total:
            self.hit_ratio.set(self._matched_total / self._prompt_total)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of a sample (tests and benches); 0.0 when absent."""
        found = self.registry.get_sample_value(name, labels or {})
        return float(found) if found is not None else 0.0
