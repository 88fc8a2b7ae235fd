"""Producer/consumer roles of the vLLM connector: P/D disaggregation over a shared tier.

Pure (no vLLM import, no I/O of its own: lookups are passed in, time too). The connector calls
it on the scheduler side.

- **Producer** (``kv_role="kv_producer"``): a request whose ``kv_transfer_params`` ask for it
  (``{"do_remote_decode": true}``, NIXL's marker, or ``{"kvstrata_produce": true}``) is
  prefilled as usual; the connector saves every full block through kvstrata (the shared tier:
  a remote Valkey tier, or one disk directory on one host) and ``request_finished`` returns
  ``{"kvstrata_offer": <base64 msgpack TransferOffer>}`` (``encode_params``): protocol version,
  the model digest (``ModelFingerprint.model_digest``), the producer's ``KVLayout``, the
  request id, the tenant, one ``BlockEntry(index, block_size, key)`` per saved block (the
  producer's chained content keys), transport ``shared_tier``, operation ``read``. The keys
  are what names the objects: the consumer recomputes its own and reads only those.
- **Consumer** (``kv_role="kv_consumer"``): ``ConsumerGate.admit`` decodes the offer
  (``decode_params``: bounded, any bad input is one ``HandshakeError``), answers it with the
  handshake's ``negotiate`` against the consumer's own model digest, layout and the request's
  tenant, then compares the offered keys with its own for the same tokens (``key_mismatch``:
  another fingerprint, e.g. another vLLM build). A refusal means local prefill for this request
  (no kvstrata lookup at all), counted by reason. Accepted: it polls (``poll_s``) until the
  store holds every offered block the consumer can use, at most ``wait_s``; vLLM is told "ask
  again" meanwhile (``get_num_new_matched_tokens`` → ``None``: the scheduler skips the request,
  other requests run). Then, or after the wait ran out (counted), the normal matched-tokens
  path loads what is there through the verified load path; what is missing is recomputed.
- ``kv_both`` (and a request without an offer) keeps the connector's ordinary behaviour.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Final

from kvstrata.connectors.vllm_plan import Lookup, SchedulerPlanner
from kvstrata.identity import BlockKey
from kvstrata.transfer.handshake import (
    PROTOCOL_VERSION,
    AcceptWithConversion,
    BlockEntry,
    HandshakeError,
    Operation,
    ReceiverCapabilities,
    Refuse,
    TransferOffer,
    Transport,
    WireLayout,
    decode_offer,
    encode,
    negotiate,
)
from kvstrata.transfer.layout import KVLayout, RefuseReason

PARAMS_KEY: Final = "kvstrata_offer"
REQUEST_FLAGS: Final = ("do_remote_decode", "kvstrata_produce")
MAX_OFFER_BYTES: Final = 1 << 20
"""An offer of 2048 blocks is about 80 KiB; more than this is refused before decoding."""

"""(tenant, keys) → how many leading keys the store can serve now."""


class Role(Enum):
    BOTH = "kv_both"
    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"

    @classmethod
    def of(cls, kv_role: object) -> Role:
        text = str(getattr(kv_role, "value", kv_role) or "kv_both")
        try:
            return cls(text)
        except ValueError:
            return cls.BOTH


def wants_offer(params: object) -> bool:
    """Did the request ask the producer for an offer?"""
    return isinstance(params, Mapping) and any(params.get(k) is True for k in REQUEST_FLAGS)


def build_offer(
    *,
    model_digest: bytes,
    layout: KVLayout,
    request_id: str,
    tenant: str,
    keys: Sequence[bytes],
) -> TransferOffer:
    return TransferOffer(
        version=PROTOCOL_VERSION,
        model_digest=bytes(model_digest),
        layout=WireLayout.of(layout),
        request_id=request_id[:256],
        tenant=tenant,
        blocks=tuple(BlockEntry(i, layout.block_size, bytes(k)) for i, k in enumerate(keys)),
        operations=(Operation.READ,),
        transports=(Transport.SHARED_TIER,),
    )


def encode_params(offer: TransferOffer) -> dict[str, Any]:
    """``kv_transfer_params`` are JSON (they go through the OpenAI server): base64 text."""
    return {PARAMS_KEY: base64.b64encode(encode(offer)).decode("ascii")}


def decode_params(params: object) -> TransferOffer | None:
    """The offer in a request's ``kv_transfer_params``; None when there is none.

    Raises:
        HandshakeError: the offer is there but is not one (wrong type, too long, not base64,
            not a valid offer of this protocol).
    """
    if not isinstance(params, Mapping) or PARAMS_KEY not in params:
        return None
    text = params[PARAMS_KEY]
    if not isinstance(text, str):
        raise HandshakeError(RefuseReason.MALFORMED, f"{PARAMS_KEY} is {type(text).__name__}")
    if len(text) > (MAX_OFFER_BYTES + 2) // 3 * 4:
        raise HandshakeError(RefuseReason.TOO_LARGE, f"{len(text)} characters")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
        raise HandshakeError(RefuseReason.MALFORMED, f"not base64: {exc}") from exc
    return decode_offer(raw, max_bytes=MAX_OFFER_BYTES)


class Gate(Enum):
    NONE = "none"  # no offer: the ordinary path
    WAIT = "wait"  # accepted, the producer's blocks are not all there yet: ask again
    READY = "ready"  # accepted (blocks there, or the wait ran out): the ordinary path
    LOCAL = "local"  # refused: local prefill, no kvstrata lookup


KEY_MISMATCH: Final = "key_mismatch"
CONVERSION_UNAVAILABLE: Final = "conversion_unavailable"
REUSE_DISABLED: Final = "reuse_disabled"


@dataclass
class _Waiting:
    tenant: str
    keys: list[BlockKey]
    deadline: float
    next_poll: float


@dataclass
class ConsumerGate:
    model_digest: bytes | None  # None: this side cannot identify its model (reuse disabled)
    layout: KVLayout | None
    lookup: Lookup
    wait_s: float = 30.0
    poll_s: float = 0.02
    counts: dict[str, int] = field(default_factory=dict)
    _waiting: dict[str, _Waiting] = field(default_factory=dict)
    _decided: dict[str, Gate] = field(default_factory=dict)

    def _count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def take_counts(self) -> dict[str, int]:
        counts, self.counts = self.counts, {}
        return counts

    def _refuse(self, req_id: str, reason: str) -> Gate:
        self._count("pd_refused")
        self._count(f"pd_refused:{reason}")
        self._decided[req_id] = Gate.LOCAL
        return Gate.LOCAL

    def admit(
        self,
        req_id: str,
        params: object,
        *,
        tenant: str,
        keys_of: Callable[[int], Sequence[bytes]],
        usable_blocks: int,
        now: float,
    ) -> Gate:
        """What to do with a request now. ``keys_of(n)``: this side's first ``n`` keys of the
        request; ``usable_blocks``: full prompt blocks it may load (never the last token)."""
        decided = self._decided.get(req_id)
        if decided is not None:
            return decided
        waiting = self._waiting.get(req_id)
        if waiting is None:
            try:
                offer = decode_params(params)
            except HandshakeError as error:
                return self._refuse(req_id, error.reason.value)
            if offer is None:
                return Gate.NONE
            gate = self._check(req_id, offer, tenant, keys_of, usable_blocks, now)
            if gate is not Gate.WAIT:
                return gate
            waiting = self._waiting[req_id]
        if now < waiting.next_poll:
            return Gate.WAIT
        # Presence, not the break-even test: an offer below a tier's min_reusable_tokens, or
        # one a fetch would not beat, must not wait out pd_wait_ms for blocks already here.
        if self.lookup(waiting.tenant, waiting.keys, True, req_id) >= len(waiting.keys):
            return self._ready(req_id)
        if now >= waiting.deadline:
            self._count("pd_wait_timeouts")
            return self._ready(req_id)
        waiting.next_poll = now + self.poll_s
        return Gate.WAIT

    def _ready(self, req_id: str) -> Gate:
        self._waiting.pop(req_id, None)
        self._decided[req_id] = Gate.READY
        return Gate.READY

    def _check(
        self,
        req_id: str,
        offer: TransferOffer,
        tenant: str,
        keys_of: Callable[[int], Sequence[bytes]],
        usable_blocks: int,
        now: float,
    ) -> Gate:
        if self.model_digest is None or self.layout is None:
            return self._refuse(req_id, REUSE_DISABLED)
        receiver = ReceiverCapabilities(
            model_digest=self.model_digest,
            layout=self.layout,
            tenant_allowed={tenant},
            transports=(Transport.SHARED_TIER,),
            operations=(Operation.READ,),
        )
        answer = negotiate(offer, receiver)
        if isinstance(answer, Refuse):
            return self._refuse(req_id, answer.reason.value)
        if isinstance(answer, AcceptWithConversion):  # stored objects are not converted here
            return self._refuse(req_id, CONVERSION_UNAVAILABLE)
        blocks = min(len(offer.blocks), max(usable_blocks, 0))
        entries = offer.blocks[:blocks]
        if any(e.index != i or e.tokens != self.layout.block_size for i, e in enumerate(entries)):
            return self._refuse(req_id, RefuseReason.MALFORMED.value)
        own = [bytes(k) for k in keys_of(blocks)]
        if own != [e.key for e in entries]:
            return self._refuse(req_id, KEY_MISMATCH)
        self._count("pd_offers_accepted")
        if not own:
            return self._ready(req_id)
        keys = [BlockKey(k) for k in own]
        self._waiting[req_id] = _Waiting(tenant, keys, now + self.wait_s, now)
        return Gate.WAIT

    def forget(self, req_id: str) -> None:
        self._waiting.pop(req_id, None)
        self._decided.pop(req_id, None)


def vllm_kv_layout(vllm_config: Any, *, kv_dtype: str, order: str, codec_id: str) -> KVLayout:
    """The layout of the connector's stored blocks, from vLLM's config (attribute reads only)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    return KVLayout(
        num_layers=int(model.get_num_layers(parallel)),
        num_kv_heads=int(model.get_total_num_kv_heads()),
        head_dim=int(model.get_head_size()),
        block_size=int(vllm_config.cache_config.block_size),
        dtype=kv_dtype,
        order=order,
        codec_id=codec_id,
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
    )


