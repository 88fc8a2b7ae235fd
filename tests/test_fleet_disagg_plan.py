"""``fleet.disagg.plan``: scripted scenarios on ``WorkerState`` objects (pure, no processes)."""

from __future__ import annotations

import threading
from types import MappingProxyType

from kvstrata.fleet.disagg import DisaggSettings, plan
from kvstrata.fleet.fleet_config import FleetConfig
from kvstrata.fleet.routing import FleetRouting
from kvstrata.fleet.table import Table
from kvstrata.fleet.worker_info import TransferTarget, WorkerInfo
from kvstrata.fleet.workers import WorkerState, default_profile
from kvstrata.identity.keys import FingerprintDigest
from kvstrata.index.core import GlobalIndex
from kvstrata.router.disagg import DisaggConfig
from kvstrata.router.disagg_inputs import Link
from kvstrata.serve.timing import PrefillTiming
from kvstrata.transfer.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")
SETTINGS = DisaggSettings(Link(1e9), DisaggConfig(interference_weight=50.0))


def _state(worker_id: str, *, transfer: bool) -> WorkerState:
    info = WorkerInfo(
        worker_id=worker_id,
        base_url=f"http://{worker_id}",
        epoch=1,
        model="tiny",
        fingerprint=FingerprintDigest(bytes(32)),
        block_size=16,
        events_endpoint="tcp://127.0.0.1:1",
        replay_endpoint=None,
        next_seq=0,
        transfer=TransferTarget("127.0.0.1", 4000, LAYOUT) if transfer else None,
    )
    return WorkerState(info, default_profile(16))


def _busy(state: WorkerState, decodes: int) -> None:
    for i in range(decodes):
        state.begin(f"bg{i}", 8, 0, 0.01, 500, 0.0)
        state.first_token(f"bg{i}", 0.01, alone=False)


def _plan(decode: WorkerState, prefill: list[WorkerState], tokens: int) -> str:
    chosen = plan(
        request_id="r", prompt_tokens=tokens, decode=decode, prefill_workers=prefill,
        matches={}, settings=SETTINGS,
    )  # fmt: skip
    return f"{chosen.path}:{chosen.reason}"


def test_no_prefill_worker_or_no_transfer_port_stays_local() -> None:
    decode, prefill = _state("d0", transfer=True), _state("p0", transfer=False)
    assert _plan(decode, [], 2048) == "local:no_prefill_worker"
    assert _plan(_state("d1", transfer=False), [prefill], 2048) == "local:no_transfer_port"
    prefill.healthy = False
    assert _plan(decode, [prefill], 2048) == "local:no_prefill_worker"


def test_idle_decoder_stays_local_busy_one_disaggregates_long_prompts_only() -> None:
    decode, prefill = _state("d0", transfer=True), _state("p0", transfer=False)
    assert _plan(decode, [prefill], 2048) == "local:cost"
    _busy(decode, 4)
    assert decode.active_decodes() == 4
    assert _plan(decode, [prefill], 2048) == "disagg:cost"
    assert _plan(decode, [prefill], 24) == "local:cost"  # one prefill step either way


def test_the_least_loaded_prefill_worker_is_chosen() -> None:
    decode = _state("d0", transfer=True)
    _busy(decode, 4)
    queued, idle = _state("p0", transfer=False), _state("p1", transfer=False)
    for i in range(3):  # queued prefills, no first token yet
        queued.begin(f"q{i}", 2048, 0, 1.0, 1, 0.0)
    chosen = plan(
        request_id="r", prompt_tokens=2048, decode=decode, prefill_workers=[queued, idle],
        matches={}, settings=SETTINGS,
    )  # fmt: skip
    assert chosen.path == "disagg" and chosen.prefill_worker_id == "p1"
    assert [w for w, _ in chosen.candidates] == ["p0", "p1"]
    assert chosen.candidates[0][1] > chosen.candidates[1][1]
    assert SETTINGS.min_timeout_s <= chosen.timeout_s <= SETTINGS.max_timeout_s


def _routing(decode: WorkerState, prefill: WorkerState) -> FleetRouting:
    """The fleet's routing state over two scripted workers (no processes, no event plane)."""
    routing = FleetRouting.__new__(FleetRouting)
    routing.config = FleetConfig(prefill_urls=frozenset({"http://p0"}), disagg=SETTINGS)
    routing._lock = threading.Lock()
    by_id = {"d0": decode, "p0": prefill}
    routing._table = Table(
        MappingProxyType(by_id), MappingProxyType({"http://d0": "d0", "http://p0": "p0"})
    )
    routing._index = GlobalIndex(FingerprintDigest(bytes(32)), 16)
    return routing


def test_remote_prefills_book_their_compute_on_the_prefill_worker_not_their_ttft() -> None:
    """Each disaggregated request booked its whole predicted TTFT (which holds the prefill
    worker's queue) as prefill seconds there, so the queue estimate doubled per request and
    disaggregation switched off under the load it is for (review finding, stop 35)."""
    decode, prefill = _state("d0", transfer=True), _state("p0", transfer=False)
    _busy(decode, 8)
    routing = _routing(decode, prefill)
    one = prefill.profile().prefill.seconds(2048, 0)
    for k in range(1, 4):
        decode.begin(f"r{k}", 2048, 0, one, 8, 0.0)
        chosen = routing.plan_disagg("d0", f"r{k}", "t", list(range(2048)), record=True)
        assert chosen.path == "disagg", chosen.reason
        assert abs(prefill.queued_prefill_s() - k * one) < 1e-6 * k * one
        assert decode.queued_prefill_s() == 0.0  # the decode worker only waits for its KV
    # and its TTFT is no sample of the decode worker's own prefill of 2,048 tokens
    decode.first_token("r1", 0.3, alone=True)
    assert decode.prefill_fit.samples == 0


