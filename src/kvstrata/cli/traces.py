"""Where a trace-driven command's requests come from: a Mooncake file or a synthetic preset."""

from __future__ import annotations

from pathlib import Path

from kvstrata.workloads.mooncake import TraceRequest, read_trace
from kvstrata.workloads.synthetic import generate, preset


def load_source(
    trace: Path | None, synthetic: str | None, seed: int, data_dir: Path
) -> tuple[list[TraceRequest], str]:
    """The requests and a label for reports (``synthetic:NAME:seed=N`` or the file path)."""
    if trace is not None:
        return read_trace(trace), str(trace)
    assert synthetic is not None, "argparse requires --trace or --synthetic"
    return generate(preset(synthetic, seed), data_dir), f"synthetic:{synthetic}:seed={seed}"
