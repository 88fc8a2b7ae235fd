"""Study: ValuePolicy variants vs the deployed peers (issue 15 item 3).

PYTHONPATH=src python study/value_study.py TRACE [REQUESTS]   (TRACE: mooncake | chat | docs |
azure-conv). Capacities 2%, 5%, 15% of the replayed distinct blocks. Simulated time: figures
do not depend on machine load. Prints one JSON line per trace.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from kvstrata.bench.eviction import SimulatedTrace, make_policy, replay
from kvstrata.costs import PROFILES
from kvstrata.store.policy import EvictionPolicy
from kvstrata.store.value_policy import ValuePolicy
from kvstrata.workloads.mooncake import read_trace
from kvstrata.workloads.synthetic import generate, preset

PEERS = ("lru", "s3fifo", "arc", "gdsf", "tinylfu", "kvstrata")
VARIANTS: dict[str, Callable[[], EvictionPolicy]] = {
    "v1-ghost1": lambda: ValuePolicy(ghost_factor=1.0),
    "v1-ghost8": lambda: ValuePolicy(ghost_factor=8.0),
    "v2-ghost8-uses": lambda: ValuePolicy(ghost_factor=8.0, ghost_uses=True),
    "v3-ghost8-uses-censored": lambda: ValuePolicy(
        ghost_factor=8.0, ghost_uses=True, ghost_censored=True
    ),
    "v3-ghost1-uses-censored": lambda: ValuePolicy(
        ghost_factor=1.0, ghost_uses=True, ghost_censored=True
    ),
}


def main() -> None:
    name = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else None
    data = Path("../shared/data")
    if name == "mooncake":
        requests = read_trace(data / "mooncake" / "conversation_trace.jsonl")
    else:
        requests = generate(preset(name, int(sys.argv[4]) if len(sys.argv) > 4 else 0), data)
    requests = requests[:count]
    trace = SimulatedTrace.build(requests, PROFILES["smollm2-cpu"]())
    distinct = len(trace.meta)
    capacities = [int(distinct * p / 100) for p in (2, 5, 15)]
    out: dict[str, object] = {"trace": name, "requests": len(requests), "capacities": capacities}
    rows: dict[str, dict[str, list[float]]] = {}
    names = [n for n in (*PEERS, *VARIANTS) if only is None or n in only]
    for policy_name in names:
        tokens, seconds = [], []
        for capacity in capacities:
            policy = (
                VARIANTS[policy_name]() if policy_name in VARIANTS else make_policy(policy_name, trace)
            )
            result = replay(trace, policy, capacity)
            tokens.append(result.saved_tokens)
            seconds.append(round(result.saved_prefill_s, 1))
        rows[policy_name] = {"s": seconds, "tok": tokens}
        print(policy_name, seconds, tokens, file=sys.stderr, flush=True)
    out["rows"] = rows
    print(json.dumps(out))


if __name__ == "__main__":
    main()
