"""The index's numpy lookup table (``index.table``): it mirrors the entries dict exactly, and
long-request lookups through it answer like the dict probe and like the hash → worker-set peer."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstrata.bench.index_peers import SetIndex
from kvstrata.events.schema import BlockRemoved, BlockStored, KVEventBatch
from kvstrata.identity.keys import FingerprintDigest
from kvstrata.index import GlobalIndex, Medium
from kvstrata.index import core as index_core
from kvstrata.index.table import SYNC_BACKLOG, ProbeTable

FP = FingerprintDigest(bytes(range(32)))
BS = 4
MEDIA = ("GPU", "CPU", "DISK")


def _values(table: ProbeTable, keys: list[int]) -> list[int]:
    words = table.values(np.array(keys, dtype=np.uint64))
    assert words.shape == (len(keys), table.words)
    return [int.from_bytes(row.astype("<u8").tobytes(), "little") for row in words]


@pytest.mark.parametrize("words", [1, 2, 3])
def test_table_mirrors_a_dict_through_inserts_updates_deletes_and_growth(words: int) -> None:
    rng = random.Random(7)
    entries: dict[int, int] = {}
    table = ProbeTable()
    table.set_words(words)
    seen: list[int] = []
    for step in range(40):
        for _ in range(rng.randrange(1, 3000)):  # up to 60k keys: several growths
            op = rng.random()
            if op < 0.6 or not seen:
                key = rng.getrandbits(64)
                seen.append(key)
            else:
                key = rng.choice(seen)
            if op < 0.85:
                entries[key] = rng.getrandbits(64 * words) | 1
            else:
                entries.pop(key, None)
            table.mark(key)
        table.sync(entries)
        probe = rng.sample(seen, min(len(seen), 2000)) + [rng.getrandbits(64) for _ in range(50)]
        assert _values(table, probe) == [entries.get(k, 0) for k in probe], step
    assert table.usable and not table.pending


def test_the_hash_zero_is_held_beside_the_table_through_every_path() -> None:
    """0 marks an empty row, so the key 0 lives out of band: inserted, updated and removed by
    an incremental sync and by a rebuild, it reads like any other key."""
    table = ProbeTable()
    entries = {0: 5, 7: 9}
    table.sync(entries)  # first sync: a rebuild
    assert _values(table, [0, 7, 8]) == [5, 9, 0]
    for value in (6, None, 3):
        if value is None:
            del entries[0]
        else:
            entries[0] = value
        table.mark(0)
        table.sync(entries)  # incremental
        assert _values(table, [7, 0, 0]) == [9, entries.get(0, 0), entries.get(0, 0)]
    many = {k: k + 1 for k in range(1, 100_000)} | {0: 11}
    table.mark_many(many)
    table.sync(many)  # past the load limit: a rebuild with the key 0 in the dict
    assert _values(table, [0, 1, 99_999, 100_000]) == [11, 2, 100_000, 0]


def test_table_prefix_values_stop_at_the_first_block_nobody_holds() -> None:
    entries = {k: k + 1 for k in range(5000)}
    table = ProbeTable()
    table.sync(entries)
    for miss_at in (0, 1, 1023, 1024, 1025, 4000, None):
        keys = list(range(4500))
        if miss_at is not None:
            keys[miss_at] = 10**9
        got = table.prefix_values(np.array(keys, dtype=np.uint64))[:, 0].tolist()
        assert got == [k + 1 for k in keys[: 4500 if miss_at is None else miss_at]]


def test_keys_wider_than_64_bits_switch_the_table_off() -> None:
    table = ProbeTable()
    entries = {2**70: 1}
    table.mark(2**70)
    table.sync(entries)
    assert not table.usable


def _tokens(rng: np.random.Generator, blocks: int) -> list[int]:
    return [int(t) for t in rng.integers(0, 50_000, size=blocks * BS)]


def _stored(engine: list[int], tokens: list[int], medium: str, parent: int | None) -> BlockStored:
    return BlockStored(
        block_hashes=engine,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def _as_pairs(index: GlobalIndex, hashes: list[int]) -> dict[str, tuple[int, list[int]]]:
    return {w: (m.blocks, list(m.tier_blocks)) for w, m in index.match(hashes).items()}


@pytest.mark.parametrize(("seed", "most"), [(0, 16), (1, 16), (2, 16), (3, 40), (4, 40)])
def test_long_lookups_equal_the_set_peer_on_random_fleets(seed: int, most: int) -> None:
    """Random documents stored by random workers at random depths (chunked, in several
    media, some with a hole): every lookup, long (table) or short (dict), equals the peer's,
    on fleets of up to 16 workers (one word a value) and of up to 40 (several)."""
    rng = np.random.default_rng(seed)
    workers = [f"w{i}" for i in range(int(rng.integers(2 if most == 16 else 17, most + 1)))]
    index = GlobalIndex(FP, BS, clock=lambda: 0.0)
    peer = SetIndex(index, width=64)
    docs = [_tokens(rng, int(rng.integers(600, 1500))) for _ in range(4)]
    next_engine = iter(range(1, 10**9))
    for _ in range(40):
        worker = workers[int(rng.integers(len(workers)))]
        doc = docs[int(rng.integers(len(docs)))]
        depth = int(rng.integers(1, len(doc) // BS + 1))
        medium = MEDIA[int(rng.integers(len(MEDIA)))]
        skip = int(rng.integers(0, depth)) if rng.random() < 0.3 else -1  # a hole: chain cut
        events, parent, start = [], None, 0
        while start < depth:
            n = min(int(rng.integers(1, 300)), depth - start)
            engine = [next(next_engine) for _ in range(n)]
            if start <= skip < start + n:  # the rest of this chain is orphaned
                break
            events.append(_stored(engine, doc[start * BS : (start + n) * BS], medium, parent))
            parent, start = engine[-1], start + n
        batch = KVEventBatch(ts=0.0, events=events)
        index.apply_batch(worker, batch)
        peer.apply_batch(worker, batch)
    for doc in docs:
        hashes = peer.hashes(doc)
        for length in (len(hashes), 700, 511, 40):
            assert _as_pairs(index, hashes[:length]) == peer.match(hashes[:length]), length
        assert index.match(index.request_hashes(None, doc)) == index.match(hashes)


def test_table_lookups_follow_removals_epochs_and_wide_fleets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The table path and the dict path agree after removals, a restart and past 16 slots
    (where the table's values take a second word)."""
    rng = np.random.default_rng(5)
    index = GlobalIndex(FP, BS, clock=lambda: 0.0)
    doc = _tokens(rng, 1200)
    hashes = index.request_hashes(None, doc).tolist()
    engine = list(range(1, 1201))

    def both() -> dict[str, tuple[int, list[int]]]:
        via_table = _as_pairs(index, hashes)
        monkeypatch.setattr(index_core, "_TABLE_MIN_BLOCKS", 10**9)
        via_dict = _as_pairs(index, hashes)
        monkeypatch.setattr(index_core, "_TABLE_MIN_BLOCKS", 512)
        assert via_table == via_dict
        return via_table

    for w, medium in (("a", "GPU"), ("b", "CPU"), ("c", "GPU")):
        index.apply_batch(w, KVEventBatch(ts=0.0, events=[_stored(engine, doc, medium, None)]))
    assert both()["a"] == (1200, [1200, 0, 0, 0])
    index.apply_batch("a", KVEventBatch(ts=0.0, events=[BlockRemoved(engine[700:], "GPU")]))
    index.apply_batch("b", KVEventBatch(ts=0.0, events=[BlockRemoved([engine[5]], "CPU")]))
    assert both()["a"][0] == 700 and both()["b"][0] == 5
    index.apply_batch("c", KVEventBatch(ts=0.0, epoch=1, events=[]))
    index.apply_batch("c", KVEventBatch(ts=0.0, epoch=2, events=[]))  # a restart drops c
    assert both()["c"][0] == 0
    for i in range(20):  # past 16 slots the table's values take two words
        index.store_hashes(f"x{i}", hashes[: 900 - 10 * i], Medium.DISK)
    assert index.sync_table() and index._table.words == 2
    assert both()["x19"] == (710, [0, 0, 710, 0])
    assert both()["a"] == (700, [700, 0, 0, 0]) and both()["x0"] == (900, [0, 0, 900, 0])
    index.apply_batch("a", KVEventBatch(ts=0.0, events=[BlockRemoved(engine[:1], "GPU")]))
    assert both()["a"][0] == 0 and both()["x18"][0] == 720


