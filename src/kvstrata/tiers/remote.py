"""Remote tier on Redis/Valkey (one node or a Redis Cluster), shared by every worker.

Object layout: ``remote_format`` (meta and payload under one cluster hash tag).

The tier is one class composed of a state and three paths over it:

- ``remote_state.RemoteState``: what this process knows of the shared tier (local views, no
  I/O), the ledger's scripts and replies, hit booking, error counting and the lifecycle;
- ``remote_write.RemoteWrites``: the two-phase store (a reservation in the shared ledger
  ``remote_ledger``, then the commit and one transactional write of meta and payload);
- ``remote_read.RemoteReads``: probes, read-ahead and verified loads (a corrupt object is
  deleted and reported through ``take_dropped``);
- ``remote_deletion.RemoteDeletion``: ``remove``, ``bury`` (server tombstones,
  ``remote_tombstones``), ``objects_of`` (a tenant's survey) and ``scan_keys``.

Eviction is the ledger's (``evicts_itself``): the store never picks victims here. Failures
(timeouts, refused connections, a dead shard) are ``RemoteUnavailable`` inside; the public
calls turn them into misses (loads, probes) or a refused store, count them in ``counters`` and
in ``remote_counters``, and a per-node circuit breaker stops a dead node from costing more
than one timeout per backoff period.
"""

from __future__ import annotations

from kvstrata.tiers.remote_deletion import RemoteDeletion
from kvstrata.tiers.remote_read import RemoteReads
from kvstrata.tiers.remote_state import QuotaOf, RemoteCounters, ValueOf
from kvstrata.tiers.remote_write import RemoteWrites

__all__ = ["QuotaOf", "RemoteCounters", "RemoteTier", "ValueOf"]


class RemoteTier(RemoteReads, RemoteWrites, RemoteDeletion):
    """A shared Redis/Valkey tier (see the module docstring for layout and contract)."""

    name = "remote"
    evicts_itself = True
