"""Reader for Mooncake-format request traces (Qin et al., USENIX FAST 2025).

Format: one JSON object per line with

    timestamp      int, milliseconds of relative arrival
    input_length   int >= 0, prompt tokens
    output_length  int >= 0, generated tokens
    hash_ids       list of int, one id per ``BLOCK_TOKENS``-token block of the prompt

An id is *chained*: it names the whole prefix that ends with its block, so two requests that
share id ``h`` at position ``i`` share their first ``i + 1`` blocks. The last block may be
partial, hence ``len(hash_ids) == ceil(input_length / BLOCK_TOKENS)``. Unknown extra fields
are ignored (traces grow columns); blank lines are skipped.

The reader is strict on everything else because benchmarks and the simulator both trust
these invariants: a malformed line raises ``TraceFormatError`` naming the file, the 1-based
line number and the problem, rather than silently skewing a hit rate. Requests are returned
in file order; this module does not sort or otherwise reinterpret the trace.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NewType

from kvstrata.errors import InvalidInput, TraceFormatError

BLOCK_TOKENS = 512
"""Tokens per hashed block in Mooncake traces."""

TraceBlockId = NewType("TraceBlockId", int)
"""A trace's chained prefix id. Not a ``kvstrata.identity`` key: ids are remapped integers
that are only comparable within one trace."""

_REQUIRED_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. Invariant: ``len(hash_ids) == ceil(input_length / 512)``."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[TraceBlockId, ...]

    @property
    def timestamp_s(self) -> float:
        return self.timestamp_ms / 1000.0

    @property
    def block_count(self) -> int:
        return len(self.hash_ids)

    def prefix_tokens(self, blocks: int) -> int:
        """Prompt tokens covered by the first ``blocks`` blocks.

        All blocks are full except possibly the last, so a cache hit on every block covers
        ``input_length`` tokens rather than ``512 * block_count``.
        """
        if not 0 <= blocks <= len(self.hash_ids):
            raise InvalidInput(f"blocks must be in [0, {len(self.hash_ids)}], got {blocks}")
        if blocks == len(self.hash_ids):
            return self.input_length
        return blocks * BLOCK_TOKENS


MAX_FIELD = 2**53
"""Largest timestamp or length accepted: exact as a float (times are divided into seconds)."""


def blocks_for_tokens(tokens: int) -> int:
    """Number of (possibly partial) blocks needed for ``tokens`` prompt tokens."""
    return -(-tokens // BLOCK_TOKENS)


def parse_request(record: Any) -> TraceRequest:
    """Validate one decoded JSON value; raise ``ValueError`` with the problem if malformed.

    Kept separate from file handling so that callers with records from elsewhere (a
    generator, a socket) get the same checks; ``iter_trace`` adds the file and line.
    """
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    missing = [name for name in _REQUIRED_FIELDS if name not in record]
    if missing:
        raise ValueError(f"missing field(s): {', '.join(missing)}")
    timestamp = _non_negative_int(record, "timestamp")
    input_length = _non_negative_int(record, "input_length")
    output_length = _non_negative_int(record, "output_length")
    raw_ids = record["hash_ids"]
    if not isinstance(raw_ids, list):
        raise ValueError(f"hash_ids: expected a list, got {type(raw_ids).__name__}")
    seen: dict[int, int] = {}
    for position, value in enumerate(raw_ids):
        if not _is_int(value):
            raise ValueError(f"hash_ids[{position}]: expected an int, got {type(value).__name__}")
        if value in seen:  # an id names a whole prefix: it cannot occur twice in one prompt
            raise ValueError(f"hash_ids[{position}] repeats hash_ids[{seen[value]}] ({value})")
        seen[value] = position
    expected_blocks = blocks_for_tokens(input_length)
    if len(raw_ids) != expected_blocks:
        raise ValueError(
            f"len(hash_ids) = {len(raw_ids)} but input_length {input_length} needs "
            f"ceil({input_length}/{BLOCK_TOKENS}) = {expected_blocks} blocks"
        )
    if input_length == 0:
        raise ValueError("input_length: a request needs at least one prompt token")
    return TraceRequest(
        timestamp_ms=timestamp,
        input_length=input_length,
        output_length=output_length,
        hash_ids=tuple(TraceBlockId(value) for value in raw_ids),
    )


def iter_trace(path: str | os.PathLike[str]) -> Iterator[TraceRequest]:
    """Yield the requests of a trace file lazily, in file order."""
    trace_path = Path(path)
    try:
        with trace_path.open("r", encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                yield _parse_line(trace_path, line_number, line)
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{trace_path}: not valid UTF-8: {exc}") from exc
    except OSError as exc:
        raise InvalidInput(f"cannot read trace {trace_path}: {exc.strerror or exc}") from exc


def read_trace(path: str | os.PathLike[str]) -> list[TraceRequest]:
    """Read a whole trace file into memory (the Mooncake traces are a few MB)."""
    return list(iter_trace(path))


def _parse_line(path: Path, line_number: int, line: str) -> TraceRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{path}:{line_number}: bad JSON: {exc.msg}") from exc
    try:
        return parse_request(record)
    except ValueError as exc:
        raise TraceFormatError(f"{path}:{line_number}: {exc}") from exc


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _non_negative_int(record: dict[str, Any], name: str) -> int:
    value = record[name]
    if not _is_int(value):
        raise ValueError(f"{name}: expected an int, got {type(value).__name__}")
    if not 0 <= value <= MAX_FIELD:
        raise ValueError(f"{name}: expected 0..{MAX_FIELD}, got {value}")
    return int(value)
