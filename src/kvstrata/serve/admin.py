"""Admin endpoints: the run-time rollback switch of every tier.

``GET /admin/tiers`` lists the store's levels (enabled, write policy, bytes, bytes at risk);
``POST /admin/tiers/{name}`` with ``{"enabled": false}`` stops reading and writing that tier
at once, keeping its committed data so that ``{"enabled": true}`` brings it back. Both need
an admin credential (``HttpAuth`` with ``ADMINISTER``; off on a server that has none); a
switch is audited (``tier_switch``, reason ``enabled`` / ``disabled``, the tier, the key id).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvstrata.errors import ApiError
from kvstrata.security import ADMINISTER
from kvstrata.serve.auth import HttpAuth, request_id_of
from kvstrata.serve.protocol import parse_json
from kvstrata.store.tiered import TieredStore

ADMIN_TIERS = "/admin/tiers"


def _error(status: int, message: str, code: str) -> JSONResponse:
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    }
    return JSONResponse(body, status_code=status)


def tier_status(store: TieredStore) -> list[dict[str, Any]]:
    out = []
    for index, level in enumerate(store.levels):
        out.append(
            {
                "name": level.name,
                "enabled": level.enabled,
                "write_policy": level.config.write_policy.value,
                "used_bytes": level.tier.used_bytes,
                "capacity_bytes": level.tier.capacity_bytes,
                "bytes_at_risk": store.bytes_at_risk(index),
                "fetch_s_per_byte": level.fetch_s_per_byte,
            }
        )
    return out


def register_admin(app: FastAPI, store: TieredStore | None, auth: HttpAuth) -> None:
    @app.get(ADMIN_TIERS)
    async def list_tiers(request: Request) -> Any:
        auth.check(request, ADMINISTER, "list the tiers")
        return {"tiers": tier_status(store) if store is not None else []}

    @app.post(ADMIN_TIERS + "/{name}")
    async def set_tier(name: str, request: Request) -> Any:
        principal = auth.check(request, ADMINISTER, "switch tiers")
        if store is None:
            return _error(404, "this server has no tiered store", "tier_not_found")
        try:
            body = parse_json(await request.body())
        except ApiError:
            return _error(400, "body must be JSON", "invalid_json")
        enabled = body.get("enabled") if isinstance(body, dict) else None
        if not isinstance(enabled, bool):
            return _error(400, 'body must be {"enabled": true|false}', "invalid_value")
        try:
            # the store records the switch in its audit log (one owner of that line)
            await asyncio.to_thread(
                functools.partial(
                    store.set_enabled,
                    name,
                    enabled,
                    key_id=principal.key_id,
                    request_id=request_id_of(request),
                )
            )
        except KeyError:
            return _error(404, f"no tier named {name!r}", "tier_not_found")
        return {"tiers": tier_status(store)}
