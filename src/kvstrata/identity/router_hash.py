"""Router hashes: fast, keyed, chained 64-bit prefix hashes for looking requests up in an index.

A router hashes *every* incoming request to find which worker holds the longest cached prefix,
so this is on the hot path of every request, while the storage keys (``keys.chain_keys``,
BLAKE3) are computed only by the worker that loads or stores KV. Hashing all blocks of a request
at once in numpy is several times faster than a per-block cryptographic hash loop in Python.

Why a non-cryptographic hash is acceptable here: a router hash is only a *hint* of where a
prefix lives. A collision (accidental, or crafted by a tenant who learned the seed) can only
send a request to a worker that does not really hold its prefix, i.e. cost a routing mistake
and some recomputation. It can never make anyone use wrong KV, because a worker always
re-derives and checks the exact BLAKE3 storage keys (``chain_keys``) before using any KV.

Math (all arithmetic wrapping mod 2**64, ``mix`` = the splitmix64 finaliser, a bijection):

    s        = mix(seed + GAMMA * block_size)                      per (namespace, block size)
    K_c      = mix(s + GAMMA * (c + 1)) | 1                        odd multiplier of column c
    b_j      = mix(sum_c t_{j,c} * K_c)                            content hash of block j
    r_{-1}   = s;  r_j = r_{j-1} * P + b_j                         chained prefix state
    hash_j   = mix(r_j)

Within a block the content is a keyed linear form, mixed once per block: one multiply-add per
token (``einsum``, a single pass over the tokens) where a per-token mix took six. Two blocks
collide when ``sum_c (t_c - t'_c) * K_c = 0``; for secret random odd ``K_c`` and any fixed pair
of distinct blocks that is a ~2**-64 event, though someone who learned ``K`` (the seed) can
solve for colliding blocks, which, as above, costs only a routing mistake.

The recurrence is evaluated for all blocks at once as
``r_j = P^j * (s * P + cumsum_i(b_i * P^-i))``: P is odd, hence invertible mod 2**64.
Properties: hash_j depends on blocks 0..j only (prefix property); changing block i's content
hash changes r_k for every k >= i (its term is multiplied by a power of the invertible P, so it
cannot vanish) and, ``mix`` being a bijection, hash_k too. The seed keys both the column
multipliers and the chain start, so the same tokens hash unrelatedly in two namespaces (equal
only by a ~2**-64 accident, which, as above, could only cost a routing mistake).
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvstrata.errors import IdentityError
from kvstrata.identity.keys import KEY_BYTES, NamespaceRoot

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
"""splitmix64's increment (odd): steps the key stream."""
P = 0xC2B2AE3D27D4EB4F
"""Odd base of the polynomial prefix hash."""
P_INV = pow(P, -1, 1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_MIX1_INV = pow(_MIX1, -1, 1 << 64)
_MIX2_INV = pow(_MIX2, -1, 1 << 64)
_MAX_TOKEN = 2**32 - 1

RouterHashes = npt.NDArray[np.uint64]


def mix64(value: int) -> int:
    """splitmix64's finaliser on a Python int (a bijection of 64-bit values)."""
    z = value & MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & MASK64
    return z ^ (z >> 31)


def _unshift_xor(z: int, shift: int) -> int:
    """Invert ``z ^= z >> shift`` on 64 bits (each pass recovers ``shift`` more top bits)."""
    result = z
    for _ in range(64 // shift):
        result = z ^ (result >> shift)
    return result & MASK64


def unmix64(value: int) -> int:
    """The inverse of :func:`mix64`: recovers the chain state ``r_j`` from ``hash_j``."""
    z = _unshift_xor(value & MASK64, 31)
    z = _unshift_xor((z * _MIX2_INV) & MASK64, 27)
    return _unshift_xor((z * _MIX1_INV) & MASK64, 30)


def _mix64_inplace(z: RouterHashes) -> RouterHashes:
    tmp = np.right_shift(z, 30)
    z ^= tmp
    z *= np.uint64(_MIX1)
    np.right_shift(z, 27, out=tmp)
    z ^= tmp
    z *= np.uint64(_MIX2)
    np.right_shift(z, 31, out=tmp)
    z ^= tmp
    return z


def router_seed(root: NamespaceRoot) -> int:
    """The router seed of a namespace: the first 8 bytes (little-endian) of its BLAKE3 root.

    The root already binds the model fingerprint digest and the tenant salt, so tenants and
    models never share router hashes, and a tenant without the deployment secret cannot
    compute another tenant's seed.
    """
    if len(root) != KEY_BYTES:
        raise IdentityError("namespace root must be 32 bytes")
    return int.from_bytes(root[:8], "little")


def effective_seed(seed: int, block_size: int) -> int:
    """``s``: the seed folded with the block size, so other block sizes never share hashes."""
    return mix64(seed + GAMMA * block_size)


def column_multipliers(seed: int, block_size: int) -> list[int]:
    """``K_c``: one odd, seed-dependent multiplier per token position in a block."""
    s = effective_seed(seed, block_size)
    return [mix64(s + GAMMA * (c + 1)) | 1 for c in range(block_size)]


def _as_u32(tokens: Sequence[int] | np.ndarray) -> npt.NDArray[np.uint32]:
    """Token ids as a uint32 array; ``array.array`` converts a list faster than numpy does."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise IdentityError("token ids must be a 1-D sequence")
        if tokens.dtype == np.uint32:
            return tokens
        if tokens.size == 0:
            return np.zeros(0, dtype=np.uint32)
        if tokens.dtype.kind not in "iu":
            raise IdentityError(f"token ids must be integers, got {tokens.dtype}")
        if int(tokens.min()) < 0 or int(tokens.max()) > _MAX_TOKEN:
            raise IdentityError("token ids must lie in [0, 2**32)")
        return tokens.astype(np.uint32)
    try:
        packed = array.array("I", tokens)
    except OverflowError:
        raise IdentityError("token ids must lie in [0, 2**32)") from None
    except TypeError:  # e.g. numpy integer scalars: take the slower, checked numpy path
        return _as_u32(np.asarray(tokens))
    if packed.itemsize != 4:  # pragma: no cover - C unsigned int is 32-bit on our platforms
        return np.asarray(packed, dtype=np.uint32)
    return np.frombuffer(packed, dtype=np.uint32)


_TABLES: tuple[RouterHashes, RouterHashes] = (np.ones(0, dtype=np.uint64),) * 2
"""``(P^j, P^-j)`` for j < their length: they depend on ``P`` alone, so every hasher shares
them (one per namespace each would hold ~190 KiB per 128k-token request, times thousands of
namespaces). Grown by replacing the tuple whole, never in place: a thread that read the old
tables keeps valid arrays."""


def _powers(n_blocks: int) -> tuple[RouterHashes, RouterHashes]:
    global _TABLES
    tables = _TABLES
    if n_blocks <= len(tables[0]):
        return tables
    size = max(n_blocks, 2 * len(tables[0]), 64)
    steps = np.full(size, P, dtype=np.uint64)
    steps[0] = 1
    powers = np.cumprod(steps, dtype=np.uint64)
    steps.fill(P_INV)
    steps[0] = 1
    tables = (powers, np.cumprod(steps, dtype=np.uint64))
    _TABLES = tables
    return tables


class RouterHasher:
    """Chained 64-bit router hashes of full blocks for one namespace seed and block size.

    Holds only its seed's column multipliers (the power tables are shared and grow on
    demand); thread-safe.
    """

    def __init__(self, seed: int, block_size: int) -> None:
        if block_size <= 0:
            raise IdentityError("block_size must be positive")
        if not 0 <= seed <= MASK64:
            raise IdentityError("router seed must be a 64-bit unsigned int")
        self.seed = seed
        self.block_size = block_size
        self._s = effective_seed(seed, block_size)
        self._k = np.array(column_multipliers(seed, block_size), dtype=np.uint64)
        self._start = np.uint64((self._s * P) & MASK64)  # r_{-1} * P

    @classmethod
    def for_root(cls, root: NamespaceRoot, block_size: int) -> RouterHasher:
        return cls(router_seed(root), block_size)

    def block_content_hashes(self, tokens: Sequence[int] | np.ndarray) -> RouterHashes:
        """``b_j`` of every full block: keyed and position-in-block aware, but not chained."""
        ids = _as_u32(tokens)
        n_blocks = len(ids) // self.block_size
        blocks = ids[: n_blocks * self.block_size].reshape(n_blocks, self.block_size)
        # uint32 tokens times uint64 multipliers: einsum sums in uint64, wrapping mod 2**64
        content: RouterHashes = np.einsum("jc,c->j", blocks, self._k, dtype=np.uint64)
        return _mix64_inplace(content)

    def hashes(self, tokens: Sequence[int] | np.ndarray) -> RouterHashes:
        """Chained hash of every full block (one per block, a trailing partial block has none)."""
        return self._chain(self.block_content_hashes(tokens), self._start)

    def extend(self, parent_hash: int | None, tokens: Sequence[int] | np.ndarray) -> RouterHashes:
        """Hashes of the full blocks of ``tokens`` following the block hashed ``parent_hash``.

        ``hash_j = mix(r_j)`` and ``mix`` is a bijection, so a parent's published hash gives
        back its chain state and the chain continues from there without the earlier tokens:
        this is how an index turns a ``BlockStored`` event (parent hash + the new blocks'
        tokens) into router hashes. ``None`` starts a chain, as :meth:`hashes` does.
        """
        if parent_hash is None:
            return self.hashes(tokens)
        if not 0 <= parent_hash <= MASK64:
            raise IdentityError("parent router hash must be a 64-bit unsigned int")
        start = np.uint64((unmix64(parent_hash) * P) & MASK64)
        return self._chain(self.block_content_hashes(tokens), start)

    @staticmethod
    def _chain(content: RouterHashes, start: np.uint64) -> RouterHashes:
        """``mix(r_j)`` with ``r_j = P^j * (start + cumsum_i(b_i * P^-i))``, where ``start`` is
        the previous chain state times ``P``: ``start`` added to the first term before the
        cumulative sum reaches every ``r_j`` with its ``P^j``, at no extra pass."""
        n_blocks = len(content)
        if not n_blocks:
            return content
        powers, inverses = _powers(n_blocks)
        content *= inverses[:n_blocks]
        content[:1] += start  # an array op: wraps mod 2**64 without a scalar overflow warning
        np.cumsum(content, dtype=np.uint64, out=content)
        content *= powers[:n_blocks]
        return _mix64_inplace(content)
