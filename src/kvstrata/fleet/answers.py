"""Reading a worker's answers as the front door relays them: a stream's head up to its first
token (a chat's opening role event is not one, nor a comment), the worker's timing comment
taken out of it, and the usage counts of a JSON answer or of
an SSE event — whole counts in range only, so a broken worker's garbage never reaches the
router's fits. Pure: bytes in, values out."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from kvstrata.serve.timing import PrefillTiming, take_timing


async def stream_head(chunks: AsyncIterator[bytes]) -> tuple[list[bytes], float | None]:
    """A stream's chunks up to and including its first token (or its end, if it ends first),
    and when that token came: what the front door reads before it answers the client."""
    head: list[bytes] = []
    read = b""  # the head so far: an event may arrive split over several reads
    async for chunk in chunks:
        head.append(chunk)
        read += chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")  # SSE's line ends
        end = read.rfind(b"\n\n")
        events = read[: end + 2] if end >= 0 else b""  # the complete events
        if b"data:" in events and not only_role_preamble(events):  # not a bare comment
            return head, time.time()
    return head, None


def head_timing(head: list[bytes]) -> tuple[list[bytes], PrefillTiming | None]:
    """A stream's head as one chunk without the worker's timing comment (``serve.timing``;
    searched in the whole head, so a comment split over reads is found), and its report."""
    rest, timing = take_timing(b"".join(head))
    return ([rest] if rest else []), timing


async def chained(head: list[bytes], rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    for chunk in head:
        yield chunk
    async for chunk in rest:
        yield chunk


_ROLE_PREAMBLE = b'"delta":{"role":"assistant","content":""}'


def only_role_preamble(chunk: bytes) -> bool:
    """Is ``chunk`` nothing but a chat stream's opening event — the assistant role with empty
    content, which workers (kvstrata's and vLLM's) send before the prefill? It is not the first
    token: taken for one, the router believed every streamed chat's prefill done at once, and
    its queue estimates and TTFT metrics were wrong for them."""
    return chunk.count(b"data:") == 1 and _ROLE_PREAMBLE in chunk


_MAX_USAGE_TOKENS = 1 << 31
"""Above any context a worker serves: a larger count (or inf, NaN) is a broken answer."""


def usage_of(content: bytes) -> tuple[int, int] | None:
    """(completion_tokens, cached_tokens) from a worker's JSON answer, if it has a usage that
    makes sense (whole counts in range: a broken worker's garbage must not reach the fits)."""
    try:
        usage = json.loads(content).get("usage")
        details = usage.get("prompt_tokens_details") or {}  # vLLM may send null
        counts = (usage["completion_tokens"], details.get("cached_tokens") or 0)
    except (ValueError, AttributeError, KeyError, TypeError, RecursionError):
        return None
    if not all(type(n) is int and 0 <= n < _MAX_USAGE_TOKENS for n in counts):
        return None
    return counts[0], counts[1]


def usage_in_sse(chunk: bytes) -> tuple[int, int] | None:
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            found = usage_of(line[len(b"data: ") :])
            if found is not None:
                return found
    return None
