"""``kvstrata bench disagg``: local prefill against remote prefill + KV transfer, measured.

Two real ``kvstrata serve`` processes on this machine: a **decode worker** (transfer port
open, a host tier to receive into) and a **prefill worker**. For each load (``A`` concurrent
decode streams kept running on the decode worker) and each prompt length, both paths run in
the same run, alternating, ``repeats`` times, each on a fresh prompt (no cache hit on either
side):

- **local**: ``/v1/completions`` (``max_tokens`` 1) on the decode worker: its TTFT;
- **disagg**: ``POST /kv/prefill`` to the prefill worker and the completion with
  ``kvstrata_transfer`` to the decode worker, concurrently: the decode answer's TTFT.

``chosen`` is what ``router.disagg.choose`` picks for that point from the figures a fleet
has *before* the point is measured (``router.disagg_inputs.disagg_cost``): each worker's
prefill model refitted online (``OnlinePrefillFit``) from the TTFTs of requests that ran
alone (a fleet's front door learns the same figure as the worker's reported prefill compute
plus the serving overhead around it), the interference of running decodes learned from
earlier loaded TTFTs (``InterferenceEstimate``, under the workers' default chunked-prefill
token budget), the disaggregated path's fixed overhead learned from earlier points
(``OverheadEstimate``, as link latency), the decode step, the decode worker's advertised
layout, and the link measured once at start with ``transfer.tcp.raw_socket_gbps``.
``best`` is the path with the lower measured median; ``choice_accuracy`` the share of
points where they agree.
``transfer_gbps`` is the transfer stack alone (``bench.transfer_link``: a sender process
streams RUN frames into this process's PENDING host-tier slots, every block digest verified,
then committed; this model's layer size; no compute), the median of ``LINK_PROBES`` probes
each paired with a raw socket between the same two processes and of the same size
(``raw_link_gbps``, reported as ``raw_socket_gbps``), ``transfer_vs_raw`` the median of the
per-probe ratios. The replies' own
bytes over their seconds — which span the whole layer-wise prefill, so on a compute-bound
model they measure the prefill's pace, not the link's — are ``prefill_send_gbps``.
``overlap`` is the median share of transfer time hidden behind the prefill.

A second kind of load (``queued``): one prefill of ``N`` fresh tokens sent to the decode
worker just before each measured request (``QUEUE_LEAD_S`` ahead), no streams: the request
waits behind it on the local path, while on the disaggregated path the prefill worker computes
meanwhile. The router's figure for it is what a fleet's queue estimate holds: the blocker's
predicted prefill seconds (the decode worker's fit) less the lead. Those points teach the
fits nothing (their TTFTs did not run alone).

``decode_worker``: why the decode worker did not load blocks it held — its counters at the
end of the sweep, by reason: ``promotion_unloaded_blocks`` (a plan cut short: ``pool_full``,
``missing``, …), ``breakeven_recompute`` (a plan not made: ``fetch_slower``,
``below_min_tokens``) and the host tier's ``evictions`` by outcome. A point whose
``decode_hit_tokens`` falls short of the prompt is explained there.

Both workers share this machine's cores: a remote prefill competes with the decode streams
for CPU, which a real deployment (two machines) would not; the figures say what this box does.
Each worker's ``/kv/info`` ``compute`` entry tells the router so (``shared_compute``).
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

import httpx

from kvstrata.bench.disagg_workers import WorkerPair
from kvstrata.bench.servers import counter_totals
from kvstrata.bench.transfer_link import LinkProbe, transfer_stack_gbps
from kvstrata.costs import OnlinePrefillFit
from kvstrata.costs.online import DEFAULT_MIN_SHAPES
from kvstrata.router.costs import CostProfile
from kvstrata.router.disagg import choose
from kvstrata.router.disagg_inputs import (
    InterferenceEstimate,
    Link,
    OverheadEstimate,
    disagg_cost,
)
from kvstrata.runtime.scheduler import SchedulerConfig
from kvstrata.transfer.layout import KVLayout
from kvstrata.transfer.tcp import raw_socket_gbps

RAW_SOCKET_BYTES = 256 * 1024 * 1024
LINK_PROBES = 3
LINK_PROBE_BYTES = 128 * 1024 * 1024
LINK_PROBE_MAX_BLOCKS = 4096
STREAM_PROMPT_TOKENS = 32
QUEUE_LEAD_S = 0.05  # a queued point's blocker is sent this long before the measured request


@dataclass(frozen=True, slots=True)
class DisaggBenchConfig:
    model: str = "smollm2"
    lengths: tuple[int, ...] = (256, 512, 1024, 2048)
    loads: tuple[int, ...] = (0, 2, 4)
    queued: tuple[int, ...] = (2048,)  # blocker lengths of the queued points (module docstring)
    repeats: int = 3
    stream_tokens: int = 256  # each background decode stream's length (restarted when done)
    timeout_s: float = 300.0
    link_probe_bytes: int = LINK_PROBE_BYTES  # KV payload of each transfer-stack probe


@dataclass
class _Learned:
    """The fleet's figures for both workers, learned from this run's own requests."""

    decode_fit: OnlinePrefillFit
    prefill_fit: OnlinePrefillFit
    prior: CostProfile
    interference: InterferenceEstimate
    overhead: OverheadEstimate
    decode_step_s: float = 0.02

    def profile(self, fit: OnlinePrefillFit) -> CostProfile:
        return self.interference.apply(self.prior.with_prefill(fit.model()))


def _prompt(length: int) -> list[int]:
    """A fresh prompt (no block shared with any other): random-looking ids in 3..20002."""
    seed = uuid.uuid4().int
    return [3 + (seed >> (i % 64) ^ i * 2654435761) % 20000 for i in range(length)]


def _complete(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[float, int]:
    start = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json=body)
    response.raise_for_status()
    return time.perf_counter() - start, int(response.headers.get("x-kvstrata-matched-tokens", 0))


class _Streams:
    """``count`` decode streams kept running on a worker until :meth:`stop`."""

    def __init__(self, url: str, count: int, tokens: int, timeout_s: float) -> None:
        self._url, self._count, self._tokens = url, count, tokens
        self._timeout_s = timeout_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.step_samples: list[float] = []
        self.errors: list[str] = []

    def start(self) -> None:
        for _ in range(self._count):
            thread = threading.Thread(target=self._loop, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _loop(self) -> None:
        with httpx.Client(timeout=self._timeout_s) as client:
            while not self._stop.is_set():
                body = {"prompt": _prompt(STREAM_PROMPT_TOKENS), "max_tokens": self._tokens}
                body |= {"temperature": 0, "ignore_eos": True}
                try:
                    seconds, _ = _complete(client, self._url, body)
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    return
                self.step_samples.append(seconds / self._tokens)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self._timeout_s)


def calibration_lengths(lengths: Sequence[int]) -> list[int]:
    """The prompt lengths ``_calibrate`` times: every swept length, then halvings of the
    shortest until there are ``DEFAULT_MIN_SHAPES`` (4) distinct lengths, the fewest
    ``OnlinePrefillFit`` leaves its prior with. With fewer (``--lengths 256,2048`` gave 3)
    both workers' fits stayed the prior for the whole sweep: 2,048 tokens were predicted at
    0.22 s for 7.19 s measured, and the queued points chose local where disaggregation was
    ~2x faster. Halving stops at 1 token: a sweep whose shortest length reaches 1 first (its
    shortest below 8 with fewer than 4 lengths, e.g. ``[2, 2048]``) calibrates with fewer
    shapes, and its fits keep their prior."""
    shapes = set(lengths)
    shortest = min(shapes)
    while len(shapes) < DEFAULT_MIN_SHAPES and shortest > 1:
        shortest //= 2
        shapes.add(shortest)
    return sorted(shapes)


def _calibrate(
    client: httpx.Client, pair: WorkerPair, learned: _Learned, lengths: Sequence[int]
) -> None:
    """Alone prefills on each worker (what a fleet learns its fits from) and a decode step.

    ``calibration_lengths(lengths)``, twice each: enough samples and distinct shapes for
    ``OnlinePrefillFit`` to leave its prior (8 samples, 4 shapes)."""
    shapes = calibration_lengths(lengths)
    for url, fit in ((pair.decode, learned.decode_fit), (pair.prefill, learned.prefill_fit)):
        for length in shapes * 2:
            body = {"prompt": _prompt(length), "max_tokens": 1, "temperature": 0}
            seconds, _ = _complete(client, url, body)
            fit.observe(length, 0, seconds)
    steps = 16
    base = {"max_tokens": 1, "temperature": 0, "ignore_eos": True}
    one, _ = _complete(client, pair.decode, {**base, "prompt": _prompt(STREAM_PROMPT_TOKENS)})
    many, _ = _complete(
        client, pair.decode, {**base, "prompt": _prompt(STREAM_PROMPT_TOKENS), "max_tokens": steps}
    )
    learned.decode_step_s = max(1e-4, (many - one) / (steps - 1))


def _disagg_once(
    client: httpx.Client, pool: ThreadPoolExecutor, pair: WorkerPair, tokens: list[int]
) -> tuple[float, dict[str, Any], int]:
    request_id = f"bench-{uuid.uuid4().hex}"
    target = {
        "host": pair.transfer_host,
        "port": pair.transfer_port,
        "transport": pair.transfer_transport,
    }
    prefill_body = {"request_id": request_id, "prompt_token_ids": tokens, "target": target}
    wait = {"request_id": request_id, "timeout_s": 60}
    body = {"prompt": tokens, "max_tokens": 1, "temperature": 0, "kvstrata_transfer": wait}
    sent = pool.submit(client.post, f"{pair.prefill}/kv/prefill", json=prefill_body)
    seconds, matched = _complete(client, pair.decode, body)
    reply = sent.result()
    reply.raise_for_status()
    outcome: dict[str, Any] = reply.json()
    return seconds, outcome, matched


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _blocked(
    client: httpx.Client, pool: ThreadPoolExecutor, url: str, queued: int
) -> Future[tuple[float, int]] | None:
    """Send a ``queued``-token prefill to ``url`` and give it ``QUEUE_LEAD_S`` to be admitted
    (None and no wait for 0)."""
    if queued <= 0:
        return None
    body = {"prompt": _prompt(queued), "max_tokens": 1, "temperature": 0}
    blocker = pool.submit(_complete, client, url, body)
    time.sleep(QUEUE_LEAD_S)
    return blocker


def _point(
    client: httpx.Client,
    pool: ThreadPoolExecutor,
    pair: WorkerPair,
    learned: _Learned,
    link: Link,
    length: int,
    load: int,
    repeats: int,
    transfers: list[dict[str, Any]],
    queued: int = 0,
) -> dict[str, Any]:
    queue_s = 0.0
    if queued:  # what the fleet's queue estimate holds once the blocker is in
        queue_s = max(0.0, learned.decode_fit.model().seconds(queued, 0) - QUEUE_LEAD_S)
    cost = disagg_cost(
        prompt_tokens=length,
        decode_cached_tokens=0,
        prefill_cached_tokens=0,
        decode_queue_s=queue_s,  # streams decode, they are not queued prefills
        prefill_queue_s=0.0,
        active_decodes=load,
        decode_profile=learned.profile(learned.decode_fit),
        prefill_profile=learned.profile(learned.prefill_fit),
        layout=pair.layout,
        link=replace(link, latency_s=learned.overhead.value_s),
        decode_step_s=learned.decode_step_s,
        shared_compute=pair.shared_compute,
    )
    choice = choose(cost)
    local: list[float] = []
    remote: list[float] = []
    hits: list[int] = []
    for _ in range(repeats):  # alternating, fresh prompts
        blocker = _blocked(client, pool, pair.decode, queued)
        seconds, _ = _complete(
            client, pair.decode, {"prompt": _prompt(length), "max_tokens": 1, "temperature": 0}
        )
        local.append(seconds)
        if blocker is not None:
            blocker.result()
        blocker = _blocked(client, pool, pair.decode, queued)
        seconds, outcome, matched = _disagg_once(client, pool, pair, _prompt(length))
        remote.append(seconds)
        hits.append(matched)
        transfers.append(outcome)
        if blocker is not None:
            blocker.result()
        if outcome.get("outcome") == "sent":  # the front door learns the prefill fit so
            learned.prefill_fit.observe(length, 0, float(outcome["seconds"]))
    ttft_local, ttft_disagg = _median(local), _median(remote)
    if not queued:  # what a fleet learns from these (after the choice was made)
        predicted_alone = learned.decode_fit.model().seconds(length, 0)
        for seconds in local:
            if load == 0:
                learned.decode_fit.observe(length, 0, seconds)
            else:
                learned.interference.observe(seconds, predicted_alone, length, load)
        learned.overhead.observe(ttft_disagg, choice.ttft_disagg_s - learned.overhead.value_s)
    best = "disagg" if ttft_disagg < ttft_local else "local"
    return {
        "prompt_tokens": length,
        "load": load,
        "queued_tokens": queued,
        "ttft_local_s": ttft_local,
        "ttft_disagg_s": ttft_disagg,
        "spread_local_s": max(local) - min(local),
        "spread_disagg_s": max(remote) - min(remote),
        "predicted_local_s": choice.ttft_local_s,
        "predicted_disagg_s": choice.ttft_disagg_s,
        "overhead_s": learned.overhead.value_s,
        "chosen": choice.path,
        "best": best,
        "decode_hit_tokens": min(hits),
    }


def run_disagg_bench(
    config: DisaggBenchConfig, start_pair: Callable[[], AbstractContextManager[WorkerPair]]
) -> dict[str, Any]:
    """The sweep (module docstring); ``start_pair`` starts the two workers (a context)."""
    raw_before = raw_socket_gbps(RAW_SOCKET_BYTES)
    link = Link(bytes_per_s=raw_before * 1e9, latency_s=0.0, source="measured")
    with start_pair() as pair, httpx.Client(timeout=config.timeout_s) as client:
        prior = CostProfile(block_size=pair.layout.block_size)  # refitted by _calibrate
        learned = _Learned(
            OnlinePrefillFit(prior.prefill),
            OnlinePrefillFit(prior.prefill),
            prior,
            InterferenceEstimate(SchedulerConfig().max_num_batched_tokens),
            OverheadEstimate(),
        )
        _calibrate(client, pair, learned, config.lengths)
        points: list[dict[str, Any]] = []
        transfers: list[dict[str, Any]] = []
        with ThreadPoolExecutor(max_workers=3) as pool:
            for load in config.loads:
                streams = _Streams(pair.decode, load, config.stream_tokens, config.timeout_s)
                streams.start()
                try:
                    for length in config.lengths:
                        points.append(
                            _point(client, pool, pair, learned, link, length, load,
                                   config.repeats, transfers)
                        )  # fmt: skip
                finally:
                    streams.stop()
                if streams.step_samples:
                    learned.decode_step_s = _median(streams.step_samples)
            for queued in config.queued:
                for length in config.lengths:
                    points.append(
                        _point(client, pool, pair, learned, link, length, 0, config.repeats,
                               transfers, queued)
                    )  # fmt: skip
        decode_worker = _decode_counters(client, pair.decode)
    raw_after = raw_socket_gbps(RAW_SOCKET_BYTES)
    probes = [
        _link_probe(pair.layout, config.link_probe_bytes, pair.transfer_transport)
        for _ in range(LINK_PROBES)
    ]
    raw = (raw_before, raw_after)
    summary = _summary(config, pair.layout, points, transfers, raw, link, probes)
    return summary | {
        "transport": pair.transfer_transport,
        "shared_compute": pair.shared_compute,
        "decode_worker": decode_worker,
    }


def _decode_counters(client: httpx.Client, url: str) -> dict[str, dict[str, float]]:
    """The decode worker's counters that explain a short hit (module docstring)."""
    page = client.get(f"{url}/metrics")
    page.raise_for_status()
    evictions = counter_totals(page.text, "kvstrata_tier_evictions", ("tier", "outcome"))
    return {
        "promotion_unloaded_blocks": counter_totals(
            page.text, "kvstrata_promotion_unloaded_blocks", ("reason",)
        ),
        "breakeven_recompute": counter_totals(
            page.text, "kvstrata_breakeven_recompute", ("reason",)
        ),
        "evictions": {k: v for k, v in evictions.items() if not k.startswith("device/")},
    }


