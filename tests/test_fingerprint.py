"""ModelFingerprint: every KV-relevant input moves the digest; unknown inputs disable reuse."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from kvstrata.engine.hf_identity import model_facts
from kvstrata.engine.model_loader import LoadedModel, load_model
from kvstrata.identity import (
    AdapterIdentity,
    ModelFacts,
    ModelFingerprint,
    ReuseDisabled,
    ReuseDisabledReason,
    build_fingerprint,
)


@pytest.fixture(scope="module")
def fresh_tiny() -> LoadedModel:
    """A model of our own: engines switch the shared one to their paged attention."""
    return load_model("tiny")


@pytest.fixture()
def facts(fresh_tiny: LoadedModel) -> ModelFacts:
    return model_facts(fresh_tiny, block_size=16, kv_dtype="float32")


def with_config(facts: ModelFacts, **changes: Any) -> ModelFacts:
    config = dict(facts.config)
    config.update(changes)
    return dataclasses.replace(facts, config=config)


def test_tiny_and_fields_are_complete(facts: ModelFacts) -> None:
    fp = build_fingerprint(facts)
    assert isinstance(fp, ModelFingerprint)
    assert fp.architecture == "LlamaForCausalLM"
    assert len(fp.checkpoint_digest) == 64 and len(fp.tokenizer_digest) == 64
    assert fp.positional.kind == "rope" and fp.positional.theta == 10000.0
    assert fp.attention_impl == "sdpa" and fp.kv_dtype == "float32" and fp.block_size == 16
    assert len(fp.digest()) == 32
    assert build_fingerprint(facts) == fp and build_fingerprint(facts).digest() == fp.digest()


@pytest.mark.parametrize(
    "change",
    [
        {"checkpoint_digest": "0" * 64},
        {"tokenizer_digest": "1" * 64},
        {"special_tokens": {"<|im_end|>": 7}},
        {"chat_template": "{{ messages }}"},
        {"adapter": AdapterIdentity("lora-a", "ab" * 32)},
        {"multimodal_processor": "siglip", "multimodal_processor_version": "1.0"},
        {"attention_impl": "eager"},
        {"kv_dtype": "bfloat16"},
        {"block_size": 32},
        {"kv_layout": "NHD"},
        {"tp_size": 2},
        {"tp_rank": 1},
        {"pp_size": 2},
        {"pp_stage": 1},
    ],
)
def test_every_kv_relevant_fact_moves_the_digest(facts: ModelFacts, change: dict[str, Any]) -> None:
    base = build_fingerprint(facts)
    changed = build_fingerprint(dataclasses.replace(facts, **change))
    assert isinstance(base, ModelFingerprint) and isinstance(changed, ModelFingerprint)
    assert changed.digest() != base.digest()


def test_rope_theta_and_known_scaling_move_the_digest(facts: ModelFacts) -> None:
    base = build_fingerprint(facts)
    theta = build_fingerprint(
        with_config(facts, rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
    )
    linear = build_fingerprint(
        with_config(
            facts, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
        )
    )
    assert isinstance(base, ModelFingerprint)
    assert isinstance(theta, ModelFingerprint) and isinstance(linear, ModelFingerprint)
    assert len({base.digest(), theta.digest(), linear.digest()}) == 3


@pytest.mark.parametrize(
    "change",
    [
        {"rms_norm_eps": 1e-5},
        {"hidden_act": "gelu"},
        {"attention_bias": True},
        {"mlp_bias": True},
        {"pretraining_tp": 2},
        {"intermediate_size": 4096},
    ],
)
def test_config_values_that_change_the_forward_move_the_digest(
    facts: ModelFacts, change: dict[str, Any]
) -> None:
    """Same weights, another epsilon / activation / bias use: other KV, so other keys (they
    were "benign" keys that no field carried, and two such models shared every block)."""
    base, changed = build_fingerprint(facts), build_fingerprint(with_config(facts, **change))
    assert isinstance(base, ModelFingerprint)
    assert isinstance(changed, ReuseDisabled) or changed.digest() != base.digest()
    assert isinstance(changed, ReuseDisabled) or changed.model_digest() != base.model_digest()


def test_the_bound_checkpoint_digest_follows_its_spec(facts: ModelFacts) -> None:
    from blake3 import blake3

    from kvstrata.identity.fingerprint import NUMERIC_CONFIG_KEYS

    fp = build_fingerprint(facts)
    assert isinstance(fp, ModelFingerprint)
    numeric = {key: facts.config.get(key) for key in NUMERIC_CONFIG_KEYS}
    body = json.dumps(numeric, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    expected = blake3(
        b"kvstrata.checkpoint.v1\x00" + facts.checkpoint_digest.encode() + b"\x00" + body.encode()
    ).hexdigest()
    assert fp.checkpoint_digest == expected
    assert build_fingerprint(dataclasses.replace(facts, checkpoint_digest="none")) == (
        ReuseDisabled(ReuseDisabledReason.UNIDENTIFIED_CHECKPOINT, "no weight files")
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"rope_parameters": {"rope_type": "wobbly", "rope_theta": 1.0}}, "unknown_rope_scaling"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1.0}},
            "length_dependent_rope",
        ),
        ({"sliding_window": 4096}, "sliding_window"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "unknown_attention"),
        ({"attn_logit_softcapping": 30.0}, "unknown_config_key"),
        ({"quantization_config": {"quant_method": "gguf"}}, "quantized_weights"),
    ],
)
def test_unknown_config_inputs_disable_reuse(
    facts: ModelFacts, change: dict[str, Any], reason: str
) -> None:
    result = build_fingerprint(with_config(facts, **change))
    assert isinstance(result, ReuseDisabled)
    assert result.reason == ReuseDisabledReason(reason)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"architecture": "MambaForCausalLM"}, "unknown_architecture"),
        ({"attention_impl": "flex_attention"}, "unknown_attention"),
        ({"multimodal_processor": "mystery"}, "unidentified_multimodal_processor"),
        ({"extra_model_inputs": ("pixel_values",)}, "unidentified_model_input"),
    ],
)
def test_unknown_model_inputs_disable_reuse(
    facts: ModelFacts, change: dict[str, Any], reason: str
) -> None:
    result = build_fingerprint(dataclasses.replace(facts, **change))
    assert isinstance(result, ReuseDisabled)
    assert result.reason == ReuseDisabledReason(reason)


def test_fingerprint_canonical_encoding_is_stable() -> None:
    """Golden: the canonical bytes of a fixed fingerprint (a silent change would orphan caches)."""
    from kvstrata.identity.fingerprint import PositionalEncoding

    fp = ModelFingerprint(
        architecture="LlamaForCausalLM",
        checkpoint_digest="aa" * 32,
        tokenizer_digest="bb" * 32,
        special_tokens=(("<s>", 1),),
        chat_template_digest="none",
        adapter=None,
        multimodal_processor=None,
        attention_impl="sdpa",
        positional=PositionalEncoding("rope", 10000.0, '{"rope_type":"default"}'),
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        kv_dtype="float32",
        block_size=16,
        kv_layout="L",
    )
    assert fp.digest().hex() == GOLDEN_FP_DIGEST


GOLDEN_FP_DIGEST = "73c4774daec3ac70e8ceff942ef69388d623ad306de1bc3fe25964b099bf9995"