def test_the_pending_backlog_stays_bounded_without_long_lookups() -> None:
    """The simulator stores by router hash and may only look short requests up: the event
    path syncs, so pending hashes never exceed the backlog plus one call's worth."""
    index = GlobalIndex(FP, BS, clock=lambda: 0.0)
    rng = random.Random(3)
    for _ in range(50):
        hashes = [rng.getrandbits(64) for _ in range(300)]
        index.store_hashes(f"w{rng.randrange(4)}", hashes, Medium.DEVICE)
        index.match(hashes[:10])  # short: the dict answers, nothing syncs here
        assert index._table.pending < SYNC_BACKLOG + 300
    assert index.sync_table() and not index._table.pending


def test_the_event_path_takes_every_rebuild_so_no_lookup_pays_one() -> None:
    """Growth past the load limit and a fleet past 16 slots rebuild the table: both happen
    while events are applied, never in the sync a lookup runs."""
    index = GlobalIndex(FP, BS, clock=lambda: 0.0)
    rng = random.Random(11)
    for step in range(400):  # ~60k hashes: several growths; 20 workers: a second word
        hashes = [rng.getrandbits(64) for _ in range(150)]
        index.store_hashes(f"w{step % 20}", hashes, Medium.DEVICE)
        table = index._table
        assert not table.would_rebuild and table.words == (1 if step < 16 else 2), step
        assert table.pending < SYNC_BACKLOG


