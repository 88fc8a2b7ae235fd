"""``bench eviction --remote-writers N``: cluster-wide eviction by value vs the server's LRU.

The trace's requests are dealt round-robin to ``N`` writer **processes** (request ``i`` goes
to writer ``i mod N``, so one conversation's turns land on different writers: every reuse
across writers must go through the shared server). All writers of a run talk to one real
``valkey-server`` started for that run. Two modes, same requests, same writers:

- ``value`` — kvstrata: each writer has its own ``RemoteTier`` on one shared namespace, whose
  server-side ledger (``kvstrata.tiers.remote_ledger``) admits and evicts for all of them:
  capacity ``capacity_blocks × payload_bytes``, GDSF score ``L + uses · value_per_byte`` with
  the store's own ``value_per_byte`` (saved prefill seconds per byte). Per request a writer does
  what the tiered store does: ``probe`` the chain (one pipelined round trip), take the prefix
  the tier holds, ``read_ahead`` it and load each block (``prepare_load`` verifies the digest
  and books the hit in the ledger); a load that misses (another writer's admission evicted the
  block since the probe) ends the hit there. Then every block after the hit that the tier does
  not hold is stored head first (``prepare_store`` → ``complete_store``).
- ``lru`` — the server's own eviction: a server with ``maxmemory`` and
  ``maxmemory-policy allkeys-lru``; writers ``EXISTS`` the chain (which does not touch a key's
  LRU clock), ``GET`` the leading run of present blocks (which does, and checks the bytes; a
  block evicted meanwhile ends the hit), then ``SET`` every block after the hit that was absent.
  One key per block holding the same meta + payload bytes the remote tier stores in two keys:
  the charitable layout for LRU (a meta and a payload key could be evicted separately).

Same memory: the LRU server gets the memory the value server's data used when the run ended
(the tier is full from early on): ``maxmemory = lru_baseline + (value_used − value_baseline)
+ allowance``. Each ``baseline`` is that server's ``used_memory`` when empty, with one idle
connection per writer open. The value figure counts the ledger's bookkeeping, so the LRU gets
that room for extra blocks (``lru_budget="used"``, the default). ``allowance`` is room for the
LRU writers' transient client buffers (a pipeline of ``LRU_PIPELINE`` values in and out per
writer): the value server has no limit, so its writers' buffers never show in its figure, and
without the room they would crowd out LRU data. ``lru_budget="blocks"`` instead gives the LRU
room for exactly ``capacity_blocks`` of its own objects (the per-object cost measured on the
empty LRU server first), plus the allowance: the same block count, which is what the two would
hold with real (MiB) blocks, where the ledger's ~0.5 KiB per object is noise. Both favour the
LRU. The first repeat runs ``value`` first, so there is always a measured budget; repeats
alternate the order, and each LRU run uses the latest value run's figure.

Saved prefill seconds: ``recompute_s`` of the hit blocks, priced by the same cost model and
the same ``chain_metas`` objects as the simulated ``bench eviction`` (only ``size`` and
``digest`` differ: payloads are ``payload_bytes`` of deterministic bytes per block; what a
replay costs is round trips, 3–4 per block the remote tier stores, not bytes). Token hit rate
= hit tokens / prompt tokens. Writers pass a barrier every ``sync_every`` requests, so the
interleaving stays close to trace order.
"""

from __future__ import annotations

import multiprocessing
import queue
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from kvstrata.bench.eviction import SimulatedTrace
from kvstrata.bench.remote_writers import (
    LRU_PIPELINE,
    NAMESPACE,
    WriterJob,
    WriterResult,
    lru_value,
    writer_main,
)
from kvstrata.costs import DEFAULT_PREFILL_MODEL, PrefillModel
from kvstrata.errors import InvalidInput
from kvstrata.identity import BlockKey
from kvstrata.runtime.valkey_server import ValkeyServer
from kvstrata.workloads.mooncake import TraceRequest

MODES = ("value", "lru")
REMOTE_CAPACITY_FRACTION = 10_000 / 182_790
"""The simulated bench's smallest default capacity (10,000 blocks) as a share of the
Mooncake conversation trace's distinct blocks: eviction matters as much on a shorter trace."""


def _info(url: str) -> dict[str, int]:
    with redis.Redis.from_url(url, socket_timeout=30.0) as conn:
        memory, stats = conn.info("memory"), conn.info("stats")
        return {
            "used_memory": int(memory["used_memory"]),
            "evicted_keys": int(stats["evicted_keys"]),
            "keys": int(conn.dbsize()),
        }


def _baseline(url: str, clients: int) -> int:
    """``used_memory`` of the empty server with one idle connection per writer open (their
    buffers are not data: neither mode's budget should pay for them)."""
    connections = [redis.Redis.from_url(url, socket_timeout=30.0) for _ in range(clients)]
    try:
        for conn in connections:
            conn.ping()
        return _info(url)["used_memory"]
    finally:
        for conn in connections:
            conn.close()


