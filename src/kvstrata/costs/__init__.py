"""Prefill cost: one model (``model``), its one online refit (``online``), named profiles.

Torch-free and low in the layer order, so that the engine's break-even switch, the eviction
policies' ``recompute_s``, the router's TTFT estimates and the simulator all price a forward
with the same formula and the same fit.
"""

from kvstrata.costs.model import (
    DEFAULT_CALIBRATION_POINTS,
    SMOLLM2_KV_BYTES_PER_TOKEN,
    PrefillModel,
    calibrate,
    fit,
    point_label,
)
from kvstrata.costs.online import OnlinePrefillFit
from kvstrata.costs.profiles import (
    DEFAULT_PREFILL_MODEL,
    PROFILES,
    SMOLLM2_ATTENTION_TO_LINEAR,
    llama3_8b_h100,
    per_token,
    smollm2_cpu,
    smollm2_cpu_worker,
)

__all__ = [
    "DEFAULT_CALIBRATION_POINTS",
    "DEFAULT_PREFILL_MODEL",
    "PROFILES",
    "SMOLLM2_ATTENTION_TO_LINEAR",
    "SMOLLM2_KV_BYTES_PER_TOKEN",
    "OnlinePrefillFit",
    "PrefillModel",
    "calibrate",
    "fit",
    "llama3_8b_h100",
    "per_token",
    "point_label",
    "smollm2_cpu",
    "smollm2_cpu_worker",
]
