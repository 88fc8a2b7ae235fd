"""One running request's state on the engine thread: its tokens, block table and keys.

``tokens`` is the prompt followed by every sampled token; the first ``num_computed`` have KV in
the pool, in the blocks of ``table`` (block ``i`` holds positions ``i*B .. i*B+B-1``). The first
``committed`` entries of ``table`` are committed pool blocks this sequence holds a reference
on (matched at admission, or published once full); the rest are scratch blocks it owns.
``keys[i]`` is block ``i``'s chained key, computed when the block is first needed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvstrata.engine.generation import Generation
from kvstrata.engine.kv_pool import PagedKVPool
from kvstrata.engine.paged_attention import LayerListener
from kvstrata.identity import BlockKey, NamespaceRoot, chain_keys


@dataclass(frozen=True)
class HeldBlocks:
    """A finished sequence's blocks, handed over instead of released (a prefill-only request):
    the first ``committed`` of ``block_ids`` are committed blocks it holds a reference on, the
    rest scratch blocks it owns; ``release`` gives them back (on the step thread)."""

    block_ids: tuple[int, ...]
    committed: int
    keys: tuple[BlockKey, ...]

    def release(self, pool: PagedKVPool) -> None:
        pool.release(list(self.block_ids[: self.committed]))
        for block_id in self.block_ids[self.committed :]:
            pool.free_scratch(block_id)


@dataclass(eq=False)
class Sequence:
    gen: Generation
    tenant: str
    lookup: bool
    store: bool
    generator: torch.Generator
    arrival: float = field(default_factory=time.perf_counter)
    placed_at: float | None = None  # when a router placed it (its clock): admission order
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    table: list[int] = field(default_factory=list)
    committed: int = 0
    keys: list[BlockKey] = field(default_factory=list)
    root: NamespaceRoot | None = None  # None: reuse disabled, nothing is keyed or published
    publishable: bool = True
    admitted_at: float | None = None
    compute_s: float = 0.0  # its own share of the steps before its first token (batch.py)
    started: bool = False  # admitted once (metrics of the prompt are recorded once)
    on_layer: LayerListener | None = None  # called per layer of every step (prefill-for-transfer)
    listener_error: BaseException | None = None  # what ``on_layer`` raised: the sequence fails
    hold: Callable[[HeldBlocks], None] | None = None  # a finished prefill's blocks go here

    @property
    def pending_tokens(self) -> int:
        return len(self.tokens) - self.num_computed

    def key(self, index: int, block_size: int) -> BlockKey:
        """Key of full block ``index`` (its tokens must all be in ``tokens``)."""
        assert self.root is not None
        while len(self.keys) <= index:
            i = len(self.keys)
            parent: NamespaceRoot | BlockKey = self.keys[i - 1] if i else self.root
            chunk = self.tokens[i * block_size : (i + 1) * block_size]
            self.keys.append(chain_keys(parent, chunk, block_size)[0])
        return self.keys[index]

    def hand_over(self, block_size: int, prompt_tokens: int) -> HeldBlocks:
        """Give up every block to the returned holder (nothing is released); ``keys`` are the
        chained keys of the prompt's full blocks (none when reuse is disabled)."""
        full = prompt_tokens // block_size if self.root is not None else 0
        keys = tuple(self.key(i, block_size) for i in range(full))
        held = HeldBlocks(tuple(self.table), self.committed, keys)
        self.table = []
        self.committed = 0
        self.num_computed = 0
        return held

    def release(self, pool: PagedKVPool) -> None:
        """Drop every block: references on committed ones, scratch ones freed."""
        pool.release(self.table[: self.committed])
        for block_id in self.table[self.committed :]:
            pool.free_scratch(block_id)
        self.table.clear()
        self.committed = 0
        self.num_computed = 0
