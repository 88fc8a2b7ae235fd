"""``kvstrata delete``: remove a tenant's or a prompt's KV through ``POST /admin/delete``.

Works against a front door (every worker, then the router's index) or one worker. The API key
comes from ``--api-key-file`` or ``KVSTRATA_API_KEY`` (read here, at the edge) and must hold
the admin role. Prints the objects removed per tier (and per worker behind a front door), or
the answer as JSON with ``--json``. Exit status: 0 when every replica was confirmed deleted,
1 when the server refused or some worker did not confirm (replicas may remain: run it again),
2 for a bad invocation or an unreachable server.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Final

from kvstrata.cli.output import emit
from kvstrata.errors import InvalidInput

API_KEY_ENV: Final = "KVSTRATA_API_KEY"
_UNITS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION: Final = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``2h``, ``7d`` (or a bare number of seconds) → seconds."""
    value = text.strip()
    match = _DURATION.fullmatch(value)
    try:
        seconds = (
            float(match.group(1)) * _UNITS[match.group(2)] if match is not None else float(value)
        )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration (e.g. 90s, 30m, 2h, 7d)"
        ) from None
    if seconds < 0 or seconds != seconds or seconds == float("inf"):
        raise argparse.ArgumentTypeError("a duration must be a finite number >= 0")
    return seconds


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "delete",
        help="delete a tenant's or a prompt's KV from every tier (and the router's index)",
        description="POST /admin/delete to a front door or a worker: every replica of the "
        "matching blocks (and of their descendants) on every tier, and every index entry, "
        "with tombstones against late writes and events. Needs an admin API key.",
    )
    parser.add_argument("--url", required=True, help="front door or worker base URL")
    parser.add_argument("--tenant", required=True, help="the namespace to delete from")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--all", action="store_true", help="every object of the tenant")
    what.add_argument("--prompt", help="this prompt's blocks and their descendants")
    what.add_argument(
        "--messages",
        type=Path,
        metavar="FILE",
        help="a JSON file of chat messages (templated as /v1/chat/completions does)",
    )
    what.add_argument(
        "--older-than",
        type=parse_duration,
        metavar="DURATION",
        help="the tenant's objects created more than this long ago (90s, 30m, 2h, 7d)",
    )
    parser.add_argument(
        "--api-key-file", type=Path, default=None, help=f"admin API key (default: ${API_KEY_ENV})"
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="HTTP timeout")
    parser.add_argument(
        "--ca-file",
        type=Path,
        default=None,
        help="CA bundle that signed the server's HTTPS certificate (default: the system CAs)",
    )
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    parser.set_defaults(func=run_delete)


def request_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"tenant": args.tenant}
    if args.all:
        body["all"] = True
    elif args.prompt is not None:
        body["prompt"] = args.prompt
    elif args.messages is not None:
        try:
            messages = json.loads(args.messages.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidInput(f"--messages {args.messages}: {exc}") from exc
        if isinstance(messages, dict) and "messages" in messages:
            messages = messages["messages"]  # a chat request body works too
        if not isinstance(messages, list):
            raise InvalidInput(f"--messages {args.messages}: must hold a JSON list of messages")
        body["messages"] = messages
    else:
        body["older_than_s"] = args.older_than
    return body


def api_key(args: argparse.Namespace) -> str | None:
    path: Path | None = args.api_key_file
    if path is not None:
        try:
            return path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidInput(f"--api-key-file {path}: {exc}") from exc
    from_env = os.environ.get(API_KEY_ENV)
    return from_env or None


def run_delete(args: argparse.Namespace) -> int:
    import httpx

    from kvstrata.fleet.worker_info import worker_tls

    body = request_body(args)
    headers = {}
    key = api_key(args)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    url = args.url.rstrip("/") + "/admin/delete"
    try:
        response = httpx.post(
            url, json=body, headers=headers, timeout=args.timeout_s, verify=worker_tls(args.ca_file)
        )
    except (httpx.HTTPError, OSError) as exc:  # OSError: an unreadable --ca-file
        print(f"kvstrata delete: cannot reach {url}: {exc}", file=sys.stderr)
        return 2
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        print(f"kvstrata delete: HTTP {response.status_code}: not a JSON answer", file=sys.stderr)
        return 1
    if "error" in answer and "removed" not in answer:
        error = answer["error"]
        message = error.get("message") if isinstance(error, dict) else error
        print(f"kvstrata delete: refused (HTTP {response.status_code}): {message}", file=sys.stderr)
        if args.json:
            emit(answer, as_json=True, title="", columns=(), rows=())
        return 1
    # A worker's own answer has no status: a tier it could not reach may still hold replicas.
    confirmed = response.status_code == 200 and not answer.get("unreachable")
    status = str(answer.get("status", "ok" if confirmed else "partial"))
    emit(
        answer,
        as_json=args.json,
        title=(
            f"deleted from {args.tenant!r} ({status}): {answer.get('deleted_keys', 0)} keys "
            f"tombstoned, {_replicas(answer)} replicas removed"
        ),
        columns=("worker", "tier", "removed"),
        rows=_rows(answer),
    )
    if status != "ok" or response.status_code != 200:
        if not args.json:
            for worker in answer.get("workers", []):
                if worker.get("status") != "ok":
                    print(
                        f"kvstrata delete: worker {worker.get('worker_id') or worker.get('url')} "
                        f"did not confirm: {worker.get('error')}",
                        file=sys.stderr,
                    )
        return 1
    return 0


def _replicas(answer: dict[str, Any]) -> int:
    removed = answer.get("removed")
    if not isinstance(removed, dict):
        return 0
    return sum(n for n in removed.values() if isinstance(n, int))


def _rows(answer: dict[str, Any]) -> list[tuple[str, str, Any]]:
    rows: list[tuple[str, str, Any]] = []
    for worker in answer.get("workers", []):
        name = str(worker.get("worker_id") or worker.get("url"))
        if worker.get("status") != "ok":
            rows.append((name, "-", "failed"))
            continue
        rows += [(name, tier, n) for tier, n in sorted(worker.get("removed", {}).items())]
    total = "total" if "workers" in answer else str(answer.get("worker_id") or "worker")
    rows += [(total, tier, n) for tier, n in sorted(answer.get("removed", {}).items())]
    if "index" in answer:
        rows.append(("router index", "entries", answer["index"].get("removed", 0)))
    return rows
