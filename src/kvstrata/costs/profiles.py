"""Named prefill models, and where every constant comes from.

``smollm2_cpu`` — SmolLM2-135M fp32 on this project's 2-core CPU. Two reference timings
cannot pin three unknowns, so the ratio b / a is fixed from the architecture and ``a`` and
``t0`` are solved from the two timings:

* b / a = attention FLOPs per (new token, context token) / linear FLOPs per new token
  = (4 · hidden · layers) / (2 · params incl. the tied LM head)
  = (4 · 576 · 30) / (2 · 134.5 M) = 2.57e-4 for SmolLM2-135M (hidden 576, 30 layers,
  106.2 M non-embedding parameters + a 49,152 × 576 LM head);
* the timings (``docs/results-history.md``, ``kvstrata bench ttft``): a fresh 2,048-token prefill,
  3.9 s (the less contended end of the measured 3.9–6 s), and a 16-token forward over 2,032
  cached tokens, 0.14 s. Without ``t0`` these give a negative ``a`` (16 tokens cost 8.8 ms
  each, 2,048 tokens 1.9 ms each: the short forward is dominated by fixed cost).

``smollm2_cpu_worker`` — the same engine as one fleet worker that owns one core: one torch
thread pinned to it, as ``kvstrata up --workers 2 --pin-cpus`` runs two workers on two cores
(the ``reference-cpu`` simulator profile). Fitted (:func:`kvstrata.costs.fit`, the fleet's own
least-squares fit) to ten timings, not to two: measured on 2026-12-05 on a 2-core Intel Xeon
(Sapphire Rapids) with ``OMP_NUM_THREADS=1 taskset -c 0 kvstrata bench prefill --repeat 3
--points 16,64,128,256,512,1024,2048,2032+16,1536+512,512+256`` (fresh prefills of 16 to 2,048
tokens and three forwards after a hit; minimum of 3 each). Until 2026-12-05 it was fitted to
two timings with b / a fixed from the FLOP counts, as ``smollm2_cpu`` is (81 ms + 1.97 ms per
token + 0.51 µs per token²): that shape, and a machine running 1.18× faster than on the day
of those timings, priced a 400-token prompt 1.3× above what the fleet measured (``kvstrata
bench calibrate``'s ``measured`` fit). The curve's fit (54 ms + 1.52 ms per token + 0.66 µs
per token²) is within 7 % of every fresh length from 64 to 2,048 tokens. It still
under-prices a few new tokens after a long hit (16 after 2,032: 0.10 s for 0.15 s measured),
the paged gather that the three-term model does not have.

Other CPUs differ, so the worker's timings are kept per CPU family
(``SMOLLM2_WORKER_TIMINGS_BY_CPU``, chosen by :func:`cpu_family` from the CPU's model name):
``intel-xeon`` above (the default), and ``amd-epyc``, measured on 2026-12-06 on a 2-core AMD
EPYC with the same command: 29 ms + 2.57 ms per token + 1.13 µs per token², about 1.7× the
Xeon's per-token cost. Its fit is within 5 % of the fresh lengths from 128 to 2,048 tokens
but under-prices short prompts (64 tokens: 0.20 s for 0.23 s measured; 16: 0.07 s for 0.10
s). ``kvstrata bench calibrate`` simulates with the profile of the CPU it runs on and reports
the live fleet's own fit beside it.

``per_token`` — a base model without its attention term or overhead: every prompt token
costs the same, so maximising saved seconds maximises saved tokens (what ``bench eviction``
counts); also the regime of large models at moderate context.

``llama3_8b_h100`` — from published numbers, not a measurement here: Llama-3.1-8B (8.03 B
parameters, hidden 4,096, 32 layers, 8 KV heads of 128) in bf16 on one H100 SXM (989 TFLOP/s
dense bf16 peak) at an assumed ``mfu`` of peak (prefill of long prompts typically reaches
about half). Linear FLOPs 2 · params per token, attention FLOPs 4 · hidden · layers per
(token, context token); KV bytes per token 2 · 32 · 8 · 128 · 2 = 131,072.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Final

from kvstrata.costs.model import SMOLLM2_KV_BYTES_PER_TOKEN, PrefillModel, fit
from kvstrata.errors import InvalidInput

SMOLLM2_ATTENTION_TO_LINEAR: Final = (4 * 576 * 30) / (2 * (106_168_320 + 49_152 * 576))
"""b / a from FLOP counts of SmolLM2-135M (see the module docstring): about 2.57e-4."""

_REF_FRESH_TOKENS, _REF_FRESH_S = 2048, 3.9
_REF_STEP_TOKENS, _REF_STEP_CONTEXT, _REF_STEP_S = 16, 2032, 0.14
SMOLLM2_WORKER_TIMINGS: Final[tuple[tuple[int, int, float], ...]] = (
    (16, 0, 0.0978),
    (64, 0, 0.1534),
    (128, 0, 0.2413),
    (256, 0, 0.4384),
    (512, 0, 0.8935),
    (1024, 0, 1.9862),
    (2048, 0, 4.5529),
    (16, 2032, 0.1494),
    (512, 1536, 1.4213),
    (256, 512, 0.5334),
)
"""``(new_tokens, cached_tokens, seconds)`` of one pinned worker on the Intel Xeon (docstring),
2026-12-05."""
SMOLLM2_WORKER_TIMINGS_EPYC: Final[tuple[tuple[int, int, float], ...]] = (
    (16, 0, 0.1018),
    (64, 0, 0.2273),
    (128, 0, 0.3743),
    (256, 0, 0.6955),
    (512, 0, 1.4734),
    (1024, 0, 3.2177),
    (2048, 0, 7.7052),
    (16, 2032, 0.1650),
    (512, 1536, 2.3009),
    (256, 512, 0.8627),
)
"""The same points on the 2-core AMD EPYC (docstring), 2026-12-06."""
DEFAULT_CPU_FAMILY: Final = "intel-xeon"
"""The family whose timings ``reference-cpu`` uses, and any CPU without timings of its own."""
SMOLLM2_WORKER_TIMINGS_BY_CPU: Final[dict[str, tuple[tuple[int, int, float], ...]]] = {
    DEFAULT_CPU_FAMILY: SMOLLM2_WORKER_TIMINGS,
    "amd-epyc": SMOLLM2_WORKER_TIMINGS_EPYC,
}
"""One pinned worker's timings per CPU family (:func:`cpu_family`). A family is matched by
vendor line only (every Xeon gets the Sapphire Rapids timings): a coarse match, which is why
``bench calibrate`` also reports the CPU's full name."""
SMOLLM2_WORKER_DECODE_BY_CPU: Final[dict[str, tuple[float, float]]] = {
    "amd-epyc": (0.0624, 0.0104),
}
"""``(decode_step_base_s, decode_per_sequence_s)``: one pinned worker's decode-only steps,
``seconds = base + per_sequence · batch`` fitted to batches of 1, 2, 4 and 8 sequences of 512
prompt tokens (minimum of 9–10 steps each: 61, 97, 104, 144 ms), measured on 2026-12-07 on
the 2-core AMD EPYC with the prefill curve's command plus ``--decode 1,2,4,8``
(:mod:`kvstrata.bench.decode`); a second run gave 67 ms + 9.0 ms. A family without its own
(the Xeon) prices decode from its prefill fit (``sim.profiles.reference_cpu``), which on the
EPYC gave 29 ms + 3.7 ms: a one-sequence step at half its measured cost."""
_CPU_MARKERS: Final = {DEFAULT_CPU_FAMILY: "xeon", "amd-epyc": "epyc"}


