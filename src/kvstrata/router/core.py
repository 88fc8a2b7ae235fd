"""The router: index lookup + a placement policy; shared by the fleet and the simulator."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

import numpy as np

from kvstrata.index.core import ConsistencyMode, GlobalIndex
from kvstrata.router.model import (
    RequestLifecycle,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    WorkerLoad,
)

_log = logging.getLogger(__name__)


class Router:
    """Places requests: longest-prefix match per worker from the index, then the policy.

    In approximate mode the decision is written back into the index (the router's own
    prediction of where the prefix now lives). The last ``keep_decisions`` decisions are kept
    for ``/debug`` and each one is logged at debug level with its per-worker estimates.
    """

    def __init__(
        self, index: GlobalIndex, policy: RoutingPolicy, *, keep_decisions: int = 256
    ) -> None:
        self.index = index
        self.policy = policy
        self.recent: deque[RouteDecision] = deque(maxlen=keep_decisions)
        self._lifecycle = policy if isinstance(policy, RequestLifecycle) else None

    def route(
        self,
        request: RouteRequest,
        loads: Sequence[WorkerLoad],
        *,
        now: float | None = None,
        record: bool = True,
    ) -> RouteDecision:
        """Choose a worker; ``record=False`` explains without committing (``/debug/route``)."""
        hashes = request.hashes
        matches = self.index.match(
            hashes if isinstance(hashes, np.ndarray) else list(hashes), now=now
        )
        decision = self.policy.choose(request, matches, loads)
        if record:
            if self.index.mode is ConsistencyMode.APPROXIMATE:
                self.index.record_route(decision.worker_id, list(hashes), now)
            self.recent.append(decision)
            if self._lifecycle is not None:
                self._lifecycle.routed(request, decision)
            if _log.isEnabledFor(logging.DEBUG):
                _log.debug("route %s", decision.to_dict())
        return decision

    def first_token(self, request_id: str) -> None:
        """The request's first token came back (policies with a lifecycle record are told)."""
        if self._lifecycle is not None:
            self._lifecycle.first_token(request_id)

    def finished(self, request_id: str) -> None:
        """The request ended (completed, failed or cancelled)."""
        if self._lifecycle is not None:
            self._lifecycle.finished(request_id)
