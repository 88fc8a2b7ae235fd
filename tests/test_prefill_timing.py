"""A worker reports each request's own prefill compute time, and the router learns from it.

The engine splits every step's measured time over the sequences in it by the cost model's
price of each part (``BatchRunner._attribute``); the worker sends the sum up to a request's
first token as a header (non-streamed) or, when the front door asks, as an SSE comment in
front of the first token (``serve.timing``); the front door takes the comment out and refits
the worker's prefill model from the figure, also for a request that shared its steps.
Real tiny-model worker and front door under uvicorn.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from http_helpers import tiny_fleet
from kvstrata.costs import OnlinePrefillFit, PrefillModel
from kvstrata.engine.batch import BatchRunner
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.fleet.answers import head_timing, stream_head
from kvstrata.fleet.fleet import Fleet
from kvstrata.fleet.vllm_workers import router_fingerprint
from kvstrata.fleet.worker_info import WorkerInfo
from kvstrata.fleet.workers import WorkerState, default_profile
from kvstrata.runtime.config import ServeLimits
from kvstrata.serve.app import PREFILL_HEADER
from kvstrata.serve.timing import (
    COMPUTE_HEADER,
    MATCHED_HEADER,
    TIMING_REQUEST_HEADER,
    PrefillTiming,
    from_headers,
    take_timing,
    timing_comment,
)

MODEL = "tiny"
pytestmark = pytest.mark.timeout(300)


# ---- the engine's split of a step ------------------------------------------------------------
def _seq(num_computed: int = 0, decoding: bool = False) -> Any:
    return SimpleNamespace(
        num_computed=num_computed,
        compute_s=0.0,
        gen=SimpleNamespace(output_ids=[7] if decoding else []),
    )


def _attribute(model: PrefillModel, work: list[tuple[Any, int]], step_s: float) -> None:
    BatchRunner._attribute(SimpleNamespace(costs=OnlinePrefillFit(model)), work, step_s)  # type: ignore[arg-type]


def test_a_part_alone_in_its_step_gets_the_measured_step() -> None:
    seq = _seq(num_computed=64)
    _attribute(PrefillModel(overhead_s=0.1, per_token_s=0.01), [(seq, 100)], 2.5)
    assert seq.compute_s == pytest.approx(2.5)


def test_parts_sharing_a_step_get_their_own_price_scaled_by_the_step() -> None:
    model = PrefillModel(overhead_s=0.1, per_token_s=0.01, per_token_ctx_s=1e-5)
    a, b, decode = _seq(), _seq(num_computed=200), _seq(num_computed=500, decoding=True)
    work = [(a, 100), (b, 300), (decode, 1)]
    price = model.seconds(100) + model.marginal_s(300, 200) + model.marginal_s(1, 500)
    _attribute(model, work, 2 * price)  # the step took twice what the model says
    assert a.compute_s == pytest.approx(2 * model.seconds(100))
    assert b.compute_s == pytest.approx(2 * model.seconds(300, 200))
    assert decode.compute_s == 0.0  # past its first token: nothing to learn from
    _attribute(model, [(a, 50)], 0.3)  # the next chunk of ``a``, alone: added
    assert a.compute_s == pytest.approx(2 * model.seconds(100) + 0.3)


def test_a_model_that_prices_nothing_splits_the_step_evenly() -> None:
    a, b = _seq(), _seq()
    _attribute(PrefillModel(per_token_s=0.0), [(a, 10), (b, 20)], 1.0)
    assert a.compute_s == b.compute_s == pytest.approx(0.5)


# ---- the wire format -------------------------------------------------------------------------
def test_the_comment_round_trips_and_is_taken_out_whole() -> None:
    data = b'data: {"choices":[{"text":"x"}]}\n\n'
    chunk = timing_comment(0.4123754, 512).encode() + data
    assert take_timing(chunk) == (data, PrefillTiming(0.412375, 512))
    assert take_timing(data) == (data, None)


@pytest.mark.parametrize(
    "comment",
    [
        b": kvstrata-timing prefill-compute-s=0 matched-tokens=5\n\n",  # not positive
        b": kvstrata-timing prefill-compute-s=9999.5 matched-tokens=5\n\n",  # over an hour
        b": kvstrata-timing prefill-compute-s=1.2.3 matched-tokens=5\n\n",  # not a number
    ],
)
def test_a_broken_comment_is_removed_and_teaches_nothing(comment: bytes) -> None:
    data = b"data: {}\n\n"
    assert take_timing(comment + data) == (data, None)


@pytest.mark.parametrize(
    ("compute", "matched", "expected"),
    [
        ("0.25", "16", PrefillTiming(0.25, 16)),
        ("nan", "16", None),
        ("inf", "16", None),
        ("-1", "16", None),
        ("0.25", "-3", None),
        ("0.25", "1.5", None),
        (None, "16", None),
        ("0.25", None, None),
    ],
)
def test_header_values(compute: str | None, matched: str | None, expected: Any) -> None:
    assert from_headers(compute, matched) == expected


async def _aiter(chunks: list[bytes]) -> Any:
    for chunk in chunks:
        yield chunk


ROLE = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'


def test_a_comment_alone_is_not_a_first_token_and_leaves_the_head() -> None:
    comment = timing_comment(0.5, 0).encode()
    head, first_at = asyncio.run(stream_head(_aiter([ROLE, comment, TOKEN, b"data: [DONE]\n\n"])))
    assert head == [ROLE, comment, TOKEN] and first_at is not None
    assert head_timing(head) == ([ROLE + TOKEN], PrefillTiming(0.5, 0))
    assert head_timing([ROLE]) == ([ROLE], None)


def test_the_head_and_its_comment_are_found_wherever_the_reads_split_them() -> None:
    """Over a network, one write may arrive in several reads: every split point."""
    stream = ROLE + timing_comment(0.5, 3).encode() + TOKEN + b"data: [DONE]\n\n"
    first_token_ends = len(ROLE) + len(timing_comment(0.5, 3)) + len(TOKEN)
    for cut in range(1, len(stream)):
        reads = [stream[:cut], stream[cut:]]
        head, first_at = asyncio.run(stream_head(_aiter(reads)))
        assert first_at is not None, cut
        assert len(b"".join(head)) >= first_token_ends, cut  # not before the whole token
        relayed, timing = head_timing(head)
        assert timing == PrefillTiming(0.5, 3), cut
        rest = stream[len(b"".join(head)) :]
        assert b"".join(relayed) + rest == ROLE + TOKEN + b"data: [DONE]\n\n", cut


def test_a_stream_with_crlf_line_ends_still_has_a_first_token() -> None:
    crlf = [ROLE.replace(b"\n", b"\r\n"), TOKEN.replace(b"\n", b"\r\n"), b"data: [DONE]\r\n\r\n"]
    head, first_at = asyncio.run(stream_head(_aiter(crlf)))
    assert head == crlf[:2] and first_at is not None


# ---- the router's side: what a worker state learns from -----------------------------------
def _worker() -> WorkerState:
    info = WorkerInfo(
        "w0", "http://h", 1, "m", router_fingerprint("m", 16), 16, "tcp://h:1", None, 0
    )  # fmt: skip
    return WorkerState(info, default_profile(16))


def _alone_request(state: WorkerState, request_id: str, at: float) -> None:
    state.begin(request_id, 256, 0, 0.5, 16, now=at)


def test_a_reporting_worker_teaches_the_overhead_and_never_the_fit_from_ttfts() -> None:
    state = _worker()
    for i in range(5):
        _alone_request(state, f"r{i}", at=10.0 * i)
        state.observe_prefill(f"r{i}", 256, 0, 0.40)
        state.first_token(f"r{i}", 10.0 * i + 0.40 + 0.01 * (i + 1), alone=True)
        state.finish(f"r{i}", 10.0 * i + 1.0, completion_tokens=2, ttft_s=0.4)
    assert state.prefill_fit.samples == 5  # the reports, not the TTFTs
    assert state.serving_overhead_s == pytest.approx(0.03)  # median of 10..50 ms
    fit = state.prefill_fit.model()
    priced = state.prefill_model()
    assert priced.overhead_s == pytest.approx(fit.overhead_s + 0.03)
    assert priced.per_token_s == fit.per_token_s
    _alone_request(state, "quiet", at=100.0)  # a stream that reported nothing (an error)
    state.first_token("quiet", 100.001, alone=True)
    assert state.prefill_fit.samples == 5 and state.serving_overhead_s == pytest.approx(0.03)


def test_a_worker_that_reports_nothing_teaches_the_fit_from_alone_ttfts() -> None:
    state = _worker()  # a vLLM server: no report ever
    _alone_request(state, "a", at=0.0)
    state.first_token("a", 0.5, alone=True)
    _alone_request(state, "b", at=1.0)
    state.first_token("b", 1.7, alone=False)  # placed beside another: not a sample
    assert state.prefill_fit.samples == 1 and state.serving_overhead_s == 0.0


# ---- a real worker and front door ------------------------------------------------------------
@dataclass
class Served:
    fleet: Fleet
    worker: httpx.Client
    front: httpx.Client


@pytest.fixture(scope="module")
def served(tiny_model: LoadedModel) -> Iterator[Served]:
    limits = ServeLimits(max_tokens=256)
    with tiny_fleet(tiny_model, worker_id="timing:1", limits=limits) as tiny:
        yield Served(tiny.fleet, tiny.worker, tiny.front)


GREEDY = {"ignore_eos": True, "temperature": 0.0}


def _body(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream, **GREEDY}


def _samples(served: Served) -> int:
    (view,) = served.fleet.worker_views()
    return view.prefill_samples


def test_a_worker_reports_its_own_prefill_time_only_when_asked(served: Served) -> None:
    body = _body("the worker reports its timing " * 4, 3, stream=True)
    plain = served.worker.post("/v1/completions", json=body).content
    asked = served.worker.post(
        "/v1/completions", json=body, headers={TIMING_REQUEST_HEADER: "1"}
    ).content
    assert b"kvstrata-timing" not in plain
    events = asked.split(b"\n\n")
    assert events[0].startswith(b": kvstrata-timing ")  # in front of the first token
    rest, timing = take_timing(asked)
    assert timing is not None and 0 < timing.compute_s < 60
    assert timing.matched_tokens > 0  # the same prompt again: its blocks were cached
    assert rest.count(b"data:") == plain.count(b"data:")
    answer = served.worker.post("/v1/completions", json={**body, "stream": False})
    reported = from_headers(answer.headers.get(COMPUTE_HEADER), answer.headers[MATCHED_HEADER])
    assert reported is not None
    assert reported.compute_s <= float(answer.headers[PREFILL_HEADER])


def test_the_front_door_learns_from_a_stream_that_shared_its_steps(served: Served) -> None:
    """A request placed beside one in flight is not "alone": from its TTFT the router
    learned nothing, so on a busy worker the prefill model kept its prior."""
    before = _samples(served)
    long = _body("a long answer keeps the worker busy", 200, stream=True)
    with served.front.stream("POST", "/v1/completions", json=long) as running:
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # it is decoding now
        beside = served.front.post(
            "/v1/completions", json=_body("placed beside a running request", 2, stream=True)
        )
        assert beside.status_code == 200
        assert float(beside.headers["x-kvstrata-predicted-ttft-s"]) > 0
        assert b"kvstrata-timing" not in beside.content  # taken out on the way
        assert beside.content.endswith(b"data: [DONE]\n\n")
        assert _samples(served) == before + 2  # the running one and the one beside it
        rest = list(lines)
    assert not any("kvstrata-timing" in line for line in rest)
    answer = served.front.post("/v1/completions", json=_body("not streamed", 2, stream=False))
    assert answer.status_code == 200 and _samples(served) == before + 3
    (view,) = served.fleet.worker_views()
    assert math.isfinite(view.prefill_model.spread)
    assert view.serving_overhead_s > 0  # the running one ran alone: TTFT − its compute
