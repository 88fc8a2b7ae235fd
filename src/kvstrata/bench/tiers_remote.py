"""Remote tier throughput against plain redis-py on the same server, same bytes, same run.

``kvstrata bench tiers`` runs this after host and disk. Per object size, ``objects`` objects
of random bytes (GB/s = 1e9 bytes/s; every figure is the *median* of ``repeat`` rounds, each
round touching every object once; ``*_spread`` = [min, max] over the rounds):

- ``get``: what a consumer does on a remote hit — ``RemoteTier.prepare_load`` (one ``MGET``
  of meta and payload, the meta checksum, key, exact length and payload digest verified) +
  ``complete_load``. ``raw_get``: a plain ``GET`` of the very same payload keys through
  redis-py with the hiredis parser (what "plain" costs). ``ratio`` = get / raw_get; its spread
  comes from the rounds paired in order (goal ≥ 0.8 at 1–4 MiB with the digest on).
- ``put``: ``prepare_store`` (ledger reservation) + copy into the slot + ``complete_store``
  (digest check, ledger commit, ``MULTI`` of meta + payload). ``raw_set``: a plain ``SET`` of
  the same bytes under other keys. ``put_ratio`` = put / raw_set. Before every put round both
  sides' keys are deleted (not timed), so each round writes fresh keys.
- ``read_ahead``: a planned promotion of the whole batch — ``read_ahead(keys)`` (one pipelined
  ``MGET`` per shard) then ``prepare_load``/``complete_load`` of each object (verified, no
  further round trip) — against ``raw_sequential_get`` (one plain ``GET`` per object, one
  after another: what a tier without pipelining pays) and ``raw_pipelined_get`` (one plain
  pipeline of ``GET``: the ceiling). ``read_ahead_ratio`` = read_ahead / raw_sequential_get.

Runs of the tier and of its baseline alternate, first one then the other, so both see the same
machine state. The first round's bytes are checked against the source, so a fast-but-wrong
path cannot pass. The bench starts its own ``ValkeyServer`` unless a URL is given; it then
works in a namespace of its own and deletes every key it wrote.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import redis
import redis.utils

from kvstrata.bench.remote_servers import bench_namespace, delete_namespace, remote_target
from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_client import RemoteConfig

Rounds = dict[str, list[float]]
"""Per metric: the seconds of each round (a round moves ``objects × size`` bytes)."""


def _alternating(
    runs: dict[str, Callable[[], None]], repeat: int, before: Callable[[], None]
) -> Rounds:
    """Seconds of every round of every run; the order of the runs flips each round."""
    rounds: Rounds = {name: [] for name in runs}
    names = list(runs)
    for index in range(repeat):
        for name in names if index % 2 == 0 else reversed(names):
            before()
            start = time.perf_counter()
            runs[name]()
            rounds[name].append(time.perf_counter() - start)
    return rounds


def _rate(total: int, seconds: float) -> float:
    return total / max(seconds, 1e-12) / 1e9


def _summary(rounds: Rounds, total: int, pairs: Sequence[tuple[str, str, str]]) -> dict[str, Any]:
    """``<metric>_gbps`` (median round), ``<metric>_gbps_spread`` and each ratio with the
    spread of its rounds paired in order."""
    out: dict[str, Any] = {}
    for metric, seconds in rounds.items():
        rates = [_rate(total, s) for s in seconds]
        out[f"{metric}_gbps"] = _rate(total, statistics.median(seconds))
        out[f"{metric}_gbps_spread"] = [min(rates), max(rates)]
    for name, a, b in pairs:
        paired = [sb / sa for sa, sb in zip(rounds[a], rounds[b], strict=True)]
        out[name] = out[f"{a}_gbps"] / out[f"{b}_gbps"]
        out[f"{name}_spread"] = [min(paired), max(paired)]
    return out


class _RemoteRun:
    """One object size: a tier, a raw client, the objects' keys; the timed closures."""

    def __init__(
        self, url: str, rows: np.ndarray, metas: list[KVObjectMeta], namespace: str
    ) -> None:
        count, size = rows.shape
        self.rows, self.metas, self.size = rows, metas, size
        self.tier = RemoteTier(
            RemoteConfig(
                url=url, namespace=namespace, timeout_s=30.0, read_ahead_bytes=count * size * 2
            ),
            count * size * 2,
        ).start()  # hits booked in the background, as a worker's store factory does
        # The peer reads with the same client buffer size as the tier (1 MiB; redis-py's
        # default is 64 KiB, which costs both ~20% on MiB-sized values here).
        self.raw = redis.Redis.from_url(
            url, socket_timeout=30.0, socket_read_size=self.tier.config.socket_read_bytes
        )
        self.keys: list[BlockKey] = [meta.key for meta in metas]
        self.data_keys = [self.tier.data_key(key) for key in self.keys]
        self.raw_keys = [f"{namespace}:raw:{i}" for i in range(count)]

    def clear(self) -> None:
        for key in self.keys:
            self.tier.remove(key)
        self.raw.delete(*self.raw_keys)

    def put(self) -> None:
        for i, meta in enumerate(self.metas):
            slot = self.tier.prepare_store(meta)
            if slot is None:
                raise AssertionError("remote put refused")
            slot.buffer[:] = self.rows[i].data
            if not self.tier.complete_store(slot, True):
                raise AssertionError("remote put failed verification")

    def raw_set(self) -> None:
        for i, name in enumerate(self.raw_keys):
            self.raw.set(name, self.rows[i].data)

    def get(self) -> None:
        for key in self.keys:
            lease = self.tier.prepare_load(key)
            if lease is None:
                raise AssertionError("remote get missed or failed verification")
            self.tier.complete_load(lease)

    def raw_get(self) -> None:
        for name in self.data_keys:
            if self.raw.get(name) is None:
                raise AssertionError("raw GET missed")

    def read_ahead(self) -> None:
        self.tier.read_ahead(self.keys)
        self.get()
        self.tier.discard_read_ahead()

    def raw_pipelined_get(self) -> None:
        pipe = self.raw.pipeline(transaction=False)
        for name in self.data_keys:
            pipe.get(name)
        if any(reply is None for reply in pipe.execute()):
            raise AssertionError("raw pipelined GET missed")

    def check(self) -> None:
        for i, key in enumerate(self.keys):
            lease = self.tier.prepare_load(key)
            if lease is None or bytes(lease.buffer) != self.rows[i].tobytes():
                raise AssertionError("remote get returned different bytes")
            self.tier.complete_load(lease)
        for i, name in enumerate(self.data_keys):
            if self.raw.get(name) != self.rows[i].tobytes():
                raise AssertionError("raw GET returned different bytes")

    def close(self) -> None:
        try:
            self.clear()
        finally:
            self.tier.close()
            self.raw.close()


