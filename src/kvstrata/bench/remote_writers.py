"""The writer processes of ``bench eviction --remote-writers``: one replays its share of a trace.

A writer is a separate process (``writer_main`` is its entry point, started by
``kvstrata.bench.eviction_remote`` with the ``spawn`` method) holding its own connection(s) to
the shared server; see that module for what each mode does per request and why. Writers pass a
shared barrier every ``sync_every`` requests (the same number of times each, so none waits for
one that has finished) and post their ``WriterResult`` — or the error that stopped them, after
breaking the barrier so that the others stop too — on a queue.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import redis

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, payload_digest
from kvstrata.store.value_policy import value_per_byte
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_client import RemoteConfig
from kvstrata.tiers.remote_format import encode_meta
from kvstrata.workloads.mooncake import TraceRequest

NAMESPACE = "bench-eviction"
LRU_PIPELINE = 8
"""Commands per pipeline of an LRU writer (bounds its transient client buffers)."""
_BARRIER_S = 600.0


def payload_of(key: BlockKey, size: int) -> bytes:
    """A block's deterministic stand-in payload (differs per key, so a mix-up is caught)."""
    return (bytes(key) * (size // len(key) + 1))[:size]


def lru_value(meta: KVObjectMeta, payload_bytes: int) -> bytes:
    """What an LRU writer stores for a block: the remote tier's meta encoding + payload."""
    payload = payload_of(meta.key, payload_bytes)
    return encode_meta(replace(meta, size=payload_bytes, digest=payload_digest(payload))) + payload


@dataclass(frozen=True)
class WriterJob:
    """Everything one writer process needs (pickled to it)."""

    mode: str
    url: str
    requests: tuple[TraceRequest, ...]
    chains: tuple[tuple[BlockKey, ...], ...]
    metas: dict[BlockKey, KVObjectMeta]
    capacity_bytes: int
    payload_bytes: int
    sync_every: int
    rounds: int


@dataclass
class WriterResult:
    """One writer's replay. ``refused``: stores the server turned down (value: the block was
    already reserved or held by another writer; lru: out of memory with nothing to evict)."""

    requests: int = 0
    prompt_tokens: int = 0
    saved_tokens: int = 0
    saved_prefill_s: float = 0.0
    stored: int = 0
    load_misses: int = 0
    refused: int = 0
    evicted: int = 0
    seconds: float = 0.0

    COUNTS: ClassVar[tuple[str, ...]] = (
        "requests", "prompt_tokens", "saved_tokens", "stored", "load_misses", "refused"
    )  # fmt: skip

    @property
    def token_hit_rate(self) -> float:
        return self.saved_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "token_hit_rate": round(self.token_hit_rate, 4)}


class _Writer:
    """One writer's replay; ``serve(index)`` handles one request of its share."""

    def __init__(self, job: WriterJob) -> None:
        self.job = job
        self.result = WriterResult()

    def count_hit(self, index: int, hit: int) -> None:
        request, chain = self.job.requests[index], self.job.chains[index]
        self.result.requests += 1
        self.result.prompt_tokens += request.input_length
        if hit:
            self.result.saved_tokens += request.prefix_tokens(hit)
            self.result.saved_prefill_s += sum(self.job.metas[k].recompute_s for k in chain[:hit])

    def serve(self, index: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _ValueWriter(_Writer):
    def __init__(self, job: WriterJob) -> None:
        super().__init__(job)
        config = RemoteConfig(url=job.url, namespace=NAMESPACE, timeout_s=30.0)
        self.tier = RemoteTier(config, job.capacity_bytes, value_of=value_per_byte).start()

    def serve(self, index: int) -> None:
        tier, chain = self.tier, self.job.chains[index]
        tier.probe(chain)
        held = 0
        while held < len(chain) and tier.contains(chain[held]):
            held += 1
        hit = 0
        if held:
            tier.read_ahead(chain[:held])
            for key in chain[:held]:
                lease = tier.prepare_load(key)
                if lease is None:
                    self.result.load_misses += 1
                    break
                tier.complete_load(lease)
                hit += 1
            tier.discard_read_ahead()
        self.count_hit(index, hit)
        size = self.job.payload_bytes
        for key in chain[hit:]:
            if tier.contains(key):
                continue
            payload = payload_of(key, size)
            meta = replace(
                self.job.metas[key],
                size=size,
                digest=payload_digest(payload),
                created_at=time.time(),
            )
            slot = tier.prepare_store(meta)
            if slot is None:  # another writer holds or reserved it (no quotas here)
                self.result.refused += 1
                continue
            slot.buffer[:] = payload
            if tier.complete_store(slot, True):
                self.result.stored += 1
        self.result.evicted += len(tier.take_evicted())

    def close(self) -> None:
        self.tier.flush_touches()
        self.tier.close()


class _LRUWriter(_Writer):
    def __init__(self, job: WriterJob) -> None:
        super().__init__(job)
        self.conn = redis.Redis.from_url(job.url, socket_timeout=30.0)

    def value_of(self, key: BlockKey) -> bytes:
        return lru_value(self.job.metas[key], self.job.payload_bytes)

    def serve(self, index: int) -> None:
        chain = self.job.chains[index]
        names = [f"{NAMESPACE}:{key.hex()}" for key in chain]
        present = [bool(n) for n in self._pipelined(names, lambda pipe, name: pipe.exists(name))]
        held = present.index(False) if False in present else len(present)
        hit = 0
        for key, value in zip(chain[:held], self._pipelined(names[:held], _get), strict=True):
            if value is None:  # evicted since the EXISTS
                self.result.load_misses += 1
                break
            if value != self.value_of(key):
                raise AssertionError(f"LRU server returned other bytes for {key.hex()}")
            hit += 1
        self.count_hit(index, hit)
        missing = [p for p in range(hit, len(chain)) if p < held or not present[p]]
        values = {names[p]: self.value_of(chain[p]) for p in missing}
        replies = self._pipelined(list(values), lambda pipe, name: pipe.set(name, values[name]))
        for reply in replies:
            if isinstance(reply, redis.OutOfMemoryError):  # nothing left to evict
                self.result.refused += 1
            else:
                self.result.stored += 1

    def _pipelined(self, names: list[str], build: Any) -> list[Any]:
        """``build(pipe, name)`` for each name, ``LRU_PIPELINE`` commands per round trip, so a
        long chain never holds more than that many objects in the server's client buffers."""
        out: list[Any] = []
        for start in range(0, len(names), LRU_PIPELINE):
            pipe = self.conn.pipeline(transaction=False)
            for name in names[start : start + LRU_PIPELINE]:
                build(pipe, name)
            out += pipe.execute(raise_on_error=False)
        return out

    def close(self) -> None:
        self.conn.close()


def _get(pipe: Any, name: str) -> None:
    pipe.get(name)


def _replay(job: WriterJob, barrier: Any) -> WriterResult:
    writer: _Writer = _ValueWriter(job) if job.mode == "value" else _LRUWriter(job)
    started = time.perf_counter()
    try:
        for batch in range(job.rounds):
            barrier.wait(_BARRIER_S)
            for index in range(batch * job.sync_every, (batch + 1) * job.sync_every):
                if index < len(job.requests):
                    writer.serve(index)
        barrier.wait(_BARRIER_S)
    finally:
        writer.close()
    writer.result.seconds = time.perf_counter() - started
    return writer.result


def writer_main(job: WriterJob, writer: int, barrier: Any, results: Any) -> None:
    """A writer process's entry point: replay, then post ``(writer, result or error)``."""
    try:
        results.put((writer, _replay(job, barrier).to_dict()))
    except BaseException as exc:  # reported to the parent, which fails the bench
        barrier.abort()
        results.put((writer, f"{type(exc).__name__}: {exc}"))
        raise
