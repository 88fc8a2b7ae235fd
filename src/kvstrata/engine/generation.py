"""What a prefill leaves behind and a generation in progress (plain records of the engine)."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvstrata.engine.sampling import SamplingParams
from kvstrata.errors import EngineError
from kvstrata.identity import BlockKey, ReuseDisabled
from kvstrata.telemetry import RequestRecord


@dataclass
class Prefill:
    """State after a prompt was processed: logits of its last token and the attention cache."""

    logits: torch.Tensor
    cache: DynamicCache
    matched_tokens: int
    matched_by_tier: dict[str, int]
    keys: list[BlockKey]
    held_blocks: list[int]
    reuse_disabled: ReuseDisabled | None
    prefill_s: float


@dataclass
class Generation:
    """A running or finished generation; iterate it to get token ids one by one."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    record: RequestRecord
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    step_logits: list[torch.Tensor] = field(default_factory=list)
    _iterator: Iterator[int] | None = None

    _running: Iterator[int] | None = None

    def __iter__(self) -> Iterator[int]:
        if self._iterator is None:
            raise EngineError("generation already consumed")
        iterator, self._iterator = self._iterator, None
        self._running = iterator
        return iterator

    def run(self) -> Generation:
        for _ in self:
            pass
        return self

    def close(self) -> None:
        """Stop early (stop string, client gone): releases the engine and keeps the KV so far."""
        iterator = self._iterator if self._iterator is not None else self._running
        self._iterator = None
        if isinstance(iterator, Generator):
            iterator.close()
