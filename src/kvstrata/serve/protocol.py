"""The OpenAI-compatible wire format: request models and the error shape.

Requests are parsed strictly (a string where a number belongs is a 400, not a coercion)
and unknown fields are ignored, as OpenAI clients send many optional ones (``user``,
``store``, ``metadata``, ``parallel_tool_calls``, ``service_tier``...). Parameters the
reference engine cannot honour (``n > 1``, penalties, logprobs, non-text content; tool
calling, a ``response_format`` other than text, ``logit_bias``: ``serve.unsupported``) are
rejected with a 400 naming the parameter rather than silently dropped, and so is a stop
string over ``MAX_STOP_CHARS`` characters and anything that would only fail later, inside
the engine: a ``seed`` outside what ``torch.Generator.manual_seed`` accepts, text that is
not valid Unicode (a JSON escape such as ``"\\ud800"`` decodes to a lone surrogate, which no
tokenizer can encode). Responses are plain dicts shaped like OpenAI's (``serve.responses``).
Every error, FastAPI's own included (malformed JSON, schema violations, unknown routes), is
answered as ``{"error": {message, type, param, code}}``; the front door, which validates
bodies by hand, answers schema violations in the same shape (``invalid_request``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvstrata.errors import ApiError
from kvstrata.serve.unsupported import (
    UNSUPPORTED_MESSAGE_FIELDS,
    UNSUPPORTED_PARAMS,
    refuse_in_message,
    refuse_tool_role,
    refuse_unsupported,
)

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 1024
"""The longest stop string, in characters. OpenAI states no bound, but stop strings in use are
end markers and role headers of a few to a few dozen characters; 1,024 leaves any of them (or
a paragraph) room, and bounds what the assembler scans per token (``serve.streaming``): a
100 KB stop string held the event loop for seconds per request (review finding)."""
MAX_TENANT_CHARS = 128
SEED_MIN = -(1 << 63)  # what torch.Generator.manual_seed accepts (engine.sampling checks too)
SEED_MAX = (1 << 64) - 1
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a float's range")
    return value


_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(raw: bytes) -> Any:
    """``raw`` as JSON; ``ApiError`` 400 ``invalid_json`` for anything else — malformed, not
    UTF-8, nested deeper than the parser recurses, an integer of more digits than Python
    converts, ``NaN`` / ``Infinity`` or a number past a float's range (the last two
    ``json.loads`` accepts; a body holding one could not be sent on: a 500 at the front door,
    with its reservation leaked). Every hand-parsed body goes through here (FastAPI parses
    the typed ones). Lone surrogates are the typed fields' to refuse (naming the field), and
    :func:`check_forwardable`'s for a body sent on as it came."""
    try:
        return json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as exc:
        message = f"request body is not valid JSON: {exc}"[:300]
        raise ApiError(400, message, code="invalid_json") from exc


def check_forwardable(raw: bytes, value: Any) -> None:
    """``ApiError`` 400 when ``value`` (parsed from ``raw``) holds a lone surrogate anywhere:
    an escaped half of a UTF-16 pair is not text, cannot be encoded, and so a body forwarded
    whole (the front door's) could not be sent on."""
    if not _ESCAPED_SURROGATE.search(raw):  # only an escape can make a lone one
        return
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        message = f"request body holds text that is not valid Unicode: {exc}"[:300]
        raise ApiError(400, message, code="invalid_json") from exc


