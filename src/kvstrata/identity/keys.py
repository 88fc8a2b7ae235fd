"""Chained, content-addressed block keys: the byte-exact identity spec of kvstrata.

Spec (version 1, H = BLAKE3 with a 32-byte output, integers little-endian):

    root(fp, ns)   = H("kvstrata.root.v1\\0"    ‖ fp_digest[32] ‖ u32(len(salt)) ‖ salt)
    key_0          = H("kvstrata.block.v1\\0"   ‖ root[32] ‖ u32(n) ‖ u32 token ids… ‖ extras)
    key_i          = H("kvstrata.block.v1\\0"   ‖ key_{i-1}[32] ‖ u32(n) ‖ u32 token ids… ‖ extras)
    content(block) = H("kvstrata.content.v1\\0" ‖ u32(n) ‖ u32 token ids…)
    extras         = u32(count) ‖ entries sorted by their encoded bytes, where
                     mm entry      = 0x01 ‖ u32(offset in block) ‖ mm_hash[32]
                     adapter entry = 0x02 ‖ u32(len(name)) ‖ utf8(name) ‖ weight_digest[32]

Only full blocks get keys. A ``BlockKey`` names a whole prefix (it is chained through its
parent); a ``ContentHash`` names one block's tokens regardless of position. They are distinct
types and never compared with each other. Golden vectors live in ``tests/golden/``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import numpy as np
from blake3 import blake3

from kvstrata.errors import IdentityError

BlockKey = NewType("BlockKey", bytes)
"""Chained key of the prefix that ends with this block (32 bytes)."""

ContentHash = NewType("ContentHash", bytes)
"""Hash of one block's tokens alone, not chained (32 bytes)."""

NamespaceRoot = NewType("NamespaceRoot", bytes)
"""Parent of key_0: binds a chain to one model fingerprint and one tenant namespace."""

FingerprintDigest = NewType("FingerprintDigest", bytes)
"""Digest of a ``ModelFingerprint`` (32 bytes)."""

KEY_BYTES = 32
_ROOT_TAG = b"kvstrata.root.v1\x00"
_BLOCK_TAG = b"kvstrata.block.v1\x00"
_CONTENT_TAG = b"kvstrata.content.v1\x00"
_TENANT_TAG = b"kvstrata.tenant.v1\x00"
_MAX_TOKEN = 2**32 - 1
_MASK64 = (1 << 64) - 1
_U32 = struct.Struct("<I")


def _u32(value: int) -> bytes:
    return _U32.pack(value)


@dataclass(frozen=True)
class TenantNamespace:
    """A tenant's namespace: its name (for metrics and audit) and the salt mixed into keys.

    The salt is derived from the tenant name and a deployment secret, so that a tenant who
    does not know the secret cannot compute another tenant's keys.
    """

    name: str
    salt: bytes

    @classmethod
    def for_tenant(cls, name: str, secret: bytes = b"") -> TenantNamespace:
        if not name:
            raise IdentityError("tenant name must be non-empty")
        encoded = name.encode("utf-8")
        salt = blake3(_TENANT_TAG + _u32(len(secret)) + secret + encoded).digest()
        return cls(name=name, salt=salt)


DEFAULT_TENANT = "default"
_SECRET_DIGEST_TAG = b"kvstrata.secret-digest.v1\x00"


def secret_digest(secret: bytes) -> str:
    """A public digest of the deployment secret (32 hex chars of BLAKE3 over a tag and the
    secret): a router and a worker compare these to check that they salt tenants alike,
    without either revealing the secret."""
    return blake3(_SECRET_DIGEST_TAG + secret).hexdigest()[:32]


@dataclass(frozen=True, order=True)
class MultimodalExtra:
    """A multimodal input that starts inside a block: its offset there and its content hash."""

    offset: int
    mm_hash: bytes

    def encode(self) -> bytes:
        if len(self.mm_hash) != KEY_BYTES:
            raise IdentityError("multimodal hash must be 32 bytes")
        return b"\x01" + _u32(self.offset) + self.mm_hash


