"""The global index: scripted scenarios, real vLLM events, and a stateful check against a model.

The naive model (:class:`IndexModel`) keeps, per worker, engine hash → (router hash, media) and
computes every router hash from the *whole* token prefix with ``RouterHasher.hashes``; the index
instead continues each event's chain from its parent (``RouterHasher.extend``) and packs every
worker into one integer per block. Agreement after every step of random stores, removals,
clears, restarts, resyncs and worker removals covers both the hashing and the packing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstrata.events.schema import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
)
from kvstrata.identity.keys import FingerprintDigest
from kvstrata.index import ConsistencyMode, GlobalIndex, Medium, PrefixMatch, parse_medium

FP = FingerprintDigest(bytes(range(32)))
BS = 4
NOW = 1000.0


def make_index(block_size: int = BS, **kwargs: object) -> GlobalIndex:
    return GlobalIndex(FP, block_size, clock=lambda: NOW, **kwargs)  # type: ignore[arg-type]


def tokens(seed: int, blocks: int, block_size: int = BS) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(blocks * block_size)]


def ehash(*parts: object) -> int:
    """A content-derived 64-bit engine hash, as vLLM's are."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def engine_hashes(
    toks: list[int], salt: str = "", namespace: str | None = None, block_size: int = BS
) -> list[int]:
    """Chained like an engine's: the namespace and a salt (vLLM's ``cache_salt``) enter them."""
    return [
        ehash(namespace, salt, tuple(toks[: (i + 1) * block_size]))
        for i in range(len(toks) // block_size)
    ]


def stored(
    hashes: list[int],
    toks: list[int],
    parent: int | None = None,
    medium: str | None = "device",
    namespace: str | None = None,
    block_size: int = BS,
) -> BlockStored:
    return BlockStored(
        block_hashes=list[BlockHash](hashes),
        parent_block_hash=parent,
        token_ids=toks,
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
        namespace=namespace,
    )


def removed(hashes: list[int], medium: str | None = "device") -> BlockRemoved:
    return BlockRemoved(block_hashes=list[BlockHash](hashes), medium=medium)


def batch(*events: KVEvent, epoch: int | None = None, ts: float = NOW) -> KVEventBatch:
    return KVEventBatch(ts=ts, events=list(events), epoch=epoch)


def store_chain(
    index: GlobalIndex,
    worker: str,
    toks: list[int],
    *,
    medium: str = "device",
    namespace: str | None = None,
    split: int | None = None,
    salt: str = "",
) -> list[int]:
    """Store ``toks`` as one event, or as two (parent then children) when ``split`` is given."""
    hashes = engine_hashes(toks, salt, namespace)
    if split is None:
        index.apply_batch(worker, batch(stored(hashes, toks, None, medium, namespace)))
    else:
        cut = split * BS
        first = stored(hashes[:split], toks[:cut], None, medium, namespace)
        rest = stored(hashes[split:], toks[cut:], hashes[split - 1], medium, namespace)
        index.apply_batch(worker, batch(first))
        index.apply_batch(worker, batch(rest))
    return hashes


def depth(
    index: GlobalIndex, toks: list[int], tenant: str | None = None
) -> dict[str, tuple[int, tuple[int, int, int, int]]]:
    result = index.match(index.request_hashes(tenant, toks))
    return {w: (m.blocks, m.tier_blocks) for w, m in result.items()}


# ------------------------------------------------------------------------------ chains
def test_chain_in_one_event_and_in_several_events_match_the_same() -> None:
    index = make_index()
    doc = tokens(1, 6)
    store_chain(index, "w0", doc)
    store_chain(index, "w1", doc, split=2)
    store_chain(index, "w2", doc[: 3 * BS], split=1)
    expected_full = (6, (6, 0, 0, 0))
    assert depth(index, doc) == {"w0": expected_full, "w1": expected_full, "w2": (3, (3, 0, 0, 0))}
    # A request that diverges in block 4 matches 4 blocks where 6 are held; a trailing partial
    # block has no hash and cannot match.
    fork = doc[: 4 * BS] + tokens(99, 2)
    assert depth(index, fork)["w0"] == (4, (4, 0, 0, 0))
    assert depth(index, doc[: 2 * BS + 3])["w1"] == (2, (2, 0, 0, 0))
    assert depth(index, tokens(2, 6)) == {w: (0, (0, 0, 0, 0)) for w in ("w0", "w1", "w2")}
    assert index.stats.blocks_stored == 15
    assert len(index) == 6  # distinct blocks: the three workers share them
    assert index.blocks_held("w2") == (3, 0, 0, 0)


def test_each_block_counts_at_its_fastest_medium() -> None:
    index = make_index()
    doc = tokens(3, 8)
    hashes = engine_hashes(doc)
    # blocks 0-3 on device (0-1 also on disk), 4-5 host, 6 disk, 7 remote (vLLM's names too)
    index.apply_batch(
        "w",
        batch(
            stored(hashes[:4], doc[:16], None, "GPU"),
            stored(hashes[:2], doc[:8], None, "disk"),
            stored(hashes[4:6], doc[16:24], hashes[3], "CPU"),
            stored(hashes[6:7], doc[24:28], hashes[5], "local_disk"),
            stored(hashes[7:8], doc[28:32], hashes[6], "redis"),
        ),
    )
    assert depth(index, doc)["w"] == (8, (4, 2, 1, 1))
    assert index.blocks_held("w") == (4, 2, 3, 0)  # the remote block is the shared tier's
    assert index.shared_blocks() == 1
    # Losing block 5 from host ends the prefix there.
    index.apply_batch("w", batch(removed([hashes[5]], "cpu")))
    assert depth(index, doc)["w"] == (5, (4, 1, 0, 0))


def test_removal_from_one_medium_keeps_the_other() -> None:
    index = make_index()
    doc = tokens(4, 3)
    hashes = store_chain(index, "w", doc, medium="device")
    store_chain(index, "w", doc, medium="host")
    assert depth(index, doc)["w"] == (3, (3, 0, 0, 0))
    index.apply_batch("w", batch(removed(hashes, "device")))
    assert depth(index, doc)["w"] == (3, (0, 3, 0, 0))
    assert index.blocks_held("w") == (0, 3, 0, 0)
    index.apply_batch("w", batch(removed(hashes[1:], "host")))
    assert depth(index, doc)["w"] == (1, (0, 1, 0, 0))
    index.apply_batch("w", batch(removed(hashes[1:], "host")))
    assert index.stats.unknown_removals == 2
    assert index.stats.blocks_removed == 5


def test_orphan_blocks_are_counted_and_skipped() -> None:
    index = make_index()
    doc = tokens(5, 3)
    hashes = engine_hashes(doc)
    index.apply_batch("w", batch(stored(hashes[1:], doc[BS:], parent=hashes[0])))
    assert index.stats.orphan_blocks == 2
    assert len(index) == 0 and index.blocks_held("w") == (0, 0, 0, 0)
    # The parent held by *another* worker does not make the block placeable on this one.
    store_chain(index, "other", doc[:BS])
    index.apply_batch("w", batch(stored(hashes[1:], doc[BS:], parent=hashes[0])))
    assert index.stats.orphan_blocks == 4
    assert depth(index, doc)["w"] == (0, (0, 0, 0, 0))


def test_bad_events_are_counted_and_skipped() -> None:
    index = make_index()
    doc = tokens(6, 2)
    hashes = engine_hashes(doc)
    index.apply_batch(
        "w",
        batch(
            stored(hashes, doc, block_size=BS * 2),  # another block size
            stored(hashes, doc[:-1]),  # a token short
            stored(hashes[:1], doc),  # one hash for two blocks' tokens
        ),
    )
    assert index.stats.bad_events == 3
    assert index.stats.events == 3
    assert len(index) == 0


def test_unknown_medium_is_counted_for_stores_and_removals() -> None:
    """A store in an unknown medium is skipped, so a removal in one leaves the copies the
    index knows (an offload tier of an unlisted name must not unroute the worker's device
    copies on each of its evictions)."""
    index = make_index()
    doc = tokens(7, 2)
    hashes = engine_hashes(doc)
    index.apply_batch("w", batch(stored(hashes, doc, medium="tape")))
    assert index.stats.unknown_mediums == 1 and len(index) == 0
    store_chain(index, "w", doc)
    index.apply_batch("w", batch(removed(hashes, "tape")))
    assert index.stats.unknown_mediums == 2
    assert depth(index, doc)["w"] == (2, (2, 0, 0, 0))


def test_medium_names() -> None:
    assert parse_medium(None) is Medium.DEVICE
    assert parse_medium("GPU") is Medium.DEVICE
    assert parse_medium("CPU") is Medium.HOST
    assert parse_medium("Disk") is Medium.DISK
    assert parse_medium("valkey") is Medium.REMOTE
    assert parse_medium("floppy") is None


def test_duplicate_stores_are_counted_once_placed() -> None:
    index = make_index()
    doc = tokens(8, 3)
    store_chain(index, "w", doc)
    store_chain(index, "w", doc)
    assert index.stats.duplicate_stores == 3
    assert index.stats.blocks_stored == 3
    assert index.blocks_held("w") == (3, 0, 0, 0)


def test_an_engine_hash_reused_for_other_content_moves_the_placement() -> None:
    index = make_index()
    first, second = tokens(9, 1), tokens(10, 1)
    index.apply_batch("w", batch(stored([42], first)))
    index.apply_batch("w", batch(stored([42], second)))
    assert depth(index, first)["w"][0] == 0
    assert depth(index, second)["w"][0] == 1
    assert index.blocks_held("w") == (1, 0, 0, 0) and len(index) == 1


def test_same_tokens_under_two_engine_hashes_survive_removal_of_one() -> None:
    """vLLM's ``cache_salt`` changes engine hashes, not tokens: two engine hashes, one block."""
    index = make_index()
    doc = tokens(11, 2)
    plain = store_chain(index, "w", doc)
    salted = store_chain(index, "w", doc, salt="tenant-a")
    index.apply_batch("w", batch(removed(plain)))
    assert depth(index, doc)["w"] == (2, (2, 0, 0, 0))
    index.apply_batch("w", batch(removed(salted)))
    assert depth(index, doc)["w"] == (0, (0, 0, 0, 0))
    assert len(index) == 0


def test_a_cleared_alias_does_not_outlive_the_clear() -> None:
    index = make_index()
    doc = tokens(22, 2)
    plain = store_chain(index, "w", doc)
    store_chain(index, "w", doc, salt="tenant-a")
    index.apply_batch("w", batch(AllBlocksCleared()))
    store_chain(index, "w", doc)
    index.apply_batch("w", batch(removed(plain)))
    assert depth(index, doc)["w"] == (0, (0, 0, 0, 0))
    assert len(index) == 0


def test_a_gap_in_one_workers_chain_ends_its_prefix() -> None:
    """Block 2 is gone from w but still on v: w's prefix stops at 2, v's goes on."""
    index = make_index()
    doc = tokens(23, 5)
    hashes = store_chain(index, "w", doc)
    store_chain(index, "v", doc[: 3 * BS], medium="host")
    index.apply_batch("w", batch(removed(hashes[2:3])))
    assert depth(index, doc) == {"w": (2, (2, 0, 0, 0)), "v": (3, (0, 3, 0, 0))}


def test_all_blocks_cleared_empties_one_workers_device_only() -> None:
    """vLLM sends it for a GPU prefix-cache reset (kvstrata's workers never do): what its
    connector offloaded to host or disk is still there (it was dropped too: review finding,
    stop 35)."""
    index = make_index()
    doc, offloaded = tokens(12, 2), tokens(13, 2)
    store_chain(index, "w0", doc)
    store_chain(index, "w0", offloaded, medium="host")
    store_chain(index, "w1", doc, medium="host")
    index.apply_batch("w0", batch(AllBlocksCleared()))
    assert depth(index, doc) == {"w0": (0, (0, 0, 0, 0)), "w1": (2, (0, 2, 0, 0))}
    assert depth(index, offloaded)["w0"] == (2, (0, 2, 0, 0))
    assert index.stats.clears == 1 and index.stats.unknown_removals == 0
    assert index.blocks_held("w0") == (0, 2, 0, 0)


# ------------------------------------------------------------------------------ consistency
def test_a_new_epoch_drops_the_stale_entries() -> None:
    index = make_index()
    doc, other = tokens(13, 3), tokens(14, 2)
    hashes = engine_hashes(doc)
    index.apply_batch("w", batch(stored(hashes, doc), epoch=1))
    index.apply_batch("v", batch(stored(hashes, doc), epoch=1))
    index.apply_batch("w", batch(stored(engine_hashes(other), other), epoch=2))
    assert index.stats.epoch_changes == 1
    assert index.stats.stale_entries_dropped == 3
    assert index.epoch("w") == 2
    assert depth(index, doc) == {"w": (0, (0, 0, 0, 0)), "v": (3, (3, 0, 0, 0))}
    assert depth(index, other)["w"] == (2, (2, 0, 0, 0))
    # The same epoch again changes nothing; a first epoch on a worker without one drops nothing.
    index.apply_batch("w", batch(epoch=2))
    index.apply_batch("u", batch(stored(hashes, doc)))
    index.apply_batch("u", batch(epoch=5))
    assert index.stats.epoch_changes == 1
    assert depth(index, doc)["u"] == (3, (3, 0, 0, 0))


def test_an_inconsistent_worker_matches_nothing_until_resynced() -> None:
    index = make_index()
    doc = tokens(15, 4)
    hashes = engine_hashes(doc)
    index.apply_batch("w", batch(stored(hashes, doc), epoch=1))
    index.apply_batch("v", batch(stored(hashes[:2], doc[:8]), epoch=1))
    index.mark_inconsistent("w")
    index.mark_inconsistent("w")
    assert index.stats.inconsistent_marks == 1
    assert not index.is_consistent("w") and index.is_consistent("v")
    assert depth(index, doc) == {"w": (0, (0, 0, 0, 0)), "v": (2, (2, 0, 0, 0))}
    # Events still arriving do not make it trusted again.
    index.apply_batch("w", batch(stored(hashes, doc, medium="host"), epoch=1))
    assert depth(index, doc)["w"][0] == 0
    # The dump replaces everything: only what it lists is held afterwards.
    index.replace_worker("w", 1, [stored(hashes[:3], doc[:12], medium="disk")], ts=NOW - 0.5)
    assert index.is_consistent("w")
    assert index.stats.resyncs == 1
    assert index.stats.stale_entries_dropped == 4
    assert depth(index, doc)["w"] == (3, (0, 0, 3, 0))
    assert index.blocks_held("w") == (0, 0, 3, 0)
    assert index.stats.lag_quantile(1.0) == pytest.approx(0.5)


def test_remove_worker_frees_its_slot_and_a_newcomer_starts_empty() -> None:
    index = make_index()
    doc = tokens(16, 3)
    for w in ("a", "b", "c"):
        store_chain(index, w, doc)
    slot_b = index._workers["b"].slot
    assert index.remove_worker("b") == 3
    assert index.remove_worker("b") == 0
    assert "b" not in index.workers
    index.add_worker("d")
    assert index._workers["d"].slot == slot_b  # reused
    assert depth(index, doc) == {
        "a": (3, (3, 0, 0, 0)),
        "c": (3, (3, 0, 0, 0)),
        "d": (0, (0, 0, 0, 0)),
    }
    for w in ("a", "c"):
        index.remove_worker(w)
    assert len(index) == 0
    assert index.stats.unknown_removals == 0
    index.remove_hashes("ghost", [1, 2], Medium.DEVICE)
    assert index.stats.unknown_removals == 2


def test_tenants_never_match_each_others_blocks() -> None:
    index = make_index()
    doc = tokens(17, 3)
    store_chain(index, "w", doc, namespace="a")
    store_chain(index, "w", doc[: 2 * BS], namespace="a", split=1)
    assert depth(index, doc, tenant="a")["w"] == (3, (3, 0, 0, 0))
    assert depth(index, doc, tenant="b")["w"] == (0, (0, 0, 0, 0))
    assert depth(index, doc, tenant=None)["w"] == (0, (0, 0, 0, 0))
    # Namespace None is the default tenant, by either name.
    store_chain(index, "v", doc)
    assert depth(index, doc, tenant="default")["v"] == (3, (3, 0, 0, 0))
    assert depth(index, doc, tenant="a")["v"] == (0, (0, 0, 0, 0))
    # Another deployment secret gives tenant "a" other hashes.
    other = make_index(tenant_secret=b"elsewhere")
    assert list(other.request_hashes("a", doc)) != list(index.request_hashes("a", doc))
    assert list(other.request_hashes(None, doc)) != list(index.request_hashes(None, doc))


def test_more_than_sixteen_workers_match_like_sixteen() -> None:
    docs = [tokens(100 + d, 6) for d in range(4)]
    small, large = make_index(), make_index()
    for i in range(4):
        for d, doc in enumerate(docs):
            cut = (i + d) % 7
            if cut:
                store_chain(small, f"w{i}", doc[: cut * BS], medium=("device", "host")[d % 2])
                store_chain(large, f"w{i}", doc[: cut * BS], medium=("device", "host")[d % 2])
    for i in range(4, 20):
        store_chain(large, f"w{i}", docs[i % 4][: (i % 5 + 1) * BS], medium="disk")
    large.mark_inconsistent("w19")
    assert large._next_slot > 16
    for d, doc in enumerate(docs):
        got_small, got_large = depth(small, doc), depth(large, doc)
        assert {w: got_large[w] for w in got_small} == got_small
        for i in range(4, 20):
            held = 0 if i == 19 or i % 4 != d else i % 5 + 1
            assert got_large[f"w{i}"] == (held, (0, 0, held, 0))


# ------------------------------------------------------------------------------ shared tier
def test_a_remote_block_from_one_worker_counts_for_every_worker() -> None:
    """Worker a writes blocks 0-1 to device and 0-3 to the shared remote tier: b and c (which
    never saw the prefix) match 4 remote blocks; a matches 2 device + 2 remote."""
    index = make_index()
    doc = tokens(40, 4)
    hashes = engine_hashes(doc)
    index.add_worker("b")
    index.add_worker("c")
    index.apply_batch(
        "a", batch(stored(hashes[:2], doc[:8]), stored(hashes, doc, medium="remote"), epoch=1)
    )
    assert depth(index, doc) == {
        "a": (4, (2, 0, 0, 2)),
        "b": (4, (0, 0, 0, 4)),
        "c": (4, (0, 0, 0, 4)),
    }
    assert index.blocks_held("a") == (2, 0, 0, 0) and index.shared_blocks() == 4
    # b's own host copy of block 0 is faster for b; the rest stays remote.
    index.apply_batch("b", batch(stored(hashes[:1], doc[:4], medium="host")))
    assert depth(index, doc)["b"] == (4, (0, 1, 0, 3))
    # A child b stores on device under a parent only the shared tier holds is placeable.
    more = doc + tokens(41, 1)
    index.apply_batch("b", batch(stored(engine_hashes(more)[4:], more[16:], hashes[3])))
    assert index.stats.orphan_blocks == 0
    assert depth(index, more)["b"] == (5, (1, 1, 0, 3))
    assert depth(index, more)["c"] == (4, (0, 0, 0, 4))


def test_any_workers_remote_removal_clears_the_shared_block() -> None:
    index = make_index()
    doc = tokens(42, 3)
    hashes = engine_hashes(doc)
    index.apply_batch("a", batch(stored(hashes, doc, medium="remote")))
    index.add_worker("b")
    # b's store evicted block 2 from the shared tier (a wrote it): gone for everyone.
    index.apply_batch("b", batch(removed(hashes[2:], "remote")))
    assert depth(index, doc) == {"a": (2, (0, 0, 0, 2)), "b": (2, (0, 0, 0, 2))}
    index.apply_batch("b", batch(removed(hashes[2:], "remote")))  # twice: unknown
    assert index.stats.unknown_removals == 1
    index.apply_batch("a", batch(removed(hashes[:2], "valkey")))
    assert depth(index, doc) == {"a": (0, (0, 0, 0, 0)), "b": (0, (0, 0, 0, 0))}
    assert len(index) == 0 and index.shared_blocks() == 0


def test_shared_blocks_outlive_the_announcing_workers_restart_resync_and_removal() -> None:
    index = make_index()
    doc = tokens(43, 3)
    hashes = engine_hashes(doc)
    index.apply_batch(
        "a", batch(stored(hashes, doc), stored(hashes, doc, medium="remote"), epoch=1)
    )
    index.add_worker("b", epoch=7)
    remote_only = (3, (0, 0, 0, 3))
    index.apply_batch("a", batch(epoch=2))  # a restarted: its device blocks are stale
    assert depth(index, doc) == {"a": remote_only, "b": remote_only}
    index.apply_batch("a", batch(AllBlocksCleared(), epoch=2))
    index.mark_inconsistent("a")
    assert depth(index, doc) == {"a": (0, (0, 0, 0, 0)), "b": remote_only}
    index.replace_worker("a", 3, [])
    assert depth(index, doc)["a"] == remote_only
    index.remove_worker("a")
    assert depth(index, doc) == {"b": remote_only}
    # A duplicate announcement (another worker's dump lists what it probed) changes nothing.
    index.apply_batch("b", batch(stored(hashes, doc, medium="remote")))
    assert index.stats.duplicate_stores == 3 and index.shared_blocks() == 3


def test_a_worker_without_the_shared_tier_does_not_count_its_blocks() -> None:
    index = make_index()
    doc = tokens(44, 2)
    hashes = engine_hashes(doc)
    index.apply_batch("a", batch(stored(hashes, doc, medium="remote")))
    index.add_worker("b")
    index.set_shared_access("b", False)
    assert depth(index, doc) == {"a": (2, (0, 0, 0, 2)), "b": (0, (0, 0, 0, 0))}
    index.set_shared_access("b", True)
    assert depth(index, doc)["b"] == (2, (0, 0, 0, 2))


def test_shared_blocks_reach_workers_beyond_the_first_word() -> None:
    """20 workers (two 64-bit words of slots): the shared slot lends its blocks to all."""
    index = make_index()
    doc = tokens(45, 3)
    for i in range(20):
        index.add_worker(f"w{i}")
    index.apply_batch("w3", batch(stored(engine_hashes(doc), doc, medium="remote")))
    store_chain(index, "w18", doc[:BS], medium="host")
    got = depth(index, doc)
    assert got["w18"] == (3, (0, 1, 0, 2))
    assert all(got[f"w{i}"] == (3, (0, 0, 0, 3)) for i in range(20) if i != 18)


def test_match_of_an_empty_request_and_of_a_numpy_array() -> None:
    index = make_index()
    doc = tokens(18, 2)
    store_chain(index, "w", doc)
    assert index.match([])["w"] == PrefixMatch("w", 0, (0, 0, 0, 0))
    hashes = index.request_hashes(None, doc)
    assert index.match(hashes) == index.match([int(h) for h in hashes])


def test_direct_api_keys_by_router_hash() -> None:
    index = make_index()
    hashes = [int(h) for h in index.request_hashes(None, tokens(19, 3))]
    index.store_hashes("sim", hashes, Medium.HOST)
    assert index.match(hashes)["sim"].tier_blocks == (0, 3, 0, 0)
    index.remove_hashes("sim", hashes[2:], Medium.HOST)
    assert index.match(hashes)["sim"].blocks == 2


def test_lag_is_sampled_per_batch() -> None:
    index = make_index()
    assert index.stats.lag_quantile(0.5) is None
    for lag in (0.1, 0.2, 0.3):
        index.apply_batch("w", batch(ts=NOW - lag))
    index.apply_batch("w", batch(ts=NOW + 5))  # clock skew never gives a negative lag
    assert index.stats.batches == 4
    assert index.stats.lag_quantile(1.0) == pytest.approx(0.3)
    assert index.stats.lag_quantile(0.0) == 0.0


# ------------------------------------------------------------------------------ approximate
def test_approximate_mode_predicts_from_routes_until_the_ttl() -> None:
    index = make_index(mode=ConsistencyMode.APPROXIMATE, approx_ttl_s=10.0)
    doc = tokens(20, 4)
    hashes = index.request_hashes(None, doc)
    index.record_route("w0", list(hashes), now=100.0)
    index.record_route("w1", hashes[:2], now=105.0)
    got = index.match(hashes, now=106.0)
    assert got["w0"] == PrefixMatch("w0", 4, (4, 0, 0, 0), predicted=True)
    assert got["w1"] == PrefixMatch("w1", 2, (2, 0, 0, 0), predicted=True)
    later = index.match(hashes, now=111.0)  # w0's prediction expired, w1's has not
    assert (later["w0"].blocks, later["w1"].blocks) == (0, 2)
    assert index.match(hashes, now=116.0)["w1"].blocks == 0
    assert index.expire_predictions(now=116.0) == 6
    assert index.stats.predictions_expired == 6
    assert index.stats.routes_recorded == 2


def test_approximate_mode_forgets_a_removed_worker() -> None:
    index = make_index(mode=ConsistencyMode.APPROXIMATE, approx_ttl_s=60.0)
    doc = tokens(21, 3)
    hashes = list(index.request_hashes(None, doc))
    index.record_route("w0", hashes, now=0.0)
    index.record_route("w1", hashes, now=0.0)
    index.remove_worker("w0")
    index.add_worker("w2")  # takes w0's slot: must not inherit its predictions
    got = index.match(hashes, now=1.0)
    assert set(got) == {"w1", "w2"}
    assert (got["w1"].blocks, got["w2"].blocks) == (3, 0)
    # The default clock is used when no time is given.
    assert index.match(hashes)["w1"].blocks == 0  # NOW = 1000 is past the TTL


# ------------------------------------------------------------------------------ real vLLM
FIXTURES = Path(__file__).parent / "fixtures" / "vllm_events"


def fixture_batch(name: str) -> KVEventBatch:
    data, frames, i = (FIXTURES / name).read_bytes(), [], 0
    while i < len(data):
        n = int.from_bytes(data[i : i + 4], "big")
        frames.append(data[i + 4 : i + 4 + n])
        i += 4 + n
    decoded = decode_batch(frames[2])
    assert decoded.skipped == ()
    return decoded.batch


@pytest.mark.parametrize("kind", ["int", "bytes"])
def test_real_vllm_events_place_the_request_that_produced_them(kind: str) -> None:
    index = make_index(block_size=32)  # the capture ran vLLM with block_size=32
    plain = fixture_batch(f"vllm032_{kind}_00.bin")
    (event,) = plain.events
    assert isinstance(event, BlockStored) and event.namespace is None
    index.apply_batch("vllm-0", plain)
    assert index.stats.bad_events == index.stats.orphan_blocks == 0
    request = list(event.token_ids)
    assert depth(index, request)["vllm-0"] == (2, (2, 0, 0, 0))
    # A request that shares only the first block; another tenant shares nothing.
    assert depth(index, request[:32] + [7] * 40)["vllm-0"] == (1, (1, 0, 0, 0))
    assert depth(index, request, tenant="tenant-a")["vllm-0"][0] == 0
    # The salted request (same tokens, other engine hashes) and then the prefix-cache reset.
    index.apply_batch("vllm-0", fixture_batch(f"vllm032_{kind}_01.bin"))
    index.apply_batch("vllm-0", batch(BlockRemoved(block_hashes=event.block_hashes, medium="GPU")))
    assert depth(index, request)["vllm-0"] == (2, (2, 0, 0, 0))
    index.apply_batch("vllm-0", fixture_batch(f"vllm032_{kind}_02.bin"))
    assert depth(index, request)["vllm-0"] == (0, (0, 0, 0, 0))
    assert index.stats.clears == 1 and len(index) == 0


# ------------------------------------------------------------------------------ stateful model
WORKERS = ("w0", "w1", "w2")
MEDIA = ("device", "host", "disk", "remote", "GPU", "CPU")
_STEMS = [tokens(500 + s, 3) for s in range(2)]
_TAILS = [tokens(600 + t, 2) for t in range(2)]
# (namespace, salt, tokens): shared stems, two tails, a salted twin and another tenant.
DOCS = [
    (ns, salt, stem + tail)
    for ns, salt in ((None, ""), (None, "salt"), ("a", ""))
    for stem, tail in ((_STEMS[0], _TAILS[0]), (_STEMS[0], _TAILS[1]), (_STEMS[1], _TAILS[0]))
]
DOC_BLOCKS = 5


class IndexModel:
    """Plain dicts: worker → engine hash → (router hash, set of media); prefix walk per worker."""

    def __init__(self, index: GlobalIndex) -> None:
        self.index = index  # only for its hashers (the request side of the contract)
        self.held: dict[str, dict[int, tuple[int, set[int]]]] = {}
        self.shared: dict[int, int] = {}  # the shared (remote) tier: engine → router hash
        self.blind: set[str] = set()  # workers that do not reach the shared tier
        self.consistent: dict[str, bool] = {}
        self.orphans = 0
        self.duplicates = 0

    def router_hash(self, ns: str | None, toks: list[int]) -> int:
        return int(self.index.request_hashes(ns, toks)[-1])

    def touch(self, worker: str) -> None:
        self.held.setdefault(worker, {})
        self.consistent.setdefault(worker, True)

    def store(
        self, worker: str, doc: int, start: int, stop: int, parent: int | None, medium: int
    ) -> None:
        ns, salt, toks = DOCS[doc]
        held = self.held[worker]
        if parent is not None and parent not in held and parent not in self.shared:
            self.orphans += stop - start
            return
        hashes = engine_hashes(toks, salt, ns)
        for i in range(start, stop):
            router = self.router_hash(ns, toks[: (i + 1) * BS])
            if medium == Medium.REMOTE:
                if self.shared.get(hashes[i]) == router:
                    self.duplicates += 1
                self.shared[hashes[i]] = router
                continue
            current = held.get(hashes[i])
            if current is not None and current[0] == router:
                if medium in current[1]:
                    self.duplicates += 1
                current[1].add(medium)
            else:
                held[hashes[i]] = (router, {medium})

    def remove(self, worker: str, hashes: list[int], medium: int) -> None:
        if medium == Medium.REMOTE:  # any worker's removal: the shared object is gone
            for h in hashes:
                self.shared.pop(h, None)
            return
        held = self.held.get(worker, {})
        for h in hashes:
            if h in held:
                held[h][1].discard(medium)
                if not held[h][1]:
                    del held[h]

    def match(
        self, tenant: str | None, toks: list[int]
    ) -> dict[str, tuple[int, tuple[int, int, int, int]]]:
        request = [int(h) for h in self.index.request_hashes(tenant, toks)]
        result = {}
        for worker, held in self.held.items():
            media: dict[int, set[int]] = {}
            for router, where in held.values():
                media.setdefault(router, set()).update(where)
            if worker not in self.blind:
                for router in self.shared.values():
                    media.setdefault(router, set()).add(Medium.REMOTE)
            tiers = [0, 0, 0, 0]
            if self.consistent[worker]:
                for router in request:
                    if not media.get(router):
                        break
                    tiers[min(media[router])] += 1
            result[worker] = (sum(tiers), (tiers[0], tiers[1], tiers[2], tiers[3]))
        return result


class IndexMachine(RuleBasedStateMachine):
    PADDING = 0  # idle workers registered first (17 pushes slots past one 64-bit word)

    def __init__(self) -> None:
        super().__init__()
        self.index = make_index()
        self.model = IndexModel(self.index)
        self.epochs = dict.fromkeys(WORKERS, 0)
        for i in range(self.PADDING):
            self.index.add_worker(f"pad{i}")
            self.model.touch(f"pad{i}")

    def _event(self, worker: str, doc: int, start: int, length: int, medium: str) -> BlockStored:
        ns, salt, toks = DOCS[doc]
        stop = min(DOC_BLOCKS, start + length)
        hashes = engine_hashes(toks, salt, ns)
        parent = hashes[start - 1] if start else None
        self.model.touch(worker)
        medium_id = parse_medium(medium)
        assert medium_id is not None
        self.model.store(worker, doc, start, stop, parent, medium_id)
        return stored(hashes[start:stop], toks[start * BS : stop * BS], parent, medium, ns)

    @rule(
        worker=st.sampled_from(WORKERS),
        doc=st.integers(0, len(DOCS) - 1),
        start=st.integers(0, DOC_BLOCKS - 1),
        length=st.integers(1, DOC_BLOCKS),
        medium=st.sampled_from(MEDIA),
    )
    def store(self, worker: str, doc: int, start: int, length: int, medium: str) -> None:
        event = self._event(worker, doc, start, length, medium)
        self.index.apply_batch(worker, batch(event, epoch=self.epochs[worker]))

    @rule(
        worker=st.sampled_from(WORKERS),
        doc=st.integers(0, len(DOCS) - 1),
        start=st.integers(0, DOC_BLOCKS - 1),
        length=st.integers(1, DOC_BLOCKS),
        medium=st.sampled_from(MEDIA),
    )
    def remove(self, worker: str, doc: int, start: int, length: int, medium: str) -> None:
        ns, salt, toks = DOCS[doc]
        hashes = engine_hashes(toks, salt, ns)[start : start + length]
        medium_id = parse_medium(medium)
        assert medium_id is not None
        self.model.touch(worker)
        self.model.remove(worker, hashes, medium_id)
        self.index.apply_batch(worker, batch(removed(hashes, medium), epoch=self.epochs[worker]))

    @rule(worker=st.sampled_from(WORKERS))
    def clear(self, worker: str) -> None:
        """vLLM's GPU prefix-cache reset: the device copies go, offloaded ones stay."""
        self.model.touch(worker)
        self.model.remove(worker, list(self.model.held.get(worker, {})), Medium.DEVICE)
        self.index.apply_batch(worker, batch(AllBlocksCleared(), epoch=self.epochs[worker]))

    @rule(worker=st.sampled_from(WORKERS), doc=st.integers(0, len(DOCS) - 1))
    def restart(self, worker: str, doc: int) -> None:
        """A new incarnation: its first batch carries the new epoch and a fresh store."""
        self.epochs[worker] += 1
        self.model.touch(worker)
        self.model.held[worker] = {}
        self.model.consistent[worker] = True
        event = self._event(worker, doc, 0, DOC_BLOCKS, "device")
        self.index.apply_batch(worker, batch(event, epoch=self.epochs[worker]))

    @rule(worker=st.sampled_from(WORKERS))
    def lose_events(self, worker: str) -> None:
        self.index.mark_inconsistent(worker)
        if worker in self.model.consistent:
            self.model.consistent[worker] = False

    @rule(worker=st.sampled_from(WORKERS), docs=st.lists(st.integers(0, len(DOCS) - 1)))
    def resync(self, worker: str, docs: list[int]) -> None:
        self.model.touch(worker)
        self.model.held[worker] = {}
        self.model.consistent[worker] = True
        dump = [self._event(worker, d, 0, DOC_BLOCKS, "host") for d in docs]
        self.index.replace_worker(worker, self.epochs[worker], dump)

    @rule(worker=st.sampled_from(WORKERS))
    def remove_worker(self, worker: str) -> None:
        self.index.remove_worker(worker)
        self.model.held.pop(worker, None)
        self.model.consistent.pop(worker, None)
        self.model.blind.discard(worker)

    @rule(worker=st.sampled_from(WORKERS), reaches=st.booleans())
    def shared_access(self, worker: str, reaches: bool) -> None:
        self.index.set_shared_access(worker, reaches)
        if reaches:
            self.model.blind.discard(worker)
        else:
            self.model.blind.add(worker)

    @invariant()
    def matches_equal_the_model(self) -> None:
        for ns, _, toks in DOCS:
            for tenant in {ns, "b"}:
                assert depth(self.index, toks, tenant) == self.model.match(tenant, toks)

    @invariant()
    def counts_equal_the_model(self) -> None:
        routers: set[int] = set()
        for worker, held in self.model.held.items():
            per_medium = [0, 0, 0, 0]
            for router, media in held.values():
                routers.add(router)
                for medium in media:
                    per_medium[medium] += 1
            assert self.index.blocks_held(worker) == tuple(per_medium)
        routers.update(self.model.shared.values())
        assert self.index.shared_blocks() == len(self.model.shared)
        assert len(self.index) == len(routers)
        assert sorted(self.index.workers) == sorted(self.model.held)
        assert self.index.stats.orphan_blocks == self.model.orphans
        assert self.index.stats.duplicate_stores == self.model.duplicates


class PaddedIndexMachine(IndexMachine):
    PADDING = 17


TestIndexMatchesModel = IndexMachine.TestCase
TestIndexMatchesModel.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestPaddedIndexMatchesModel = PaddedIndexMachine.TestCase
TestPaddedIndexMatchesModel.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None
)


