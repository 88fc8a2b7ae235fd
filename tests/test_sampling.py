"""Sampling on its own: tiny temperatures are greedy, small ones stay finite, seeds are bounded."""

from __future__ import annotations

import pytest
import torch

from kvstrata.engine.sampling import SAMPLING_EPS, SEED_MAX, SEED_MIN, SamplingParams, sample_next
from kvstrata.errors import InvalidInput
from kvstrata.serve import protocol


def _logits(seed: int, scale: float = 30.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(49152, generator=generator) * scale).to(dtype)


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-12, SAMPLING_EPS / 2])
def test_temperatures_below_the_threshold_are_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, top_p=0.5, top_k=3)
    assert params.greedy and params.temperature == 0.0
    params.validate()
    logits = _logits(1)
    assert sample_next(logits, params, torch.Generator().manual_seed(0)) == int(logits.argmax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [SAMPLING_EPS, 1e-4, 1e-3])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_small_temperatures_sample_finite_probabilities(
    temperature: float, dtype: torch.dtype, top_p: float
) -> None:
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=50)
    assert not params.greedy
    for seed in range(4):
        logits = _logits(seed, scale=1e3 if dtype is torch.float32 else 30.0, dtype=dtype)
        token = sample_next(logits, params, torch.Generator().manual_seed(seed))
        # So sharp a distribution is the argmax (unless the two best are within a hair).
        assert token == int(logits.float().argmax())


def test_logits_near_the_float32_limit_do_not_overflow() -> None:
    logits = torch.tensor([3e38, -3e38, 1e38, 0.0])  # / 1e-5 would be inf - inf = nan
    params = SamplingParams(temperature=SAMPLING_EPS)
    assert sample_next(logits, params, torch.Generator().manual_seed(0)) == 0


def test_masked_logits_and_ordinary_temperatures_still_sample() -> None:
    logits = torch.full((8,), float("-inf"))
    logits[2], logits[5] = 1.0, 1.0
    params = SamplingParams(temperature=0.7, seed=5)
    seen = {sample_next(logits, params, torch.Generator().manual_seed(i)) for i in range(64)}
    assert seen == {2, 5}


def test_seed_range_is_what_torch_accepts() -> None:
    assert (protocol.SEED_MIN, protocol.SEED_MAX) == (SEED_MIN, SEED_MAX)
    for seed in (SEED_MIN, -1, 0, SEED_MAX):
        torch.Generator().manual_seed(seed)
        SamplingParams(seed=seed).validate()
    for seed in (SEED_MIN - 1, SEED_MAX + 1):
        with pytest.raises((RuntimeError, ValueError)):
            torch.Generator().manual_seed(seed)
        with pytest.raises(InvalidInput, match="seed"):
            SamplingParams(seed=seed).validate()


def test_negative_temperatures_stay_invalid() -> None:
    with pytest.raises(InvalidInput, match="temperature"):
        SamplingParams(temperature=-1e-9).validate()
