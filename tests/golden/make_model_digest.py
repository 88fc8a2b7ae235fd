"""Generate ``model_digest_v1.json``: golden vectors of ``ModelFingerprint.model_digest``.

Run once, from the repository root: ``.venv/bin/python tests/golden/make_model_digest.py``.
The file is checked in and must never be regenerated to make a failing test pass: a change in
these bytes changes what every transfer handshake calls "the same model", which needs a new
spec version (a new tag, a new golden file). ``--force`` exists only while unreleased.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from kvstrata.identity import AdapterIdentity, ModelFingerprint
from kvstrata.identity.fingerprint import PositionalEncoding

OUT = Path(__file__).with_name("model_digest_v1.json")


def base_fingerprint() -> ModelFingerprint:
    """A SmolLM2-shaped fingerprint with fixed, made-up file digests."""
    return ModelFingerprint(
        architecture="LlamaForCausalLM",
        checkpoint_digest="ab" * 32,
        tokenizer_digest="cd" * 32,
        special_tokens=(("bos_token", 1), ("eos_token", 2)),
        chat_template_digest="none",
        adapter=None,
        multimodal_processor=None,
        attention_impl="kvstrata_paged",
        positional=PositionalEncoding(kind="rope", theta=100000.0, scaling="{}"),
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        kv_dtype="float32",
        block_size=16,
        kv_layout="LKHTD",
    )


def cases() -> list[tuple[str, ModelFingerprint]]:
    base = base_fingerprint()
    return [
        ("smollm2_shape_bs16_fp32", base),
        (
            "same_model_bs32_bf16_tp3_rank1",
            dataclasses.replace(
                base, block_size=32, kv_dtype="bfloat16", tp_size=3, tp_rank=1, kv_layout="HTD"
            ),
        ),
        (
            "with_adapter",
            dataclasses.replace(base, adapter=AdapterIdentity("sql-lora", "ef" * 32)),
        ),
    ]


def _as_json(fp: ModelFingerprint) -> dict[str, Any]:
    fields: dict[str, Any] = json.loads(fp.canonical_bytes())
    return fields


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    if OUT.exists() and not args.force:
        print(f"{OUT} exists; refusing to overwrite (see the module docstring)", file=sys.stderr)
        return 1
    vectors = [
        {
            "name": name,
            "fingerprint": _as_json(fp),
            "model_digest": fp.model_digest().hex(),
            "fingerprint_digest": fp.digest().hex(),
        }
        for name, fp in cases()
    ]
    OUT.write_text(json.dumps({"spec": "kvstrata.model.v1", "vectors": vectors}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