def cpu_family(model_name: str) -> str | None:
    """The family in ``SMOLLM2_WORKER_TIMINGS_BY_CPU`` a CPU model name (``/proc/cpuinfo``'s
    ``model name``) belongs to; None when no timings were measured on such a CPU, or when the
    name matches more than one family."""
    lowered = model_name.lower()
    found = [family for family, marker in _CPU_MARKERS.items() if marker in lowered]
    return found[0] if len(found) == 1 else None


def _from_two_timings(
    name: str,
    fresh: tuple[int, float],
    step: tuple[int, int, float],
) -> PrefillModel:
    """A SmolLM2 model from a fresh prefill ``(tokens, s)`` and a short forward over a cached
    prefix ``(tokens, context, s)``, with b / a fixed from the architecture (docstring)."""
    ratio = SMOLLM2_ATTENTION_TO_LINEAR
    (fresh_tokens, fresh_s), (step_tokens, step_context, step_s) = fresh, step
    fresh_units = fresh_tokens * (1.0 + ratio * fresh_tokens / 2.0)
    step_units = step_tokens * (1.0 + ratio * (step_context + step_tokens / 2.0))
    per_token_s = (fresh_s - step_s) / (fresh_units - step_units)
    return PrefillModel(
        overhead_s=step_s - per_token_s * step_units,
        per_token_s=per_token_s,
        per_token_ctx_s=per_token_s * ratio,
        kv_bytes_per_token=SMOLLM2_KV_BYTES_PER_TOKEN,
        name=name,
    )


