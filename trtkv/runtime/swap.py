"""Preemption by swapping: a preempted sequence's cache goes to host memory and comes back bit for bit.

Recomputing a preempted sequence (prefilling prompt + output again) computes its K/V rows in a
different chunking than the steps that first produced them; the rows then differ in their last bits,
and a quantized format (int4 above all) can round one of them to a different code — the same prompt
gave a different output once preempted. Sealed blocks and the open block are exact, so
they are copied out instead: ``swap_out`` saves the sequence's sealed pool blocks and its slot's open
block (sink rows included) -- and, in a cache with a window ring, its slot's ring blocks -- before the block
manager frees them; ``swap_in`` writes them into the
blocks and slot the sequence is given when it is admitted again and restores ``num_cached``, so the
sequence resumes exactly where it stopped. The copies live in host memory until then (or until the
request is aborted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.sequence import Sequence


@dataclass
class SwappedKV:
    num_cached: int
    num_blocks: int  # sealed blocks saved (== num_cached // block_size)
    tensors: dict[str, torch.Tensor]  # name -> [L, num_blocks, ...], or the slot's entries (``PagedKVCache.slot_index``)


class Swapper:
    """Host copies of preempted sequences' caches, keyed by sequence id."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.saved: dict[int, SwappedKV] = {}

    def __contains__(self, seq: Sequence) -> bool:
        return seq.seq_id in self.saved

    def blocks_needed(self, seq: Sequence) -> int:
        s = self.saved.get(seq.seq_id)
        return 0 if s is None else s.num_blocks

    def swap_out(self, seq: Sequence) -> None:
        """Copy ``seq``'s sealed blocks and open block to host memory (call before its blocks are freed)."""
        n = seq.num_cached // self.cache.block_size
        blocks = torch.tensor(seq.block_table[:n], dtype=torch.long)
        saved = {}
        for name, t in self.cache.tensors.items():
            own = self.cache.slot_index(name, seq.slot)
            if own is not None:
                saved[name] = t[:, own].to("cpu", copy=True)
            else:
                saved[name] = t[:, blocks.to(t.device)].to("cpu", copy=True)
        self.saved[seq.seq_id] = SwappedKV(seq.num_cached, n, saved)

    def swap_in(self, seq: Sequence) -> None:
        """Write the saved rows into ``seq``'s new blocks (its block table's first ones) and slot; restore ``num_cached``."""
        s = self.saved.pop(seq.seq_id)
        assert len(seq.block_table) >= s.num_blocks and seq.slot is not None, seq
        blocks = torch.tensor(seq.block_table[: s.num_blocks], dtype=torch.long)
        for name, t in self.cache.tensors.items():
            own = self.cache.slot_index(name, seq.slot)
            if own is not None:
                t[:, own] = s.tensors[name].to(t.device)
            else:
                t[:, blocks.to(t.device)] = s.tensors[name].to(t.device)
        seq.num_cached = s.num_cached

    def discard(self, seq: Sequence) -> None:
        self.saved.pop(seq.seq_id, None)
