"""Generate ``block_keys_v1.json``: golden vectors of the version-1 block key spec (keys.py).

Run once, from the repository root: ``.venv/bin/python tests/golden/make_block_keys.py``.
The file is checked in and must never be regenerated to make a failing test pass: a change in
these bytes is a change of the on-disk identity of every stored block, which needs a new spec
version (new tags, a new golden file), not new vectors. ``--force`` exists only for adding
vectors while the spec is still unreleased.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvstrata.identity.keys import (
    AdapterExtra,
    BlockExtras,
    FingerprintDigest,
    MultimodalExtra,
    TenantNamespace,
    chain_keys,
    content_hash,
    namespace_root,
)

OUT = Path(__file__).with_name("block_keys_v1.json")
FINGERPRINT_DIGEST = bytes(range(32))
TENANT = "acme"
SECRET = b"s3cret"
MM_A = bytes([0xAA]) * 32
MM_B = bytes(range(100, 132))
LORA_DIGEST = bytes(range(32, 64))


def _cases() -> list[dict[str, Any]]:
    lora = AdapterExtra(name="sql-lora", weight_digest=LORA_DIGEST)
    return [
        {"name": "plain_bs4", "block_size": 4, "tokens": list(range(10)), "extras": None},
        {
            "name": "plain_bs16",
            "block_size": 16,
            "tokens": [(i * 7919 + 13) % 151_936 for i in range(40)],
            "extras": None,
        },
        {
            "name": "extreme_ids_bs4",
            "block_size": 4,
            "tokens": [0, 2**32 - 1, 1, 2**31, 65_535, 65_536, 255, 256],
            "extras": None,
        },
        {"name": "partial_only_bs4", "block_size": 4, "tokens": [5, 6, 7], "extras": None},
        {
            "name": "multimodal_and_adapter_bs4",
            "block_size": 4,
            "tokens": [101, 102, 103, 104, 9, 9, 9, 9, 200, 201, 202, 203, 7],
            "extras": [
                BlockExtras(multimodal=(MultimodalExtra(offset=1, mm_hash=MM_A),)),
                None,
                BlockExtras(
                    multimodal=(
                        MultimodalExtra(offset=3, mm_hash=MM_B),
                        MultimodalExtra(offset=0, mm_hash=MM_A),
                    ),
                    adapter=lora,
                ),
            ],
        },
        {
            "name": "adapter_bs16",
            "block_size": 16,
            "tokens": list(range(1000, 1032)),
            "extras": [BlockExtras(adapter=lora), BlockExtras(adapter=lora)],
        },
    ]


def _extras_json(extras: BlockExtras | None) -> dict[str, Any] | None:
    if extras is None:
        return None
    return {
        "multimodal": [{"offset": m.offset, "mm_hash": m.mm_hash.hex()} for m in extras.multimodal],
        "adapter": None
        if extras.adapter is None
        else {"name": extras.adapter.name, "weight_digest": extras.adapter.weight_digest.hex()},
    }


def build() -> dict[str, Any]:
    namespace = TenantNamespace.for_tenant(TENANT, SECRET)
    root = namespace_root(FingerprintDigest(FINGERPRINT_DIGEST), namespace)
    vectors = []
    for case in _cases():
        block_size = case["block_size"]
        tokens = case["tokens"]
        extras = case["extras"]
        keys = chain_keys(root, tokens, block_size, extras)
        n_full = len(tokens) // block_size
        blocks = [tokens[i * block_size : (i + 1) * block_size] for i in range(n_full)]
        vectors.append(
            {
                "name": case["name"],
                "block_size": block_size,
                "tokens": tokens,
                "extras": None if extras is None else [_extras_json(e) for e in extras],
                "keys": [k.hex() for k in keys],
                "content_hashes": [content_hash(b).hex() for b in blocks],
            }
        )
    return {
        "spec": "kvstrata block keys v1 (src/kvstrata/identity/keys.py)",
        "fingerprint_digest": FINGERPRINT_DIGEST.hex(),
        "tenant": TENANT,
        "secret_hex": SECRET.hex(),
        "tenant_salt": namespace.salt.hex(),
        "root": root.hex(),
        "vectors": vectors,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    args = parser.parse_args()
    if OUT.exists() and not args.force:
        print(f"{OUT} exists; golden vectors are generated once (see --help)", file=sys.stderr)
        return 1
    OUT.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
