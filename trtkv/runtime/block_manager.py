"""Pool blocks and sequence slots: sized from a memory budget, handed to sequences, freed on finish.

Memory is counted in the cache's own bytes (``PagedKVLayout.bytes_per_block`` and
``tail_bytes_per_slot``, times the number of layers): every slot costs one fp16 open block per layer
and K/V whether it is used or not, and the rest of the budget becomes pool blocks of the format. So
the same budget holds ~3.5x the sealed tokens in int4 as in fp16.

A sequence holds a slot from admission to finish (or preemption) and one pool block per sealed
block of its tokens. The block that receives an open block is allocated when the step that fills it
is scheduled (``append_block``), so a step can always seal what it completes.

With a ``PrefixCache`` (runtime/prefix_cache.py) a pool block is *free* (on the free list), *used*
(held by one or more sequences) or *cached* (sealed, registered under its key, held by nobody): cached
blocks count as allocatable and are evicted, least recently released first, when the free list is empty.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from trtkv.errors import TrtkvError
from trtkv.runtime.sequence import Sequence

GIB = 1024**3


@dataclass(frozen=True)
class CacheBudget:
    """How a KV memory budget splits into sequence slots and pool blocks."""

    budget_bytes: int
    bytes_per_block: int  # one pool block, K and V, all layers
    bytes_per_slot: int  # one slot's open blocks, K and V, all layers
    block_size: int
    num_slots: int
    num_blocks: int

    @classmethod
    def plan(cls, budget_bytes: int, *, bytes_per_block: int, bytes_per_slot: int, block_size: int, num_slots: int,
             blocks_when_free: int = 0) -> "CacheBudget":
        """``bytes_per_block`` 0 (every layer keeps a window ring, nothing in the block tables' pool): the pool gets
        ``blocks_when_free`` blocks, which cost nothing (the block tables still count each sequence's sealed blocks)."""
        if num_slots < 1:
            raise TrtkvError(f"need at least one sequence slot, got {num_slots}", "pass --max-seqs 1 or more")
        slot_bytes = num_slots * bytes_per_slot
        num_blocks = (budget_bytes - slot_bytes) // bytes_per_block if bytes_per_block else blocks_when_free * (budget_bytes >= slot_bytes)
        if num_blocks < 1:
            need = (slot_bytes + bytes_per_block) / GIB
            raise TrtkvError(
                f"a KV budget of {budget_bytes / GIB:.3f} GiB does not hold {num_slots} sequence slots "
                f"({slot_bytes / GIB:.3f} GiB of open blocks and window rings) and one pool block",
                f"raise --kv-memory to at least {need:.3f} GiB or lower --max-seqs",
            )
        return cls(budget_bytes, bytes_per_block, bytes_per_slot, block_size, num_slots, int(num_blocks))

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (
            f"{self.num_blocks} blocks x {self.block_size} tokens ({self.pool_tokens} sealed tokens, "
            f"{self.bytes_per_block / 1024:.1f} KiB/block) + {self.num_slots} slots "
            f"({self.bytes_per_slot / 1024:.1f} KiB/slot) in {self.budget_bytes / GIB:.3f} GiB"
        )


class BlockManager:
    """Free lists of pool blocks and slots; block tables live on the sequences."""

    def __init__(self, num_blocks: int, num_slots: int, block_size: int, prefix=None):
        self.prefix = prefix  # a runtime.prefix_cache.PrefixCache, or None: no prefix caching
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.free_slots: deque[int] = deque(range(num_slots))

    # -- accounting
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: the free list plus the cached blocks it may evict."""
        return len(self.free_blocks) + self.num_cached_blocks

    @property
    def num_cached_blocks(self) -> int:
        return 0 if self.prefix is None else self.prefix.num_cached

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def prefix_evictable(self, blocks: list[int]) -> int:
        """How many of the cached ``blocks`` a hit would take out of what can be allocated."""
        return 0 if self.prefix is None else self.prefix.num_evictable(blocks)

    def blocks_for(self, num_cached_tokens: int) -> int:
        """Pool blocks a sequence with this many cached tokens holds (its sealed blocks)."""
        return num_cached_tokens // self.block_size

    def blocks_to_finish(self, seq: Sequence) -> int:
        """Pool blocks still to allocate for ``seq`` to cache every token it has now."""
        return max(0, self.blocks_for(seq.num_tokens) - len(seq.block_table))

    def max_blocks(self, seq: Sequence) -> int:
        """Pool blocks ``seq`` needs at its longest: the last sampled token is never cached."""
        return self.blocks_for(len(seq.prompt_ids) + seq.params.max_tokens - 1)

    # -- allocation
    def allocate_slot(self, seq: Sequence) -> None:
        assert seq.slot is None, seq
        if not self.free_slots:
            raise RuntimeError("no free slot (the scheduler admits only when one is free)")
        seq.slot = self.free_slots.popleft()

    def can_append(self, n: int = 1) -> bool:
        return self.num_free_blocks >= n

    def append_block(self, seq: Sequence) -> int:
        """Give ``seq`` the pool block for its next sealed block (evicting the oldest cached block if none is free)."""
        if self.free_blocks:
            block = self.free_blocks.popleft()
        elif self.num_cached_blocks:
            block = self.prefix.evict()
        else:
            raise RuntimeError("no free block (the scheduler preempts before this happens)")
        seq.block_table.append(block)
        return block

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks and slot (finish, abort or preemption). Shared blocks lose one reference;
        the last one makes them cached. Released last block first, so that a chain is evicted from its end."""
        for block in reversed(seq.block_table):
            if self.prefix is None or not self.prefix.release(block):
                self.free_blocks.append(block)
        seq.block_table = []
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None
        seq.num_cached = 0
