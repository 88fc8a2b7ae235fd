"""Exactness verification: does cached prefill reproduce a fresh prefill on *this* model?

For operators who must know before turning caching on. Each prompt runs on the same engine:
first a fresh reference (no lookup and no store: a run that stores would adopt a block the
pool already holds under its key at publication, and read that from then on — not fresh), then
the same run again storing its blocks (computed fresh; a block already held stays the held
one), then a run that reuses the longest cached prefix. Reference and cached run
decode greedily; we compare the logits of every step and the greedy tokens.

With ``concurrency`` N > 1 the fresh reference of every prompt still runs alone, and then the
prompts are replayed N at a time in shared engine steps, each as a fresh run (no store either)
and a cached run side by side: mixed batches of cached and uncached sequences, prefill chunks
and decodes of different lengths. Both batched runs are compared with the reference run
alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

from kvstrata.engine.engine import ReferenceEngine
from kvstrata.engine.generation import Generation
from kvstrata.engine.sampling import SamplingParams
from kvstrata.errors import InvalidInput
from kvstrata.identity import DEFAULT_TENANT

DEFAULT_TOLERANCE = 1e-4


@dataclass(frozen=True)
class VerifyPrompt:
    line: int
    tenant: str
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None


@dataclass(frozen=True)
class PromptVerdict:
    line: int
    tenant: str
    prompt_tokens: int
    matched_tokens: int
    max_abs_logit_diff: float
    greedy_equal: bool


def _parse_messages(raw: Any, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(raw, list) or not raw:
        raise InvalidInput(f"{where}: 'messages' must be a non-empty list")
    messages = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise InvalidInput(f"{where}: messages[{i}] must be an object")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise InvalidInput(f"{where}: messages[{i}] needs string 'role' and 'content'")
        messages.append({"role": role, "content": content})
    return tuple(messages)


def read_prompts(path: Path) -> list[VerifyPrompt]:
    """Parse a JSONL file of prompts; a malformed line raises ``InvalidInput`` naming it."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"cannot read {path}: {exc}") from exc
    prompts: list[VerifyPrompt] = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"{where}: invalid JSON ({exc.msg})") from exc
        if not isinstance(obj, dict):
            raise InvalidInput(f"{where}: expected a JSON object")
        tenant = obj.get("tenant", DEFAULT_TENANT)
        if not isinstance(tenant, str) or not tenant:
            raise InvalidInput(f"{where}: 'tenant' must be a non-empty string")
        has_prompt, has_messages = "prompt" in obj, "messages" in obj
        if has_prompt == has_messages:
            raise InvalidInput(f"{where}: give exactly one of 'prompt' or 'messages'")
        if has_prompt:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise InvalidInput(f"{where}: 'prompt' must be a non-empty string")
            prompts.append(VerifyPrompt(line=number, tenant=tenant, prompt=obj["prompt"]))
        else:
            messages = _parse_messages(obj["messages"], where)
            prompts.append(VerifyPrompt(line=number, tenant=tenant, messages=messages))
    if not prompts:
        raise InvalidInput(f"{path}: no prompts")
    return prompts


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _compare(reference: Generation, other: Generation) -> tuple[float, bool]:
    diff = max(
        float((a - b).abs().max().item())
        for a, b in zip(reference.step_logits, other.step_logits, strict=True)
    )
    return diff, reference.output_ids == other.output_ids


def verify_tokens(
    engine: ReferenceEngine, token_ids: Sequence[int], *, tenant: str, max_tokens: int
) -> tuple[int, float, bool]:
    """(matched tokens, max |Δlogit| over all steps, greedy tokens equal) for one prompt."""
    params = _greedy(max_tokens)
    fresh = _reference(engine, token_ids, tenant, params)
    _store_blocks(engine, token_ids, tenant, params)
    cached = engine.generate(token_ids, params, tenant=tenant, keep_logits=True).run()
    diff, equal = _compare(fresh, cached)
    return cached.record.matched_tokens, diff, equal


def _reference(
    engine: ReferenceEngine, token_ids: Sequence[int], tenant: str, params: SamplingParams
) -> Generation:
    """A fresh run: reads no cached block and adopts none (module docstring)."""
    return engine.generate(
        token_ids, params, tenant=tenant, lookup=False, store=False, keep_logits=True
    ).run()


def _store_blocks(
    engine: ReferenceEngine, token_ids: Sequence[int], tenant: str, params: SamplingParams
) -> None:
    """The run's blocks, computed fresh, stored for the cached run to reuse: with the same
    greedy answer, so the block that continues the prompt is there for its tail."""
    engine.generate(token_ids, params, tenant=tenant, lookup=False, store=True).run()


def run_together(generations: Sequence[Generation]) -> None:
    """Drive generations to their ends from this thread; they share the engine's steps."""
    iterators = [iter(g) for g in generations]
    for _ in zip_longest(*iterators):
        pass


def _encode(engine: ReferenceEngine, item: VerifyPrompt) -> list[int]:
    if item.messages is not None:
        return engine.encode_chat(item.messages)
    assert item.prompt is not None
    return engine.encode_prompt(item.prompt)


def verify_prompts(
    engine: ReferenceEngine,
    prompts: Sequence[VerifyPrompt],
    *,
    max_tokens: int = 32,
    concurrency: int = 1,
) -> Iterator[PromptVerdict]:
    if concurrency < 1:
        raise InvalidInput("concurrency must be at least 1")
    if concurrency == 1:
        for item in prompts:
            ids = _encode(engine, item)
            matched, diff, equal = verify_tokens(
                engine, ids, tenant=item.tenant, max_tokens=max_tokens
            )
            yield PromptVerdict(item.line, item.tenant, len(ids), matched, diff, equal)
        return
    params = _greedy(max_tokens)
    for start in range(0, len(prompts), concurrency):
        group = prompts[start : start + concurrency]
        encoded = [_encode(engine, item) for item in group]
        references = [
            _reference(engine, ids, item.tenant, params)
            for item, ids in zip(group, encoded, strict=True)
        ]
        for item, ids in zip(group, encoded, strict=True):
            _store_blocks(engine, ids, item.tenant, params)
        batched: list[tuple[Generation, Generation]] = []
        for item, ids in zip(group, encoded, strict=True):
            fresh = engine.generate(
                ids, params, tenant=item.tenant, lookup=False, store=False, keep_logits=True
            )
            cached = engine.generate(ids, params, tenant=item.tenant, keep_logits=True)
            batched.append((fresh, cached))
        run_together([g for pair in batched for g in pair])
        for item, ids, reference, (fresh, cached) in zip(
            group, encoded, references, batched, strict=True
        ):
            fresh_diff, fresh_equal = _compare(reference, fresh)
            cached_diff, cached_equal = _compare(reference, cached)
            yield PromptVerdict(
                item.line,
                item.tenant,
                len(ids),
                cached.record.matched_tokens,
                max(fresh_diff, cached_diff),
                fresh_equal and cached_equal,
            )


def summarise(verdicts: Sequence[PromptVerdict], tolerance: float) -> dict[str, Any]:
    max_diff = max((v.max_abs_logit_diff for v in verdicts), default=0.0)
    return {
        "prompts": len(verdicts),
        "all_exact": all(v.greedy_equal for v in verdicts) and max_diff <= tolerance,
        "max_abs_logit_diff": max_diff,
        "min_matched_tokens": min((v.matched_tokens for v in verdicts), default=0),
    }


def verdict_dict(verdict: PromptVerdict) -> dict[str, Any]:
    return asdict(verdict)
