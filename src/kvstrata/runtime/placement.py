"""When the router placed a request: ``X-Kvstrata-Placed-At``, front door → worker.

The front door routes requests one at a time, under its fleet lock, and prices each one's
time to first token as the queue it places it behind (``router.queue``). It then proxies them
concurrently, and requests proxied together race to the worker: a later one can reach the
engine first (a reused connection against a new one, a shorter body) and take the step the
earlier one was priced for. So the front door sends, with every request, the wall-clock
second it placed it (``Reservation.started``, six decimals)::

    X-Kvstrata-Placed-At: 1796589012.304518

and the worker's engine admits requests placed earlier before waiting ones placed later that
reached it moments before (``runtime.scheduler``: at most ``REORDER_WINDOW_S`` apart). A
value that is not a finite positive number is ignored (the request goes last, as one from a
client that sends none): it only orders admission, so a bad one costs nothing but its place.
"""

from __future__ import annotations

import math
from typing import Final

PLACED_AT_HEADER: Final = "X-Kvstrata-Placed-At"
_MAX_CHARS: Final = 32


def placed_at_header(placed_at: float) -> str:
    return f"{placed_at:.6f}"


def parse_placed_at(value: str | None) -> float | None:
    """The header's seconds, or None when absent or not a finite positive number."""
    if value is None or len(value) > _MAX_CHARS:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None
