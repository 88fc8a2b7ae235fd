"""What a reference engine is built with: ``EngineConfig``, and the KV pool shape a loaded
model needs (``pool_config_for``, which also sizes a pool before the engine exists)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.engine.kv_pool import PoolConfig
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.runtime.read_layouts import ReadLayout
from kvstrata.runtime.scheduler import SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    pool_blocks: int = 1024
    device: str = "auto"  # "auto" → cuda when available, else cpu
    tenant_secret: bytes = b""
    max_model_len: int | None = None  # None → the model's max_position_embeddings
    reuse: bool = True  # False: never look up or store (the fresh-prefill baseline)
    prefetch: bool = True  # prefetch queued requests' prefixes from a shared store level
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    read_layouts: tuple[ReadLayout, ...] = ()  # stored objects of these layouts are converted


def pool_config_for(
    loaded: LoadedModel, block_size: int, num_blocks: int, device: str = "cpu"
) -> PoolConfig:
    """The KV shape of this model's pool (``PoolConfig.bytes_per_block`` sizes it)."""
    config = loaded.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return PoolConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        dtype=loaded.model.dtype,
        device=device,
    )
