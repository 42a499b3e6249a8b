"""Prefix caching over sealed blocks: requests that share a prompt prefix share its pool blocks.

A sealed block is immutable and depends only on the tokens up to its end (the open-page contract:
the rows of block ``j`` were computed by queries that saw blocks ``< j`` sealed and block ``j`` in
fp16), so it can be reused by every sequence whose first ``(j+1) * block_size`` tokens are the same.

**Keys.** Block ``j`` of a sequence is keyed by a hash chain: ``key_j = H(key_{j-1}, tokens of block j)``,
with ``key_{-1} = H(salt)``; the salt names what else makes the sealed bytes reproducible — the KV
format (codes, scales, sink tokens), the block size and the engine (its manifest: model, weights,
calibration constants). A first block's sink rows are a function of its first ``S`` tokens, which are
part of ``key_0``; the entry of a first block keeps a copy of them (the owner's slot had them).

**Which blocks.** Only a block computed the canonical way a prefill computes it is registered: in steps
that each took the most tokens a step may (one step of ``block_size`` tokens, or of the engine's
``max_new_tokens_per_step`` when that is smaller). A block filled otherwise (decodes, the end of a
prompt, a chunk cut by the step's token budget) holds rows computed in other matmul shapes, whose last
bits differ from a one-step prefill's; reusing it would make a hit differ from a recomputation in its
log-probabilities (measured on the tiny model: a second turn's block of prompt end + first outputs)
and, in a quantized format, possibly in a code — the reason preemption swaps instead of recomputing.
So a hit is bit-equal to what the request computes without the cache, and a second chat turn reuses
the blocks of the first turn's prompt, not those of its answer.

**Life of a block.** A block is *registered* when the sequence that sealed it finishes the step (one
reference, its owner). A hit takes a reference; ``free`` drops one. A registered block that nobody
references is *cached*: it stays in the pool, addressable by its key, until an allocation finds no
free block and evicts the least recently released one (LRU). Blocks never registered (a duplicate of
a key already cached, or a block restored from a swap) go back to the free list as before.

**A hit** (at admission, for a sequence that has computed nothing yet) gives the sequence the longest
chain of cached blocks that matches its tokens, at most ``(prompt_len - 1) // block_size`` of them:
when the prompt ends exactly at a block boundary its last full block is recomputed, because the last
token's query must see its own block in fp16 (reusing the sealed copy and recomputing just that token
would attend to the quantized rows of its own block and change the logits). The sequence resumes at a
block boundary with an empty open block; a hit of block 0 also copies its sink rows into the slot.

**Preemption (swap to host).** ``free`` on a swapped-out sequence drops its references: a block others
still reference stays (refcounted), one nobody does becomes cached. The host copy is complete, so
swap-in writes it into fresh private blocks and never depends on the cache keeping anything.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

from trtkv.errors import TrtkvError
from trtkv.runtime.sequence import Sequence

SINK_TENSORS = ("k_tail", "v_tail")


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a block: its parent's key and its tokens (blake2b, 128 bits)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class PrefixCache:
    """Keys, reference counts and the LRU of cached blocks of one pool (the block manager calls it)."""

    def __init__(self, block_size: int, salt: str, cache=None):
        if getattr(cache, "ring", None) is not None:  # a hit would need the sliding layers' blocks the ring has freed
            raise TrtkvError("prefix caching needs every layer's sealed blocks, and this cache frees the sliding layers' (a window ring)",
                             "serve with --keep-window-blocks to cache prefixes, or with --no-prefix-cache")
        self.block_size = block_size
        self.root = hashlib.blake2b(salt.encode(), digest_size=16).digest()
        self.cache = cache  # the PagedKVCache, for sink rows (None: no sink rows to keep)
        self.block_of: dict[bytes, int] = {}  # key -> pool block
        self.key_of: dict[int, bytes] = {}  # pool block -> key (registered blocks only)
        self.refs: dict[int, int] = {}  # registered pool block -> sequences holding it
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached (unreferenced) blocks, oldest first
        self.sinks: dict[int, dict[str, torch.Tensor]] = {}  # first blocks -> their sink rows
        self.hit_tokens = 0
        self.evicted = 0

    # -- accounting
    @property
    def num_cached(self) -> int:
        return len(self.lru)

    def keys(self, seq: Sequence, n: int) -> list[bytes]:
        """The keys of ``seq``'s first ``n`` full blocks (extended lazily: tokens only ever append)."""
        bs, ks = self.block_size, seq.block_keys
        while len(ks) < n:
            j = len(ks)
            ks.append(chain_hash(ks[-1] if ks else self.root, seq.tokens(j * bs, (j + 1) * bs)))
        return ks[:n]

    # -- hits
    def match(self, seq: Sequence) -> list[int]:
        """Pool blocks of the longest cached chain of ``seq``'s prompt that leaves its last token to compute."""
        blocks = []
        for key in self.keys(seq, (len(seq.prompt_ids) - 1) // self.block_size):
            b = self.block_of.get(key)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of ``blocks`` are cached (unreferenced): taking them removes them from what can be allocated."""
        return sum(1 for b in blocks if b in self.lru)

    def take(self, seq: Sequence, blocks: list[int]) -> None:
        """Give ``seq`` (fresh, with a slot) the hit ``blocks``: references, block table, sink rows, ``num_cached``."""
        assert not seq.block_table and seq.num_cached == 0 and seq.slot is not None, seq
        for b in blocks:
            self.lru.pop(b, None)
            self.refs[b] += 1
        seq.block_table = list(blocks)
        seq.num_cached = len(blocks) * self.block_size
        self.hit_tokens += seq.num_cached
        if blocks and blocks[0] in self.sinks:
            for name, rows in self.sinks[blocks[0]].items():
                self.cache.layout.sink_rows(self.cache.tensors[name][:, seq.slot]).copy_(rows)

    # -- registration (after a step sealed block ``index`` of ``seq``)
    def register(self, seq: Sequence, index: int) -> None:
        block = seq.block_table[index]
        if block in self.key_of:
            return  # a hit: already registered
        key = self.keys(seq, index + 1)[index]
        if key in self.block_of:
            return  # the same block sealed twice (two equal prompts in one step): this copy stays private
        self.block_of[key] = block
        self.key_of[block] = key
        self.refs[block] = 1
        if index == 0 and self.cache is not None and self.cache.layout.sink_tokens:
            self.sinks[block] = {n: self.cache.layout.sink_rows(self.cache.tensors[n][:, seq.slot]).clone() for n in SINK_TENSORS}

    # -- release and eviction (the block manager's free list holds only unregistered blocks)
    def release(self, block: int) -> bool:
        """Drop one reference to ``block``; False when it is not registered (the caller frees it)."""
        if block not in self.key_of:
            return False
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.lru[block] = None
        return True

    def evict(self) -> int:
        """Forget the least recently released cached block and return it (the caller allocates it)."""
        block, _ = self.lru.popitem(last=False)
        key = self.key_of.pop(block)
        del self.block_of[key], self.refs[block]
        self.sinks.pop(block, None)
        self.evicted += 1
        return block
