"""A worker process over a shared remote tier, for the cross-process tests (run as a script).

``write``: generate ``--tokens`` prompt tokens (seeded) once, so its blocks are written through
to the remote tier, and exit. ``read``: a fresh engine (empty device pool, nothing local) runs
the same prompt twice — without the cache (a fresh prefill) and with it — and prints one JSON
line: the tokens matched per tier, the greedy outputs and the largest logit difference.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from kvstrata.engine.engine import EngineConfig
from kvstrata.engine.factory import build_engine
from kvstrata.engine.model_loader import load_model
from kvstrata.engine.sampling import SamplingParams
from kvstrata.runtime.config import WorkerConfig, remote_tier
from kvstrata.store.config import TierConfig
from kvstrata.tiers.remote_client import RemoteConfig


def prompt(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, 40000, size=n)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["write", "read"])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--url", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--tenant", default="default")
    parser.add_argument("--tokens", type=int, default=150)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    loaded = load_model(args.model)
    remote = RemoteConfig(url=args.url, namespace=args.namespace)
    config = WorkerConfig(tiers=(remote_tier(remote, 256 << 20, TierConfig("remote")),))
    engine = build_engine(loaded, EngineConfig(block_size=16, pool_blocks=256), config)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ids = prompt(args.tokens, args.seed)
    try:
        if args.mode == "write":
            engine.generate(ids, greedy, tenant=args.tenant).run()
            print(json.dumps({"written": True}))
            return 0
        fresh = engine.generate(ids, greedy, use_cache=False, keep_logits=True).run()
        engine.pool.clear()
        cached = engine.generate(ids, greedy, keep_logits=True, tenant=args.tenant).run()
        diff = max(
            float((a - b).abs().max())
            for a, b in zip(fresh.step_logits, cached.step_logits, strict=True)
        )
        out = {
            "matched_by_tier": cached.record.matched_by_tier,
            "fresh": fresh.output_ids,
            "cached": cached.output_ids,
            "max_logit_diff": diff,
        }
        print(json.dumps(out))
        return 0
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
