"""Per request, local prefill on the decode worker or remote prefill + KV transfer?

The front door first places the request on a decode worker (the router, as for a colocated
fleet: prefill workers are never routing candidates), then :func:`plan` asks
``router.disagg.choose`` once per healthy prefill worker and keeps the one with the best
predicted disaggregated TTFT. The inputs (``router.disagg_inputs.disagg_cost``) are the
fleet's own figures: prompt tokens, each side's cached prefix (the global index), each
worker's queued prefill seconds and running decodes, its online prefill fit and learned
interference (``WorkerState``), KV bytes per token from the decode worker's advertised layout
(``/kv/info`` ``transfer``), whether the two share compute (``/kv/info`` ``compute``), and
the link (:class:`DisaggSettings`: measured once at start with
``transfer.tcp.raw_socket_gbps``, or configured).

Pure: called under the fleet lock with the states, no I/O, no clock. The I/O (``POST
/kv/prefill`` beside the decode completion) is :mod:`.disagg_proxy`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from kvstrata.fleet.workers import WorkerState
from kvstrata.index.model import PrefixMatch
from kvstrata.router.disagg import Choice, DisaggConfig, choose
from kvstrata.router.disagg_inputs import Link, disagg_cost
from kvstrata.router.placement import shares_compute

MIN_OWN_SAMPLES = 3
Reason = Literal[
    "cost", "no_prefill_worker", "no_transfer_port", "prefill_unreachable", "plan_failed"
]


@dataclass(frozen=True, slots=True)
class DisaggSettings:
    link: Link
    choice: DisaggConfig = field(default_factory=DisaggConfig)
    min_timeout_s: float = 5.0
    max_timeout_s: float = 60.0
    timeout_factor: float = 4.0
    """The decode worker waits ``factor ×`` the predicted disaggregated TTFT for the KV
    (within the bounds) before it prefills locally."""


@dataclass(frozen=True, slots=True)
class DisaggPlan:
    """One request's choice (immutable: carried across ``await`` by the front door)."""

    path: Literal["local", "disagg"]
    reason: Reason
    choice: Choice | None = None
    prefill_worker_id: str | None = None
    prefill_url: str | None = None
    prefill_epoch: int = 0
    prefill_cached_tokens: int = 0
    target_host: str = ""
    target_port: int = 0
    target_transport: str = "tcp"
    timeout_s: float = 0.0
    candidates: tuple[tuple[str, float], ...] = ()
    """(prefill worker, predicted disaggregated TTFT) of every healthy prefill worker."""

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["candidates"] = [{"worker_id": w, "ttft_disagg_s": t} for w, t in self.candidates]
        return body


def _cached(match: PrefixMatch | None, state: WorkerState, prompt_tokens: int) -> int:
    blocks = 0 if match is None else match.blocks
    return min(blocks * state.info.block_size, max(0, prompt_tokens - 1))


def plan(
    *,
    request_id: str,
    prompt_tokens: int,
    decode: WorkerState,
    prefill_workers: Sequence[WorkerState],
    matches: Mapping[str, PrefixMatch],
    settings: DisaggSettings,
) -> DisaggPlan:
    """Local or remote prefill for a request already placed on ``decode`` (module docstring)."""
    target = decode.info.transfer
    if target is None:
        return DisaggPlan("local", "no_transfer_port")
    healthy = [s for s in prefill_workers if s.healthy]
    if not healthy:
        return DisaggPlan("local", "no_prefill_worker")
    decode_cached = _cached(matches.get(decode.worker_id), decode, prompt_tokens)
    decode_profile = decode.interference.apply(decode.profile())
    # A prefill worker learns its fit from its own /kv/prefill replies; until it has enough,
    # it is priced like the decode worker (same model, same kind of machine).
    options: list[tuple[Choice, WorkerState, int]] = []
    for remote in healthy:
        remote_cached = _cached(matches.get(remote.worker_id), remote, prompt_tokens)
        cost = disagg_cost(
            prompt_tokens=prompt_tokens,
            decode_cached_tokens=decode_cached,
            prefill_cached_tokens=remote_cached,
            decode_queue_s=decode.queued_prefill_s(exclude=request_id),
            prefill_queue_s=remote.queued_prefill_s(),
            active_decodes=decode.active_decodes(),
            decode_profile=decode_profile,
            prefill_profile=(
                remote.interference.apply(remote.profile())
                if remote.prefill_fit.samples >= MIN_OWN_SAMPLES
                else decode_profile
            ),
            layout=target.layout,
            link=settings.link,
            decode_step_s=decode.decode_step_s,
            shared_compute=shares_compute(decode.info.compute, remote.info.compute),
        )
        options.append((choose(cost, settings.choice), remote, remote_cached))
    best, remote, remote_cached = min(options, key=lambda o: o[0].ttft_disagg_s)
    candidates = tuple((s.worker_id, c.ttft_disagg_s) for c, s, _ in options)
    timeout = min(
        settings.max_timeout_s,
        max(settings.min_timeout_s, settings.timeout_factor * best.ttft_disagg_s),
    )
    return DisaggPlan(
        path=best.path,
        reason="cost",
        choice=best,
        prefill_worker_id=remote.worker_id,
        prefill_url=remote.info.base_url,
        prefill_epoch=remote.info.epoch,
        prefill_cached_tokens=remote_cached,
        target_host=target.host,
        target_port=target.port,
        target_transport=target.transport,
        timeout_s=timeout,
        candidates=candidates,
    )
