"""Contract suite of the layer-wise transfer over every transport (tcp, nixl).

The sender is a real separate process (``transfer_sender.py``) on loopback; the receiver
writes into a real host tier. What must hold on every transport: a full transfer commits
bytes equal to what was sent; a corrupted frame, a wrong block digest, a missing layer, a
cancellation (either side), a timeout and a SIGKILLed sender leave nothing in the tier, and
each outcome is counted once. Malformed frames (Hypothesis) are refused with a clear error.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, Representation, payload_digest
from kvstrata.security.audit import AuditLog
from kvstrata.telemetry.transfer_metrics import TransferMetrics
from kvstrata.tiers.base import TierError
from kvstrata.tiers.host import HostTier
from kvstrata.transfer import frames
from kvstrata.transfer.nixl_transport import available as nixl_missing
from kvstrata.transfer.stream import Conversion, TransferReceiver, TransferResult, TransferSender
from kvstrata.transfer.tcp import TcpConnection, TcpTransport, raw_socket_gbps
from kvstrata.transfer.transport import Listener, Transport, TransportTimeout
from transfer_sender import payload

HERE = Path(__file__).parent
SRC = HERE.parent / "src"
BLOCKS, LAYERS, LAYER_BYTES = 3, 4, 1024
BLOCK_BYTES = LAYERS * LAYER_BYTES


def _transport(name: str) -> Transport:
    if name == "nixl":
        reason = nixl_missing()
        if reason is not None:
            print(f"SKIP nixl: {reason}", file=sys.stderr)
            pytest.skip(reason)
        from kvstrata.transfer.nixl_transport import NixlTransport

        return NixlTransport(slots=4, slot_bytes=1 << 20)
    return TcpTransport()


@pytest.fixture(params=["tcp", pytest.param("nixl", marks=pytest.mark.slow)])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Transport:
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # UCX reads it when this process's agent starts
    return _transport(str(request.param))


@pytest.fixture
def tier() -> Iterator[HostTier]:
    with HostTier(8 * BLOCK_BYTES, BLOCK_BYTES, pin_memory=False) as host:
        yield host


def metas(count: int = BLOCKS) -> list[KVObjectMeta]:
    """The decode side's metas: keys known from its tokens, digest provisional (zeros)."""
    return [
        KVObjectMeta(
            key=BlockKey(bytes([i + 1]) * 32),
            parent=BlockKey(bytes([i]) * 32) if i else None,
            tenant="t0",
            representation=Representation("float32", "kvstrata.block.v1", 16, (BLOCK_BYTES,)),
            size=BLOCK_BYTES,
            digest=bytes(16),
            created_at=1000.0,
            position=16 * i,
        )
        for i in range(count)
    ]


