"""KV layouts and the conversion plans between them (pure: no torch, no I/O).

A ``KVLayout`` says how one *block* of KV is laid out in bytes on one side of a transfer or in
one stored object: the model's shape (layers, total KV heads, head dim), the block size, the
axis order of the block payload, the element dtype and codec, and which tensor-parallel rank /
pipeline stage holds it. Axis letters:

    L  layers (of this pipeline stage)     K  the K/V pair (size 2)
    H  KV heads held by this TP rank       T  token slots of the block
    D  head dimension

The reference engine's order is ``LKHTD`` (``kv[L, 2, H, N, B, D]`` sliced at one block).

TP sharding of KV heads follows vLLM (and GQA): with ``H`` KV heads and TP size ``t``,
``t <= H`` needs ``H % t == 0`` and rank ``r`` holds heads ``[r·H/t, (r+1)·H/t)``;
``t > H`` needs ``t % H == 0`` and rank ``r`` holds head ``r // (t/H)`` (replicated).

``plan_conversion(source, target)`` returns either a ``ConversionPlan`` — the ordered steps
that turn a run of source blocks (all source TP ranks together) into the target's blocks for
one target rank — or a ``Refusal`` with a reason from the closed ``RefuseReason`` list.
Steps always run in one canonical order: reorder to ``LKHTD``, reshard heads, reblock, cast,
reorder to the target order. Reorder, reshard and reblock move values without touching them
(lossless); a dtype change is lossy (``bfloat16 → float32`` is exact on the values but does
not reproduce a fresh float32 prefill) and a lossy plan is never an exact hit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

CANONICAL_ORDER = "LKHTD"
"""The reference engine's block order; every plan passes through it."""

KNOWN_DTYPES = frozenset({"float32", "bfloat16", "float16"})
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class RefuseReason(Enum):
    """Why a receiver refuses a layout (closed list; values are stable wire strings)."""

    SHAPE_MISMATCH = "shape_mismatch"  # layers, total KV heads or head dim differ
    ORDER_UNKNOWN = "order_unknown"  # not a permutation of LKHTD
    DTYPE_UNSUPPORTED = "dtype_unsupported"
    CODEC_UNSUPPORTED = "codec_unsupported"  # codecs differ (only identity converts)
    HEADS_NOT_DIVISIBLE = "heads_not_divisible"  # a TP size does not shard the KV heads
    PIPELINE_MISMATCH = "pipeline_mismatch"  # PP size or stage differ
    INVALID_LAYOUT = "invalid_layout"  # non-positive sizes, rank out of range
    # The handshake's reasons (transfer/handshake.py): beyond the layout itself.
    MODEL_MISMATCH = "model_mismatch"  # model digests differ (another model, not a layout)
    VERSION_UNSUPPORTED = "version_unsupported"  # protocol version the receiver does not speak
    TENANT_FORBIDDEN = "tenant_forbidden"  # the receiver does not take this tenant's KV
    TRANSPORT_UNSUPPORTED = "transport_unsupported"  # no transport in common
    OPERATION_UNSUPPORTED = "operation_unsupported"  # no operation (write/read) in common
    LOSSY_NOT_ALLOWED = "lossy_not_allowed"  # the only plan is lossy; the receiver wants exact
    TOO_LARGE = "too_large"  # message over the size limit, or more blocks than the receiver takes
    MALFORMED = "malformed"  # not a message of this protocol (bytes, types, values)
    PLAN_MISMATCH = "plan_mismatch"  # the receiver's plan is not the sender's own plan


@dataclass(frozen=True)
class Refusal:
    reason: RefuseReason
    detail: str


