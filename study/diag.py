"""Diagnostic: where kvstrata's and S3-FIFO's saved tokens come from (use count at hit time)."""
from __future__ import annotations
import sys
from collections import Counter
from pathlib import Path
from kvstrata.bench.eviction import SimulatedTrace, make_policy, replay
from kvstrata.costs import PROFILES
from kvstrata.workloads.mooncake import read_trace

reqs = read_trace(Path("../shared/data/mooncake/conversation_trace.jsonl"))[:3000]
trace = SimulatedTrace.build(reqs, PROFILES["smollm2-cpu"]())
cap = int(sys.argv[1]) if len(sys.argv) > 1 else 1105
span = reqs[-1].timestamp_s - reqs[0].timestamp_s
print("span s", span, "distinct", len(trace.meta))
for name in ("s3fifo", "kvstrata", "gdsf"):
    pol = make_policy(name, trace)
    uses: Counter = Counter()
    hit_by_use: Counter = Counter()
    hit_s_by_use: Counter = Counter()
    vict_use: Counter = Counter()
    ages = []
    last: dict = {}
    orig_access, orig_remove, orig_insert = pol.on_access, pol.on_remove, pol.on_insert
    now_box = [0.0]
    def acc(key, now):
        u = uses[key]
        b = min(u, 5)
        hit_by_use[b] += 1
        hit_s_by_use[b] += trace.meta[key].recompute_s
        uses[key] += 1; last[key] = now; now_box[0] = now
        orig_access(key, now)
    def ins(meta, now):
        uses[meta.key] = 1; last[meta.key] = now; now_box[0] = now
        orig_insert(meta, now)
    def rem(key):
        vict_use[min(uses[key], 5)] += 1
        ages.append(now_box[0] - last[key])
        del uses[key]
        orig_remove(key)
    pol.on_access, pol.on_insert, pol.on_remove = acc, ins, rem  # type: ignore
    r = replay(trace, pol, cap)
    ages.sort()
    print(name, r.saved_tokens, round(r.saved_prefill_s), "hits by prior uses", dict(sorted(hit_by_use.items())),
          "hit_s", {k: round(v) for k, v in sorted(hit_s_by_use.items())},
          "victims by uses", dict(sorted(vict_use.items())),
          "victim age p10/50/90", [round(ages[int(len(ages)*q)],1) for q in (0.1,0.5,0.9)])
