"""Adapters: named weight deltas merged into the model (a LoRA after merging is exactly this).

An adapter changes every KV tensor the model produces, so its name and weight digest are part
of the model fingerprint: KV computed with one adapter can never be served to another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from blake3 import blake3

from kvstrata.errors import ModelLoadError
from kvstrata.identity import AdapterIdentity


@dataclass(frozen=True)
class Adapter:
    name: str
    deltas: dict[str, torch.Tensor]

    def identity(self) -> AdapterIdentity:
        hasher = blake3()
        for param_name in sorted(self.deltas):
            tensor = self.deltas[param_name].detach().to("cpu", torch.float32).contiguous()
            hasher.update(param_name.encode() + b"\x00")
            hasher.update(str(tuple(tensor.shape)).encode())
            hasher.update(tensor.numpy().tobytes())
        return AdapterIdentity(name=self.name, weight_digest=hasher.hexdigest())

    def merge_into(self, model: torch.nn.Module) -> None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for param_name, delta in self.deltas.items():
                if param_name not in params:
                    raise ModelLoadError(f"adapter {self.name!r}: no parameter {param_name!r}")
                target = params[param_name]
                if target.shape != delta.shape:
                    raise ModelLoadError(f"adapter {self.name!r}: shape mismatch for {param_name}")
                target.add_(delta.to(target.dtype).to(target.device))
