"""kvstrata.workloads: request traces and synthetic workloads, read into typed records.

Pure data: nothing here knows about caches, tiers or engines, so benchmarks and the
simulator can share one reader and one set of format invariants.
"""

from kvstrata.workloads.mooncake import (
    BLOCK_TOKENS,
    TraceBlockId,
    TraceRequest,
    iter_trace,
    read_trace,
)

__all__ = ["BLOCK_TOKENS", "TraceBlockId", "TraceRequest", "iter_trace", "read_trace"]
