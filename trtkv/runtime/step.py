"""One engine step: the inputs and outputs of the step contract (docs/kv-cache-format.md, "The engine step contract").

A step processes ``B`` sequences with up to ``T`` new tokens each, padded to ``[B, T]``; it never crosses a
block boundary for any sequence (``context_lens[b] % block_size + new_lens[b] <= block_size``). The cache
tensors are not part of the batch: they live in ``trtkv.runtime.kv_pool.PagedKVCache``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtkv.errors import TrtkvError
from trtkv.quant import QuantizedTensor


@dataclass
class StepBatch:
    """The per-step inputs of the step network (all int64, on the engine's device)."""

    input_ids: torch.Tensor  # [B, T] new tokens; positions context_lens[b] + t
    context_lens: torch.Tensor  # [B] tokens already cached (sealed + open) before this step
    new_lens: torch.Tensor  # [B] valid new tokens 1..T (the rest of the row is padding)
    block_tables: torch.Tensor  # [B, max_blocks] sealed blocks; entries past context_lens // block_size ignored (-1)
    slot_ids: torch.Tensor  # [B] each sequence's open-block slot

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def validate(self, block_size: int) -> None:
        """Refuse a batch that breaks the contract (shapes, lengths, block boundaries)."""
        B, T = self.input_ids.shape
        for name in ("context_lens", "new_lens", "slot_ids"):
            if tuple(getattr(self, name).shape) != (B,):
                raise TrtkvError(f"StepBatch.{name} has shape {list(getattr(self, name).shape)}, expected [{B}]", "one entry per sequence")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != B:
            raise TrtkvError(f"StepBatch.block_tables has shape {list(self.block_tables.shape)}, expected [{B}, max_blocks]", "one row per sequence")
        if bool(((self.new_lens < 1) | (self.new_lens > T)).any()):
            raise TrtkvError(f"StepBatch.new_lens must be in 1..{T}, got {self.new_lens.tolist()}", "pad rows, never send an empty one")
        if bool((self.context_lens % block_size + self.new_lens > block_size).any()):
            raise TrtkvError(
                f"a step crosses a block boundary (block_size {block_size}, context_lens {self.context_lens.tolist()}, new_lens {self.new_lens.tolist()})",
                "split prefills at block boundaries (trtkv.cache_layout.block_chunks)",
            )
        sealed = self.context_lens // block_size
        if bool((sealed > self.block_tables.shape[1]).any()):
            raise TrtkvError("block_tables has fewer columns than sealed blocks", "size block_tables to the longest context")

    @classmethod
    def make(cls, rows: list[list[int]], context_lens: list[int], block_tables: list[list[int]], slot_ids: list[int],
             min_len: int = 1) -> "StepBatch":
        """Pad ``rows`` of new tokens (any lengths, to ``min_len`` at least) and ``block_tables`` (with -1) into a batch."""
        B = len(rows)
        T = max(min_len, max(len(r) for r in rows))
        MB = max(1, max((len(b) for b in block_tables), default=1))
        ids = torch.zeros(B, T, dtype=torch.long)
        bt = torch.full((B, MB), -1, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            if block_tables[i]:
                bt[i, : len(block_tables[i])] = torch.tensor(block_tables[i], dtype=torch.long)
        return cls(
            input_ids=ids,
            context_lens=torch.tensor(context_lens, dtype=torch.long),
            new_lens=torch.tensor([len(r) for r in rows], dtype=torch.long),
            block_tables=bt,
            slot_ids=torch.tensor(slot_ids, dtype=torch.long),
        )


    def padded_to(self, batch: int, max_blocks: int) -> "StepBatch":
        """This decode batch grown to ``batch`` rows and ``max_blocks`` table columns, the fixed shapes a captured
        CUDA graph replays. Padding rows decode one token at context 0 in slot 0: they read nothing (no sealed
        block, an empty open block) and the caller drops their outputs; table padding is -1 (never read)."""
        B, T = self.input_ids.shape
        if batch < B or max_blocks < self.block_tables.shape[1]:
            raise ValueError(f"cannot pad a [{B}, {self.block_tables.shape[1]}] batch to [{batch}, {max_blocks}]")
        grow = batch - B

        def rows(t: torch.Tensor, fill: int) -> torch.Tensor:
            return torch.cat([t, t.new_full((grow, *t.shape[1:]), fill)]) if grow else t

        tables = self.block_tables
        if max_blocks > tables.shape[1]:
            tables = torch.cat([tables, tables.new_full((B, max_blocks - tables.shape[1]), -1)], 1)
        return StepBatch(rows(self.input_ids, 0), rows(self.context_lens, 0), rows(self.new_lens, 1), rows(tables, -1), rows(self.slot_ids, 0))


@dataclass
class StepSeals:
    """The blocks a step across blocks sealed itself (the torch engine's CPU prefill quantizes them in the step for its
    later queries): the pool stores these codes instead of quantizing the same rows a second time. Sequence ``b``
    sealed its blocks ``first[b] ... first[b] + count[b] - 1``; each ``QuantizedTensor`` holds ``[B * per_seq]``
    blocks, sequence-major (``b * per_seq + (block - first[b])``; padding past ``count[b]``)."""

    first: list[int]
    count: list[int]
    per_seq: int
    blocks: dict[tuple[int, str], QuantizedTensor]  # (layer, "k" / "v") -> the blocks as the seal stores them

    def position(self, b: int, block_index: int) -> int | None:
        """Where sequence ``b``'s block ``block_index`` is in ``blocks``, or None when the step did not seal it."""
        j = block_index - self.first[b]
        return b * self.per_seq + j if 0 <= j < self.count[b] else None


@dataclass
class StepOutput:
    """The step network's outputs."""

    logits: torch.Tensor  # [B, V] float32 at each sequence's last valid token ([B, T, V] for an all-logits build)
    new_k: torch.Tensor  # [L, B, T, H, D] float16: this step's K rows (after RoPE), model space
    new_v: torch.Tensor  # [L, B, T, H, D] float16
    sealed: StepSeals | None = None  # blocks the engine sealed in the step (None: the pool seals every block it fills)
