"""The prefill worker's side of a prefill → decode transfer (issue 14; ``docs/disaggregation.md``).

``prefill_and_send(engine, tokens, tenant, request_id, target)`` connects to the decode
worker's transfer port, sends the intro and the ``TransferOffer`` (this pool's layout, the
prompt's full blocks), checks the answer (``check_answer``), then runs ``engine.prefill`` with
a layer listener: each layer's blocks are copied off the pool on the step thread (a copy,
nothing else) and a sender thread ships layer ``l`` of every block (``TransferSender``) as
soon as it has it, while layers ``l+1…`` compute — the layer-wise overlap. Blocks the prompt
matched in the pool at admission are exported before the prefill is queued.

Block positions of a listener call: the engine names each block once, in the step that
completes it (``paged_attention.LayerListener``: a chunk that ends mid-block leaves that
block to the next step), so the first naming step starts at the block of the request's
``matched_tokens`` and each later one just after the last block named. After the prefill,
every block is read back from the pool (still pinned) and compared, layer by layer, with the
very tensors the sender thread shipped (not with the feed's latest copy): anything that made
them differ — a preemption that recomputed the prompt, a listener contract broken — cancels
the transfer (the decode worker computes locally) rather than finishing it. The blocks are
released in every case.

``overlap`` is the share of the sender's busy time (layer frames on the wire) that passed
before the prefill finished: what the compute hid.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from kvstrata.engine.engine import ReferenceEngine
from kvstrata.engine.prefill import PrefillHandle
from kvstrata.engine.transfer_io import export_prefix, pool_layout
from kvstrata.errors import KvstrataError
from kvstrata.identity import ModelFingerprint
from kvstrata.transfer.handshake import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    BlockEntry,
    HandshakeError,
    Operation,
    Refuse,
    TransferOffer,
    Transport,
    WireLayout,
    check_answer,
    decode_answer,
    encode,
)
from kvstrata.transfer.intro import TransferIntro, encode_intro, intro_mac
from kvstrata.transfer.stream import TransferSender
from kvstrata.transfer.transport import Address, Connection, TransportError, make_transport

logger = logging.getLogger(__name__)
_CONNECT_TIMEOUT_S = 10.0
UNREACHABLE = "no kvstrata transfer listener answered at the target"
_DONE = -1


@dataclass(frozen=True)
class SendOutcome:
    """``outcome``: ``sent`` (COMPLETE sent), ``refused`` (``reason``: the receiver's
    ``RefuseReason``), ``unreachable``, ``failed`` (transport or engine error, ``reason``)
    or ``inconsistent`` (the sent blocks were not the pool's final ones: cancelled)."""

    outcome: str
    blocks: int = 0
    payload_bytes: int = 0
    seconds: float = 0.0
    overlap: float = 0.0
    reason: str = ""
    compute_s: float = 0.0
    """The prefill's own compute (``RequestRecord.prefill_compute_s``; 0: unknown), without
    the handshake, the transfer or the wait for the last layer to go out."""
    matched_tokens: int = 0
    """Prompt tokens the prefill found cached here."""


class _LayerFeed:
    """The listener's side: copies each named layer's blocks, by block index, on the step
    thread; the sender thread takes whole layers from ``ready``."""

    def __init__(self, engine: ReferenceEngine, blocks: int) -> None:
        self.engine, self.blocks = engine, blocks
        self.handle: PrefillHandle | None = None
        self.block_size = engine.pool.config.block_size
        layers = engine.pool.config.num_layers
        self.data: list[list[torch.Tensor | None]] = [[None] * blocks for _ in range(layers)]
        self.ids: dict[int, int] = {}  # block index → pool block id, as the listener named it
        self.ready: queue.Queue[int] = queue.Queue()
        self._sent_layers = 0
        self._step_first = 0
        self._last_index: int | None = None  # the last block index a step named

    def preload(self, exported: torch.Tensor) -> None:
        for index in range(min(int(exported.shape[0]), self.blocks)):
            for layer, row in enumerate(self.data):
                row[index] = exported[index, layer]

    def __call__(self, layer: int, block_ids: tuple[int, ...]) -> None:
        """On the step thread, inside the forward: copy, never block."""
        if layer == 0:
            self._new_step(block_ids)
        first = self._step_first
        ids = [b for i, b in enumerate(block_ids) if first + i < self.blocks]
        if ids:
            pool = self.engine.pool
            index = torch.tensor(ids, dtype=torch.long, device=pool.kv.device)
            with torch.inference_mode():
                picked = pool.kv[layer].index_select(2, index)  # [2, H, k, B, D]
                copies = picked.permute(2, 0, 1, 3, 4).contiguous().to("cpu")
            for offset in range(len(ids)):
                self.data[layer][first + offset] = copies[offset]
                self.ids[first + offset] = ids[offset]
        self._publish()

    def _new_step(self, block_ids: tuple[int, ...]) -> None:
        generation = self.handle.generation if self.handle is not None else None
        if self._last_index is None:
            matched = generation.record.matched_tokens if generation is not None else 0
            self._step_first = matched // self.block_size
        else:
            self._step_first = self._last_index + 1
        if block_ids:
            self._last_index = self._step_first + len(block_ids) - 1

    def fill_missing(self, final: torch.Tensor) -> None:
        """After the prefill: blocks no listener call named (matched at admission)."""
        for layer, row in enumerate(self.data):
            for index in range(self.blocks):
                if row[index] is None:
                    row[index] = final[index, layer]
        self._publish()

    def _publish(self) -> None:
        while self._sent_layers < len(self.data) and all(
            t is not None for t in self.data[self._sent_layers]
        ):
            self.ready.put(self._sent_layers)
            self._sent_layers += 1


def _offer(
    engine: ReferenceEngine,
    tokens: list[int],
    tenant: str,
    request_id: str,
    blocks: int,
    transport: str,
) -> TransferOffer:
    assert isinstance(engine.fingerprint, ModelFingerprint)
    keys = engine.call(lambda: engine.block_keys(tokens, tenant)).result()[:blocks]
    size = engine.pool.config.block_size
    return TransferOffer(
        version=PROTOCOL_VERSION,
        model_digest=engine.fingerprint.model_digest(),
        layout=WireLayout.of(pool_layout(engine.pool.config)),
        request_id=request_id,
        tenant=tenant,
        blocks=tuple(BlockEntry(i, size, bytes(key)) for i, key in enumerate(keys)),
        operations=(Operation.WRITE,),
        transports=(Transport(transport),),
    )


def prefill_and_send(
    engine: ReferenceEngine,
    tokens: list[int],
    tenant: str,
    request_id: str,
    target: Address,
    *,
    tenant_secret: bytes = b"",
    layer_delay_s: float = 0.0,
    timeout_s: float = 60.0,
    transport: str = "tcp",
) -> SendOutcome:
    """Prefill ``tokens`` here and stream their KV to ``target`` (module docstring).
    ``layer_delay_s``: a pause before each layer is sent (tests: a transfer slow enough to
    kill its sender mid-way)."""
    start = time.monotonic()
    if not isinstance(engine.fingerprint, ModelFingerprint):
        return SendOutcome("refused", reason="reuse_disabled")
    try:
        conn = make_transport(transport).connect(target, timeout_s=_CONNECT_TIMEOUT_S)
    except TransportError as exc:
        # The caller named the target: it learns only that no transfer listener answered
        # there, not whether a port is closed or held by something else (logged here).
        logger.info("transfer %s: %s", request_id, exc)
        return SendOutcome("unreachable", reason=UNREACHABLE)
    try:
        return _run(
            engine, conn, tokens, tenant, request_id, tenant_secret, layer_delay_s, timeout_s,
            start, transport,
        )  # fmt: skip
    finally:
        conn.close()


def _run(
    engine: ReferenceEngine,
    conn: Connection,
    tokens: list[int],
    tenant: str,
    request_id: str,
    secret: bytes,
    layer_delay_s: float,
    timeout_s: float,
    start: float,
    transport: str,
) -> SendOutcome:
    size = engine.pool.config.block_size
    blocks = len(tokens) // size
    offer = _offer(engine, tokens, tenant, request_id, blocks, transport)
    mac = intro_mac(secret, request_id, tenant, tokens)
    try:
        intro = TransferIntro(PROTOCOL_VERSION, request_id, tuple(tokens), tenant, mac)
        conn.send_frame(encode_intro(intro), timeout_s=_CONNECT_TIMEOUT_S)
        conn.send_frame(encode(offer), timeout_s=_CONNECT_TIMEOUT_S)
        raw = conn.recv_frame(timeout_s=_CONNECT_TIMEOUT_S)
        answer = decode_answer(bytes(raw), max_bytes=MAX_MESSAGE_BYTES)
        checked = check_answer(offer, answer)
    except HandshakeError as error:
        return SendOutcome("refused", reason=error.reason.value)
    except TransportError as exc:
        return SendOutcome("failed", reason=f"handshake: {exc}"[:200])
    if isinstance(checked, Refuse):
        return SendOutcome("refused", reason=checked.reason.value)
    config = engine.pool.config
    layer_bytes = 2 * config.num_kv_heads * size * config.head_dim * config.dtype.itemsize
    sender = TransferSender(
        conn,
        request_id,
        blocks=blocks,
        layers=config.num_layers,
        layer_bytes=layer_bytes,
        timeout_s=timeout_s,
    )
    exported = export_prefix(engine, tokens, tenant).blocks
    feed = _LayerFeed(engine, blocks)
    feed.preload(exported)
    handle: PrefillHandle | None = None
    worker = _SendThread(sender, feed, layer_delay_s)
    try:

        def submit() -> PrefillHandle:
            # On the step thread, so no step admits the request before the feed knows it.
            submitted = engine.prefill(tokens, tenant=tenant, on_layer=feed, request_id=request_id)
            feed.handle = submitted
            return submitted

        handle = engine.call(submit).result()
        worker.start()
        result = handle.result()
        prefill_done = time.monotonic()
        final = _pool_blocks(engine, result.block_ids[:blocks])
        feed.fill_missing(final)
        feed.ready.put(_DONE)
        worker.join()
        if worker.error is not None:
            return SendOutcome("failed", reason=str(worker.error)[:200])
        if not _same(worker.sent, final):
            sender.cancel()
            return SendOutcome("inconsistent", blocks, worker.payload_bytes)
        sender.finish()
    except (KvstrataError, TransportError) as exc:
        return SendOutcome("failed", reason=str(exc)[:200])
    finally:
        if worker.is_alive():
            worker.stop()
        if handle is not None:
            handle.release()
    seconds = time.monotonic() - start
    return SendOutcome(
        "sent",
        blocks,
        worker.payload_bytes,
        seconds,
        worker.overlap(prefill_done),
        compute_s=result.compute_s,
        matched_tokens=result.matched_tokens,
    )


def _pool_blocks(engine: ReferenceEngine, block_ids: tuple[int, ...]) -> torch.Tensor:
    """``[n, L, 2, H, B, D]`` copies of pinned blocks, read on the step thread."""
    pool = engine.pool

    def run() -> torch.Tensor:
        index = torch.tensor(block_ids, dtype=torch.long, device=pool.kv.device)
        with torch.inference_mode():
            picked = pool.kv.index_select(3, index)
            return picked.permute(3, 0, 1, 2, 4, 5).contiguous().to("cpu")

    return engine.call(run).result()


def _same(sent: dict[int, list[torch.Tensor]], final: torch.Tensor) -> bool:
    """Whether every layer was shipped and every shipped block equals the pool's final one."""
    layers, blocks = int(final.shape[1]), int(final.shape[0])
    if sorted(sent) != list(range(layers)):
        return False
    return all(
        len(row) == blocks and all(torch.equal(row[i], final[i, layer]) for i in range(blocks))
        for layer, row in sent.items()
    )


class _SendThread(threading.Thread):
    """Takes ready layers from the feed and sends them; records its busy intervals."""

    def __init__(self, sender: TransferSender, feed: _LayerFeed, delay_s: float) -> None:
        super().__init__(name="kv-transfer-send", daemon=True)
        self.sender, self.feed, self.delay_s = sender, feed, delay_s
        self.error: BaseException | None = None
        self.payload_bytes = 0
        self.sent: dict[int, list[torch.Tensor]] = {}  # layer → the tensors shipped for it
        self.busy: list[tuple[float, float]] = []
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()
        self.feed.ready.put(_DONE)
        self.join(timeout=5)

    def run(self) -> None:
        try:
            while not self._stopped.is_set():
                layer = self.feed.ready.get()
                if layer == _DONE:
                    return
                if self.delay_s > 0 and self._stopped.wait(self.delay_s):
                    return
                began = time.monotonic()
                row = list(self.feed.data[layer])  # these tensors, whatever the feed does next
                views = []
                for tensor in row:
                    assert tensor is not None
                    views.append(tensor.contiguous().view(torch.uint8).reshape(-1).numpy().data)
                self.sent[layer] = [t for t in row if t is not None]
                self.sender.send_layer(layer, views)
                self.payload_bytes += sum(v.nbytes for v in views)
                self.busy.append((began, time.monotonic()))
        except (KvstrataError, TransportError) as exc:
            self.error = exc

    def overlap(self, prefill_done: float) -> float:
        total = sum(end - begin for begin, end in self.busy)
        if total <= 0:
            return 0.0
        hidden = sum(max(0.0, min(end, prefill_done) - begin) for begin, end in self.busy)
        return hidden / total
