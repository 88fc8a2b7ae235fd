"""The qualified local path: prefill on the decode worker, or remote prefill + KV transfer?

Pure (no clock, no I/O, nothing of the store): every figure is passed in — queue estimates
already in seconds, the prefill fits of both workers (their ``CostProfile``, whose
``PrefillModel`` the live router refits per worker with ``OnlinePrefillFit``), the link
bandwidth as measured, the conversion plan's throughput. One implementation of the formula
below; ``choose`` applies it and explains its choice.

Notation: ``P`` prompt tokens; ``c_D``, ``c_P`` tokens cached on the decode / prefill worker,
each clipped to ``[0, P − 1]`` (the last prompt token is always computed); ``q_D``, ``q_P``
their queue estimates; ``S_D(n, c)``, ``S_P(n, c)`` their ``PrefillModel.seconds``;
``I_D(n)`` what the decode worker's ``A`` running decodes add to a prefill of ``n`` tokens
there (``CostProfile.interference_s``, the router's existing rule); ``ι`` the seconds one
prefill step adds to each running decode's step on the decode worker and ``steps(n)`` the
steps a prefill of ``n`` tokens takes there (``ceil(n / chunk)``, 1 unchunked); ``w`` the
weight of a second of delay to a running decode against a second of this request's TTFT.

Local::

    n_D          = P − c_D
    ttft_local   = q_D + S_D(n_D, c_D) + I_D(n_D)
    cost_local   = ttft_local + w · A · ι · steps(n_D)

Disaggregated (prefill on the prefill worker, layers streamed as they are computed, the
decode worker computes the last prompt token itself, as its admission always does)::

    τ            = 1 / link_bytes_per_s + (1 / conversion_bytes_per_s, 0 for identity)
    T_cached     = kv_bytes_per_token · τ · max(0, c_P − c_D)         shipped at once
    T_comp       = kv_bytes_per_token · τ · max(0, P − 1 − max(c_D, c_P))  streamed per layer
    n_P          = P − c_P
    C_P          = S_P(n_P, c_P) + [shared] I_D(n_P)
    pipe         = max(T_cached + T_comp, C_P / L + T_comp, C_P + T_comp / L)
    arrive       = q_P + pipe + transfer_latency_s
    ttft_disagg  = max(arrive, q_D) + S_D(1, P − 1) + I_D(1)
    cost_disagg  = ttft_disagg + w · A · ι · (1 + [shared] steps(n_P))

``pipe`` is when the last byte lands for a FIFO link fed first with the blocks cached on the
prefill worker, then with layer ``l``'s computed blocks once ``(l + 1) / L`` of the forward has
run (its maximum over the layers is reached at the first or the last layer). The decode worker
admits the request in its queue order, so the KV's arrival and its own queue overlap:
``max(arrive, q_D)``.

``[shared]`` is 1 when the two workers compute on the same hardware (``shared_compute``: one
host with overlapping CPU sets, or one device — ``router.placement``), else 0. Then the remote
prefill is no relief for the decode worker: its steps slow the running decodes as a local
prefill's would, and those decodes slow it as they would slow a local one. Two workers on
separate machines (the case disaggregation is for) pay neither.

``choose`` takes the disaggregated path only when ``cost_disagg + min_gain_s < cost_local``;
equal costs stay local. What follows from the formula (the property tests check each):

* a busier decode worker (``q_D``, ``A`` or ``ι`` larger) never favours local on separate
  hardware: ``cost_local`` grows by the full amount, ``cost_disagg`` by at most as much;
* shared compute never favours disagg: only ``cost_disagg`` grows; with equal fits and
  caches, no queues and a shared machine, local always wins;
* a slower link or conversion, a larger latency, or a busier prefill worker never favours
  disagg: only ``cost_disagg`` grows;
* a longer uncached prompt (caches fixed) never favours local while the decode worker's
  queue hides the remote path (``q_D ≥ arrive``): ``S_D(n + 1, c) − S_D(n, c) ≥
  S_D(1, P) − S_D(1, P − 1)``. Beyond that regime a longer prompt can favour local — on a
  slow link the transfer grows faster than the prefill it saves — which is why the choice is
  priced per request and not by a length threshold;
* short prompts and an idle decode worker stay local: the remote path pays the transfer
  latency and a forward on the decode worker anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvstrata.errors import InvalidInput
from kvstrata.router.costs import CostProfile

Path = Literal["local", "disagg"]


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    interference_weight: float = 1.0
    """``w``: a second of delay to one running decode, counted against a second of TTFT."""
    min_gain_s: float = 0.0
    """Disaggregate only when it saves more than this (0: any saving; ties stay local)."""

    def __post_init__(self) -> None:
        if not (self.interference_weight >= 0 and self.min_gain_s >= 0):
            raise InvalidInput(f"weights and gains must be >= 0: {self}")


@dataclass(frozen=True, slots=True)
class DisaggCost:
    """What one request's choice is priced on (module docstring for the formula)."""

    prompt_tokens: int
    decode_cached_tokens: int
    prefill_cached_tokens: int
    decode_queue_s: float
    prefill_queue_s: float
    decode_profile: CostProfile
    prefill_profile: CostProfile
    kv_bytes_per_token: int
    num_layers: int
    link_bytes_per_s: float
    transfer_latency_s: float = 0.0
    conversion_bytes_per_s: float = 0.0  # the conversion plan's throughput; 0: identity
    active_decodes: int = 0  # running decodes on the decode worker
    prefill_step_interference_s: float = 0.0  # ι: what a prefill step adds to a decode step
    shared_compute: bool = False  # both workers on the same cores/device (docstring: [shared])

    def __post_init__(self) -> None:
        counts = (self.prompt_tokens, self.decode_cached_tokens, self.prefill_cached_tokens)
        if self.prompt_tokens < 1 or min(counts) < 0:
            raise InvalidInput(f"need prompt_tokens >= 1 and cached tokens >= 0: {counts}")
        if self.num_layers < 1 or self.kv_bytes_per_token < 1 or not self.link_bytes_per_s > 0:
            raise InvalidInput("need num_layers, kv_bytes_per_token and link_bytes_per_s > 0")
        rest = (
            self.decode_queue_s,
            self.prefill_queue_s,
            self.transfer_latency_s,
            self.conversion_bytes_per_s,
            self.active_decodes,
            self.prefill_step_interference_s,
        )
        if not all(math.isfinite(x) and x >= 0 for x in rest):
            raise InvalidInput(f"queues, latency, rates and interference must be >= 0: {rest}")


