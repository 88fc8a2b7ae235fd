"""What ``kvstrata bench vllm-fleet`` reports, computed from its client runs (pure, no I/O).

One :class:`FleetRun` is one client run of ``vllm.benchmarks.serve`` through a fresh front door
with one routing policy, in front of two freshly started vLLM servers: the client's figures,
the generated texts and each server's ``/metrics`` counters just before and just after the
client (the difference is the run's own work; the warm-up request falls before it).

- **hit rate** = (vLLM prefix-cache hit tokens + external, i.e. connector, hit tokens) ÷ prompt
  tokens, summed over both servers (:func:`hit_rate`);
- **per-server requests**: the difference of ``vllm:request_success_total`` on each server;
- per policy, each figure's median/min/max over the repetitions (:func:`summarize`);
- **goals** (issue 13 item 4): kvstrata's median TTFT p50 and p99 ≤ 0.8 × round-robin's, and
  ≤ 1.0 × the best other policy's (the lowest median among the others); a missing figure never
  meets a goal (:func:`goals`);
- **outputs**: at temperature 0 and the same dataset seed every run sends the same prompts in
  the same order; each text is compared with the first run's text for that prompt
  (:func:`mismatches`; a failed request counts as a mismatch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstrata.bench.serving_report import spread
from kvstrata.telemetry.prom_text import samples

POLICY_NAMES = ("kvstrata", "round-robin", "llm-d", "dynamo")
"""The names ``kvstrata router --policy`` accepts (``router.registry.POLICIES``)."""
FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "hit_rate", "req_per_s", "tpot_p50_ms")
GOAL_VS_ROUND_ROBIN = 0.8
GOAL_VS_BEST_OTHER = 1.0

_COUNTERS = {
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prefix_cache_hits_total": "prefix_cache_hit_tokens",
    "vllm:external_prefix_cache_hits_total": "external_hit_tokens",
    "vllm:request_success_total": "requests",
    "vllm:num_preemptions_total": "preemptions",
}


def server_counters(text: str) -> dict[str, float]:
    """The counters this bench reads from one server's ``/metrics`` (label sets summed; a
    counter the server does not show is 0)."""
    out = dict.fromkeys(_COUNTERS.values(), 0.0)
    for name, _labels, value in samples(text):
        key = _COUNTERS.get(name)
        if key is not None:
            out[key] += value
    return out


def counter_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}


def hit_rate(deltas: Sequence[Mapping[str, float]]) -> float | None:
    """Cached prompt tokens (vLLM's prefix cache + the connector's external hits) ÷ prompt
    tokens, over every server; ``None`` when no prompt token was seen."""
    prompt = sum(d.get("prompt_tokens", 0.0) for d in deltas)
    cached = sum(
        d.get("prefix_cache_hit_tokens", 0.0) + d.get("external_hit_tokens", 0.0) for d in deltas
    )
    return cached / prompt if prompt > 0 else None


@dataclass(frozen=True)
class FleetRun:
    policy: str
    repeat: int
    position: int
    """Where in its repetition this run came (0: first)."""
    client: dict[str, Any]
    """Figures kept from the client result (``serving_report.run_figures``)."""
    servers: dict[str, dict[str, float]]
    """Worker id → counter differences over the client run."""
    texts: list[str | None] = field(repr=False)
    start_s: float = 0.0
    """Both servers and the front door started and attached (outside every figure)."""

    def figures(self) -> dict[str, Any]:
        return {
            "ttft_p50_ms": self.client.get("ttft_p50_ms"),
            "ttft_p99_ms": self.client.get("ttft_p99_ms"),
            "tpot_p50_ms": self.client.get("tpot_p50_ms"),
            "req_per_s": self.client.get("request_throughput"),
            "hit_rate": hit_rate(list(self.servers.values())),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "repeat": self.repeat,
            "position": self.position,
            **self.figures(),
            "requests_per_server": {w: d.get("requests") for w, d in self.servers.items()},
            "client": self.client,
            "server_counters": self.servers,
            "start_s": self.start_s,
        }


def run_order(policies: Sequence[str], repeat: int) -> list[str]:
    """Repetition ``repeat`` (1-based): the list rotated by ``(repeat - 1) // 2``, reversed on
    even repetitions, so over each pair of repetitions every policy's mean position is the
    same and, over more, each one takes its turn first."""
    turn = ((repeat - 1) // 2) % len(policies)
    base = list(policies[turn:]) + list(policies[:turn])
    return base if repeat % 2 == 1 else base[::-1]


def mismatches(runs: Sequence[FleetRun]) -> dict[str, Any]:
    """Per policy, the prompt indexes whose text differs from the first run's text for that
    prompt (the first run is the reference; a failed request is a mismatch)."""
    if not runs:
        return {"reference": None, "compared": 0, "by_policy": {}}
    reference = runs[0]
    by_policy: dict[str, list[int]] = {}
    compared = 0
    for run in runs[1:]:
        bad = by_policy.setdefault(run.policy, [])
        for i, text in enumerate(run.texts):
            compared += 1
            expected = reference.texts[i] if i < len(reference.texts) else None
            if text is None or expected is None or text != expected:
                bad.append(i)
    by_policy.setdefault(reference.policy, [])
    return {
        "reference": {"policy": reference.policy, "repeat": reference.repeat},
        "compared": compared,
        "mismatched": sum(len(v) for v in by_policy.values()),
        "by_policy": {p: sorted(set(v)) for p, v in by_policy.items()},
    }


def _goal(ours: float | None, peer: float | None, factor: float, peer_name: str | None) -> Any:
    ratio = None if ours is None or peer is None or peer == 0 else ours / peer
    return {
        "goal": f"<= {factor} x {peer_name}",
        "kvstrata_ms": ours,
        "peer": peer_name,
        "peer_ms": peer,
        "ratio": ratio,
        "met": ratio is not None and ratio <= factor,
    }


def goals(medians: Mapping[str, Mapping[str, float | None]]) -> dict[str, Any]:
    """Issue 13 item 4's goals on the per-policy medians (``policy → figure → median``)."""
    out: dict[str, Any] = {}
    ours = medians.get("kvstrata", {})
    others = {p: m for p, m in medians.items() if p != "kvstrata"}
    for figure in ("ttft_p50_ms", "ttft_p99_ms"):
        rr = medians.get("round-robin", {}).get(figure)
        out[f"{figure}_vs_round_robin"] = _goal(
            ours.get(figure), rr, GOAL_VS_ROUND_ROBIN, "round-robin" if rr is not None else None
        )
        present: dict[str, float] = {
            p: value for p, m in others.items() if (value := m.get(figure)) is not None
        }
        best = min(present, key=lambda p: present[p]) if present else None
        out[f"{figure}_vs_best_other"] = _goal(
            ours.get(figure),
            present[best] if best is not None else None,
            GOAL_VS_BEST_OTHER,
            best,
        )
    return out


def summarize(runs: Sequence[FleetRun]) -> dict[str, Any]:
    """Per policy: each figure's median (the top-level value) and spread, per-server request
    counts per repetition; then the goals and the output comparison."""
    policies: dict[str, Any] = {}
    for policy in dict.fromkeys(r.policy for r in runs):
        mine = sorted((r for r in runs if r.policy == policy), key=lambda r: r.repeat)
        entry: dict[str, Any] = {}
        for figure in FIGURES:
            entry[figure] = spread([r.figures()[figure] for r in mine])["median"]
        entry["spread"] = {
            figure: spread([r.figures()[figure] for r in mine]) for figure in FIGURES
        }
        entry["requests_per_server"] = [
            {w: d.get("requests") for w, d in r.servers.items()} for r in mine
        ]
        entry["failed"] = [r.client.get("failed") for r in mine]
        policies[policy] = entry
    medians = {p: {f: e[f] for f in FIGURES} for p, e in policies.items()}
    checks = goals(medians)
    return {
        "policies": policies,
        "goals": checks,
        "goals_met": bool(checks) and all(g["met"] for g in checks.values()),
        "outputs": mismatches(runs),
        "runs": [r.to_dict() for r in runs],
    }
