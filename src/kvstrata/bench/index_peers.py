"""The peers of ``bench index``: the ways a router's index is commonly written in Python.

Both place ``BlockStored`` events exactly as :class:`~kvstrata.index.core.GlobalIndex` does
(same router hashes, each chunk continued from its parent's router hash, resolved through the
worker's own engine-hash map) so all three hold the same blocks; only the lookup layout differs.
``match`` returns, for every worker seen, ``(depth, [device, host, disk, remote])``: the longest
prefix of the request it holds and how many of those blocks sit in each tier (a block held in
several tiers counts in the fastest), as ``GlobalIndex.match`` reports it.
:func:`time_lookups` times kvstrata and the peers on the same requests, alternating.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvstrata.events.schema import BlockHash, BlockStored, KVEventBatch
from kvstrata.identity.keys import chain_keys
from kvstrata.index.core import GlobalIndex, parse_medium

MEDIA = 4
"""Device, host, disk, remote: the tiers a match is split by."""

_FASTEST = [0] + [(b & -b).bit_length() - 1 for b in range(1, 1 << MEDIA)]
"""Medium bits → the fastest medium among them."""


class NaiveIndex:
    """Per worker, engine hash → router hash and router hash → medium bits; walked per worker."""

    def __init__(self, index: GlobalIndex) -> None:
        self._hasher = index.hasher(None)
        self.engine: dict[str, dict[BlockHash, int]] = {}
        self.held: dict[str, dict[int, int]] = {}

    def apply_batch(self, worker_id: str, batch: KVEventBatch) -> None:
        engine = self.engine.setdefault(worker_id, {})
        held = self.held.setdefault(worker_id, {})
        for event in batch.events:
            if not isinstance(event, BlockStored):
                continue
            medium = parse_medium(event.medium)
            if medium is None:
                continue
            parent = None
            if event.parent_block_hash is not None:
                parent = engine.get(event.parent_block_hash)
                if parent is None:
                    continue
            routers = self._hasher.extend(parent, event.token_ids).tolist()
            bit = 1 << medium
            for engine_hash, router in zip(event.block_hashes, routers, strict=True):
                engine[engine_hash] = router
                held[router] = held.get(router, 0) | bit

    def match(self, hashes: list[int]) -> dict[str, tuple[int, list[int]]]:
        result: dict[str, tuple[int, list[int]]] = {}
        for worker_id, held in self.held.items():
            tiers = [0, 0, 0, 0]
            depth = 0
            for router in hashes:
                bits = held.get(router)
                if not bits:
                    break
                tiers[_FASTEST[bits]] += 1
                depth += 1
            result[worker_id] = (depth, tiers)
        return result


class SetIndex:
    """One dict, router hash → worker set, walked once per request (Dynamo/llm-d style).

    The worker set is one Python int: bit ``medium * W + slot`` is set when worker ``slot``
    holds the block in ``medium`` (``W`` = ``width``, the most workers it can hold). The walk
    keeps the bitmask of workers still matching and stops when it is empty; consecutive blocks
    with the same (masked) set form one run (a block whose raw set equals the previous one's
    costs one lookup and one comparison), and only the runs are expanded per worker at the end,
    so the per-block cost does not grow with the worker count.
    """

    def __init__(self, index: GlobalIndex, width: int = 64) -> None:
        self._hasher = index.hasher(None)
        self.width = width
        self.full = (1 << width) - 1
        self.engine: dict[str, dict[BlockHash, int]] = {}
        self.held: dict[int, int] = {}
        self.slots: dict[str, int] = {}

    def _slot(self, worker_id: str) -> int:
        slot = self.slots.get(worker_id)
        if slot is None:
            slot = len(self.slots)
            if slot >= self.width:
                raise ValueError(f"the set peer holds at most {self.width} workers")
            self.slots[worker_id] = slot
        return slot

    def apply_batch(self, worker_id: str, batch: KVEventBatch) -> None:
        slot = self._slot(worker_id)
        engine = self.engine.setdefault(worker_id, {})
        held = self.held
        for event in batch.events:
            if not isinstance(event, BlockStored):
                continue
            medium = parse_medium(event.medium)
            if medium is None:
                continue
            parent = None
            if event.parent_block_hash is not None:
                parent = engine.get(event.parent_block_hash)
                if parent is None:
                    continue
            routers = self._hasher.extend(parent, event.token_ids).tolist()
            bit = 1 << (medium * self.width + slot)
            for engine_hash, router in zip(event.block_hashes, routers, strict=True):
                engine[engine_hash] = router
                held[router] = held.get(router, 0) | bit

    def hashes(self, tokens: list[int]) -> list[int]:
        """The request's router hashes as the peer walks them (a plain list)."""
        return list(self._hasher.hashes(tokens).tolist())

    def match(self, hashes: list[int]) -> dict[str, tuple[int, list[int]]]:
        w, full, held = self.width, self.full, self.held
        alive = (1 << len(self.slots)) - 1
        spread = alive | alive << w | alive << 2 * w | alive << 3 * w
        runs: list[tuple[int, int]] = []
        key, run, last = 0, 0, -1
        get = held.get
        for router in hashes:
            raw = get(router, 0)
            if raw == last:  # the same holders as the block before: the run goes on
                run += 1
                continue
            last = raw
            bits = raw & spread
            anyone = (bits | bits >> w | bits >> 2 * w | bits >> 3 * w) & full
            if anyone != alive:
                alive = anyone
                if not alive:
                    break
                spread = alive | alive << w | alive << 2 * w | alive << 3 * w
            if bits == key:
                run += 1
            else:
                if run:
                    runs.append((key, run))
                key, run = bits, 1
        if run:
            runs.append((key, run))
        return self._expand(runs)

    def _expand(self, runs: list[tuple[int, int]]) -> dict[str, tuple[int, list[int]]]:
        w, full = self.width, self.full
        depth = [0] * len(self.slots)
        tiers = [[0, 0, 0, 0] for _ in self.slots]
        for bits, count in runs:
            faster = 0
            for medium in range(MEDIA):
                fastest = (bits >> medium * w) & full & ~faster
                faster |= fastest
                while fastest:
                    low = fastest & -fastest
                    slot = low.bit_length() - 1
                    depth[slot] += count
                    tiers[slot][medium] += count
                    fastest ^= low
        return {worker: (depth[slot], tiers[slot]) for worker, slot in self.slots.items()}


