"""What a worker accepts from one request: its output length.

``output_budget`` is the one rule for a request's ``max_tokens``: an explicit value above
``ServeLimits.max_tokens`` is a 400 (as vLLM words it: "max_tokens must be at most N"), and a
request without one gets its endpoint's default capped by the limit and by the room its prompt
leaves in the context window.
"""

from __future__ import annotations

from typing import Final

from kvstrata.errors import ApiError, ContextTooLong
from kvstrata.runtime.config import ServeLimits
from kvstrata.serve.protocol import SamplingRequest

DEFAULT_LIMITS: Final = ServeLimits()


def output_budget(
    body: SamplingRequest, *, prompt_tokens: int, max_model_len: int, limit: int
) -> int:
    """The ``max_tokens`` a request runs with.

    An explicit value above ``limit`` raises ``ApiError`` (400); one that does not fit the
    context window is left to the engine, which raises ``ContextTooLong``. Without one, the
    endpoint's default (16 for completions, none for chat) is capped by ``limit`` and by the
    room the prompt leaves in the context window; a prompt that leaves no room raises
    ``ContextTooLong``.
    """
    param = body.explicit_max_tokens_param()
    asked = body.requested_max_tokens()
    if param is not None and asked is not None:
        if asked > limit:
            raise ApiError(
                400, f"{param} must be at most {limit}", code="invalid_value", param=param
            )
        return asked
    room = max_model_len - prompt_tokens
    if room < 1:
        raise ContextTooLong(
            f"prompt of {prompt_tokens} tokens fills the context window of {max_model_len} tokens"
        )
    return min(room, limit) if asked is None else min(asked, room, limit)
