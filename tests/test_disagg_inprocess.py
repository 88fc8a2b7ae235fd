"""Prefill → decode between two engines in one process (tiny model, fast): the sender's
layer-wise feed places blocks right across a chunked prefill (several steps) and the decode
engine hits exactly what it received."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.factory import build_engine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.engine.relayout import pool_layout
from kvstrata.engine.sampling import SamplingParams
from kvstrata.engine.transfer_io import ExportedPrefix, export_prefix
from kvstrata.errors import ConfigError
from kvstrata.runtime.config import load_worker_config
from kvstrata.runtime.scheduler import SchedulerConfig
from kvstrata.serve import transfer_receiver
from kvstrata.serve.disagg import DisaggMetrics, Disaggregation
from kvstrata.serve.protocol import TransferWait
from kvstrata.serve.transfer_receiver import DecodeTransfers, TransferStatus
from kvstrata.serve.transfer_sender import _same, prefill_and_send
from kvstrata.transfer.handshake import decode_answer
from kvstrata.transfer.intro import TransferIntro, encode_intro, intro_mac
from kvstrata.transfer.layout import RefuseReason
from kvstrata.transfer.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    BlockEntry,
    Operation,
    Refuse,
    TransferOffer,
    Transport,
    WireLayout,
    encode,
)
from kvstrata.transfer.tcp import GREETING, TcpTransport
from tier_helpers import worker_tiers

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SECRET = b"in-process-secret"


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 40000, size=n)]


@pytest.fixture()
def decode(tiny_model: LoadedModel) -> Iterator[tuple[ReferenceEngine, DecodeTransfers]]:
    worker = load_worker_config(raw={"tiers": [{"name": "host", "gib": 0.01}]}, source="test")
    config = EngineConfig(block_size=16, pool_blocks=64, tenant_secret=SECRET)
    engine = build_engine(tiny_model, config, worker)
    engine.start_loop()
    receiver = DecodeTransfers(engine, tenant_secret=SECRET).start()
    yield engine, receiver
    receiver.close()
    engine.close()


@pytest.mark.parametrize("chunk", [512, 32])  # one step; several steps of two blocks each
def test_chunked_prefill_streams_every_block_to_its_place(
    tiny_model: LoadedModel, decode: tuple[ReferenceEngine, DecodeTransfers], chunk: int
) -> None:
    engine, receiver = decode
    scheduler = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=chunk)
    sender = ReferenceEngine(
        tiny_model,
        EngineConfig(block_size=16, pool_blocks=64, tenant_secret=SECRET, scheduler=scheduler),
    )
    sender.start_loop()
    try:
        prompt = _tokens(16 * 6 + 3, seed=chunk)
        cached = prompt[: 16 * 2]
        sender.generate(cached, SamplingParams(max_tokens=1)).run()  # 2 blocks held already
        address = (receiver.host, receiver.port)
        sent = prefill_and_send(
            sender, prompt, "default", f"r{chunk}", address, tenant_secret=SECRET
        )
        assert sent.outcome == "sent", sent
        assert sent.blocks == 6 and 0.0 <= sent.overlap <= 1.0
        status = receiver.wait(f"r{chunk}", 10)
        assert status is not None and status.committed and status.blocks == 6
        hit = engine.generate(prompt, GREEDY).run()  # first: only the transfer can explain it
        assert hit.record.matched_tokens == 96
        fresh = engine.generate(prompt, GREEDY, use_cache=False).run()
        assert hit.output_ids == fresh.output_ids
    finally:
        sender.stop_loop()


def test_a_chunk_ending_inside_the_last_full_block_ships_its_final_content(
    tiny_model: LoadedModel, decode: tuple[ReferenceEngine, DecodeTransfers]
) -> None:
    """24-token chunks over 40 tokens: the first step ends 8 tokens into block 1, the last
    full block. Block 1 must not be shipped (and committed as a hit) half computed."""
    engine, receiver = decode
    scheduler = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24)
    sender = ReferenceEngine(
        tiny_model,
        EngineConfig(block_size=16, pool_blocks=64, tenant_secret=SECRET, scheduler=scheduler),
    )
    sender.start_loop()
    try:
        prompt = _tokens(40, seed=24)
        address = (receiver.host, receiver.port)
        sent = prefill_and_send(sender, prompt, "default", "mid", address, tenant_secret=SECRET)
        assert sent.outcome == "sent" and sent.blocks == 2, sent
        status = receiver.wait("mid", 10)
        assert status is not None and status.committed and status.blocks == 2
        hit = engine.generate(prompt, GREEDY).run()
        assert hit.record.matched_tokens == 32
        fresh = engine.generate(prompt, GREEDY, use_cache=False).run()
        assert hit.output_ids == fresh.output_ids
    finally:
        sender.stop_loop()


def test_wrong_secret_is_refused_and_nothing_stored(
    tiny_model: LoadedModel, decode: tuple[ReferenceEngine, DecodeTransfers]
) -> None:
    engine, receiver = decode
    sender = ReferenceEngine(
        tiny_model, EngineConfig(block_size=16, pool_blocks=64, tenant_secret=SECRET)
    )
    sender.start_loop()
    try:
        prompt = _tokens(40, seed=9)
        sent = prefill_and_send(
            sender, prompt, "default", "rx", (receiver.host, receiver.port), tenant_secret=b"wrong"
        )
        assert (sent.outcome, sent.reason) == ("refused", "tenant_forbidden")
        assert engine.generate(prompt, GREEDY).run().record.matched_tokens == 0
        # an unauthenticated peer records no status under the id it names: it could
        # otherwise end (or crowd out) the wait of the real transfer of that request
        assert receiver.wait("rx", 0.3) is None
        assert receiver.metrics.count("tcp", "refused") == 1
    finally:
        sender.stop_loop()


def test_the_final_check_compares_what_was_shipped_not_the_feeds_latest_copy() -> None:
    final = torch.zeros(2, 3, 4)  # [blocks, layers, …]
    shipped = {layer: [final[0, layer].clone(), final[1, layer].clone()] for layer in range(3)}
    assert _same(shipped, final)
    shipped[1][1] = shipped[1][1] + 1  # a block shipped before its step had finished it
    assert not _same(shipped, final)
    del shipped[2]
    shipped[1][1] = final[1, 1].clone()
    assert not _same(shipped, final)  # a layer never shipped


def test_connections_beyond_the_cap_are_closed_at_accept(
    decode: tuple[ReferenceEngine, DecodeTransfers], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Peers that connect and say nothing hold a thread each until their handshake times
    out: beyond ``MAX_CONNECTIONS`` the receiver closes a new connection at once."""
    _, receiver = decode
    monkeypatch.setattr(transfer_receiver, "MAX_CONNECTIONS", 2)
    peers = [socket.create_connection((receiver.host, receiver.port)) for _ in range(3)]
    try:
        for peer in peers:
            peer.settimeout(5)
            assert peer.recv(len(GREETING), socket.MSG_WAITALL) == GREETING
        assert peers[2].recv(1) == b""  # closed by the receiver
        for peer in peers[:2]:  # still waiting for their intro
            peer.settimeout(0.3)
            with pytest.raises(TimeoutError):
                peer.recv(1)
    finally:
        for peer in peers:
            peer.close()


