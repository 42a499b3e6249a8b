"""The paged quantized KV cache layout: defined once here, shared by runtime, kernels, ONNX and plugins.

One pool per layer and per K/V. A pool is cut into ``num_blocks`` blocks of ``block_size`` tokens;
each block holds every KV head. A sequence addresses its tokens through a block table
(``block_table[seq, i]`` is the pool block holding tokens ``i*block_size ... (i+1)*block_size-1``),
and new tokens are written at flat slots ``slot = block * block_size + offset`` (negative slot: padding,
skipped). See docs/kv-cache-format.md for the byte-level description.

    data  [num_blocks, num_kv_heads, block_size, packed_dim]   codes (int8 | uint8 | fp16)
    scale [num_blocks, num_kv_heads, block_size, groups]       fp16, dynamic formats only
    zero  [num_blocks, num_kv_heads, block_size, groups]       fp16, asymmetric dynamic formats only

Static scales and smoothing factors are per-layer constants (``TensorParams``), not pool tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from trtkv.errors import TrtkvError
from trtkv.formats import KVFormat, TensorFormat
from trtkv.quant import QuantizedTensor, TensorParams, dequantize, quantize

Which = Literal["k", "v"]


@dataclass
class KVPool:
    """The tensors of one layer's paged cache for K or V."""

    data: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None


@dataclass(frozen=True)
class PagedKVLayout:
    """Shapes and dtypes of a layer's paged K and V pools for one KV format."""

    fmt: KVFormat
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int

    def __post_init__(self) -> None:
        if self.fmt.recent_tokens:
            raise TrtkvError(
                f"format {self.fmt.name!r} keeps recent tokens unquantized, which the paged cache does not store yet",
                "use a format with recent_tokens=0 for engines and serving",
            )
        for t in (self.fmt.k, self.fmt.v):
            t.groups(self.head_dim)  # validates group size against head_dim
            if t.dtype == "int4" and self.head_dim % 2:
                raise TrtkvError(f"int4 needs an even head_dim, got {self.head_dim}", "use int8 for this model")

    def tensor_format(self, which: Which) -> TensorFormat:
        return self.fmt.k if which == "k" else self.fmt.v

    def packed_dim(self, which: Which) -> int:
        """Storage elements per token and head: head_dim, or head_dim/2 for packed int4."""
        return self.head_dim // self.tensor_format(which).traits.codes_per_byte

    def data_dtype(self, which: Which) -> torch.dtype:
        t = self.tensor_format(which)
        if t.dtype == "int8" and not (t.symmetric or t.is_static):
            return torch.uint8
        return t.traits.storage

    def data_shape(self, which: Which) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.num_kv_heads, self.block_size, self.packed_dim(which))

    def scale_shape(self, which: Which) -> tuple[int, int, int, int] | None:
        t = self.tensor_format(which)
        if not t.is_dynamic:
            return None
        return (self.num_blocks, self.num_kv_heads, self.block_size, t.groups(self.head_dim))

    def zero_shape(self, which: Which) -> tuple[int, int, int, int] | None:
        return None if self.tensor_format(which).symmetric else self.scale_shape(which)

    def bytes_per_block(self) -> int:
        """Bytes of one block of K and V together, scales included."""
        total = 0
        for which in ("k", "v"):
            total += _numel(self.data_shape(which)) // self.num_blocks * self.data_dtype(which).itemsize
            for shape in (self.scale_shape(which), self.zero_shape(which)):
                if shape is not None:
                    total += _numel(shape) // self.num_blocks * 2
        return total

    def allocate(self, which: Which, device: torch.device | str = "cpu") -> KVPool:
        """Zero-filled pool tensors for K or V."""
        def zeros(shape, dtype):
            return None if shape is None else torch.zeros(shape, dtype=dtype, device=device)

        return KVPool(
            data=torch.zeros(self.data_shape(which), dtype=self.data_dtype(which), device=device),
            scale=zeros(self.scale_shape(which), torch.float16),
            zero=zeros(self.zero_shape(which), torch.float16),
        )


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def write_paged(
    layout: PagedKVLayout,
    which: Which,
    pool: KVPool,
    rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    params: TensorParams | None = None,
) -> None:
    """Reference quantize-and-append: rows [tokens, kv_heads, head_dim] go to their slots (slot < 0: skipped)."""
    fmt = layout.tensor_format(which)
    keep = slot_mapping >= 0
    rows, slots = rows[keep], slot_mapping[keep].long()
    qt = quantize(rows, fmt, params, head_axis=-2)
    block, off = slots // layout.block_size, slots % layout.block_size
    pool.data[block, :, off] = qt.codes.to(pool.data.dtype)
    if pool.scale is not None:
        pool.scale[block, :, off] = qt.scale
    if pool.zero is not None:
        pool.zero[block, :, off] = qt.zero


def gather_paged(
    layout: PagedKVLayout,
    which: Which,
    pool: KVPool,
    block_table: torch.Tensor,
    context_len: int,
    params: TensorParams | None = None,
    dequant: bool = True,
) -> torch.Tensor | QuantizedTensor:
    """Reference read of one sequence's first ``context_len`` tokens: [context_len, kv_heads, head_dim] float32."""
    pos = torch.arange(context_len, device=block_table.device)
    block = block_table[pos // layout.block_size].long()
    off = pos % layout.block_size
    qt = QuantizedTensor(
        codes=pool.data[block, :, off],
        scale=None if pool.scale is None else pool.scale[block, :, off],
        zero=None if pool.zero is None else pool.zero[block, :, off],
    )
    if not dequant:
        return qt
    return dequantize(qt, layout.tensor_format(which), params, head_axis=-2)
