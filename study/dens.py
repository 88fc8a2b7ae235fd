from __future__ import annotations
import sys
from pathlib import Path
from kvstrata.bench.eviction import SimulatedTrace, replay
from kvstrata.costs import PROFILES
from kvstrata.store.value_policy import ValuePolicy, bucket_start_s
from kvstrata.workloads.mooncake import read_trace
reqs = read_trace(Path("../shared/data/mooncake/conversation_trace.jsonl"))[:3000]
trace = SimulatedTrace.build(reqs, PROFILES["smollm2-cpu"]())
pol = ValuePolicy()
replay(trace, pol, int(sys.argv[1]))
d = pol.density
for c in range(4):
    row = [(round(bucket_start_s(b)), round(d.hits[c][b]), round(d.exits[c][b]), f"{d.density[c][b]:.2g}") for b in range(0, 48, 2) if d.hits[c][b] or d.exits[c][b]]
    print(c, row)