def test_a_prefill_request_id_that_cannot_be_encoded_is_refused_at_parsing() -> None:
    """It goes into the intro's MAC (UTF-8): a lone surrogate was a 500 there."""
    from pydantic import ValidationError

    from kvstrata.serve.disagg import PrefillRequest

    body = {"request_id": "\ud800", "prompt_token_ids": [1, 2], "target": {"host": "h", "port": 1}}
    with pytest.raises(ValidationError):
        PrefillRequest.model_validate(body)
    assert PrefillRequest.model_validate({**body, "request_id": "r-1"}).request_id == "r-1"


def test_close_cancels_the_transfers_in_flight(
    tiny_model: LoadedModel, decode: tuple[ReferenceEngine, DecodeTransfers]
) -> None:
    """A transfer still streaming when the decode side closes is cancelled (its pending
    objects aborted, its waiter told) before ``close`` returns: nothing reaches the store
    afterwards (it went on for up to ``receive_timeout_s``)."""
    engine, receiver = decode
    sender = ReferenceEngine(
        tiny_model, EngineConfig(block_size=16, pool_blocks=64, tenant_secret=SECRET)
    )
    sender.start_loop()
    prompt = _tokens(64, seed=11)
    address = (receiver.host, receiver.port)
    outcome: list[object] = []
    thread = threading.Thread(
        target=lambda: outcome.append(
            prefill_and_send(
                sender, prompt, "default", "slow", address, tenant_secret=SECRET, layer_delay_s=1.0
            )
        )
    )
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while not receiver._receiving and time.monotonic() < deadline:
            time.sleep(0.02)
        assert receiver._receiving, "the transfer never started"
        started = time.monotonic()
        receiver.close()
        assert time.monotonic() - started < 3
        assert not receiver._receiving
        status = receiver.wait("slow", 1)
        assert status is not None and status.outcome == "cancelled" and status.blocks == 0
        assert engine.generate(prompt, GREEDY).run().record.matched_tokens == 0
    finally:
        thread.join(timeout=30)
        sender.stop_loop()


