"""The router process's state: workers, the global index, the event plane, the router.

:class:`Fleet` is what the front door (:mod:`.frontdoor`) routes with; it attaches workers
(``/kv/info`` + the event plane's dump-and-resume), watches their health and marks dead ones,
and answers routing questions under the lock it shares with the event plane.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from kvstrata.errors import NoWorkerAvailable
from kvstrata.fleet.eventplane import EventPlane
from kvstrata.fleet.metrics import FleetMetrics
from kvstrata.fleet.workers import WorkerInfo, WorkerProtocolError, WorkerState, default_profile
from kvstrata.index.core import ConsistencyMode, GlobalIndex
from kvstrata.router.core import Router
from kvstrata.router.costs import CostProfile
from kvstrata.router.model import RouteDecision, RouteRequest
from kvstrata.router.policies import POLICIES
from kvstrata.runtime import tokenization

_log = logging.getLogger(__name__)


class FleetTokenizer:
    """Tokenizes as ``ReferenceEngine.encode_prompt`` / ``encode_chat`` do (tested equal)."""

    def __init__(self, model_dir: Path, chat_template: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.chat_template = chat_template

    def encode_prompt(self, prompt: str) -> list[int]:
        return tokenization.encode_prompt(self.tokenizer, prompt)

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return tokenization.encode_chat(self.tokenizer, messages, self.chat_template)


@dataclass
class FleetConfig:
    policy: str = "kvstrata"
    mode: ConsistencyMode = ConsistencyMode.EXACT
    health_interval_s: float = 0.5
    health_failures: int = 2
    max_attempts: int = 3
    request_timeout_s: float = 600.0
    tenant_secret: bytes = b""
    worker_urls: list[str] = field(default_factory=list)


class Fleet:
    """The router process's state: workers, index, event plane, router, metrics."""

    def __init__(self, tokenizer: FleetTokenizer, config: FleetConfig) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"unknown policy {config.policy!r}; known: {', '.join(POLICIES)}")
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = FleetMetrics()
        self.lock = threading.Lock()
        self.workers: dict[str, WorkerState] = {}
        self.urls: dict[str, str] = {}  # base URL → worker id (for re-attachment)
        self.index: GlobalIndex | None = None
        self.router: Router | None = None
        self.events: EventPlane | None = None
        self._http = httpx.Client(timeout=10.0)

    # ------------------------------------------------------------------ workers
    def _profile(self, worker_id: str) -> CostProfile:
        state = self.workers.get(worker_id)
        if state is None:
            raise KeyError(worker_id)
        return state.profile()

    def _ensure_index(self, info: WorkerInfo) -> GlobalIndex:
        if self.index is None:
            self.index = GlobalIndex(
                info.fingerprint,
                info.block_size,
                mode=self.config.mode,
                tenant_secret=self.config.tenant_secret,
            )
            self.router = Router(self.index, POLICIES[self.config.policy](self._profile))
            self.events = EventPlane(self.index, self.lock)
            self.metrics.export_index(self.index, self.events.stats, self.lock)
            self.events.start()
        elif info.fingerprint != self.index.fingerprint or info.block_size != self.index.block_size:
            raise WorkerProtocolError(
                f"worker {info.worker_id} serves another model or block size than the fleet"
            )
        return self.index

    def attach(self, base_url: str) -> WorkerInfo:
        """Read a worker's identity and attach its event stream (or, approximate: just add it)."""
        from kvstrata.fleet.workers import fetch_info

        info = fetch_info(self._http, base_url)
        index = self._ensure_index(info)
        previous = self.workers.get(info.worker_id)
        if self.config.mode is ConsistencyMode.EXACT:
            assert self.events is not None
            self.events.attach(info)
        else:
            with self.lock:
                index.add_worker(info.worker_id, info.epoch)
        state = WorkerState(info, default_profile(info.block_size))
        if previous is not None:  # keep what was learned about this machine's speed
            state.prefill_fit = previous.prefill_fit
            state.decode_step_s = previous.decode_step_s
        self.workers[info.worker_id] = state
        self.urls[base_url] = info.worker_id
        self.metrics.worker_healthy.labels(info.worker_id).set(1)
        self.metrics.worker_events.labels(info.worker_id, "attached").inc()
        return info

    def mark_dead(self, worker_id: str) -> None:
        state = self.workers.get(worker_id)
        if state is None or not state.healthy:
            return
        state.healthy = False
        self.metrics.worker_healthy.labels(worker_id).set(0)
        self.metrics.worker_events.labels(worker_id, "detached").inc()
        if self.events is not None:
            self.events.detach(worker_id)
        elif self.index is not None:
            with self.lock:
                self.index.remove_worker(worker_id)
        _log.warning("worker %s is unreachable: no more traffic, index entries dropped", worker_id)

    def check_health(self) -> None:
        """One health round (blocking; run off the event loop)."""
        from kvstrata.fleet.workers import fetch_info

        for url in list(self.config.worker_urls):
            worker_id = self.urls.get(url)
            state = self.workers.get(worker_id) if worker_id else None
            try:
                info = fetch_info(self._http, url)
            except (httpx.HTTPError, WorkerProtocolError):
                if state is not None:
                    state.failures += 1
                    if state.failures >= self.config.health_failures:
                        self.mark_dead(state.worker_id)
                continue
            if state is None or not state.healthy or info.epoch != state.info.epoch:
                if state is not None and info.epoch != state.info.epoch:
                    self.metrics.worker_events.labels(info.worker_id, "epoch_changed").inc()
                try:
                    self.attach(url)
                except (httpx.HTTPError, WorkerProtocolError, TimeoutError) as exc:
                    _log.warning("attaching %s failed: %s", url, exc)
                    continue
            self.workers[info.worker_id].failures = 0

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        self._http.close()

    # ------------------------------------------------------------------ routing
    def route(
        self, request_id: str, tenant: str, tokens: list[int], max_tokens: int | None, record: bool
    ) -> RouteDecision:
        if self.router is None or self.index is None:
            raise NoWorkerAvailable("no worker attached")
        now = time.time()
        loads = [state.load() for state in self.workers.values()]
        with self.lock:
            loads = [
                replace(load, cached_blocks=sum(self.index.blocks_held(load.worker_id)))
                for load in loads
            ]
            hashes = self.index.request_hashes(tenant, tokens)
            request = RouteRequest(
                request_id=request_id,
                tenant=tenant,
                prompt_tokens=len(tokens),
                hashes=hashes,
                expected_output_tokens=max_tokens or 0,
                arrival_s=now,
            )
            return self.router.route(request, loads, now=now, record=record)
