"""The router's tokenizer: it turns prompts and chats into token ids exactly as the workers'
engine does, so the blocks the router hashes are the blocks the workers cached."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstrata.runtime import tokenization

_NO_LIMIT = 1 << 24
"""``transformers`` states an unknown context as about 1e30: no bound."""


def _context_of(model_dir: Path, tokenizer: Any) -> int | None:
    """``max_position_embeddings`` of the model's config, else the tokenizer's
    ``model_max_length`` when it states a real one."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    for context in (
        config.get("max_position_embeddings") if isinstance(config, dict) else None,
        getattr(tokenizer, "model_max_length", None),
    ):
        if type(context) is int and 0 < context < _NO_LIMIT:
            return context
    return None


class FleetTokenizer:
    """Tokenizes as ``ReferenceEngine.encode_prompt`` / ``encode_chat`` do (tested equal)."""

    def __init__(self, model_dir: Path, chat_template: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.chat_template = chat_template
        self.context_tokens = _context_of(model_dir, self.tokenizer)
        """The model's context window (None: neither its config nor its tokenizer says)."""
        self.token_bytes = tokenization.max_token_bytes(self.tokenizer)

    def refuse_if_it_cannot_fit(self, texts: Sequence[str], param: str) -> None:
        """The workers' own early refusal (``tokenization.refuse_if_it_cannot_fit``) against
        the model's context: the front door would otherwise spend seconds tokenizing
        megabytes of text that every worker refuses at once."""
        if self.context_tokens is not None:
            tokenization.refuse_if_it_cannot_fit(
                texts, self.context_tokens, self.token_bytes, param
            )

    def encode_prompt(self, prompt: str) -> list[int]:
        return tokenization.encode_prompt(self.tokenizer, prompt)

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return tokenization.encode_chat(self.tokenizer, messages, self.chat_template)

    def chat_content_start(self, messages: Sequence[dict[str, Any]]) -> tuple[list[int], int]:
        return tokenization.chat_content_start(self.tokenizer, messages, self.chat_template)
