"""Samples of a Prometheus text exposition (what an engine's ``/metrics`` returns), one shared
reader for the fleet's load scrape and the serving benchmark. Comments, blank lines and
samples whose value is not a number are skipped."""

from __future__ import annotations

from collections.abc import Iterator


def samples(text: str) -> Iterator[tuple[str, str, float]]:
    """(metric name, the sample's name with its labels, value) of each sample line."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        yield name_labels.split("{", 1)[0], name_labels, number
