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
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvstrata.events.curve import create_certificate
from kvstrata.fleet.workers import WorkerInfo, WorkerProtocolError


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


def curve_refusal(info: WorkerInfo, *, router_has_keys: bool) -> WorkerProtocolError | None:
    """Why the router must not attach ``info`` (None: both sides agree on CURVE)."""
    worker_curve = info.curve_public_key is not None
    if worker_curve == router_has_keys:
        return None
    where = f"worker {info.worker_id} at {info.base_url}"
    if worker_curve:
        return WorkerProtocolError(
            f"{where} encrypts its KV events with CURVE and this router has no client "
            "certificate: refused; start the router with --curve-secret-file (a certificate "
            "whose public half is in the worker's curve_clients_dir)"
        )
    return WorkerProtocolError(
        f"{where} publishes its KV events in plaintext and this router requires CURVE: "
        "refused (no silent downgrade); start the worker with --curve-secret-file and "
        "--curve-clients-dir"
    )
