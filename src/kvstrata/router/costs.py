"""What a worker's time to first token is made of, besides the prefill forward itself.

``CostProfile`` holds one worker's cost figures: its prefill model
(:class:`kvstrata.costs.PrefillModel`, the same class the engine, the eviction policies and
the simulator use; the live router refits it per worker with
:class:`kvstrata.costs.OnlinePrefillFit` from the time-to-first-token of the requests the
worker served), the per-block fetch time by tier, and the decode-step model that running
decodes add to a prefill (unchunked or chunked).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

from kvstrata.costs import PrefillModel

MEDIA: Final = 4  # device, host, disk, remote (kvstrata.index.Medium order)

GENERIC_PREFILL: Final = PrefillModel(overhead_s=0.01, per_token_s=1e-4, name="generic")
"""The default of a ``CostProfile`` built without a prefill model: 10 ms + 0.1 ms per token."""


@dataclass(frozen=True, slots=True)
class CostProfile:
    """One worker's cost figures: prefill model, per-block fetch seconds by tier, decode cost.

    ``fetch_s_per_block[m]`` is what it costs to bring one block from medium ``m`` into the
    device pool (0 for the device itself); ``decode_interference_s`` is the prefill slow-down
    each running decode adds (they share the forward passes).

    Chunked prefill (``prefill_chunk_tokens > 0``, as vLLM and Sarathi-Serve schedule it): a
    prefill of ``n`` new tokens runs as ``ceil(n / chunk)`` iterations, each of which also
    runs one decode step of the worker's batch, ``decode_step_base_s +
    decode_interference_s · active_decodes``; with no decode running nothing is added.
    ``prefill_chunk_tokens = 0`` keeps the unchunked rule ``active · decode_interference_s``.
    ``decode_rides_prefill``: the engine computes a chunk and its iteration's decode tokens
    in one forward (the reference engine packs every row of a step), so a chunk pays only
    ``decode_interference_s · active_decodes`` more, not a second fixed cost; a step of
    decodes alone still pays ``decode_step_base_s``.
    """

    prefill: PrefillModel = GENERIC_PREFILL
    fetch_s_per_block: tuple[float, float, float, float] = (0.0, 2e-4, 1e-3, 4e-3)
    decode_interference_s: float = 0.0
    block_size: int = 16
    decode_step_base_s: float = 0.0
    prefill_chunk_tokens: int = 0
    decode_rides_prefill: bool = False

    def fetch_s(self, tier_blocks: tuple[int, int, int, int]) -> float:
        return sum(n * s for n, s in zip(tier_blocks, self.fetch_s_per_block, strict=True))

    def decode_step_s(self, active_decodes: int) -> float:
        """One decode iteration of a batch of ``active_decodes`` sequences."""
        return self.decode_step_base_s + self.decode_interference_s * active_decodes

    def interference_s(self, new_tokens: int, active_decodes: int) -> float:
        """What running decodes add to a prefill of ``new_tokens`` (see the class docstring)."""
        if active_decodes <= 0:
            return 0.0
        if self.prefill_chunk_tokens <= 0:
            return active_decodes * self.decode_interference_s
        chunks = -(-max(new_tokens, 1) // self.prefill_chunk_tokens)
        if self.decode_rides_prefill:
            return chunks * active_decodes * self.decode_interference_s
        return chunks * self.decode_step_s(active_decodes)

    def with_prefill(self, prefill: PrefillModel) -> CostProfile:
        return replace(self, prefill=prefill)