@dataclass(frozen=True, slots=True)
class Choice:
    path: Path
    ttft_local_s: float
    ttft_disagg_s: float
    cost_local_s: float  # TTFT plus the delay charged for running decodes
    cost_disagg_s: float
    transfer_s: float  # the link's busy time for the shipped KV (T_cached + T_comp)
    reason: str
    prefill_busy_s: float = 0.0  # the prefill worker's own compute for it (its queue's share)


def _steps(new_tokens: int, profile: CostProfile) -> int:
    chunk = profile.prefill_chunk_tokens
    return -(-max(new_tokens, 1) // chunk) if chunk > 0 else 1


def choose(cost: DisaggCost, config: DisaggConfig | None = None) -> Choice:
    """Local prefill or remote prefill + transfer, by the module docstring's formula."""
    config = config or DisaggConfig()
    prompt = cost.prompt_tokens
    c_decode = min(cost.decode_cached_tokens, prompt - 1)
    c_prefill = min(cost.prefill_cached_tokens, prompt - 1)
    decode, remote = cost.decode_profile, cost.prefill_profile
    harm_per_step = config.interference_weight * cost.active_decodes
    harm_per_step *= cost.prefill_step_interference_s

    n_local = prompt - c_decode
    ttft_local = cost.decode_queue_s + decode.prefill.seconds(n_local, c_decode)
    ttft_local += decode.interference_s(n_local, cost.active_decodes)
    cost_local = ttft_local + harm_per_step * _steps(n_local, decode)

    per_byte = 1.0 / cost.link_bytes_per_s
    if cost.conversion_bytes_per_s > 0:
        per_byte += 1.0 / cost.conversion_bytes_per_s
    per_token = cost.kv_bytes_per_token * per_byte
    t_cached = per_token * max(0, c_prefill - c_decode)
    t_comp = per_token * max(0, prompt - 1 - max(c_decode, c_prefill))
    n_remote = prompt - c_prefill
    compute = remote.prefill.seconds(n_remote, c_prefill)
    remote_harm_steps = 0
    if cost.shared_compute:
        compute += decode.interference_s(n_remote, cost.active_decodes)
        remote_harm_steps = _steps(n_remote, remote)
    layers = cost.num_layers
    pipe = max(t_cached + t_comp, compute / layers + t_comp, compute + t_comp / layers)
    arrive = cost.prefill_queue_s + pipe + cost.transfer_latency_s
    last_token = decode.prefill.seconds(1, prompt - 1) + decode.interference_s(
        1, cost.active_decodes
    )
    ttft_disagg = max(arrive, cost.decode_queue_s) + last_token
    cost_disagg = ttft_disagg + harm_per_step * (1 + remote_harm_steps)

    gain = cost_local - cost_disagg
    if gain > config.min_gain_s:
        path: Path = "disagg"
        reason = f"disagg saves {gain:.4f} s (local prefill of {n_local} tokens)"
    else:
        path = "local"
        transfer = t_cached + t_comp + cost.transfer_latency_s
        reason = (
            f"local: disagg would save {gain:.4f} s <= {config.min_gain_s} s "
            f"(transfer {transfer:.4f} s, remote queue {cost.prefill_queue_s:.4f} s)"
        )
    return Choice(
        path=path,
        ttft_local_s=ttft_local,
        ttft_disagg_s=ttft_disagg,
        cost_local_s=cost_local,
        cost_disagg_s=cost_disagg,
        transfer_s=t_cached + t_comp,
        reason=reason,
        prefill_busy_s=compute,
    )
