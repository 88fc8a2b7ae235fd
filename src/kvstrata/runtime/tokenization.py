"""Prompt and chat → token ids, the one way every kvstrata component does it.

The router tokenizes a request before a worker does, to hash its blocks: if the two ever
disagreed, routing would chase prefixes no worker holds. Both call these functions (no torch
here, so the router process need not load a model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstrata.errors import ApiError


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    return list(tokenizer(prompt)["input_ids"])


def encode_chat(
    tokenizer: Any, messages: Sequence[dict[str, Any]], chat_template: str | None
) -> list[int]:
    """Render the chat template (with the generation prompt), then tokenize without specials.

    Raises ``ApiError`` 400 (``invalid_value``, param ``messages``) when the model has no chat
    template, or when its template refuses the conversation: Llama-2's and Mistral's call
    ``raise_exception`` (a jinja2 ``TemplateError``) for roles out of order. Either is the
    client's to fix (send a conversation the model takes, or use ``/v1/completions``), not a
    server failure: a worker and the front door both answer it so, as vLLM does."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ApiError(
            400,
            "this model has no chat template: use /v1/completions with a prompt instead",
            code="invalid_value",
            param="messages",
        )
    try:
        text = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=False, chat_template=chat_template
        )
    except _template_errors() as exc:
        raise ApiError(
            400,
            f"the model's chat template refused these messages: {exc}"[:500],
            code="invalid_value",
            param="messages",
        ) from exc
    return list(tokenizer.encode(text, add_special_tokens=False))


def _template_errors() -> tuple[type[Exception], ...]:
    """What a chat template's rendering raises for a conversation it refuses: a jinja2
    ``TemplateError`` (``raise_exception``, an undefined variable) or, from ``transformers``,
    a ``ValueError`` (no template to render). Evaluated only when an ``except`` clause is
    reached; jinja2 is imported late, as ``transformers`` itself does."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers renders no template without it
        return (ValueError,)
    return (ValueError, TemplateError)


def chat_content_start(
    tokenizer: Any, messages: Sequence[dict[str, Any]], chat_template: str | None
) -> tuple[list[int], int]:
    """A chat's token ids and the index of the first one that depends on what the messages
    say: where they first differ from the same chat with every ``content`` blanked.

    Tokens before it are the chat template's alone (its default system prompt, role
    headers): every conversation of the tenant shares those blocks, and they tell nothing of
    this one. A deletion of the conversation starts at the block holding this token
    (``serve.deletion``). A merge across the boundary can only move the difference earlier,
    which deletes a block more, never one less."""
    tokens = encode_chat(tokenizer, messages, chat_template)
    blank = encode_chat(tokenizer, [{**m, "content": ""} for m in messages], chat_template)
    start = 0
    while start < len(tokens) and start < len(blank) and tokens[start] == blank[start]:
        start += 1
    return tokens, start


def max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes of text one token of ``tokenizer`` can stand for: its longest
    vocabulary entry (byte-level BPE writes one character per byte; SentencePiece's ``▁`` is
    three bytes for one space, an over-estimate, which is safe here). A tokenizer without a
    vocabulary to read gets a bound too large to refuse anything."""
    vocab = getattr(tokenizer, "get_vocab", None)
    if vocab is None:
        return 1 << 30
    pieces = (len(str(piece).encode("utf-8", "surrogatepass")) for piece in vocab())
    return max(pieces, default=1 << 30)


def cannot_fit(text_bytes: int, context_tokens: int, token_bytes: int) -> bool:
    """Must text of ``text_bytes`` UTF-8 bytes tokenize to more than ``context_tokens``?

    Each token covers at most ``token_bytes`` bytes, so the text needs at least
    ``text_bytes / token_bytes`` tokens; with a factor 2 of margin (a normalizer may drop a
    few characters). Lets a server refuse a prompt far too long for its context before it
    spends seconds tokenizing it."""
    return text_bytes > 2 * context_tokens * token_bytes


def refuse_if_it_cannot_fit(
    texts: Sequence[str], context_tokens: int, token_bytes: int, param: str
) -> None:
    """A 400 (``context_length_exceeded``) before tokenizing text far too long for a context
    window of ``context_tokens`` (megabytes of it would hold a tokenizer thread for seconds);
    ``cannot_fit`` is the rule."""
    size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
    if cannot_fit(size, context_tokens, token_bytes):
        raise ApiError(
            400,
            f"{size} bytes of text cannot fit the context window of {context_tokens} tokens",
            code="context_length_exceeded",
            param=param,
        )
