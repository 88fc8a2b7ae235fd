"""vLLM's per-layer KV tensors ↔ one kvstrata object per vLLM block.

What vLLM 0.32 hands a connector (``register_kv_caches``): one tensor per attention layer.

- Every backend gets a *logical* 4-D view ``[num_kernel_blocks, H, N, C]`` whose strides follow
  the resolved ``KVCacheLayout`` (``vllm/v1/kv_cache_interface.py::create_kv_cache_views``).
  On the CPU backend (``CPU_ATTN``, layout ``LBHNC``) it is contiguous
  ``[num_blocks, num_kv_heads, block_size, 2*head_size]``; on CUDA backends with an ``NHD``
  layout (``LBNHC``) the same logical shape has permuted strides. When the attention kernel's
  block is smaller than the scheduler's, one vLLM block spans ``r`` consecutive kernel blocks.
- Older vLLM GPU backends expose ``[2, num_blocks, block_size, num_kv_heads, head_size]``
  (K and V stacked on a leading axis). ``LayerLayout`` recognises it by its 5 dimensions with
  a leading 2 and puts the block axis at 1.

An object's payload is, for each layer in registration order, the bytes of that block in
*logical* order (``index_select`` gathers through any strides), so the payload of a block does
not depend on the physical layout, only on the logical shape, the dtype and the layer order —
which ``BlockCodec.representation`` records and a load checks. Pure torch: no vLLM import, so
the GPU shapes are unit-tested on CPU tensors (real CUDA is untested here: no GPU).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.errors import InvalidInput
from kvstrata.objects import Representation

LAYOUT_TAG = "vllm.kv.v1"


class UnsupportedLayout(InvalidInput):
    """A KV tensor whose block axis this codec cannot find."""


@dataclass(frozen=True)
class LayerLayout:
    """Where a layer tensor keeps its blocks.

    ``block_axis`` is 0 for vLLM 0.32's logical ``[B, H, N, C]`` views and 1 for the older
    stacked ``[2, B, N, H, D]`` GPU tensors; ``ratio`` kernel blocks make up one vLLM block.
    """

    block_axis: int
    ratio: int

    @classmethod
    def detect(cls, tensor: torch.Tensor, num_blocks: int) -> LayerLayout:
        if num_blocks < 1:
            raise UnsupportedLayout("num_blocks must be positive")
        if tensor.dim() == 5 and tensor.shape[0] == 2:
            axis = 1
        elif tensor.dim() == 4:
            axis = 0
        else:
            raise UnsupportedLayout(f"KV tensor of shape {tuple(tensor.shape)}")
        kernel_blocks = int(tensor.shape[axis])
        if kernel_blocks < num_blocks or kernel_blocks % num_blocks:
            raise UnsupportedLayout(
                f"KV tensor of shape {tuple(tensor.shape)} does not hold {num_blocks} blocks"
            )
        return cls(axis, kernel_blocks // num_blocks)

    def block_shape(self, tensor: torch.Tensor) -> tuple[int, ...]:
        """Logical shape of one vLLM block of this layer, as stored in a payload."""
        shape = list(tensor.shape)
        del shape[self.block_axis]
        if self.block_axis == 0:
            return (self.ratio, *shape)
        return (shape[0], self.ratio, *shape[1:])


class BlockCodec:
    """Gathers whole vLLM blocks into payload rows and scatters rows back (all layers).

    ``gather(ids)`` returns a CPU ``uint8`` tensor ``[len(ids), block_bytes]``; ``scatter(ids,
    rows)`` writes such rows into the blocks ``ids`` of every layer. Blocks not named are never
    touched.
    """

    def __init__(
        self,
        layers: Mapping[str, torch.Tensor],
        num_blocks: int,
        block_size: int,
        *,
        use_numpy: bool | None = None,
    ) -> None:
        if not layers:
            raise UnsupportedLayout("no KV tensors registered")
        self.names = list(layers)
        self.tensors = [layers[name] for name in self.names]
        self.layouts = [LayerLayout.detect(t, num_blocks) for t in self.tensors]
        dtypes = {t.dtype for t in self.tensors}
        if len(dtypes) != 1:
            raise UnsupportedLayout(f"layers of different dtypes: {sorted(map(str, dtypes))}")
        self.dtype = self.tensors[0].dtype
        self.device = self.tensors[0].device
        self.num_blocks = num_blocks
        self.block_size = block_size
        # numpy for CPU tensors (see ``_gather_cpu``); torch ops otherwise (tests force both).
        self.use_numpy = self.device.type == "cpu" if use_numpy is None else use_numpy
        self.block_shapes = [
            lay.block_shape(t) for lay, t in zip(self.layouts, self.tensors, strict=False)
        ]
        item = torch.empty((), dtype=self.dtype).element_size()
        self.layer_bytes = [_numel(shape) * item for shape in self.block_shapes]
        self.offsets = [sum(self.layer_bytes[:i]) for i in range(len(self.layer_bytes))]
        self.block_bytes = sum(self.layer_bytes)
        self._rows_view: list[np.ndarray | None] | None = None  # built by the first ``place``

    @property
    def representation(self) -> Representation:
        uniform = len(set(self.block_shapes)) == 1
        shape = (
            (len(self.tensors), *self.block_shapes[0])
            if uniform
            else tuple(_numel(s) for s in self.block_shapes)
        )
        stacked = any(lay.block_axis == 1 for lay in self.layouts)
        layout = f"{LAYOUT_TAG}[L,{'2,R,N,H,D' if stacked else 'R,H,N,C'}]"
        return Representation(
            dtype=str(self.dtype).removeprefix("torch."),
            layout=layout if uniform else f"{layout}:ragged",
            block_size=self.block_size,
            shape=shape,
        )

    def _kernel_ids(self, layout: LayerLayout, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        if layout.ratio > 1:
            ids = (ids[:, None] * layout.ratio + torch.arange(layout.ratio)).reshape(-1)
        return ids.to(self.device)

    def _check(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise InvalidInput(f"block id {block_id} outside [0, {self.num_blocks})")

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """``out``: ``[len(block_ids), block_bytes]`` uint8 rows to fill (a reused buffer: fresh
        pages cost their first touch on every call), else new ones."""
        self._check(block_ids)
        n = len(block_ids)
        if out is not None and (out.shape != (n, self.block_bytes) or out.dtype != torch.uint8):
            raise InvalidInput(f"out of shape {tuple(out.shape)} for {n} blocks")
        rows = out if out is not None else torch.empty((n, self.block_bytes), dtype=torch.uint8)
        if n == 0:
            return rows
        if self.use_numpy:
            self._gather_cpu(block_ids, rows.numpy())
            return rows
        for tensor, layout, offset, size in self._layers():
            picked = tensor.index_select(layout.block_axis, self._kernel_ids(layout, block_ids))
            if layout.block_axis == 1:  # [2, n*r, ...] → block-major [n, 2, r, ...]
                picked = picked.reshape(2, n, layout.ratio, *picked.shape[2:]).transpose(0, 1)
            flat = picked.contiguous().reshape(n, -1).view(torch.uint8).cpu()
            rows[:, offset : offset + size].copy_(flat)
        return rows

    def scatter(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        self._scatter(block_ids, rows, None)

    def place(self, block_id: int, payload: memoryview) -> None:
        """Write one block's payload (every layer) into block ``block_id``, straight from
        ``payload`` (a tier's buffer: read, never kept). On an accelerator the copies have
        completed when this returns, whichever stream the caller's thread uses."""
        self._check([block_id])
        row = np.frombuffer(payload, dtype=np.uint8)
        if row.size != self.block_bytes:
            raise InvalidInput(f"payload of {row.size} bytes for a block of {self.block_bytes}")
        if not self.use_numpy:
            self._scatter([block_id], torch.tensor(row).reshape(1, -1), None)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            return
        self._scatter_cpu([block_id], row.reshape(1, -1), None)

    def scatter_layer(self, layer: int, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Write only layer ``layer``'s slice of whole-block ``rows`` (a layer-wise load)."""
        if not 0 <= layer < len(self.tensors):
            raise InvalidInput(f"layer {layer} outside [0, {len(self.tensors)})")
        self._scatter(block_ids, rows, layer)

    def _scatter(self, block_ids: Sequence[int], rows: torch.Tensor, layer: int | None) -> None:
        self._check(block_ids)
        n = len(block_ids)
        if rows.shape != (n, self.block_bytes) or rows.dtype != torch.uint8:
            raise InvalidInput(f"rows of shape {tuple(rows.shape)} for {n} blocks")
        if n == 0:
            return
        if self.use_numpy:
            self._scatter_cpu(block_ids, rows.numpy(), layer)
            return
        for tensor, layout, offset, size in self._layers(layer):
            chunk = rows[:, offset : offset + size].contiguous().view(self.dtype)
            chunk = chunk.to(self.device)
            per_block = tensor.shape[:]
            if layout.block_axis == 0:
                source = chunk.reshape(n * layout.ratio, *per_block[1:])
            else:
                source = chunk.reshape(n, 2, layout.ratio, *per_block[2:]).transpose(0, 1)
                source = source.reshape(2, n * layout.ratio, *per_block[2:])
            tensor.index_copy_(layout.block_axis, self._kernel_ids(layout, block_ids), source)

    # CPU tensors are copied with numpy: plain single-threaded memcpy. torch's copy kernels
    # fan out to its OpenMP pool, and on a busy small machine (vLLM's own threads included)
    # their spin-waits made loads many times slower (docs/results-history.md, vLLM connector).
    def _layers(
        self, layer: int | None = None
    ) -> Iterator[tuple[torch.Tensor, LayerLayout, int, int]]:
        every = zip(self.tensors, self.layouts, self.offsets, self.layer_bytes, strict=True)
        if layer is None:
            yield from every
        else:
            yield next(itertools.islice(every, layer, None))

    def _block_rows(self) -> list[np.ndarray | None]:
        """Per layer: its words as one row per vLLM block where the tensor is contiguous with
        the block axis first (vLLM's CPU layout), else None (built once: views, no copies)."""
        if self._rows_view is None:
            views: list[np.ndarray | None] = []
            for tensor, layout in zip(self.tensors, self.layouts, strict=True):
                words = self._as_words(tensor)
                usable = layout.block_axis == 0 and words.flags.c_contiguous
                views.append(words.reshape(self.num_blocks, -1) if usable else None)
            self._rows_view = views
        return self._rows_view

    def _as_words(self, tensor: torch.Tensor) -> np.ndarray:
        return tensor.view(_INT_OF_SIZE[tensor.element_size()]).numpy()

    def _kernel_index(self, layout: LayerLayout, block_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64)
        if layout.ratio > 1:
            ids = (ids[:, None] * layout.ratio + np.arange(layout.ratio)).reshape(-1)
        return ids

    def _gather_cpu(self, block_ids: Sequence[int], rows: np.ndarray) -> None:
        n = len(block_ids)
        for tensor, layout, offset, size in self._layers():
            words = self._as_words(tensor)
            picked = words.take(self._kernel_index(layout, block_ids), axis=layout.block_axis)
            if layout.block_axis == 1:
                picked = picked.reshape(2, n, layout.ratio, *picked.shape[2:]).swapaxes(0, 1)
            flat = np.ascontiguousarray(picked).reshape(n, -1).view(np.uint8)
            rows[:, offset : offset + size] = flat

    def _scatter_cpu(self, block_ids: Sequence[int], rows: np.ndarray, layer: int | None) -> None:
        n = len(block_ids)
        views = self._block_rows()
        for index in range(len(self.tensors)) if layer is None else (layer,):
            offset, size = self.offsets[index], self.layer_bytes[index]
            blocks = views[index]
            if blocks is not None:  # whole vLLM blocks are contiguous rows: one pass, no copy
                source = rows[:, offset : offset + size].view(blocks.dtype)
                if n == 1:
                    blocks[block_ids[0]] = source[0]  # basic indexing: a plain memcpy
                else:
                    blocks[np.asarray(block_ids, dtype=np.int64)] = source
                continue
            layout = self.layouts[index]
            words = self._as_words(self.tensors[index])
            chunk = np.ascontiguousarray(rows[:, offset : offset + size]).view(words.dtype)
            kernel_index = self._kernel_index(layout, block_ids)
            if layout.block_axis == 0:
                words[kernel_index] = chunk.reshape(n * layout.ratio, *words.shape[1:])
            else:
                rest = words.shape[2:]
                source = chunk.reshape(n, 2, layout.ratio, *rest).swapaxes(0, 1)
                words[:, kernel_index] = source.reshape(2, n * layout.ratio, *rest)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for dim in shape:
        total *= int(dim)
    return total
