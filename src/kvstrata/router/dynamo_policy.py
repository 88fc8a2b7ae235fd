"""The ``dynamo`` baseline: NVIDIA Dynamo's KV router cost, fed what Dynamo's router tracks.

Dynamo's router (``ai-dynamo/dynamo`` ``lib/kv-router``) scores each worker with

    cost = prefill_load_scale · max(0, raw_prefill_blocks − overlap_credit_blocks)
           + decode_blocks

lowest wins (``scheduling/selector/default.rs`` ``DefaultWorkerScorer::worker_logit``,
commit 07a6c9ce3bb096cfaf353fe69ee578e105c6a512), where

* ``raw_prefill_blocks = (active_prefill_tokens + isl) / block_size``: the worker's
  ``active_prefill_tokens`` are the *effective* (uncached) prompt tokens of every request the
  router sent there whose first token has not come back. A request's count is set when it is
  routed (``PrefillLoadHint::initial_effective_prefill_tokens`` = its ISL minus the chosen
  worker's overlap) and dropped at its first token (``ActiveSequences::
  mark_prefill_completed``) or when it is freed (``sequences/single.rs``, commit
  04df1c42f2fedff2286f46f13efcc96ec32a55bd); no time decay is configured by default.
* ``overlap_credit_blocks``: cached blocks by tier × ``overlap_score_credit`` (device, 1.0),
  ``host_cache_hit_weight`` 0.75, ``disk_cache_hit_weight`` 0.25.
* ``decode_blocks = WorkerLoadProjection::potential_decode_blocks() = active_decode_blocks +
  additional_active_blocks`` (``sequences/prompt_registry.rs``): the *unique* prompt blocks of
  every routed, unfinished request on the worker (a block shared by two requests counts once;
  blocks are acquired when the request is routed and released only when it is freed, so
  queued, prefilling and decoding requests all count; output blocks are not tracked by
  default), plus the new request's blocks not already among them.

None of this is worker telemetry: it is the router's own record of what it sent. So it lives
here, in the policy, fed by the router's request lifecycle (:class:`~.model.RequestLifecycle`:
``routed`` on a committed decision, ``first_token``, ``finished``), which the simulator and the
live fleet both drive through :class:`~.core.Router`. ``WorkerLoad`` is used only for health.
Exact cost ties go to the first worker (Dynamo breaks them at random).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvstrata.index.core import PrefixMatch
from kvstrata.router.costs import CostProfile
from kvstrata.router.estimate import TtftEstimator, decide, healthy_loads, match_of
from kvstrata.router.model import RouteDecision, RouteRequest, WorkerLoad


@dataclass(frozen=True, slots=True)
class DynamoWeights:
    """Dynamo KV router defaults: overlap credit per tier and the prefill load scale.

    From ``KvRouterConfig::default()`` in ai-dynamo/dynamo ``lib/kv-router/src/scheduling/
    config.rs`` (commit 0243c51bb6e8958be89df4978b5761677c9adc23): ``overlap_score_credit``
    1.0 (our ``device_credit``), ``prefill_load_scale`` 1.0 (what the deprecated
    ``kv_overlap_score_weight`` now sets), ``host_cache_hit_weight`` 0.75,
    ``disk_cache_hit_weight`` 0.25, ``router_temperature`` 0.0 (deterministic argmin, the only
    mode implemented here). Dynamo has no remote-tier credit; 0 keeps remote blocks uncredited.
    """

    prefill_load_scale: float = 1.0
    device_credit: float = 1.0
    host_credit: float = 0.75
    disk_credit: float = 0.25
    remote_credit: float = 0.0


@dataclass(slots=True)
class _Routed:
    worker_id: str
    prefill_tokens: int
    blocks: tuple[int, ...]


class ActiveSequences:
    """The router's record of routed, unfinished requests per worker (Dynamo's
    ``ActiveSequences``): effective prefill tokens until the first token, unique prompt
    blocks until the end."""

    def __init__(self) -> None:
        self._requests: dict[str, _Routed] = {}
        self._prefill: Counter[str] = Counter()
        self._blocks: dict[str, Counter[int]] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(
        self, request_id: str, worker_id: str, prefill_tokens: int, blocks: Sequence[int]
    ) -> None:
        if request_id in self._requests:
            self.free(request_id)
        routed = _Routed(worker_id, max(0, prefill_tokens), tuple(int(b) for b in blocks))
        self._requests[request_id] = routed
        self._prefill[worker_id] += routed.prefill_tokens
        self._blocks.setdefault(worker_id, Counter()).update(routed.blocks)

    def first_token(self, request_id: str) -> None:
        routed = self._requests.get(request_id)
        if routed is not None:
            self._prefill[routed.worker_id] -= routed.prefill_tokens
            routed.prefill_tokens = 0

    def free(self, request_id: str) -> None:
        self.first_token(request_id)
        routed = self._requests.pop(request_id, None)
        if routed is None:
            return
        held = self._blocks[routed.worker_id]
        held.subtract(routed.blocks)
        for block in routed.blocks:
            if held.get(block, 0) <= 0:
                held.pop(block, None)

    def prefill_tokens(self, worker_id: str) -> int:
        return self._prefill.get(worker_id, 0)

    def active_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def new_blocks(self, worker_id: str, blocks: Sequence[int]) -> int:
        """Blocks of ``blocks`` not among the worker's active ones."""
        held = self._blocks.get(worker_id)
        if not held:
            return len(blocks)
        return sum(1 for block in blocks if int(block) not in held)


