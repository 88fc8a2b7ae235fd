"""The vLLM connector's producer/consumer roles, pure parts (``connectors/vllm_pd.py``): the
offer in ``kv_transfer_params``, hostile params, the consumer's gate and the producer's offer
built from the planner's saved keys."""

from __future__ import annotations

import base64
import contextlib
import json
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.connectors.vllm_identity import (
    KV_LAYOUT,
    VllmModelView,
    tenant_for_salt,
    vllm_attention_impl,
    vllm_fingerprint,
)
from kvstrata.connectors.vllm_pd import (
    MAX_OFFER_BYTES,
    PARAMS_KEY,
    ConsumerGate,
    Gate,
    Role,
    RoleSide,
    build_offer,
    decode_params,
    encode_params,
    wants_offer,
)
from kvstrata.connectors.vllm_plan import ScheduledRequest, SchedulerPlanner
from kvstrata.identity import ModelFacts, ModelFingerprint
from kvstrata.transfer.handshake import HandshakeError, encode
from kvstrata.transfer.layout import KVLayout, RefuseReason

BS = 4
LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS, dtype="bfloat16", order="LHTKD"
)
DIGEST = bytes(range(32))
BIGGER_BLOCKS = replace(LAYOUT, block_size=2 * BS)


def _fingerprint() -> ModelFingerprint:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "rope_theta": 10000.0,
        "vocab_size": 100,
    }
    facts = ModelFacts(
        architecture="LlamaForCausalLM",
        config=config,
        checkpoint_digest="c" * 64,
        tokenizer_digest="t" * 64,
        special_tokens={"<s>": 1},
        chat_template=None,
        attention_impl=vllm_attention_impl("0.32.0", "cpu"),
        kv_dtype="bfloat16",
        block_size=BS,
        kv_layout=KV_LAYOUT,
    )
    built = vllm_fingerprint(VllmModelView(facts, device="cpu"))
    assert isinstance(built, ModelFingerprint)
    return built


def _offer(keys: list[bytes], **changes: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "model_digest": DIGEST,
        "layout": LAYOUT,
        "request_id": "r1",
        "tenant": "default",
        "keys": keys,
    }
    fields.update(changes)
    return encode_params(build_offer(**fields))


def test_params_round_trip_and_are_json() -> None:
    keys = [bytes([i]) * 32 for i in range(3)]
    params = _offer(keys)
    assert set(params) == {PARAMS_KEY}
    offer = decode_params(json.loads(json.dumps(params)))
    assert offer is not None
    assert [b.key for b in offer.blocks] == keys and offer.tenant == "default"
    assert offer.layout.layout() == LAYOUT and offer.model_digest == DIGEST
    assert decode_params(None) is None and decode_params({"do_remote_decode": True}) is None
    assert wants_offer({"do_remote_decode": True}) and wants_offer({"kvstrata_produce": True})
    assert not wants_offer({"do_remote_decode": "yes"}) and not wants_offer(None)
    assert Role.of("kv_consumer") is Role.CONSUMER and Role.of(None) is Role.BOTH


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (17, RefuseReason.MALFORMED),
        ("not base64!", RefuseReason.MALFORMED),
        ("é" * 8, RefuseReason.MALFORMED),
        (base64.b64encode(b"\x93garbage").decode(), RefuseReason.MALFORMED),
        ("A" * (MAX_OFFER_BYTES * 2), RefuseReason.TOO_LARGE),
    ],
)
def test_hostile_params_are_one_clear_error(value: object, reason: RefuseReason) -> None:
    with pytest.raises(HandshakeError) as caught:
        decode_params({PARAMS_KEY: value})
    assert caught.value.reason is reason


