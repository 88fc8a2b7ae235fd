"""The tiered store's audit trail over real host and disk tiers: an eviction, a quota
rejection, a tier switch, a digest mismatch (a corrupted disk object) and an expiry each leave
exactly one JSON line with the tier, the block key in hex and the reason — never a token id.
Time is a settable clock; the audit file is read after ``close()`` has written the queue."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvstrata.objects import KVObjectMeta
from kvstrata.security.audit import AuditLog
from kvstrata.store.config import TierConfig
from kvstrata.store.policies import LRUPolicy
from kvstrata.store.tiered import RequestScope, TieredStore
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.host import HostTier
from test_tiered_store import OBJ, chain, filler, read
from tier_helpers import FakeClock

TOKENS = tuple(range(71_003, 71_003 + 16))


def _with_tokens(objs: list[tuple[KVObjectMeta, bytes]]) -> list[tuple[KVObjectMeta, bytes]]:
    return [(replace(meta, tokens=TOKENS), payload) for meta, payload in objs]


def _store(tmp_path: Path, clock: FakeClock, audit: AuditLog) -> TieredStore:
    host = TierConfig("host", tenant_quota_bytes={"greedy": OBJ // 2})
    disk = TierConfig("disk", ttl_s=100.0)
    levels = [
        (HostTier(2 * OBJ, OBJ, clock=clock), LRUPolicy(), host),
        (DiskTier(tmp_path / "disk", 64 * OBJ, durable=False, clock=clock), LRUPolicy(), disk),
    ]
    return TieredStore(levels, clock=clock, audit=audit)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _summary(line: dict[str, Any]) -> tuple[Any, ...]:
    return (
        line["audit"],
        line["reason"],
        line.get("tier"),
        line.get("tenant"),
        line.get("objects"),
    )


def test_store_records_evict_quota_switch_digest_and_expiry(tmp_path: Path) -> None:
    clock = FakeClock()
    audit_path = tmp_path / "audit.jsonl"
    audit = AuditLog(audit_path, component="worker").start()
    store = _store(tmp_path, clock, audit)
    e0, e1, e2 = _with_tokens(chain("e", 3))
    (greedy,) = _with_tokens(chain("g", 1, tenant="greedy"))
    try:
        for meta, payload in (e0, e1, e2):  # the host holds two: leaf e1 goes (disk has it)
            clock.now += 1
            assert store.put(meta, filler(payload))
        assert store.put(greedy[0], filler(greedy[1]))  # over its host quota: disk only
        assert not store.levels[0].tier.contains(greedy[0].key)
        store.set_enabled("host", False)
        disk = store.levels[1].tier
        assert isinstance(disk, DiskTier)
        path = disk.path_of(e2[0].key)
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
        assert read(store, e2[0].key) is None  # the digest check drops it
        clock.now += 101  # every disk object is past its TTL; e0 is the one looked at
        assert store.lookup([e0[0].key], RequestScope("t0")) == []
        store.take_events()  # the store learns of the tier's drop
    finally:
        store.close()
        audit.close()
    hex_of = {name: [obj[0].key.hex()] for name, obj in (("e0", e0), ("e1", e1), ("e2", e2))}
    assert [_summary(line) for line in _lines(audit_path)] == [
        ("evict", "already_below", "host", "t0", hex_of["e1"]),
        ("quota_reject", "larger_than_quota", "host", "greedy", [greedy[0].key.hex()]),
        ("tier_switch", "disabled", "host", None, None),
        ("invalidate", "digest_mismatch", "disk", None, hex_of["e2"]),
        ("evict", "expired", "disk", None, hex_of["e0"]),
    ]
    text = audit_path.read_text()
    assert all(str(token) not in text for token in TOKENS)
    assert all(line["component"] == "worker" for line in _lines(audit_path))
    metric = {"tier": "disk", "reason": "digest_mismatch"}
    assert store.metrics.value("kvstrata_tier_invalidated_total", metric) == 1


def test_quota_full_is_recorded_when_the_tenant_has_nothing_to_evict(tmp_path: Path) -> None:
    """The tenant's own objects are pinned by a reader: nothing of its own can go."""
    clock = FakeClock()
    audit_path = tmp_path / "audit.jsonl"
    host = TierConfig("host", tenant_quota_bytes={"t0": OBJ})
    levels = [(HostTier(4 * OBJ, OBJ, clock=clock), LRUPolicy(), host)]
    with AuditLog(audit_path) as audit:
        store = TieredStore(levels, clock=clock, audit=audit)
        first, second = chain("p", 2)
        assert store.put(first[0], filler(first[1]))
        (located,) = store.lookup([first[0].key], RequestScope("t0"))
        with store.load(located, "t0") as lease:
            assert lease is not None
            assert not store.put(second[0], filler(second[1]))
        store.close()
    (line,) = _lines(audit_path)
    assert _summary(line) == ("quota_reject", "quota_full", "host", "t0", [second[0].key.hex()])