def test_a_transfer_listener_without_a_tenant_secret_refuses_to_start(
    tiny_model: LoadedModel,
) -> None:
    """Intros are MACed with the tenant secret: with none, anyone who reached the port could
    compute a valid intro for any tenant and commit KV of its choosing (a review reproduced
    another checkpoint's KV served as a hit). The listener now refuses to start."""
    worker = load_worker_config(raw={"tiers": [{"name": "host", "gib": 0.01}]}, source="test")
    engine = build_engine(tiny_model, EngineConfig(block_size=16, pool_blocks=16), worker)
    try:
        with pytest.raises(ConfigError, match="tenant secret"):
            DecodeTransfers(engine)
    finally:
        engine.close()


@pytest.mark.parametrize(
    "entries",
    [[(0, 16), (1, 8)], [(1, 16)], [(0, 16), (2, 16)]],
    ids=["partial-last-block", "shifted", "gap"],
)
def test_an_offer_of_other_than_the_prompts_full_blocks_in_order_is_refused(
    tiny_model: LoadedModel,
    decode: tuple[ReferenceEngine, DecodeTransfers],
    entries: list[tuple[int, int]],
) -> None:
    """The receiver files block i under its own key of prompt block i, as a full block: an
    offer naming a partial block or other positions (which the handshake's pure check
    allows) would have its bytes served as an exact hit of the wrong tokens."""
    engine, receiver = decode
    sender = ReferenceEngine(
        tiny_model, EngineConfig(block_size=16, pool_blocks=64, tenant_secret=SECRET)
    )
    prompt = _tokens(40, seed=7)
    exported = export_prefix_after(sender, prompt)
    conn = TcpTransport().connect((receiver.host, receiver.port), timeout_s=5)
    try:
        mac = intro_mac(SECRET, "r1", "default", prompt)
        conn.send_frame(
            encode_intro(TransferIntro(PROTOCOL_VERSION, "r1", tuple(prompt), "default", mac))
        )
        offer = TransferOffer(
            version=PROTOCOL_VERSION,
            model_digest=sender.fingerprint.model_digest(),
            layout=WireLayout.of(pool_layout(sender.pool.config)),
            request_id="r1",
            tenant="default",
            blocks=tuple(BlockEntry(i, n, bytes(exported.keys[0])) for i, n in entries),
            operations=(Operation.WRITE,),
            transports=(Transport.TCP,),
        )
        conn.send_frame(encode(offer))
        answer = decode_answer(bytes(conn.recv_frame(timeout_s=5)), max_bytes=MAX_MESSAGE_BYTES)
    finally:
        conn.close()
    assert isinstance(answer, Refuse) and answer.reason is RefuseReason.MALFORMED
    assert engine.generate(prompt, GREEDY).run().record.matched_tokens == 0


def export_prefix_after(engine: ReferenceEngine, prompt: list[int]) -> ExportedPrefix:
    engine.generate(prompt, SamplingParams(max_tokens=1)).run()
    return export_prefix(engine, prompt, "default")


