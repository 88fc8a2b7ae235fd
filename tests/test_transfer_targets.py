"""`[transfer] allowed_targets`: where a prefill worker may stream KV (runtime.transfer_config)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.errors import ConfigError, InvalidInput
from kvstrata.runtime.config import load_worker_config
from kvstrata.runtime.transfer_config import TransferConfig, parse_rule
from kvstrata.transfer.tcp import TcpConnection, TcpTransport
from kvstrata.transfer.transport import TransportError
from socket_helpers import foreign_service


def test_default_admits_loopback_only() -> None:
    config = TransferConfig()
    assert config.permits("127.0.0.1", 7000) and config.permits("127.1.2.3", 1)
    assert config.permits("::1", 7000) and config.permits("[::1]", 7000)
    assert config.permits("localhost", 9) and config.permits("LocalHost", 9)
    for host in ("10.0.0.1", "169.254.169.254", "::ffff:10.0.0.1", "example.com", "localhost."):
        assert not config.permits(host, 7000), host


def test_networks_names_and_ports() -> None:
    config = TransferConfig(
        allowed_targets=("10.0.0.0/8:7000", "[fd00::/8]", "decode-1.internal", "[::1]:9")
    )
    assert config.permits("10.2.3.4", 7000) and not config.permits("10.2.3.4", 7001)
    assert config.permits("fd00::1", 1) and not config.permits("fe80::1", 1)
    assert config.permits("decode-1.internal", 5) and not config.permits("decode-2.internal", 5)
    assert config.permits("::1", 9) and not config.permits("::1", 10)
    assert not config.permits("127.0.0.1", 7000)  # the list replaces the default
    assert TransferConfig(allowed_targets=("*",)).permits("203.0.113.9", 1)
    assert not TransferConfig(allowed_targets=()).permits("127.0.0.1", 1)


@pytest.mark.parametrize(
    "entry", ["", " ", "10.0.0.1:0", "10.0.0.1:70000", "host:port", "::1", "[::1", "[::1]x", "a b"]
)
def test_malformed_entries_are_refused(entry: str) -> None:
    with pytest.raises(InvalidInput, match="transfer target"):
        parse_rule(entry)


@given(st.text(max_size=40))
def test_any_entry_parses_or_fails_cleanly(entry: str) -> None:
    try:
        rule = parse_rule(entry)
    except InvalidInput:
        return
    rule.admits("127.0.0.1", 1)


@given(st.text(max_size=40), st.integers(min_value=1, max_value=65535))
def test_hostile_targets_never_crash_the_check(host: str, port: int) -> None:
    TransferConfig(allowed_targets=("10.0.0.0/8", "decode.internal:7")).permits(host, port)


def test_worker_config_reads_the_table_and_flags_override_it() -> None:
    raw = {"transfer": {"port": 0, "host": "0.0.0.0", "allowed_targets": ["10.1.0.0/16"]}}
    config = load_worker_config(raw=raw).transfer
    assert (config.port, config.host) == (0, "0.0.0.0")
    assert config.permits("10.1.9.9", 7) and not config.permits("127.0.0.1", 7)
    flags = {"transfer_port": 7100, "allowed_transfer_targets": "127.0.0.1,decode-a"}
    overridden = load_worker_config(raw=raw, overrides=flags).transfer
    assert overridden.port == 7100 and overridden.permits("decode-a", 1)
    assert load_worker_config().transfer == TransferConfig()
    with pytest.raises(ConfigError, match=r"transfer\.port"):
        load_worker_config(raw={"transfer": {"port": 70000}})
    with pytest.raises(ConfigError, match=r"transfer\.allowed_targets"):
        load_worker_config(raw={"transfer": {"allowed_targets": ["10.0.0.1:99999"]}})
    with pytest.raises(ConfigError, match=r"transfer\.nope"):
        load_worker_config(raw={"transfer": {"nope": 1}})


def test_transport_is_tcp_or_nixl_everywhere_it_is_named() -> None:
    from kvstrata.fleet.worker_info import TransferTarget
    from kvstrata.transfer.transport import TransportError, make_transport

    assert load_worker_config(raw={"transfer": {"transport": "nixl"}}).transfer.transport == "nixl"
    assert load_worker_config(overrides={"transfer_transport": "tcp"}).transfer.transport == "tcp"
    with pytest.raises(ConfigError, match=r"transfer\.transport"):
        load_worker_config(raw={"transfer": {"transport": "rdma"}})
    layout = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "block_size": 16}
    layout["dtype"] = "float32"
    entry = {"host": "127.0.0.1", "port": 7000, "layout": layout}
    assert TransferTarget.from_json(entry).transport == "tcp"  # an older worker says nothing
    assert TransferTarget.from_json({**entry, "transport": "nixl"}).transport == "nixl"
    with pytest.raises(ValueError, match="bad transfer entry"):
        TransferTarget.from_json({**entry, "transport": "carrier-pigeon"})
    with pytest.raises(TransportError, match="unknown transport"):
        make_transport("rdma")


@pytest.mark.parametrize("banner", [b"", b"SSH-2.0-OpenSSH_9.6\r\n", b"kvstrata-transfer/0\n"])
def test_connect_writes_nothing_to_a_peer_that_does_not_greet_as_a_transfer_listener(
    banner: bytes,
) -> None:
    """A silent service, one that speaks something else, and an older transfer listener: the
    connecting side sends no byte and its error names none of the peer's."""
    with (
        foreign_service(banner) as service,
        pytest.raises(TransportError, match="not a kvstrata transfer listener") as caught,
    ):
        TcpTransport().connect(service.address, timeout_s=0.5)
    assert service.received == b""
    assert not banner.strip() or banner.strip().decode() not in str(caught.value)


def test_a_listener_greets_and_its_peer_then_speaks_frames() -> None:
    transport = TcpTransport()
    listener = transport.listen()
    accepted: list[object] = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept(timeout_s=10)))
    thread.start()
    try:
        client = transport.connect(listener.address, timeout_s=10)
        thread.join(10)
        server = accepted[0]
        assert isinstance(server, TcpConnection)
        client.send_frame(b"hello")
        assert bytes(server.recv_frame(timeout_s=5)) == b"hello"
        client.close()
        server.close()
    finally:
        listener.close()
