"""The KV object model and its lifecycle state machine (pure: no I/O, no torch).

States::

    PENDING ──complete_store(ok)──▶ COMMITTED ──ttl──▶ EXPIRED
       │                               │
       └──complete_store(fail)──▶ INVALID ◀──digest mismatch / incompatible / deleted

EXPIRED and INVALID are terminal. Every other transition raises ``IllegalTransition``.
The payload digest is xxh3-128 over the payload bytes: it guards against corruption (torn
writes, bit flips, truncation), not against an adversary — identity is the BLAKE3 block key,
which is never derived from the payload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import xxhash

from kvstrata.errors import KvstrataError
from kvstrata.identity import BlockKey

DIGEST_ALGORITHM = "xxh3-128"
MALFORMED_META: tuple[type[Exception], ...] = (
    ValueError,
    KeyError,
    TypeError,
    AttributeError,
    OverflowError,
    RecursionError,
)
"""What ``KVObjectMeta.from_dict(json.loads(raw))`` raises on well-checksummed nonsense: bad
values, missing keys, a list where a map belongs, ``int(1e400)``, nesting too deep."""


class IllegalTransition(KvstrataError):
    """An object was asked to move between states the lifecycle does not allow."""


class ObjectState(Enum):
    PENDING = "pending"
    COMMITTED = "committed"
    EXPIRED = "expired"
    INVALID = "invalid"


_ALLOWED: dict[ObjectState, frozenset[ObjectState]] = {
    ObjectState.PENDING: frozenset({ObjectState.COMMITTED, ObjectState.INVALID}),
    ObjectState.COMMITTED: frozenset({ObjectState.EXPIRED, ObjectState.INVALID}),
    ObjectState.EXPIRED: frozenset(),
    ObjectState.INVALID: frozenset(),
}


def check_transition(current: ObjectState, target: ObjectState) -> ObjectState:
    if target not in _ALLOWED[current]:
        raise IllegalTransition(f"{current.value} → {target.value} is not a legal transition")
    return target


@dataclass(frozen=True)
class Representation:
    """How the payload encodes the KV of one block; part of compatibility, not of identity."""

    dtype: str
    layout: str
    block_size: int
    shape: tuple[int, ...]
    codec_id: str = "identity"
    codec_version: int = 1
    tp_rank: int = 0
    tp_size: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "layout": self.layout,
            "block_size": self.block_size,
            "shape": list(self.shape),
            "codec_id": self.codec_id,
            "codec_version": self.codec_version,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Representation:
        return cls(
            dtype=_text(data["dtype"]),
            layout=_text(data["layout"]),
            block_size=_integer(data["block_size"]),
            shape=tuple(_integer(x) for x in data["shape"]),
            codec_id=_text(data["codec_id"]),
            codec_version=_integer(data["codec_version"]),
            tp_rank=_integer(data["tp_rank"]),
            tp_size=_integer(data["tp_size"]),
        )


def _number(value: Any) -> float:
    """A number a meta's writer wrote (JSON int or float); anything else — a string of digits
    included, which ``float`` would take — is a meta no writer makes (``TypeError``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"a number was expected, not {type(value).__name__}")
    return float(value)


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"an integer was expected, not {type(value).__name__}")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a string was expected, not {type(value).__name__}")
    return value


def payload_digest(payload: bytes | bytearray | memoryview) -> bytes:
    """xxh3-128 of the payload bytes, 16 bytes big-endian."""
    return xxhash.xxh3_128_digest(payload)


def payload_hasher() -> xxhash.xxh3_128:
    """A running :func:`payload_digest`: ``update`` it with the payload's parts in order and
    ``digest()`` equals the digest of the whole (for bytes that arrive or are read in parts)."""
    return xxhash.xxh3_128()


@dataclass(frozen=True)
class KVObjectMeta:
    """Everything a tier and a policy need to know about one object, without its bytes.

    ``parent`` is the key of the previous block of the chain (None for the first block):
    tiers and policies use it to keep prefix closure (leaves leave first).
    ``recompute_tokens`` / ``position`` let a policy price what a hit saves: the block's
    tokens must be recomputed at that depth of the context if it is lost.
    ``tokens`` are the block's own token ids: KV events carry them so that a fleet index can
    compute its own router hashes for blocks found in any tier. ``None`` for objects written
    before tokens were recorded (old disk files); such objects serve hits but are never
    announced in events.
    """

    key: BlockKey
    parent: BlockKey | None
    tenant: str
    representation: Representation
    size: int
    digest: bytes
    created_at: float
    ttl_s: float | None = None
    position: int = 0  # index of the block's first token in its sequence
    recompute_s: float = 0.0  # measured prefill time this block saves when hit
    model: str = ""
    tokens: tuple[int, ...] | None = None

    def expires_at(self) -> float | None:
        return None if self.ttl_s is None else self.created_at + self.ttl_s

    def expired(self, now: float) -> bool:
        deadline = self.expires_at()
        return deadline is not None and now >= deadline

    def with_ttl(self, ttl_s: float | None) -> KVObjectMeta:
        return replace(self, ttl_s=ttl_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key.hex(),
            "parent": self.parent.hex() if self.parent is not None else None,
            "tenant": self.tenant,
            "representation": self.representation.to_dict(),
            "size": self.size,
            "digest": self.digest.hex(),
            "created_at": self.created_at,
            "ttl_s": self.ttl_s,
            "position": self.position,
            "recompute_s": self.recompute_s,
            "model": self.model,
            "tokens": list(self.tokens) if self.tokens is not None else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVObjectMeta:
        """The meta ``to_dict`` wrote; ``ValueError`` (or ``KeyError``/``TypeError``) for a
        dict no writer makes — among them a time that is not a finite number or a negative
        TTL: a reader must count such an object invalid, never merely expired."""
        parent = data.get("parent")
        created_at = _number(data["created_at"])
        ttl_s = None if data.get("ttl_s") is None else _number(data["ttl_s"])
        if not math.isfinite(created_at) or not (
            ttl_s is None or (math.isfinite(ttl_s) and ttl_s >= 0)
        ):
            raise ValueError(f"meta times out of range: created_at {created_at}, ttl_s {ttl_s}")
        return cls(
            key=BlockKey(bytes.fromhex(data["key"])),
            parent=BlockKey(bytes.fromhex(parent)) if parent is not None else None,
            tenant=_text(data["tenant"]),
            representation=Representation.from_dict(data["representation"]),
            size=_integer(data["size"]),
            digest=bytes.fromhex(data["digest"]),
            created_at=created_at,
            ttl_s=ttl_s,
            position=_integer(data.get("position", 0)),
            recompute_s=_number(data.get("recompute_s", 0.0)),
            model=_text(data.get("model", "")),
            tokens=_tokens_from(data.get("tokens")),
        )


def _tokens_from(value: Any) -> tuple[int, ...] | None:
    """Token ids from a meta dict; absent (an old file) → None, anything but ints raises."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise ValueError(f"meta 'tokens' must be a list of ints, got {value!r:.80}")
    return tuple(value)


@dataclass
class ObjectRecord:
    """A tier's mutable bookkeeping for one object: state, readers, reuse statistics."""

    meta: KVObjectMeta
    state: ObjectState = ObjectState.PENDING
    readers: int = 0
    hits: int = 0
    last_access: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def transition(self, target: ObjectState) -> None:
        self.state = check_transition(self.state, target)