def start_sender(transport: Transport, listener: Listener, mode: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{HERE}", UCX_NET_DEVICES="lo")
    return subprocess.Popen(
        [
            sys.executable,
            str(HERE / "transfer_sender.py"),
            f"--transport={transport.name}",
            f"--port={listener.address[1]}",
            f"--mode={mode}",
            f"--blocks={BLOCKS}",
            f"--layers={LAYERS}",
            f"--layer-bytes={LAYER_BYTES}",
        ],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )


def run_transfer(
    transport: Transport,
    tier: HostTier,
    mode: str,
    *,
    timeout_s: float = 30.0,
    metrics: TransferMetrics | None = None,
    during: object = None,
) -> TransferResult:
    receiver = TransferReceiver(tier, metrics=metrics)
    listener = transport.listen()
    proc = start_sender(transport, listener, mode)
    try:
        conn = listener.accept(timeout_s=60)
        try:
            with ThreadPoolExecutor(1) as pool:  # receive while the sender runs (flow control)
                future = pool.submit(
                    receiver.receive, conn, metas(), timeout_s=timeout_s, request_id="req-1"
                )
                if mode == "half":
                    assert proc.stdout is not None
                    for line in proc.stdout:  # NIXL logs on stdout too
                        if line.strip() == "HALF":
                            break
                    proc.send_signal(signal.SIGKILL)
                if during == "cancel":
                    threading.Timer(0.3, receiver.cancel).start()
                result = future.result(timeout=timeout_s + 30)
            if mode == "half":
                assert proc.wait(timeout=30) == -signal.SIGKILL  # killed mid-transfer
            return result
        finally:
            conn.close()
    finally:
        listener.close()
        if proc.poll() is None:
            proc.wait(timeout=60)


def assert_nothing_visible(tier: HostTier) -> None:
    assert tier.object_count == 0
    assert tier.used_bytes == 0
    assert all(tier.prepare_load(m.key) is None for m in metas())


def test_full_transfer_commits_equal_bytes(transport: Transport, tier: HostTier) -> None:
    metrics = TransferMetrics()
    result = run_transfer(transport, tier, "full", metrics=metrics)
    assert result.outcome == "committed", result.detail
    assert result.committed == tuple(m.key for m in metas())
    assert result.payload_bytes == BLOCKS * BLOCK_BYTES
    for block, meta in enumerate(metas()):
        expected = b"".join(payload(7, block, layer, LAYER_BYTES) for layer in range(LAYERS))
        lease = tier.prepare_load(meta.key)
        assert lease is not None
        assert bytes(lease.buffer) == expected
        assert lease.meta.digest == payload_digest(expected)
        tier.complete_load(lease)
    assert metrics.count(transport.name, "committed") == 1


@pytest.mark.parametrize(
    ("mode", "outcome"),
    [
        ("corrupt", "digest_mismatch"),
        ("bad_complete", "digest_mismatch"),
        ("skip", "refused"),
        ("cancel", "cancelled"),
    ],
)
def test_spoilt_transfer_commits_nothing(
    transport: Transport, tier: HostTier, mode: str, outcome: str
) -> None:
    metrics = TransferMetrics()
    result = run_transfer(transport, tier, mode, metrics=metrics)
    assert result.outcome == outcome, result.detail
    assert result.committed == ()
    assert_nothing_visible(tier)
    assert metrics.count(transport.name, outcome) == 1
    assert metrics.count(transport.name, "committed") == 0


def test_timeout_commits_nothing(transport: Transport, tier: HostTier) -> None:
    metrics = TransferMetrics()
    timed_out = run_transfer(transport, tier, "stall", timeout_s=1.5, metrics=metrics)
    assert timed_out.outcome == "timeout", timed_out.detail
    assert_nothing_visible(tier)
    assert metrics.count(transport.name, "timeout") == 1


def test_receiver_cancel_commits_nothing(transport: Transport, tier: HostTier) -> None:
    metrics = TransferMetrics()
    cancelled = run_transfer(transport, tier, "stall", metrics=metrics, during="cancel")
    assert cancelled.outcome == "cancelled", cancelled.detail
    assert_nothing_visible(tier)
    assert metrics.count(transport.name, "cancelled") == 1


def test_sigkilled_sender_is_peer_lost(transport: Transport, tier: HostTier) -> None:
    metrics = TransferMetrics()
    result = run_transfer(transport, tier, "half", metrics=metrics)
    assert result.outcome == "peer_lost", result.detail
    assert_nothing_visible(tier)
    assert metrics.count(transport.name, "peer_lost") == 1
    # the tier is whole afterwards: the same keys store and commit again
    again = run_transfer(transport, tier, "full", metrics=metrics)
    assert again.outcome == "committed", again.detail


def test_audit_record_names_objects_and_outcome(tmp_path: Path, tier: HostTier) -> None:
    path = tmp_path / "audit.jsonl"
    with AuditLog(path) as audit:
        receiver = TransferReceiver(tier, audit=audit)
        a, b = socket.socketpair()
        sender_conn, receiver_conn = TcpConnection(a), TcpConnection(b)
        sender = TransferSender(sender_conn, "req-a", blocks=1, layers=1, layer_bytes=BLOCK_BYTES)
        sender.send_layer(0, [b"\x01" * BLOCK_BYTES])
        sender.finish()
        result = receiver.receive(receiver_conn, metas(1), timeout_s=10)
        sender_conn.close()
        receiver_conn.close()
    assert result.ok
    line = path.read_text().strip()
    assert '"audit":"transfer"' in line and '"reason":"committed"' in line
    assert metas(1)[0].key.hex() in line and '"request_id":"req-a"' in line


def _receive_raw(
    tier: HostTier, raw_frames: list[bytes], *, max_frame: int, blocks: int = 1
) -> TransferResult:
    a, b = socket.socketpair()

    def write() -> None:
        with a:
            a.sendall(b"".join(raw_frames))

    writer = threading.Thread(target=write)
    writer.start()
    conn = TcpConnection(b, max_frame=max_frame)
    try:
        return TransferReceiver(tier).receive(conn, metas(blocks), timeout_s=10)
    finally:
        writer.join()
        conn.close()


def _framed(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    body=st.one_of(
        st.binary(max_size=64),
        st.binary(max_size=48).map(lambda b: frames.encode_begin("r", 1, 1, BLOCK_BYTES)[:6] + b),
        st.binary(max_size=48).map(lambda b: frames.layer_header("r", 0, 0, bytes(16)) + b),
        st.binary(max_size=64).map(lambda b: frames.layers_header("r", 0, 0, [bytes(16)]) + b),
        st.tuples(st.integers(0, 3), st.integers(0, 3), st.binary(max_size=40)).map(
            lambda t: frames.layers_header("r", t[0], t[1], [bytes(16)] * 2) + t[2]
        ),
        st.integers(0, 30).map(lambda n: frames.encode_begin("r", 1, 1, BLOCK_BYTES)[:n]),
        st.tuples(
            st.integers(0, 3), st.integers(0, 3), st.integers(0, 3), st.binary(max_size=8)
        ).map(lambda t: frames.encode_run("r", t[0], t[1], t[2]) + t[3]),
    )
)
def test_malformed_frames_are_refused_and_receiver_survives(tier: HostTier, body: bytes) -> None:
    try:
        frames.decode(body)
    except frames.MalformedFrame as exc:
        assert str(exc)
    result = _receive_raw(
        tier,
        [_framed(frames.encode_begin("r", 1, 1, BLOCK_BYTES)), _framed(body)],
        max_frame=1 << 16,
    )
    assert result.outcome in ("refused", "digest_mismatch", "peer_lost"), result
    assert result.detail
    assert_nothing_visible(tier)


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(extra=st.integers(1, 1 << 30), cut=st.integers(1, 100))
def test_oversized_and_truncated_frames(tier: HostTier, extra: int, cut: int) -> None:
    begin = _framed(frames.encode_begin("r", 1, 1, BLOCK_BYTES))
    oversized = struct.pack(">I", (1 << 16) + extra)
    result = _receive_raw(tier, [begin, oversized], max_frame=1 << 16)
    assert result.outcome == "refused" and "over the limit" in result.detail
    layer = frames.layer_header("r", 0, 0, bytes(16)) + bytes(BLOCK_BYTES)
    truncated = _framed(layer)[: -min(cut, len(layer))]
    result = _receive_raw(tier, [begin, truncated], max_frame=1 << 16)
    assert result.outcome == "peer_lost" and "mid-frame" in result.detail
    assert_nothing_visible(tier)


def test_an_announced_frame_costs_only_the_bytes_that_came() -> None:
    """A 4-byte header announcing 6 MiB and 10 bytes behind it: the receiver holds about
    1 MiB, not 6 (a peer before any authentication could otherwise make each connection
    allocate ``max_frame``); the frame still arrives whole, resumed across timeouts."""
    a, b = socket.socketpair()
    receiver = TcpConnection(b, max_frame=8 << 20)
    body = os.urandom(6 << 20)
    a.sendall(struct.pack(">I", len(body)) + body[:10])
    with pytest.raises(TransportTimeout):
        receiver.recv_frame(timeout_s=0.2)
    assert len(receiver._buffer) <= 1 << 20
    sender = threading.Thread(target=a.sendall, args=(body[10:],))
    sender.start()
    got = bytes(receiver.recv_frame(timeout_s=10))
    sender.join()
    assert got == body and len(receiver._buffer) == len(body)
    a.sendall(struct.pack(">I", 3) + b"abc")  # a smaller frame reuses the grown buffer
    assert bytes(receiver.recv_frame(timeout_s=5)) == b"abc"
    a.close()
    receiver.close()


def test_a_layer_goes_as_runs_of_blocks_within_the_frame_limit(tier: HostTier) -> None:
    """A layer goes as RUN frames of consecutive blocks, each followed by its bytes as a frame
    of their own, never past ``max_frame``; a spoilt byte in a run is caught by the block's
    digest at COMPLETE and refuses the whole transfer."""
    sent: list[bytes] = []

    class Recording:
        path, max_frame = "tcp", 2 * LAYER_BYTES + 200  # two slices per frame fit, three not

        def send_frame(self, *parts: object, timeout_s: float | None = None) -> None:
            sent.append(b"".join(bytes(memoryview(p)) for p in parts))  # type: ignore[arg-type]

    sender = TransferSender(Recording(), "r", blocks=BLOCKS, layers=LAYERS, layer_bytes=LAYER_BYTES)  # type: ignore[arg-type]
    for layer in range(LAYERS):
        sender.send_layer(layer, [payload(7, b, layer, LAYER_BYTES) for b in range(BLOCKS)])
    sender.finish()
    assert isinstance(frames.decode(sent[0]), frames.Begin)
    body = sent[1:-1]
    decoded = [frames.decode(f) for f in body[::2]]  # RUN, its bytes, RUN, its bytes, ...
    runs = [(f.first, f.count) for f in decoded if isinstance(f, frames.Run)]
    assert runs == [(0, 2), (2, 1)] * LAYERS
    assert [len(f) for f in body[1::2]] == [2 * LAYER_BYTES, LAYER_BYTES] * LAYERS
    assert all(len(f) <= Recording.max_frame for f in sent)
    result = _receive_raw(tier, [_framed(f) for f in sent], max_frame=1 << 16, blocks=BLOCKS)
    assert result.ok and len(result.committed) == BLOCKS
    for key in list(result.committed):
        tier.remove(key)
    spoilt = bytearray(sent[2])
    spoilt[-1] ^= 0xFF  # the last slice of the first run of layer 0: block 1
    frames_in = [_framed(bytes(spoilt) if i == 2 else f) for i, f in enumerate(sent)]
    result = _receive_raw(tier, frames_in, max_frame=1 << 16, blocks=BLOCKS)
    assert result.outcome == "digest_mismatch" and "block 1 whole-payload" in result.detail
    assert_nothing_visible(tier)
    short = [_framed(f) for f in sent[:2]] + [_framed(sent[2][:-1])]  # a run's bytes cut short
    result = _receive_raw(tier, short, max_frame=1 << 16, blocks=BLOCKS)
    assert result.outcome == "refused" and "expected" in result.detail
    assert_nothing_visible(tier)


def test_a_slice_larger_than_a_run_goes_alone_and_commits(tier: HostTier) -> None:
    """Large blocks: one layer slice over ``run_bytes`` (but within the frame limit) is a RUN
    of its own, not an error that fails every transfer."""
    sent: list[bytes] = []

    class Recording:
        path, max_frame = "tcp", 1 << 20

        def send_frame(self, *parts: object, timeout_s: float | None = None) -> None:
            sent.append(b"".join(bytes(memoryview(p)) for p in parts))  # type: ignore[arg-type]

    sender = TransferSender(
        Recording(),  # type: ignore[arg-type]
        "r",
        blocks=BLOCKS,
        layers=LAYERS,
        layer_bytes=LAYER_BYTES,
        run_bytes=LAYER_BYTES // 2,
    )
    for layer in range(LAYERS):
        sender.send_layer(layer, [payload(5, b, layer, LAYER_BYTES) for b in range(BLOCKS)])
    sender.finish()
    runs = [frames.decode(f) for f in sent[1:-1:2]]
    assert [(r.first, r.count) for r in runs if isinstance(r, frames.Run)] == [
        (b, 1) for b in range(BLOCKS)
    ] * LAYERS
    result = _receive_raw(tier, [_framed(f) for f in sent], max_frame=1 << 20, blocks=BLOCKS)
    assert result.ok and len(result.committed) == BLOCKS


def test_layers_frames_with_a_spoilt_slice_are_refused_at_that_slice(tier: HostTier) -> None:
    """LAYERS frames (slices inline, each with its digest) are still accepted: a spoilt slice
    is refused where it arrives."""
    slices = [payload(3, b, 0, BLOCK_BYTES) for b in range(2)]
    raw = [_framed(frames.encode_begin("r", 2, 1, BLOCK_BYTES))]
    header = frames.layers_header("r", 0, 0, [payload_digest(p) for p in slices])
    good = header + b"".join(slices)
    complete = frames.encode_complete("r", [payload_digest(p) for p in slices])
    result = _receive_raw(
        tier, [*raw, _framed(good), _framed(complete)], max_frame=1 << 16, blocks=2
    )
    assert result.ok and len(result.committed) == 2
    for key in list(result.committed):
        tier.remove(key)
    spoilt = bytearray(good)
    spoilt[-1] ^= 0xFF
    result = _receive_raw(tier, [*raw, _framed(bytes(spoilt))], max_frame=1 << 16, blocks=2)
    assert result.outcome == "digest_mismatch" and "block 1 layer 0" in result.detail
    assert_nothing_visible(tier)


def test_layers_out_of_order_still_commit_with_the_layer_ordered_digest(tier: HostTier) -> None:
    """A sender may send layers in any order: the receiver's running block hash only follows
    layers in order; otherwise COMPLETE hashes the assembled payload. Either way the committed
    object is the layer-ordered payload, and a wrong COMPLETE digest is still refused."""
    slices = {
        (b, layer): payload(9, b, layer, LAYER_BYTES) for b in range(2) for layer in range(LAYERS)
    }
    order = [(0, 1), (0, 0), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    digests = [payload_digest(b"".join(slices[(b, j)] for j in range(LAYERS))) for b in range(2)]

    def transfer(complete: list[bytes]) -> TransferResult:
        raw = [_framed(frames.encode_begin("r", 2, LAYERS, LAYER_BYTES))]
        for b, layer in order:
            data = slices[(b, layer)]
            raw.append(_framed(frames.layer_header("r", b, layer, payload_digest(data)) + data))
        raw.append(_framed(frames.encode_complete("r", complete)))
        return _receive_raw(tier, raw, max_frame=1 << 16, blocks=2)

    result = transfer(digests)
    assert result.ok and len(result.committed) == 2
    for b, key in enumerate(result.committed):
        lease = tier.prepare_load(key)
        assert lease is not None
        assert bytes(lease.buffer) == b"".join(slices[(b, j)] for j in range(LAYERS))
        tier.complete_load(lease)
        tier.remove(key)
    result = transfer([digests[0], bytes(16)])
    assert result.outcome == "digest_mismatch" and "block 1 whole-payload" in result.detail
    assert_nothing_visible(tier)


def test_conversion_hook_runs_after_verification(tier: HostTier) -> None:
    seen: list[int] = []

    def convert(sources: Sequence[bytes]) -> list[bytes]:
        seen.append(len(sources))
        return [src[::-1] for src in sources]  # stands for a real layout conversion

    a, b = socket.socketpair()
    sender_conn, receiver_conn = TcpConnection(a), TcpConnection(b)
    sender = TransferSender(sender_conn, "req-c", blocks=1, layers=2, layer_bytes=BLOCK_BYTES // 2)
    source = payload(3, 0, 0, BLOCK_BYTES)
    sender.send_layer(0, [source[: BLOCK_BYTES // 2]])
    sender.send_layer(1, [source[BLOCK_BYTES // 2 :]])
    sender.finish()
    conversion = Conversion(convert, 1, BLOCK_BYTES)
    result = TransferReceiver(tier, convert=conversion).receive(
        receiver_conn, metas(1), timeout_s=10
    )
    sender_conn.close()
    receiver_conn.close()
    assert result.ok and seen == [1]
    lease = tier.prepare_load(metas(1)[0].key)
    assert lease is not None and bytes(lease.buffer) == source[::-1]
    tier.complete_load(lease)


@pytest.mark.parametrize(
    ("blocks", "layers", "layer_bytes", "detail"),
    [
        (4096, 1024, 64, "the handshake agreed 1 of"),  # staging sized by the sender: refused
        (1, 1, 3, "conversion failed"),  # agreed sizes, bytes the converter cannot take
    ],
)
def test_a_conversion_takes_only_what_the_handshake_agreed_and_never_raises(
    tier: HostTier, blocks: int, layers: int, layer_bytes: int, detail: str
) -> None:
    def convert(sources: Sequence[bytes]) -> list[bytes]:
        return [bytes(memoryview(bytearray(src)).cast("f")) for src in sources]  # 4-byte items

    agreed = Conversion(convert, 1, 3 if layer_bytes == 3 else BLOCK_BYTES)
    raw = [_framed(frames.encode_begin("r", blocks, layers, layer_bytes))]
    if layer_bytes == 3:
        piece = b"abc"
        raw.append(_framed(frames.layer_header("r", 0, 0, payload_digest(piece)) + piece))
        raw.append(_framed(frames.encode_complete("r", [payload_digest(piece)])))
    a, b = socket.socketpair()
    sender_conn, receiver_conn = TcpConnection(a), TcpConnection(b)
    for frame in raw:
        a.sendall(frame)
    result = TransferReceiver(tier, convert=agreed).receive(receiver_conn, metas(1), timeout_s=5)
    sender_conn.close()
    receiver_conn.close()
    assert result.outcome == "refused" and detail in result.detail, result.detail
    assert_nothing_visible(tier)


def test_streamed_block_digest_is_payload_digest() -> None:
    a, b = socket.socketpair()
    sender = TransferSender(TcpConnection(a), "r", blocks=1, layers=3, layer_bytes=100)
    parts = [payload(1, 0, layer, 100) for layer in range(3)]
    for layer, part in enumerate(parts):
        sender.send_layer(layer, [part])
    assert sender.finish() == [payload_digest(b"".join(parts))]
    a.close()
    b.close()


def test_raw_socket_gbps_measures_loopback() -> None:
    assert raw_socket_gbps(32 * 1024 * 1024) > 0.0


def test_a_slot_final_meta_keeps_key_size_and_tenant(tier: HostTier) -> None:
    meta = metas(1)[0]
    slot = tier.prepare_store(meta)
    assert slot is not None
    slot.buffer[:] = bytes(BLOCK_BYTES)
    slot.meta = replace(meta, tenant="t1", digest=payload_digest(bytes(BLOCK_BYTES)))
    with pytest.raises(TierError, match="key, size and tenant"):
        tier.complete_store(slot, True)
