"""The qualified local path (issue 14, item 6): the formula's monotonic cases, as properties."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.costs import PrefillModel, smollm2_cpu
from kvstrata.errors import InvalidInput
from kvstrata.router.costs import CostProfile
from kvstrata.router.disagg import Choice, DisaggConfig, DisaggCost, choose

KV_BYTES = 46_080  # SmolLM2-135M fp32: a realistic size; the properties hold for any


def gain(cost: DisaggCost, config: DisaggConfig | None = None) -> float:
    choice = choose(cost, config)
    return choice.cost_local_s - choice.cost_disagg_s


def close_or_above(after: float, before: float) -> bool:
    return after >= before - 1e-9 * max(1.0, abs(before))


models = st.builds(
    PrefillModel,
    overhead_s=st.floats(0, 0.05),
    per_token_s=st.floats(0, 1e-3),
    per_token_ctx_s=st.floats(0, 1e-7),
)
profiles = st.builds(
    CostProfile,
    prefill=models,
    decode_interference_s=st.floats(0, 1e-3),
    decode_step_base_s=st.floats(0, 0.02),
    prefill_chunk_tokens=st.sampled_from([0, 256, 512]),
)
costs = st.builds(
    DisaggCost,
    prompt_tokens=st.integers(1, 16_384),
    decode_cached_tokens=st.integers(0, 16_384),
    prefill_cached_tokens=st.integers(0, 16_384),
    decode_queue_s=st.floats(0, 5),
    prefill_queue_s=st.floats(0, 5),
    decode_profile=profiles,
    prefill_profile=profiles,
    kv_bytes_per_token=st.integers(1_000, 200_000),
    num_layers=st.integers(1, 80),
    link_bytes_per_s=st.floats(1e6, 1e11),
    transfer_latency_s=st.floats(0, 0.05),
    conversion_bytes_per_s=st.one_of(st.just(0.0), st.floats(1e7, 1e11)),
    active_decodes=st.integers(0, 64),
    prefill_step_interference_s=st.floats(0, 0.05),
)
more = st.floats(0.0, 10.0)


@settings(max_examples=300, deadline=None)
@given(costs, more)
def test_a_busier_decode_worker_never_favours_local(cost: DisaggCost, extra: float) -> None:
    busier = [
        replace(cost, decode_queue_s=cost.decode_queue_s + extra),
        replace(cost, active_decodes=cost.active_decodes + 1 + int(extra)),
        replace(cost, prefill_step_interference_s=cost.prefill_step_interference_s + extra),
    ]
    for other in busier:
        assert close_or_above(gain(other), gain(cost))


@settings(max_examples=300, deadline=None)
@given(costs, st.floats(1.0, 1000.0), more)
def test_a_slower_link_or_busier_prefill_worker_never_favours_disagg(
    cost: DisaggCost, factor: float, extra: float
) -> None:
    slower = [
        replace(cost, link_bytes_per_s=cost.link_bytes_per_s / factor),
        replace(cost, transfer_latency_s=cost.transfer_latency_s + extra),
        replace(cost, prefill_queue_s=cost.prefill_queue_s + extra),
        replace(cost, conversion_bytes_per_s=1e9 / factor)
        if cost.conversion_bytes_per_s == 0
        else replace(cost, conversion_bytes_per_s=cost.conversion_bytes_per_s / factor),
    ]
    for other in slower:
        assert close_or_above(gain(cost), gain(other))
        if gain(cost) < -1e-9:  # a clear choice of local (not a tie up to rounding)
            assert choose(other).path == "local"


@settings(max_examples=300, deadline=None)
@given(costs, st.integers(1, 8_192))
def test_a_longer_uncached_prompt_never_favours_local_while_the_decode_queue_hides_it(
    cost: DisaggCost, longer: int
) -> None:
    long = replace(cost, prompt_tokens=cost.prompt_tokens + longer)
    # the documented regime: the decode worker's queue covers the remote path at both lengths
    arrive = choose(replace(long, decode_queue_s=0.0)).ttft_disagg_s
    long = replace(long, decode_queue_s=max(long.decode_queue_s, arrive))
    short = replace(long, prompt_tokens=cost.prompt_tokens)
    assert close_or_above(gain(long), gain(short))
    if gain(short) > 1e-9:  # a clear choice of disagg (not a tie up to rounding)
        assert choose(long).path == "disagg"


@settings(max_examples=200, deadline=None)
@given(costs)
def test_equal_costs_stay_local_and_the_margin_only_removes_disagg(cost: DisaggCost) -> None:
    choice = choose(cost)
    assert (choice.path == "disagg") == (choice.cost_disagg_s < choice.cost_local_s)
    exact = choose(cost, DisaggConfig(min_gain_s=max(0.0, gain(cost))))
    assert exact.path == "local"  # saving exactly the margin is a tie
    assert choice.ttft_local_s <= choice.cost_local_s
    assert choice.ttft_disagg_s <= choice.cost_disagg_s


def test_equal_costs_stay_local() -> None:
    """A one-token prompt behind a decode queue: both paths compute the same one token."""
    zero = CostProfile(prefill=PrefillModel(overhead_s=0.01, per_token_s=1e-3))
    cost = DisaggCost(
        prompt_tokens=1,
        decode_cached_tokens=0,
        prefill_cached_tokens=0,
        decode_queue_s=1.0,
        prefill_queue_s=0.0,
        decode_profile=zero,
        prefill_profile=zero,
        kv_bytes_per_token=KV_BYTES,
        num_layers=30,
        link_bytes_per_s=1e9,
    )
    choice = choose(cost)
    assert choice.ttft_local_s == choice.ttft_disagg_s
    assert choice.path == "local"


def scenario(**overrides: object) -> DisaggCost:
    """SmolLM2 on this CPU's profile for both workers, a 1 GB/s link (as measured in tests)."""
    profile = CostProfile(prefill=smollm2_cpu(), prefill_chunk_tokens=512)
    base = DisaggCost(
        prompt_tokens=4096,
        decode_cached_tokens=0,
        prefill_cached_tokens=0,
        decode_queue_s=0.0,
        prefill_queue_s=0.0,
        decode_profile=profile,
        prefill_profile=profile,
        kv_bytes_per_token=KV_BYTES,
        num_layers=30,
        link_bytes_per_s=1e9,
        transfer_latency_s=1e-3,
        active_decodes=16,
        prefill_step_interference_s=0.02,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def test_the_qualified_local_path_in_its_three_named_cases() -> None:
    loaded = scenario()  # 16 decodes running on the decode worker
    assert choose(loaded).path == "disagg"
    assert choose(replace(loaded, decode_queue_s=2.0)).path == "disagg"
    short: Choice = choose(replace(loaded, prompt_tokens=16))
    assert short.path == "local"  # a short prompt
    idle = choose(scenario(active_decodes=0))
    assert idle.path == "local"  # low load: the transfer only adds time
    slow = choose(replace(loaded, link_bytes_per_s=1e6))
    assert slow.path == "local"  # a slow link
    assert slow.transfer_s > choose(loaded).transfer_s


def test_layer_streaming_hides_the_transfer_behind_the_prefill() -> None:
    cost = scenario(active_decodes=0)
    streamed = choose(cost)
    one_layer = choose(replace(cost, num_layers=1))  # nothing overlaps
    assert streamed.ttft_disagg_s < one_layer.ttft_disagg_s
    hidden = one_layer.ttft_disagg_s - streamed.ttft_disagg_s
    assert hidden <= streamed.transfer_s


def test_invalid_inputs_are_refused() -> None:
    with pytest.raises(InvalidInput):
        scenario(prompt_tokens=0)
    with pytest.raises(InvalidInput):
        scenario(link_bytes_per_s=0.0)
    with pytest.raises(InvalidInput):
        scenario(decode_queue_s=float("nan"))
    with pytest.raises(InvalidInput):
        DisaggConfig(min_gain_s=-1.0)


@settings(max_examples=300, deadline=None)
@given(costs)
def test_shared_compute_never_favours_disagg(cost: DisaggCost) -> None:
    apart, shared = replace(cost, shared_compute=False), replace(cost, shared_compute=True)
    assert close_or_above(gain(apart), gain(shared))
    assert choose(shared).ttft_local_s == choose(apart).ttft_local_s


@settings(max_examples=300, deadline=None)
@given(costs)
def test_on_shared_compute_equal_workers_without_queues_stay_local(cost: DisaggCost) -> None:
    """The same fit, the same cache, no queue on either side, one machine: the remote prefill
    takes the same cycles as a local one and adds a transfer and a last-token forward."""
    same = replace(
        cost,
        prefill_profile=cost.decode_profile,
        prefill_cached_tokens=cost.decode_cached_tokens,
        decode_queue_s=0.0,
        prefill_queue_s=0.0,
        shared_compute=True,
    )
    assert choose(same).path == "local"


def test_a_loaded_decode_worker_gains_nothing_from_a_prefill_worker_on_its_cores() -> None:
    loaded = scenario()  # disagg on separate machines (the named case above)
    assert choose(loaded).path == "disagg"
    shared = choose(replace(loaded, shared_compute=True))
    assert shared.path == "local"
    assert shared.cost_disagg_s > choose(loaded).cost_disagg_s
