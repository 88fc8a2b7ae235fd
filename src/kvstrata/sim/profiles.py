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

``reference-cpu``: this project's reference engine (SmolLM2-135M, fp32, torch on the 2-core
CPU), from the measurements in ``docs/results.md`` and ``kvstrata.costs.profiles``:

* Prefill: ``kvstrata.costs.smollm2_cpu()`` — fitted to ``kvstrata bench ttft``'s fresh
  2,048-token prefill (3.9 s) and a 16-token forward over 2,032 cached tokens (0.14 s), with
  the attention/linear ratio from the architecture's FLOP counts: 104 ms fixed, 1.47 ms per
  token, 0.377 µs per token².
* Decode step: ``a`` = that fit's fixed 104 ms per forward, ``b`` = one more token in the
  batch = 1.47 ms + attention over ~1k context tokens ≈ 1.86 ms (same fit; the reference
  engine itself does not batch decodes, so this describes a batched engine at its speed).
* KV bytes per token 46,080 (fp32, 30 layers, 3 KV heads of 64): 23.6 MB per block;
  host → device at 12.15 GB/s (``kvstrata bench tiers`` host get): 1.94 ms per block;
  disk 14.5 GB/s (page cache warm).
* Capacities (an assumption sized for small synthetic traces): 64 device blocks (1.5 GB),
  256 host blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Final

from kvstrata.costs import SMOLLM2_KV_BYTES_PER_TOKEN, PrefillModel, smollm2_cpu
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


def reference_cpu() -> SimProfile:
    """SmolLM2-135M fp32 on this 2-core CPU, from this project's measurements."""
    prefill = smollm2_cpu()
    block_bytes = SMOLLM2_KV_BYTES_PER_TOKEN * BLOCK_TOKENS
    cost = CostProfile(
        prefill=prefill,
        fetch_s_per_block=_fetch_s(block_bytes, 12.15e9, 14.5e9, 1.0e9),
        decode_interference_s=prefill.per_token_s + prefill.per_token_ctx_s * 1024,
        decode_step_base_s=prefill.overhead_s,
        prefill_chunk_tokens=2048,
        block_size=BLOCK_TOKENS,
    )
    return SimProfile(
        "reference-cpu", cost, SMOLLM2_KV_BYTES_PER_TOKEN, device_blocks=64, host_blocks=256
    )


PROFILES: Final[dict[str, Callable[[], SimProfile]]] = {
    "gpu-a100-8b": gpu_a100_8b,
    "reference-cpu": reference_cpu,
}


def profile(name: str) -> SimProfile:
    if name not in PROFILES:
        raise InvalidInput(f"unknown sim profile {name!r}; expected one of {sorted(PROFILES)}")
    return PROFILES[name]()
