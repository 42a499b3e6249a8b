"""The paged quantized KV cache layout: defined once here, shared by runtime, kernels, ONNX and plugins.

One pool per layer and per K/V, cut into ``num_blocks`` blocks of ``block_size`` tokens; each block
holds every KV head. Beside the pools, every sequence slot owns one fp16 **open block** (the tail)
per layer and K/V. A sequence's newest ``context_len % block_size`` tokens live in its tail; when the
tail fills, it is **sealed**: quantized as a whole into a pool block (``seal_blocks``) and emptied.
So a query at position ``t`` sees positions ``>= block_size * (t // block_size)`` in fp16 and every
older token through the quantized pool. A format with ``sink=S`` also keeps a sequence's first ``S`` tokens
in fp16, in ``S`` more tail rows, once its first block is sealed: a query then reads positions ``< S``
from there, never from the pool (``seal_open_block``). See docs/kv-cache-format.md for the byte-level
description.

    data  [num_blocks, H, block_size, packed_dim]   codes (int8 | uint8 | fp16)
    scale [num_blocks, H, block_size, groups]       fp16, per-token dynamic formats
          [num_blocks, H, head_dim]                 fp16, per_block_channel formats (one per channel per block)
    zero  same shape as scale                       fp16, asymmetric dynamic formats
    outlier_index [num_blocks, H, N]                int16, ``outN`` formats: positions token * head_dim + channel
    outlier_value [num_blocks, H, N]                fp16, ``outN`` formats: the kept values (transformed space)
    tail  [num_slots, H, block_size + S, head_dim]  fp16, the open blocks, then the S sink rows

Sequence ``s`` holding ``n`` tokens addresses them through its block table: ``block_table[s, i]`` is the
pool block of tokens ``i*block_size ... (i+1)*block_size-1`` for ``i < n // block_size`` (sealed blocks),
and tokens ``block_size*(n // block_size) ... n-1`` sit at the same offsets in ``tail[slot]``.
Static scales, smoothing factors and the codebooks of ``nuq`` formats are per-layer constants (``TensorParams``), not
pool tensors; ``PagedKVLayout.constant_bytes`` counts the codebooks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from trtkv.errors import TrtkvError
from trtkv.formats import KVFormat, TensorFormat
from trtkv.quant import QuantizedTensor, TensorParams, dequantize, quantize_block

if TYPE_CHECKING:  # pragma: no cover
    from trtkv.rope import RopeTable

Which = Literal["k", "v"]
TAIL_DTYPE = torch.float16
SCALE_DTYPE = torch.float16  # dynamic scales and zero-points, ``formats.SCALE_BITS`` wide (the byte counts read SCALE_BITS)
OUTLIER_INDEX_DTYPE = torch.int16  # ``formats.OUTLIER_INDEX_BITS`` wide
OUTLIER_VALUE_DTYPE = torch.float16  # ``formats.OUTLIER_VALUE_BITS`` wide


@dataclass
class KVPool:
    """The tensors of one layer's paged cache for K or V (pool blocks plus the open blocks)."""

    data: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    tail: torch.Tensor | None = None  # [num_slots, H, block_size + sink_tokens, head_dim] fp16
    outlier_index: torch.Tensor | None = None  # [num_blocks, H, N] int16 (``outN`` formats)
    outlier_value: torch.Tensor | None = None  # [num_blocks, H, N] fp16


