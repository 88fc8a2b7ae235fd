"""kvstrata identity for a vLLM engine: a fingerprint from vLLM's model config, a tenant per
``cache_salt``.

The decision stays with the pure builder (``kvstrata.identity.build_fingerprint``): this module
only observes what vLLM loaded (HF config, weight and tokenizer files, special tokens, chat
template, dtype, block size, parallelism) and adds the vLLM-specific rules:

- the attention implementation recorded is ``vllm-<version>:<device>:<backend>`` (the builder's
  whitelist knows only the reference engine's ``eager``/``sdpa``, so the facts are checked with
  ``sdpa`` and the true vLLM name replaces it in the fingerprint: the digest names the real
  kernel, and KV of another vLLM version, device or backend never matches);
- devices other than ``cpu``/``cuda``, tensor or pipeline parallelism (each rank would need its
  own keys), quantised weights, LoRA adapters and multimodal processors disable reuse.

``cache_salt`` → tenant: every salt is its own tenant namespace (name ``salt-<BLAKE3 of the
salt>``, so the salt itself never reaches disk metadata or events); no salt → ``default``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from kvstrata.identity import (
    DEFAULT_TENANT,
    ModelFacts,
    ModelFingerprint,
    ReuseDisabled,
    ReuseDisabledReason,
    TenantNamespace,
    build_fingerprint,
)

KV_LAYOUT = "vllm.kv.v1[block]"
SUPPORTED_DEVICES = frozenset({"cpu", "cuda"})
_SALT_TAG = b"kvstrata.vllm.cache_salt.v1\x00"


@dataclass(frozen=True)
class VllmModelView:
    """What the connector read off vLLM's config (plain values, so tests need no vLLM)."""

    architecture: str
    hf_config: Mapping[str, Any]
    checkpoint_digest: str
    tokenizer_digest: str
    special_tokens: Mapping[str, int]
    chat_template: str | None
    kv_dtype: str
    block_size: int
    vllm_version: str
    device: str
    backend: str = "auto"
    tp_size: int = 1
    pp_size: int = 1
    quantization: str | None = None
    lora_enabled: bool = False
    multimodal: bool = False

    @property
    def attention_impl(self) -> str:
        return f"vllm-{self.vllm_version}:{self.device}:{self.backend}"


def vllm_fingerprint(view: VllmModelView) -> ModelFingerprint | ReuseDisabled:
    if view.device not in SUPPORTED_DEVICES:
        return ReuseDisabled(ReuseDisabledReason.UNKNOWN_ATTENTION, view.attention_impl)
    if view.tp_size != 1 or view.pp_size != 1:
        detail = f"tp={view.tp_size} pp={view.pp_size} (one key space per rank not built)"
        return ReuseDisabled(ReuseDisabledReason.UNIDENTIFIED_INPUT, detail)
    if view.quantization:
        return ReuseDisabled(ReuseDisabledReason.QUANTIZED_WEIGHTS, view.quantization)
    if view.lora_enabled:
        return ReuseDisabled(ReuseDisabledReason.UNIDENTIFIED_INPUT, "LoRA adapters")
    if view.multimodal:
        return ReuseDisabled(ReuseDisabledReason.UNIDENTIFIED_PROCESSOR, "multimodal model")
    facts = ModelFacts(
        architecture=view.architecture,
        config=view.hf_config,
        checkpoint_digest=view.checkpoint_digest,
        tokenizer_digest=view.tokenizer_digest,
        special_tokens=view.special_tokens,
        chat_template=view.chat_template,
        attention_impl="sdpa",  # stands in for the vLLM kernel during the whitelist checks
        kv_dtype=view.kv_dtype,
        block_size=view.block_size,
        kv_layout=KV_LAYOUT,
    )
    built = build_fingerprint(facts)
    if isinstance(built, ReuseDisabled):
        return built
    return dataclasses.replace(built, attention_impl=view.attention_impl)


def tenant_for_salt(cache_salt: str | None, secret: bytes = b"") -> TenantNamespace:
    """The tenant namespace of a request's ``cache_salt`` (``None``/empty: the default)."""
    if not cache_salt:
        return TenantNamespace.for_tenant(DEFAULT_TENANT, secret)
    digest = blake3(_SALT_TAG + cache_salt.encode("utf-8")).hexdigest()[:32]
    return TenantNamespace.for_tenant(f"salt-{digest}", secret)
