"""Hypothesis drives the tiered store against a naive model of what must be visible.

Invariants checked after every step:
- a lookup never returns a PENDING, EXPIRED, INVALID, deleted or other tenant's object, and a
  load never yields bytes other than those stored under that key;
- tenant quotas are never exceeded on any tier;
- an object a planned promotion holds (``TieredStore.hold``) is never evicted: it stays
  until released, unless deleted, expired or found corrupt (one thread here: an object
  another thread already picked as a victim is not held in the first place);
- the store's count of a level's held bytes is its held objects' exactly, and no
  reservation (``hold(..., reserve=True)``) is taken past ``HOLD_SHARE`` of the level;
- every object committed to the write-through disk tier survives a crash (host lost, disk
  re-opened and recovered);
- the change feed, replayed from the start (recovered objects first after a crash), equals
  what every level holds, tenants included.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, Representation, payload_digest
from kvstrata.store.config import TierConfig, WritePolicy
from kvstrata.store.events import ObjectStored
from kvstrata.store.levels import Located
from kvstrata.store.policies import LRUPolicy
from kvstrata.store.state import HOLD_SHARE
from kvstrata.store.tiered import RequestScope, TieredStore
from kvstrata.store.value_policy import ValuePolicy
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.host import HostTier

OBJ = 1024
TTL = 50.0
QUOTA = {"a": 3 * OBJ, "b": 6 * OBJ}
TENANTS = ("a", "b")
CHAINS = 3
DEPTH = 4


def key_of(tenant: str, chain: int, depth: int) -> BlockKey:
    return BlockKey(f"{tenant}:{chain}:{depth}".encode().ljust(32, b"_"))


def payload_of(key: BlockKey, version: int) -> bytes:
    return (key + version.to_bytes(4, "little") * 8)[:OBJ].ljust(OBJ, b"\x01")


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvstrata-stateful-"))
        self.now = 1000.0
        self.version = 0
        self.expected: dict[BlockKey, bytes] = {}  # the payload each key may ever be read as
        self.deleted: set[BlockKey] = set()
        self.written: set[BlockKey] = set()  # keys this machine wrote through to disk
        # Corrupted on disk behind the store's back: lost until deleted (a re-put of the same
        # key finds the copy present and, rightly, does not re-read it to check).
        self.corrupted: set[BlockKey] = set()
        self.replayed: dict[tuple[str, BlockKey], str] = {}  # the feed, applied: level → tenant
        # planned promotions not finished yet, each with its keys deleted or corrupted since
        self.holds: list[tuple[list[Located], set[BlockKey]]] = []
        self.store = self._open()

    def clock(self) -> float:
        return self.now

    def _open(self) -> TieredStore:
        host = HostTier(8 * OBJ, OBJ, clock=self.clock)
        disk = DiskTier(self.dir, 12 * OBJ, durable=False, clock=self.clock)
        levels = [
            (
                host,
                ValuePolicy(demotion_fetch_s_per_byte=1e-9),
                TierConfig("host", ttl_s=TTL, tenant_quota_bytes=QUOTA),
            ),
            (
                disk,
                LRUPolicy(),
                TierConfig("disk", WritePolicy.WRITE_THROUGH, ttl_s=TTL, tenant_quota_bytes=QUOTA),
            ),
        ]
        return TieredStore(levels, clock=self.clock, record_events=True)

    @rule(
        tenant=st.sampled_from(TENANTS),
        chain=st.integers(0, CHAINS - 1),
        depth=st.integers(0, DEPTH - 1),
    )
    def put(self, tenant: str, chain: int, depth: int) -> None:
        parent = None
        for d in range(depth + 1):
            key = key_of(tenant, chain, d)
            if key not in self.expected or key in self.deleted:
                self.version += 1
                self.expected[key] = payload_of(key, self.version)
                self.deleted.discard(key)
            payload = self.expected[key]
            meta = KVObjectMeta(
                key=key,
                parent=parent,
                tenant=tenant,
                representation=Representation("uint8", "raw", 1, (OBJ,)),
                size=OBJ,
                digest=payload_digest(payload),
                created_at=self.now,
                position=d,
                recompute_s=0.001 * (d + 1),
            )

            def fill(buffer: memoryview, data: bytes = payload) -> None:
                buffer[:] = data

            self.store.put(meta, fill, RequestScope(tenant))
            if self.store.levels[1].tier.contains(key):
                self.written.add(key)
            parent = key

    @rule(
        tenant=st.sampled_from(TENANTS),
        owner=st.sampled_from(TENANTS),
        chain=st.integers(0, CHAINS - 1),
    )
    def lookup_and_load(self, tenant: str, owner: str, chain: int) -> None:
        keys = [key_of(owner, chain, d) for d in range(DEPTH)]
        found = self.store.lookup(keys, RequestScope(tenant))
        if owner != tenant:
            assert found == []
        for located in found:
            assert located.key not in self.deleted
            with self.store.load(located, tenant) as lease:
                if lease is not None:
                    assert lease.meta.tenant == tenant
                    assert not lease.meta.expired(self.now)
                    assert bytes(lease.buffer) == self.expected[located.key]

    @rule(tenant=st.sampled_from(TENANTS), chain=st.integers(0, CHAINS - 1), reserve=st.booleans())
    def hold(self, tenant: str, chain: int, reserve: bool) -> None:
        keys = [key_of(tenant, chain, d) for d in range(DEPTH)]
        located = self.store.lookup(keys, RequestScope(tenant))
        before = list(self.store._held_bytes)
        held = self.store.hold(located, reserve=reserve)
        for level, was, now in zip(self.store.levels, before, self.store._held_bytes, strict=True):
            if reserve and now > was:  # a reservation took new bytes: within the cap
                assert now <= HOLD_SHARE * level.tier.capacity_bytes
        assert held == located[: len(held)]
        self.holds.append((held, set(self.corrupted)))

    @precondition(lambda self: bool(self.holds))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        held, _ = self.holds.pop(data.draw(st.integers(0, len(self.holds) - 1)))
        self.store.release(held)

    @rule(seconds=st.sampled_from([1.0, 10.0, 30.0, 60.0]))
    def advance(self, seconds: float) -> None:
        self.now += seconds

    @rule(tenant=st.sampled_from(TENANTS), chain=st.integers(0, CHAINS - 1))
    def delete(self, tenant: str, chain: int) -> None:
        keys = [key_of(tenant, chain, d) for d in range(DEPTH)]
        self.store.delete(keys)
        self.deleted.update(keys)
        for _, gone in self.holds:
            gone.update(keys)
        self.corrupted.difference_update(keys)
        assert self.store.lookup(keys, RequestScope(tenant)) == []

    @precondition(lambda self: any(True for _ in self.store.levels[1].tier.keys()))
    @rule(data=st.data())
    def corrupt_a_disk_file(self, data: st.DataObject) -> None:
        disk = self.store.levels[1].tier
        assert isinstance(disk, DiskTier)
        key = data.draw(st.sampled_from(sorted(disk.keys())))
        path = disk.path_of(key)
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
        self.corrupted.add(key)  # it may now legitimately disappear
        for _, gone in self.holds:
            gone.add(key)

    @rule()
    def crash(self) -> None:
        disk = self.store.levels[1].tier
        survivors = {k for k in disk.keys() if k in self.written and k not in self.corrupted}
        disk.close()  # the process dies: the host tier's memory is simply gone
        self.store = self._open()
        self.holds = []  # the process died with its promotions
        self.replayed = {}  # a new store: its feed starts with what it recovered
        recovered = set(self.store.levels[1].tier.keys())
        assert survivors <= recovered

    @invariant()
    def feed_replays_to_residency(self) -> None:
        with self.store.exclusive():
            resident = {
                (name, meta.key): meta.tenant
                for name, metas in self.store.resident()
                for meta in metas
            }
            events = self.store.take_events()
        for event in events:
            if isinstance(event, ObjectStored):
                self.replayed[(event.tier, event.meta.key)] = event.meta.tenant
            else:
                assert self.replayed.pop((event.tier, event.key)) == event.tenant
        assert self.replayed == resident

    @invariant()
    def held_objects_stay(self) -> None:
        for held, gone in self.holds:
            for loc in held:
                if loc.key not in gone and not loc.meta.expired(self.now):
                    assert self.store.levels[loc.level].tier.contains(loc.key)

    @invariant()
    def held_bytes_are_counted_exactly(self) -> None:
        held = [0] * len(self.store.levels)
        for (level, _), hold in self.store._held.items():
            held[level] += hold.size
        assert held == self.store._held_bytes

    @invariant()
    def quotas_hold(self) -> None:
        for level in self.store.levels:
            for tenant, quota in QUOTA.items():
                assert level.tier.tenant_bytes(tenant) <= quota
            assert level.tier.used_bytes <= level.tier.capacity_bytes

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_store_against_naive_model = StoreMachine.TestCase