class DynamoLinearPolicy:
    """Dynamo's KV router cost over its own bookkeeping (module docstring)."""

    name = "dynamo"

    def __init__(
        self, profiles: Callable[[str], CostProfile], weights: DynamoWeights | None = None
    ) -> None:
        self.estimator = TtftEstimator(profiles)
        self.weights = weights or DynamoWeights()
        self.active = ActiveSequences()

    def cost(
        self, request: RouteRequest, match: PrefixMatch, worker_id: str, blocks: Sequence[int]
    ) -> float:
        w = self.weights
        block_size = self.estimator.profiles(worker_id).block_size
        device, host, disk, remote = match.tier_blocks
        credit = w.device_credit * device + w.host_credit * host + w.disk_credit * disk
        credit += w.remote_credit * remote
        raw_prefill = (self.active.prefill_tokens(worker_id) + request.prompt_tokens) / block_size
        decode = self.active.active_blocks(worker_id) + self.active.new_blocks(worker_id, blocks)
        return w.prefill_load_scale * max(raw_prefill - credit, 0.0) + decode

    def choose(
        self, request: RouteRequest, matches: Mapping[str, PrefixMatch], loads: Sequence[WorkerLoad]
    ) -> RouteDecision:
        healthy = healthy_loads(loads)
        blocks = [int(h) for h in request.hashes]
        scores = {
            w.worker_id: self.cost(request, match_of(matches, w.worker_id), w.worker_id, blocks)
            for w in healthy
        }
        pick = min(healthy, key=lambda w: scores[w.worker_id])
        return decide(
            self.name,
            request,
            matches,
            healthy,
            self.estimator,
            pick.worker_id,
            "lowest_cost",
            scores,
        )

    # ------------------------------------------------------------ RequestLifecycle
    def routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        """A committed decision: its uncached tokens and prompt blocks now load the worker."""
        chosen = next(e for e in decision.estimates if e.worker_id == decision.worker_id)
        block_size = self.estimator.profiles(decision.worker_id).block_size
        prefill = request.prompt_tokens - chosen.tier_blocks[0] * block_size
        self.active.add(request.request_id, decision.worker_id, prefill, list(request.hashes))

    def first_token(self, request_id: str) -> None:
        self.active.first_token(request_id)

    def finished(self, request_id: str) -> None:
        self.active.free(request_id)
