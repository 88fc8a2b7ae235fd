"""The global KV index: which worker holds which prefix block where (see :mod:`.core`)."""

from kvstrata.index.core import (
    ConsistencyMode,
    GlobalIndex,
    IndexStats,
    Medium,
    PrefixMatch,
    parse_medium,
)

__all__ = [
    "ConsistencyMode",
    "GlobalIndex",
    "IndexStats",
    "Medium",
    "PrefixMatch",
    "parse_medium",
]