def _client_allowance(plan: _Plan) -> int:
    """Room for one busy LRU writer's buffers on the server: a pipeline of values in its query
    buffer and one in its output buffer, plus the 16 KiB read buffer and reply chunk of a
    client. The value server has no limit, so its writers' transient buffers never show in
    the measured budget; without this room they would crowd out data on the LRU server."""
    value_bytes = len(_lru_sample(plan, next(iter(plan.trace.meta))))
    return 2 * LRU_PIPELINE * value_bytes + 32 * 1024


def _ledger_usage(url: str) -> dict[str, int]:
    """What the shared ledger accounts for at the end of a run (all writers together)."""
    with redis.Redis.from_url(url, socket_timeout=30.0) as conn:
        used, count = conn.hmget(f"{{{NAMESPACE}}}:L:u", "used", "n")
    return {"ledger_used_bytes": int(used or 0), "ledger_objects": int(count or 0)}


def _lru_object_bytes(url: str, sample: bytes, count: int = 2000) -> float:
    """Memory one LRU object of this size costs on an empty server (measured, then flushed)."""
    with redis.Redis.from_url(url, socket_timeout=30.0) as conn:
        before = int(conn.info("memory")["used_memory"])
        pipe = conn.pipeline(transaction=False)
        for i in range(count):
            pipe.set(f"{NAMESPACE}:probe:{i:08d}", sample)
        pipe.execute()
        used = int(conn.info("memory")["used_memory"]) - before
        conn.flushall()
    return used / count


@dataclass
class _Plan:
    trace: SimulatedTrace
    shares: list[list[int]]
    capacity_blocks: int
    payload_bytes: int
    sync_every: int
    lru_budget: str


def _run_mode(plan: _Plan, mode: str, budget: int | None) -> dict[str, Any]:
    """One run of ``mode`` on a fresh server; for ``lru``, ``budget`` bytes of data memory."""
    server = ValkeyServer().start()
    clients = len(plan.shares)
    try:
        baseline = _baseline(server.url, clients)
        extra: dict[str, Any] = {}
        if mode == "lru":
            assert budget is not None
            if plan.lru_budget == "blocks":
                sample = _lru_sample(plan, next(iter(plan.trace.meta)))
                budget = int(plan.capacity_blocks * _lru_object_bytes(server.url, sample))
                baseline = _baseline(server.url, clients)
            allowance = clients * _client_allowance(plan)
            maxmemory = baseline + budget + allowance
            with redis.Redis.from_url(server.url) as conn:
                conn.config_set("maxmemory", maxmemory)
                conn.config_set("maxmemory-policy", "allkeys-lru")
            extra = {
                "maxmemory": maxmemory,
                "maxmemory_policy": "allkeys-lru",
                "budget_bytes": budget,
                "client_allowance_bytes": allowance,
            }
        writers = _run_writers(plan, mode, server.url)
        info = _info(server.url)
        if mode == "value":
            extra = _ledger_usage(server.url)
    finally:
        server.stop()
    data_bytes = info["used_memory"] - baseline
    totals = WriterResult()
    for entry in writers:
        for name in WriterResult.COUNTS:
            setattr(totals, name, getattr(totals, name) + entry[name])
        totals.saved_prefill_s += entry["saved_prefill_s"]
    if mode == "lru":  # the server evicts; no writer's admissions do
        evictions = info["evicted_keys"]
        for entry in writers:
            entry.pop("evicted")
    else:
        evictions = sum(entry["evicted"] for entry in writers)
    return {
        "mode": mode,
        "saved_prefill_s": round(totals.saved_prefill_s, 3),
        "saved_tokens": totals.saved_tokens,
        "prompt_tokens": totals.prompt_tokens,
        "token_hit_rate": round(totals.token_hit_rate, 4),
        "requests": totals.requests,
        "stored": totals.stored,
        "load_misses": totals.load_misses,
        "refused": totals.refused,
        "evictions": evictions,
        "used_memory": info["used_memory"],
        "data_memory": data_bytes,
        "keys_at_end": info["keys"],
        "seconds": round(max(e["seconds"] for e in writers), 2),
        "per_writer": writers,
        **extra,
    }


def _lru_sample(plan: _Plan, key: BlockKey) -> bytes:
    return lru_value(plan.trace.meta[key], plan.payload_bytes)


