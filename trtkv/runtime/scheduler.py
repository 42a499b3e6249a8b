"""Continuous batching: which sequences run in the next engine step, and with how many tokens.

Policy, every step:

1. **Running sequences first**, decodes before prefills, oldest first. Each gets one chunk of its
   pending tokens that ends at the next block boundary (an engine step never crosses one), at most
   ``max_step_tokens`` and what is left of the step's token budget ``max_num_batched_tokens``. With an
   engine that takes chunks across blocks (``cross_blocks``: the torch engine on CPU, see
   docs/kv-cache-format.md) a chunk runs to the budget instead, over as many blocks as it needs.
2. A chunk that fills open blocks needs a pool block for each to seal into. If none is free the **newest**
   running sequence is preempted (recompute: its blocks and slot are freed, it goes back to the
   front of the queue and later prefills prompt + output again); if that is the sequence itself, it
   waits.
3. **Admission**: waiting sequences, first come first served, while a slot is free, budget is
   left and the free blocks cover the new prompt's sealed blocks on top of what running prefills
   still need. Nothing is admitted in a step that preempted. With prefix caching a new sequence first
   takes the cached blocks its prompt starts with (runtime/prefix_cache.py) and needs only the rest.

A request whose prompt plus ``max_tokens`` needs more blocks than the whole pool, or more tokens
than the engine's context, is rejected when it is added.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from trtkv.cache_layout import chunk_length
from trtkv.errors import TrtkvError
from trtkv.runtime.block_manager import BlockManager
from trtkv.runtime.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class Chunk:
    """``length`` tokens of ``seq`` starting at ``start`` (== its ``num_cached``) go into one step."""

    seq: Sequence
    start: int
    length: int

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the sequence's last token: its logits give the next token."""
        return self.start + self.length == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    decode: list[Chunk] = field(default_factory=list)  # one generated token each
    prefill: list[Chunk] = field(default_factory=list)  # prompt tokens (one, when a prefix hit leaves one), or several
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.decode) + sum(c.length for c in self.prefill)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int = 512,
        max_step_tokens: int | None = None,
        max_model_len: int | None = None,
        cross_blocks: bool = False,
        whole_blocks: bool = False,
    ):
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.max_num_seqs = min(max_num_seqs or block_manager.num_slots, block_manager.num_slots)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cross_blocks = cross_blocks  # the engine takes a chunk over several blocks (sealing them in the step)
        # deterministic mode: a chunk is never cut by the step's token budget (it waits for a step with room), so every
        # prefill chunk is a whole block from a block boundary or the rest of the prompt, whatever else runs
        self.whole_blocks = whole_blocks
        self.max_step_tokens = max_num_batched_tokens if cross_blocks else min(max_step_tokens or self.block_size, self.block_size)
        if whole_blocks:  # a step must hold a whole block
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_step_tokens)
        self._share = self.max_step_tokens  # this step's most tokens per prefill chunk (``_prefill_share``)
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self.num_preemptions = 0
        self.swapper = None  # a runtime.swap.Swapper: preempt by swapping (exact) instead of recomputing

    # -- requests
    def check(self, seq: Sequence) -> None:
        """Reject a request that could never run, with the reason and the limit."""
        total = len(seq.prompt_ids) + seq.params.max_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise TrtkvError(
                f"prompt ({len(seq.prompt_ids)} tokens) + max_tokens ({seq.params.max_tokens}) = {total} tokens exceeds the "
                f"engine's context of {self.max_model_len} tokens",
                "shorten the prompt or lower max_tokens",
            )
        need = self.bm.max_blocks(seq)
        if need > self.bm.num_blocks:
            raise TrtkvError(
                f"prompt ({len(seq.prompt_ids)} tokens) + max_tokens ({seq.params.max_tokens}) needs {need} KV blocks of "
                f"{self.block_size} tokens but the whole pool has {self.bm.num_blocks}",
                "shorten the prompt, lower max_tokens, or serve with a larger --kv-memory",
            )

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.finish(seq, reason)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if self.swapper is not None:
            self.swapper.discard(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._share = self._prefill_share(budget)
        order = sorted(self.running, key=lambda s: (s.in_prefill, self.running.index(s)))
        for seq in order:
            if budget <= 0:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            chunk = self._chunk(seq, budget)
            if chunk.length > budget:  # whole_blocks: not cut, it waits for the next step
                continue
            if not self._reserve_block(seq, chunk, out):
                continue
            budget -= chunk.length
            (out.prefill if chunk.length > 1 or chunk.start < len(seq.prompt_ids) else out.decode).append(chunk)
        if not out.preempted:
            budget = self._admit(out, budget)
        return out

    def _prefill_share(self, budget: int) -> int:
        """The most tokens one prefill chunk takes this step. Across blocks: all of it for a single prompt, else the
        budget left after the decodes split evenly (in whole blocks, one at least) over the sequences that want a chunk -- the running ones with
        more than one token pending and the waiting ones the free slots could admit -- so that one prompt gets the
        whole budget (one step instead of one per block) and many prompts get a block each, like block-wise steps
        (a prefill over several blocks attends over its in-step blocks twice: fewer of them cost less)."""
        if not self.cross_blocks:
            return self.max_step_tokens
        decodes = sum(1 for s in self.running if s.num_pending == 1)
        wanting = sum(1 for s in self.running if s.num_pending > 1) + min(len(self.waiting), self.bm.num_free_slots)
        if wanting <= 1:
            return budget
        return max(self.block_size, (budget - decodes) // wanting // self.block_size * self.block_size)

    def _chunk(self, seq: Sequence, budget: int) -> Chunk:
        limit = min(self.max_step_tokens, budget, self._share)
        if self.whole_blocks:
            limit = self.max_step_tokens  # its natural length; schedule() skips it when the budget is short
        return Chunk(seq, seq.num_cached, chunk_length(seq.num_cached, seq.num_pending, None if self.cross_blocks else self.block_size, limit))

    def _natural_length(self, seq: Sequence) -> int:
        """The first chunk of a waiting sequence in whole-blocks mode, after its prefix hit (an upper bound without one)."""
        start = len(self._prefix_hit(seq)) * self.block_size if not seq.num_cached else seq.num_cached
        return chunk_length(start, seq.num_tokens - start, self.block_size, self.max_step_tokens)

    def _blocks_needed(self, chunk: Chunk) -> int:
        """Pool blocks ``chunk`` seals into that its sequence does not hold yet (0 or 1 unless chunks cross blocks)."""
        return max(0, (chunk.start + chunk.length) // self.block_size - len(chunk.seq.block_table))

    def _reserve_block(self, seq: Sequence, chunk: Chunk, out: SchedulerOutput) -> bool:
        """Allocate the blocks ``chunk`` seals into, preempting the newest sequences if needed."""
        need = self._blocks_needed(chunk)
        if not need:
            return True
        while not self.bm.can_append(need):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            for lst in (out.decode, out.prefill):
                lst[:] = [c for c in lst if c.seq is not victim]
            if victim is seq:
                return False
        for _ in range(need):
            self.bm.append_block(seq)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and slot and requeue it first. With a swapper its cache is saved to
        host memory and restored on admission (exact); without one, prompt + output is prefilled again."""
        self.running.remove(seq)
        if self.swapper is not None:
            self.swapper.swap_out(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        committed = sum(self.bm.blocks_to_finish(s) for s in self.running)
        while self.waiting and budget > 0 and self.bm.num_free_slots and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.whole_blocks and self._natural_length(seq) > budget:
                break  # its first chunk would be cut: admitted in a later step
            hit = self._prefix_hit(seq)
            need = self.bm.blocks_for(seq.num_tokens) - len(hit)
            if self.bm.num_free_blocks - self.bm.prefix_evictable(hit) - committed < need:
                break
            self.waiting.popleft()
            self.bm.allocate_slot(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if hit:
                self.bm.prefix.take(seq, hit)
            self._swap_in(seq)
            chunk = self._chunk(seq, budget)
            reserved = self._reserve_block(seq, chunk, out)
            assert reserved, "admission checked the free blocks"
            committed += need + len(hit) - len(seq.block_table)
            budget -= chunk.length
            (out.prefill if chunk.length > 1 or chunk.start < len(seq.prompt_ids) else out.decode).append(chunk)
        return budget

    def _swap_in(self, seq: Sequence) -> None:
        """A swapped-out sequence gets blocks for its saved sealed blocks and resumes where it stopped."""
        if self.swapper is None or seq not in self.swapper:
            return
        for _ in range(self.swapper.blocks_needed(seq)):
            self.bm.append_block(seq)
        self.swapper.swap_in(seq)

    def _prefix_hit(self, seq: Sequence) -> list[int]:
        """Cached pool blocks ``seq`` can start from (runtime/prefix_cache.py): only for a sequence with nothing computed."""
        if self.bm.prefix is None or seq.num_cached or (self.swapper is not None and seq in self.swapper):
            return []
        return self.bm.prefix.match(seq)

    def postprocess(self, out: SchedulerOutput) -> None:
        """Mark the scheduled tokens cached (the runtime has written their K/V rows); register the blocks they sealed."""
        for chunk in out.decode + out.prefill:
            seq, end = chunk.seq, chunk.start + chunk.length
            seq.num_cached = end
            if self.bm.prefix is None:
                continue
            # a block is cached only if every step that filled it was a full one (PrefixCache: "Which blocks")
            bs, offset = self.block_size, chunk.start % self.block_size
            if not self.cross_blocks:
                full = chunk.length == min(self.max_step_tokens, bs - offset)
                seq.block_full_steps = full and (offset == 0 or seq.block_full_steps)
                if end % bs == 0 and seq.block_full_steps:
                    self.bm.prefix.register(seq, end // bs - 1)
                continue
            # a chunk across blocks fills the blocks after its first one whole; its first block counts when the chunk
            # began it or the steps before were full ones; the block it ends in goes on as full when the token budget,
            # not the prompt, ended the chunk
            first = chunk.start // bs
            for block in range(first, end // bs):
                if block > first or offset == 0 or seq.block_full_steps:
                    self.bm.prefix.register(seq, block)
            began = end // bs > first or offset == 0 or seq.block_full_steps
            seq.block_full_steps = seq.num_tokens > end and began
