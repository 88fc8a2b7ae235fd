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


class ContextTooLong(InvalidInput):
    """Prompt plus requested output exceed the model's context window."""


class TraceFormatError(InvalidInput):
    """A workload trace line is malformed."""
