"""Deletions in the global index: what goes, and what a late event may not bring back.

Scripted scenarios on the pure index (time passed in): a prompt's chain and its descendants
leave every worker slot and the shared tier, other tenants and prefixes stay; a tenant's
whole namespace; the keys workers report (``older_than``). Tombstones refuse a late batch,
a replayed batch and a dump taken before the deletion; a batch after the deletion, a new
incarnation and anything after the TTL are accepted. A slot whose stream the index already
applied past the deletion's position (the index side runs after every worker answered) keeps
what that worker stored again meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstrata.index import GlobalIndex
from kvstrata.index.tombstones import Lineage, StreamPosition, Tombstones
from test_index import (
    BS,
    FP,
    batch,
    depth,
    engine_hashes,
    removed,
    stored,
    tokens,
)

TTL = 600.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock) -> GlobalIndex:
    return GlobalIndex(FP, BS, clock=clock, tombstone_ttl_s=TTL)


def put(
    index: GlobalIndex,
    worker: str,
    toks: list[int],
    *,
    seq: int,
    ns: str = "acme",
    medium: str = "device",
    parent_blocks: int = 0,
    epoch: int = 7,
) -> list[int]:
    """Store blocks ``parent_blocks..`` of ``toks`` (below the earlier ones) at ``seq``."""
    hashes = engine_hashes(toks, namespace=ns)
    parent = hashes[parent_blocks - 1] if parent_blocks else None
    event = stored(hashes[parent_blocks:], toks[parent_blocks * BS :], parent, medium, ns)
    index.apply_batch(worker, batch(event, epoch=epoch), seq=seq)
    return hashes


def blocks(index: GlobalIndex, toks: list[int], ns: str = "acme") -> dict[str, int]:
    return {w: d for w, (d, _tiers) in depth(index, toks, ns).items()}


def positions(**next_seq: int) -> dict[str, StreamPosition]:
    return {w: StreamPosition(7, seq) for w, seq in next_seq.items()}


def test_a_prompt_and_its_descendants_leave_every_slot_and_the_shared_tier() -> None:
    clock = Clock()
    index = make(clock)
    doc = tokens(1, 6)
    other = tokens(2, 4)
    put(index, "w0", doc[: 3 * BS], seq=0)
    put(index, "w0", doc, seq=1, parent_blocks=3)  # descendants, in a later event
    put(index, "w1", doc[: 4 * BS], seq=0, medium="host")
    put(index, "w1", doc, seq=1, medium="remote")  # the shared tier
    put(index, "w0", other, seq=2)
    put(index, "w0", doc, seq=3, ns="globex")  # the same tokens, another tenant
    assert blocks(index, doc) == {"w0": 6, "w1": 6}

    prompt = index.request_hashes("acme", doc[: 2 * BS])
    result = index.delete("acme", router_hashes=prompt, positions=positions(w0=4, w1=2))
    # w0: 6 device; w1: 4 host; shared: 6 remote.
    assert result.removed == 6 + 4 + 6
    assert blocks(index, doc) == {"w0": 0, "w1": 0}
    assert blocks(index, doc[: 5 * BS]) == {"w0": 0, "w1": 0}
    assert index.shared_blocks() == 0
    assert blocks(index, other) == {"w0": 4, "w1": 0}
    assert blocks(index, doc, "globex") == {"w0": 6, "w1": 0}
    assert index.stats.deletions == 1 and index.stats.deleted_entries == 16


def test_late_replayed_and_stale_dump_events_cannot_resurrect_later_ones_can() -> None:
    clock = Clock()
    index = make(clock)
    doc = tokens(3, 4)
    put(index, "w0", doc, seq=5)
    put(index, "w0", doc, seq=6, medium="remote")
    index.delete(
        "acme",
        router_hashes=index.request_hashes("acme", doc),
        positions=positions(w0=9),
    )
    assert blocks(index, doc) == {"w0": 0}

    put(index, "w0", doc, seq=8)  # a late batch from before the deletion's answer
    put(index, "w0", doc, seq=5)  # a replay of the original one
    put(index, "w0", doc, seq=6, medium="remote")
    assert blocks(index, doc) == {"w0": 0}
    assert index.stats.tombstone_refusals == 12

    hashes = engine_hashes(doc, namespace="acme")
    stale_dump = [stored(hashes, doc, None, "host", "acme")]
    index.replace_worker("w0", 7, stale_dump, next_seq=9)  # taken before the answer's seq
    assert blocks(index, doc) == {"w0": 0}
    index.replace_worker("w0", 7, stale_dump, next_seq=10)  # taken after: the block is back
    assert blocks(index, doc) == {"w0": 4}

    index.delete(
        "acme", router_hashes=index.request_hashes("acme", doc), positions=positions(w0=12)
    )
    put(index, "w0", doc, seq=12)  # stored again after the deletion: a fact
    assert blocks(index, doc) == {"w0": 4}


def test_a_worker_that_did_not_confirm_is_refused_a_new_incarnation_is_not() -> None:
    clock = Clock()
    index = make(clock)
    doc = tokens(4, 3)
    put(index, "w0", doc, seq=1)
    put(index, "w1", doc, seq=1)
    # w0 answered from a new incarnation (epoch 8) the index has not heard of yet; w1 failed.
    prompt = index.request_hashes("acme", doc)
    index.delete("acme", router_hashes=prompt, positions={"w0": StreamPosition(8, 3)})
    put(index, "w1", doc, seq=50)  # no position: refused whatever its seq
    put(index, "w0", doc, seq=2)  # its old incarnation's late batch: refused
    assert blocks(index, doc) == {"w0": 0, "w1": 0}
    put(index, "w0", doc, seq=0, epoch=8)  # the new incarnation before its position: refused
    assert blocks(index, doc) == {"w0": 0, "w1": 0}
    put(index, "w1", doc, seq=0, epoch=9)  # w1 restarted: never confirmed, still refused
    assert blocks(index, doc) == {"w0": 0, "w1": 0}
    put(index, "w0", doc, seq=3, epoch=8)
    assert blocks(index, doc)["w0"] == 3
    put(index, "w0", doc, seq=0, epoch=99)  # a later restart of a confirmed worker: accepted
    assert blocks(index, doc)["w0"] == 3


def test_tombstones_expire_after_their_ttl() -> None:
    clock = Clock()
    index = make(clock)
    doc = tokens(5, 2)
    put(index, "w0", doc, seq=1)
    index.delete("acme", router_hashes=index.request_hashes("acme", doc), positions=positions(w0=4))
    clock.now += TTL - 1
    put(index, "w0", doc, seq=2)
    assert blocks(index, doc) == {"w0": 0}
    clock.now += 1
    put(index, "w0", doc, seq=2)
    assert blocks(index, doc) == {"w0": 2}
    # applying the batch pruned the expired ones (they were kept until another deletion, and
    # every stored block paid the tombstone check meanwhile: review finding, stop 35)
    assert index.tombstones() == 0


def test_everything_deletes_the_namespace_and_reported_keys_go_too() -> None:
    clock = Clock()
    index = make(clock)
    first, second, kept = tokens(6, 3), tokens(7, 2), tokens(8, 2)
    put(index, "w0", first, seq=0)
    put(index, "w1", second, seq=0, medium="remote")
    put(index, "w0", kept, seq=1, ns="globex")
    result = index.delete("acme", everything=True, positions=positions(w0=2, w1=1))
    assert result.removed == 3 + 2
    assert blocks(index, first) == {"w0": 0, "w1": 0}
    assert blocks(index, second) == {"w0": 0, "w1": 0}
    assert blocks(index, kept, "globex") == {"w0": 2, "w1": 0}

    # older_than: the workers choose by age and report the keys' event hashes.
    old, young = tokens(9, 2), tokens(10, 2)
    put(index, "w0", old, seq=2)
    put(index, "w0", young, seq=3)
    reported = engine_hashes(old, namespace="acme")
    index.delete("acme", engine_hashes=reported, positions=positions(w0=4, w1=1))
    assert blocks(index, old) == {"w0": 0, "w1": 0}
    assert blocks(index, young)["w0"] == 2
    put(index, "w0", old, seq=3)
    assert blocks(index, old)["w0"] == 0


def test_lineage_and_tombstones_alone() -> None:
    lineage = Lineage()
    lineage.add("a", None, [1, 2, 3])
    lineage.add("a", 2, [4, 5])
    lineage.add("b", None, [6])
    assert lineage.descendants("a", [2]) == {2, 3, 4, 5}
    assert lineage.descendants("a", [9]) == {9}
    assert lineage.namespace("b") == {6}
    lineage.discard(6)
    assert lineage.namespace("b") == set()

    stones: Tombstones[int] = Tombstones(10.0)
    stones.add([1, 2], {"w": StreamPosition(1, 5)}, now=0.0)
    stones.add([2], {"w": StreamPosition(1, 8)}, now=5.0)  # a later deletion replaces
    two = stones.get(2, now=9.0)
    assert two is not None and two.refuses("w", 1, 7) and not two.refuses("w", 1, 8)
    assert stones.expire(10.0) == 1 and stones.get(1, 10.0) is None
    assert stones.get(2, 14.9) is not None and stones.get(2, 15.0) is None


def _deleted_then_stored_again(index: GlobalIndex, worker: str, doc: list[int]) -> None:
    """What a fast worker's stream shows once its deletion ran (answer: ``next_seq`` 2):
    the prompt at seq 0, its ``BlockRemoved`` at seq 1, the prompt recomputed at seq 3."""
    hashes = put(index, worker, doc, seq=0)
    index.apply_batch(worker, batch(removed(hashes), epoch=7), seq=1)
    assert blocks(index, doc)[worker] == 0
    put(index, worker, doc, seq=3)
    assert blocks(index, doc)[worker] == len(hashes)


def test_a_store_after_the_workers_deletion_survives_the_index_side() -> None:
    """The review's race (stop 36): ``delete`` removed the fresh store of the fast worker,
    and no later event brought it back (a routing miss for good); the slow one's entries go."""
    clock = Clock()
    index = make(clock)
    doc = tokens(11, 3)
    _deleted_then_stored_again(index, "fast", doc)
    put(index, "slow", doc, seq=4)  # its deletion is at seq 5: not applied yet
    result = index.delete(
        "acme", router_hashes=index.request_hashes("acme", doc), positions=positions(fast=2, slow=6)
    )
    assert blocks(index, doc) == {"fast": 3, "slow": 0}
    assert result.removed == 3 and index.tombstones() > 0  # tombstones recorded as before
    put(index, "fast", doc, seq=1)  # a replay from before its position: still refused
    put(index, "slow", doc, seq=5)
    assert blocks(index, doc) == {"fast": 3, "slow": 0}
    put(index, "slow", doc, seq=6)  # stored again after its own position: a fact
    assert blocks(index, doc) == {"fast": 3, "slow": 3}


