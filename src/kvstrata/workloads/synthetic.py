"""Deterministic synthetic Mooncake-format traces: conversations, shared prompts, documents.

Why: one real trace cannot tell whether an eviction policy is good or merely fitted to that
trace. These generators produce traces with the same format and the same causes of reuse
as chat services — a shared system prompt, documents that many conversations quote
(Zipf-popular), multi-turn conversations whose next turn re-sends the whole history after a
think time — but with different mixes and time scales. Every draw comes from one seeded
``random.Random``, so a (preset, seed) pair always yields the same trace.

Model of one conversation: it starts at an arrival of the arrival process, picks a system
prompt (Zipf) and, with ``document_probability``, a document (Zipf); each turn's prompt is
``system + document + user₁ + assistant₁ + … + userₜ``. After each turn it continues with
its own probability ``p`` (drawn once per conversation from Beta(a, b): some users keep
chatting, many leave after one turn) after a lognormal think time, until ``max_turns`` or
``max_context_tokens``. Lengths are lognormal (median, sigma).

Block ids are exact: each 512-token block is named by its parent's id and the token ranges
of the segments it covers, so two prompts share an id iff they share the whole prefix, and
a partial last block changes id when the next turn extends it — as in Mooncake's hashes.

Arrivals: Poisson at ``conversation_rate_per_s``, or the timestamps of an Azure LLM trace
CSV (``TIMESTAMP, ContextTokens, GeneratedTokens``; Patel et al., ISCA 2024), taking every
``azure_stride``-th row as a conversation start and its ContextTokens / GeneratedTokens as
the first user message and first answer lengths.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from kvstrata.errors import InvalidInput
from kvstrata.workloads.mooncake import BLOCK_TOKENS, TraceBlockId, TraceRequest

Segment = tuple[tuple[str, int, int], int]
"""((kind, owner, index), tokens): one stretch of a prompt with its own content."""


@dataclass(frozen=True)
class SyntheticConfig:
    """Knobs of one workload. Defaults describe a chat service; presets vary them."""

    seed: int = 0
    duration_s: float = 3600.0
    conversation_rate_per_s: float = 1.5
    azure_csv: str | None = None
    azure_stride: int = 4
    system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (400, 2000)
    system_zipf: float = 1.1
    documents: int = 0
    document_probability: float = 0.0
    document_tokens: tuple[float, float] = (6000.0, 0.8)  # lognormal (median, sigma)
    document_zipf: float = 1.0
    user_tokens: tuple[float, float] = (300.0, 1.2)
    output_tokens: tuple[float, float] = (300.0, 0.8)
    continue_beta: tuple[float, float] = (2.0, 3.0)
    think_time_s: tuple[float, float] = (90.0, 1.0)
    max_turns: int = 40
    max_context_tokens: int = 65_536


PRESETS: dict[str, SyntheticConfig] = {
    "chat": SyntheticConfig(),
    "docs": SyntheticConfig(
        conversation_rate_per_s=1.0,
        system_prompts=2,
        documents=3000,
        document_probability=0.7,
        user_tokens=(120.0, 1.0),
        continue_beta=(1.0, 3.0),
        think_time_s=(40.0, 1.3),
    ),
    "azure-conv": SyntheticConfig(
        azure_csv="azure-llm-2023/AzureLLMInferenceTrace_conv.csv",
        azure_stride=4,
        system_prompts=8,
        system_zipf=0.8,
        documents=500,
        document_probability=0.2,
        continue_beta=(1.5, 2.5),
        think_time_s=(60.0, 1.5),
    ),
}
"""``chat``: Poisson conversations, a few system prompts, no documents, engaged users.
``docs``: document Q&A — most conversations quote one of 3,000 Zipf-popular documents, short
questions, short sessions with short think times. ``azure-conv``: the arrival process and
length mix of Azure's 2023 conversation trace (``azure_csv`` is relative to the shared data
directory passed to ``generate``), heavier-tailed think times."""


def generate(
    config: SyntheticConfig, data_dir: str | os.PathLike[str] | None = None
) -> list[TraceRequest]:
    """All requests of the workload, sorted by arrival time (ties in generation order)."""
    rng = random.Random(config.seed)
    starts = _conversation_starts(config, rng, data_dir)
    system_lengths = [
        rng.randint(*config.system_prompt_tokens) for _ in range(config.system_prompts)
    ]
    document_lengths = [
        max(1, round(_lognormal(rng, *config.document_tokens))) for _ in range(config.documents)
    ]
    system_cdf = _zipf_cdf(config.system_prompts, config.system_zipf)
    document_cdf = _zipf_cdf(config.documents, config.document_zipf)
    interner: dict[tuple[int, tuple[tuple[tuple[str, int, int], int, int], ...]], int] = {}
    timed: list[tuple[int, int, TraceRequest]] = []
    for conversation, (start_s, first_user, first_output) in enumerate(starts):
        segments: list[Segment] = []
        if config.system_prompts:
            system = _pick(rng, system_cdf)
            segments.append((("s", system, 0), system_lengths[system]))
        if config.documents and rng.random() < config.document_probability:
            document = _pick(rng, document_cdf)
            segments.append((("d", document, 0), document_lengths[document]))
        keep_going = rng.betavariate(*config.continue_beta)
        now_s = start_s
        for turn in range(config.max_turns):
            user = first_user if turn == 0 and first_user else _length(rng, config.user_tokens)
            segments.append((("u", conversation, turn), user))
            input_length = sum(tokens for _, tokens in segments)
            if input_length > config.max_context_tokens or now_s >= config.duration_s:
                break
            output = (
                first_output if turn == 0 and first_output else _length(rng, config.output_tokens)
            )
            request = TraceRequest(
                timestamp_ms=round(now_s * 1000),
                input_length=input_length,
                output_length=output,
                hash_ids=_block_ids(segments, interner),
            )
            timed.append((request.timestamp_ms, len(timed), request))
            segments.append((("a", conversation, turn), output))
            if rng.random() >= keep_going:
                break
            now_s += _lognormal(rng, *config.think_time_s)
    timed.sort()
    return [request for _, _, request in timed]


def preset(name: str, seed: int = 0) -> SyntheticConfig:
    if name not in PRESETS:
        raise InvalidInput(f"unknown synthetic preset {name!r}; expected one of {sorted(PRESETS)}")
    return replace(PRESETS[name], seed=seed)


def write_trace(path: str | os.PathLike[str], requests: list[TraceRequest]) -> None:
    """Write requests as Mooncake JSONL (readable by ``kvstrata.workloads.read_trace``)."""
    with Path(path).open("w", encoding="utf-8") as handle:
        for request in requests:
            record = {
                "timestamp": request.timestamp_ms,
                "input_length": request.input_length,
                "output_length": request.output_length,
                "hash_ids": [int(block) for block in request.hash_ids],
            }
            handle.write(json.dumps(record) + "\n")


def _conversation_starts(
    config: SyntheticConfig, rng: random.Random, data_dir: str | os.PathLike[str] | None
) -> list[tuple[float, int, int]]:
    """(start second, first user tokens or 0, first output tokens or 0) per conversation."""
    if config.azure_csv is None:
        if config.conversation_rate_per_s <= 0:
            raise InvalidInput("conversation_rate_per_s must be > 0")
        starts: list[tuple[float, int, int]] = []
        now_s = rng.expovariate(config.conversation_rate_per_s)
        while now_s < config.duration_s:
            starts.append((now_s, 0, 0))
            now_s += rng.expovariate(config.conversation_rate_per_s)
        return starts
    csv_path = Path(config.azure_csv)
    if not csv_path.is_absolute():
        if data_dir is None:
            raise InvalidInput(f"{config.azure_csv} is relative: pass the shared data directory")
        csv_path = Path(data_dir) / csv_path
    return _azure_starts(csv_path, config.azure_stride, config.duration_s)


def _azure_starts(path: Path, stride: int, duration_s: float) -> list[tuple[float, int, int]]:
    if stride < 1:
        raise InvalidInput(f"azure_stride must be >= 1, got {stride}")
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
    except OSError as exc:
        raise InvalidInput(f"cannot read Azure trace {path}: {exc.strerror or exc}") from exc
    starts: list[tuple[float, int, int]] = []
    origin: datetime | None = None
    for row in rows[::stride]:
        stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
        origin = origin or stamp
        offset = (stamp - origin).total_seconds()
        if offset >= duration_s:
            break
        starts.append((offset, max(1, int(row["ContextTokens"])), int(row["GeneratedTokens"])))
    return starts


def _block_ids(
    segments: list[Segment],
    interner: dict[tuple[int, tuple[tuple[tuple[str, int, int], int, int], ...]], int],
) -> tuple[TraceBlockId, ...]:
    ids: list[TraceBlockId] = []
    parent = -1
    pieces: list[tuple[tuple[str, int, int], int, int]] = []
    fill = 0

    def close() -> None:
        nonlocal parent, pieces, fill
        name = (parent, tuple(pieces))
        block = interner.setdefault(name, len(interner))
        ids.append(TraceBlockId(block))
        parent, pieces, fill = block, [], 0

    for content, tokens in segments:
        start = 0
        while start < tokens:
            take = min(tokens - start, BLOCK_TOKENS - fill)
            pieces.append((content, start, start + take))
            fill += take
            start += take
            if fill == BLOCK_TOKENS:
                close()
    if pieces:
        close()
    return tuple(ids)


def _zipf_cdf(count: int, exponent: float) -> list[float]:
    weights = [1.0 / (rank**exponent) for rank in range(1, count + 1)]
    total = sum(weights)
    cdf: list[float] = []
    running = 0.0
    for weight in weights:
        running += weight / total
        cdf.append(running)
    return cdf


def _pick(rng: random.Random, cdf: list[float]) -> int:
    from bisect import bisect_left

    return min(bisect_left(cdf, rng.random()), len(cdf) - 1)


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(median), sigma)


def _length(rng: random.Random, spec: tuple[float, float]) -> int:
    return max(1, round(_lognormal(rng, *spec)))