def test_remote_removals_and_deletions_keep_the_backlog_bounded() -> None:
    """A remote removal (the shared tier) and a deletion change many entries at once: they
    sync on the event path too, or the next long lookup paid for all of them (25-40 ms for
    60k hashes, under the fleet lock)."""
    index = GlobalIndex(FP, BS, clock=lambda: 0.0)
    rng = random.Random(5)
    hashes = [rng.getrandbits(64) for _ in range(3000)]
    index.store_hashes("w0", hashes, Medium.DEVICE)
    index.store_hashes("w1", hashes, Medium.REMOTE, engine_hashes=hashes)
    assert index.sync_table() and not index._table.pending
    index.remove_hashes("w1", hashes, Medium.REMOTE)
    assert index._table.pending < SYNC_BACKLOG
    doc = _tokens(np.random.default_rng(5), 3000)
    index.apply_batch(
        "w2", KVEventBatch(ts=0.0, events=[_stored(list(range(1, 3001)), doc, "GPU", None)])
    )
    assert index.sync_table() and not index._table.pending
    index.delete("default", everything=True)
    assert index._table.pending < SYNC_BACKLOG


def test_a_dump_syncs_the_table_once_at_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A resync's dump is applied under the fleet lock in one go: syncing every 256 hashes
    on the way was half its time, for a table nobody can look up until the dump is in."""
    index = GlobalIndex(FP, BS, clock=lambda: 0.0)
    rng = np.random.default_rng(8)
    docs = [_tokens(rng, 500) for _ in range(8)]
    events = [
        _stored(list(range(1 + 1000 * d, 501 + 1000 * d)), doc, "GPU", None)
        for d, doc in enumerate(docs)
    ]
    index.add_worker("w")
    assert index.sync_table()  # the first (empty) build, before the dump
    syncs: list[int] = []
    real_sync = index._table.sync

    def counted(entries: dict[int, int]) -> None:
        syncs.append(index._table.pending)
        real_sync(entries)

    monkeypatch.setattr(index._table, "sync", counted)
    index.replace_worker("w", None, events)
    assert len(syncs) == 1 and syncs[0] == 4000 and not index._table.pending
    peer = SetIndex(index, width=64)
    peer.apply_batch("w", KVEventBatch(ts=0.0, events=events))
    for doc in docs:
        assert _as_pairs(index, peer.hashes(doc)) == peer.match(peer.hashes(doc))