def _link_probe(layout: KVLayout, total_bytes: int, transport: str) -> LinkProbe:
    layer_bytes = layout.block_bytes() // layout.num_layers
    blocks = min(LINK_PROBE_MAX_BLOCKS, max(1, total_bytes // layout.block_bytes()))
    return transfer_stack_gbps(
        blocks=blocks, layers=layout.num_layers, layer_bytes=layer_bytes, transport_name=transport
    )


def _summary(
    config: DisaggBenchConfig,
    layout: KVLayout,
    points: list[dict[str, Any]],
    transfers: list[dict[str, Any]],
    raw: tuple[float, float],
    link: Link,
    probes: Sequence[LinkProbe],
) -> dict[str, Any]:
    sent = [t for t in transfers if t.get("outcome") == "sent"]
    total_bytes = sum(int(t["bytes"]) for t in sent)
    total_s = sum(float(t["seconds"]) for t in sent)
    prefill_send_gbps = total_bytes / total_s / 1e9 if total_s > 0 else 0.0
    agree = sum(1 for p in points if p["chosen"] == p["best"])
    return {
        "model": config.model,
        "repeats": config.repeats,
        "lengths": list(config.lengths),
        "loads": list(config.loads),
        "queued": list(config.queued),
        "points": points,
        "choice_accuracy": agree / len(points) if points else 0.0,
        "transfer_gbps": _median([p.stack_gbps for p in probes]),
        "raw_socket_gbps": _median([p.raw_socket_gbps for p in probes]),
        "transfer_vs_raw": _median([p.stack_vs_raw for p in probes]),
        "link_probes": [
            {
                "transfer_gbps": p.stack_gbps,
                "raw_socket_gbps": p.raw_socket_gbps,
                "ratio": p.stack_vs_raw,
                "bytes": p.payload_bytes,
            }
            for p in probes
        ],
        "prefill_send_gbps": prefill_send_gbps,
        "prefill_send_vs_raw": prefill_send_gbps / max(raw) if max(raw) > 0 else 0.0,
        "raw_socket_gbps_runs": list(raw),  # before and after the sweep (the router's link)
        "overlap": _median([float(t["overlap"]) for t in sent]),
        "transfers": len(transfers),
        "transfers_sent": len(sent),
        "link_source": link.source,
        "kv_bytes_per_token": layout.block_bytes() // layout.block_size,
    }
