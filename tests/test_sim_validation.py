"""Non-finite or negative simulator settings are refused, not run.

Review finding: the checks were ``< 0`` / ``<= 0``, which NaN passes: ``--service-noise nan``
never ended, a NaN event lag reordered the event heap, ``--estimate-noise inf`` and
``--host-blocks -5`` were accepted.
"""

from __future__ import annotations

import math

import pytest

from kvstrata.cli.main import main
from kvstrata.errors import InvalidInput
from kvstrata.sim.cluster import SimConfig
from kvstrata.sim.profiles import gpu_a100_8b
from kvstrata.sim.trace import parse_window, prepare
from kvstrata.workloads.mooncake import TraceRequest

BAD = [math.nan, math.inf, -math.inf, -0.5]


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("field", ["event_lag_s", "estimate_noise", "service_noise", "work_weight"])
def test_rates_sigmas_and_lags_must_be_finite_and_non_negative(field: str, value: float) -> None:
    with pytest.raises(InvalidInput, match="finite number >= 0"):
        SimConfig(profile=gpu_a100_8b(), **{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(("device", "host"), [(-1, None), (None, -5)])
def test_block_counts_must_not_be_negative(device: int | None, host: int | None) -> None:
    with pytest.raises(InvalidInput, match="blocks must be >= 0"):
        SimConfig(profile=gpu_a100_8b().with_capacities(device, host))


def test_zero_is_a_valid_setting() -> None:
    config = SimConfig(
        profile=gpu_a100_8b().with_capacities(None, 0),
        event_lag_s=0.0,
        estimate_noise=0.0,
        service_noise=0.0,
        work_weight=0.0,
    )
    assert config.profile.host_blocks == 0


@pytest.mark.parametrize("scale", [math.nan, math.inf, 0.0, -1.0])
def test_rate_scale_must_be_finite_and_positive(scale: float) -> None:
    with pytest.raises(InvalidInput, match="rate scale"):
        prepare([TraceRequest(0, 600, 4, (1,))], scale)


@pytest.mark.parametrize("text", ["nan:10", "0:nan", "inf:", ":inf"])
def test_time_window_bounds_must_be_finite(text: str) -> None:
    with pytest.raises(InvalidInput, match="finite"):
        parse_window(text)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flags",
    [
        ["--service-noise", "nan"],
        ["--estimate-noise", "inf"],
        ["--event-lag", "nan"],
        ["--host-blocks", "-5"],
        ["--device-blocks", "-1"],
        ["--rate-scale", "nan"],
    ],
)
def test_cli_refuses_them_with_a_clear_message(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "--synthetic", "chat", "--limit", "20", "--workers", "2", "--jobs", "1"]
    assert main([*argv, "--policies", "round-robin", "--json", "--quiet", *flags]) == 2
    err = capsys.readouterr().err
    assert ">= 0" in err or "> 0" in err