class RoleSide:
    """The scheduler side's producer or consumer half, over the connector's planner (the
    connector delegates to it; ``kv_both`` has none). ``identity``: this side's model digest
    and layout, None when reuse is disabled (a producer then offers nothing, a consumer
    refuses every offer ``reuse_disabled``)."""

    def __init__(
        self,
        role: Role,
        planner: SchedulerPlanner,
        lookup: Lookup,
        identity: tuple[bytes, KVLayout] | None,
        *,
        wait_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.role = role
        self.planner = planner
        self.identity = identity
        self.clock = clock
        self.gate: ConsumerGate | None = None
        if role is Role.CONSUMER:
            digest, layout = identity if identity is not None else (None, None)
            self.gate = ConsumerGate(digest, layout, lookup, wait_s=wait_s)
        self._counts: dict[str, int] = {}

    def admit(self, request: Any) -> Gate:
        """kv_consumer: what to do with a request (``Gate.NONE`` without an offer)."""
        params = request.kv_transfer_params
        if self.gate is None or not isinstance(params, Mapping) or PARAMS_KEY not in params:
            return Gate.NONE
        planner = self.planner
        prompt = list(request.prompt_token_ids or [])
        salt = request.cache_salt
        return self.gate.admit(
            request.request_id,
            params,
            tenant=planner.tenant_of(salt).name,
            keys_of=lambda n: planner.request_keys(prompt, salt, n)[1],
            usable_blocks=max(len(prompt) - 1, 0) // planner.block_size,
            now=self.clock(),
        )

    def offer_params(self, request: Any) -> dict[str, Any] | None:
        """kv_producer, before the planner forgets the request: the offer of every block
        planned for storing, if the request asked for one."""
        if self.gate is not None:
            self.gate.forget(request.request_id)
        if self.role is not Role.PRODUCER or self.identity is None:
            return None
        if not wants_offer(request.kv_transfer_params):
            return None
        saved = self.planner.saved_keys(request.request_id)
        if saved is None:
            return None
        tenant, keys = saved
        digest, layout = self.identity
        offer = build_offer(
            model_digest=digest, layout=layout, request_id=request.request_id, tenant=tenant,
            keys=keys,
        )  # fmt: skip
        self._counts["pd_offers_sent"] = self._counts.get("pd_offers_sent", 0) + 1
        return encode_params(offer)

    def take_counts(self) -> dict[str, int]:
        counts, self._counts = self._counts, {}
        if self.gate is not None:
            for name, value in self.gate.take_counts().items():
                counts[name] = counts.get(name, 0) + value
        return counts
