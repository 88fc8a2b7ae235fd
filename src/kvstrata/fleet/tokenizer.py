"""The router's tokenizer: it turns prompts and chats into token ids exactly as the workers'
engine does, so the blocks the router hashes are the blocks the workers cached."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstrata.runtime import tokenization


class FleetTokenizer:
    """Tokenizes as ``ReferenceEngine.encode_prompt`` / ``encode_chat`` do (tested equal)."""

    def __init__(self, model_dir: Path, chat_template: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.chat_template = chat_template

    def encode_prompt(self, prompt: str) -> list[int]:
        return tokenization.encode_prompt(self.tokenizer, prompt)

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return tokenization.encode_chat(self.tokenizer, messages, self.chat_template)

    def chat_content_start(self, messages: Sequence[dict[str, Any]]) -> tuple[list[int], int]:
        return tokenization.chat_content_start(self.tokenizer, messages, self.chat_template)
