"""Fuzzing the message boundaries: KV event batches, the live and replay sockets, lookups.

Real ZMQ sockets on 127.0.0.1 (or ipc in a temporary directory) carry random frames:

- ``decode_batch`` returns a batch or raises ``EventDecodeError``, nothing else, and what it
  returns holds only hashes a vLLM hash function can produce;
- a subscriber fed random live messages counts every one (malformed, duplicate or batch),
  never raises, and delivers the next good batch;
- a publisher's ROUTER fed random requests never raises and still answers a good request
  with its buffered batches; a subscriber fed random replay replies does not raise either;
- the vLLM connector's ``LookupServer`` answers random request bytes (single or multi-frame)
  with a miss and keeps serving real lookups.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import example, given
from hypothesis import strategies as st

from fuzz_helpers import FEW, FUZZ
from kvstrata.connectors.vllm_lookup import LookupServer
from kvstrata.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    ReceivedBatch,
    ZmqEventPublisher,
    ZmqEventSubscriber,
    encode_batch,
    make_batch,
)
from kvstrata.events.schema import EventDecodeError, decode_batch
from kvstrata.identity import BlockKey
from kvstrata.identity.keys import FingerprintDigest
from kvstrata.index.core import GlobalIndex
from kvstrata.objects import KVObjectMeta, Representation, payload_digest
from kvstrata.store.config import TierConfig
from kvstrata.store.levels import RequestScope
from kvstrata.store.policies import LRUPolicy
from kvstrata.store.tiered import TieredStore
from kvstrata.tiers.host import HostTier

TIMEOUT_S = 5.0
pytestmark = pytest.mark.timeout(300)

# ---- what msgpack can carry ---------------------------------------------------------------
mp_scalar = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "GPU"])
)
mp_value = st.recursive(
    mp_scalar,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(max_size=6) | st.integers(-3, 3), inner, max_size=5)
    ),
    max_leaves=16,
)
EVENT_FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"]
EVENT_FIELDS += ["medium", "lora_name", "extra_keys", "group_idx", "namespace"]
near_event = st.fixed_dictionaries(
    {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Nope"])},
    optional={name: mp_value for name in EVENT_FIELDS},
)
near_batch = st.one_of(
    st.tuples(mp_value, st.lists(near_event | mp_value, max_size=4)).map(list),
    st.tuples(st.floats(), st.lists(near_event, max_size=4), mp_value, mp_value, mp_value).map(
        list
    ),
    st.fixed_dictionaries(
        {"ts": mp_value, "events": st.lists(near_event, max_size=3)},
        optional={"worker_id": mp_value, "epoch": mp_value, "data_parallel_rank": mp_value},
    ),
)
payloads = st.binary(max_size=64) | mp_value.map(msgspec.msgpack.encode)
payloads |= near_batch.map(msgspec.msgpack.encode)


def _stored(block_hash: int) -> BlockStored:
    return BlockStored([block_hash], None, [1, 2, 3, 4], 4, None, "GPU", None)


GOOD_EVENTS: list[KVEvent] = [_stored(7), BlockRemoved([7], "GPU", namespace="t1")]


@FUZZ
@given(payload=payloads)
@example(payload=msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [-1]}]]))
@example(payload=msgspec.msgpack.encode({"events": []}))
@example(payload=msgspec.msgpack.encode({}))
@example(payload=b"\xc7\x01\x05x")  # an ext type
@example(payload=b"\x91" * 10_000 + b"\xc0")  # deep nesting
def test_decode_batch_raises_only_event_decode_errors(payload: bytes) -> None:
    try:
        decoded = decode_batch(payload)
    except EventDecodeError:
        return
    for event in decoded.batch.events:
        if isinstance(event, BlockStored | BlockRemoved):
            hashes: list[Any] = list(event.block_hashes)
            if isinstance(event, BlockStored) and event.parent_block_hash is not None:
                hashes.append(event.parent_block_hash)
            for block_hash in hashes:
                assert (isinstance(block_hash, bytes) and block_hash) or (
                    isinstance(block_hash, int) and 0 <= block_hash < 1 << 64
                )


# ---- the index, the events' consumer --------------------------------------------------------
B = 4
block_hash = (
    st.integers(0, (1 << 64) - 1) | st.binary(min_size=1, max_size=8) | st.sampled_from([1, 2, 3])
)
token_ids = st.lists(
    st.integers(0, 50) | st.integers(-(1 << 63), (1 << 64) - 1), max_size=3 * B
) | st.integers(0, 50).map(lambda t: [t] * B)
medium = st.sampled_from(["GPU", "CPU", "host", "disk", "remote", None, "tape"])
stored = st.builds(
    BlockStored,
    st.lists(block_hash, min_size=0, max_size=3),
    st.none() | block_hash,
    token_ids,
    st.sampled_from([B, 0, -1, 3]),
    st.none() | st.integers(),
    medium,
    st.none() | st.text(max_size=4),
    namespace=st.none() | st.text(max_size=8) | st.just(""),
)
removed = st.builds(
    BlockRemoved,
    st.lists(block_hash, max_size=3),
    medium,
    namespace=st.none() | st.text(max_size=8),
)


@FUZZ
@given(
    batches=st.lists(
        st.tuples(
            st.lists(stored | removed | st.just(AllBlocksCleared()), max_size=4),
            st.none() | st.integers(0, 3),
            st.floats(),
        ),
        max_size=4,
    )
)
@example(batches=[([BlockStored([5], None, [1 << 40] * B, B, None, "GPU", None)], None, 1.0)])
def test_index_applies_any_decodable_batch(
    batches: list[tuple[list[KVEvent], int | None, float]],
) -> None:
    """Whatever a worker's events say, the index counts what it cannot use and keeps serving."""
    index = GlobalIndex(FingerprintDigest(bytes(32)), B)
    for events, epoch, ts in batches:
        index.apply_batch("w1", make_batch(events, ts=ts, epoch=epoch, worker_id="w1"))
    index.replace_worker("w2", 1, [e for events, _, _ in batches for e in events])
    tokens = list(range(3 * B))
    good = BlockStored([11, 12, 13], None, tokens, B, None, "GPU", "")
    index.replace_worker("w3", 1, [good])
    matches = index.match(index.request_hashes(None, tokens))
    assert matches["w3"].blocks == 3