def time_lookups(
    repeats: int,
    block_size: int,
    index: GlobalIndex,
    requests: Sequence[npt.NDArray[np.uint32]],
    naive: NaiveIndex | None,
    peer_set: SetIndex | None,
    between: Callable[[], None] | None = None,
) -> tuple[dict[str, list[float]], list[int], bool | None]:
    """Per repeat, kvstrata and each peer in turn (the order rotates), on the same request.

    Each lookup gets the request as a freshly built Python list (untimed), as a router gets it
    from decoding the request body just before it hashes: a list reused across lookups would
    be read cold after the other indexes' walks, a cost no router pays.

    ``between`` (untimed) runs before each repeat: the live variant applies a step of events
    to every index there, so each lookup also pays what its index defers to lookups.

    Returns the samples (seconds) by figure, the last lookup's per-worker depths and whether
    every peer's answer equalled kvstrata's on every lookup (None: no peer)."""
    samples: dict[str, list[float]] = {
        k: [] for k in ("hash", "lookup", "both", "naive", "set", "set_both", "blake3")
    }
    matched: list[int] = []
    agrees: bool | None = None if naive is None and peer_set is None else True
    root = index.root("default")

    def ours(tokens: list[int]) -> dict[str, tuple[int, list[int]]]:
        start = time.perf_counter()
        hashes = index.request_hashes(None, tokens)
        hashed = time.perf_counter()
        found = index.match(hashes)
        done = time.perf_counter()
        samples["hash"].append(hashed - start)
        samples["lookup"].append(done - hashed)
        samples["both"].append(done - start)
        matched[:] = sorted((m.blocks for m in found.values()), reverse=True)
        return {w: (m.blocks, list(m.tier_blocks)) for w, m in found.items()}

    def plain(tokens: list[int]) -> dict[str, tuple[int, list[int]]]:
        assert naive is not None
        hashes = index.request_hashes(None, tokens).tolist()  # untimed: the figure is the walk
        start = time.perf_counter()
        theirs = naive.match(hashes)
        samples["naive"].append(time.perf_counter() - start)
        return theirs

    def by_set(tokens: list[int]) -> dict[str, tuple[int, list[int]]]:
        assert peer_set is not None
        start = time.perf_counter()
        hashes = peer_set.hashes(tokens)
        hashed = time.perf_counter()
        theirs = peer_set.match(hashes)
        done = time.perf_counter()
        samples["set"].append(done - hashed)
        samples["set_both"].append(done - start)
        return theirs

    runs = [ours, *([plain] if naive else []), *([by_set] if peer_set else [])]
    for i in range(repeats):
        if between is not None:
            between()
        request = requests[i % len(requests)]
        answers = {}
        for k in range(len(runs)):
            run = runs[(i + k) % len(runs)]
            answers[run] = run(request.tolist())
        if agrees:
            agrees = all(answers[run] == answers[ours] for run in runs)
        if i < min(repeats, 10):
            start = time.perf_counter()
            chain_keys(root, request.tolist(), block_size)
            samples["blake3"].append(time.perf_counter() - start)
    return samples, matched, agrees


__all__ = ["MEDIA", "NaiveIndex", "SetIndex", "time_lookups"]
