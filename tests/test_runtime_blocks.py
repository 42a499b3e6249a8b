"""The runtime's block accounting (block_manager.py, prefix_cache.py, scheduler.py, swap.py, kv_pool.py, step.py)
against a simple model, on random operation sequences: requests with shared prompt prefixes added, scheduled, stepped,
sampled, finished, aborted and preempted (by swapping or by recompute) in pools of odd sizes, odd block sizes, odd token
budgets and steps smaller than a block, with and without prefix caching and sink rows.

The "engine" writes, through the real ``PagedKVCache.write_new_rows`` (and its reference seal), rows that say which
token they are: K = (token id, position), V = (a hash of the prefix up to it, 1). After every step the test reads back
every cached position of every running sequence -- sealed rows from the pool blocks its block table names, sink rows
and open rows from its slot -- and compares them with its own tokens. So a block handed to two owners, evicted while
held, reused for another prefix, swapped back into the wrong place, or a slot reused too early, shows as a wrong row.
Besides: free + used + cached == total with no block in two states, reference counts equal to the holders, slots held
once, budgets kept, the scheduler's policy (decodes first, oldest first, chunks that end at block boundaries, preempt the
newest, requeue it first, admit in arrival order and never in a step that preempted), a block registered in the prefix
cache exactly when every step that filled it was a full one, and every request ends with its tokens.
"""

from __future__ import annotations

import hashlib
import random
import struct
from types import SimpleNamespace

import pytest
import torch

from trtkv.cache_layout import PagedKVLayout
from trtkv.errors import TrtkvError
from trtkv.formats import get_format
from trtkv.runtime.block_manager import GIB, BlockManager, CacheBudget
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.prefix_cache import PrefixCache, chain_hash
from trtkv.runtime.scheduler import Chunk, Scheduler, SchedulerOutput
from trtkv.runtime.sequence import SamplingParams, Sequence, SequenceStatus
from trtkv.runtime.step import StepBatch, StepOutput
from trtkv.runtime.swap import Swapper


def prefix_code(tokens) -> float:
    """A number for a prefix, exact in fp16 (an integer below 2048)."""
    return float(hash(tuple(tokens)) % 2039)


def make_cache(bs: int, sink: int, num_blocks: int, num_slots: int) -> PagedKVCache:
    spec = f"k=fp16,v=fp16,block={bs}" + (f",sink={sink}" if sink else "")
    return PagedKVCache(PagedKVLayout(get_format(spec), 1, 2, bs, num_blocks, num_slots), 1)


