"""What ``kvstrata bench serving`` reports, computed from its client runs (pure, no I/O).

A ``RunRecord`` is one client run against one freshly started server: its phase
(``saturating`` or ``half``), repetition, side (``kvstrata`` or ``vllm``), the figures kept from
``vllm.benchmarks.serve``'s result and the generated texts. ``summarize`` turns the records into
the report: per side and phase, each figure's median/min/max over the repetitions; each ratio
(kvstrata ÷ vLLM) of the medians, with the min/max of the per-repetition ratios as its spread
(the two runs of a repetition are adjacent in time, so drift of a shared machine cancels); the
goals and whether each is met (a missing value never meets a goal); and the share of requests
whose text is the same on both sides, over every pair of runs of the same phase and repetition
(same dataset seed, so the same prompts in the same order; a failed request counts as unequal).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstrata.errors import InvalidInput

SIDES = ("kvstrata", "vllm")
PHASES = ("saturating", "half")
FIGURES = ("request_throughput", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")
RATIOS: Mapping[str, tuple[str, str]] = {  # name → (phase, figure)
    "throughput_ratio": ("saturating", "request_throughput"),
    "ttft_p50_ratio": ("half", "ttft_p50_ms"),
    "ttft_p99_ratio": ("half", "ttft_p99_ms"),
    "tpot_ratio": ("half", "tpot_p50_ms"),
}
GOALS: Mapping[str, tuple[str, float]] = {
    "throughput_ratio": (">=", 0.8),
    "ttft_p50_ratio": ("<=", 1.0),
    "tpot_ratio": ("<=", 1.5),
}


# ---- one client run ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RunRecord:
    phase: str
    repeat: int
    side: str
    request_rate: float
    figures: dict[str, Any]
    texts: list[str | None] = field(repr=False)  # None: the request failed
    server_ready_s: float = 0.0
    server_kv: str | None = None  # what the server's log says about its KV memory

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (rate ``inf`` as the string ``"inf"``), without the texts."""
        rate: float | str = "inf" if math.isinf(self.request_rate) else self.request_rate
        return {
            "phase": self.phase,
            "repeat": self.repeat,
            "side": self.side,
            "request_rate": rate,
            "figures": self.figures,
            "server_ready_s": self.server_ready_s,
            "server_kv": self.server_kv,
        }


def run_figures(result: Mapping[str, Any]) -> dict[str, Any]:
    """The fields kept from ``vllm.benchmarks.serve.main``'s result."""
    return {
        "request_throughput": result.get("request_throughput"),
        "ttft_p50_ms": result.get("median_ttft_ms"),
        "ttft_p99_ms": result.get("p99_ttft_ms"),
        "tpot_p50_ms": result.get("median_tpot_ms"),
        "e2el_p50_ms": result.get("median_e2el_ms"),
        "output_throughput": result.get("output_throughput"),
        "completed": result.get("completed"),
        "failed": result.get("failed"),
        "duration_s": result.get("duration"),
        "total_input_tokens": result.get("total_input_tokens"),
        "total_output_tokens": result.get("total_output_tokens"),
    }


def run_texts(result: Mapping[str, Any]) -> list[str | None]:
    texts = list(result.get("generated_texts") or [])
    errors = list(result.get("errors") or [""] * len(texts))
    return [None if error else text for text, error in zip(texts, errors, strict=True)]


# ---- aggregation (pure) -----------------------------------------------------------------------
def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, min and max of the values that exist (``None`` where none does)."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "values": list(values)}
    return {
        "median": statistics.median(present),
        "min": min(present),
        "max": max(present),
        "values": list(values),
    }


def ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def goal_met(value: float | None, op: str, target: float) -> bool:
    if value is None:
        return False
    return value >= target if op == ">=" else value <= target


def equal_outputs(ours: Sequence[str | None], theirs: Sequence[str | None]) -> tuple[int, int]:
    """(requests whose text is the same on both sides, requests compared)."""
    if len(ours) != len(theirs):
        raise InvalidInput(f"{len(ours)} vs {len(theirs)} outputs: not the same requests")
    same = sum(1 for a, b in zip(ours, theirs, strict=True) if a is not None and a == b)
    return same, len(ours)


def saturating_rate(runs: Sequence[RunRecord]) -> float:
    """vLLM's median req/s in the saturating phase."""
    figures = spread(
        [
            r.figures["request_throughput"]
            for r in runs
            if (r.phase, r.side) == ("saturating", "vllm")
        ]
    )
    if figures["median"] is None or figures["median"] <= 0:
        raise InvalidInput("vLLM completed no request in the saturating phase")
    return float(figures["median"])


def _pick(runs: Sequence[RunRecord], phase: str, side: str) -> list[RunRecord]:
    return sorted((r for r in runs if (r.phase, r.side) == (phase, side)), key=lambda r: r.repeat)


def summarize(runs: Sequence[RunRecord], repeats: int) -> dict[str, Any]:
    """The ratios with their spread and goals, per-side figures, output agreement."""
    sides: dict[str, Any] = {}
    for side in SIDES:
        sides[side] = {
            phase: {
                fig: spread([r.figures.get(fig) for r in _pick(runs, phase, side)])
                for fig in (*FIGURES, "failed")
            }
            for phase in PHASES
        }
    out: dict[str, Any] = {}
    ratio_spread: dict[str, Any] = {}
    for name, (phase, fig) in RATIOS.items():
        out[name] = ratio(
            sides["kvstrata"][phase][fig]["median"], sides["vllm"][phase][fig]["median"]
        )
        paired = zip(_pick(runs, phase, "kvstrata"), _pick(runs, phase, "vllm"), strict=False)
        per_repeat = [ratio(k.figures.get(fig), v.figures.get(fig)) for k, v in paired]
        ratio_spread[name] = {"phase": phase, "figure": fig} | spread(per_repeat)
    same = compared = 0
    for phase in PHASES:
        for ours, theirs in zip(
            _pick(runs, phase, "kvstrata"), _pick(runs, phase, "vllm"), strict=False
        ):
            s, c = equal_outputs(ours.texts, theirs.texts)
            same, compared = same + s, compared + c
    out["outputs_equal_share"] = same / compared if compared else None
    goals = {
        name: {"goal": f"{op} {target}", "value": out[name], "met": goal_met(out[name], op, target)}
        for name, (op, target) in GOALS.items()
    }
    return out | {
        "goals": goals,
        "goals_met": all(g["met"] for g in goals.values()),
        "ratio_spread": ratio_spread,
        "outputs_compared": compared,
        "outputs_equal": same,
        "repeats": repeats,
        "kvstrata": sides["kvstrata"],
        "vllm": sides["vllm"],
    }