@dataclass(frozen=True)
class KVLayout:
    num_layers: int  # layers of the whole model
    num_kv_heads: int  # KV heads of the whole model (before TP sharding)
    head_dim: int
    block_size: int
    dtype: str
    order: str = CANONICAL_ORDER
    codec_id: str = "identity"
    codec_version: int = 1
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_stage: int = 0

    def problem(self) -> Refusal | None:
        """Why this layout is not valid on its own, or None."""
        counts = (
            self.num_layers, self.num_kv_heads, self.head_dim, self.block_size,
            self.codec_version, self.tp_size, self.tp_rank, self.pp_size, self.pp_stage,
        )  # fmt: skip
        if not all(type(n) is int for n in counts):  # parsed JSON: 2.0, "2", true are not sizes
            return Refusal(RefuseReason.INVALID_LAYOUT, f"a size that is not an integer in {self}")
        if not (isinstance(self.dtype, str) and isinstance(self.order, str)):
            return Refusal(RefuseReason.INVALID_LAYOUT, f"dtype or order not a string in {self}")
        sizes = (self.num_layers, self.num_kv_heads, self.head_dim, self.block_size)
        if min(sizes) <= 0 or self.tp_size <= 0 or self.pp_size <= 0:
            return Refusal(RefuseReason.INVALID_LAYOUT, f"non-positive size in {self}")
        if not 0 <= self.tp_rank < self.tp_size or not 0 <= self.pp_stage < self.pp_size:
            return Refusal(RefuseReason.INVALID_LAYOUT, "rank or stage out of range")
        if sorted(self.order) != sorted(CANONICAL_ORDER):
            return Refusal(RefuseReason.ORDER_UNKNOWN, f"order {self.order!r}")
        if self.dtype not in KNOWN_DTYPES:
            return Refusal(RefuseReason.DTYPE_UNSUPPORTED, f"dtype {self.dtype!r}")
        h, t = self.num_kv_heads, self.tp_size
        if (t <= h and h % t) or (t > h and t % h):
            return Refusal(RefuseReason.HEADS_NOT_DIVISIBLE, f"{h} KV heads over TP {t}")
        if self.num_layers % self.pp_size:
            return Refusal(RefuseReason.PIPELINE_MISMATCH, "layers not divisible by PP size")
        return None

    def rank(self, tp_rank: int) -> KVLayout:
        """The same layout as held by another TP rank."""
        return replace(self, tp_rank=tp_rank)

    def local_heads(self) -> range:
        """Global indices of the KV heads this rank holds."""
        h, t, r = self.num_kv_heads, self.tp_size, self.tp_rank
        if t <= h:
            per = h // t
            return range(r * per, (r + 1) * per)
        head = r // (t // h)
        return range(head, head + 1)

    def local_layers(self) -> range:
        per = self.num_layers // self.pp_size
        return range(self.pp_stage * per, (self.pp_stage + 1) * per)

    def dims(self) -> dict[str, int]:
        """Size of each axis letter in one block payload of this rank."""
        return {
            "L": len(self.local_layers()),
            "K": 2,
            "H": len(self.local_heads()),
            "T": self.block_size,
            "D": self.head_dim,
        }

    def block_shape(self) -> tuple[int, ...]:
        dims = self.dims()
        return tuple(dims[axis] for axis in self.order)

    def block_bytes(self) -> int:
        count = 1
        for size in self.block_shape():
            count *= size
        return count * DTYPE_BYTES[self.dtype]


class StepKind(Enum):
    REORDER = "reorder"
    RESHARD_HEADS = "reshard_heads"
    REBLOCK = "reblock"
    CAST = "cast"


@dataclass(frozen=True)
class HeadSource:
    """Target heads ``[target_start, target_start+count)`` come from ``source_rank``'s local
    heads ``[source_start, source_start+count)``."""

    source_rank: int
    source_start: int
    target_start: int
    count: int


@dataclass(frozen=True)
class ConversionStep:
    kind: StepKind
    source_order: str = ""  # REORDER: from this axis order …
    target_order: str = ""  # … to this one
    heads: tuple[HeadSource, ...] = ()  # RESHARD_HEADS
    source_block_size: int = 0  # REBLOCK
    target_block_size: int = 0
    source_dtype: str = ""  # CAST
    target_dtype: str = ""


