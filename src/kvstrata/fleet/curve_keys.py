"""CURVE for a fleet: ``kvstrata up``'s generated certificates, and the router's attach rule.

``FleetKeys.generate`` makes, in a fresh run directory (``tempfile.mkdtemp``: mode 0700, only
this user can read the secrets; removed by ``remove()`` when ``up`` exits), one server
certificate every worker's event sockets use and one client certificate for the router, whose
public half is the only entry of the clients directory the workers admit. Workers get
``--curve-secret-file`` / ``--curve-clients-dir`` (``worker_args``), the router the client
certificate (``FleetConfig.curve_client_secret_file``).

``curve_refusal``: a router attaches a worker only if both use CURVE or neither does. A CURVE
worker and a router without keys would get nothing; a plaintext worker and a router with keys
would be a silent downgrade. Either way the attach is refused with the fix in the message.

A vLLM server's two streams are judged apart (``lower_stream_refusal``). vLLM's own (the
device tier) cannot be CURVE — vLLM's publisher has none —, so router keys do not refuse it.
The kvstrata connector's (``lower``, with its key ``lower_curve_public_key``, from
``--worker …,lower_curve=KEY``) follows the rule above, and one without a key beyond loopback
is refused even without router keys: its connector publishes plaintext on loopback only
(``runtime.event_exposure``), so the router would silently receive nothing from it.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvstrata.events.curve import create_certificate
from kvstrata.fleet.worker_info import WorkerInfo, WorkerProtocolError
from kvstrata.runtime.event_exposure import is_local_endpoint


@dataclass(frozen=True)
class FleetKeys:
    run_dir: Path
    worker_secret_file: Path
    clients_dir: Path
    router_secret_file: Path

    @classmethod
    def generate(cls) -> FleetKeys:
        run_dir = Path(tempfile.mkdtemp(prefix="kvstrata-curve-"))  # 0700
        clients = run_dir / "clients"
        clients.mkdir(mode=0o700)
        _, worker_secret = create_certificate(run_dir, "worker")
        router_public, router_secret = create_certificate(run_dir, "router")
        router_public.rename(clients / router_public.name)
        return cls(run_dir, worker_secret, clients, router_secret)

    def worker_args(self) -> list[str]:
        """The ``kvstrata serve`` flags of every worker of the fleet."""
        return [
            "--curve-secret-file",
            str(self.worker_secret_file),
            "--curve-clients-dir",
            str(self.clients_dir),
        ]

    def remove(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)


def curve_refusal(
    info: WorkerInfo, *, router_has_keys: bool, engine: str = "kvstrata"
) -> WorkerProtocolError | None:
    """Why the router must not attach ``info`` (None: both sides agree on CURVE); ``engine``
    as ``FleetConfig.engine`` (``vllm``: the main stream is vLLM's own, never CURVE)."""
    worker_curve = info.curve_public_key is not None
    where = f"worker {info.worker_id} at {info.base_url}"
    if worker_curve and not router_has_keys:
        return WorkerProtocolError(
            f"{where} encrypts its KV events with CURVE and this router has no client "
            "certificate: refused; start the router with --curve-secret-file (a certificate "
            "whose public half is in the worker's curve_clients_dir)"
        )
    if router_has_keys and not worker_curve and engine != "vllm":
        return WorkerProtocolError(
            f"{where} publishes its KV events in plaintext and this router requires CURVE: "
            "refused (no silent downgrade); start the worker with --curve-secret-file and "
            "--curve-clients-dir"
        )
    if info.lower_events_endpoint is None:
        return None
    why = lower_stream_refusal(
        info.worker_id,
        info.lower_events_endpoint,
        info.lower_curve_public_key,
        router_has_keys=router_has_keys,
    )
    return None if why is None else WorkerProtocolError(why)


def lower_stream_refusal(
    worker_id: str, endpoint: str, server_key: bytes | None, *, router_has_keys: bool
) -> str | None:
    """Why the router must not read a worker's connector stream at ``endpoint`` (None: fine)."""
    where = f"worker {worker_id}'s connector stream {endpoint}"
    if server_key is not None:
        if router_has_keys:
            return None
        return (
            f"{where} is CURVE (lower_curve) and this router has no client certificate: "
            "refused; start the router with --curve-secret-file (a certificate whose public "
            "half is in the connector's events.curve_clients_dir)"
        )
    fix = (
        "give the connector events.curve_secret_file and events.curve_clients_dir, and the "
        "router its public key: --worker …,lower_curve=KEY (z85 text or its certificate file)"
    )
    if not is_local_endpoint(endpoint):
        return (
            f"{where} is beyond loopback and has no CURVE key: refused, since a connector "
            f"publishes plaintext on loopback only and the router would receive nothing; {fix}"
        )
    if router_has_keys:
        return (
            f"{where} is plaintext and this router requires CURVE: refused (no silent "
            f"downgrade); {fix}"
        )
    return None
