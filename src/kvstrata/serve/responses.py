"""OpenAI-shaped response bodies: completions, chat completions, their stream chunks, usage
and the model list. ``usage.prompt_tokens_details.cached_tokens`` carries the matched prefix
tokens, as OpenAI and vLLM report them."""

from __future__ import annotations

import time
from typing import Any


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_body: dict[str, Any] | None,
    *,
    chunk: bool = False,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if not chunk or usage_body is not None:
        body["usage"] = usage_body
    return body


def chat_body(
    request_id: str, model: str, text: str, finish_reason: str | None, usage_body: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage_body,
    }


def chat_chunk(
    request_id: str,
    model: str,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    usage_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion.chunk``; ``delta=None`` makes the choice-less usage chunk."""
    choices = (
        []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    )
    body: dict[str, Any] = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage_body is not None:
        body["usage"] = usage_body
    return body


def models_body(model: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "kvstrata",
                "max_model_len": max_model_len,
            }
        ],
    }
