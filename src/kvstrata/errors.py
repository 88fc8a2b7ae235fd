"""One exception tree for kvstrata.

Expected outcomes (a cache miss, no free block, reuse disabled) are return values, not
exceptions. Exceptions are for invalid input and broken invariants; foreign errors (OS,
torch, HTTP) are mapped to these at the edge where they occur.
"""

from __future__ import annotations


class KvstrataError(Exception):
    """Base of every error kvstrata raises on purpose."""


class InvalidInput(KvstrataError):
    """A caller handed us something malformed (bad JSONL line, bad parameter, bad event)."""


class IdentityError(KvstrataError):
    """An identity could not be built or decoded (bad digest length, bad canonical encoding)."""


class ModelLoadError(KvstrataError):
    """The model or tokenizer could not be located, converted or loaded."""


class EngineError(KvstrataError):
    """The reference engine failed while serving a request."""


class QueueFull(KvstrataError):
    """The engine's waiting queue is full: try again after ``retry_after_s`` (HTTP 429)."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestCancelled(KvstrataError):
    """The request was cancelled (client gone, engine stopping) before it finished."""


class ContextTooLong(InvalidInput):
    """Prompt plus requested output exceed the model's context window."""


class TraceFormatError(InvalidInput):
    """A workload trace line is malformed."""


class ConfigError(InvalidInput):
    """A configuration file, flag or connector setting is malformed; names the key and source."""

    def __init__(self, message: str, *, key: str | None = None, source: str | None = None):
        where = ", ".join(part for part in (f"key {key!r}" if key else "", source or "") if part)
        super().__init__(f"{where}: {message}" if where else message)
        self.key = key
        self.source = source


class PoolStateError(KvstrataError):
    """An illegal device-pool transition (a bug in the caller, never an expected outcome)."""


class NoWorkerAvailable(KvstrataError):
    """No healthy worker to send the request to."""


class AuthError(KvstrataError):
    """A caller that is not allowed: ``status`` 401 (no or unknown credential) or 403 (a known
    credential without the right). ``reason`` is the audit reason code."""

    def __init__(self, status: int, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class ApiError(KvstrataError):
    """An error answered to an HTTP client as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class ConversionError(InvalidInput):
    """KV blocks that do not match the layout or conversion plan they were handed with (a
    wrong shape, dtype or missing TP rank), or a plan whose steps are inconsistent."""