@dataclass(frozen=True, order=True)
class AdapterExtra:
    """An adapter (e.g. LoRA) applied to this block: its name and weight digest."""

    name: str
    weight_digest: bytes

    def encode(self) -> bytes:
        if len(self.weight_digest) != KEY_BYTES:
            raise IdentityError("adapter weight digest must be 32 bytes")
        encoded = self.name.encode("utf-8")
        return b"\x02" + _u32(len(encoded)) + encoded + self.weight_digest


@dataclass(frozen=True)
class BlockExtras:
    """Canonical extra keys of one block (set-like: order of construction does not matter)."""

    multimodal: tuple[MultimodalExtra, ...] = field(default=())
    adapter: AdapterExtra | None = None

    def encode(self) -> bytes:
        entries = [m.encode() for m in self.multimodal]
        if self.adapter is not None:
            entries.append(self.adapter.encode())
        entries.sort()
        return _u32(len(entries)) + b"".join(entries)


_NO_EXTRAS = _u32(0)


def namespace_root(
    fingerprint_digest: FingerprintDigest, namespace: TenantNamespace
) -> NamespaceRoot:
    """H(fingerprint digest ‖ tenant salt): the parent of the first block of every chain."""
    if len(fingerprint_digest) != KEY_BYTES:
        raise IdentityError("fingerprint digest must be 32 bytes")
    salt = namespace.salt
    return NamespaceRoot(blake3(_ROOT_TAG + fingerprint_digest + _u32(len(salt)) + salt).digest())


def canonical_token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian u32; raises on ids that do not fit."""
    array = np.asarray(tokens)
    if array.size == 0:
        return b""
    if array.dtype.kind not in "iu":
        raise IdentityError(f"token ids must be integers, got {array.dtype}")
    if int(array.min()) < 0 or int(array.max()) > _MAX_TOKEN:
        raise IdentityError("token ids must lie in [0, 2**32)")
    return array.astype("<u4", copy=False).tobytes()


def chain_keys(
    parent: NamespaceRoot | BlockKey,
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    extras: Sequence[BlockExtras | None] | None = None,
) -> list[BlockKey]:
    """Keys of every *full* block of ``tokens``, chained from ``parent``.

    ``extras[i]`` (optional) holds the extra keys of block i. A trailing partial block gets
    no key. Hashing all blocks from one contiguous byte buffer keeps per-block overhead low.
    """
    if block_size <= 0:
        raise IdentityError("block_size must be positive")
    if len(parent) != KEY_BYTES:
        raise IdentityError("parent must be 32 bytes")
    data = canonical_token_bytes(tokens)
    n_full = len(data) // (4 * block_size)
    if extras is not None and len(extras) < n_full:
        raise IdentityError("extras must cover every full block")
    stride = 4 * block_size
    header = _u32(block_size)
    keys: list[BlockKey] = []
    prev = bytes(parent)
    for i in range(n_full):
        block_extras = extras[i] if extras is not None else None
        tail = _NO_EXTRAS if block_extras is None else block_extras.encode()
        hasher = blake3(_BLOCK_TAG)
        hasher.update(prev)
        hasher.update(header)
        hasher.update(data[i * stride : (i + 1) * stride])
        hasher.update(tail)
        prev = hasher.digest()
        keys.append(BlockKey(prev))
    return keys


def content_hash(block_tokens: Sequence[int] | np.ndarray) -> ContentHash:
    """Position-free hash of one block's tokens (for non-prefix reuse and dedup stats)."""
    data = canonical_token_bytes(block_tokens)
    return ContentHash(blake3(_CONTENT_TAG + _u32(len(data) // 4) + data).digest())


def event_block_hash(key: BlockKey) -> int:
    """The int a KV event carries for ``key``: the low 64 bits, big-endian, of its bytes.

    Why this form: it is what vLLM puts in its events by default (``vllm_event_int``), so one
    consumer decodes kvstrata and vLLM block hashes alike. It is a lossy *name* for the block
    on the wire (collisions cost a routing mistake, never a wrong hit: workers re-check the
    full 32-byte key before using any KV).
    """
    if len(key) != KEY_BYTES:
        raise IdentityError(f"block key must be {KEY_BYTES} bytes, got {len(key)}")
    return int.from_bytes(key, "big") & _MASK64
