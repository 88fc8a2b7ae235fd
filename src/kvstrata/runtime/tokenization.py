"""Prompt and chat → token ids, the one way every kvstrata component does it.

The router tokenizes a request before a worker does, to hash its blocks: if the two ever
disagreed, routing would chase prefixes no worker holds. Both call these functions (no torch
here, so the router process need not load a model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    return list(tokenizer(prompt)["input_ids"])


def encode_chat(
    tokenizer: Any, messages: Sequence[dict[str, Any]], chat_template: str | None
) -> list[int]:
    """Render the chat template (with the generation prompt), then tokenize without specials."""
    text = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=False, chat_template=chat_template
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
