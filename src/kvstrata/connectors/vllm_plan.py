"""The scheduler side's bookkeeping: which vLLM blocks to load from kvstrata and which to store.

Pure state machine (no vLLM import, no I/O): the connector feeds it what vLLM's scheduler says
and ships the ``StepPlan`` it returns to the worker inside the connector metadata (so the plan
must pickle: it holds only ints, bytes, strings and tuples).

Per request it keeps the kvstrata key chain (rooted in the model fingerprint and the tenant of
the request's ``cache_salt``), the request's vLLM block ids and how many full blocks were
already planned for storing.

- ``matched_tokens``: the longest run of full prompt blocks beyond vLLM's own (block-aligned)
  hit that kvstrata holds, never the last prompt token (vLLM must compute one). Asks ``lookup``
  (the worker's store) and remembers the answer for ``after_alloc``.
- ``after_alloc``: vLLM accepted ``num_external`` tokens: the blocks to fill are the request's
  blocks right after its local hit; they are loaded in the next step's plan.
- ``build``: for every request scheduled this step, the full blocks whose KV exists once the
  step's forward has run and that were not planned before are stored (the worker skips keys
  kvstrata already holds, and blocks whose load failed); when vLLM rewinds a request (a failed
  load), the blocks it recomputes are planned again.
- **Fences** (as vLLM's ``OffloadingConnector`` does): the worker's saver reads vLLM's blocks
  after the step, so a finished request's blocks may still be read when vLLM frees them.
  ``finished`` frees them at once (no ``delay_free_blocks``: held blocks would cut how many
  requests vLLM runs at once) and fences the blocks it planned to store, with the number of
  the last plan that stored any of them. A fenced block that vLLM hands out again — a fresh
  block of a scheduled request, beyond its local prefix hit, whose KV this step writes — puts
  its request into the plan's ``flush``: the worker finishes that request's saves before the
  forward (``handle_preemptions``). ``saves_done(seq)`` (every save of plans up to ``seq`` has
  run: the worker's report) lifts fences.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstrata.identity import (
    BlockKey,
    ModelFingerprint,
    NamespaceRoot,
    ReuseDisabled,
    TenantNamespace,
    chain_keys,
    namespace_root,
)


class Lookup(Protocol):
    """(tenant, keys) → how many leading keys kvstrata can serve now (worth loading);
    ``presence``: how many it holds at all; ``req_id``: the vLLM request (a canary's share)."""

    def __call__(
        self,
        tenant: str,
        keys: Sequence[BlockKey],
        presence: bool = False,
        req_id: str | None = None,
    ) -> int: ...


@dataclass(frozen=True)
class RequestLoad:
    req_id: str
    tenant: str
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class BlockSave:
    block_id: int
    key: bytes
    parent: bytes | None
    position: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class RequestSave:
    req_id: str
    tenant: str
    blocks: tuple[BlockSave, ...]


@dataclass
class StepPlan:
    seq: int = 0
    """Plans are numbered 1, 2, … in the order they are built (``saves_done``)."""
    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[RequestSave] = field(default_factory=list)
    preempted: tuple[str, ...] = ()
    flush: tuple[str, ...] = ()
    """Finished requests whose saves must be done before this step's forward (a block they
    read was handed out again)."""
    pd_counts: dict[str, int] = field(default_factory=dict)
    """The scheduler side's producer/consumer counters since the last plan (``vllm_pd``): the
    worker side adds them to its stats (the plan is how they cross processes)."""


@dataclass(frozen=True)
class ScheduledRequest:
    """One request of a scheduler step, as vLLM describes it.

    ``block_ids``: the request's whole block list (``replace``) or blocks appended this step.
    ``computed``: tokens with KV before this step; ``scheduled``: tokens computed this step.
    """

    req_id: str
    block_ids: Sequence[int]
    replace: bool
    computed: int
    scheduled: int


@dataclass
class _Tracked:
    tenant: TenantNamespace
    root: NamespaceRoot
    token_ids: Sequence[int]
    enabled: bool
    keys: list[BlockKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    planned_saves: int = 0
    local_blocks: int = 0
    found_blocks: int = 0
    last_save_seq: int = 0  # the last plan that stored any of its blocks (0: none)
    saved_block_ids: set[int] = field(default_factory=set)  # planned saves read these


class SchedulerPlanner:
    def __init__(
        self,
        fingerprint: ModelFingerprint | ReuseDisabled,
        block_size: int,
        lookup: Lookup,
        *,
        tenant_of: Callable[[str | None], TenantNamespace],
    ) -> None:
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.lookup = lookup
        self.tenant_of = tenant_of
        self._digest = fingerprint.digest() if isinstance(fingerprint, ModelFingerprint) else None
        self._requests: dict[str, _Tracked] = {}
        self._loads: list[RequestLoad] = []
        self._seq = 0
        self._fences: dict[str, tuple[int, tuple[int, ...]]] = {}  # req → (seq, block ids)
        self._fenced: dict[int, set[str]] = {}  # block id → finished requests that may read it
        self._flush: set[str] = set()
        self.matched_tokens_total = 0

    @property
    def enabled(self) -> bool:
        return self._digest is not None

    def _keys(self, state: _Tracked, blocks: int) -> list[BlockKey]:
        """The first ``blocks`` keys of the request's chain (extended on demand)."""
        have = len(state.keys)
        if have < blocks:
            parent: NamespaceRoot | BlockKey = state.keys[-1] if state.keys else state.root
            size = self.block_size
            tokens = list(state.token_ids[have * size : blocks * size])
            state.keys.extend(chain_keys(parent, tokens, size))
        return state.keys[:blocks]

    # ---- get_num_new_matched_tokens / update_state_after_alloc -------------------------------
    def matched_tokens(
        self,
        req_id: str,
        token_ids: Sequence[int],
        cache_salt: str | None,
        num_computed: int,
        *,
        eligible: bool = True,
    ) -> int:
        """Tokens kvstrata can add beyond ``num_computed`` (vLLM's block-aligned local hit)."""
        state = self._requests.get(req_id)
        if state is not None:
            state.token_ids = token_ids  # same request (retried or resumed): same prefix
        else:
            tenant = self.tenant_of(cache_salt)
            root = (
                namespace_root(self._digest, tenant)
                if self._digest is not None
                else NamespaceRoot(bytes(32))
            )
            enabled = self._digest is not None and eligible
            state = _Tracked(tenant, root, token_ids, enabled)
            self._requests[req_id] = state
        state.local_blocks = num_computed // self.block_size
        state.found_blocks = 0
        if not state.enabled:
            return 0
        limit = max(len(token_ids) - 1, 0) // self.block_size
        if limit <= state.local_blocks:
            return 0
        keys = self._keys(state, limit)
        found = self.lookup(state.tenant.name, keys[state.local_blocks :], False, req_id)
        state.found_blocks = max(0, min(found, limit - state.local_blocks))
        return (state.local_blocks + state.found_blocks) * self.block_size - num_computed

    def after_alloc(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        state = self._requests.get(req_id)
        if state is None:
            self._reused(block_ids)
            return
        state.block_ids = list(block_ids)
        self._reused(state.block_ids[state.local_blocks :])
        blocks = num_external // self.block_size
        if blocks <= 0 or not state.enabled:
            return
        blocks = min(blocks, state.found_blocks)
        first = state.local_blocks
        targets = state.block_ids[first : first + blocks]
        keys = self._keys(state, first + len(targets))[first:]
        self._loads.append(
            RequestLoad(req_id, state.tenant.name, tuple(targets), tuple(bytes(k) for k in keys))
        )
        self.matched_tokens_total += len(targets) * self.block_size

    # ---- build_connector_meta ---------------------------------------------------------------
    def build(self, scheduled: Iterable[ScheduledRequest]) -> StepPlan:
        self._seq += 1
        plan = StepPlan(seq=self._seq, loads=self._loads)
        self._loads = []
        size = self.block_size
        for item in scheduled:
            state = self._requests.get(item.req_id)
            if state is None:
                self._reused(item.block_ids)
                continue
            if item.replace:
                state.block_ids = list(item.block_ids)
                self._reused(state.block_ids[state.local_blocks :])
            else:
                state.block_ids.extend(item.block_ids)
                self._reused(item.block_ids)
            if not state.enabled:
                continue
            # vLLM rewinds a request whose load failed: blocks from there on are recomputed
            # now, so they are planned for storing again (the worker skips held keys).
            state.planned_saves = min(state.planned_saves, item.computed // size)
            full = min(item.computed + item.scheduled, len(state.token_ids)) // size
            full = min(full, len(state.block_ids))
            if full <= state.planned_saves:
                continue
            keys = self._keys(state, full)
            blocks = []
            for index in range(state.planned_saves, full):
                parent = bytes(keys[index - 1]) if index > 0 else None
                tokens = tuple(int(t) for t in state.token_ids[index * size : (index + 1) * size])
                blocks.append(
                    BlockSave(
                        state.block_ids[index], bytes(keys[index]), parent, index * size, tokens
                    )
                )
            state.planned_saves = full
            state.saved_block_ids.update(block.block_id for block in blocks)
            state.last_save_seq = plan.seq
            plan.saves.append(RequestSave(item.req_id, state.tenant.name, tuple(blocks)))
        if self._flush:
            plan.flush = tuple(sorted(self._flush))
            self._flush.clear()
        return plan

    # ---- fences -----------------------------------------------------------------------------
    def _reused(self, block_ids: Iterable[int]) -> None:
        """These blocks are written from this step on: fenced readers must be done first."""
        if not self._fenced:
            return
        for block_id in block_ids:
            readers = self._fenced.get(block_id)
            if readers:
                for req_id in list(readers):
                    self._lift(req_id)
                    self._flush.add(req_id)

    def _lift(self, req_id: str) -> None:
        _, block_ids = self._fences.pop(req_id, (0, ()))
        for block_id in block_ids:
            readers = self._fenced.get(block_id)
            if readers is not None:
                readers.discard(req_id)
                if not readers:
                    del self._fenced[block_id]

    def saves_done(self, seq: int) -> None:
        """The worker ran every save of the plans up to ``seq``: their fences go."""
        for req_id in [r for r, (fenced_at, _) in self._fences.items() if fenced_at <= seq]:
            self._lift(req_id)

    @property
    def fenced_requests(self) -> int:
        return len(self._fences)

    def request_keys(
        self, token_ids: Sequence[int], cache_salt: str | None, blocks: int
    ) -> tuple[str, list[bytes]]:
        """The tenant and first ``blocks`` keys a request with these tokens and salt gets here
        (a consumer compares them with a producer's offer); no keys when reuse is disabled."""
        tenant = self.tenant_of(cache_salt)
        if self._digest is None:
            return tenant.name, []
        root = namespace_root(self._digest, tenant)
        tokens = list(token_ids[: blocks * self.block_size])
        return tenant.name, [bytes(k) for k in chain_keys(root, tokens, self.block_size)]

    def saved_keys(self, req_id: str) -> tuple[str, list[bytes]] | None:
        """The tenant and keys of the blocks planned for storing so far (a producer's offer)."""
        state = self._requests.get(req_id)
        if state is None or not state.enabled:
            return None
        keys = self._keys(state, state.planned_saves)
        return state.tenant.name, [bytes(k) for k in keys]

    def finished(self, req_id: str) -> None:
        """Forget the request; vLLM frees its blocks now: those it planned to store are fenced
        until the worker reports their saves done."""
        state = self._requests.pop(req_id, None)
        if state is None or not state.saved_block_ids:
            return
        seq, earlier = self._fences.get(req_id, (0, ()))  # an id vLLM used twice: both hold
        fenced = tuple(sorted(state.saved_block_ids.union(earlier)))
        self._fences[req_id] = (max(seq, state.last_save_seq), fenced)
        for block_id in fenced:
            self._fenced.setdefault(block_id, set()).add(req_id)

    def preempted(self, req_id: str) -> None:
        """Its blocks are gone (the worker finishes their saves before the step's forward:
        nothing to fence); resumption re-matches and gets a new block list. Call it before
        ``build`` of the same step: vLLM may resume a request in the step that preempts it."""
        state = self._requests.get(req_id)
        if state is not None:
            state.block_ids = []
            state.saved_block_ids.clear()