def _send(
    tiny_model: LoadedModel, receiver: DecodeTransfers, prompt: list[int], rid: str
) -> TransferStatus:
    sender = ReferenceEngine(tiny_model, EngineConfig(block_size=16, pool_blocks=64))
    sender.start_loop()
    try:
        address = (receiver.host, receiver.port)
        sent = prefill_and_send(sender, prompt, "default", rid, address, tenant_secret=SECRET)
        assert sent.outcome == "sent", sent
    finally:
        sender.stop_loop()
    status = receiver.wait(rid, 10)
    assert status is not None and status.committed
    return status


def _held(engine: ReferenceEngine) -> int:
    assert engine.bridge is not None
    return len(engine.bridge.store._held)


def test_received_blocks_stay_until_their_request_took_them(tiny_model: LoadedModel) -> None:
    """Between the commit and the decode request's lookup, saves into a full host tier (LRU:
    the received chain is its oldest) must not evict the received chain; the request's first
    token ends the hold."""
    block = 2 * 2 * 2 * 16 * 16 * 4  # the tiny model's block bytes
    worker = worker_tiers(host_bytes=24 * block, policy="lru")
    config = EngineConfig(block_size=16, pool_blocks=64, tenant_secret=SECRET)
    engine = build_engine(tiny_model, config, worker)
    engine.start_loop()
    receiver = DecodeTransfers(engine, tenant_secret=SECRET).start()
    try:
        prompt = _tokens(16 * 6 + 3, seed=61)
        _send(tiny_model, receiver, prompt, "held")
        assert _held(engine) == 6
        for seed in range(62, 68):  # 6 prompts of 6 blocks: more than the tier holds
            engine.generate(_tokens(16 * 6 + 3, seed=seed), SamplingParams(max_tokens=1)).run()
        assert engine.bridge is not None
        dropped = {"tier": "host", "outcome": "dropped"}
        assert engine.bridge.store.metrics.value("kvstrata_tier_evictions_total", dropped) > 0
        engine.call(engine.pool.clear).result()  # only the host tier can serve it now
        disagg = Disaggregation(engine, DisaggMetrics(CollectorRegistry()), receiver=receiver)
        generation = engine.generate(prompt, GREEDY)
        disagg.release_at_first_token(TransferWait(request_id="held"), generation)
        generation.run()
        assert generation.record.matched_tokens == 96
        assert _held(engine) == 0
        fresh = engine.generate(prompt, GREEDY, use_cache=False).run()
        assert generation.output_ids == fresh.output_ids
    finally:
        receiver.close()
        engine.close()


def test_a_hold_nobody_takes_ends_after_hold_s(tiny_model: LoadedModel) -> None:
    worker = load_worker_config(raw={"tiers": [{"name": "host", "gib": 0.01}]}, source="test")
    config = EngineConfig(block_size=16, pool_blocks=64, tenant_secret=SECRET)
    engine = build_engine(tiny_model, config, worker)
    engine.start_loop()
    # Long enough that a loaded box checks each hold before it ends; short enough to wait out.
    receiver = DecodeTransfers(engine, tenant_secret=SECRET, hold_s=1.5).start()
    try:
        _send(tiny_model, receiver, _tokens(16 * 3, seed=71), "orphan")
        assert _held(engine) == 3
        deadline = time.monotonic() + 15
        while _held(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _held(engine) == 0
        receiver.hold_s = 600  # from here on, only a release or a newer transfer ends a hold
        _send(tiny_model, receiver, _tokens(16 * 3, seed=72), "again")
        # A repeated id: its wait is for this transfer, not the first one's end.
        assert _send(tiny_model, receiver, _tokens(16 * 4, seed=73), "again").blocks == 4
        assert _held(engine) == 4  # the first transfer's hold ended with the second's
        disagg = Disaggregation(engine, DisaggMetrics(CollectorRegistry()), receiver=receiver)
        disagg.release_at_first_token(TransferWait(request_id="again"), None)  # it failed
        assert _held(engine) == 0
        _send(tiny_model, receiver, _tokens(16 * 3, seed=74), "closing")
        assert _held(engine) == 3
    finally:
        receiver.close()
    assert _held(engine) == 0  # close ends every hold
    engine.close()
