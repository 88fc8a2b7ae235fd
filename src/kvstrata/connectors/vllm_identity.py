"""kvstrata identity for a vLLM engine: a fingerprint from vLLM's model config, a tenant per
``cache_salt``.

The decision stays with the pure builder (``kvstrata.identity.build_fingerprint``): this module
only observes what vLLM loaded (``model_fingerprint``: HF config, weight and tokenizer files,
special tokens, chat template, dtype, block size, parallelism; vLLM is imported there, when
called) and adds the vLLM-specific rules (``vllm_fingerprint``, pure):

- the attention implementation recorded is ``vllm-<version>:<device>:<backend>`` (the builder's
  whitelist knows only the reference engine's ``eager``/``sdpa``, so the facts are checked with
  ``sdpa`` and the true vLLM name replaces it in the fingerprint: the digest names the real
  kernel, and KV of another vLLM version, device or backend never matches);
- devices other than ``cpu``/``cuda``, tensor or pipeline parallelism (each rank would need its
  own keys), quantised weights, LoRA adapters, multimodal processors and speculative decoding
  with a drafter model (EAGLE, MTP, a draft model, Medusa, …: its layers may join the KV cache
  vLLM hands the connector, and its checkpoint is not in the fingerprint) disable reuse;
- speculative decoding with a model-free proposer (``MODEL_FREE_SPECULATION``: n-gram prompt
  lookup, suffix decoding) keeps it: the KV cache holds the target model's layers alone, and
  the scheduler side stores only blocks of accepted tokens (a step's full blocks are counted
  over the request's tokens, which hold no draft; draft positions lie past them and are
  rewritten once their true tokens are computed). The fingerprint does not name the method:
  the blocks are the model's KV, as those of an engine without speculation are.

``cache_salt`` → tenant: every salt is its own tenant namespace (name ``salt-<BLAKE3 of the
salt>``, so the salt itself never reaches disk metadata or events); no salt → ``default``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.identity import (
    DEFAULT_TENANT,
    ModelFacts,
    ModelFingerprint,
    ReuseDisabled,
    ReuseDisabledReason,
    TenantNamespace,
    build_fingerprint,
)
from kvstrata.identity.salts import salt_tenant
from kvstrata.runtime.model_files import checkpoint_digest, tokenizer_digest

KV_LAYOUT = "vllm.kv.v1[block]"
MODEL_FREE_SPECULATION = frozenset({"ngram", "ngram_gpu", "suffix"})
"""``speculative_config.method`` values whose proposer has no layers (module docstring)."""
SUPPORTED_DEVICES = frozenset({"cpu", "cuda"})


def vllm_attention_impl(vllm_version: str, device: str, backend: str = "auto") -> str:
    """The attention name a vLLM fingerprint records: version, device and kernel backend."""
    return f"vllm-{vllm_version}:{device}:{backend}"


@dataclass(frozen=True)
class VllmModelView:
    """What the connector read off vLLM's config (plain values, so tests need no vLLM): the
    same ``ModelFacts`` the reference engine observes (``attention_impl`` names the vLLM
    kernel, ``kv_layout`` is vLLM's, TP/PP and a multimodal processor in their fields), plus
    what only vLLM reports."""

    facts: ModelFacts
    device: str
    quantization: str | None = None
    lora_enabled: bool = False
    speculative: str | None = None
    """The speculative decoding method (``speculative_config.method``), None without one."""


def vllm_fingerprint(view: VllmModelView) -> ModelFingerprint | ReuseDisabled:
    facts = view.facts
    if view.device not in SUPPORTED_DEVICES:
        return ReuseDisabled(ReuseDisabledReason.UNKNOWN_ATTENTION, facts.attention_impl)
    if facts.tp_size != 1 or facts.pp_size != 1:
        detail = f"tp={facts.tp_size} pp={facts.pp_size} (one key space per rank not built)"
        return ReuseDisabled(ReuseDisabledReason.UNIDENTIFIED_INPUT, detail)
    if view.quantization:
        return ReuseDisabled(ReuseDisabledReason.QUANTIZED_WEIGHTS, view.quantization)
    if view.lora_enabled:
        return ReuseDisabled(ReuseDisabledReason.UNIDENTIFIED_INPUT, "LoRA adapters")
    if view.speculative is not None and view.speculative not in MODEL_FREE_SPECULATION:
        detail = f"speculative decoding ({view.speculative}): drafter KV and checkpoint"
        return ReuseDisabled(ReuseDisabledReason.UNIDENTIFIED_INPUT, detail)
    if facts.multimodal_processor is not None:
        return ReuseDisabled(ReuseDisabledReason.UNIDENTIFIED_PROCESSOR, "multimodal model")
    # "sdpa" stands in for the vLLM kernel during the builder's whitelist checks; the real
    # name goes into the fingerprint, so KV of another vLLM version, device or backend differs.
    built = build_fingerprint(dataclasses.replace(facts, attention_impl="sdpa"))
    if isinstance(built, ReuseDisabled):
        return built
    return dataclasses.replace(built, attention_impl=facts.attention_impl)


def tenant_for_salt(cache_salt: str | None, secret: bytes = b"") -> TenantNamespace:
    """The tenant namespace of a request's ``cache_salt`` (``None``/empty: the default)."""
    if not cache_salt:
        return TenantNamespace.for_tenant(DEFAULT_TENANT, secret)
    return TenantNamespace.for_tenant(salt_tenant(cache_salt), secret)


def model_fingerprint(vllm_config: Any, kv_cache_config: Any) -> ModelFingerprint | ReuseDisabled:
    """Observe vLLM's model config and let the pure builder decide (``vllm_fingerprint``)."""
    import vllm  # type: ignore[import-not-found]
    from transformers import AutoTokenizer
    from vllm.platforms import current_platform  # type: ignore[import-not-found]

    model_config = vllm_config.model_config
    model_dir = Path(str(model_config.model))
    tokenizer_dir = Path(str(model_config.tokenizer or model_config.model))
    if not model_dir.is_dir() or not tokenizer_dir.is_dir():
        detail = f"model {model_dir} is not a local directory (its files cannot be digested)"
        return ReuseDisabled(ReuseDisabledReason.UNIDENTIFIED_INPUT, detail)
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        return ReuseDisabled(
            ReuseDisabledReason.UNKNOWN_ATTENTION, f"{len(groups)} KV cache groups (hybrid model)"
        )
    hf_config = model_config.hf_config
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    special = {
        str(tok): int(tid)
        for tok, tid in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=True)
    }
    template = getattr(tokenizer, "chat_template", None)
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    kv_dtype = (
        str(model_config.dtype).removeprefix("torch.") if cache_dtype == "auto" else cache_dtype
    )
    backend = getattr(vllm_config.attention_config, "backend", None)
    architectures = list(getattr(hf_config, "architectures", None) or [])
    parallel = vllm_config.parallel_config
    device = str(current_platform.device_type)
    multimodal = bool(getattr(model_config, "is_multimodal_model", False))
    facts = ModelFacts(
        architecture=str(architectures[0]) if architectures else "unknown",
        config=hf_config.to_dict(),
        checkpoint_digest=checkpoint_digest(model_dir),
        tokenizer_digest=tokenizer_digest(tokenizer_dir),
        special_tokens=special,
        chat_template=template if isinstance(template, str) else None,
        attention_impl=vllm_attention_impl(
            str(vllm.__version__), device, getattr(backend, "name", None) or "auto"
        ),
        kv_dtype=kv_dtype,
        block_size=int(vllm_config.cache_config.block_size),
        kv_layout=KV_LAYOUT,
        multimodal_processor="vllm-multimodal" if multimodal else None,
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
    )
    view = VllmModelView(
        facts,
        device=device,
        quantization=model_config.quantization,
        lora_enabled=vllm_config.lora_config is not None,
        speculative=_speculative_method(vllm_config),
    )
    return vllm_fingerprint(view)


def _speculative_method(vllm_config: Any) -> str | None:
    spec = getattr(vllm_config, "speculative_config", None)
    return None if spec is None else str(getattr(spec, "method", None) or "unknown")
