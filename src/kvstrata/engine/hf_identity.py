"""Gather ``ModelFacts`` from a loaded transformers model and tokenizer.

The decision (fingerprint or ``ReuseDisabled``) is made by the pure builder in
``kvstrata.identity``; this module only observes: it digests weight and tokenizer files and
reads the config, special tokens and chat template. File digests are cached beside the files
(keyed by size and mtime) so that re-opening a checkpoint stays well under a second.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from blake3 import blake3

from kvstrata.engine.model_loader import LoadedModel
from kvstrata.identity import (
    AdapterIdentity,
    ModelFacts,
    ModelFingerprint,
    ReuseDisabled,
    build_fingerprint,
)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
_DIGEST_CACHE = ".kvstrata-digests.json"
KV_LAYOUT = "kvstrata.pool.v1[L,2,H,N,B,D]"


def digest_files(paths: list[Path]) -> str:
    """BLAKE3 over (name, size, content) of each file in sorted order; cached by size+mtime."""
    hasher = blake3()
    for path in sorted(paths, key=lambda p: p.name):
        hasher.update(path.name.encode() + b"\x00")
        hasher.update(bytes.fromhex(_file_digest(path)))
    return hasher.hexdigest()


def _file_digest(path: Path) -> str:
    stat = path.stat()
    cache_file = path.parent / _DIGEST_CACHE
    cache: dict[str, Any] = {}
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(path.name)
    stamp = [stat.st_size, stat.st_mtime_ns]
    if isinstance(entry, dict) and entry.get("stamp") == stamp:
        return str(entry["blake3"])
    hasher = blake3(max_threads=blake3.AUTO)
    hasher.update_mmap(path)
    value = hasher.hexdigest()
    cache[path.name] = {"stamp": stamp, "blake3": value}
    tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(cache))
        tmp.replace(cache_file)
    except OSError:
        pass  # read-only checkpoint directory: recompute next time, same answer
    return value


def checkpoint_digest(model_dir: Path) -> str:
    files = [p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES)]
    return digest_files(files) if files else "none"


def tokenizer_digest(model_dir: Path) -> str:
    files = [model_dir / n for n in _TOKENIZER_FILES if (model_dir / n).is_file()]
    return digest_files(files) if files else "none"


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
