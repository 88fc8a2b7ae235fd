"""The body of ``POST /admin/delete``, shared by a worker and the front door (engine-free).

Exactly one selector per request, and nothing else (anything else is a 400)::

    {"tenant": T, "all": true}                  every object of namespace T
    {"tenant": T, "prompt": TEXT}               the prompt's blocks and their descendants
    {"tenant": T, "messages": [...]}            the same for a chat (templated as chat is)
    {"tenant": T, "prompt_token_ids": [...]}    the same for tokens (what the front door sends)
    {"tenant": T, "prompt_token_ids": [...], "content_from": I}
                                                the same from the block holding token I on
                                                (the front door's form of a chat)
    {"tenant": T, "older_than_s": N}            T's objects created more than N seconds ago

``tenant`` is a namespace name exactly as blocks are stored under it (``acme``, or a narrowed
``acme/conv-1``, which ``all`` on ``acme`` does not reach). The selector's kind is the audit
record's reason; the prompt itself is never logged.

A chat is deleted from its first block that holds message content on
(``tokenization.chat_content_start``): the blocks before it hold only the chat template (its
default system prompt, role headers), shared by every conversation of the tenant and telling
nothing of this one; deleting them would take every other conversation's cache with them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvstrata.errors import ApiError
from kvstrata.security.keys import MAX_NAMESPACE_CHARS, valid_namespace
from kvstrata.serve.protocol import ChatCompletionRequest, ChatMessage, parse_json, valid_text

DELETE_PATH: Final = "/admin/delete"
MAX_DELETE_TOKENS: Final = 1 << 20


TOKEN_ID_LIMIT = 1 << 32
"""Token ids a request may name at the front door or in a delete: [0, 2**32), what the router
can hash (``identity.router_hash``); each worker checks its own vocabulary."""


class SelectorKind(StrEnum):
    ALL = "all"
    PROMPT = "prompt"
    MESSAGES = "messages"
    TOKENS = "prompt_token_ids"
    OLDER_THAN = "older_than"


class DeleteRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    tenant: str = Field(min_length=1, max_length=MAX_NAMESPACE_CHARS)
    all: bool | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    prompt_token_ids: list[int] | None = Field(default=None, max_length=MAX_DELETE_TOKENS)
    older_than_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    content_from: int | None = Field(default=None, ge=0)  # with prompt_token_ids only

    @field_validator("prompt")
    @classmethod
    def _prompt_is_text(cls, value: str | None) -> str | None:
        return None if value is None else valid_text(value)

    @model_validator(mode="after")
    def _one_selector(self) -> Self:
        if not valid_namespace(self.tenant):
            raise ValueError("tenant must be printable")
        given = [
            name
            for name in ("all", "prompt", "messages", "prompt_token_ids", "older_than_s")
            if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of all, prompt, messages, prompt_token_ids, older_than_s"
            )
        if self.all is False:
            raise ValueError('"all" may only be true')
        if self.prompt_token_ids is not None and any(
            not 0 <= t < TOKEN_ID_LIMIT for t in self.prompt_token_ids
        ):  # no tokenizer makes others; beyond, the router's hashing refused them with a 500
            raise ValueError("token ids must be in [0, 2**32)")
        if self.content_from is not None and self.prompt_token_ids is None:
            raise ValueError("content_from goes with prompt_token_ids only")
        return self

    @property
    def kind(self) -> SelectorKind:
        if self.all:
            return SelectorKind.ALL
        if self.prompt is not None:
            return SelectorKind.PROMPT
        if self.messages is not None:
            return SelectorKind.MESSAGES
        if self.prompt_token_ids is not None:
            return SelectorKind.TOKENS
        return SelectorKind.OLDER_THAN

    @property
    def by_prompt(self) -> bool:
        """Selects a prompt's blocks (text, chat or tokens), not by tenant or age."""
        return self.kind in (SelectorKind.PROMPT, SelectorKind.MESSAGES, SelectorKind.TOKENS)

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them (as ``/v1/chat/completions`` does)."""
        assert self.messages is not None
        return ChatCompletionRequest.model_construct(messages=self.messages).template_messages()


def parse_delete_body(raw: bytes) -> DeleteRequest:
    """Parse and validate a delete body; ``ApiError`` 400 naming the first problem."""
    payload = parse_json(raw)
    if not isinstance(payload, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return DeleteRequest.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        message = str(first.get("msg"))
        raise ApiError(
            400, message if param is None else f"{param}: {message}", param=param
        ) from exc


__all__ = [
    "DELETE_PATH",
    "TOKEN_ID_LIMIT",
    "DeleteRequest",
    "SelectorKind",
    "parse_delete_body",
]
