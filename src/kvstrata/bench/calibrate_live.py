"""``kvstrata bench calibrate``, live side: a real ``kvstrata up`` fleet replaying the slice.

The fleet is started as a user would (``python -m kvstrata.cli.main up --workers N --model
smollm2 --policy P --pool-gib G --host-gib 0``, this checkout's package first on
``PYTHONPATH``) in its own process group, killed as a group at the end. Once the front door's
``/health`` counts every worker, each worker is warmed by a short request of unrelated tokens
(shorter than one engine block, so nothing is cached).

**Probes** (the measured prefill model): before the replay, prompts of random tokens with no
relation to the trace, one at a time on the idle fleet, ``max_tokens = 1``: fresh prompts of
each length in ``PROBE_FRESH`` up to the longest replayed prompt and, for each, the same prompt
extended by ``PROBE_TAIL`` tokens (a hit on the cached prefix). The TTFT of each, with the
tokens the worker reports as cached (``usage.prompt_tokens_details.cached_tokens``), gives
``(new, cached, seconds)`` samples; the command fits them (``kvstrata.costs.fit``) into a
prefill model, HTTP and routing included: what the simulator's TTFT must reproduce. Probe
prompts share nothing with the replay (their tokens come from another generator), so they
leave nothing the replay could hit.

**Replay**: every request is sent at its scaled arrival time (asyncio, one connection each),
``POST /v1/completions`` with the prompt as token ids, ``max_tokens`` = its output tokens,
``ignore_eos``, greedy, streaming; TTFT = send → the first streamed chunk carrying text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

import httpx

from kvstrata.bench.calibrate import TOKEN_HI, TOKEN_LO, LiveRequest, prompt_ids
from kvstrata.bench.foreign_load import own_cpu, own_cpu_use
from kvstrata.bench.servers import (
    counter_totals,
    free_port,
    running_server,
    server_env,
    sigterm_unwinds,
    tail,
)
from kvstrata.errors import InvalidInput
from kvstrata.runtime.placement import PLACED_AT_HEADER, parse_placed_at
from kvstrata.runtime.processes import with_source_first

PROBE_FRESH: Final = (32, 256, 1024, 2048, 4096)
PROBE_TAIL: Final = 16
MODEL_NAME: Final = "smollm2"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LiveResult:
    failures: list[str]
    workers: dict[str, int]
    cached_tokens: int
    prompt_tokens: int
    probes: list[tuple[int, int, float]]
    fleet_ready_s: float
    replay_wall_s: float
    per_request: list[dict[str, Any]]
    """Every replayed request in order: its index and arrival, the worker that served it,
    prompt and cached tokens, its TTFT and the router's prediction of it (None where
    missing), when the front door placed it and when its first token came (wall clock).
    ``bench calibrate --per-request`` prints them: for a closer look at the router's
    predictions."""
    router: list[dict[str, Any]]
    """The front door's ``/fleet/workers`` after the replay: each worker's router view (its
    online prefill fit and decode-step estimate), what its routing decisions were based on."""
    decisions: dict[str, int]
    """``worker/reason`` → routing decisions (the front door's ``/metrics``), this fleet's
    warm-up, probes and replay together."""
    cpu: dict[str, Any] = field(default_factory=dict)
    """CPU seconds the fleet's processes and this one used during the replay
    (``foreign_load.own_cpu_use``: the workers, the front door, the load generator)."""

    @property
    def answered(self) -> list[tuple[str, int, float]]:
        """Per answered request, in request order: (worker that served it, prompt tokens,
        TTFT)."""
        return [
            (row["worker"], row["prompt_tokens"], row["ttft_s"])
            for row in self.per_request
            if row["ttft_s"] is not None
        ]

    @property
    def predicted(self) -> list[tuple[float, float]]:
        """Per answered request the router predicted a TTFT for: (its prediction, the TTFT)."""
        return [
            (row["predicted_ttft_s"], row["ttft_s"])
            for row in self.per_request
            if row["ttft_s"] is not None and row["predicted_ttft_s"] is not None
        ]

    @property
    def placements(self) -> list[tuple[str, float, float]]:
        """Per answered request the front door reported a placement for: (worker, placed
        at, first token at), wall clock."""
        return [
            (row["worker"], row["placed_at"], row["first_token_at"])
            for row in self.per_request
            if row["placed_at"] is not None and row["first_token_at"] is not None
        ]

    @property
    def ttft_s(self) -> list[float]:
        """Per request, in request order; failed requests are left out (see ``failures``)."""
        return [ttft for _, _, ttft in self.answered]


def fleet_command(
    python: str,
    *,
    workers: int,
    port: int,
    policy: str,
    pool_gib: float,
    pin_cpus: bool = True,
    model: str = MODEL_NAME,
) -> list[str]:
    """``kvstrata up``'s command line; ``pin_cpus``: each worker owns its share of the CPUs
    (``--pin-cpus``), as the ``reference-cpu`` profile assumes (one core per worker)."""
    return [
        python, "-m", "kvstrata.cli.main", "up",
        "--workers", str(workers),
        "--port", str(port),
        "--model", model,
        "--policy", policy,
        "--pool-gib", repr(pool_gib),
        "--host-gib", "0",
        "--log-level", "warning",
        *(["--pin-cpus"] if pin_cpus else []),
    ]  # fmt: skip


def _env(tmp: Path, omp_threads: int) -> dict[str, str]:
    return with_source_first(server_env(tmp, omp_threads=omp_threads))


def _body(tokens: list[int], max_tokens: int, model: str) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass(slots=True)
class _Answer:
    ttft_s: float | None = None
    cached: int = 0
    worker: str = "?"
    predicted_s: float | None = None
    placed_at: float | None = None
    """When the front door placed it (its wall clock, ``X-Kvstrata-Placed-At``)."""
    first_token_at: float | None = None
    """When its first token came (this client's wall clock: the same machine's)."""
    error: str | None = None


async def _send(client: httpx.AsyncClient, base: str, body: dict[str, Any]) -> _Answer:
    answer = _Answer()
    started = time.perf_counter()
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            answer.worker = response.headers.get("x-kvstrata-worker", "?")
            answer.predicted_s = _seconds(response.headers.get("x-kvstrata-predicted-ttft-s"))
            answer.placed_at = parse_placed_at(response.headers.get(PLACED_AT_HEADER))
            if response.status_code != 200:
                answer.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return answer
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    answer.error = str(chunk["error"])[:200]
                    return answer
                choices = chunk.get("choices") or []
                if answer.ttft_s is None and choices and choices[0].get("text") is not None:
                    answer.ttft_s = time.perf_counter() - started
                    answer.first_token_at = time.time()
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    answer.cached = int(details.get("cached_tokens") or 0)
    except httpx.HTTPError as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    if answer.ttft_s is None and answer.error is None:
        answer.error = "no token streamed"
    return answer


def _random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def probe_lengths(max_prompt_tokens: int) -> tuple[int, ...]:
    """Fresh probe lengths: ``PROBE_FRESH`` up to ``max_prompt_tokens`` (at least two)."""
    lengths = tuple(n for n in PROBE_FRESH if n <= max_prompt_tokens)
    return lengths if len(lengths) >= 2 else PROBE_FRESH[:2]


async def _probe(
    client: httpx.AsyncClient,
    base: str,
    rounds: int,
    lengths: Sequence[int],
    say: Callable[[str], None],
    model: str,
) -> list[tuple[int, int, float]]:
    rng = random.Random(0xC0FFEE)
    samples: list[tuple[int, int, float]] = []
    for _ in range(rounds):
        for length in lengths:
            prompt = _random_tokens(rng, length)
            for tokens in (prompt, prompt + _random_tokens(rng, PROBE_TAIL)):
                answer = await _send(client, base, _body(tokens, 1, model))
                if answer.ttft_s is None:
                    raise InvalidInput(f"probe failed: {answer.error}")
                samples.append((len(tokens) - answer.cached, answer.cached, answer.ttft_s))
                say(f"probe: {len(tokens)} tokens, {answer.cached} cached: {answer.ttft_s:.3f} s")
    return samples


async def _time_points(
    client: httpx.AsyncClient,
    base: str,
    points: Sequence[tuple[int, int]],
    repeats: int,
    say: Callable[[str], None],
    model: str,
) -> list[tuple[int, int, tuple[float, ...]]]:
    rng = random.Random(0x5EED)
    samples: list[tuple[int, int, tuple[float, ...]]] = []
    for new, cached in points:
        timings: list[float] = []
        for _ in range(repeats):  # fresh random tokens each time: no repeat hits an earlier one
            prefix = _random_tokens(rng, cached)
            if cached:  # stored by this untimed request, hit by the timed one
                stored = await _send(client, base, _body(prefix, 1, model))
                if stored.ttft_s is None:
                    raise InvalidInput(f"point {cached}+{new}: the prefix failed: {stored.error}")
            answer = await _send(client, base, _body(prefix + _random_tokens(rng, new), 1, model))
            if answer.ttft_s is None:
                raise InvalidInput(f"point {cached}+{new} failed: {answer.error}")
            if answer.cached != cached:
                raise InvalidInput(
                    f"point {cached}+{new}: the worker reported {answer.cached} cached tokens"
                )
            timings.append(answer.ttft_s)
        say(f"served: {cached}+{new}: " + ", ".join(f"{t:.4f}" for t in timings) + " s")
        samples.append((new, cached, tuple(timings)))
    return samples


async def _replay(
    client: httpx.AsyncClient,
    base: str,
    requests: Sequence[LiveRequest],
    block_tokens: int,
    say: Callable[[str], None],
    model: str,
) -> list[_Answer]:
    bodies = [_body(prompt_ids(r, block_tokens), r.output_tokens, model) for r in requests]
    start = time.perf_counter()

    async def one(i: int) -> _Answer:
        delay = requests[i].arrival_s - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        answer = await _send(client, base, bodies[i])
        if (i + 1) % 10 == 0:
            say(f"replay: request {i + 1}/{len(requests)} answered")
        return answer

    return list(await asyncio.gather(*(one(i) for i in range(len(requests)))))


async def _wait_workers(base: str, workers: int, model: str) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as client:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                health = (await client.get(f"{base}/health")).json()
                if int(health.get("workers", 0)) >= workers:
                    warm = random.Random(7)
                    bodies = [_body(_random_tokens(warm, 8), 2, model) for _ in range(workers)]
                    await asyncio.gather(*(_send(client, base, body) for body in bodies))
                    return
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.5)
    raise InvalidInput(f"the fleet did not report {workers} healthy workers within 300 s")


def _client() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(900.0, connect=30.0))


async def _with_client(work: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
    """``work`` on one client (``_client``), closed when it ends."""
    async with _client() as client:
        return await work(client)


def _seconds(value: str | None) -> float | None:
    """A header's positive, finite number of seconds, else None (diagnostics only)."""
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def _router_state(
    base: str, say: Callable[[str], None]
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The front door's ``/fleet/workers`` and its decisions by worker and reason; empty (and
    said) when either cannot be read: diagnostics, never a reason to lose a replay."""
    try:
        workers = httpx.get(f"{base}/fleet/workers", timeout=30.0)
        metrics = httpx.get(f"{base}/metrics", timeout=30.0)
        workers.raise_for_status()
        metrics.raise_for_status()
        return list(workers.json()["workers"]), _decisions(metrics.text)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        say(f"calibrate: the router's state could not be read: {exc!r}")
        return [], {}


def _decisions(exposition: str) -> dict[str, int]:
    """``worker/reason`` → count of the router's decisions in a ``/metrics`` page."""
    totals = counter_totals(exposition, "kvstrata_router_decisions", ("worker", "reason"))
    return {key: int(value) for key, value in totals.items()}


@dataclass(frozen=True, slots=True)
class LiveFleet:
    """A running fleet (``live_fleet``): probe it, replay on it."""

    base: str
    workers: int
    ready_s: float
    say: Callable[[str], None]
    model: str = MODEL_NAME

    def probe(self, rounds: int, max_prompt_tokens: int) -> list[tuple[int, int, float]]:
        """``(new, cached, seconds)`` samples (module docstring); [] for 0 rounds."""
        if not rounds:
            return []
        lengths = probe_lengths(max_prompt_tokens)
        return asyncio.run(
            _with_client(lambda c: _probe(c, self.base, rounds, lengths, self.say, self.model))
        )

    def time_points(
        self, points: Sequence[tuple[int, int]], repeats: int
    ) -> list[tuple[int, int, tuple[float, ...]]]:
        """``(new, cached, timings)`` per ``(new, cached)`` point: the TTFTs of ``repeats``
        requests of ``max_tokens = 1`` on the idle fleet, each on fresh random tokens;
        ``cached > 0`` points first send the ``cached``-token prefix (untimed, stored) and
        check the timed request hit exactly that many tokens."""
        return asyncio.run(
            _with_client(
                lambda c: _time_points(c, self.base, points, repeats, self.say, self.model)
            )
        )

    def replay(
        self,
        requests: Sequence[LiveRequest],
        block_tokens: int,
        probes: Sequence[tuple[int, int, float]] = (),
    ) -> LiveResult:
        started, cpu = time.perf_counter(), own_cpu()
        answers = asyncio.run(
            _with_client(
                lambda c: _replay(c, self.base, requests, block_tokens, self.say, self.model)
            )
        )
        wall = time.perf_counter() - started
        cpu_use = own_cpu_use(cpu, own_cpu(), wall)
        router, decisions = _router_state(self.base, self.say)
        served: dict[str, int] = {}
        for answer in answers:
            served[answer.worker] = served.get(answer.worker, 0) + 1
        return LiveResult(
            failures=[f"#{i}: {a.error}" for i, a in enumerate(answers) if a.error is not None],
            workers=served,
            cached_tokens=sum(a.cached for a in answers),
            prompt_tokens=sum(r.prompt_tokens for r in requests),
            probes=list(probes),
            fleet_ready_s=self.ready_s,
            replay_wall_s=wall,
            per_request=[
                {
                    "index": r.index,
                    "arrival_s": r.arrival_s,
                    "worker": a.worker,
                    "prompt_tokens": r.prompt_tokens,
                    "cached_tokens": a.cached,
                    "ttft_s": a.ttft_s,
                    "predicted_ttft_s": a.predicted_s,
                    "placed_at": a.placed_at,
                    "first_token_at": a.first_token_at,
                }
                for a, r in zip(answers, requests, strict=True)
            ],
            router=router,
            decisions=decisions,
            cpu=cpu_use,
        )


@contextlib.contextmanager
def live_fleet(
    *,
    workers: int,
    policy: str,
    pool_gib: float,
    omp_threads: int = 1,
    pin_cpus: bool = True,
    python: str | None = None,
    say: Callable[[str], None] | None = None,
    model: str = MODEL_NAME,
) -> Iterator[LiveFleet]:
    """Start ``kvstrata up`` (module docstring), wait for every worker, warm it; always kill
    its process group on the way out."""
    log_line = say or (lambda line: print(line, file=sys.stderr, flush=True))
    port = free_port()
    with sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="kvstrata-calibrate-") as raw:
        tmp = Path(raw)
        log = tmp / "fleet.log"
        command = fleet_command(
            python or sys.executable,
            workers=workers,
            port=port,
            policy=policy,
            pool_gib=pool_gib,
            pin_cpus=pin_cpus,
            model=model,
        )
        started = time.perf_counter()
        with running_server(command, _env(tmp, omp_threads), log, port, name="fleet") as base:
            try:
                asyncio.run(_wait_workers(base, workers, model))
            except InvalidInput as exc:
                raise InvalidInput(f"{exc}\nfleet log:\n{tail(log)}") from exc
            ready_s = time.perf_counter() - started
            log_line(f"calibrate: fleet of {workers} up in {ready_s:.1f} s")
            yield LiveFleet(base, workers, ready_s, log_line, model)