def _run_writers(plan: _Plan, mode: str, url: str) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("spawn")
    count = len(plan.shares)
    barrier = context.Barrier(count)
    results = context.Queue()
    longest = max(len(share) for share in plan.shares)
    rounds = -(-longest // plan.sync_every)
    processes = []
    for writer, share in enumerate(plan.shares):
        chains = tuple(plan.trace.keys[i] for i in share)
        job = WriterJob(
            mode=mode,
            url=url,
            requests=tuple(plan.trace.requests[i] for i in share),
            chains=chains,
            metas={key: plan.trace.meta[key] for chain in chains for key in chain},
            capacity_bytes=plan.capacity_blocks * plan.payload_bytes,
            payload_bytes=plan.payload_bytes,
            sync_every=plan.sync_every,
            rounds=rounds,
        )
        process = context.Process(
            target=writer_main,
            args=(job, writer, barrier, results),
            name=f"kvstrata-writer-{writer}",
        )
        process.start()
        processes.append(process)
    out: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    try:
        while len(out) + len(errors) < count:
            try:
                writer, reply = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead and not errors:
                    barrier.abort()
                    errors.append(f"{dead[0].name} exited with {dead[0].exitcode}")
                    break
                continue
            if isinstance(reply, str):
                errors.append(f"writer {writer}: {reply}")
            else:
                out[writer] = {"writer": writer, **reply}
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return [out[w] for w in range(count)]


def _median_spread(runs: Sequence[dict[str, Any]], field: str) -> tuple[float, list[float]]:
    values = [float(run[field]) for run in runs]
    return statistics.median(values), [min(values), max(values)]


def _summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in ("saved_prefill_s", "token_hit_rate", "saved_tokens", "evictions", "data_memory"):
        median, spread = _median_spread(runs, field)
        out[field] = median
        out[f"{field}_spread"] = spread
    out["requests"] = runs[0]["requests"]
    writers = len(runs[0]["per_writer"])
    fields = ["saved_prefill_s", "token_hit_rate", "stored", "refused"]
    if runs[0]["mode"] == "value":  # the server's LRU evictions belong to no writer
        fields.append("evicted")
    out["per_writer"] = [
        {
            "writer": w,
            "requests": runs[0]["per_writer"][w]["requests"],
            **{
                field: statistics.median(run["per_writer"][w][field] for run in runs)
                for field in fields
            },
        }
        for w in range(writers)
    ]
    return out


def run_remote_multi_writer(
    requests: Sequence[TraceRequest],
    capacity_blocks: int,
    *,
    writers: int = 3,
    repeats: int = 3,
    payload_bytes: int = 4096,
    cost_model: PrefillModel = DEFAULT_PREFILL_MODEL,
    sync_every: int = 32,
    lru_budget: str = "used",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Both modes ``repeats`` times (alternating order); the ``remote_multi_writer`` report."""
    if writers < 1 or repeats < 1 or sync_every < 1:
        raise InvalidInput("writers, repeats and sync_every must be >= 1")
    if capacity_blocks < 1 or payload_bytes < 16:
        raise InvalidInput("the remote mode needs capacity >= 1 block and payloads >= 16 bytes")
    if lru_budget not in ("used", "blocks"):
        raise InvalidInput(f"lru_budget must be 'used' or 'blocks', got {lru_budget!r}")
    trace = SimulatedTrace.build(requests, cost_model)
    shares = [list(range(w, len(requests), writers)) for w in range(writers)]
    plan = _Plan(trace, shares, capacity_blocks, payload_bytes, sync_every, lru_budget)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    order: list[str] = []
    budget: int | None = None
    for repeat in range(repeats):
        for mode in MODES if repeat % 2 == 0 else tuple(reversed(MODES)):
            run = _run_mode(plan, mode, budget)
            if mode == "value":
                budget = run["data_memory"]
            runs[mode].append(run)
            order.append(mode)
            if progress is not None:
                progress(
                    f"repeat {repeat} {mode}: {run['saved_prefill_s']} s saved, "
                    f"hit rate {run['token_hit_rate']}, {run['evictions']} evictions, "
                    f"{run['seconds']} s"
                )
    value, lru = _summary(runs["value"]), _summary(runs["lru"])
    paired = [
        v["saved_prefill_s"] / b["saved_prefill_s"]
        for v, b in zip(runs["value"], runs["lru"], strict=True)
        if b["saved_prefill_s"]
    ]
    return {
        "writers": writers,
        "assignment": "round-robin",
        "capacity_blocks": capacity_blocks,
        "payload_bytes": payload_bytes,
        "lru_budget": lru_budget,
        "requests": len(requests),
        "repeats": repeats,
        "order": order,
        "cost_model": cost_model.name,
        "value": value,
        "lru": lru,
        "ratio": value["saved_prefill_s"] / lru["saved_prefill_s"]
        if lru["saved_prefill_s"]
        else None,
        "ratio_spread": [min(paired), max(paired)] if paired else None,
        "token_ratio": value["token_hit_rate"] / lru["token_hit_rate"]
        if lru["token_hit_rate"]
        else None,
        "runs": runs,
    }