def valid_text(value: str) -> str:
    """``value`` unless it holds a lone surrogate (not Unicode text: it cannot be encoded)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"text must be valid Unicode: lone surrogate {value[exc.start]!r} at index {exc.start}"
        ) from None
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


TRANSFER_ID_PATTERN: Final = r"^[A-Za-z0-9_.:-]{1,256}$"
"""A transfer's request id (``/kv/prefill``, ``kvstrata_transfer``): letters, digits and
``_.:-`` only. It is logged, audited and MACed: a newline in it forged audit lines in the
log (review finding, stop 35)."""


class TransferWait(_Strict):
    """``kvstrata_transfer``: wait for the KV transfer ``request_id`` (prefill → decode) to end,
    at most ``timeout_s``, then generate (a hit when it committed; local prefill otherwise)."""

    request_id: str = Field(pattern=TRANSFER_ID_PATTERN)
    timeout_s: float = Field(default=30.0, gt=0.0, le=600.0)


_NULL_IS_DEFAULT: Final = frozenset(
    (
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "n",
        "frequency_penalty",
        "presence_penalty",
        "ignore_eos",
    )
)


class SamplingRequest(_Strict):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # extension; -1 (vLLM) and 0 both mean off
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool | int | None = None
    top_logprobs: int | None = None  # refused unless 0: an ignored field would look honoured
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says
    # Refused unless they ask for nothing (``refuse_unsupported``): typed ``Any`` so that any
    # value gets the same message, naming the parameter.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    logit_bias: Any = None
    kvstrata_tenant: str | None = Field(default=None, min_length=1, max_length=MAX_TENANT_CHARS)
    kvstrata_transfer: TransferWait | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's API (and vLLM's) takes an explicit ``null`` for these as "not given", and
        some clients send one: it gets the default, as if the field were absent."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in _NULL_IS_DEFAULT}
        return data

    @field_validator("model", "user", "kvstrata_tenant")
    @classmethod
    def _valid_name(cls, value: str | None) -> str | None:
        return None if value is None else valid_text(value)

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("penalties are not supported; use 0")
        return value

    @field_validator(*UNSUPPORTED_PARAMS)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_unsupported(str(info.field_name), value)

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | int | None) -> bool | int | None:
        if value not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return value

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed")
        if any(not stop for stop in stops):
            raise ValueError("stop sequences must be non-empty")
        if any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise ValueError(f"a stop sequence may be at most {MAX_STOP_CHARS} characters")
        for stop in stops:
            valid_text(stop)
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def requested_max_tokens(self) -> int | None:
        """The output length asked for, defaults included (None: as long as allowed)."""
        return self.max_tokens

    def explicit_max_tokens_param(self) -> str | None:
        """The field that set the output length explicitly (None: a default applies)."""
        if "max_tokens" in self.model_fields_set and self.max_tokens is not None:
            return "max_tokens"
        return None

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=DEFAULT_COMPLETION_MAX_TOKENS, ge=1)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, value: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], str) and len(value) != 1:
            raise ValueError("exactly one prompt is supported (no batched prompts)")
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and any(isinstance(v, int) and v < 0 for v in value):
            raise ValueError("token ids must be non-negative")
        for text in [value] if isinstance(value, str) else value:
            if isinstance(text, str):
                valid_text(text)
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value


class ContentPart(BaseModel):
    """One part of a message's content; only ``text`` parts reach the (text-only) model."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    tool_calls: Any = None  # these three: refused unless null or empty (``refuse_in_message``)
    tool_call_id: Any = None
    function_call: Any = None

    @field_validator("role")
    @classmethod
    def _no_tool_role(cls, value: str) -> str:
        return refuse_tool_role(value)

    @field_validator(*UNSUPPORTED_MESSAGE_FIELDS)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_in_message(str(info.field_name), value)

    @field_validator("content")
    @classmethod
    def _valid_content(
        cls, value: str | list[ContentPart] | None
    ) -> str | list[ContentPart] | None:
        for part in [value] if isinstance(value, str) else value or []:
            text = part if isinstance(part, str) else part.text
            if text is not None:
                valid_text(text)
        return value


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``; ``max_tokens`` unset → the server's limit or the room
    left in the context window, whichever is less (``limits.output_budget``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def explicit_max_tokens_param(self) -> str | None:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "max_tokens" if self.max_tokens is not None else None

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template expects them: role and one string of content.

        Raises ``ApiError`` (400) for a content part that is not text.
        """
        out: list[dict[str, str]] = []
        for i, message in enumerate(self.messages):
            role = "system" if message.role == "developer" else message.role
            out.append({"role": role, "content": _content_text(message.content, i)})
        return out


def _content_text(content: str | list[ContentPart] | None, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise ApiError(
                400,
                f"content part of type {part.type!r} is not supported: the model is text-only",
                code="unsupported_content_type",
                param=f"messages[{index}].content[{j}]",
            )
        texts.append(part.text)
    return "\n".join(texts)


# ---- errors ---------------------------------------------------------------------------
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers or None)


async def api_error_handler(_request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc)


async def http_error_handler(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = "not_found" if exc.status_code == 404 else None
    return error_response(ApiError(exc.status_code, str(exc.detail), code=code))


async def validation_error_handler(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """Schema violations are 400s in OpenAI's shape, not FastAPI's 422."""
    return error_response(invalid_request(list(exc.errors()), in_body=True))


def invalid_request(errors: list[Any], *, in_body: bool) -> ApiError:
    """The 400 for a body's first schema violation (pydantic's ``errors()``), as a worker
    answers it; ``in_body``: the locations start with FastAPI's ``"body"`` (a body validated
    by hand, as the front door's, has none). One shape for both, so a client cannot tell
    which of them refused its request."""
    first: dict[str, Any] = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid"}
    if first.get("type") == "json_invalid":
        return ApiError(400, "the request body is not valid JSON", code="invalid_json")
    loc = list(first.get("loc", ()))
    param = _param_path(loc[1:] if in_body else loc)
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    return ApiError(400, message, code=code, param=param)


def _param_path(loc: list[Any]) -> str | None:
    """``["messages", 0, "content"]`` → ``messages[0].content``; union tags dropped."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _UNION_TAGS or "[" in part or "-" in part:
            break
        else:
            path += f".{part}" if path else part
    return path or None