def test_truncated_and_newer_offers_are_refused() -> None:
    offer = build_offer(
        model_digest=DIGEST, layout=LAYOUT, request_id="r", tenant="t", keys=[b"k" * 32]
    )
    raw = encode(offer)
    with pytest.raises(HandshakeError):
        decode_params({PARAMS_KEY: base64.b64encode(raw[: len(raw) // 2]).decode()})
    newer = encode(msgspec.structs.replace(offer, version=99))
    with pytest.raises(HandshakeError) as caught:
        decode_params({PARAMS_KEY: base64.b64encode(newer).decode()})
    assert caught.value.reason is RefuseReason.VERSION_UNSUPPORTED


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200).map(base64.b64encode)))
def test_any_params_decode_or_fail_with_a_handshake_error(value: str | bytes) -> None:
    text = value.decode() if isinstance(value, bytes) else value
    with contextlib.suppress(HandshakeError):
        decode_params({PARAMS_KEY: text})


def _no_hits(tenant: str, keys: object, presence: bool = False, req_id: object = None) -> int:
    return 0


@dataclass
class _Store:
    """A store that holds ``held`` blocks, none of them worth loading (below the break-even):
    only a presence probe sees them."""

    held: int = 0
    calls: int = 0

    def __call__(
        self, tenant: str, keys: object, presence: bool = False, req_id: object = None
    ) -> int:
        self.calls += 1
        return self.held if presence else 0


def _gate(store: _Store) -> ConsumerGate:
    return ConsumerGate(DIGEST, LAYOUT, store, wait_s=1.0, poll_s=0.1)


KEYS = [bytes([i]) * 32 for i in range(4)]


def _admit(gate: ConsumerGate, params: object, now: float, *, tenant: str = "default") -> Gate:
    return gate.admit(
        "r1", params, tenant=tenant, keys_of=lambda n: KEYS[:n], usable_blocks=3, now=now
    )


def test_consumer_waits_for_the_offered_blocks_then_takes_the_ordinary_path() -> None:
    store = _Store()
    gate = _gate(store)
    params = _offer(KEYS)  # 4 offered; 3 usable (the last prompt token is never loaded)
    assert _admit(gate, params, 0.0) is Gate.WAIT
    assert _admit(gate, params, 0.05) is Gate.WAIT and store.calls == 1  # polls are paced
    store.held = 3
    assert _admit(gate, params, 0.2) is Gate.READY
    assert _admit(gate, params, 5.0) is Gate.READY  # decided: no more polls
    assert store.calls == 2
    assert gate.take_counts() == {"pd_offers_accepted": 1}
    assert _admit(gate, None, 0.0) is Gate.READY  # same request id: already decided
    gate.forget("r1")
    assert _admit(gate, None, 0.0) is Gate.NONE


def test_a_wait_that_runs_out_is_counted_and_goes_on_with_what_is_there() -> None:
    store = _Store(held=1)
    gate = _gate(store)
    params = _offer(KEYS)
    assert _admit(gate, params, 0.0) is Gate.WAIT
    assert _admit(gate, params, 0.5) is Gate.WAIT
    assert _admit(gate, params, 1.5) is Gate.READY
    assert gate.take_counts() == {"pd_offers_accepted": 1, "pd_wait_timeouts": 1}


@pytest.mark.parametrize(
    ("params", "tenant", "reason"),
    [
        (_offer(KEYS, model_digest=bytes(32)), "default", "model_mismatch"),
        (_offer(KEYS, layout=BIGGER_BLOCKS), "default", "conversion_unavailable"),
        (_offer(KEYS, layout=replace(LAYOUT, num_layers=3)), "default", "shape_mismatch"),
        (_offer(KEYS), "tenant-b", "tenant_forbidden"),
        (_offer([b"\xff" * 32, *KEYS[1:]]), "default", "key_mismatch"),
        ({PARAMS_KEY: "!!"}, "default", "malformed"),
    ],
)  # fmt: skip
def test_refused_offers_mean_local_prefill_counted_by_reason(
    params: dict[str, Any], tenant: str, reason: str
) -> None:
    store = _Store(held=4)
    gate = _gate(store)
    assert _admit(gate, params, 0.0, tenant=tenant) is Gate.LOCAL
    assert _admit(gate, params, 0.0, tenant=tenant) is Gate.LOCAL
    assert gate.take_counts() == {"pd_refused": 1, f"pd_refused:{reason}": 1}
    assert store.calls == 0  # a refused offer never reads the store


def test_a_consumer_without_a_model_identity_refuses_every_offer() -> None:
    gate = ConsumerGate(None, None, _Store(held=4))
    assert _admit(gate, _offer(KEYS), 0.0) is Gate.LOCAL
    assert gate.take_counts()["pd_refused:reuse_disabled"] == 1


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    cache_salt: str | None = None


def test_the_producers_offer_is_what_the_consumer_computes_for_the_same_prompt() -> None:
    fingerprint = _fingerprint()
    tokens = list(range(1, 3 * BS + 2))  # 3 full blocks + 1 token
    producer_planner = SchedulerPlanner(
        fingerprint, BS, lambda t, k, p=False, r=None: 0, tenant_of=tenant_for_salt
    )
    producer = RoleSide(
        Role.PRODUCER,
        producer_planner,
        lambda t, k, p=False, r=None: 0,
        (DIGEST, LAYOUT),
        wait_s=1,
        clock=float,
    )
    asked = _Request("p1", tokens, {"do_remote_decode": True})
    assert producer_planner.matched_tokens("p1", tokens, None, 0) == 0
    producer_planner.after_alloc("p1", [0, 1, 2, 3], 0)
    step = [ScheduledRequest("p1", [0, 1, 2, 3], True, 0, len(tokens))]
    (save,) = producer_planner.build(step).saves
    assert len(save.blocks) == 3
    assert producer.offer_params(_Request("p1", tokens, None)) is None  # not asked: no offer
    params = producer.offer_params(asked)
    assert params is not None and producer.take_counts() == {"pd_offers_sent": 1}
    offer = decode_params(params)
    assert offer is not None and [b.key for b in offer.blocks] == [b.key for b in save.blocks]

    held = {"n": 0}
    consumer_planner = SchedulerPlanner(
        fingerprint, BS, lambda t, k, p=False, r=None: held["n"], tenant_of=tenant_for_salt
    )
    now = {"t": 0.0}
    consumer = RoleSide(
        Role.CONSUMER,
        consumer_planner,
        lambda t, k, p=False, r=None: held["n"],
        (DIGEST, LAYOUT),
        wait_s=10,
        clock=lambda: now["t"],
    )
    request = _Request("c1", tokens, params)
    assert consumer.admit(request) is Gate.WAIT
    held["n"] = 3
    now["t"] = 1.0
    assert consumer.admit(request) is Gate.READY
    assert consumer_planner.matched_tokens("c1", tokens, None, 0) == 3 * BS
    # Another tenant's request carrying this offer is refused: its keys are other keys.
    other = _Request("c2", tokens, params, cache_salt="tenant-b")
    assert consumer.admit(other) is Gate.LOCAL
    assert consumer.take_counts()["pd_refused:tenant_forbidden"] == 1