def smollm2_cpu() -> PrefillModel:
    """SmolLM2-135M fp32 on this machine's 2-core CPU, from the two reference timings."""
    return _from_two_timings(
        "smollm2-cpu",
        (_REF_FRESH_TOKENS, _REF_FRESH_S),
        (_REF_STEP_TOKENS, _REF_STEP_CONTEXT, _REF_STEP_S),
    )


def smollm2_cpu_worker(cpu: str = DEFAULT_CPU_FAMILY) -> PrefillModel:
    """SmolLM2-135M fp32 as a fleet worker owning one core of a ``cpu`` family CPU (see the
    module docstring); the Xeon's model keeps its original name."""
    try:
        timings = SMOLLM2_WORKER_TIMINGS_BY_CPU[cpu]
    except KeyError:
        known = ", ".join(SMOLLM2_WORKER_TIMINGS_BY_CPU)
        raise InvalidInput(f"no SmolLM2 worker timings for CPU {cpu!r} (known: {known})") from None
    suffix = "" if cpu == DEFAULT_CPU_FAMILY else f"-{cpu}"
    return fit(timings, name=f"smollm2-cpu-worker{suffix}")


DEFAULT_PREFILL_MODEL: Final = smollm2_cpu()
"""The reference engine's model until it is calibrated or refitted online."""


def per_token(base: PrefillModel = DEFAULT_PREFILL_MODEL) -> PrefillModel:
    """``base`` without its attention term and overhead (see the module docstring)."""
    return replace(base, per_token_ctx_s=0.0, overhead_s=0.0, name="per-token")


def llama3_8b_h100(mfu: float = 0.5) -> PrefillModel:
    """Llama-3.1-8B bf16 on one H100 SXM at ``mfu`` of peak (see the module docstring)."""
    flops_per_s = 989e12 * mfu
    return PrefillModel(
        overhead_s=0.0,
        per_token_s=2 * 8.03e9 / flops_per_s,
        per_token_ctx_s=4 * 4096 * 32 / flops_per_s,
        kv_bytes_per_token=2 * 32 * 8 * 128 * 2,
        name="llama3-8b-h100",
    )


PROFILES: Final[dict[str, Callable[[], PrefillModel]]] = {
    "smollm2-cpu": smollm2_cpu,
    "smollm2-cpu-worker": smollm2_cpu_worker,
    "per-token": per_token,
    "llama3-8b-h100": llama3_8b_h100,
}
"""Prefill models by name, for the command line."""
