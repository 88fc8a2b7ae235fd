"""Tier throughput against the raw medium, same bytes, same run: does a tier cost more than it must?

What is measured, per object size (GB/s = 1e9 bytes/s, best of ``repeat`` rounds, each round
touching every one of ``objects`` objects once):

- ``host.get``: what a consumer does on a hit — ``prepare_load`` (which re-verifies the digest,
  the default) + copy the slot's bytes into a
  destination torch tensor (as the engine copies into its pool) + ``complete_load``.
  ``host.memcpy``: the same destination copy from a plain source tensor. ``host.ratio`` =
  get / memcpy shows the tier's per-object overhead (goal ≥ 0.8 at 1–4 MiB).
  ``host.put``: ``prepare_store`` + copy from a source tensor into the slot + ``complete_store``,
  which includes the xxh3-128 digest check (no goal; reported).
- ``disk.read``: ``prepare_load`` + ``complete_load`` — open, ``preadv`` into a pooled buffer and
  verify the payload digest. Its peer, ``disk.raw_readinto``: plain ``os.open`` + ``preadv``
  into one preallocated buffer (aligned like the tier's, reused, no digest) + ``close`` of the
  very same files, the cheapest way to read them; ``disk.ratio`` = read / raw_readinto, the
  headline (goal ≥ 0.8 with verification on), with ``ratio_median`` and ``ratio_spread``
  [min, max] of the rounds' paired ratios (a round of each, alternating) beside it.
  ``disk.raw_read``: ``os.read``, which allocates a fresh ``bytes`` per file (page faults on
  fresh memory can dominate), kept for comparison with older figures as
  ``disk.ratio_vs_os_read``. ``disk.get`` adds the copy into a destination tensor;
  ``disk.write`` is one durable (fsync'd) store round.
- Cold cache, always measured: before every round the files are fsync'd and their pages dropped
  (``posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)``), then ``cold_read`` (the tier's verified
  read) or ``cold_raw_readinto`` (its peer) runs; ``repeat`` rounds of each, alternating, the
  *median* round kept. ``disk.cold_ratio`` = cold_read / cold_raw_readinto (goal ≥ 0.7), with
  ``cold_ratio_spread`` [min, max] over the rounds' paired ratios. On a file system that keeps
  pages in memory only (tmpfs) the drop is a no-op and the cold figures equal warm ones.

Verification cost: every tier verifies the payload digest on every read by default
(``verify_reads``). ``host.get_gbps_verified`` / ``host.get_gbps_unverified`` (and the same for
``disk``) are the ``get`` path with the check on and off — the same tier, the same objects,
rounds alternating between the two, the *median* round of each — and ``verify_cost_ratio`` =
unverified / verified rate (1.0: free; 2.0: verified reads take twice as long). ``get_gbps``
itself is the default, verified path.

The page cache is warm for the other disk figures (the files were just written), so they
measure the read path and verification, not the device; ``cold=True`` drops the pages before
their rounds too, for both the tier and the raw reads.
Rounds of the tier and of its baseline alternate, so both see the same machine state. Torch
copies run on ``threads`` intra-op threads (default 1): on a small shared machine a parallel
copy stalls whenever one of its threads is preempted, which measures the neighbours, not the
tier; pass ``threads=0`` for torch's default. Every
round's destination is checked against the source once, so a fast-but-wrong path cannot pass.

``remote`` (on by default): the remote tier on a Valkey server against plain redis-py ``GET``/
``SET`` of the same bytes; see ``kvstrata.bench.tiers_remote`` (medians, not best rounds).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstrata.bench.tiers_remote import RemoteBench
from kvstrata.errors import InvalidInput
from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, Representation, payload_digest
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.disk_format import aligned_buffer
from kvstrata.tiers.host import HostTier

MIB = 1 << 20


def _gbps(total_bytes: int, seconds: float) -> float:
    return total_bytes / max(seconds, 1e-12) / 1e9


Moved = dict[str, tuple[int, float]]
"""Per metric: (bytes moved, best seconds) — rates and ratios are derived from these."""


def _time(fn: Callable[[], None], before: Callable[[], None] | None = None) -> float:
    if before is not None:
        before()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _metas(source: torch.Tensor, size: int) -> list[KVObjectMeta]:
    rows = source.numpy()
    return [
        KVObjectMeta(
            key=BlockKey(hashlib.blake2b(f"bench-{size}-{i}".encode(), digest_size=32).digest()),
            parent=None,
            tenant="bench",
            representation=Representation("uint8", "raw", 1, (size,)),
            size=size,
            digest=payload_digest(rows[i]),
            created_at=time.time(),
        )
        for i in range(rows.shape[0])
    ]


def _alternate(
    runs: dict[str, Callable[[], None]], repeat: int, before: Callable[[], None] | None = None
) -> dict[str, list[float]]:
    """Seconds of every round of each run, rounds interleaved so every run sees the same
    conditions (callers keep the best, and the rounds for a median and a spread)."""
    rounds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, fn in runs.items():
            rounds[name].append(_time(fn, before))
    return rounds


def _best(rounds: dict[str, list[float]]) -> dict[str, float]:
    """The fastest round of each run (``_alternate``'s)."""
    return {name: min(times) for name, times in rounds.items()}


def _verify_cost(
    tier: HostTier | DiskTier, get: Callable[[], None], total: int, repeat: int
) -> Moved:
    """Median seconds of ``get`` with read verification on and off, rounds interleaved."""
    rounds: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(repeat):
            for verify in (True, False):
                tier.verify_reads = verify
                rounds[verify].append(_time(get))
    finally:
        tier.verify_reads = True
    return {
        "verified": (total, statistics.median(rounds[True])),
        "unverified": (total, statistics.median(rounds[False])),
    }


def _verify_fields(measured: Sequence[Moved]) -> dict[str, float]:
    rates = _rates(measured, ("unverified", "verified"))
    return {
        "get_gbps_verified": rates["verified_gbps"],
        "get_gbps_unverified": rates["unverified_gbps"],
        "verify_cost_ratio": rates["ratio"],
    }


def _host(
    source: torch.Tensor, dest: torch.Tensor, metas: list[KVObjectMeta], repeat: int
) -> tuple[Moved, Moved, bool]:
    count, size = source.shape
    tier = HostTier(count * size, size)

    def put() -> None:
        for i, meta in enumerate(metas):
            slot = tier.prepare_store(meta)
            assert slot is not None
            tier.tensor(slot).copy_(source[i])
            if not tier.complete_store(slot, True):
                raise AssertionError("host put failed verification")

    def clear() -> None:
        for meta in metas:
            tier.remove(meta.key)

    put_s = float("inf")
    for _ in range(repeat):
        clear()
        put_s = min(put_s, _time(put))

    def get() -> None:
        for i, meta in enumerate(metas):
            lease = tier.prepare_load(meta.key)
            assert lease is not None
            dest[i].copy_(tier.tensor(lease))
            tier.complete_load(lease)

    def memcpy() -> None:
        for i in range(count):
            dest[i].copy_(source[i])

    dest.zero_()
    get()
    if not torch.equal(dest, source):
        raise AssertionError("host get returned different bytes")
    best = _best(_alternate({"get": get, "memcpy": memcpy}, repeat))
    total = count * size
    verify = _verify_cost(tier, get, total, repeat)
    tier.close()
    moved = {"get": (total, best["get"]), "put": (total, put_s), "memcpy": (total, best["memcpy"])}
    return moved, verify, tier.pinned


ColdRounds = dict[str, list[tuple[int, float]]]
"""Rounds per metric: (bytes moved, seconds) of every round, in order (the cold-cache ones
and the warm ``read`` / ``raw_readinto`` ones)."""


def _peers(cold: bool) -> dict[str, str]:
    """What each ratio compares: printed with the table."""
    cache = "pages dropped" if cold else "warm page cache"
    return {
        "host.ratio": "host get / torch copy_ from a plain tensor (memcpy)",
        "disk.ratio": f"verified disk read / os.preadv into a preallocated buffer, {cache}",
        "disk.ratio_vs_os_read": f"verified disk read / os.read allocating fresh bytes, {cache}",
        "disk.cold_ratio": "verified disk read / os.preadv into a preallocated buffer, "
        "pages dropped",
        "verify_cost_ratio": "the same get with read verification off / on",
    }


def _disk(
    source: torch.Tensor,
    dest: torch.Tensor,
    metas: list[KVObjectMeta],
    repeat: int,
    directory: Path,
    cold: bool,
) -> tuple[Moved, Moved, ColdRounds]:
    count, size = source.shape
    rows, dest_rows = source.numpy(), dest.numpy()
    tier = DiskTier(directory, count * size)
    start = time.perf_counter()
    for i, meta in enumerate(metas):
        slot = tier.prepare_store(meta)
        assert slot is not None
        slot.buffer[:] = rows[i].data
        if not tier.complete_store(slot, True):
            raise AssertionError("disk put failed verification")
    write_s = time.perf_counter() - start
    files = [(tier.path_of(meta.key), tier.path_of(meta.key).stat().st_size) for meta in metas]
    file_bytes = sum(length for _, length in files)
    scratch = aligned_buffer(max(length for _, length in files)).data

    def read() -> None:
        for meta in metas:
            lease = tier.prepare_load(meta.key)
            if lease is None:
                raise AssertionError("disk read failed verification")
            tier.complete_load(lease)

    def get() -> None:
        for i, meta in enumerate(metas):
            lease = tier.prepare_load(meta.key)
            assert lease is not None
            dest_rows[i] = np.frombuffer(lease.buffer, dtype=np.uint8)
            tier.complete_load(lease)

    def raw_read() -> None:
        for path, length in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.read(fd, length)
            finally:
                os.close(fd)

    def raw_readinto() -> None:
        for path, length in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.preadv(fd, [scratch[:length]], 0)
            finally:
                os.close(fd)

    def drop_cache() -> None:
        for path, _ in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # DONTNEED drops clean pages only
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    dest.zero_()
    get()
    if not torch.equal(dest, source):
        raise AssertionError("disk get returned different bytes")
    warm = _alternate(
        {"read": read, "raw_read": raw_read, "raw_readinto": raw_readinto, "get": get},
        repeat,
        drop_cache if cold else None,
    )
    best = _best(warm)
    total = count * size
    verify = _verify_cost(tier, get, total, repeat)
    cold_rounds: ColdRounds = {
        "read": [(total, t) for t in warm["read"]],  # the warm rounds, for their median
        "raw_readinto": [(file_bytes, t) for t in warm["raw_readinto"]],
        "cold_read": [],
        "cold_raw_readinto": [],
    }
    for i in range(repeat):
        pair = [("cold_read", read, total), ("cold_raw_readinto", raw_readinto, file_bytes)]
        for name, fn, moved in pair[i % 2 :] + pair[: i % 2]:
            cold_rounds[name].append((moved, _time(fn, drop_cache)))
    tier.close()
    return (
        {
            "read": (total, best["read"]),
            "raw_read": (file_bytes, best["raw_read"]),  # header + meta + payload: all it reads
            "raw_readinto": (file_bytes, best["raw_readinto"]),
            "get": (total, best["get"]),
            "write": (total, write_s),
        },
        verify,
        cold_rounds,
    )


def run_tier_bench(
    sizes_mib: Sequence[float],
    objects: int = 32,
    repeat: int = 5,
    directory: str | os.PathLike[str] | None = None,
    cold: bool = False,
    threads: int = 1,
    remote: bool = True,
    remote_url: str | None = None,
) -> dict[str, Any]:
    """Run host, disk (and remote: on ``remote_url`` or a Valkey server started here)
    measurements for each object size; one JSON-ready dict."""
    if not sizes_mib or any(s <= 0 for s in sizes_mib):
        raise InvalidInput("sizes must be positive MiB values")
    if objects <= 0 or repeat <= 0 or threads < 0:
        raise InvalidInput("objects and repeat must be positive, threads non-negative")
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        if remote:
            with RemoteBench(remote_url, repeat) as bench:
                result = _run(sizes_mib, objects, repeat, directory, cold, bench)
                result["remote"] = bench.section(objects)
        else:
            result = _run(sizes_mib, objects, repeat, directory, cold, None)
    finally:
        torch.set_num_threads(saved_threads)
    result["torch_threads"] = threads or saved_threads
    return result


def _run(
    sizes_mib: Sequence[float],
    objects: int,
    repeat: int,
    directory: str | os.PathLike[str] | None,
    cold: bool,
    remote: RemoteBench | None,
) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="kvstrata-bench-tiers-", dir=directory))
    per_size: list[dict[str, Any]] = []
    host_all: list[Moved] = []
    disk_all: list[Moved] = []
    host_verify: list[Moved] = []
    disk_verify: list[Moved] = []
    disk_cold: list[ColdRounds] = []
    pinned = False
    try:
        for mib in sizes_mib:
            size = max(1, int(mib * MIB))
            generator = torch.Generator().manual_seed(size)
            source = torch.randint(0, 256, (objects, size), dtype=torch.uint8, generator=generator)
            dest = torch.zeros_like(source)
            metas = _metas(source, size)
            host, host_v, pinned = _host(source, dest, metas, repeat)
            disk, disk_v, disk_c = _disk(source, dest, metas, repeat, root / f"size-{size}", cold)
            host_all.append(host)
            disk_all.append(disk)
            disk_cold.append(disk_c)
            host_verify.append(host_v)
            disk_verify.append(disk_v)
            entry: dict[str, Any] = {
                "size_mib": mib,
                "size_bytes": size,
                "host": {**_rates([host], ("get", "memcpy")), **_verify_fields([host_v])},
                "disk": _disk_fields([disk], [disk_v], [disk_c]),
            }
            if remote is not None:
                entry["remote"] = remote.measure(source.numpy(), metas)
            per_size.append(entry)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "host": {
            **_rates(host_all, ("get", "memcpy")),
            **_verify_fields(host_verify),
            "pinned": pinned,
        },
        "disk": {
            **_disk_fields(disk_all, disk_verify, disk_cold),
            "verify": True,
            "cold": cold,
            "dir": str(root.parent),
        },
        "sizes": per_size,
        "peers": _peers(cold),
        "objects": objects,
        "repeat": repeat,
        "unit": "GB/s = 1e9 bytes/s; all sizes together = total bytes / total best time "
        "(cold: median round)",
    }


