"""The inputs of ``router.disagg.choose`` from what a fleet knows (pure: figures passed in).

The front door (``fleet.disagg``) and ``kvstrata bench disagg`` price a request the same way,
through :func:`disagg_cost`:

- prompt tokens and the tokens cached on each side (the global index's match);
- each worker's wait before this request's prefill starts (the predicted prefills queued
  ahead of it: the reference engine batches a new prefill with running decodes, it does not
  wait for them to finish), the decode worker's running decodes, and each worker's
  ``CostProfile`` (its online prefill fit) — the router's own live figures;
- KV bytes per token from the decode worker's advertised ``KVLayout`` (``/kv/info``
  ``transfer.layout``: one block's bytes over its tokens);
- the link (bytes/s as measured or configured, a fixed latency) and the conversion plan's
  throughput (0: identity);
- ``ι``, the seconds one prefill step adds to a running decode's step: the decode worker's
  learned decode step (a prefill step is at least one step of its batch);
- whether the two workers share compute (``router.placement.shares_compute`` of their
  ``/kv/info`` ``compute`` entries).

:class:`InterferenceEstimate` learns what running decodes add to a prefill on a worker
(``CostProfile.decode_interference_s``, per running decode) from TTFTs measured while decodes
ran: ``(ttft − predicted prefill alone) / active``, smoothed. No clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvstrata.router.costs import CostProfile
from kvstrata.router.disagg import DisaggCost
from kvstrata.transfer.layout import KVLayout


def kv_bytes_per_token(layout: KVLayout) -> int:
    """Bytes one token's KV takes in ``layout`` (all layers, K and V, every head of the rank)."""
    return max(1, layout.block_bytes() // layout.block_size)


@dataclass(frozen=True, slots=True)
class Link:
    bytes_per_s: float
    latency_s: float = 0.0
    source: str = "measured"  # "measured" (raw_socket_gbps at start) or "configured"


def disagg_cost(
    *,
    prompt_tokens: int,
    decode_cached_tokens: int,
    prefill_cached_tokens: int,
    decode_queue_s: float,
    prefill_queue_s: float,
    active_decodes: int,
    decode_profile: CostProfile,
    prefill_profile: CostProfile,
    layout: KVLayout,
    link: Link,
    decode_step_s: float,
    conversion_bytes_per_s: float = 0.0,
    shared_compute: bool = False,
) -> DisaggCost:
    """One request's ``DisaggCost`` from the fleet's figures (module docstring)."""
    step = decode_step_s if math.isfinite(decode_step_s) and decode_step_s > 0 else 0.0
    return DisaggCost(
        prompt_tokens=prompt_tokens,
        decode_cached_tokens=max(0, decode_cached_tokens),
        prefill_cached_tokens=max(0, prefill_cached_tokens),
        decode_queue_s=max(0.0, decode_queue_s),
        prefill_queue_s=max(0.0, prefill_queue_s),
        decode_profile=decode_profile,
        prefill_profile=prefill_profile,
        kv_bytes_per_token=kv_bytes_per_token(layout),
        num_layers=layout.num_layers,
        link_bytes_per_s=link.bytes_per_s,
        transfer_latency_s=max(0.0, link.latency_s),
        conversion_bytes_per_s=conversion_bytes_per_s,
        active_decodes=max(0, active_decodes),
        prefill_step_interference_s=step,
        shared_compute=shared_compute,
    )


class InterferenceEstimate:
    """What each running decode adds to each prefill step on one worker (seconds), learned.

    The worker schedules chunked prefill (``prefill_chunk_tokens`` per step, the scheduler's
    token budget; 0: unchunked), so a prefill of ``n`` tokens beside ``A`` decodes takes
    ``steps(n)`` steps, each ``ι_A · A`` longer than alone: the ``CostProfile`` chunked rule
    with ``decode_interference_s = ι_A``, the decodes riding in the prefill's own steps
    (``decode_rides_prefill``: no base step, it is in the alone fit already).

    Not thread-safe: owned by whoever owns the worker's state (the fleet lock, the bench's
    single thread)."""

    def __init__(self, chunk_tokens: int, initial_s: float = 0.0, weight: float = 0.3) -> None:
        self.chunk_tokens = max(0, chunk_tokens)
        self.value_s = max(0.0, initial_s)
        self.samples = 0
        self._weight = weight

    def _steps(self, new_tokens: int) -> int:
        chunk = self.chunk_tokens
        return -(-max(new_tokens, 1) // chunk) if chunk > 0 else 1

    def observe(
        self, ttft_s: float, predicted_alone_s: float, new_tokens: int, active_decodes: int
    ) -> None:
        """One TTFT measured while ``active_decodes`` decodes ran (ignored when none did)."""
        if active_decodes <= 0 or not (math.isfinite(ttft_s) and math.isfinite(predicted_alone_s)):
            return
        extra = max(0.0, ttft_s - predicted_alone_s)
        per_decode = extra / (active_decodes * self._steps(new_tokens))
        if self.samples == 0:
            self.value_s = per_decode
        else:
            self.value_s += self._weight * (per_decode - self.value_s)
        self.samples += 1

    def apply(self, profile: CostProfile) -> CostProfile:
        """``profile`` priced with this estimate under the chunked rule."""
        return replace(
            profile,
            decode_interference_s=self.value_s,
            prefill_chunk_tokens=self.chunk_tokens,
            decode_rides_prefill=True,
        )


class OverheadEstimate:
    """The disaggregated path's fixed cost the formula does not see (HTTP, handshake, commit,
    the received blocks' promotion on the decode worker): measured TTFT minus the prediction
    made with no latency, smoothed and clipped at 0; used as ``Link.latency_s``. Not
    thread-safe (one owner)."""

    def __init__(self, weight: float = 0.5) -> None:
        self.value_s = 0.0
        self.samples = 0
        self._weight = weight

    def observe(self, measured_s: float, predicted_without_latency_s: float) -> None:
        if not (math.isfinite(measured_s) and math.isfinite(predicted_without_latency_s)):
            return
        gap = max(0.0, measured_s - predicted_without_latency_s)
        self.value_s = (
            gap if self.samples == 0 else self.value_s + self._weight * (gap - self.value_s)
        )
        self.samples += 1
