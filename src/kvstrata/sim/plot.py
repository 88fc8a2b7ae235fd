"""TTFT CDFs per policy, drawn with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np


def plot_ttft_cdf(
    ttfts: Mapping[str, Sequence[float]], path: str | os.PathLike[str], *, title: str
) -> None:
    """One CDF line per policy, log-scaled time axis (TTFTs span milliseconds to minutes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for name, values in ttfts.items():
        data = np.sort(np.asarray(values, dtype=np.float64))
        if not len(data):
            continue
        fraction = np.arange(1, len(data) + 1) / len(data)
        axes.plot(np.maximum(data, 1e-3), fraction, label=name, linewidth=1.5)
    axes.set_xscale("log")
    axes.set_xlabel("time to first token (s, simulated)")
    axes.set_ylabel("fraction of requests")
    axes.set_title(title)
    axes.axhline(0.99, color="grey", linewidth=0.8, linestyle=":")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
