"""Continuous batching is exact: a request in a mixed batch equals the same request alone.

Mixed batches: cached and uncached prompts, prefill chunks beside decodes, different lengths,
preemption when the pool runs out. "Alone" is a fresh engine step loop with nothing else
queued. Greedy tokens must be identical and every step's logits within 1e-4 (fp32).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.generation import Generation
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.engine.sampling import SamplingParams
from kvstrata.engine.verify import run_together
from kvstrata.errors import ContextTooLong, InvalidInput, QueueFull
from kvstrata.runtime.scheduler import SchedulerConfig
from kvstrata.telemetry import KvMetrics

B = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, 40000, size=n)]


def make(model: LoadedModel, *, pool_blocks: int = 256, **scheduler: int) -> ReferenceEngine:
    config = EngineConfig(
        block_size=B, pool_blocks=pool_blocks, scheduler=SchedulerConfig(**scheduler)
    )
    return ReferenceEngine(model, config, metrics=KvMetrics())


def alone(engine: ReferenceEngine, prompt: list[int], params: SamplingParams) -> Generation:
    return engine.generate(prompt, params, use_cache=False, keep_logits=True).run()


def max_diff(a: Generation, b: Generation) -> float:
    return max(
        float((x - y).abs().max()) for x, y in zip(a.step_logits, b.step_logits, strict=True)
    )


def assert_nothing_pinned(engine: ReferenceEngine) -> None:
    assert engine.pool.blocks_available == engine.pool.config.num_blocks
    assert not engine.batch.scheduler.running and not engine.batch.scheduler.waiting


def mixed_prompts() -> list[list[int]]:
    shared = tokens(70, seed=1)
    return [
        shared + tokens(9, seed=2),  # cached prefix (70 tokens) after the warm-up below
        tokens(150, seed=3),  # uncached, several prefill chunks under a 64-token budget
        tokens(5, seed=4),  # shorter than a block
        shared + tokens(40, seed=5),  # shares the prefix with the first
        tokens(33, seed=6),
    ]


@pytest.mark.parametrize("budget", [64, 512])
def test_mixed_batch_equals_each_request_alone(tiny_model: LoadedModel, budget: int) -> None:
    engine = make(tiny_model, max_num_batched_tokens=budget, max_num_seqs=8)
    prompts = mixed_prompts()
    reference = [alone(engine, p, GREEDY) for p in prompts]
    engine.generate(prompts[0][:70], SamplingParams(max_tokens=1)).run()  # cache the prefix
    gens = [engine.generate(p, GREEDY, keep_logits=True) for p in prompts]
    run_together(gens)
    assert gens[0].record.matched_tokens == 64 and gens[3].record.matched_tokens == 64
    assert gens[1].record.matched_tokens == 0
    for ref, got in zip(reference, gens, strict=True):
        assert got.output_ids == ref.output_ids
        assert max_diff(ref, got) <= 1e-4
    batches = engine.metrics.value("kvstrata_batch_sequences_sum")
    steps = engine.metrics.value("kvstrata_batch_sequences_count")
    assert batches / steps > 1.5  # the requests really shared steps
    assert_nothing_pinned(engine)


def test_decode_joins_running_prefill_chunks(tiny_model: LoadedModel) -> None:
    """A request arriving while another decodes is admitted at the next step, not after."""
    engine = make(tiny_model, max_num_batched_tokens=32, max_num_seqs=4)
    first = engine.generate(tokens(20, seed=7), SamplingParams(max_tokens=40, ignore_eos=True))
    it = iter(first)
    for _ in range(3):
        next(it)
    second = engine.generate(tokens(100, seed=8), SamplingParams(max_tokens=2, ignore_eos=True))
    second_it = iter(second)
    next(second_it)  # its four prefill chunks ran beside the first one's decodes
    assert len(first.output_ids) < 40 and not first.done
    first.close()
    second.close()
    engine.step()
    assert first.done and second.done
    assert_nothing_pinned(engine)


def test_preemption_when_the_pool_is_full_stays_exact(tiny_model: LoadedModel) -> None:
    # 14 blocks; four requests of up to 4 blocks each cannot all run at once
    engine = make(tiny_model, pool_blocks=14, max_num_seqs=4, max_num_batched_tokens=256)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = [tokens(30, seed=s) for s in (11, 12, 13, 14)]
    reference = [alone(engine, p, params) for p in prompts]
    gens = [engine.generate(p, params, keep_logits=True) for p in prompts]
    run_together(gens)
    assert engine.metrics.value("kvstrata_preemptions_total") > 0
    for ref, got in zip(reference, gens, strict=True):
        assert got.output_ids == ref.output_ids
        assert max_diff(ref, got) <= 1e-4
    assert_nothing_pinned(engine)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_arrivals_on_a_small_pool_stay_exact(tiny_model: LoadedModel, seed: int) -> None:
    """Staggered arrivals, shared prefixes, chunking and preemption, all at once."""
    rng = np.random.default_rng(seed)
    engine = make(tiny_model, pool_blocks=24, max_num_seqs=6, max_num_batched_tokens=48)
    shared = tokens(40, seed=100 + seed)
    requests = []
    for i in range(10):
        own = tokens(int(rng.integers(1, 45)), seed=1000 * seed + i)
        prompt = (shared[: int(rng.integers(0, 41))] + own)[:80]
        params = SamplingParams(max_tokens=int(rng.integers(3, 20)), ignore_eos=True)
        requests.append((prompt, params))
    reference = [alone(engine, p, q) for p, q in requests]
    gens: list[Generation] = []
    for prompt, params in requests:
        gens.append(engine.generate(prompt, params, keep_logits=True))
        for _ in range(int(rng.integers(0, 4))):
            engine.step()
    run_together(gens)
    for ref, got in zip(reference, gens, strict=True):
        assert got.output_ids == ref.output_ids
        assert max_diff(ref, got) <= 1e-4
    assert_nothing_pinned(engine)


def test_a_request_waits_for_a_prefix_in_flight_instead_of_computing_it_twice(
    tiny_model: LoadedModel,
) -> None:
    # step 1: 64 of the first prompt; step 2: its last 41 (blocks 4, 5 in flight) and, with
    # budget left, the second would compute those blocks again: it is deferred one step
    engine = make(tiny_model, max_num_batched_tokens=64, max_num_seqs=4)
    prefix = tokens(100, seed=40)
    first, second = prefix + tokens(5, seed=41), prefix + tokens(7, seed=42)
    reference = [alone(engine, p, GREEDY) for p in (first, second)]
    before = engine.metrics.value("kvstrata_computed_tokens_total")
    gens = [engine.generate(p, GREEDY, keep_logits=True) for p in (first, second)]
    run_together(gens)
    assert gens[0].record.matched_tokens == 0
    assert gens[1].record.matched_tokens == 96  # the first request's six prefix blocks
    assert engine.metrics.value("kvstrata_admissions_deferred_total") > 0
    computed = engine.metrics.value("kvstrata_computed_tokens_total") - before
    assert computed == len(first) + len(second) - 96
    for ref, got in zip(reference, gens, strict=True):
        assert got.output_ids == ref.output_ids and max_diff(ref, got) <= 1e-4
    assert_nothing_pinned(engine)


def test_cancel_frees_the_sequence_and_keeps_completed_blocks(tiny_model: LoadedModel) -> None:
    engine = make(tiny_model)
    prompt = tokens(40, seed=21)
    gen = engine.generate(prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    it = iter(gen)
    for _ in range(30):  # 40 + 29 computed tokens: four full blocks
        next(it)
    gen.close()
    engine.step()
    assert gen.done and gen.finish_reason == "abort"
    assert_nothing_pinned(engine)
    assert engine.metrics.value("kvstrata_cancelled_requests_total") == 1
    again = engine.generate(prompt + gen.output_ids[:24], SamplingParams(max_tokens=1)).run()
    assert again.record.matched_tokens == 63  # the blocks the cancelled request completed


def test_a_full_queue_refuses_with_retry_after(tiny_model: LoadedModel) -> None:
    engine = make(tiny_model, max_waiting=2, max_num_seqs=1)
    queued = [engine.generate(tokens(10, seed=s), SamplingParams(max_tokens=2)) for s in (1, 2)]
    with pytest.raises(QueueFull) as refused:
        engine.generate(tokens(10, seed=3), SamplingParams(max_tokens=2))
    assert refused.value.retry_after_s >= 1.0
    assert engine.metrics.value("kvstrata_rejected_requests_total") == 1
    assert engine.metrics.value("kvstrata_queue_depth") == 2
    for gen in queued:
        gen.run()
    assert engine.metrics.value("kvstrata_queue_depth") == 0
    engine.generate(tokens(10, seed=3), SamplingParams(max_tokens=2)).run()  # room again


def test_sampled_requests_in_a_batch_keep_their_own_seeded_streams(
    tiny_model: LoadedModel,
) -> None:
    engine = make(tiny_model)
    params = [
        SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True)
        for s in (1, 2, 3)
    ]
    prompts = [tokens(25, seed=30 + i) for i in range(3)]
    reference = [alone(engine, p, q).output_ids for p, q in zip(prompts, params, strict=True)]
    gens = [engine.generate(p, q) for p, q in zip(prompts, params, strict=True)]
    run_together(gens)
    assert [g.output_ids for g in gens] == reference


def test_a_request_larger_than_the_pool_is_refused(tiny_model: LoadedModel) -> None:
    engine = make(tiny_model, pool_blocks=4)
    with pytest.raises(ContextTooLong, match="does not fit the KV pool"):
        engine.generate(tokens(60, seed=1), SamplingParams(max_tokens=10))


def test_a_token_id_outside_the_vocabulary_is_refused_before_it_joins_a_batch(
    tiny_model: LoadedModel,
) -> None:
    """Queued, it would fail the packed forward of every request batched with it."""
    engine = make(tiny_model)
    vocab = int(tiny_model.model.config.vocab_size)
    good = engine.generate(tokens(20, seed=1), SamplingParams(max_tokens=3))
    for bad in ([5, vocab], [5, -1]):
        with pytest.raises(InvalidInput, match="token ids must lie in"):
            engine.generate(bad, SamplingParams(max_tokens=3))
    assert len(good.run().output_ids) == 3


@pytest.mark.slow
def test_smollm2_mixed_batch_equals_alone(smollm2_model: LoadedModel) -> None:
    engine = make(smollm2_model, max_num_batched_tokens=128, max_num_seqs=8)
    prompts = mixed_prompts()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = [alone(engine, p, params) for p in prompts]
    engine.generate(prompts[0][:70], SamplingParams(max_tokens=1)).run()
    gens = [engine.generate(p, params, keep_logits=True) for p in prompts]
    run_together(gens)
    for ref, got in zip(reference, gens, strict=True):
        assert got.output_ids == ref.output_ids
        assert max_diff(ref, got) <= 1e-4
    assert_nothing_pinned(engine)


def test_a_request_that_pinned_blocks_keep_out_waits_without_spinning(
    tiny_model: LoadedModel,
) -> None:
    """A prefill handle pins 6 of 8 blocks and nothing runs: a 3-block request used to be
    admitted, preempt itself at every step and spin the step loop at full speed."""
    engine = make(tiny_model, pool_blocks=8)
    handle = engine.prefill(tokens(96, seed=1))  # 6 blocks, pinned until released
    handle.result()
    gen = engine.generate(tokens(40, seed=2), SamplingParams(max_tokens=8, ignore_eos=True))
    steps = sum(engine.step() for _ in range(200))
    assert steps == 0 and not gen.done and gen.record.preemptions == 0
    handle.release()
    assert len(gen.run().output_ids) == 8
