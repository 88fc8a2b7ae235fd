"""How the fleet learns a worker's identity and resident state: one small seam per engine.

``WorkerSource`` primitives (both blocking HTTP, called without the fleet lock):

- ``info(http, base_url, api_key) -> WorkerInfo``: the worker's identity, epoch, event
  endpoints and load figures; raises ``httpx.HTTPError`` or ``WorkerProtocolError`` when the
  worker cannot be reached or answers garbage (then it is treated as unreachable);
- ``dump(http, info, api_key) -> WorkerDump``: every block the worker holds now and the live
  sequence number of its event stream that snapshot corresponds to.

``KvstrataSource`` reads ``kvstrata serve``'s ``/kv/info`` and ``/kv/dump``;
``kvstrata.fleet.vllm_workers.VllmSource`` builds both for a vLLM OpenAI server, which has
neither (its device tier is rebuilt from its replay buffer instead).
"""

from __future__ import annotations

from typing import Protocol

import httpx

from kvstrata.fleet.worker_info import WorkerDump, WorkerInfo, fetch_dump, fetch_info


class WorkerSource(Protocol):
    def info(self, http: httpx.Client, base_url: str, api_key: str | None) -> WorkerInfo: ...

    def dump(self, http: httpx.Client, info: WorkerInfo, api_key: str | None) -> WorkerDump: ...


class KvstrataSource:
    """``kvstrata serve`` workers: ``/kv/info`` and ``/kv/dump``."""

    def info(self, http: httpx.Client, base_url: str, api_key: str | None) -> WorkerInfo:
        return fetch_info(http, base_url, api_key)

    def dump(self, http: httpx.Client, info: WorkerInfo, api_key: str | None) -> WorkerDump:
        return fetch_dump(http, info.base_url, api_key)