def test_a_slot_not_provably_past_its_position_loses_its_entries() -> None:
    """When unsure, the entries go as they always did: a slot exactly at the position, one of
    another epoch, an inconsistent one, one fed by a second stream, an unsettled worker, a
    dump taken before the position. A dump taken after it is spared."""
    doc = tokens(12, 2)

    def survives(
        prepare: Callable[[GlobalIndex], object],
        position: StreamPosition,
        unsettled: frozenset[str] = frozenset(),
    ) -> bool:
        index = make(Clock())
        prepare(index)
        prompt = index.request_hashes("acme", doc)
        index.delete("acme", router_hashes=prompt, positions={"w0": position}, unsettled=unsettled)
        return blocks(index, doc)["w0"] > 0

    def at(seq: int, epoch: int = 7) -> Callable[[GlobalIndex], object]:
        return lambda index: put(index, "w0", doc, seq=seq, epoch=epoch)

    def inconsistent(index: GlobalIndex) -> None:
        put(index, "w0", doc, seq=9)
        index.mark_inconsistent("w0")

    def second_stream(index: GlobalIndex) -> None:
        put(index, "w0", doc, seq=9)
        event = stored(engine_hashes(doc, namespace="other"), doc, None, "host", "other")
        index.apply_batch("w0", batch(event), seq=0, second_stream=True)

    def dump(next_seq: int) -> Callable[[GlobalIndex], object]:
        event = stored(engine_hashes(doc, namespace="acme"), doc, None, "device", "acme")
        return lambda index: index.replace_worker("w0", 7, [event], next_seq=next_seq)

    assert survives(at(5), StreamPosition(7, 5))
    assert not survives(at(4), StreamPosition(7, 5))  # the position's own batch is not in
    assert not survives(at(5), StreamPosition(8, 5))  # another incarnation answered
    assert not survives(at(5, epoch=6), StreamPosition(7, 5))
    assert not survives(at(5), StreamPosition(None, 5))
    assert not survives(inconsistent, StreamPosition(7, 5))
    assert not survives(second_stream, StreamPosition(7, 5))
    assert not survives(at(5), StreamPosition(7, 5), unsettled=frozenset({"w0"}))
    assert not survives(dump(5), StreamPosition(7, 5))  # as old as batch 4
    assert survives(dump(6), StreamPosition(7, 5))
