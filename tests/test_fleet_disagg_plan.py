"""``fleet.disagg.plan``: scripted scenarios on ``WorkerState`` objects (pure, no processes)."""

from __future__ import annotations

from kvstrata.fleet.disagg import DisaggSettings, plan
from kvstrata.fleet.workers import TransferTarget, WorkerInfo, WorkerState, default_profile
from kvstrata.identity.keys import FingerprintDigest
from kvstrata.router.disagg import DisaggConfig
from kvstrata.router.disagg_inputs import Link
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
