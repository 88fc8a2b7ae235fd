"""``[[pool.read_layouts]]``: alternate layouts whose stored objects a worker reads (torch-free).

A worker restarted with another block size (or reading what a TP-sharded or differently
ordered writer stored) finds none of its own keys in its disk and remote tiers: block keys are
rooted in the full fingerprint, which names the representation. Each ``ReadLayout`` names one
writer's representation by the fields that differ from the pool's own (unset: the pool's);
the engine derives that writer's fingerprint, looks the prompt up under it where its own keys
stop matching, and converts what it finds (``engine.relayout``).

The default is none: every alternate costs a chain of keys and a store lookup on each miss,
and the store's resident metas cannot name an alternate by themselves (a key is rooted in a
fingerprint, not in a ``Representation``; the remote tier's objects are not listed cheaply),
so an operator names the layouts a restart left behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Protocol

from kvstrata.errors import ConfigError

READ_LAYOUTS: Final = "pool.read_layouts"
_AXES: Final = "LKHTD"


@dataclass(frozen=True)
class ReadLayout:
    """A writer's layout by what differs from the pool's own (None: the pool's own)."""

    block_size: int | None = None
    order: str | None = None
    tp_size: int | None = None
    dtype: str | None = None

    def describe(self) -> str:
        fields = {
            "block_size": self.block_size,
            "order": self.order,
            "tp_size": self.tp_size,
            "dtype": self.dtype,
        }
        return ", ".join(f"{k}={v}" for k, v in fields.items() if v is not None) or "own"


class TableReader(Protocol):
    def get(self, name: str) -> Any: ...

    def fail(self, name: str, message: str) -> ConfigError: ...


def parse_read_layout(table: TableReader) -> ReadLayout:
    """One ``[[pool.read_layouts]]`` entry, validated field by field."""
    block_size, tp_size = table.get("block_size"), table.get("tp_size")
    order, dtype = table.get("order"), table.get("dtype")
    if block_size is not None and block_size < 1:
        raise table.fail("block_size", "must be at least 1")
    if tp_size is not None and tp_size < 1:
        raise table.fail("tp_size", "must be at least 1")
    if order is not None and sorted(order) != sorted(_AXES):
        raise table.fail("order", f"must be a permutation of {_AXES}")
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise table.fail("dtype", "must be float32, bfloat16 or float16")
    layout = ReadLayout(block_size=block_size, order=order, tp_size=tp_size, dtype=dtype)
    if layout == ReadLayout():
        raise table.fail("block_size", "an alternate layout must differ in some field")
    return layout
