"""One writer process of the multi-writer tests (run as a script; prints one JSON line).

It opens its own ``RemoteTier`` on ``--url``/``--namespace`` (capacity and quotas as given —
every writer of a namespace must agree on them, as workers built from one configuration
do), waits until ``--start-at`` (a wall-clock instant shared by all writers, so their stores
interleave), then stores ``--objects`` (``seed:tenant:value`` items, value = saved prefill
seconds) in order, and reports what it stored and which objects its admissions evicted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from kvstrata.objects import KVObjectMeta
from kvstrata.store.value_policy import value_per_byte
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_client import RemoteConfig
from tier_helpers import make_object


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--capacity", type=int, required=True)
    parser.add_argument("--quota", action="append", default=[], help="tenant:bytes")
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--objects", required=True, help="comma list of seed:tenant:value")
    args = parser.parse_args(argv)
    quotas = {t: int(b) for t, b in (q.split(":") for q in args.quota)}
    tier = RemoteTier(
        RemoteConfig(url=args.url, namespace=args.namespace),
        args.capacity,
        value_of=value_per_byte,
        quota_of=quotas.get,
    )
    stored, refused = [], []
    try:
        while time.time() < args.start_at:
            time.sleep(0.001)
        for item in args.objects.split(","):
            seed, tenant, value = item.split(":")
            meta, payload = make_object(int(seed), tenant=tenant)
            meta = KVObjectMeta(**{**meta.__dict__, "recompute_s": float(value)})
            slot = tier.prepare_store(meta)
            if slot is None:
                refused.append(int(seed))
                continue
            slot.buffer[:] = payload
            if tier.complete_store(slot, True):
                stored.append(int(seed))
        evicted = [key.hex() for key, _ in tier.take_evicted()]
        print(json.dumps({"stored": stored, "refused": refused, "evicted": evicted}))
    finally:
        tier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