@dataclass(frozen=True)
class ConversionPlan:
    source: KVLayout  # any rank of the source; every source rank's blocks are inputs
    target: KVLayout  # the one target rank the plan produces
    steps: tuple[ConversionStep, ...]

    @property
    def identity(self) -> bool:
        return not self.steps

    @property
    def lossless(self) -> bool:
        return all(step.kind is not StepKind.CAST for step in self.steps)

    @property
    def source_ranks(self) -> tuple[int, ...]:
        """Source TP ranks whose blocks the target rank needs."""
        for step in self.steps:
            if step.kind is StepKind.RESHARD_HEADS:
                return tuple(sorted({h.source_rank for h in step.heads}))
        return (self.target.tp_rank if self.source.tp_size == self.target.tp_size else 0,)


def head_sources(source: KVLayout, target: KVLayout) -> tuple[HeadSource, ...]:
    """Where each of the target rank's heads lives among the source ranks (first holder)."""
    owner: dict[int, tuple[int, int]] = {}  # global head → (source rank, local index)
    for rank in range(source.tp_size):
        for local, head in enumerate(source.rank(rank).local_heads()):
            owner.setdefault(head, (rank, local))
    pieces: list[HeadSource] = []
    for target_local, head in enumerate(target.local_heads()):
        rank, local = owner[head]
        last = pieces[-1] if pieces else None
        if (
            last is not None
            and last.source_rank == rank
            and last.source_start + last.count == local
            and last.target_start + last.count == target_local
        ):
            pieces[-1] = HeadSource(rank, last.source_start, last.target_start, last.count + 1)
        else:
            pieces.append(HeadSource(rank, local, target_local, 1))
    return tuple(pieces)


def plan_conversion(source: KVLayout, target: KVLayout) -> ConversionPlan | Refusal:
    """The steps from ``source`` blocks to ``target`` blocks, or why there are none."""
    for layout in (source, target):
        problem = layout.problem()
        if problem is not None:
            return problem
    shape_s = (source.num_layers, source.num_kv_heads, source.head_dim)
    shape_t = (target.num_layers, target.num_kv_heads, target.head_dim)
    if shape_s != shape_t:
        return Refusal(RefuseReason.SHAPE_MISMATCH, f"(L, H, D) {shape_s} vs {shape_t}")
    if (source.codec_id, source.codec_version) != (target.codec_id, target.codec_version):
        return Refusal(
            RefuseReason.CODEC_UNSUPPORTED,
            f"codec {source.codec_id}/{source.codec_version} vs "
            f"{target.codec_id}/{target.codec_version}",
        )
    if (source.pp_size, source.pp_stage) != (target.pp_size, target.pp_stage):
        return Refusal(RefuseReason.PIPELINE_MISMATCH, "PP size or stage differ")
    steps: list[ConversionStep] = []
    if source.order != CANONICAL_ORDER:
        steps.append(
            ConversionStep(
                StepKind.REORDER, source_order=source.order, target_order=CANONICAL_ORDER
            )
        )
    if source.tp_size != target.tp_size or source.local_heads() != target.local_heads():
        # Same TP size but another rank holds other heads: never an identity plan.
        steps.append(ConversionStep(StepKind.RESHARD_HEADS, heads=head_sources(source, target)))
    if source.block_size != target.block_size:
        steps.append(
            ConversionStep(
                StepKind.REBLOCK,
                source_block_size=source.block_size,
                target_block_size=target.block_size,
            )
        )
    if source.dtype != target.dtype:
        steps.append(
            ConversionStep(StepKind.CAST, source_dtype=source.dtype, target_dtype=target.dtype)
        )
    if target.order != CANONICAL_ORDER:
        steps.append(
            ConversionStep(
                StepKind.REORDER, source_order=CANONICAL_ORDER, target_order=target.order
            )
        )
    if (
        len(steps) == 2
        and source.order == target.order
        and all(s.kind is StepKind.REORDER for s in steps)
    ):
        steps = []  # to canonical and straight back: nothing to do
    return ConversionPlan(source, target, tuple(steps))
