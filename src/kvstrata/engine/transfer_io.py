"""Moving a prefix's KV out of and into the reference engine's paged pool (issue 14's engine
side of a prefill → decode transfer).

- ``pool_layout(config)`` is the ``KVLayout`` of a pool's blocks: the model's layers, KV heads
  and head dim, the pool's block size and dtype, order ``LKHTD``, TP 1, PP 1.
- ``export_prefix(engine, token_ids, tenant)`` copies the committed full blocks of the longest
  prefix of ``token_ids`` the pool holds into one tensor ``[n, L, 2, H, B, D]`` (with their
  keys and the layout). The pool is the step thread's, so the copy runs there
  (``engine.call``) between two steps; it cannot meet an eviction half way.
- ``import_prefix(engine, token_ids, tenant, blocks)`` writes ``[n, L, 2, H, B, D]`` blocks
  (already in this engine's layout: convert them first with ``transfer.convert``) under the
  receiver's *own* keys of ``token_ids``: every new block is allocated PENDING, written, and
  only then committed, parents first, so nothing is visible half written; any error aborts
  every block it allocated. Blocks the pool already holds are kept as they are. When the pool
  runs out of room the prefix allocated so far is committed (a shorter prefix is still a
  valid one) and the result says so. Committed blocks are written through to the store as
  computed ones are, and the next ``generate`` on the prompt hits them.

Both block the calling thread until the step thread has run them: never call them from the
step thread itself while the engine's loop runs (``engine.call`` would wait on itself).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvstrata.engine.engine import ReferenceEngine
from kvstrata.engine.relayout import pool_layout
from kvstrata.errors import ConversionError, KvstrataError
from kvstrata.identity import DEFAULT_TENANT, BlockKey
from kvstrata.runtime.blocks import BlockInfo, block_tokens
from kvstrata.transfer.layout import KVLayout

__all__ = ["ExportedPrefix", "ImportResult", "export_prefix", "import_prefix", "pool_layout"]


class ExportedPrefix(NamedTuple):
    layout: KVLayout
    keys: list[BlockKey]  # the sender's keys of the exported blocks
    blocks: torch.Tensor  # [n, L, 2, H, B, D] in ``layout``


@dataclass(frozen=True)
class ImportResult:
    """``imported`` blocks were written and committed, ``present`` were in the pool already;
    ``complete`` is False when the pool ran out of room before the last block."""

    imported: int
    present: int
    complete: bool

    @property
    def blocks(self) -> int:
        """Blocks of the prefix now committed in the pool."""
        return self.imported + self.present


def export_prefix(
    engine: ReferenceEngine,
    token_ids: Sequence[int],
    tenant: str = DEFAULT_TENANT,
    *,
    device: str = "cpu",
) -> ExportedPrefix:
    """The committed full blocks of ``token_ids``'s longest cached prefix (see the module
    docstring); zero blocks when the pool holds none or reuse is disabled."""
    tokens = [int(t) for t in token_ids]
    layout = pool_layout(engine.pool.config)

    def run() -> ExportedPrefix:
        keys = engine.block_keys(tokens, tenant)
        block_ids = engine.pool.lookup_prefix(keys)
        index = torch.tensor(block_ids, dtype=torch.long, device=engine.pool.kv.device)
        with torch.inference_mode():
            picked = engine.pool.kv.index_select(3, index)  # [L, 2, H, n, B, D], a copy
            blocks = picked.permute(3, 0, 1, 2, 4, 5).contiguous().to(device)
        return ExportedPrefix(layout, keys[: len(block_ids)], blocks)

    return engine.call(run).result()


def _check_blocks(engine: ReferenceEngine, tokens: Sequence[int], blocks: torch.Tensor) -> None:
    config = engine.pool.config
    shape = (config.num_layers, 2, config.num_kv_heads, config.block_size, config.head_dim)
    if (
        not isinstance(blocks, torch.Tensor)
        or blocks.dim() != 6
        or tuple(blocks.shape[1:]) != shape
    ):
        got = tuple(blocks.shape) if isinstance(blocks, torch.Tensor) else type(blocks)
        raise ConversionError(f"blocks {got} are not this pool's [n, {shape}]")
    if blocks.dtype != config.dtype:
        raise ConversionError(f"blocks are {blocks.dtype}, the pool holds {config.dtype}")
    if blocks.shape[0] * config.block_size > len(tokens):
        raise ConversionError(
            f"{blocks.shape[0]} blocks of {config.block_size} tokens exceed the "
            f"{len(tokens)} tokens they were said to hold"
        )


def import_prefix(
    engine: ReferenceEngine,
    token_ids: Sequence[int],
    tenant: str,
    blocks: torch.Tensor,
) -> ImportResult:
    """Write ``blocks`` (the first ``len(blocks)`` full blocks of ``token_ids``, in this
    engine's layout) into the pool under this engine's keys (see the module docstring)."""
    tokens = [int(t) for t in token_ids]
    _check_blocks(engine, tokens, blocks)
    count = int(blocks.shape[0])

    def run() -> ImportResult:
        keys = engine.block_keys(tokens, tenant)[:count]
        if len(keys) < count:  # reuse disabled: no keys, nothing may be cached
            return ImportResult(imported=0, present=0, complete=False)
        pool = engine.pool
        present = len(pool.lookup_prefix(keys))
        size = pool.config.block_size
        created = time.time()
        allocated: list[int] = []
        complete = True
        try:
            for i in range(present, count):
                info = BlockInfo(tenant, i * size, block_tokens(tokens, i, size), created)
                block_id = pool.allocate(keys[i], keys[i - 1] if i else None, info)
                if block_id is None:
                    complete = False
                    break
                allocated.append(block_id)
                with torch.inference_mode():
                    pool.write_block(block_id, blocks[i])
        except BaseException as exc:
            for block_id in reversed(allocated):  # children first: abort refuses parents
                pool.abort(block_id)
            if isinstance(exc, RuntimeError) and not isinstance(exc, KvstrataError):
                raise ConversionError(f"writing an imported block failed: {exc}") from exc
            raise
        for block_id in allocated:
            pool.commit(block_id)
        if engine.bridge is not None and allocated:
            engine.bridge.write_through(allocated, keys, present, tenant, tokens)
        return ImportResult(imported=len(allocated), present=present, complete=complete)

    return engine.call(run).result()