def test_a_late_batch_from_a_retired_epoch_is_ignored() -> None:
    from kvstrata.events.schema import BlockStored, make_batch

    index = GlobalIndex(FingerprintDigest(bytes(32)), 4)
    tokens = list(range(8))
    stored = BlockStored(
        block_hashes=[1, 2],
        parent_block_hash=None,
        token_ids=tokens,
        block_size=4,
        lora_id=None,
        medium="device",
        lora_name=None,
    )
    index.apply_batch("w", make_batch([stored], epoch=1))
    index.apply_batch("w", make_batch([], epoch=2))  # restart: entries of epoch 1 dropped
    assert index.match(index.request_hashes(None, tokens))["w"].blocks == 0
    index.apply_batch("w", make_batch([stored], epoch=1))  # delivered late
    assert index.match(index.request_hashes(None, tokens))["w"].blocks == 0
    assert index.stats.stale_batches == 1 and index.epoch("w") == 2


def test_the_hasher_cache_keeps_the_namespaces_used_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """Namespace names come from clients: the cache of router hashers is bounded (LRU)."""
    from kvstrata.index import core

    monkeypatch.setattr(core, "MAX_HASHERS", 4)
    index = make_index()
    kept = index.hasher("t0")
    for i in range(1, 10):
        index.hasher(f"t{i}")
        assert index.hasher("t0") is kept  # used every time: never the least recent
    assert len(index._hashers) == 4
    assert index.hasher("t1") is not None and len(index._hashers) == 4


def test_a_batch_stamped_with_a_non_finite_time_does_not_poison_the_lag() -> None:
    index = make_index()
    toks = tokens(1, 1)
    for ts in (float("-inf"), float("nan")):
        index.apply_batch("w0", KVEventBatch(ts=ts, events=[stored(engine_hashes(toks), toks)]))
    for ts in (float("inf"), float("nan")):  # a dump's stamp, too
        index.replace_worker("w1", None, [stored(engine_hashes(toks), toks)], ts=ts)
    index.apply_batch("w0", KVEventBatch(ts=NOW - 2.0, events=[]))
    assert index.stats.lag_quantile(0.99) == 2.0