@dataclass(frozen=True)
class PagedKVLayout:
    """Shapes and dtypes of a layer's paged K and V pools and open blocks for one KV format.

    A format without its own block size is stored with sealed blocks of ``block_size`` (``fmt`` is
    replaced by ``fmt.with_block_size(block_size)``); a format that has one must match it.
    """

    fmt: KVFormat
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    num_slots: int = 0

    def __post_init__(self) -> None:
        if self.fmt.block_size is not None and self.fmt.block_size != self.block_size:
            raise TrtkvError(
                f"format {self.fmt.name!r} seals blocks of {self.fmt.block_size} tokens but the cache uses blocks of {self.block_size}",
                f"use block size {self.fmt.block_size}, or the format with block={self.block_size}",
            )
        object.__setattr__(self, "fmt", self.fmt.with_block_size(self.block_size))
        for f in self.fmt.layer_formats():
            for t in (f.k, f.v):
                t.check_head_dim(self.head_dim)
                t.check_block(self.block_size, self.head_dim)

    def layer(self, i: int) -> "PagedKVLayout":
        """Layer ``i``'s layout: a per-layer format's own storage for that layer (this layout otherwise)."""
        return dataclasses.replace(self, fmt=self.fmt.layer(i)) if self.fmt.is_per_layer else self

    def block_bytes(self, layers) -> int:
        """Bytes of one pool block of K and V over ``layers`` (indices), each layer in its own storage."""
        return sum(self.layer(i).bytes_per_block() for i in layers)

    def tensor_format(self, which: Which) -> TensorFormat:
        if self.fmt.is_per_layer:  # a programming error: shapes and codes are per layer
            raise ValueError(f"format {self.fmt.name} stores each layer its own way: use layout.layer(i)")
        return self.fmt.k if which == "k" else self.fmt.v

    def packed_dim(self, which: Which) -> int:
        """Storage elements per token and head: head_dim, or head_dim/2 for packed int4."""
        return self.tensor_format(which).packed_dim(self.head_dim)

    def data_dtype(self, which: Which) -> torch.dtype:
        return storage_dtype(self.tensor_format(which))

    # Shapes: ``num_blocks`` / ``num_slots`` default to this layout's and may be symbolic (a graph's "num_blocks");
    # ``layers`` (an int or a name) puts a leading layer axis in front: the stacked pools of the step contract.

    def _lead(self, n, default: int, layers) -> tuple:
        n = default if n is None else n
        return (n,) if layers is None else (layers, n)

    def data_shape(self, which: Which, num_blocks=None, layers=None) -> tuple:
        return (*self._lead(num_blocks, self.num_blocks, layers), self.num_kv_heads, self.block_size, self.packed_dim(which))

    def scale_shape(self, which: Which, num_blocks=None, layers=None) -> tuple | None:
        lead = self._lead(num_blocks, self.num_blocks, layers)
        return self.tensor_format(which).scale_shape(lead, self.num_kv_heads, self.block_size, self.head_dim)

    def zero_shape(self, which: Which, num_blocks=None, layers=None) -> tuple | None:
        return None if self.tensor_format(which).symmetric else self.scale_shape(which, num_blocks, layers)

    def outlier_shape(self, which: Which, num_blocks=None, layers=None) -> tuple | None:
        """Shape of the outlier positions (int16) and values (fp16) of an ``outN`` format, one list per block and KV
        head: ``[num_blocks, H, N]``; None without outliers."""
        return self.tensor_format(which).outlier_shape(self._lead(num_blocks, self.num_blocks, layers), self.num_kv_heads)

    @property
    def sink_tokens(self) -> int:
        return self.fmt.sink_tokens

    @property
    def tail_rows(self) -> int:
        """Rows of one slot's tail: the open block's ``block_size``, then the ``sink_tokens`` sink rows."""
        return self.fmt.tail_rows

    def tail_shape(self, num_slots=None, layers=None) -> tuple:
        return (*self._lead(num_slots, self.num_slots, layers), self.num_kv_heads, self.tail_rows, self.head_dim)

    # Tail rows: views of a tail tensor [..., H, tail_rows, D] (any leading axes: stacked layers, slots, one slot).

    def open_rows(self, tail: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """The open block's rows of ``tail`` (its first ``n`` rows; default all ``block_size``): a view."""
        return tail.narrow(-2, 0, self.block_size if n is None else n)

    def sink_rows(self, tail: torch.Tensor) -> torch.Tensor:
        """The sink rows of ``tail`` (a sequence's first ``sink_tokens`` tokens once its first block is sealed): a view."""
        return tail.narrow(-2, self.block_size, self.sink_tokens)

    # Byte counts: a pool block at ``TensorFormat.block_bits`` per KV head (codes at the ``DTYPES`` row's bits, scales and
    # zero-points at ``SCALE_BITS``, outlier lists at ``OUTLIER_BITS``), the tail at ``KVFormat.tail_bytes``; everything
    # that counts cache memory asks these.

    def tensor_bytes_per_block(self, which: Which) -> int:
        """Bytes of one pool block of K or V: its codes plus its dynamic scales and zero-points and its outlier list
        (``TensorFormat.block_bits`` per KV head: the shapes this layout allocates, counted once)."""
        return self.num_kv_heads * self.tensor_format(which).block_bits(self.block_size, self.head_dim) // 8

    def constant_bytes(self, layers) -> int:
        """Bytes of the per-layer constants the pools of ``layers`` (indices) are read with that the format fixes: the
        codebooks of ``nuq`` formats (``KVFormat.constant_bytes``); a fixed cost, not per block or slot."""
        return sum(self.layer(i).fmt.constant_bytes(1, self.num_kv_heads) for i in layers)

    def bytes_per_block(self) -> int:
        """Bytes of one pool block of K and V together, scales included."""
        return self.tensor_bytes_per_block("k") + self.tensor_bytes_per_block("v")

    def bytes_per_token(self) -> float:
        """Pool bytes per sealed token, K and V, scales included (per-block scales amortised over the block)."""
        return self.bytes_per_block() / self.block_size

    def tail_bytes_per_slot(self) -> int:
        """Bytes of one sequence slot's open blocks and sink rows, K and V together (fp16)."""
        return self.fmt.tail_bytes_per_slot(1, self.num_kv_heads, self.head_dim)

    def pool_bytes(self) -> int:
        """Bytes of this layer's whole cache: ``num_blocks`` pool blocks and ``num_slots`` tails, K and V."""
        return self.num_blocks * self.bytes_per_block() + self.num_slots * self.tail_bytes_per_slot()

    def allocate_tail(self, device: torch.device | str = "cpu", layers: int | None = None) -> torch.Tensor:
        """Zero-filled tails (open blocks, then sink rows) of every slot: ``tail_shape``, fp16."""
        return torch.zeros(self.tail_shape(layers=layers), dtype=TAIL_DTYPE, device=device)

    def allocate(self, which: Which, device: torch.device | str = "cpu", layers: int | None = None, tail: bool = True) -> KVPool:
        """Zero-filled pool tensors (and, with ``tail``, the open blocks) for K or V; ``layers``: stacked for that many
        layers of this storage (a leading axis)."""

        def zeros(shape, dtype):
            return None if shape is None else torch.zeros(shape, dtype=dtype, device=device)

        return KVPool(
            data=zeros(self.data_shape(which, layers=layers), self.data_dtype(which)),
            scale=zeros(self.scale_shape(which, layers=layers), SCALE_DTYPE),
            zero=zeros(self.zero_shape(which, layers=layers), SCALE_DTYPE),
            tail=self.allocate_tail(device, layers) if tail else None,
            outlier_index=zeros(self.outlier_shape(which, layers=layers), OUTLIER_INDEX_DTYPE),
            outlier_value=zeros(self.outlier_shape(which, layers=layers), OUTLIER_VALUE_DTYPE),
        )


def first_window_block(context_len, window: int, block_size: int):
    """The first sealed block a sliding layer of ``window`` tokens still reads when its next query sits at position
    ``context_len`` (an int or a tensor of them): keys at positions ``> context_len - window`` (transformers' rule)
    are read, so blocks wholly below ``context_len - window + 1`` never are again."""
    first = (context_len - window + 1) // block_size
    return first.clamp(min=0) if isinstance(first, torch.Tensor) else max(0, first)


def window_ring_blocks(window: int, block_size: int) -> int:
    """The most sealed blocks a sliding layer reads in one step (``context//bs - first_window_block``, over every
    context; periodic in ``block_size`` past the window): the ring each sequence slot keeps (``WindowRing``)."""
    return max(c // block_size - first_window_block(c, window, block_size) for c in range(window + 2 * block_size))


@dataclass(frozen=True)
class WindowRing:
    """The sliding layers' sealed blocks, freed as the window moves past them.

    A sliding layer never reads a sealed block wholly outside its window again, so it needs at most
    ``ring_blocks = window_ring_blocks(window, block_size)`` of a sequence's sealed blocks at once. Each sequence
    slot owns that many blocks per sliding layer, in a ring: the sequence's sealed block ``i`` lives in ring block
    ``slot * ring_blocks + i % ring_blocks`` of the sliding layers' pools, overwriting block ``i - ring_blocks``, which
    no query reads any more. The global layers keep every sealed block in the pool the block tables address. So a
    sliding layer holds at most its window plus one block of tokens per sequence, at a fixed cost per slot, with no
    block table and nothing to allocate: the step contract is unchanged (the ring block follows from the slot).
    """

    layers: tuple[int, ...]  # the sliding layers
    window: int
    block_size: int

    @classmethod
    def of(cls, model, block_size: int) -> "WindowRing | None":
        """The ring of a ``trtkv.models.ModelInfo``'s sliding layers (None: the model has none)."""
        layers = tuple(i for i in range(model.num_layers) if model.is_sliding(i))
        if not layers or not model.sliding_window:
            return None
        return cls(layers, int(model.sliding_window), block_size)

    @property
    def ring_blocks(self) -> int:
        return window_ring_blocks(self.window, self.block_size)

    def block(self, slot, index):
        """Ring block of a sequence's sealed block ``index`` in slot ``slot`` (ints or tensors)."""
        return slot * self.ring_blocks + index % self.ring_blocks

    def first_block(self, context_len):
        return first_window_block(context_len, self.window, self.block_size)

    def bytes_per_slot(self, layout: "PagedKVLayout") -> int:
        """One slot's ring blocks, K and V, every sliding layer."""
        return self.ring_blocks * layout.block_bytes(self.layers)


def storage_dtype(t: TensorFormat) -> torch.dtype:
    """Torch dtype of a pool's ``data`` tensor: the ``DTYPES`` row's storage for the format's symmetry."""
    return t.storage.torch


def slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat pool slots ``block_table[pos // block_size] * block_size + pos % block_size`` of ``positions``.

    ``block_table`` [max_blocks] (one sequence) or [B, max_blocks] with ``positions`` [B, T]. The reference
    statement of the addressing in docs/kv-cache-format.md; nothing in the package calls it (the kernels, the graph
    and the runtime address whole blocks through the block table), the tests check it against a loop.
    """
    positions = positions.long()
    idx = positions // block_size
    blocks = block_table.long().gather(-1, idx) if block_table.dim() > 1 else block_table.long()[idx]
    return blocks * block_size + positions % block_size


def seal_blocks(
    layout: PagedKVLayout,
    which: Which,
    pool: KVPool,
    rows: torch.Tensor,
    blocks: torch.Tensor,
    params: TensorParams | None = None,
    first_positions: torch.Tensor | None = None,
    rope: "RopeTable | None" = None,
) -> None:
    """Reference seal: quantize full blocks ``rows`` [n, H, block_size, D] into pool blocks ``blocks`` [n].

    ``prerope`` keys need ``rope`` (the layer's ``trtkv.rope.RopeTable``) and ``first_positions`` [n], each block's first
    token position (its sequence's block number times ``block_size``): the seal undoes RoPE at those positions."""
    if rows.shape[1:] != (layout.num_kv_heads, layout.block_size, layout.head_dim):
        raise ValueError(f"seal_blocks wants rows [n, {layout.num_kv_heads}, {layout.block_size}, {layout.head_dim}], got {list(rows.shape)}")
    tf = layout.tensor_format(which)
    cs = None
    if tf.pre_rope and rope is not None and first_positions is not None:
        cs = block_rope(rope, first_positions, layout.block_size)
    store_quantized(pool, blocks, quantize_block(rows, tf, params, head_axis=-3, rope=cs), tf)


def store_quantized(pool: KVPool, blocks: torch.Tensor, qt: QuantizedTensor, tf: TensorFormat) -> None:
    """Store sealed blocks ``qt`` of tensor format ``tf`` -- codes, scales, zero-points and an ``outN`` format's outlier
    lists -- into pool blocks ``blocks`` [n], in place (``store_blocks`` for the first three)."""
    store_blocks(pool.data, pool.scale, pool.zero, blocks, qt.codes, qt.scale, qt.zero)
    if qt.outlier_index is not None:
        if pool.outlier_index is None or pool.outlier_value is None:
            raise ValueError(f"format {tf.short()} keeps outliers and this pool has no outlier lists")
        b = blocks.long()
        pool.outlier_index[b], pool.outlier_value[b] = qt.outlier_index, qt.outlier_value


def block_rope(rope: "RopeTable", first_positions: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` [n, 1, block_size, D] of blocks whose first tokens sit at ``first_positions`` [n]."""
    pos = first_positions.long().reshape(-1, 1) + torch.arange(block_size, device=first_positions.device)
    cos, sin = rope.cos_sin(pos.flatten())
    return cos.view(pos.shape[0], 1, block_size, -1), sin.view(pos.shape[0], 1, block_size, -1)


def store_blocks(data: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None, blocks: torch.Tensor,
                 codes: torch.Tensor, block_scale: torch.Tensor | None, block_zero: torch.Tensor | None) -> None:
    """Scatter sealed blocks (codes, scales, zero-points) into pool blocks ``blocks`` [n], in place:
    the one store every seal path (reference, kernel op, its reference op) shares."""
    b = blocks.long()
    data[b] = codes.to(data.dtype)
    if scale is not None:
        scale[b] = block_scale
    if zero is not None:
        zero[b] = block_zero


def without_sink(rows: torch.Tensor, sink_tokens: int, seq_axis: int = -2) -> torch.Tensor:
    """A sequence's first block as it is quantized: its first ``sink_tokens`` rows replaced by row
    ``sink_tokens`` (they are kept in fp16 instead), so that the sink's outliers do not set the block's ranges."""
    if not sink_tokens:
        return rows
    rows = rows.clone()
    rows.narrow(seq_axis, 0, sink_tokens).copy_(rows.narrow(seq_axis, sink_tokens, 1).expand_as(rows.narrow(seq_axis, 0, sink_tokens)))
    return rows


def sealing(block: torch.Tensor, block_index: int, sink_tokens: int, seq_axis: int = -2) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What sealing a sequence's block number ``block_index`` quantizes, and the sink rows it keeps in fp16:
    ``(block, None)``, except for a first block with sink tokens: ``(without_sink(block), its first sink_tokens rows)``.
    The one rule the paged seal (``seal_open_block``) and the eval cache (``trtkv.kv_cache``) share."""
    if block_index or not sink_tokens:
        return block, None
    return without_sink(block, sink_tokens, seq_axis), block.narrow(seq_axis, 0, sink_tokens)


def open_block_to_seal(layout: PagedKVLayout, pool: KVPool, slot: int, block_index: int) -> torch.Tensor:
    """What sealing open block ``slot`` -- its sequence's block number ``block_index`` -- quantizes, [1, H, bs, D]
    float32; a first block also fills the slot's sink rows (``sealing``). The step the reference seal
    (``seal_open_block``) and the Triton seal kernel (``trtkv.attention.triton``) share."""
    assert pool.tail is not None
    tail = pool.tail[slot : slot + 1]
    rows, sink_rows = sealing(layout.open_rows(tail).float(), block_index, layout.sink_tokens)
    if sink_rows is not None:
        layout.sink_rows(tail).copy_(sink_rows)
    return rows


def seal_open_block(layout: PagedKVLayout, which: Which, pool: KVPool, slot: int, block: int, block_index: int,
                    params: TensorParams | None = None, rope: "RopeTable | None" = None) -> None:
    """Seal open block ``slot`` -- its sequence's block number ``block_index`` -- into pool block ``block``;
    a first block also fills the slot's sink rows (``open_block_to_seal``). ``rope``: for ``prerope`` keys."""
    seal_blocks(layout, which, pool, open_block_to_seal(layout, pool, slot, block_index), torch.tensor([block]), params,
                torch.tensor([block_index * layout.block_size]), rope)


def chunk_length(start: int, remaining: int, block_size: int | None, limit: int | None = None) -> int:
    """Tokens of a step starting at position ``start``: ``remaining`` at most, ``limit`` at most (a token budget),
    and never past the end of ``start``'s block, counted from the offset inside it (a step never crosses a
    block boundary). The one rule the eval chunks, the scheduler and the static driver share."""
    n = remaining if limit is None else min(remaining, limit)
    return n if not block_size else min(n, block_size - start % block_size)


def block_chunks(start: int, length: int, block_size: int | None, limit: int | None = None) -> list[tuple[int, int]]:
    """``(begin, end)`` ranges covering ``start ... start+length-1``, each one ``chunk_length`` long."""
    if limit is not None and limit < 1:
        raise ValueError(f"a chunk limit of {limit} tokens makes no progress")
    out, pos, stop = [], start, start + length
    while pos < stop:
        end = pos + chunk_length(pos, stop - pos, block_size, limit)
        out.append((pos, end))
        pos = end
    return out


def write_tail(pool: KVPool, slot: int, rows: torch.Tensor, start: int, block_size: int) -> None:
    """Write ``rows`` [n, H, D] into open block ``slot`` at offsets ``start ... start+n-1`` (within one block)."""
    assert pool.tail is not None
    if start + rows.shape[0] > block_size:
        raise ValueError(f"{rows.shape[0]} rows at offset {start} overflow an open block of {block_size} tokens")
    pool.tail[slot, :, start : start + rows.shape[0]] = rows.transpose(0, 1).to(pool.tail.dtype)


def gather_paged(
    layout: PagedKVLayout,
    which: Which,
    pool: KVPool,
    block_table: torch.Tensor,
    context_len: int,
    params: TensorParams | None = None,
    slot: int | None = None,
    rope: "RopeTable | None" = None,
) -> torch.Tensor:
    """Reference read of one sequence's ``context_len`` tokens: [context_len, H, D] float32, model space (``prerope``
    keys: RoPE applied again at their positions, from ``rope``).

    Sealed blocks come from the pool through ``block_table``, except the first ``sink_tokens`` positions,
    which come from the sink rows of slot ``slot``; the newest ``context_len % block_size`` tokens come
    from open block ``slot`` (a slot is required when either is read).
    """
    bs, sink = layout.block_size, layout.sink_tokens
    sealed = context_len // bs
    open_len = context_len - sealed * bs
    if (open_len or (sealed and sink)) and (slot is None or pool.tail is None):
        raise ValueError(f"{context_len} tokens read open block or sink rows but no slot was given")
    parts = []
    if sealed:
        b = block_table[:sealed].long()
        qt = QuantizedTensor(
            codes=pool.data[b],
            scale=None if pool.scale is None else pool.scale[b],
            zero=None if pool.zero is None else pool.zero[b],
            outlier_index=None if pool.outlier_index is None else pool.outlier_index[b],
            outlier_value=None if pool.outlier_value is None else pool.outlier_value[b],
        )
        tf = layout.tensor_format(which)
        cs = block_rope(rope, torch.arange(sealed) * bs, bs) if tf.pre_rope and rope is not None else None
        x = dequantize(qt, tf, params, head_axis=-3, rope=cs)  # [sealed, H, bs, D]
        x = x.permute(0, 2, 1, 3).reshape(sealed * bs, layout.num_kv_heads, layout.head_dim)
        if sink:
            x = torch.cat([layout.sink_rows(pool.tail[slot]).transpose(0, 1).float(), x[sink:]])
        parts.append(x)
    if open_len:
        parts.append(layout.open_rows(pool.tail[slot], open_len).transpose(0, 1).float())
    if not parts:
        return torch.zeros(0, layout.num_kv_heads, layout.head_dim)
    return torch.cat(parts, 0)
