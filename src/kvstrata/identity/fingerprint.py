"""ModelFingerprint: every model-side input that can change the KV tensors, and its digest.

The builder is pure: the engine gathers ``ModelFacts`` (file digests, config, tokenizer facts)
and ``build_fingerprint`` decides. Anything it does not understand that could change KV
tensors yields ``ReuseDisabled`` with a reason code — never a guessed fingerprint. The rules
are deliberately a whitelist: a new architecture, RoPE variant or config key must be reviewed
and added here before its KV is ever reused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, NewType

from blake3 import blake3

from kvstrata.identity.keys import FingerprintDigest

FINGERPRINT_SCHEMA_VERSION = 1
_FP_TAG = b"kvstrata.fingerprint.v1\x00"
_MODEL_TAG = b"kvstrata.model.v1\x00"

ModelDigest = NewType("ModelDigest", bytes)
"""32 bytes naming the model alone, whatever the KV representation (see ``model_digest``)."""

REPRESENTATION_FIELDS = frozenset(
    {
        "kv_dtype",
        "block_size",
        "kv_layout",
        "codec_id",
        "codec_version",
        "tp_size",
        "tp_rank",
        "pp_size",
        "pp_stage",
    }
)
"""Fingerprint fields that say how KV is laid out, not which model computed it."""


class ReuseDisabledReason(StrEnum):
    UNKNOWN_ARCHITECTURE = "unknown_architecture"
    UNKNOWN_ROPE_SCALING = "unknown_rope_scaling"
    LENGTH_DEPENDENT_ROPE = "length_dependent_rope"
    SLIDING_WINDOW = "sliding_window"
    UNKNOWN_ATTENTION = "unknown_attention"
    UNKNOWN_CONFIG_KEY = "unknown_config_key"
    UNIDENTIFIED_PROCESSOR = "unidentified_multimodal_processor"
    UNIDENTIFIED_INPUT = "unidentified_model_input"
    QUANTIZED_WEIGHTS = "quantized_weights"
    UNIDENTIFIED_CHECKPOINT = "unidentified_checkpoint"


@dataclass(frozen=True)
class ReuseDisabled:
    """The model or request cannot be identified safely: serve it without any reuse."""

    reason: ReuseDisabledReason
    detail: str


@dataclass(frozen=True)
class AdapterIdentity:
    name: str
    weight_digest: str  # hex BLAKE3 of the adapter's weights


@dataclass(frozen=True)
class ProcessorIdentity:
    name: str
    version: str


@dataclass(frozen=True)
class PositionalEncoding:
    kind: str  # "rope"
    theta: float
    scaling: str  # canonical JSON of the scaling parameters ("null" when none)


@dataclass(frozen=True)
class ModelFingerprint:
    """Canonical, versioned record of what produced a KV tensor. Its digest roots every key."""

    architecture: str
    checkpoint_digest: str
    tokenizer_digest: str
    special_tokens: tuple[tuple[str, int], ...]
    chat_template_digest: str
    adapter: AdapterIdentity | None
    multimodal_processor: ProcessorIdentity | None
    attention_impl: str
    positional: PositionalEncoding
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    block_size: int
    kv_layout: str
    codec_id: str = "identity"
    codec_version: int = 1
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_stage: int = 0
    schema_version: int = FINGERPRINT_SCHEMA_VERSION

    def canonical_bytes(self) -> bytes:
        return json.dumps(
            asdict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=True
        ).encode("ascii")

    def digest(self) -> FingerprintDigest:
        return FingerprintDigest(blake3(_FP_TAG + self.canonical_bytes()).digest())

    def model_canonical_bytes(self) -> bytes:
        fields = {k: v for k, v in asdict(self).items() if k not in REPRESENTATION_FIELDS}
        return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode(
            "ascii"
        )

    def model_digest(self) -> ModelDigest:
        """The digest of the model alone: two layouts of one model (block size, dtype, order,
        codec, TP/PP) share it, so a transfer handshake can tell "another model" from "the same
        model, laid out differently — convert". Block keys stay rooted in ``digest()``.

        Byte-exact spec (version 1)::

            fields  = asdict(fingerprint) minus REPRESENTATION_FIELDS
                      (kv_dtype, block_size, kv_layout, codec_id, codec_version,
                       tp_size, tp_rank, pp_size, pp_stage); schema_version stays
            body    = json.dumps(fields, sort_keys=True, separators=(",", ":"),
                                 ensure_ascii=True) encoded as ASCII
                      (nested records are objects, tuples are arrays, None is null,
                       floats in Python's shortest repr, e.g. 10000.0)
            digest  = BLAKE3-256("kvstrata.model.v1\\0" ‖ body)

        Golden vector: ``tests/golden/model_digest_v1.json``.
        """
        return ModelDigest(blake3(_MODEL_TAG + self.model_canonical_bytes()).digest())


@dataclass(frozen=True)
class ModelFacts:
    """What the engine observed about a loaded model; input of the pure builder."""

    architecture: str
    config: Mapping[str, Any]
    checkpoint_digest: str
    tokenizer_digest: str
    special_tokens: Mapping[str, int]
    chat_template: str | None
    attention_impl: str
    kv_dtype: str
    block_size: int
    kv_layout: str
    adapter: AdapterIdentity | None = None
    multimodal_processor: str | None = None
    multimodal_processor_version: str | None = None
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_stage: int = 0
    extra_model_inputs: tuple[str, ...] = field(default=())


SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM"})
# "kvstrata_paged": the reference engine's SDPA over its paged pool (engine/paged_attention.py)
SUPPORTED_ATTENTION = frozenset({"eager", "sdpa", "kvstrata_paged"})
# RoPE variants whose rotation of position p depends only on p (not on the request length).
POSITION_ONLY_ROPE = frozenset({"default", "linear", "llama3", "yarn"})
# RoPE variants that switch frequencies with the sequence length: a prefix's KV computed in a
# short request differs from the same prefix inside a long one.
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})
# Llama config keys that do not change KV tensors (or are covered by other fingerprint fields).
_LLAMA_BENIGN_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "_name_or_path",
        "_model_name_or_path",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "unk_token_id",
        "use_cache",
        "initializer_range",
        "attention_dropout",
        "tie_word_embeddings",
        "pretraining_tp",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "vocab_size",
        "max_position_embeddings",
        "hidden_act",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_hidden_layers",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "attention_bias",
        "mlp_bias",
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "sliding_window",
        "use_sliding_window",
        "layer_types",
        "id2label",
        "label2id",
        "problem_type",
        "tokenizer_class",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "is_decoder",
        "add_cross_attention",
        "tie_encoder_decoder",
        "cross_attention_hidden_size",
        "prefix",
        "sep_token_id",
        "decoder_start_token_id",
        "task_specific_params",
        "finetuning_task",
        "pruned_heads",
        "torchscript",
        "output_scores",
        "return_dict_in_generate",
        "_attn_implementation_autoset",
        "_attn_implementation",
        "quantization_config",
    }
)


NUMERIC_CONFIG_KEYS = (
    "attention_bias",
    "hidden_act",
    "hidden_size",
    "intermediate_size",
    "max_position_embeddings",
    "mlp_bias",
    "num_attention_heads",
    "pretraining_tp",
    "rms_norm_eps",
    "vocab_size",
)
"""Config keys that change what the same weights compute (a norm's epsilon, the activation,
whether bias tensors are used, the shapes they are read with) and that no other fingerprint
field carries: bound into the fingerprint's ``checkpoint_digest`` (``bound_checkpoint``)."""
_CHECKPOINT_TAG = b"kvstrata.checkpoint.v1\x00"


def bound_checkpoint(weights_digest: str, config: Mapping[str, Any]) -> str:
    """The fingerprint's ``checkpoint_digest``: the weight files' digest bound to the config
    values that decide what those weights compute. Byte-exact::

        numeric = {k: config.get(k) for k in NUMERIC_CONFIG_KEYS}   (absent → null)
        body    = json.dumps(numeric, sort_keys=True, separators=(",", ":"),
                             ensure_ascii=True) as ASCII
        digest  = BLAKE3-256("kvstrata.checkpoint.v1\0" ‖ weights_digest (ASCII) ‖ "\0"
                             ‖ body), hex

    Two directories with the same weights and a different ``rms_norm_eps`` or
    ``hidden_act`` (or a runtime override of them) compute different KV: they used to share
    keys, and one served the other's KV as an exact hit."""
    numeric = {key: config.get(key) for key in NUMERIC_CONFIG_KEYS}
    body = json.dumps(numeric, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    hasher = blake3(_CHECKPOINT_TAG)
    hasher.update(weights_digest.encode("ascii") + b"\x00" + body.encode("ascii"))
    return hasher.hexdigest()


def _digest_text(text: str | None) -> str:
    if text is None:
        return "none"
    return blake3(text.encode("utf-8")).hexdigest()


def _rope(config: Mapping[str, Any]) -> PositionalEncoding | ReuseDisabled:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        return ReuseDisabled(ReuseDisabledReason.UNKNOWN_ROPE_SCALING, f"rope params {params!r}")
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    theta = params.get("rope_theta", config.get("rope_theta"))
    if rope_type in LENGTH_DEPENDENT_ROPE:
        return ReuseDisabled(ReuseDisabledReason.LENGTH_DEPENDENT_ROPE, f"rope_type={rope_type}")
    if rope_type not in POSITION_ONLY_ROPE:
        return ReuseDisabled(ReuseDisabledReason.UNKNOWN_ROPE_SCALING, f"rope_type={rope_type}")
    if theta is None:
        return ReuseDisabled(ReuseDisabledReason.UNKNOWN_ROPE_SCALING, "rope_theta missing")
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta",)}
    return PositionalEncoding(
        kind="rope",
        theta=float(theta),
        scaling=json.dumps(scaling, sort_keys=True, separators=(",", ":")),
    )


def build_fingerprint(facts: ModelFacts) -> ModelFingerprint | ReuseDisabled:
    """Decide whether KV of this model can be identified, and if so, how."""
    config = facts.config
    if facts.architecture not in SUPPORTED_ARCHITECTURES:
        return ReuseDisabled(ReuseDisabledReason.UNKNOWN_ARCHITECTURE, facts.architecture)
    if facts.checkpoint_digest in ("", "none"):  # no weight file we know how to digest
        return ReuseDisabled(ReuseDisabledReason.UNIDENTIFIED_CHECKPOINT, "no weight files")
    unknown = sorted(k for k in config if k not in _LLAMA_BENIGN_KEYS)
    if unknown:
        return ReuseDisabled(ReuseDisabledReason.UNKNOWN_CONFIG_KEY, ",".join(unknown))
    quant = config.get("quantization_config")
    if quant:
        return ReuseDisabled(
            ReuseDisabledReason.QUANTIZED_WEIGHTS, json.dumps(quant, sort_keys=True)
        )
    if config.get("sliding_window") or config.get("use_sliding_window"):
        return ReuseDisabled(
            ReuseDisabledReason.SLIDING_WINDOW, f"sliding_window={config.get('sliding_window')}"
        )
    layer_types = config.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        return ReuseDisabled(ReuseDisabledReason.UNKNOWN_ATTENTION, f"layer_types={layer_types}")
    if facts.attention_impl not in SUPPORTED_ATTENTION:
        return ReuseDisabled(ReuseDisabledReason.UNKNOWN_ATTENTION, facts.attention_impl)
    if facts.multimodal_processor is not None and not facts.multimodal_processor_version:
        return ReuseDisabled(ReuseDisabledReason.UNIDENTIFIED_PROCESSOR, facts.multimodal_processor)
    if facts.extra_model_inputs:
        return ReuseDisabled(
            ReuseDisabledReason.UNIDENTIFIED_INPUT, ",".join(sorted(facts.extra_model_inputs))
        )
    positional = _rope(config)
    if isinstance(positional, ReuseDisabled):
        return positional
    num_heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // num_heads)
    processor = (
        ProcessorIdentity(facts.multimodal_processor, str(facts.multimodal_processor_version))
        if facts.multimodal_processor is not None
        else None
    )
    return ModelFingerprint(
        architecture=facts.architecture,
        checkpoint_digest=bound_checkpoint(facts.checkpoint_digest, config),
        tokenizer_digest=facts.tokenizer_digest,
        special_tokens=tuple(sorted((str(k), int(v)) for k, v in facts.special_tokens.items())),
        chat_template_digest=_digest_text(facts.chat_template),
        adapter=facts.adapter,
        multimodal_processor=processor,
        attention_impl=facts.attention_impl,
        positional=positional,
        num_layers=int(config["num_hidden_layers"]),
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        kv_dtype=facts.kv_dtype,
        block_size=facts.block_size,
        kv_layout=facts.kv_layout,
        tp_size=facts.tp_size,
        tp_rank=facts.tp_rank,
        pp_size=facts.pp_size,
        pp_stage=facts.pp_stage,
    )