class Sim:
    """A scheduler over a real fp16 cache whose rows name their token; ``check`` compares the cache with the model."""

    def __init__(self, rng: random.Random, *, bs: int, sink: int, num_blocks: int, num_slots: int, budget: int, step_tokens: int | None,
                 prefix: bool, swap: bool, max_seqs: int | None = None, cross: bool = False):
        self.rng, self.bs, self.sink = rng, bs, sink
        self.cache = make_cache(bs, sink, num_blocks, num_slots)
        pc = PrefixCache(bs, "salt", self.cache) if prefix else None
        self.bm = BlockManager(num_blocks, num_slots, bs, pc)
        self.cross = cross  # an engine that takes chunks across blocks (the scheduler's cross_blocks)
        self.sched = Scheduler(self.bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_step_tokens=step_tokens, cross_blocks=cross)
        if swap:
            self.sched.swapper = Swapper(self.cache)
        self.step_tokens = min(step_tokens or bs, bs)
        self.seqs: list[Sequence] = []
        self.aborted: set[int] = set()
        self.full: dict[tuple[int, int], bool] = {}  # (seq id, block index) -> every chunk into it so far was a full one
        self.preemptions = 0
        self.early_stop = 0.03

    # -- the engine: the step's rows into the cache, as LLMEngine._run does
    def run(self, out: SchedulerOutput) -> None:
        chunks = out.prefill + out.decode
        if not chunks:
            return
        batch = StepBatch.make([c.seq.tokens(c.start, c.start + c.length) for c in chunks], [c.start for c in chunks],
                               [c.seq.block_table for c in chunks], [c.seq.slot for c in chunks])
        if not self.cross:
            batch.validate(self.bs)
        B, T = batch.input_ids.shape
        k = torch.zeros(1, B, T, 1, 2, dtype=torch.float16)
        v = torch.zeros_like(k)
        for b, c in enumerate(chunks):
            for t in range(c.length):
                pos = c.start + t
                k[0, b, t, 0] = torch.tensor([c.seq.token(pos), pos])
                v[0, b, t, 0] = torch.tensor([prefix_code(c.seq.tokens(0, pos + 1)), 1.0])
        sealed = self.cache.write_new_rows(batch, StepOutput(None, k, v))
        assert sealed == [b for b, c in enumerate(chunks) if (c.start + c.length) // self.bs > c.start // self.bs]

    # -- the model's view of one running sequence's cache
    def check_rows(self, s: Sequence) -> None:
        bs, S, cache = self.bs, self.sink, self.cache
        kt, vt = cache.tensors["k_tail"][0, s.slot, 0], cache.tensors["v_tail"][0, s.slot, 0]
        sealed = (s.num_cached // bs) * bs
        for p in range(s.num_cached):
            if p < sealed and not (p < S):
                kr, vr = cache.tensors["k_data"][0, s.block_table[p // bs], 0, p % bs], cache.tensors["v_data"][0, s.block_table[p // bs], 0, p % bs]
            elif p < sealed:  # a sink row of a sealed first block
                kr, vr = kt[bs + p], vt[bs + p]
            else:
                kr, vr = kt[p % bs], vt[p % bs]
            want_k = [float(s.token(p)), float(p)]
            want_v = [prefix_code(s.tokens(0, p + 1)), 1.0]
            assert kr.tolist() == want_k and vr.tolist() == want_v, (s, p, kr.tolist(), want_k, vr.tolist(), want_v)
        if S and sealed:  # the sealed first block holds row S in place of the sink rows
            b0 = s.block_table[0]
            for p in range(S):
                assert cache.tensors["k_data"][0, b0, 0, p].tolist() == [float(s.token(S)), float(S)]

    def check(self) -> None:
        bm, sched, pc = self.bm, self.sched, self.bm.prefix
        running = sched.running
        free = list(bm.free_blocks)
        assert len(free) == len(set(free)), "a block twice on the free list"
        cached = set(pc.lru) if pc else set()
        held: dict[int, list[Sequence]] = {}
        for s in running:
            assert s.status == SequenceStatus.RUNNING and s.slot is not None
            assert len(s.block_table) == s.num_cached // self.bs, s
            for b in s.block_table:
                held.setdefault(b, []).append(s)
        assert not (set(free) & cached) and not (set(free) & set(held)) and not (cached & set(held))
        assert set(free) | cached | set(held) == set(range(bm.num_blocks)), "a block lost"
        assert bm.num_free_blocks == len(free) + len(cached) and bm.num_used_blocks == len(held) and bm.num_cached_blocks == len(cached)
        for b, owners in held.items():
            if pc is not None and b in pc.key_of:
                assert pc.refs[b] == len(owners), (b, pc.refs[b], owners)
            else:
                assert len(owners) == 1, f"private block {b} held by {owners}"
        if pc is not None:
            assert all(pc.refs[b] == 0 for b in pc.lru) and set(pc.refs) == set(pc.key_of)
            assert {b: k for k, b in pc.block_of.items()} == pc.key_of
            assert not (set(pc.key_of) & set(free)), "a registered block on the free list"
            assert set(pc.sinks) <= set(pc.key_of)
        slots = [s.slot for s in running]
        assert len(set(slots)) == len(slots) and set(slots).isdisjoint(bm.free_slots)
        assert sorted(slots + list(bm.free_slots)) == list(range(bm.num_slots))
        assert len(running) <= sched.max_num_seqs
        for s in sched.waiting:
            assert s.status == SequenceStatus.WAITING and s.slot is None and s.block_table == [] and s.num_cached == 0
        if sched.swapper is not None:
            assert set(sched.swapper.saved) <= {s.seq_id for s in sched.waiting}
        for s in running:
            self.check_rows(s)

    def check_step(self, out: SchedulerOutput, running_before: list, waiting_before: list) -> None:
        sched, bs = self.sched, self.bs
        chunks = out.decode + out.prefill
        assert out.num_tokens == sum(c.length for c in chunks) <= sched.max_num_batched_tokens
        assert len({id(c.seq) for c in chunks}) == len(chunks)
        short = False
        for c in chunks:
            s = c.seq
            # across blocks: the budget (shared by the prompts wanting it) is the only cut, one token at least
            natural = min(s.num_pending, sched.max_num_batched_tokens) if self.cross else min(s.num_pending, self.step_tokens, bs - c.start % bs)
            assert c.start == s.num_cached and 1 <= c.length <= natural, (c, natural)
            short |= c.length < natural
            # decodes: one generated token; a prompt's tokens are a prefill chunk, also one (after a prefix hit)
            assert (c.length == 1 and c.start >= len(s.prompt_ids)) == (c in out.decode)
            assert c.samples == (c.start + c.length == s.num_tokens)
            assert len(s.block_table) == (c.start + c.length) // bs, "the block a step seals into is allocated before it"
        if short and not self.cross:  # a chunk is cut below its natural length only by the step's token budget
            assert out.num_tokens == sched.max_num_batched_tokens
        k = len(out.preempted)
        if k:
            assert out.preempted == list(reversed(running_before))[:k], "the newest running sequences are preempted"
            assert list(sched.waiting)[:k] == list(reversed(out.preempted)), "a preempted sequence is requeued first"
            assert not any(c.seq in waiting_before for c in chunks), "admitted in a step that preempted"
            assert all(v.status == SequenceStatus.WAITING for v in out.preempted)
        admitted = [c.seq for c in chunks if c.seq in waiting_before]
        assert sorted(admitted, key=waiting_before.index) == waiting_before[: len(admitted)], "admission in arrival order"
        assert [s for s in sched.running if s in waiting_before] == sorted(admitted, key=waiting_before.index)
        # running sequences: decodes first, then prefills, each group oldest first; a later one only when budget is left
        # (the lists of the output sort chunks by length, not by when they were scheduled: compare the sets)
        survivors = [s for s in running_before if s not in out.preempted]
        order = [s for s in survivors if s.num_pending == 1] + [s for s in survivors if s.num_pending > 1]
        got = {id(c.seq) for c in chunks if c.seq in running_before}
        assert got == {id(s) for s in order[: len(got)]}, "running sequences are served decodes first, oldest first"
        if len(got) < len(order):
            assert sum(c.length for c in chunks if c.seq in running_before) == sched.max_num_batched_tokens

    def postprocess(self, out: SchedulerOutput) -> None:
        pc, bs = self.bm.prefix, self.bs
        if self.cross:  # registration across blocks: tests/test_cross_blocks.py; here the accounting of check() holds
            self.sched.postprocess(out)
            return
        for c in out.decode + out.prefill:  # the documented rule: every step into the block took the most it could
            j = c.start // bs
            full = c.length == min(self.step_tokens, bs - c.start % bs)
            self.full[(c.seq.seq_id, j)] = full and (c.start % bs == 0 or self.full.get((c.seq.seq_id, j), False))
        before = dict(pc.key_of) if pc else {}
        self.sched.postprocess(out)
        if pc is None:
            return
        for c in out.decode + out.prefill:
            end = c.start + c.length
            if end % bs:
                continue
            j, b = end // bs - 1, c.seq.block_table[end // bs - 1]
            if b in before:  # a hit: registered already
                continue
            if not self.full[(c.seq.seq_id, j)]:
                assert b not in pc.key_of, f"block {j} of {c.seq} registered though not every step into it was a full one"
                continue
            key = self._key(c.seq, j)
            assert key in pc.block_of, f"a fully stepped block {j} of {c.seq} was not registered"
            if pc.block_of[key] == b:  # registered now: a first block keeps its sink rows, no other block does
                assert (b in pc.sinks) == (j == 0 and self.sink > 0), (j, b)
            if pc.block_of[key] != b:  # the key was cached before (or by an equal prompt in this step): this copy stays private
                assert b not in pc.key_of and (key in before.values() or pc.block_of[key] in
                                               {x.seq.block_table[(x.start + x.length) // bs - 1] for x in out.decode + out.prefill
                                                if (x.start + x.length) % bs == 0 and x.seq is not c.seq})

    def _key(self, s: Sequence, j: int) -> bytes:
        """The documented hash chain, computed here: blake2b-128 of the parent key and the block's tokens as int64."""
        key = hashlib.blake2b(b"salt", digest_size=16).digest()
        for i in range(j + 1):
            toks = s.tokens(i * self.bs, (i + 1) * self.bs)
            key = hashlib.blake2b(key + struct.pack(f"={len(toks)}q", *toks), digest_size=16).digest()
        return key

    def add(self, prompt: list[int], max_tokens: int) -> Sequence | None:
        s = Sequence(prompt, SamplingParams(max_tokens=max_tokens))
        need = (len(prompt) + max_tokens - 1) // self.bs
        if need > self.bm.num_blocks:
            with pytest.raises(TrtkvError, match=f"needs {need} KV blocks"):
                self.sched.add(s)
            return None
        self.sched.add(s)
        self.seqs.append(s)
        return s

    def step(self) -> None:
        sched = self.sched
        running_before, waiting_before = list(sched.running), list(sched.waiting)
        out = sched.schedule()
        self.preemptions += len(out.preempted)
        self.check_step(out, running_before, waiting_before)
        self.run(out)
        self.postprocess(out)
        if self.bm.prefix is not None:  # a hit's blocks are exactly the cached keys of the request's own tokens
            for s in sched.running:
                for j, b in enumerate(s.block_table):
                    if b in self.bm.prefix.key_of:
                        assert self.bm.prefix.key_of[b] == self._key(s, j)
        for c in out.decode + out.prefill:
            if c.samples:
                c.seq.append_token(self.rng.randrange(6))
                if len(c.seq.output_ids) >= c.seq.params.max_tokens:
                    sched.finish(c.seq, "length")
                elif self.rng.random() < self.early_stop:
                    sched.finish(c.seq, "stop")
        self.check()


CONFIGS = [  # bs, sink, blocks, slots, budget, step tokens, prefix, swap, max_seqs
    (4, 0, 7, 4, 6, None, True, True, None),
    (4, 2, 7, 4, 5, None, True, True, None),
    (3, 0, 7, 3, 7, None, True, False, None),
    (5, 1, 8, 4, 3, 2, True, True, 3),
    (4, 0, 6, 4, 9, 3, False, True, None),
    (2, 1, 9, 5, 4, None, True, True, None),
    (6, 0, 8, 3, 11, 4, True, True, None),
    (4, 3, 9, 4, 1, None, True, False, 2),
    (7, 2, 7, 3, 13, 5, False, False, None),
]


def drive(cfg, seed: int, pressure: bool = False, cross: bool = False) -> Sim:
    """Random arrivals (prompts sharing two stems) for 120 steps, 3 % aborts and 3 % early stops, until all finish;
    ``pressure``: longer outputs, more arrivals, no aborts nor early stops (preemption in many steps)."""
    bs, sink, blocks, slots, budget, step_tokens, prefix, swap, max_seqs = cfg
    rng = random.Random(hash((bs, sink, blocks, budget, seed, pressure)))
    sim = Sim(rng, bs=bs, sink=sink, num_blocks=blocks, num_slots=slots, budget=budget, step_tokens=step_tokens, prefix=prefix, swap=swap,
              max_seqs=max_seqs, cross=cross)
    sim.early_stop = 0.0 if pressure else 0.03
    stems = [[rng.randrange(6) for _ in range(3 * bs)] for _ in range(2)]
    for t in range(600):
        if t < 120 and rng.random() < (0.5 if pressure else 0.25):
            stem = rng.choice(stems)
            prompt = stem[: rng.randrange(1, len(stem) + 1)] + [rng.randrange(6) for _ in range(rng.randrange(0, bs + 2))]
            sim.add(prompt, rng.randrange(bs, 3 * bs + 2) if pressure else rng.randrange(1, 2 * bs + 2))
        if not pressure and rng.random() < 0.03:
            live = [s for s in sim.seqs if not s.is_finished]
            if live:
                victim = rng.choice(live)
                sim.sched.abort(victim)
                sim.aborted.add(victim.seq_id)
                assert victim.finish_reason == "abort" and victim.is_finished
                sim.check()
        if not sim.sched.has_work():
            if t >= 120:
                break
            continue
        sim.step()
    return sim


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "bs{}-sink{}-blocks{}-slots{}-budget{}-step{}-{}-{}".format(
    *c[:6], "prefix" if c[6] else "noprefix", "swap" if c[7] else "recompute"))
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("cross", [False, True], ids=["one-block-steps", "across-blocks"])
def test_random_requests_keep_every_block_row_and_slot_right(cfg, seed, cross):
    sim = drive(cfg, seed, cross=cross)
    blocks, slots, swap = cfg[2], cfg[3], cfg[7]
    assert not sim.sched.has_work()
    for s in sim.seqs:
        assert s.is_finished and s.block_table == [] and s.slot is None
        if s.seq_id not in sim.aborted and s.finish_reason == "length":
            assert len(s.output_ids) == s.params.max_tokens
    assert sorted(sim.bm.free_slots) == list(range(slots))
    assert sim.bm.num_free_blocks == blocks and sim.bm.num_used_blocks == 0
    if swap:
        assert sim.sched.swapper.saved == {}


PRESSURE = [  # small pools, many slots: preemption in many steps
    (4, 0, 8, 4, 8, None, True, True, None),
    (3, 1, 9, 5, 6, None, True, True, None),
    (4, 2, 8, 4, 7, 3, True, False, None),
    (5, 0, 9, 4, 10, None, False, True, None),
]


@pytest.mark.parametrize("cfg", PRESSURE, ids=lambda c: "bs{}-sink{}-blocks{}-slots{}-budget{}-step{}-{}-{}".format(
    *c[:6], "prefix" if c[6] else "noprefix", "swap" if c[7] else "recompute"))
@pytest.mark.parametrize("cross", [False, True], ids=["one-block-steps", "across-blocks"])
def test_under_pressure_preemption_keeps_every_row_and_every_request_ends(cfg, cross):
    sim = drive(cfg, 0, pressure=True, cross=cross)
    assert sim.preemptions >= 5 and not sim.sched.has_work()
    assert all(len(s.output_ids) == s.params.max_tokens for s in sim.seqs)
    assert sim.bm.num_free_blocks == cfg[2] and sorted(sim.bm.free_slots) == list(range(cfg[3]))


def test_the_random_runs_preempt_and_hit():
    """The runs above do reach preemption, prefix hits and evictions (else they would check little)."""
    sims = [drive(cfg, 0) for cfg in CONFIGS[:3]]
    assert sum(s.preemptions for s in sims) > 0 and sum(s.bm.prefix.hit_tokens for s in sims) > 0 and sum(s.bm.prefix.evicted for s in sims) > 0


# ---------------------------------------------------------------- CacheBudget


@pytest.mark.parametrize("budget, per_block, per_slot, slots, want", [
    (10_000, 1000, 700, 3, 7), (10_000, 1000, 700, 1, 9), (2_999, 1000, 0, 1, 2), (3_000, 1000, 0, 1, 3), (1_100, 1000, 100, 1, 1),
    (5 * GIB, 3 * 2**20, 2**20, 64, (5 * GIB - 64 * 2**20) // (3 * 2**20)),
])
def test_the_budget_is_slots_then_whole_pool_blocks(budget, per_block, per_slot, slots, want):
    b = CacheBudget.plan(budget, bytes_per_block=per_block, bytes_per_slot=per_slot, block_size=16, num_slots=slots)
    assert (b.budget_bytes, b.bytes_per_block, b.bytes_per_slot, b.block_size, b.num_slots, b.num_blocks) == (budget, per_block, per_slot, 16, slots, want)
    assert b.pool_tokens == want * 16 and isinstance(b.num_blocks, int)


@pytest.mark.parametrize("budget, slots, want", [(100, 2, 7), (20, 2, 7), (19, 2, None), (0, 1, None)])
def test_a_pool_of_free_blocks_costs_only_its_slots(budget, slots, want):
    """bytes_per_block 0 (every layer in a window ring): ``blocks_when_free`` blocks once the slots fit."""
    if want is None:
        with pytest.raises(TrtkvError, match="does not hold"):
            CacheBudget.plan(budget, bytes_per_block=0, bytes_per_slot=10, block_size=4, num_slots=slots, blocks_when_free=7)
    else:
        assert CacheBudget.plan(budget, bytes_per_block=0, bytes_per_slot=10, block_size=4, num_slots=slots, blocks_when_free=7).num_blocks == want


def test_budget_refusals_name_the_fix():
    with pytest.raises(TrtkvError, match="need at least one sequence slot, got 0"):
        CacheBudget.plan(GIB, bytes_per_block=10, bytes_per_slot=10, block_size=4, num_slots=0)
    with pytest.raises(TrtkvError, match=r"does not hold 4 sequence slots") as info:
        CacheBudget.plan(GIB // 2, bytes_per_block=GIB // 4, bytes_per_slot=GIB // 8, block_size=4, num_slots=4)
    assert "raise --kv-memory to at least 0.750 GiB" in info.value.fix
    with pytest.raises(TrtkvError, match="does not hold"):  # slots fit, no whole block
        CacheBudget.plan(1_999, bytes_per_block=1000, bytes_per_slot=1000, block_size=4, num_slots=1)


def test_budget_describe():
    b = CacheBudget(GIB // 2, 2048, 4096, 16, 3, 10)
    assert b.describe() == "10 blocks x 16 tokens (160 sealed tokens, 2.0 KiB/block) + 3 slots (4.0 KiB/slot) in 0.500 GiB"


# ---------------------------------------------------------------- BlockManager, PrefixCache, Swapper: unit behaviour


def seq(prompt, max_tokens=4) -> Sequence:
    return Sequence(list(prompt), SamplingParams(max_tokens=max_tokens))


def test_block_manager_hands_out_and_takes_back_in_order():
    bm = BlockManager(5, 2, 4)
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.num_free_slots, bm.num_cached_blocks) == (5, 0, 2, 0)
    a, b = seq(range(9), 3), seq(range(2), 8)
    assert (bm.blocks_for(7), bm.blocks_for(8), bm.blocks_for(9)) == (1, 2, 2)
    assert bm.max_blocks(a) == (9 + 3 - 1) // 4 == 2 and bm.max_blocks(b) == (2 + 8 - 1) // 4 == 2
    assert bm.blocks_to_finish(a) == 2 and bm.blocks_to_finish(b) == 0
    bm.allocate_slot(a)
    bm.allocate_slot(b)
    assert (a.slot, b.slot) == (0, 1) and bm.num_free_slots == 0
    with pytest.raises(AssertionError):
        bm.allocate_slot(a)
    with pytest.raises(RuntimeError, match="no free slot"):
        bm.allocate_slot(seq([1]))
    assert [bm.append_block(a), bm.append_block(a), bm.append_block(b)] == [0, 1, 2] and a.block_table == [0, 1]
    assert bm.blocks_to_finish(a) == 0 and bm.num_used_blocks == 3 and bm.can_append(2) and not bm.can_append(3)
    a.num_cached = 8
    bm.free(a)
    assert a.block_table == [] and a.slot is None and a.num_cached == 0
    assert list(bm.free_blocks) == [3, 4, 1, 0] and list(bm.free_slots) == [0]  # the last block first, at the back
    bm.free(a)  # twice: nothing more
    assert list(bm.free_blocks) == [3, 4, 1, 0] and list(bm.free_slots) == [0]
    bm.append_block(b), bm.append_block(b), bm.append_block(b), bm.append_block(b)
    with pytest.raises(RuntimeError, match="no free block"):
        bm.append_block(b)


def keys_of(tokens, bs, salt="salt"):
    out, key = [], hashlib.blake2b(salt.encode(), digest_size=16).digest()
    for j in range(len(tokens) // bs):
        key = hashlib.blake2b(key + struct.pack(f"={bs}q", *tokens[j * bs:(j + 1) * bs]), digest_size=16).digest()
        out.append(key)
    return out


def test_chain_hash_is_blake2b_of_the_parent_and_the_tokens():
    parent = b"p" * 16
    assert chain_hash(parent, [1, -2, 3]) == hashlib.blake2b(parent + struct.pack("=3q", 1, -2, 3), digest_size=16).digest()
    assert chain_hash(parent, [1, 2]) != chain_hash(parent, [2, 1]) and chain_hash(parent, [1, 2]) != chain_hash(b"q" * 16, [1, 2])
    pc = PrefixCache(3, "salt")
    s = seq([5, 6, 7, 8, 9, 10, 11])
    assert pc.keys(s, 2) == keys_of(s.prompt_ids, 3) and s.block_keys == keys_of(s.prompt_ids, 3)
    assert pc.keys(s, 1) == keys_of(s.prompt_ids, 3)[:1] and len(s.block_keys) == 2
    assert PrefixCache(3, "other").keys(seq([5, 6, 7]), 1) != pc.keys(seq([5, 6, 7]), 1)


def registered(pc: PrefixCache, bm: BlockManager, tokens, n_blocks: int) -> Sequence:
    """A sequence that sealed and registered its first ``n_blocks`` blocks."""
    s = seq(tokens, 2)
    bm.allocate_slot(s)
    for j in range(n_blocks):
        bm.append_block(s)
        pc.register(s, j)
    s.num_cached = n_blocks * pc.block_size
    return s


def test_prefix_hits_refcounts_and_lru_eviction():
    pc = PrefixCache(2, "salt")
    bm = BlockManager(6, 4, 2, pc)
    a = registered(pc, bm, [1, 2, 3, 4, 5, 6, 7], 3)
    assert a.block_table == [0, 1, 2] and pc.refs == {0: 1, 1: 1, 2: 1} and pc.num_cached == 0 and bm.num_used_blocks == 3
    assert pc.key_of == dict(zip([0, 1, 2], keys_of([1, 2, 3, 4, 5, 6], 2)))
    # a hit leaves the last prompt token to compute: (len - 1) // bs blocks at most
    assert pc.match(seq([1, 2, 3, 4, 5, 6, 9])) == [0, 1, 2]
    assert pc.match(seq([1, 2, 3, 4, 5, 6])) == [0, 1]
    assert pc.match(seq([1, 2, 3, 4, 5])) == [0, 1]
    assert pc.match(seq([1, 2, 9, 4, 5, 6, 7])) == [0]  # the chain breaks at the first different block
    assert pc.match(seq([9, 2, 3, 4, 5, 6, 7])) == [] and pc.match(seq([1, 2])) == []
    b = seq([1, 2, 3, 4, 0])
    bm.allocate_slot(b)
    hit = pc.match(b)
    assert hit == [0, 1] and bm.prefix_evictable(hit) == 0
    pc.take(b, hit)
    assert b.block_table == [0, 1] and b.num_cached == 4 and pc.refs == {0: 2, 1: 2, 2: 1} and pc.hit_tokens == 4
    bm.free(a)  # blocks 2, 1, 0 released: 2 nobody holds -> cached; 0 and 1 still held by b
    assert pc.refs == {0: 1, 1: 1, 2: 0} and list(pc.lru) == [2] and bm.num_free_blocks == 3 + 1 and list(bm.free_blocks) == [3, 4, 5]
    bm.free(b)  # released last block first: 1 then 0
    assert list(pc.lru) == [2, 1, 0] and bm.num_used_blocks == 0 and bm.num_cached_blocks == 3
    c = seq([1, 2, 3, 4, 5, 6, 7])
    bm.allocate_slot(c)
    hit = pc.match(c)
    assert hit == [0, 1, 2] and bm.prefix_evictable(hit) == 3 and bm.prefix_evictable([0, 4]) == 1
    pc.take(c, hit[:1])
    assert list(pc.lru) == [2, 1] and pc.refs[0] == 1
    d = seq([9, 9, 9, 9, 9, 9, 9])
    bm.allocate_slot(d)
    assert [bm.append_block(d) for _ in range(4)] == [3, 4, 5, 2]  # the free list first, then the oldest cached (2)
    assert pc.evicted == 1 and 2 not in pc.key_of and 2 not in pc.refs and pc.match(seq([1, 2, 3, 4, 5, 6, 7])) == [0, 1]
    assert bm.append_block(d) == 1 and pc.evicted == 2 and list(pc.lru) == []
    with pytest.raises(RuntimeError, match="no free block"):
        bm.append_block(d)


def test_registration_keeps_the_first_copy_and_skips_hits():
    pc = PrefixCache(2, "salt")
    bm = BlockManager(8, 4, 2, pc)
    a = registered(pc, bm, [1, 2, 3, 4], 2)
    b = registered(pc, bm, [1, 2, 3, 4], 2)  # the same blocks sealed again (two equal prompts in one step)
    assert b.block_table == [2, 3] and pc.key_of == {0: keys_of([1, 2, 3, 4], 2)[0], 1: keys_of([1, 2, 3, 4], 2)[1]}
    bm.free(b)
    assert list(bm.free_blocks)[-2:] == [3, 2] and pc.num_cached == 0  # private copies go back to the free list
    c = seq([1, 2, 3, 4, 5])
    bm.allocate_slot(c)
    pc.take(c, pc.match(c))
    pc.register(c, 0)  # a hit block: already registered, one reference more only from take
    assert pc.refs[0] == 2 and pc.refs[1] == 2
    bm.free(a)
    bm.free(c)
    assert pc.refs == {0: 0, 1: 0} and list(pc.lru) == [1, 0]


def test_a_first_blocks_sink_rows_travel_with_its_hit():
    cache = make_cache(4, 2, 6, 3)
    pc = PrefixCache(4, "salt", cache)
    bm = BlockManager(6, 3, 4, pc)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate_slot(a)
    bm.append_block(a)
    sink = cache.layout.sink_rows(cache.tensors["k_tail"][:, a.slot])
    sink.copy_(torch.tensor([[[[7.0, 8.0], [9.0, 10.0]]]]))
    pc.register(a, 0)
    assert set(pc.sinks[0]) == {"k_tail", "v_tail"} and pc.sinks[0]["k_tail"].tolist() == sink.tolist()
    sink.zero_()  # the owner's slot moves on: the entry keeps its own copy
    b = seq([1, 2, 3, 4, 0])
    bm.allocate_slot(b)
    pc.take(b, pc.match(b))
    got = cache.layout.sink_rows(cache.tensors["k_tail"][:, b.slot])
    assert got.tolist() == [[[[7.0, 8.0], [9.0, 10.0]]]]
    bm.free(a), bm.free(b)
    assert pc.evict() == 0 and 0 not in pc.sinks


def test_a_cache_with_a_window_ring_refuses_prefix_caching():
    with pytest.raises(TrtkvError, match="window ring"):
        PrefixCache(4, "s", SimpleNamespace(ring=object()))


def test_swap_out_and_in_moves_blocks_and_slot_bit_for_bit():
    cache = make_cache(3, 1, 8, 3)
    for t in cache.tensors.values():
        t.copy_(torch.randn(t.shape).to(t.dtype))
    sw = Swapper(cache)
    s = seq(range(8), 4)
    s.slot, s.block_table, s.num_cached = 1, [5, 2, 7], 7  # 2 sealed blocks (the third is allocated, not sealed)
    rows = {n: t.clone() for n, t in cache.tensors.items()}
    sw.swap_out(s)
    assert s in sw and sw.blocks_needed(s) == 2 and sw.blocks_needed(seq([1])) == 0
    for t in cache.tensors.values():
        t.zero_()
    s.slot, s.block_table, s.num_cached = 2, [0, 6], 0
    sw.swap_in(s)
    assert s.num_cached == 7 and s not in sw
    for name in ("k_data", "v_data"):
        assert torch.equal(cache.tensors[name][:, [0, 6]], rows[name][:, [5, 2]])
        assert cache.tensors[name][:, [1, 2, 3, 4, 5, 7]].abs().sum() == 0
    for name in ("k_tail", "v_tail"):
        assert torch.equal(cache.tensors[name][:, 2], rows[name][:, 1]) and cache.tensors[name][:, [0, 1]].abs().sum() == 0
    sw.swap_out(s)
    sw.discard(s)
    assert s not in sw and sw.saved == {}
    sw.discard(s)  # nothing saved: fine


def test_a_swapped_copy_is_not_a_view_of_the_cache():
    cache = make_cache(2, 0, 4, 2)
    cache.tensors["k_tail"].fill_(1.0)
    cache.tensors["k_data"].fill_(2.0)
    sw = Swapper(cache)
    s = seq(range(3), 2)
    s.slot, s.block_table, s.num_cached = 0, [1], 3
    sw.swap_out(s)
    cache.tensors["k_tail"].fill_(5.0)
    cache.tensors["k_data"].fill_(6.0)
    s.slot, s.block_table = 1, [3]
    sw.swap_in(s)
    assert cache.tensors["k_tail"][:, 1].unique().tolist() == [1.0] and cache.tensors["k_data"][:, 3].unique().tolist() == [2.0]


# ---------------------------------------------------------------- the scheduler: rules with hand-computed schedules


def test_chunks_end_at_block_boundaries_and_at_the_budget():
    """Block size 4, a 10-token prompt, 3 tokens a step: chunks 0-3, 3-4 (block end), 4-7, 7-8, 8-10."""
    sched = Scheduler(BlockManager(8, 2, 4), max_num_batched_tokens=3)
    s = seq(range(1, 11), 2)
    sched.add(s)
    spans = []
    while s.in_prefill or not spans:
        out = sched.schedule()
        spans += [(c.start, c.start + c.length) for c in out.prefill + out.decode]
        sched.postprocess(out)
    assert spans == [(0, 3), (3, 4), (4, 7), (7, 8), (8, 10)] and len(s.block_table) == 2


def test_max_step_tokens_caps_a_chunk_and_never_exceeds_a_block():
    sched = Scheduler(BlockManager(8, 2, 4), max_num_batched_tokens=100, max_step_tokens=3)
    assert sched.max_step_tokens == 3 and Scheduler(BlockManager(8, 2, 4), max_step_tokens=9).max_step_tokens == 4
    assert Scheduler(BlockManager(8, 2, 4)).max_step_tokens == 4
    assert Scheduler(BlockManager(8, 5, 4), max_num_seqs=9).max_num_seqs == 5 and Scheduler(BlockManager(8, 5, 4), max_num_seqs=2).max_num_seqs == 2
    s = seq(range(1, 11), 2)
    sched.add(s)
    spans = []
    for _ in range(4):
        out = sched.schedule()
        spans += [(c.start, c.length) for c in out.prefill + out.decode]
        sched.postprocess(out)
    assert spans == [(0, 3), (3, 1), (4, 3), (7, 1)]


@pytest.mark.parametrize("blocks, both", [(4, True), (3, False)])
def test_admission_counts_the_blocks_admitted_prefills_still_need(blocks, both):
    """Two 8-token prompts, blocks of 4: each needs 2 blocks. The first is admitted and its first chunk (0-4) takes one
    block at once, so it still needs 1 more: with 4 blocks 3 are free and 3 - 1 >= 2 admits the second; with 3 blocks,
    2 - 1 < 2 does not (it waits)."""
    sched = Scheduler(BlockManager(blocks, 2, 4), max_num_batched_tokens=16)
    a, b = seq(range(1, 9), 1), seq(range(11, 19), 1)
    sched.add(a), sched.add(b)
    out = sched.schedule()
    assert [c.seq for c in out.prefill] == ([a, b] if both else [a]) and sched.running == ([a, b] if both else [a])
    assert [(c.start, c.length) for c in out.prefill] == [(0, 4)] * (2 if both else 1)


def test_admission_counts_cached_hit_blocks_it_takes_out_of_the_free_ones():
    """A prompt whose first block is cached and unreferenced (evictable) needs it: taking it leaves one block fewer to
    allocate, so it counts against the free blocks like a fresh one."""
    pc = PrefixCache(4, "salt")
    sched = Scheduler(BlockManager(3, 2, 4, pc), max_num_batched_tokens=16)
    first = seq([1, 2, 3, 4, 5], 1)
    sched.add(first)
    out = sched.schedule()
    sched.postprocess(out)  # block 0 of [1, 2, 3, 4] registered
    sched.finish(first, "stop")
    assert pc.num_cached == 1 and sched.bm.num_free_blocks == 3
    big = seq([1, 2, 3, 4] + list(range(20, 29)), 1)  # 13 tokens: 3 blocks, the first a hit
    sched.add(big)
    out = sched.schedule()
    assert out.prefill and big.block_table[0] == 0 and big.num_cached == 4 and pc.hit_tokens == 4


def test_at_most_max_num_seqs_run_though_slots_are_free():
    sched = Scheduler(BlockManager(20, 4, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [seq([i + 1, i + 2], 3) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [c.seq for c in out.prefill] == seqs[:2] and sched.running == seqs[:2] and list(sched.waiting) == seqs[2:]
    assert sched.bm.num_free_slots == 2


def test_requests_that_can_never_run_are_refused_when_added():
    sched = Scheduler(BlockManager(3, 2, 4), max_model_len=20)
    sched.add(seq(range(10), 6))  # (10 + 6 - 1) // 4 = 3 blocks: the whole pool (the last token is never cached)
    with pytest.raises(TrtkvError, match="needs 4 KV blocks of 4 tokens but the whole pool has 3"):
        sched.add(seq(range(10), 7))
    sched2 = Scheduler(BlockManager(100, 2, 4), max_model_len=20)
    sched2.add(seq(range(10), 10))  # exactly the context
    with pytest.raises(TrtkvError, match="= 21 tokens exceeds the engine's context of 20"):
        sched2.add(seq(range(10), 11))


def test_abort_and_finish_free_everything_and_set_the_reason():
    sched = Scheduler(BlockManager(8, 2, 4), max_num_batched_tokens=100)
    a, b, c = seq(range(6)), seq(range(5)), seq(range(3))
    for s in (a, b, c):
        sched.add(s)
    sched.postprocess(sched.schedule())
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    sched.abort(c)
    assert c.status == SequenceStatus.FINISHED and c.finish_reason == "abort" and list(sched.waiting) == []
    sched.abort(a, "error")
    assert a.finish_reason == "error" and sched.running == [b] and a.slot is None and a.block_table == []
    sched.finish(b, "stop")
    assert b.finish_reason == "stop" and not sched.has_work() and sched.bm.num_free_blocks == 8 and sched.bm.num_free_slots == 2


def test_a_scheduler_output_counts_its_tokens():
    s1, s2 = seq(range(5)), seq(range(3))
    out = SchedulerOutput(decode=[Chunk(s1, 4, 1)], prefill=[Chunk(s2, 0, 3)])
    assert out.num_tokens == 4 and not out.empty and SchedulerOutput().empty and SchedulerOutput().num_tokens == 0
    assert Chunk(s1, 4, 1).samples and not Chunk(s1, 0, 4).samples and Chunk(s2, 0, 3).samples


# ---------------------------------------------------------------- the step batch and the cache's writes


def test_step_batch_make_pads_and_validate_refuses():
    b = StepBatch.make([[1, 2, 3], [4]], [5, 0], [[7, 8], []], [1, 0])
    assert b.input_ids.tolist() == [[1, 2, 3], [4, 0, 0]] and b.new_lens.tolist() == [3, 1] and b.context_lens.tolist() == [5, 0]
    assert b.block_tables.tolist() == [[7, 8], [-1, -1]] and b.slot_ids.tolist() == [1, 0] and (b.batch_size, b.num_tokens) == (2, 3)
    assert all(t.dtype == torch.long for t in (b.input_ids, b.context_lens, b.new_lens, b.block_tables, b.slot_ids))
    b.validate(4)  # 5 % 4 + 3 == 4: ends at the boundary
    with pytest.raises(TrtkvError, match="crosses a block boundary"):
        StepBatch.make([[1, 2, 3]], [6], [[1]], [0]).validate(4)
    with pytest.raises(TrtkvError, match="fewer columns than sealed blocks"):
        StepBatch.make([[1]], [9], [[1]], [0]).validate(4)
    StepBatch.make([[1]], [8], [[1, 2]], [0]).validate(4)
    bad = StepBatch.make([[1, 2]], [0], [[]], [0])
    bad.new_lens = torch.tensor([3])
    with pytest.raises(TrtkvError, match=r"new_lens must be in 1..2"):
        bad.validate(4)
    bad.new_lens = torch.tensor([0])
    with pytest.raises(TrtkvError, match="new_lens"):
        bad.validate(4)
    bad.new_lens = torch.tensor([1, 1])
    with pytest.raises(TrtkvError, match=r"new_lens has shape \[2\], expected \[1\]"):
        bad.validate(4)
    bad = StepBatch.make([[1]], [0], [[]], [0])
    bad.block_tables = torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(TrtkvError, match="block_tables has shape"):
        bad.validate(4)
    assert StepBatch.make([[1]], [0], [[]], [0]).block_tables.shape == (1, 1)


def test_step_batch_padded_to_a_graphs_shapes():
    b = StepBatch.make([[5], [6]], [9, 3], [[1, 2], [3]], [2, 1])
    p = b.padded_to(4, 5)
    assert p.input_ids.tolist() == [[5], [6], [0], [0]] and p.context_lens.tolist() == [9, 3, 0, 0] and p.new_lens.tolist() == [1, 1, 1, 1]
    assert p.slot_ids.tolist() == [2, 1, 0, 0]
    assert p.block_tables.tolist() == [[1, 2, -1, -1, -1], [3, -1, -1, -1, -1], [-1] * 5, [-1] * 5]
    assert b.padded_to(2, 2).block_tables.tolist() == b.block_tables.tolist()
    with pytest.raises(ValueError):
        b.padded_to(1, 5)
    with pytest.raises(ValueError):
        b.padded_to(4, 1)


def test_write_new_rows_writes_the_open_block_and_seals_full_ones():
    cache = make_cache(4, 1, 6, 3)
    k = torch.arange(1, 1 + 2 * 4 * 2, dtype=torch.float16).reshape(1, 2, 4, 1, 2)
    v = -k
    batch = StepBatch.make([[1, 2, 3], [4, 5, 6, 7]], [5, 0], [[0, 4], [3]], [2, 0])
    assert cache.write_new_rows(batch, StepOutput(None, k, v)) == [0, 1]  # 5 + 3 == 8 and 0 + 4 == 4: both seal
    kt = cache.tensors["k_tail"][0]
    assert kt[2, 0, 1:4].tolist() == k[0, 0, :3, 0].tolist()  # offset 5 % 4 == 1
    assert torch.equal(cache.tensors["k_data"][0, 4, 0, 1:4], k[0, 0, :3, 0]) and torch.equal(cache.tensors["v_data"][0, 4, 0, 1:4], v[0, 0, :3, 0])
    # the first block of sequence 1: rows 1..3 as written, row 0 (a sink) replaced by row 1 and kept in the slot's sink row
    assert torch.equal(cache.tensors["k_data"][0, 3, 0, 1:], k[0, 1, 1:, 0]) and torch.equal(cache.tensors["k_data"][0, 3, 0, 0], k[0, 1, 1, 0])
    assert torch.equal(kt[0, 0, 4], k[0, 1, 0, 0])
    # rows across a block boundary (an engine with cross_blocks): the first fills and seals block 0, the second opens block 1
    assert cache.write_new_rows(StepBatch.make([[1, 2]], [3], [[5]], [1]), StepOutput(None, k[:, :1, :2], v[:, :1, :2])) == [0]
    assert torch.equal(cache.tensors["k_data"][0, 5, 0, 3], k[0, 0, 0, 0]) and torch.equal(kt[1, 0, 0], k[0, 0, 1, 0])
    with pytest.raises(TrtkvError, match="has no block at index 1"):  # 3 + 6 rows fill blocks 0 and 1; the table has one
        cache.write_new_rows(StepBatch.make([[1] * 6], [3], [[5]], [1]), StepOutput(None, k[:, :1, :1].expand(1, 1, 6, 1, 2), v[:, :1, :1].expand(1, 1, 6, 1, 2)))
    with pytest.raises(TrtkvError, match="has no block at index 1"):
        cache.write_new_rows(StepBatch.make([[1]], [7], [[0]], [1]), StepOutput(None, k[:, :1, :1], v[:, :1, :1]))
    with pytest.raises(TrtkvError, match="has no block at index 0"):
        cache.write_new_rows(StepBatch.make([[1]], [3], [[]], [1]), StepOutput(None, k[:, :1, :1], v[:, :1, :1]))
    assert cache.write_new_rows(StepBatch.make([[1]], [1], [[]], [1]), StepOutput(None, k[:, :1, :1], v[:, :1, :1])) == []


def test_cache_tensors_shapes_and_slot_ownership():
    cache = make_cache(4, 2, 5, 3)
    assert set(cache.tensors) == {"k_data", "v_data", "k_tail", "v_tail"}
    assert cache.tensors["k_data"].shape == (1, 5, 1, 4, 2) and cache.tensors["k_tail"].shape == (1, 3, 1, 6, 2)
    assert cache.slot_index("k_tail", 2) == slice(2, 3) and cache.slot_index("v_tail", 0) == slice(0, 1)
    assert cache.slot_index("k_data", 1) is None and cache.block_size == 4 and not cache.is_grouped
    assert cache.nbytes() == sum(t.numel() * 2 for t in cache.tensors.values())
    with pytest.raises(TrtkvError, match="2 layer params for 1 layers"):
        PagedKVCache(cache.layout, 1, [None, None])
