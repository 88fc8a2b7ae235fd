"""Gather ``ModelFacts`` from a loaded transformers model and tokenizer.

The decision (fingerprint or ``ReuseDisabled``) is made by the pure builder in
``kvstrata.identity``; this module only observes: it digests weight and tokenizer files and
reads the config, special tokens and chat template. File digests come from the torch-free
``kvstrata.runtime.model_files`` (shared with the vLLM connector).
"""

from __future__ import annotations

from kvstrata.engine.model_loader import LoadedModel
from kvstrata.identity import (
    AdapterIdentity,
    ModelFacts,
    ModelFingerprint,
    ReuseDisabled,
    build_fingerprint,
)
from kvstrata.runtime.model_files import checkpoint_digest, tokenizer_digest

KV_LAYOUT = "kvstrata.pool.v1[L,2,H,N,B,D]"


def model_facts(
    loaded: LoadedModel,
    *,
    block_size: int,
    kv_dtype: str,
    adapter: AdapterIdentity | None = None,
    chat_template: str | None = None,
) -> ModelFacts:
    model, tokenizer = loaded.model, loaded.tokenizer
    config = model.config.to_dict()
    architectures = config.get("architectures") or [type(model).__name__]
    special = {
        str(tok): int(tid)
        for tok, tid in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=True)
    }
    template = (
        chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    )
    return ModelFacts(
        architecture=str(architectures[0]),
        config=config,
        checkpoint_digest=checkpoint_digest(loaded.path),
        tokenizer_digest=tokenizer_digest(loaded.path),
        special_tokens=special,
        chat_template=template if isinstance(template, str) else None,
        attention_impl=str(model.config._attn_implementation),
        kv_dtype=kv_dtype,
        block_size=block_size,
        kv_layout=KV_LAYOUT,
        adapter=adapter,
    )


def fingerprint_model(
    loaded: LoadedModel,
    *,
    block_size: int,
    kv_dtype: str,
    adapter: AdapterIdentity | None = None,
    chat_template: str | None = None,
) -> ModelFingerprint | ReuseDisabled:
    facts = model_facts(
        loaded,
        block_size=block_size,
        kv_dtype=kv_dtype,
        adapter=adapter,
        chat_template=chat_template,
    )
    return build_fingerprint(facts)
