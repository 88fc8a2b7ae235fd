"""Plots of benchmark results, drawn with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def plot_eviction_curves(
    result: Mapping[str, Any], path: str | os.PathLike[str], *, title: str
) -> None:
    """Saved prefill seconds and saved tokens per policy across capacities (``bench
    eviction`` JSON: ``capacities``, ``saved_prefill_s`` and ``saved_tokens`` per policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    capacities = list(result["capacities"])
    figure, (seconds_axes, tokens_axes) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, values in result["saved_prefill_s"].items():
        style = ":" if name == "belady" else "-"
        seconds_axes.plot(capacities, values, style, marker="o", label=name)
    for name, values in result["saved_tokens"].items():
        style = ":" if name == "belady" else "-"
        tokens_axes.plot(capacities, values, style, marker="o", label=name)
    for axes, label in ((seconds_axes, "saved prefill (s)"), (tokens_axes, "saved tokens")):
        axes.set_xscale("log")
        axes.set_xlabel("capacity (blocks)")
        axes.set_ylabel(label)
        axes.grid(True, which="both", alpha=0.3)
    seconds_axes.legend(loc="upper left", fontsize=8)
    figure.suptitle(f"{title} (belady = next-use oracle: fewest block misses)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