# ---- the live socket ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(scope="module")
def xpub(ctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[tuple[zmq.Socket[bytes], str]]:
    socket = ctx.socket(zmq.XPUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not the first only
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    yield socket, f"tcp://127.0.0.1:{port}"
    socket.close(linger=0)


LAST_SEQ = 1 << 62
"""Random live messages use smaller sequence numbers; the good batch after them uses this."""
seq_frame = st.integers(0, LAST_SEQ - 1).map(lambda s: s.to_bytes(8, "big")) | st.binary(
    max_size=10
)
live_message = st.one_of(
    st.tuples(st.binary(max_size=4), seq_frame, payloads).map(list),
    st.lists(st.binary(max_size=12), min_size=1, max_size=5),
)


def _subscribed(xpub: zmq.Socket[bytes]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if xpub.poll(50) and xpub.recv()[:1] == b"\x01":
            return
    raise AssertionError("no subscription reached the publisher")


@FEW
@given(messages=st.lists(live_message, max_size=8))
@example(messages=[[b"", b"\xff" * 8, b"\xc1"], [b"", b"\x00" * 7, b""], [b"x"]])
def test_subscriber_counts_random_live_messages_and_delivers_the_next_batch(
    ctx: zmq.Context[zmq.Socket[bytes]],
    xpub: tuple[zmq.Socket[bytes], str],
    messages: list[list[bytes]],
) -> None:
    socket, endpoint = xpub
    good = encode_batch(make_batch(GOOD_EVENTS, ts=1.0))
    with ZmqEventSubscriber(endpoint, context=ctx) as sub:
        _subscribed(socket)
        for frames in messages:
            socket.send_multipart(frames)
        stats = sub.stats
        delivered: list[ReceivedBatch] = []
        resync = False
        deadline = time.monotonic() + TIMEOUT_S
        while stats.malformed_messages + stats.duplicates + stats.batches < len(messages):
            assert time.monotonic() < deadline, f"{len(messages)} sent, {stats} counted"
            result = sub.poll(timeout_ms=50)
            delivered += result.batches
            resync |= result.resync_needed
        assert stats.batches == len(delivered)
        if resync:  # as the fleet's event plane does after loading the worker's dump
            sub.resume_from(LAST_SEQ)
        socket.send_multipart([b"", LAST_SEQ.to_bytes(8, "big"), good])
        while not any(b.seq == LAST_SEQ for b in delivered) and time.monotonic() < deadline:
            delivered += sub.poll(timeout_ms=50).batches
    assert delivered and delivered[-1].seq == LAST_SEQ
    assert delivered[-1].batch.events == GOOD_EVENTS
    assert stats.malformed_messages + stats.duplicates + stats.batches == len(messages) + 1


# ---- the replay socket --------------------------------------------------------------------
@pytest.fixture(scope="module")
def publisher(ctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[ZmqEventPublisher]:
    with ZmqEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=4, context=ctx
    ) as pub:
        for _ in range(6):  # seqs 0..5; 2..5 stay buffered
            pub.publish(GOOD_EVENTS, ts=1.0)
        yield pub


def _dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    return dealer


@FEW
@given(requests=st.lists(st.lists(st.binary(max_size=12), min_size=1, max_size=4), max_size=6))
@example(requests=[[b"", b"\xff" * 8], [b"x" * 8], [b"", b"", b"\x00" * 8]])
def test_replay_router_survives_random_requests(
    ctx: zmq.Context[zmq.Socket[bytes]], publisher: ZmqEventPublisher, requests: list[list[bytes]]
) -> None:
    endpoint = publisher.replay_endpoint
    assert endpoint is not None
    noise, good = _dealer(ctx, endpoint), _dealer(ctx, endpoint)
    try:
        for frames in requests:
            noise.send_multipart(frames)
        good.send_multipart([b"", (3).to_bytes(8, "big")])
        replies: list[list[bytes]] = []
        deadline = time.monotonic() + TIMEOUT_S
        while not (replies and replies[-1][1] == b"\xff" * 8) and time.monotonic() < deadline:
            publisher.serve_replay(timeout_ms=20)
            while good.poll(0):
                replies.append(good.recv_multipart())
    finally:
        noise.close(linger=0)
        good.close(linger=0)
    seqs = [int.from_bytes(frames[1], "big", signed=True) for frames in replies]
    assert seqs == [3, 4, 5, -1]
    assert decode_batch(replies[0][2]).batch.events == GOOD_EVENTS


reply_message = st.one_of(
    st.tuples(
        st.just(b""), st.integers(-5, 12).map(lambda s: s.to_bytes(8, "big", signed=True)), payloads
    ).map(list),
    st.lists(st.binary(max_size=10), min_size=1, max_size=4),
)


@FEW
@given(replies=st.lists(reply_message, max_size=6))
def test_subscriber_survives_random_replay_replies(
    ctx: zmq.Context[zmq.Socket[bytes]],
    xpub: tuple[zmq.Socket[bytes], str],
    replies: list[list[bytes]],
) -> None:
    """A replay ROUTER answering garbage: the subscriber counts it and flags what it lost."""
    socket, endpoint = xpub
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:
        if router.poll(int(TIMEOUT_S * 1000)):
            client = router.recv_multipart()[0]
            for frames in [*replies, [b"", (-1).to_bytes(8, "big", signed=True), b""]]:
                router.send_multipart([client, *frames])

    thread = threading.Thread(target=answer, name="fake-replay")
    thread.start()
    good = encode_batch(make_batch(GOOD_EVENTS, ts=1.0))
    try:
        with ZmqEventSubscriber(
            endpoint, f"tcp://127.0.0.1:{port}", replay_timeout_s=TIMEOUT_S, context=ctx
        ) as sub:
            _subscribed(socket)
            # a gap (0..9 missing), then its successor: 10 alone may be dropped as a number the
            # replay shows was never sent (it holds nothing past 9), 11 after it is trusted
            for seq in (10, 11):
                socket.send_multipart([b"", seq.to_bytes(8, "big"), good])
            delivered = []
            deadline = time.monotonic() + TIMEOUT_S
            while not any(b.seq == 11 for b in delivered) and time.monotonic() < deadline:
                delivered += sub.poll(timeout_ms=50).batches
    finally:
        thread.join(TIMEOUT_S)
        router.close(linger=0)
    assert delivered[-1].seq == 11 and delivered[-1].batch.events == GOOD_EVENTS
    assert [b.seq for b in delivered] == sorted({b.seq for b in delivered})
    assert all(0 <= b.seq <= 11 for b in delivered)


# ---- the vLLM connector's lookup socket -----------------------------------------------------
OBJ = 256


def _chain(n: int, tenant: str) -> list[tuple[KVObjectMeta, bytes]]:
    out: list[tuple[KVObjectMeta, bytes]] = []
    parent: BlockKey | None = None
    for i in range(n):
        key = BlockKey(f"{tenant}/fuzz/{i}".encode().ljust(32, b"."))
        payload = bytes([i]) * OBJ
        meta = KVObjectMeta(
            key,
            parent,
            tenant,
            Representation("uint8", "raw", 1, (OBJ,)),
            OBJ,
            payload_digest(payload),
            1000.0,
            position=i,
        )
        out.append((meta, payload))
        parent = key
    return out


def _filler(payload: bytes) -> Callable[[memoryview], None]:
    def fill(buffer: memoryview) -> None:
        buffer[:] = payload

    return fill


@pytest.fixture(scope="module")
def lookup_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[bytes]]]:
    store = TieredStore([(HostTier(16 * OBJ, OBJ), LRUPolicy(), TierConfig("host"))])
    objects = _chain(3, "acme")
    for meta, payload in objects:
        assert store.put(meta, _filler(payload))

    def lookup(  # what ConnectorWorker.lookup asks
        tenant: str, keys: Sequence[BlockKey], presence: bool = False, req_id: str | None = None
    ) -> int:
        return len(store.lookup(keys, RequestScope(tenant=tenant, model="", request_id=req_id)))

    endpoint = f"ipc://{tmp_path_factory.mktemp('lookup') / 'lookup.ipc'}"
    server = LookupServer(endpoint, lookup).start()
    yield endpoint, [bytes(meta.key) for meta, _ in objects]
    server.close()
    store.close()


def _ask(socket: zmq.Socket[bytes], frames: list[bytes]) -> int:
    socket.send_multipart(frames)
    assert socket.poll(int(TIMEOUT_S * 1000)), "the lookup server stopped answering"
    reply = socket.recv_multipart()
    return int(msgspec.msgpack.decode(reply[-1], type=int))


@FUZZ
@given(
    request=st.binary(max_size=64)
    | mp_value.map(msgspec.msgpack.encode)
    | st.tuples(st.text(max_size=8), st.lists(st.binary(max_size=40), max_size=4)).map(
        msgspec.msgpack.encode
    ),
    extra_frames=st.lists(st.binary(max_size=8), max_size=2),
)
@example(request=msgspec.msgpack.encode(["acme", [b""]]), extra_frames=[])
@example(request=b"\x92\xa2\xed\xa0\x80", extra_frames=[])  # a tenant that is not UTF-8
@example(request=b"\xa1\xff", extra_frames=[b"second frame"])
def test_lookup_server_answers_random_requests_and_keeps_serving(
    ctx: zmq.Context[zmq.Socket[bytes]],
    lookup_server: tuple[str, list[bytes]],
    request: bytes,
    extra_frames: list[bytes],
) -> None:
    endpoint, keys = lookup_server
    dealer = _dealer(ctx, endpoint)  # a DEALER can send what a REQ cannot: several frames
    try:
        found = _ask(dealer, [b"", request, *extra_frames])
        assert found >= 0
        assert _ask(dealer, [b"", msgspec.msgpack.encode(["acme", keys])]) == len(keys)
        assert _ask(dealer, [b"", msgspec.msgpack.encode(["other", keys])]) == 0
    finally:
        dealer.close(linger=0)
