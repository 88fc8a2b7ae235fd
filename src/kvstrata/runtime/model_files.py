"""Digests of a model's weight and tokenizer files: the checkpoint half of its identity.

Every engine adapter (the reference engine, the vLLM connector) fingerprints the files it
serves from the same way, so one checkpoint has one digest everywhere. BLAKE3 over (name,
size, content) in sorted order; each file's digest is cached beside it keyed by size and
mtime, so re-opening a checkpoint does not re-read gigabytes. No torch here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from blake3 import blake3

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
