"""A worker's disaggregated-prefill settings (the worker configuration's ``[transfer]`` table).

- ``port``: receive KV transfers (the decode role) on this TCP port; ``None`` (the default)
  takes none, ``0`` any free port (advertised in ``/kv/info``). ``host``: the listener address.
- ``transport``: what that listener speaks — ``tcp`` (built in) or ``nixl`` (UCX writes into
  registered memory, a TCP control channel on the same port; the optional ``nixl`` extra).
  Advertised in ``/kv/info``; a prefill worker connects with the transport the target names.
- ``allowed_targets``: where the prefill role may send KV. ``POST /kv/prefill`` names its
  target (``{host, port}``) and the worker opens a TCP connection there and streams the
  prompt's KV: without a list, anyone holding a tenant key could make a worker connect to any
  address it can reach (a server-side request forgery). A target is sent to only when an entry
  admits it. Entries (matched literally, never resolved: a DNS answer could change between the
  check and the connection):

  - an IP address or a CIDR network, optionally with ``:PORT`` (IPv6 in brackets:
    ``[::1]:7000``, ``[fd00::/8]``): admits a target whose host is an IP literal inside it;
  - a host name, optionally with ``:PORT``: admits exactly that name (case-insensitive);
  - ``*``: anything (say so on purpose).

  The default admits loopback only (``127.0.0.0/8``, ``[::1]``, ``localhost``): a one-machine
  fleet works, a multi-host one must list its decode workers or their network.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from functools import cached_property
from typing import Final

from kvstrata.errors import InvalidInput

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

TRANSPORTS: Final = ("tcp", "nixl")  # transfer.transport.TRANSPORT_NAMES (the layer above)
DEFAULT_ALLOWED_TARGETS: Final = ("127.0.0.0/8", "[::1]", "localhost")
ANY: Final = "*"


@dataclass(frozen=True)
class TargetRule:
    """One parsed entry: a network or a host name, and a port (``None``: any)."""

    network: IpNetwork | None
    name: str | None
    port: int | None

    def admits(self, host: str, port: int) -> bool:
        if self.port is not None and port != self.port:
            return False
        if self.name is not None:
            return host.lower() == self.name
        address = _ip(host)
        return address is not None and self.network is not None and address in self.network


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _port(text: str, entry: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise InvalidInput(f"transfer target {entry!r}: the port must lie in 1..65535")
    return int(text)


def parse_rule(entry: str) -> TargetRule:
    """``entry`` (module docstring) as a rule; a malformed one is an ``InvalidInput``."""
    text = entry.strip()
    if not text:
        raise InvalidInput("transfer target: an empty entry")
    port: int | None = None
    if text.startswith("["):  # [v6] or [v6/len] or [v6]:port
        close = text.find("]")
        if close < 0:
            raise InvalidInput(f"transfer target {entry!r}: an unclosed '['")
        rest = text[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise InvalidInput(f"transfer target {entry!r}: expected ':PORT' after ']'")
            port = _port(rest[1:], entry)
        host = text[1:close]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        port = _port(port_text, entry)
    elif text.count(":") > 1:
        raise InvalidInput(f"transfer target {entry!r}: put an IPv6 address in brackets")
    else:
        host = text
    try:
        return TargetRule(ipaddress.ip_network(host, strict=False), None, port)
    except ValueError:
        pass
    name = host.lower()
    if not name or any(not (c.isalnum() or c in "-._") for c in name):
        raise InvalidInput(f"transfer target {entry!r}: not an IP, a network or a host name")
    return TargetRule(None, name, port)


@dataclass(frozen=True)
class TransferConfig:
    """The ``[transfer]`` table (module docstring)."""

    host: str = "127.0.0.1"
    port: int | None = None
    transport: str = "tcp"
    allowed_targets: tuple[str, ...] = DEFAULT_ALLOWED_TARGETS

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise InvalidInput("transfer port must lie in 0..65535")
        if self.transport not in TRANSPORTS:
            raise InvalidInput(f"transfer transport must be one of {', '.join(TRANSPORTS)}")
        _ = self.rules  # a malformed entry fails here, at start-up

    @cached_property
    def rules(self) -> tuple[TargetRule, ...] | None:
        """The parsed entries; ``None`` when ``*`` admits anything."""
        if ANY in (entry.strip() for entry in self.allowed_targets):
            return None
        return tuple(parse_rule(entry) for entry in self.allowed_targets)

    def permits(self, host: str, port: int) -> bool:
        """May the prefill role send KV to ``host:port``?"""
        rules = self.rules
        return rules is None or any(rule.admits(host, port) for rule in rules)