def _measure(run: _RemoteRun, repeat: int) -> dict[str, Any]:
    count, size = run.rows.shape
    total = count * size
    writes = _alternating({"put": run.put, "raw_set": run.raw_set}, repeat, run.clear)
    run.clear()
    run.put()
    run.check()
    no_op: Callable[[], None] = lambda: None  # noqa: E731
    reads = _alternating({"get": run.get, "raw_get": run.raw_get}, repeat, no_op)
    batch = _alternating(
        {
            "read_ahead": run.read_ahead,
            "raw_sequential_get": run.raw_get,
            "raw_pipelined_get": run.raw_pipelined_get,
        },
        repeat,
        no_op,
    )
    return {
        "reads": reads,
        "writes": writes,
        "batch": batch,
        "total": total,
    }


def remote_fields(measured: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Figures of one size or of all sizes together (rounds summed across sizes)."""
    total = sum(m["total"] for m in measured)

    def summed(group: str) -> Rounds:
        names = measured[0][group]
        return {
            n: [sum(x) for x in zip(*(m[group][n] for m in measured), strict=True)] for n in names
        }

    reads = _summary(summed("reads"), total, [("ratio", "get", "raw_get")])
    writes = _summary(summed("writes"), total, [("put_ratio", "put", "raw_set")])
    batch = _summary(
        summed("batch"),
        total,
        [
            ("read_ahead_ratio", "read_ahead", "raw_sequential_get"),
            ("read_ahead_vs_raw_pipeline", "read_ahead", "raw_pipelined_get"),
        ],
    )
    return {**reads, **writes, "read_ahead": batch}


class RemoteBench:
    """The remote section of ``bench tiers``: one server (``url``, or one started here) for
    every size; ``measure`` one size at a time, then ``section`` for all of them."""

    def __init__(self, url: str | None, repeat: int) -> None:
        self.repeat = repeat
        self._given = url is not None
        self._stack = contextlib.ExitStack()
        self._target = url
        self._url: str | None = None
        self._namespace = bench_namespace("tiers")
        self._measured: list[dict[str, Any]] = []

    def __enter__(self) -> RemoteBench:
        self._url = self._stack.enter_context(remote_target(self._target))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def measure(self, rows: np.ndarray, metas: list[KVObjectMeta]) -> dict[str, Any]:
        """This size's figures (see the module docstring)."""
        assert self._url is not None, "use RemoteBench as a context manager"
        namespace = f"{self._namespace}-{len(self._measured)}"
        run = _RemoteRun(self._url, rows, metas, namespace)
        try:
            measured = _measure(run, self.repeat)
        finally:
            run.close()
            delete_namespace(self._url, namespace)
        self._measured.append(measured)
        return remote_fields([measured])

    def section(self, objects: int) -> dict[str, Any]:
        return {
            **remote_fields(self._measured),
            "verify": True,
            "hiredis": bool(redis.utils.HIREDIS_AVAILABLE),
            "server": "given" if self._given else "started by the bench",
            "batch_objects": objects,
            "statistic": "median of rounds; *_spread = [min, max] over rounds",
        }
