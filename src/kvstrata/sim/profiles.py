"""Calibrated worker cost models for the simulator, and where every constant comes from.

A :class:`SimProfile` is what one simulated worker costs and holds: the router's
:class:`~kvstrata.router.costs.CostProfile` (prefill model, per-block fetch time by tier,
decode step model, prefill chunk size — the *same object* is handed to the router's TTFT
estimator, so the kvstrata policy prices requests with the model the simulator executes),
the KV bytes of one 512-token block, and default per-worker capacities in blocks.

Block size is 512 tokens because the Mooncake-format traces name 512-token blocks; the
reference engine itself pages 16-token blocks, which only changes granularity.

``gpu-a100-8b`` (default; the Mooncake trace is only realistic at GPU speeds). Nothing here
was measured on a GPU; it is derived from spec sheets and the model shape, with the two
efficiency assumptions named:

* Model: Llama-3.1-8B in bf16 (8.03 B parameters, 32 layers, hidden 4,096, 8 KV heads of
  128; Meta's model card / ``config.json``). KV bytes per token = 2 · 32 · 8 · 128 · 2 =
  131,072, so one 512-token block is 64 MiB.
* GPU: A100-SXM4-80GB, 312 TFLOP/s dense bf16 and 2,039 GB/s HBM2e (NVIDIA A100 datasheet).
* Prefill: linear FLOPs 2 · params per token, attention FLOPs 4 · hidden · layers per (new
  token, context token), at an assumed 50% MFU (prefill of long prompts is compute-bound;
  Sarathi-Serve, Agrawal et al. OSDI 2024, and DistServe, Zhong et al. OSDI 2024, treat it
  so): 103 µs per token (≈ 9.7k tokens/s), 3.36 ns per token² of attention; 10 ms fixed per
  forward (scheduling, launch, sampling — an assumption).
* Decode step ``a + b · batch``: ``a`` = reading the 16.06 GB of weights at an assumed 80%
  of HBM bandwidth = 9.8 ms; ``b`` = reading one sequence's KV at the conversation trace's
  mean context (≈ 12.2k tokens · 131,072 B = 1.6 GB) at the same bandwidth ≈ 1.0 ms.
* Chunked prefill of 2,048 tokens per iteration (vLLM's long-standing
  ``max_num_batched_tokens`` default with chunked prefill; Sarathi-Serve's chunk range).
* Host → device: PCIe Gen4 x16 at an assumed 25 GB/s achieved (32 GB/s theoretical):
  2.7 ms per 64 MiB block, ~20× cheaper than recomputing the block (53 ms).
* Capacities: vLLM's ``gpu_memory_utilization = 0.9`` of 80 GB = 72 GB, minus 16.06 GB of
  weights and ~4 GB of activations / CUDA graphs ≈ 52 GB of KV pool = 768 blocks (393k
  tokens); host DRAM tier 4× that, 3,072 blocks = 201 GiB per GPU (1.6 TiB per 8-GPU node).

``reference-cpu``: this project's reference engine (SmolLM2-135M, fp32, torch) as a fleet
worker that owns one CPU core (``kvstrata up --workers 2 --pin-cpus`` on the 2-core machine:
each worker one core, one torch thread), from the measurements in ``kvstrata.costs.profiles``:

* Prefill: ``kvstrata.costs.smollm2_cpu_worker()`` — the three-term model fitted to ten
  ``kvstrata bench prefill`` timings of one worker pinned to one core (fresh prefills of 16
  to 2,048 tokens, three forwards after a hit; 2026-12-05, Intel Xeon): 54 ms fixed, 1.52 ms
  per token, 0.66 µs per token². ``reference-cpu-epyc`` is the same profile with the timings
  of a 2-core AMD EPYC (2026-12-06): 29 ms, 2.57 ms per token, 1.13 µs per token². Only the
  prefill fit and the decode terms are the EPYC's: its fetch figures are the Xeon's.
  (Until 2026-12-02 this profile used ``smollm2_cpu()``, one engine
  owning both cores: a 2-worker fleet runs each prefill about 3× slower than that, and
  ``bench calibrate`` found the simulator 0.3× the live fleet; until 2026-12-05 two timings
  with the FLOP-count ratio, which overpriced short prompts.)
* Decode step of ``n`` sequences alone: ``a + b · n``. On the EPYC measured
  (``kvstrata.costs.profiles.SMOLLM2_WORKER_DECODE_BY_CPU``, ``bench prefill --decode``): 62 ms +
  10.4 ms per sequence. On the Xeon, not measured, derived from its prefill fit: ``a`` = its
  fixed cost per forward, ``b`` = the per-token cost + attention over ~1k context tokens; on
  the EPYC that derivation gave 29 ms + 3.7 ms, half a measured one-sequence step (61 ms).
  A prefill chunk that runs beside ``n`` decodes costs ``b · n`` more, not a whole decode
  step more (``CostProfile.decode_rides_prefill``): the engine packs a step's prefill chunk
  and its decode tokens into one forward, as a live fleet's step trace showed (mixed steps
  cost the prefill model's price plus ~12 ms per decode row).
* KV bytes per token 46,080 (fp32, 30 layers, 3 KV heads of 64): 23.6 MB per block;
  host → device at 12.15 GB/s (``kvstrata bench tiers`` host get): 1.94 ms per block;
  disk 14.5 GB/s (page cache warm).
* Capacities (an assumption sized for small synthetic traces): 64 device blocks (1.5 GB),
  256 host blocks.

``dynamo-mocker``: NVIDIA Dynamo's simulated vLLM engine ("mocker", ai-dynamo 1.6.1) with its
default configuration, so ``kvstrata sim`` can be checked against Dynamo's own trace replay
(:mod:`kvstrata.sim.dynamo_compare`). Sources: ``dynamo.mocker.config.normalize_mocker_config()``
of the installed 1.6.1 wheel (engine defaults) and the polynomial timing model,
``ai-dynamo/aisimulate`` ``crates/core/src/engine/common/perf_model.rs``
(``polynomial_prefill_time`` / ``polynomial_decode_time``; the 1.6.1 mocker delegates its
``Polynomial`` model there, ``ai-dynamo/dynamo`` ``lib/mocker/src/common/perf_model.rs`` @
0894f5c); the coefficients were checked against the 1.6.1 binary by probing its replay with
one-request traces (figures below). Matched:

* Prefill: ``16.50142 + 1.518344e-2 · T + 4.209989e-7 · T²`` ms per scheduler iteration of
  ``T`` new tokens, iterations of at most 8,192 tokens (``max_num_batched_tokens``), the cached
  prefix free (:class:`ChunkedPolynomialPrefill`; probed: a lone 12,000-token request takes
  249.6 ms in the replay and here, a 524-token suffix after 11,776 cached tokens 24.6 ms).
  An iteration that also carries decodes takes the decode step on top (probed: +16 ms over
  two chunks beside one decode), which ``CostProfile.interference_s`` charges per chunk.
* Decode step: ``-25.74 p² + 54.01 p + 5.74`` ms (≥ 1 ms), ``p`` = active KV tokens ÷ the
  pool's tokens; linearised at small ``p`` (the trace keeps ``p`` < 0.2) as 5.74 ms + 54.01 ms
  · (mean context 12,035 tokens of the conversation trace ÷ 1,048,576) ≈ 0.62 ms per sequence.
* Chunked prefill with ``max_num_batched_tokens`` = 8,192 (the mocker's vLLM default).
* Pool: 16,384 blocks of 64 tokens = 1,048,576 tokens per worker = 2,048 of our 512-token
  blocks; no host tier (the mocker offloads nothing by default); LRU eviction
  (``kv_eviction_policy: lru`` in the replay summary).

Not matched (the simulator's worker model, :mod:`kvstrata.sim.worker`): the mocker packs
the tail of one prefill and the head of the next into one 8,192-token iteration (two
12,000-token requests arriving together finish at 338 / 495 ms there, 250 / 499 ms here: ours
packs only prompts that fit whole in a step beside the head's);
the decode step is linearised; reuse is counted in 64-token blocks there and full 512-token
trace blocks here (on the conversation trace the infinite-cache reuse differs by 0.0002).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Final

from kvstrata.costs import SMOLLM2_KV_BYTES_PER_TOKEN, PrefillModel, smollm2_cpu_worker
from kvstrata.costs.profiles import DEFAULT_CPU_FAMILY, SMOLLM2_WORKER_DECODE_BY_CPU, cpu_family
from kvstrata.errors import InvalidInput
from kvstrata.router.costs import CostProfile

BLOCK_TOKENS: Final = 512
"""Tokens per block in the simulator (the Mooncake trace's block size)."""


@dataclass(frozen=True, slots=True)
class SimProfile:
    """One worker's cost model and default capacities (see the module docstring)."""

    name: str
    cost: CostProfile
    kv_bytes_per_token: int
    device_blocks: int
    host_blocks: int

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * BLOCK_TOKENS

    def with_capacities(self, device_blocks: int | None, host_blocks: int | None) -> SimProfile:
        return replace(
            self,
            device_blocks=self.device_blocks if device_blocks is None else device_blocks,
            host_blocks=self.host_blocks if host_blocks is None else host_blocks,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkedPolynomialPrefill(PrefillModel):
    """The mocker's prefill: one polynomial per scheduler iteration of ≤ ``chunk_tokens``.

    ``seconds(new, cached)`` = Σ over the ``ceil(new / chunk_tokens)`` chunks ``c`` of
    ``overhead_s + per_token_s · c + per_token_ctx_s · c²/2``; the cached prefix costs
    nothing (Dynamo's polynomial takes only new tokens). Probed against the 1.6.1 replay: one
    12,000-token request alone takes 249.6 ms there (= poly(8,192) + poly(3,808)) and here.
    """

    chunk_tokens: int = 8192

    def seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return self.overhead_s
        full, rest = divmod(new_tokens, self.chunk_tokens)
        total = full * self._chunk_s(self.chunk_tokens)
        return total + (self._chunk_s(rest) if rest else 0.0)

    def marginal_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        return self.seconds(new_tokens, cached_tokens) - self.overhead_s

    def _chunk_s(self, tokens: int) -> float:
        return (
            self.overhead_s
            + tokens * self.per_token_s
            + tokens * tokens / 2.0 * (self.per_token_ctx_s)
        )


def _fetch_s(block_bytes: int, *bandwidths: float) -> tuple[float, float, float, float]:
    host, disk, remote = (block_bytes / bw for bw in bandwidths)
    return (0.0, host, disk, remote)


def gpu_a100_8b() -> SimProfile:
    """Llama-3.1-8B bf16 on one A100-80GB, from published figures (module docstring)."""
    kv_bytes = 2 * 32 * 8 * 128 * 2
    flops_per_s = 0.5 * 312e12
    hbm_bytes_per_s = 0.8 * 2.039e12
    block_bytes = kv_bytes * BLOCK_TOKENS
    cost = CostProfile(
        prefill=PrefillModel(
            overhead_s=0.010,
            per_token_s=2 * 8.03e9 / flops_per_s,
            per_token_ctx_s=4 * 4096 * 32 / flops_per_s,
            kv_bytes_per_token=kv_bytes,
            name="llama3.1-8b-a100",
        ),
        # host: PCIe Gen4 ~25 GB/s; disk: NVMe ~6 GB/s; remote: 100 Gb/s RDMA ~10 GB/s.
        fetch_s_per_block=_fetch_s(block_bytes, 25e9, 6e9, 10e9),
        decode_interference_s=12_200 * kv_bytes / hbm_bytes_per_s,
        decode_step_base_s=16.06e9 / hbm_bytes_per_s,
        prefill_chunk_tokens=2048,
        block_size=BLOCK_TOKENS,
    )
    return SimProfile("gpu-a100-8b", cost, kv_bytes, device_blocks=768, host_blocks=3072)


REFERENCE_CPU: Final = {DEFAULT_CPU_FAMILY: "reference-cpu", "amd-epyc": "reference-cpu-epyc"}
"""The ``reference-cpu`` profile of each CPU family with measured worker timings
(``kvstrata.costs.profiles.SMOLLM2_WORKER_TIMINGS_BY_CPU``: the same keys)."""


def reference_for(cpu_model: str) -> tuple[str, str | None]:
    """The reference profile for a CPU model name, and its family (None: no timings of its
    own, or an ambiguous name: the default family's profile)."""
    family = cpu_family(cpu_model)
    return REFERENCE_CPU[family or DEFAULT_CPU_FAMILY], family


def reference_cpu(cpu: str = DEFAULT_CPU_FAMILY) -> SimProfile:
    """SmolLM2-135M fp32, one fleet worker owning one core of a ``cpu`` family CPU, from this
    project's measurements (``reference-cpu`` is the Xeon's, ``reference-cpu-epyc`` the EPYC's)."""
    prefill = smollm2_cpu_worker(cpu)
    block_bytes = SMOLLM2_KV_BYTES_PER_TOKEN * BLOCK_TOKENS
    base, per_sequence = SMOLLM2_WORKER_DECODE_BY_CPU.get(
        cpu, (prefill.overhead_s, prefill.per_token_s + prefill.per_token_ctx_s * 1024)
    )
    cost = CostProfile(
        prefill=prefill,
        fetch_s_per_block=_fetch_s(block_bytes, 12.15e9, 14.5e9, 1.0e9),
        decode_interference_s=per_sequence,
        decode_step_base_s=base,
        prefill_chunk_tokens=2048,
        block_size=BLOCK_TOKENS,
        decode_rides_prefill=True,
    )
    return SimProfile(
        REFERENCE_CPU[cpu], cost, SMOLLM2_KV_BYTES_PER_TOKEN, device_blocks=64, host_blocks=256
    )


DYNAMO_MOCKER_POOL_TOKENS: Final = 16_384 * 64
"""The mocker's default KV pool per worker: 16,384 blocks of 64 tokens (vLLM backend)."""


def dynamo_mocker() -> SimProfile:
    """Dynamo 1.6.1's mocker (vLLM backend, polynomial timing, defaults); module docstring."""
    kv_bytes = 2 * 32 * 8 * 128 * 2  # any shape: no tier fetches are priced without a host tier
    block_bytes = kv_bytes * BLOCK_TOKENS
    mean_context_tokens = 12_035  # conversation trace: 144,793,823 input tokens / 12,031 requests
    cost = CostProfile(
        prefill=ChunkedPolynomialPrefill(
            overhead_s=16.50142e-3,
            per_token_s=1.518344e-5,
            per_token_ctx_s=2 * 4.209989e-10,
            kv_bytes_per_token=kv_bytes,
            name="dynamo-mocker-polynomial",
            chunk_tokens=8192,
        ),
        fetch_s_per_block=_fetch_s(block_bytes, 25e9, 6e9, 10e9),
        decode_interference_s=54.01e-3 * mean_context_tokens / DYNAMO_MOCKER_POOL_TOKENS,
        decode_step_base_s=5.74e-3,
        prefill_chunk_tokens=8192,
        block_size=BLOCK_TOKENS,
    )
    return SimProfile(
        "dynamo-mocker",
        cost,
        kv_bytes,
        device_blocks=DYNAMO_MOCKER_POOL_TOKENS // BLOCK_TOKENS,
        host_blocks=0,
    )


PROFILES: Final[dict[str, Callable[[], SimProfile]]] = {
    "gpu-a100-8b": gpu_a100_8b,
    "reference-cpu": reference_cpu,
    "reference-cpu-epyc": lambda: reference_cpu("amd-epyc"),
    "dynamo-mocker": dynamo_mocker,
}


def profile(name: str) -> SimProfile:
    if name not in PROFILES:
        raise InvalidInput(f"unknown sim profile {name!r}; expected one of {sorted(PROFILES)}")
    return PROFILES[name]()