def _disk_fields(
    measured: Sequence[Moved], verify: Sequence[Moved], cold: Sequence[ColdRounds]
) -> dict[str, Any]:
    """The disk section over these sizes: warm rates and ratios (best rounds; the median and
    spread of the rounds' paired ratios beside them), verification, cold cache (medians)."""
    rounds = len(cold[0]["cold_read"])
    per_round = [  # every round: (bytes, seconds) summed over the sizes, per metric
        {m: (sum(c[m][i][0] for c in cold), sum(c[m][i][1] for c in cold)) for m in cold[0]}
        for i in range(rounds)
    ]

    def paired(a: str, b: str) -> list[float]:
        return [_gbps(*r[a]) / _gbps(*r[b]) for r in per_round]

    medians: Moved = {
        m: (per_round[0][m][0], statistics.median(r[m][1] for r in per_round)) for m in cold[0]
    }
    cold_rates = _rates([medians], ("cold_read", "cold_raw_readinto"))
    warm, ratios = paired("read", "raw_readinto"), paired("cold_read", "cold_raw_readinto")
    return {
        **_rates(measured, ("read", "raw_readinto")),
        "ratio_median": statistics.median(warm),
        "ratio_spread": [min(warm), max(warm)],
        "ratio_vs_os_read": _rates(measured, ("read", "raw_read"))["ratio"],
        **_verify_fields(verify),
        "cold_read_gbps": cold_rates["cold_read_gbps"],
        "cold_raw_readinto_gbps": cold_rates["cold_raw_readinto_gbps"],
        "cold_ratio": cold_rates["ratio"],
        "cold_ratio_spread": [min(ratios), max(ratios)],
    }


def _rates(measured: Sequence[Moved], ratio: tuple[str, str]) -> dict[str, float]:
    """``<metric>_gbps`` for each metric summed over sizes, and ``ratio`` = a / b."""
    out: dict[str, float] = {}
    for metric in measured[0]:
        moved = sum(m[metric][0] for m in measured)
        seconds = sum(m[metric][1] for m in measured)
        out[f"{metric}_gbps"] = _gbps(moved, seconds)
    out["ratio"] = out[f"{ratio[0]}_gbps"] / out[f"{ratio[1]}_gbps"]
    return out
