"""Object metadata for traces of block-id chains: what a replay's tiers and policies see.

``bench eviction`` and the simulator both replay traces whose requests name their prompt as
a chain of block ids (a Mooncake id names a whole prefix: equal ids, equal prefixes). Both
need one :class:`~kvstrata.objects.KVObjectMeta` per distinct id, built once and shared by
every replay, so that the real eviction policies price blocks the way a live tier does.

Rules (:func:`chain_metas`):

* the meta of an id is built at its first occurrence, in chain order; later occurrences
  reuse it (an id names one prefix, so its parent and position never differ);
* ``key`` = the id as 16 signed little-endian bytes (room for any 128-bit id); ``parent`` =
  the key of the previous block of the chain (None for the first);
* ``position`` = ``index · block_tokens``; the block's tokens are ``block_tokens`` except
  the last block of a chain, which covers what is left of the prompt (at most
  ``block_tokens``), so a partial last block is priced for its own tokens;
* ``recompute_s`` = ``recompute_s(tokens, position)`` — the caller's cost model (the
  marginal prefill time, :meth:`kvstrata.costs.PrefillModel.marginal_s`);
* ``size`` = ``block_bytes`` for every block (a tier's capacity counts slots, not bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvstrata.errors import InvalidInput
from kvstrata.identity import DEFAULT_TENANT, BlockKey
from kvstrata.objects.model import KVObjectMeta, Representation

KEY_BYTES = 16


def block_key(block_id: int) -> BlockKey:
    """The storage key of a trace's block id (16 signed little-endian bytes)."""
    return BlockKey(block_id.to_bytes(KEY_BYTES, "little", signed=True))


@dataclass(frozen=True)
class ChainMetas:
    """A trace's chains as keys, and one meta per distinct block."""

    chains: tuple[tuple[BlockKey, ...], ...]
    """Per request, in trace order: its blocks' keys, head first."""
    keys: dict[int, BlockKey]
    """Block id → key."""
    metas: dict[BlockKey, KVObjectMeta]

    def block_ids(self) -> dict[BlockKey, int]:
        """Key → block id (the inverse of ``keys``)."""
        return {key: block for block, key in self.keys.items()}


def chain_metas(
    chains: Iterable[tuple[Sequence[int], int]],
    *,
    block_tokens: int,
    block_bytes: int,
    representation: Representation,
    recompute_s: Callable[[int, int], float],
) -> ChainMetas:
    """Metas of ``(block ids, prompt tokens)`` chains, per the rules of the module docstring."""
    if block_tokens <= 0 or block_bytes <= 0:
        raise InvalidInput(f"block tokens and bytes must be > 0, got {block_tokens}, {block_bytes}")
    keys: dict[int, BlockKey] = {}
    metas: dict[BlockKey, KVObjectMeta] = {}
    out: list[tuple[BlockKey, ...]] = []
    for block_ids, prompt_tokens in chains:
        chain: list[BlockKey] = []
        parent: BlockKey | None = None
        for index, block_id in enumerate(block_ids):
            key = keys.get(block_id)
            if key is None:
                key = block_key(block_id)
                keys[block_id] = key
                start = index * block_tokens
                tokens = min(block_tokens, prompt_tokens - start)
                if tokens <= 0:
                    raise InvalidInput(
                        f"block {index} of a {prompt_tokens}-token prompt starts past its end"
                    )
                metas[key] = KVObjectMeta(
                    key=key,
                    parent=parent,
                    tenant=DEFAULT_TENANT,
                    representation=representation,
                    size=block_bytes,
                    digest=b"",
                    created_at=0.0,
                    position=start,
                    recompute_s=recompute_s(tokens, start),
                )
            chain.append(key)
            parent = key
        out.append(tuple(chain))
    return ChainMetas(chains=tuple(out), keys=keys, metas=metas)