def test_a_prefill_worker_learns_the_compute_its_reply_reports() -> None:
    """Its fit learned the reply's whole seconds (the transfer to the decode worker
    included), and only from a prefill that ran alone (stop 39's note): now the compute
    the reply reports, on a busy worker too."""
    decode, prefill = _state("d0", transfer=True), _state("p0", transfer=False)
    _busy(decode, 8)
    routing = _routing(decode, prefill)
    one = prefill.profile().prefill.seconds(2048, 0)
    plans = []
    for k in range(2):  # two at once: neither ran alone
        decode.begin(f"r{k}", 2048, 0, one, 8, 0.0)
        plans.append(routing.plan_disagg("d0", f"r{k}", "t", list(range(2048)), record=True))
    assert all(chosen.path == "disagg" for chosen in plans)
    assert not prefill.running_alone()
    routing.finish_prefill(
        "r0", plans[0], reachable=True, prompt_tokens=2048, seconds=9.0,
        timing=PrefillTiming(3.0, 512),
    )  # fmt: skip
    assert prefill.prefill_fit.samples == 1 and prefill.reports_prefill
    assert prefill.prefill_fit._samples[-1] == (1536, 512, 3.0)  # the compute, not 9 s
    routing.finish_prefill("r1", plans[1], reachable=True, prompt_tokens=2048, seconds=9.0)
    assert prefill.prefill_fit.samples == 1  # a whole-call figure from a reporting worker: no


def test_a_report_claiming_more_matched_tokens_than_the_prompt_is_dropped() -> None:
    decode, prefill = _state("d0", transfer=True), _state("p0", transfer=False)
    _busy(decode, 8)
    routing = _routing(decode, prefill)
    chosen = []
    for k in range(2):  # two at once: the whole-call figure is no fallback either
        decode.begin(f"r{k}", 2048, 0, 1.0, 8, 0.0)
        chosen.append(routing.plan_disagg("d0", f"r{k}", "t", list(range(2048)), record=True))
    routing.finish_prefill(
        "r0", chosen[0], reachable=True, prompt_tokens=100, seconds=1.0,
        timing=PrefillTiming(0.5, 512),
    )  # fmt: skip
    assert prefill.prefill_fit.samples == 0 and not prefill.reports_prefill


def test_queue_wait_is_not_learned_as_decode_interference() -> None:
    """A TTFT behind a queued prefill, with decodes running, was charged entirely to the
    decodes (1.4 s per decode per step where there was none)."""
    state = _state("d0", transfer=False)
    _busy(state, 1)
    alone = state.prefill_fit.model().seconds(512, 0)
    state.begin("ahead", 2048, 0, 4.7, 1, 0.0)
    state.begin("r", 512, 0, alone, 64, 0.0)
    state.first_token("ahead", 4.7, alone=False)
    state.first_token("r", 4.7 + alone, alone=False)
    assert state.interference.apply(state.profile()).interference_s(2048, 4) == 0.0


def test_a_prefill_another_request_joined_is_not_learned_as_alone() -> None:
    """The engine packs a newcomer's first chunk into the step of the running prompt's last
    one, so a prompt that was alone when placed but was joined before its first token took
    longer than its prefill alone. Learning from it biased the fit (stop 38, `bench
    calibrate`: 107–307 ms + 2.0–2.6 ms/token in the router against 96 ms + 1.33 ms/token
    from idle probes, different on the two workers)."""
    state = _state("w0", transfer=False)
    state.begin("a", 512, 0, 0.8, 8, 0.0)
    state.begin("b", 256, 0, 0.4, 8, 0.1)  # placed before a's first token
    state.first_token("a", 1.4, alone=True)
    assert state.prefill_fit.samples == 0
    state.first_token("b", 1.6, alone=False)
    state.finish("a", 1.7, 8, 1.4)
    state.finish("b", 1.8, 8, 1.5)
    state.begin("c", 512, 0, 0.8, 8, 2.0)
    state.first_token("c", 2.8, alone=True)  # nobody joined: its prefill alone
    assert state.prefill_fit.samples == 1


def test_a_request_prefilled_elsewhere_does_not_spoil_a_local_sample() -> None:
    """A disaggregated request is placed on its decode worker (``begin``) before the plan
    sends its prefill elsewhere: it never joined the prefill running there, whose TTFT is
    still a sample of the worker's prefill alone."""
    state = _state("d0", transfer=True)
    state.begin("local", 512, 0, 0.8, 8, 0.0)
    state.begin("remote", 2048, 0, 3.0, 8, 0.1)
    state.prefilled_elsewhere("remote")
    state.first_token("local", 0.9, alone=True)
    assert state.prefill_fit.samples == 1
