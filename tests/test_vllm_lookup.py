"""The vLLM connector's scheduler → worker lookup socket without vLLM: a real ``LookupServer``
(REP on ipc) and ``LookupClient`` (REQ). The socket's directory is private to its user; with a
CURVE certificate only a client holding it gets answers, and an unanswered lookup is a miss."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest
import zmq

from kvstrata.connectors.vllm_lookup import LookupClient, LookupServer, endpoint_for, private_dir
from kvstrata.events.curve import KeyPair, create_certificate
from kvstrata.identity import BlockKey

KEYS = [BlockKey(bytes([i]) * 32) for i in range(3)]
REFUSED_TIMEOUT_MS = 400


def _lookup(
    tenant: str, keys: Sequence[BlockKey], presence: bool = False, req_id: str | None = None
) -> int:
    return len(keys) if tenant == "acme" else 0


@pytest.fixture
def pair(tmp_path: Path) -> tuple[KeyPair, KeyPair]:
    """The deployment's certificate and a stranger's."""
    _, mine = create_certificate(tmp_path, "lookup")
    _, other = create_certificate(tmp_path, "stranger")
    return KeyPair.from_file(mine), KeyPair.from_file(other)


@contextmanager
def _server(endpoint: str, curve: KeyPair | None) -> Iterator[LookupServer]:
    server = LookupServer(endpoint, _lookup, curve=curve).start()
    try:
        yield server
    finally:
        server.close()


def _ask(endpoint: str, curve: KeyPair | None, timeout_ms: int = 5000) -> tuple[int, int]:
    client = LookupClient("unused", timeout_ms=timeout_ms, curve=curve, endpoint=endpoint)
    try:
        return client("acme", KEYS), client.timeouts
    finally:
        client.close()


def test_socket_directory_is_private(tmp_path: Path) -> None:
    endpoint = endpoint_for("engine-0", base=tmp_path)
    directory = Path(endpoint.removeprefix("ipc://")).parent
    assert directory == private_dir(tmp_path)
    assert directory.stat().st_mode & 0o777 == 0o700
    directory.chmod(0o755)  # loosened by someone: tightened again before use
    endpoint_for("engine-0", base=tmp_path)
    assert directory.stat().st_mode & 0o777 == 0o700


def test_plain_pair_answers(tmp_path: Path) -> None:
    endpoint = endpoint_for("plain", base=tmp_path)
    with _server(endpoint, None):
        assert _ask(endpoint, None) == (3, 0)


def test_curve_pair_answers_only_the_certificate_holder(
    tmp_path: Path, pair: tuple[KeyPair, KeyPair]
) -> None:
    mine, stranger = pair
    endpoint = endpoint_for("curve", base=tmp_path)
    with _server(endpoint, mine):
        assert _ask(endpoint, mine) == (3, 0)
        assert _ask(endpoint, None, REFUSED_TIMEOUT_MS) == (0, 1)  # no key: a miss
        assert _ask(endpoint, stranger, REFUSED_TIMEOUT_MS) == (0, 1)  # wrong server key
        # the right server key but a client key the server does not list: no answer either
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        req = context.socket(zmq.REQ)
        stranger.client_of(mine.public_key).apply(req)
        req.connect(endpoint)
        req.send(msgspec.msgpack.encode(("acme", [bytes(k) for k in KEYS])))
        assert not req.poll(REFUSED_TIMEOUT_MS)
        context.destroy(linger=0)
        assert _ask(endpoint, mine) == (3, 0)  # the server kept serving
