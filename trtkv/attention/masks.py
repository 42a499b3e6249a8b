"""The step's keys in one order and its masks over them: what the torch ops and the C kernels' prefill attend with.

Keys are ``[sealed blocks | open block | this step's rows]`` (a step across blocks adds the blocks it seals, after
them): column ``j < sealed_max * block_size`` is row ``j % bs`` of each sequence's sealed block ``j // bs`` of its
block table (from ``first`` on: a window ring's view), then ``open_max`` open rows, then ``T`` new rows. ``MaskedStep``
holds which of them exist, the additive mask of the step (a local layer's with its window), the key and query
positions, and, for the layers of a window ring, a view of the step over the ring's blocks (``ring_view``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from trtkv.attention.base import AttentionStep
from trtkv.quant import QuantizedTensor


@dataclass
class MaskedStep(AttentionStep):
    mask: torch.Tensor | None = None  # [B, 1, T, C + T] bool
    kv_valid: torch.Tensor | None = None  # [B, C] bool: context keys that exist
    kv_invalid: torch.Tensor | None = None  # its negation
    sealed_all_valid: bool = True  # every sequence has sealed_max sealed blocks (nothing to zero)
    sealed_max: int = 0
    open_max: int = 0
    held: torch.Tensor | None = None  # [B] sealed blocks each sequence reads, from column 0 of its block table
    first_pos: torch.Tensor | None = None  # [B] position of sealed column 0's first row (a ring view: its first block)
    key_pos: torch.Tensor | None = None  # [B, C + T] positions of the mask's keys
    query_pos: torch.Tensor | None = None  # [B, T]
    window_masks: dict = dataclasses.field(default_factory=dict)  # sliding window -> its mask, built once per step
    biases: dict = dataclasses.field(default_factory=dict)  # (window, G) -> additive mask (``mask_bias``)
    # a ring view's: [B] bool, True where gathered column 0 is the sequence's first block (its sink rows apply);
    # None: true for every sequence (the block tables start at block 0)
    sink_ok: torch.Tensor | None = None
    ring: "MaskedStep | None" = None  # the view of this step the ringed (sliding) layers read, built once per step

    def build(self, first: torch.Tensor | None = None) -> "MaskedStep":
        """Key validity and the [B, 1, T, C + T] mask (C: gathered context keys); ``first`` [B]: the gathered sealed
        blocks start at each sequence's block ``first`` (a ring view), not block 0."""
        b, bs, dev = self.batch, self.cache.block_size, self.device
        sealed = b.context_lens // bs
        opened = b.context_lens - sealed * bs
        held = sealed if first is None else sealed - first
        self.sealed_max, self.open_max = int(held.max()), int(opened.max())
        self.held = held
        self.first_pos = torch.zeros_like(held) if first is None else first * bs
        kv_valid = []
        if self.sealed_max:
            kv_valid.append(torch.arange(self.sealed_max * bs, device=dev)[None, :] < (held * bs)[:, None])
        if self.open_max:
            kv_valid.append(torch.arange(self.open_max, device=dev)[None, :] < opened[:, None])
        B, T = b.input_ids.shape
        self.kv_valid = torch.cat(kv_valid, 1) if kv_valid else torch.zeros(B, 0, dtype=torch.bool, device=dev)
        self.kv_invalid = ~self.kv_valid
        self.sealed_all_valid = bool((held == self.sealed_max).all())
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        self.mask = torch.cat([self.kv_valid[:, None, :].expand(B, T, -1), causal[None].expand(B, T, T)], 2)[:, None]
        # positions of the keys in that order (sealed j -> j; open row i -> sealed tokens + i; new row t -> context + t)
        # and of the queries: what a sliding window compares
        keys = [torch.arange(self.sealed_max * bs, device=dev).expand(B, -1) + (0 if first is None else first[:, None] * bs),
                (sealed * bs)[:, None] + torch.arange(self.open_max, device=dev)[None, :],
                b.context_lens[:, None] + torch.arange(T, device=dev)[None, :]]
        self.key_pos = torch.cat(keys, 1)
        self.query_pos = keys[2]
        return self

    def ring_view(self) -> "MaskedStep":
        """The step as a ringed layer reads it: each sequence's sealed blocks from ``first_block`` (the first its window
        covers) on, addressed in the ring (``WindowRing.block``), with their own mask and key positions."""
        if self.ring is None:
            ring, b = self.cache.ring, self.batch
            sealed = b.context_lens // ring.block_size
            first = ring.first_block(b.context_lens)
            cols = first[:, None] + torch.arange(max(1, int((sealed - first).max())), device=self.device)[None, :]
            tables = ring.block(b.slot_ids[:, None], cols)  # columns past a sequence's sealed blocks are masked
            view = type(self)(backend=self.backend, batch=dataclasses.replace(b, block_tables=tables), cache=self.cache,
                              valid=self.valid, sink_ok=first == 0)
            self.ring = view.build(first)
        return self.ring

    def window_mask(self, window: int) -> torch.Tensor:
        """``mask`` of a local layer: also ``key position > query position - window`` (transformers' rule)."""
        got = self.window_masks.get(window)
        if got is None:
            inside = self.key_pos[:, None, :] > (self.query_pos - window)[:, :, None]  # [B, T, C + T]
            got = self.window_masks[window] = self.mask & inside[:, None]
        return got

    def mask_bias(self, window: int | None, G: int, dtype) -> torch.Tensor:
        """0 / -inf [B, 1, G * T, C + T] of the step's mask (a local layer's: with its window), GQA rows repeated; built
        once per step and reused by every layer (an add instead of a negation and a fill per layer)."""
        got = self.biases.get(window)
        if got is None:
            mask = self.mask if window is None else self.window_mask(window)
            B, _, T, C = mask.shape
            mask = mask if G == 1 else mask[:, :, None].expand(B, 1, G, T, C).reshape(B, 1, G * T, C)
            got = self.biases[window] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return got

    def open_rows(self, layer: int, which: str, new_rows: torch.Tensor) -> torch.Tensor:
        """``[B, H, open_max + T, D]`` in model space: each slot's open block (stale rows zeroed), then ``new_rows``."""
        pool = self.cache.pool(layer, which)
        rest = torch.cat([self.cache.layout_of(layer).open_rows(pool.tail, self.open_max)[self.batch.slot_ids].to(new_rows.dtype), new_rows], 2)
        if self.open_max:
            rest[:, :, : self.open_max].masked_fill_(self.kv_invalid[:, None, self.sealed_max * self.cache.block_size :, None], 0)  # stale rows
        return rest

    def sealed_blocks(self, pool) -> QuantizedTensor:
        """The batch's first ``sealed_max`` blocks of ``pool``, gathered [B * sealed_max, ...] (``index_select``: the
        advanced-index gather is 10-30x slower on CPU). Table entries < 0 read block 0; callers mask them."""
        flat = self.batch.block_tables[:, : self.sealed_max].clamp(min=0).reshape(-1)
        return QuantizedTensor(*(None if t is None else t.index_select(0, flat)
                                 for t in (pool.data, pool.scale, pool.zero, pool.outlier_index, pool.outlier_value)))

    def where_sink(self, from_sink: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        """``from_sink`` (computed from the sink rows) for the sequences whose gathered column 0 is their first block,
        ``gathered`` for the others (a ring view past the window's first block: no sink rows apply)."""
        if self.sink_ok is None:
            return from_sink
        return torch.where(self.sink_ok.view(-1, *(1,) * (from_sink.dim() - 1)), from_sink, gathered)
