"""Audit records: one JSON line per security-relevant event, never prompt material.

A record names *who* (tenant, key id), *what* (action, reason code, object ids = block keys in
hex, counts) and *which request* — nothing else. Its fields are fixed by ``AuditLog.record``'s
signature: there is no free-text field, so prompt text or token ids cannot end up in one by
accident. Object ids are capped (``MAX_KEYS`` listed, the rest counted).

Actions (``Action``) and their reason codes:

- ``auth_failure`` (``no_key``, ``unknown_key``) and ``access_denied`` (``forbidden``,
  ``namespace_denied``, ``disabled``, ``bad_namespace``), with the plane (``http``, ``zmq``);
- ``delete`` (reason: the selector, ``all`` / ``prompt`` / ``messages`` / ``older_than``;
  counts per tier), ``tombstone_refused`` (a late write or event for a deleted key);
- ``evict`` (the eviction outcome), ``invalidate`` (``digest_mismatch``, ``expired``,
  ``rollback``, …), ``quota_reject``, ``tier_switch`` (``enabled`` / ``disabled``);
- ``transfer`` (a KV transfer received from another worker; reason: its outcome, ``committed``,
  ``digest_mismatch``, ``cancelled``, ``timeout``, ``peer_lost``, ``refused``; the objects
  committed or aborted, counts of blocks and bytes).

Writing never blocks the caller: ``record`` puts the line on a queue (``logging``'s
``QueueHandler``) and a listener thread started by ``start()`` writes it to the file (or to the
``kvstrata.audit`` logger's handlers when no path is given), so the store may record under its
lock without doing I/O there. ``NULL_AUDIT`` records nothing.
"""

from __future__ import annotations

import enum
import json
import logging
import logging.handlers
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

MAX_KEYS: Final = 32
LOGGER_NAME: Final = "kvstrata.audit"


class Action(enum.StrEnum):
    AUTH_FAILURE = "auth_failure"
    ACCESS_DENIED = "access_denied"
    DELETE = "delete"
    TOMBSTONE_REFUSED = "tombstone_refused"
    EVICT = "evict"
    INVALIDATE = "invalidate"
    QUOTA_REJECT = "quota_reject"
    TIER_SWITCH = "tier_switch"
    TRANSFER = "transfer"


def _hex(key: bytes | str) -> str:
    return key if isinstance(key, str) else key.hex()


class AuditLog:
    """Structured audit lines; ``start()`` / ``close()`` own the writer thread."""

    def __init__(self, path: Path | None = None, *, component: str = "worker") -> None:
        self.path = path
        self.component = component
        self.records = 0
        self._queue: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        self._logger = logging.getLogger(f"{LOGGER_NAME}.{component}.{id(self):x}")
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self._logger.addHandler(logging.handlers.QueueHandler(self._queue))
        self._listener: logging.handlers.QueueListener | None = None
        self._count_lock = threading.Lock()

    def start(self) -> AuditLog:
        if self._listener is not None:
            return self
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handler: logging.Handler = logging.FileHandler(self.path, encoding="utf-8")
        else:
            handler = _Forward(logging.getLogger(LOGGER_NAME))
        handler.setFormatter(logging.Formatter("%(message)s"))
        self._listener = logging.handlers.QueueListener(self._queue, handler)
        self._listener.start()
        return self

    def close(self) -> None:
        """Write what is queued and stop the thread."""
        if self._listener is not None:
            self._listener.stop()
            for handler in self._listener.handlers:
                handler.close()
            self._listener = None

    def __enter__(self) -> AuditLog:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def record(
        self,
        action: Action,
        reason: str,
        *,
        tenant: str | None = None,
        key_id: str | None = None,
        request_id: str | None = None,
        plane: str | None = None,
        tier: str | None = None,
        keys: Iterable[bytes | str] = (),
        counts: Mapping[str, int] | None = None,
        now: float | None = None,
    ) -> None:
        """Queue one line (no I/O here). ``keys``: block keys (bytes or hex)."""
        listed = [_hex(k) for k in keys]
        line: dict[str, Any] = {
            "ts": round(time.time() if now is None else now, 6),
            "audit": Action(action).value,
            "reason": reason,
            "component": self.component,
        }
        for name, value in (
            ("tenant", tenant),
            ("key_id", key_id),
            ("request_id", request_id),
            ("plane", plane),
            ("tier", tier),
        ):
            if value is not None:
                line[name] = value
        if listed:
            line["objects"] = listed[:MAX_KEYS]
            line["object_count"] = len(listed)
        if counts is not None:
            line["counts"] = {str(k): int(v) for k, v in counts.items()}
        with self._count_lock:
            self.records += 1
        self._logger.info(json.dumps(line, sort_keys=True, separators=(",", ":")))


class _Forward(logging.Handler):
    """Hands lines to the ``kvstrata.audit`` logger's handlers (and its ancestors'), whatever
    the loggers' levels: a process logging at WARNING still keeps its audit trail."""

    def __init__(self, target: logging.Logger) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        line = logging.LogRecord(
            self.target.name, logging.INFO, __file__, 0, record.getMessage(), None, None
        )
        self.target.handle(line)


class _NullAudit(AuditLog):
    def record(self, *_args: Any, **_kwargs: Any) -> None:
        return None


NULL_AUDIT: Final[AuditLog] = _NullAudit(component="null")

__all__ = ["MAX_KEYS", "NULL_AUDIT", "Action", "AuditLog"]
