"""HTTP access control: one guard every endpoint of a worker or the front door calls first.

``HttpAuth.check(request, allowed, action)`` authenticates the ``Authorization`` header
(``security.keys.Authenticator``), checks the role, audits a refusal (action
``auth_failure`` / ``access_denied`` with the reason code, the key id and the request id,
never the body) and raises ``ApiError`` 401 (with ``WWW-Authenticate: Bearer``) or 403.
``namespace(principal, body_value, header_value)`` is the tenant a generation runs in: the
key's tenant, narrowed only as the key allows (``Principal.namespace``); body field and
header must agree.

Request ids: ``request_id_of(request)`` is the client's ``X-Request-Id`` when it is a plain
token (1..64 of ``[A-Za-z0-9_-]``), else a fresh one; kept on the request, so the guard's
audit records and the handler's logs name the same id (the front door forwards it).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterable
from typing import Final

from fastapi import Request

from kvstrata.errors import ApiError, AuthError
from kvstrata.security import NULL_AUDIT, Action, AuditLog, Authenticator, Principal, Role

TENANT_HEADER = "X-Kvstrata-Tenant"
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")


def request_id_of(request: Request) -> str:
    """The request's id: a valid incoming ``X-Request-Id`` or a new one (the same on every
    call for one request)."""
    known = getattr(request.state, "kvstrata_request_id", None)
    if isinstance(known, str):
        return known
    incoming = request.headers.get(REQUEST_ID_HEADER)
    chosen = (
        incoming if incoming is not None and _REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex
    )
    request.state.kvstrata_request_id = chosen
    return chosen


class HttpAuth:
    """The guard of one HTTP server (worker or front door)."""

    def __init__(self, authenticator: Authenticator, audit: AuditLog = NULL_AUDIT) -> None:
        self.authenticator = authenticator
        self.audit = audit

    def principal(self, request: Request, *, request_id: str | None = None) -> Principal:
        """The authenticated caller (no role check); raises ``ApiError`` 401."""
        self.authenticator.maybe_reload(time.monotonic())
        try:
            return self.authenticator.authenticate(request.headers.get("authorization"))
        except AuthError as exc:
            raise self._refused(exc, request, None, request_id) from None

    def check(
        self,
        request: Request,
        allowed: Iterable[Role],
        action: str,
        *,
        open_single_tenant: bool = False,
        request_id: str | None = None,
    ) -> Principal:
        principal = self.principal(request, request_id=request_id)
        try:
            self.authenticator.authorize(
                principal, allowed, action, open_single_tenant=open_single_tenant
            )
        except AuthError as exc:
            if exc.status == 401 and request.headers.get("authorization") is not None:
                exc = AuthError(401, "unknown credential", reason="unknown_key")
            raise self._refused(exc, request, principal, request_id) from None
        return principal

    def namespace(
        self,
        request: Request,
        principal: Principal,
        body_value: str | None,
        *,
        request_id: str | None = None,
    ) -> str:
        header = request.headers.get(TENANT_HEADER)
        if body_value is not None and header is not None and body_value != header:
            raise ApiError(
                400,
                "kvstrata_tenant conflicts with the X-Kvstrata-Tenant header",
                param="kvstrata_tenant",
            )
        try:
            return principal.namespace(body_value if body_value is not None else header)
        except AuthError as exc:
            raise self._refused(exc, request, principal, request_id) from None

    def _refused(
        self,
        exc: AuthError,
        request: Request,
        principal: Principal | None,
        request_id: str | None,
    ) -> ApiError:
        action = Action.AUTH_FAILURE if exc.status == 401 else Action.ACCESS_DENIED
        if exc.status in (401, 403):
            self.audit.record(
                action,
                exc.reason,
                tenant=None if principal is None else principal.tenant,
                key_id=None if principal is None else principal.key_id,
                request_id=request_id or request_id_of(request),
                plane=f"http {request.method} {_route(request)}",
            )
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        error_type = "authentication_error" if exc.status == 401 else "permission_error"
        if exc.status == 400:
            error_type = "invalid_request_error"
        return ApiError(exc.status, str(exc), type=error_type, code=exc.reason, headers=headers)


def _route(request: Request) -> str:
    """The matched route's template (``/admin/tiers/{name}``), not the path the client wrote."""
    route = request.scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


__all__ = ["REQUEST_ID_HEADER", "TENANT_HEADER", "HttpAuth", "request_id_of"]
