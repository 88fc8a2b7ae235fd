"""``ModelFingerprint.model_digest``: golden vectors, a from-spec recomputation, invariants."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from blake3 import blake3

from kvstrata.identity import AdapterIdentity, ModelFingerprint
from kvstrata.identity.fingerprint import PositionalEncoding

GOLDEN = json.loads((Path(__file__).parent / "golden" / "model_digest_v1.json").read_text())
REPRESENTATION = (
    "kv_dtype",
    "block_size",
    "kv_layout",
    "codec_id",
    "codec_version",
    "tp_size",
    "tp_rank",
    "pp_size",
    "pp_stage",
)


def _fingerprint(raw: dict[str, Any]) -> ModelFingerprint:
    fields = dict(raw)
    fields["special_tokens"] = tuple((str(k), int(v)) for k, v in fields["special_tokens"])
    fields["positional"] = PositionalEncoding(**fields["positional"])
    if fields["adapter"] is not None:
        fields["adapter"] = AdapterIdentity(**fields["adapter"])
    return ModelFingerprint(**fields)


def _vector(name: str) -> dict[str, Any]:
    return next(v for v in GOLDEN["vectors"] if v["name"] == name)


@pytest.mark.parametrize("vector", GOLDEN["vectors"], ids=lambda v: v["name"])
def test_golden_vectors(vector: dict[str, Any]) -> None:
    fp = _fingerprint(vector["fingerprint"])
    assert fp.model_digest().hex() == vector["model_digest"]
    assert fp.digest().hex() == vector["fingerprint_digest"]  # keys' root is unchanged


@pytest.mark.parametrize("vector", GOLDEN["vectors"], ids=lambda v: v["name"])
def test_recomputed_from_the_spec_text(vector: dict[str, Any]) -> None:
    """blake3 and json alone, following the model_digest docstring byte by byte."""
    fields = {k: v for k, v in vector["fingerprint"].items() if k not in REPRESENTATION}
    body = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    digest = blake3(b"kvstrata.model.v1\x00" + body.encode("ascii")).hexdigest()
    assert digest == vector["model_digest"]


def test_two_layouts_of_one_model_share_the_model_digest_only() -> None:
    a = _vector("smollm2_shape_bs16_fp32")
    b = _vector("same_model_bs32_bf16_tp3_rank1")
    assert a["model_digest"] == b["model_digest"]
    assert a["fingerprint_digest"] != b["fingerprint_digest"]
    assert _vector("with_adapter")["model_digest"] != a["model_digest"]


@pytest.mark.parametrize("name", REPRESENTATION)
def test_every_representation_field_leaves_the_model_digest(name: str) -> None:
    base = _fingerprint(_vector("smollm2_shape_bs16_fp32")["fingerprint"])
    value = getattr(base, name)
    new: Any = value + 1 if isinstance(value, int) else "x"
    changed = dataclasses.replace(base, **{name: new})
    assert changed.model_digest() == base.model_digest()
    assert changed.digest() != base.digest()


@pytest.mark.parametrize(
    "change",
    [
        {"checkpoint_digest": "00" * 32},
        {"tokenizer_digest": "11" * 32},
        {"num_layers": 31},
        {"num_kv_heads": 6},
        {"head_dim": 128},
        {"attention_impl": "sdpa"},
        {"chat_template_digest": "22" * 32},
        {"schema_version": 2},
    ],
    ids=lambda c: next(iter(c)),
)
def test_every_model_field_moves_the_model_digest(change: dict[str, Any]) -> None:
    base = _fingerprint(_vector("smollm2_shape_bs16_fp32")["fingerprint"])
    assert dataclasses.replace(base, **change).model_digest() != base.model_digest()
