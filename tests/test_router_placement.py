"""Where workers compute (``router.placement``): sharing rules and hostile ``compute`` entries."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.errors import InvalidInput
from kvstrata.fleet.worker_info import WorkerInfo, WorkerProtocolError
from kvstrata.router.placement import ComputePlace, shares_compute
from kvstrata.runtime.processes import split_cpus


def place(
    host: str = "h/boot", device: str = "cpu", cpus: tuple[int, ...] = (0, 1)
) -> ComputePlace:
    return ComputePlace(host=host, device=device, cpus=frozenset(cpus))


def test_one_host_shares_cores_unless_pinned_apart() -> None:
    assert shares_compute(place(cpus=(0, 1)), place(cpus=(1, 2)))
    assert not shares_compute(place(cpus=(0, 1)), place(cpus=(2, 3)))


def test_other_hosts_boots_or_devices_do_not_share() -> None:
    assert not shares_compute(place(), place(host="other/boot"))
    assert not shares_compute(place(), place(host="h/rebooted"))
    assert not shares_compute(place(device="cuda:0"), place(device="cuda:1"))
    assert not shares_compute(place(device="cuda:0"), place())
    assert shares_compute(place(device="cuda:0", cpus=(0,)), place(device="cuda:0", cpus=(5,)))


def test_unknown_places_are_not_shared() -> None:
    assert not shares_compute(None, place())
    assert not shares_compute(place(), None)
    assert not shares_compute(place(host=""), place(host=""))


def test_round_trip() -> None:
    original = place(device="cuda:0", cpus=(3, 1, 2))
    assert ComputePlace.from_json(original.to_json()) == original
    assert original.to_json()["cpus"] == [1, 2, 3]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(json_values)
def test_hostile_entries_are_refused_clearly(body: Any) -> None:
    try:
        parsed = ComputePlace.from_json(body)
    except InvalidInput:
        return
    assert isinstance(parsed.host, str) and isinstance(parsed.device, str)
    assert all(isinstance(c, int) and c >= 0 for c in parsed.cpus)


@pytest.mark.parametrize(
    "compute",
    [[1, 2], {"host": "h", "device": "cpu"}, {"host": "h", "device": "cpu", "cpus": [-1]},
     {"host": "h", "device": "cpu", "cpus": [True]}, {"host": 1, "device": "cpu", "cpus": []}],
)  # fmt: skip
def test_a_worker_info_with_a_bad_compute_entry_is_a_protocol_error(compute: Any) -> None:
    body = {
        "worker_id": "w",
        "epoch": 1,
        "model": "m",
        "fingerprint": "00" * 32,
        "block_size": 16,
        "events_endpoint": "tcp://127.0.0.1:1",
        "compute": compute,
    }
    with pytest.raises(WorkerProtocolError, match="bad /kv/info"):
        WorkerInfo.from_json("http://w", body)
    body["compute"] = place().to_json()
    assert WorkerInfo.from_json("http://w", body).compute == place()
    del body["compute"]
    assert WorkerInfo.from_json("http://w", body).compute is None


def test_split_cpus_gives_disjoint_shares_and_wraps_when_short() -> None:
    assert split_cpus(2, [0, 1]) == [frozenset({0}), frozenset({1})]
    assert split_cpus(2, [3, 0, 1, 2, 4]) == [frozenset({0, 1, 2}), frozenset({3, 4})]
    assert split_cpus(3, [0, 1]) == [frozenset({0}), frozenset({1}), frozenset({0})]
    assert split_cpus(1, [1, 0]) == [frozenset({0, 1})]
    with pytest.raises(ValueError):
        split_cpus(0, [0])
