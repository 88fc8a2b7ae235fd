"""OpenAI request parameters the reference engine cannot honour, refused rather than dropped.

The engine generates plain text: it calls no tools, constrains no output format and biases
no logits. A client that sends ``tools`` and gets text back, or ``response_format`` JSON and
gets prose, was silently answered something else than it asked for; so each such parameter
is a 400 (``invalid_value``) naming it, unless its value asks for nothing: null, an empty
list or object, ``"none"`` (``tool_choice``, ``function_call``) or ``{"type": "text"}``
(``response_format``). Parameters that change nothing in the answer (``user``, ``store``,
``metadata``, ``parallel_tool_calls``, ``service_tier``, ``stream_options``...) stay accepted.
"""

from __future__ import annotations

from typing import Any, Final

UNSUPPORTED_PARAMS: Final = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "logit_bias",
)
"""Request fields (``SamplingRequest``) refused unless they ask for nothing."""

UNSUPPORTED_MESSAGE_FIELDS: Final = ("tool_calls", "tool_call_id", "function_call")
"""A chat message's fields (``ChatMessage``) refused unless null (or, a list, empty)."""

_WHY: Final = {
    "tools": "tool calling is not supported",
    "tool_choice": 'tool calling is not supported; only "none" is accepted',
    "functions": "function calling is not supported",
    "function_call": 'function calling is not supported; only "none" is accepted',
    "response_format": 'only {"type": "text"} is supported (no JSON mode or schemas)',
    "logit_bias": "logit_bias is not supported",
}
_NO_TOOLS: Final = "is not supported: the engine does no tool calling"


def asks_for_nothing(name: str, value: Any) -> bool:
    """Whether ``value`` of the parameter ``name`` is the one that changes nothing."""
    if value is None:
        return True
    if name in ("tool_choice", "function_call"):
        return bool(value == "none")
    if name == "response_format":
        return bool(value == {"type": "text"})
    return bool(value == [] or value == {})


def refuse_unsupported(name: str, value: Any) -> Any:
    """``value`` when it asks for nothing, else ``ValueError`` (a 400 naming ``name``)."""
    if not asks_for_nothing(name, value):
        raise ValueError(_WHY.get(name, f"{name} is not supported"))
    return value


def refuse_in_message(name: str, value: Any) -> Any:
    """A message's ``tool_calls`` / ``tool_call_id`` / ``function_call``: ``value`` when null
    (or an empty list, as some clients send back an assistant message), else ``ValueError``."""
    if value is not None and value != []:
        raise ValueError(f"{name} {_NO_TOOLS}")
    return value


def refuse_tool_role(role: str) -> str:
    """``role`` unless it is ``tool`` or ``function`` (a tool's result), else ``ValueError``."""
    if role in ("tool", "function"):
        raise ValueError(f"role {role!r} {_NO_TOOLS}")
    return role
