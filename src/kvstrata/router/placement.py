"""Where a worker computes, as its ``/kv/info`` says (``compute``), and whether two share it.

Why: the qualified local path (``router.disagg``) prices a remote prefill as relief for the
decode worker's running decodes. That holds only when the prefill worker computes on other
hardware; two workers on one host that share CPU cores (or one GPU) take the same cycles, so
the "remote" prefill slows the decodes just as a local one would (``DisaggCost.
shared_compute``). Pure: the worker reads its own place (``serve``); the router compares.

Wire form (JSON object, every field required)::

    {"host": str,          # the machine: hostname + "/" + kernel boot id (one boot of one host)
     "device": str,        # "cpu", or the accelerator the engine runs on ("cuda:0", …)
     "cpus": [int, ...]}   # the CPU ids the worker process may run on (its affinity)

Two places share compute when their hosts are equal and either both run on ``cpu`` with
intersecting CPU sets, or both name the same accelerator. Unknown (an older worker without
``compute``, or a malformed entry): not shared — the router keeps its earlier behaviour.
Containers on one host with different hostnames are not recognised (documented limit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstrata.errors import InvalidInput

MAX_CPUS = 65_536  # a bound on a hostile entry's size, far above any machine's CPU count


@dataclass(frozen=True, slots=True)
class ComputePlace:
    host: str
    device: str
    cpus: frozenset[int]

    def shares_with(self, other: ComputePlace) -> bool:
        """Do the two compute on the same hardware (module docstring)?"""
        if not self.host or self.host != other.host or self.device != other.device:
            return False
        if self.device != "cpu":
            return True
        return not self.cpus.isdisjoint(other.cpus)

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "device": self.device, "cpus": sorted(self.cpus)}

    @classmethod
    def from_json(cls, body: Any) -> ComputePlace:
        """The ``compute`` entry; ``InvalidInput`` for anything that is not the wire form."""
        if not isinstance(body, dict):
            raise InvalidInput(f"compute must be an object: {body!r:.100}")
        host, device, cpus = body.get("host"), body.get("device"), body.get("cpus")
        if not (isinstance(host, str) and isinstance(device, str) and isinstance(cpus, list)):
            raise InvalidInput(f"compute needs host, device (str) and cpus (list): {body!r:.100}")
        if len(cpus) > MAX_CPUS or not all(
            isinstance(c, int) and not isinstance(c, bool) and 0 <= c < MAX_CPUS for c in cpus
        ):
            raise InvalidInput(f"compute cpus must be CPU ids: {cpus!r:.100}")
        return cls(host=host, device=device, cpus=frozenset(cpus))


def shares_compute(a: ComputePlace | None, b: ComputePlace | None) -> bool:
    """Unknown on either side: not shared (module docstring)."""
    return a is not None and b is not None and a.shares_with(b)
