"""The prefill timing a kvstrata worker reports to the front door, byte for byte.

The router fits each worker's prefill model online (:mod:`kvstrata.costs.online`). A time
to first token measured at the front door is a clean sample only when the request ran alone,
which on a busy worker is almost never: the engine packs several prompts into one step. So
the worker reports each request's own compute time, ``RequestRecord.prefill_compute_s`` (its
share of the forward steps up to its first token, ``BatchRunner._attribute``), with the
number of prompt tokens it found cached:

* **non-streamed answers** carry two headers, ``X-Kvstrata-Prefill-Compute-S`` (seconds,
  six decimals) and ``X-Kvstrata-Matched-Tokens`` (``serve.app``);
* **streamed answers**, only when the request carries ``X-Kvstrata-Timing: 1`` (the front
  door sends it), put one SSE comment in front of the event with the first token, in the
  same write::

      : kvstrata-timing prefill-compute-s=0.412375 matched-tokens=512\\n\\n

  A line that starts with ``:`` is a comment that SSE clients ignore (WHATWG HTML, "Server-
  sent events", interpreting an event stream), and the front door removes it
  (:func:`take_timing`), so what reaches a client is byte for byte the worker's answer
  without the comment. The comment rides on the first event with text: a stream that ends
  or fails before any text carries none.

The figure is an estimate of the request's prefill alone (exact for a prompt alone in its
steps; beside others, the cost model's split of each measured step). Neither is sent when
the worker does not know it (a prefill preempted half way: its steps were not one prefill).
The front door fits a worker's prefill model from its reports and learns from TTFTs only
what the reports leave out, the serving overhead around them (``fleet.workers``); from a
worker that reports nothing (vLLM), the fit comes from TTFTs measured alone.
"""

from __future__ import annotations

import math
import re
from typing import Final, NamedTuple

TIMING_REQUEST_HEADER: Final = "X-Kvstrata-Timing"
COMPUTE_HEADER: Final = "X-Kvstrata-Prefill-Compute-S"
MATCHED_HEADER: Final = "X-Kvstrata-Matched-Tokens"

MAX_COMPUTE_S: Final = 3600.0
"""Above any prefill: a larger (or non-finite, or negative) figure is a broken report."""
_MAX_TOKENS: Final = 1 << 31

_COMMENT = re.compile(
    rb": kvstrata-timing prefill-compute-s=([0-9.]{1,24}) matched-tokens=([0-9]{1,10})\n\n"
)


class PrefillTiming(NamedTuple):
    compute_s: float
    matched_tokens: int


def timing_comment(compute_s: float, matched_tokens: int) -> str:
    """The SSE comment a streamed answer carries in front of its first token."""
    return (
        f": kvstrata-timing prefill-compute-s={compute_s:.6f} matched-tokens={matched_tokens}\n\n"
    )


def checked(compute_s: float, matched_tokens: int) -> PrefillTiming | None:
    """A report whose figures make sense (a finite duration in (0, an hour], a whole count
    in range), else None: a broken worker's figures must not reach the router's fits."""
    if not (math.isfinite(compute_s) and 0 < compute_s <= MAX_COMPUTE_S):
        return None
    if not 0 <= matched_tokens < _MAX_TOKENS:
        return None
    return PrefillTiming(compute_s, matched_tokens)


def from_headers(compute: str | None, matched: str | None) -> PrefillTiming | None:
    """A non-streamed answer's report, from its two header values (None: none or broken)."""
    if compute is None or matched is None:
        return None
    try:
        return checked(float(compute), int(matched))
    except ValueError:
        return None


def take_timing(chunk: bytes) -> tuple[bytes, PrefillTiming | None]:
    """``chunk`` without its timing comment, and the report it held (None: none or broken;
    a broken comment is removed all the same)."""
    found = _COMMENT.search(chunk)
    if found is None:
        return chunk, None
    rest = chunk[: found.start()] + chunk[found.end() :]
    try:
        return rest, checked(float(found[1]), int(found[2]))
    except ValueError:
        return rest, None
