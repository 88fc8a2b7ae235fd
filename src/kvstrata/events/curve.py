"""CURVE keys for the ZMQ planes (events, replay, vLLM lookups): encryption + client allow-lists.

Why: the event and replay sockets carry every tenant's token ids, so a plain socket lets anyone
who reaches the port read them. With CURVE (libzmq's CurveZMQ, shipped by pyzmq) the traffic
is encrypted and the server admits only clients whose public key it knows: a client without
the server's public key completes no handshake and receives nothing, and one whose key is not
in the allow-list is refused by the ZAP handler.

Small frozen values, parsed once at the edge and handed to sockets:

- ``CurveServer``: the server's key pair and the allowed clients' public keys (a directory of
  ``zmq.auth`` public certificates, or an explicit set);
- ``CurveClient``: the client's key pair and the server's public key (``KeyPair.client_of``);
- ``ZapGuard``: the ZAP authenticator of one context (``start``/``stop``, never in a
  constructor); one per context, since a context has one ZAP endpoint.

Keys are raw 32-byte values here (``z85`` text only where a key is shown, e.g. ``/kv/info``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from kvstrata.errors import InvalidInput

KEY_BYTES: Final = 32
Z85_CHARS: Final = 40


class CurveKeyError(InvalidInput):
    """A certificate file or key that cannot be used (missing, no secret part, bad length)."""


def _key(value: bytes | None, what: str) -> bytes:
    if value is None:
        raise CurveKeyError(f"{what} is missing")
    try:
        raw = z85.decode(value) if len(value) == Z85_CHARS else value
    except (ValueError, KeyError, IndexError) as exc:
        raise CurveKeyError(f"{what} is not z85 text: {exc!r}") from exc
    if len(raw) != KEY_BYTES:
        raise CurveKeyError(f"{what} must be {KEY_BYTES} bytes (or {Z85_CHARS} z85 characters)")
    return raw


def decode_public_key(text: str) -> bytes:
    """A z85 public key (as ``/kv/info`` shows it) → 32 bytes; ``CurveKeyError`` if malformed."""
    if len(text) != Z85_CHARS:
        raise CurveKeyError(f"a CURVE public key is {Z85_CHARS} z85 characters")
    try:
        encoded = text.encode("ascii")
    except UnicodeEncodeError as exc:
        raise CurveKeyError("a CURVE public key is ASCII z85 text") from exc
    return _key(encoded, "public key")


def encode_public_key(key: bytes) -> str:
    return z85.encode(key).decode("ascii")


def load_key_pair(secret_file: Path) -> tuple[bytes, bytes]:
    """(public, secret) of a ``zmq.auth`` secret certificate (``*.key_secret``)."""
    try:
        public, secret = zmq.auth.load_certificate(secret_file)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read the CURVE certificate {secret_file}: {exc}") from exc
    if secret is None:
        raise CurveKeyError(f"{secret_file} holds no secret key (a public certificate?)")
    return _key(public, "public key"), _key(secret, "secret key")


def load_public_key(certificate: Path) -> bytes:
    """The public key of a ``zmq.auth`` certificate (its public or its secret file)."""
    try:
        public, _secret = zmq.auth.load_certificate(certificate)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read the CURVE certificate {certificate}: {exc}") from exc
    return _key(public, "public key")


def load_public_keys(directory: Path) -> frozenset[bytes]:
    """Every public key of the ``zmq.auth`` certificates in ``directory``."""
    if not directory.is_dir():
        raise CurveKeyError(f"no such directory: {directory}")
    try:
        found = zmq.auth.load_certificates(directory)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read the client certificates in {directory}: {exc}") from exc
    return frozenset(_key(key, "client public key") for key in found)


@dataclass(frozen=True)
class KeyPair:
    """One party's CURVE keys (e.g. the router's client certificate, read once)."""

    public_key: bytes
    secret_key: bytes = field(repr=False)

    @classmethod
    def from_file(cls, secret_file: Path) -> KeyPair:
        return cls(*load_key_pair(secret_file))

    def client_of(self, server_key: bytes) -> CurveClient:
        """These keys as a client of the server whose public key is ``server_key``."""
        return CurveClient(_key(server_key, "server public key"), self.public_key, self.secret_key)


@dataclass(frozen=True)
class CurveServer:
    """A CURVE server's keys and the clients it lets in (by public key)."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    allowed_clients: frozenset[bytes]

    @classmethod
    def from_files(cls, secret_file: Path, clients_dir: Path) -> CurveServer:
        public, secret = load_key_pair(secret_file)
        return cls(public, secret, load_public_keys(clients_dir))

    @property
    def public_key_z85(self) -> str:
        return encode_public_key(self.public_key)

    def apply(self, socket: zmq.Socket[bytes]) -> None:
        """Make ``socket`` a CURVE server (before bind)."""
        socket.curve_server = True
        socket.curve_secretkey = self.secret_key
        socket.curve_publickey = self.public_key


@dataclass(frozen=True)
class CurveClient:
    """A CURVE client's keys and the public key of the server it talks to."""

    server_key: bytes
    public_key: bytes
    secret_key: bytes = field(repr=False)

    @classmethod
    def from_file(cls, secret_file: Path, server_key: bytes) -> CurveClient:
        return KeyPair.from_file(secret_file).client_of(server_key)

    def apply(self, socket: zmq.Socket[bytes]) -> None:
        """Make ``socket`` a CURVE client of ``server_key`` (before connect)."""
        socket.curve_serverkey = self.server_key
        socket.curve_publickey = self.public_key
        socket.curve_secretkey = self.secret_key


class _AllowList:
    """ZAP credentials provider: a client is in iff its public key is listed."""

    def __init__(self, keys: Iterable[bytes]) -> None:
        self.z85_keys = frozenset(z85.encode(k) for k in keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.z85_keys


class ZapGuard:
    """The ZAP handler of one context admitting ``allowed`` client keys; a thread, so it is
    started by ``start()`` and stopped by ``stop()`` (the owner's lifecycle)."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], allowed: Iterable[bytes]) -> None:
        self.context = context
        self.allowed = frozenset(allowed)
        self._auth: ThreadAuthenticator | None = None

    def start(self) -> ZapGuard:
        if self._auth is None:
            auth = ThreadAuthenticator(self.context)
            auth.start()
            auth.configure_curve_callback(domain="*", credentials_provider=_AllowList(self.allowed))
            self._auth = auth
        return self

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def create_certificate(directory: Path, name: str) -> tuple[Path, Path]:
    """A new key pair in ``directory``: (public certificate, secret certificate) paths; the
    secret one readable by its owner only."""
    public, secret = zmq.auth.create_certificates(directory, name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


__all__ = [
    "CurveClient",
    "CurveKeyError",
    "CurveServer",
    "KeyPair",
    "ZapGuard",
    "create_certificate",
    "decode_public_key",
    "encode_public_key",
    "load_key_pair",
    "load_public_key",
    "load_public_keys",
]
