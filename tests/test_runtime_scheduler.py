"""Block manager, scheduler and sampler: the runtime's policy, no engine and no server."""

from __future__ import annotations

import pytest
import torch

from trtkv.errors import TrtkvError
from trtkv.formats import get_format
from trtkv.runtime.block_manager import GIB, BlockManager, CacheBudget
from trtkv.runtime.sampler import Sampler, filter_top_k_top_p, make_generator
from trtkv.runtime.scheduler import Scheduler
from trtkv.runtime.sequence import SamplingParams, Sequence, SequenceStatus

BS = 4


def seq(n_prompt: int, max_tokens: int = 8, **kw) -> Sequence:
    return Sequence(list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, **kw))


def run_step(sched: Scheduler, token: int = 7):
    """Pretend the engine ran: mark cached, append a token to every sequence whose chunk reached its end."""
    out = sched.schedule()
    sampled = [c.seq for c in out.decode + out.prefill if c.samples]
    sched.postprocess(out)
    for s in sampled:
        s.append_token(token)
        if len(s.output_ids) >= s.params.max_tokens:
            sched.finish(s, "length")
    return out


def check_invariants(sched: Scheduler) -> None:
    bm = sched.bm
    held = [b for s in sched.running for b in s.block_table]
    assert len(held) == len(set(held)), "a block is owned twice"
    assert set(held).isdisjoint(bm.free_blocks)
    assert len(held) + bm.num_free_blocks == bm.num_blocks
    slots = [s.slot for s in sched.running]
    assert None not in slots and len(slots) == len(set(slots))
    assert len(slots) + bm.num_free_slots == bm.num_slots
    for s in sched.waiting:
        assert s.slot is None and s.block_table == [] and s.num_cached == 0


# ---------------------------------------------------------------- budget


def test_budget_counts_slots_and_int4_holds_more_tokens():
    from trtkv.cache_layout import PagedKVLayout

    L, H, D = 30, 3, 64
    got = {}
    for name in ("fp16", "int8", "int4"):
        lay = PagedKVLayout(get_format(name), H, D, 64, 1, 1)
        b = CacheBudget.plan(GIB, bytes_per_block=lay.bytes_per_block() * L, bytes_per_slot=lay.tail_bytes_per_slot() * L, block_size=64, num_slots=32)
        assert b.num_blocks * b.bytes_per_block + b.num_slots * b.bytes_per_slot <= GIB
        got[name] = b.num_blocks
    assert got["int4"] / got["fp16"] > 3.5
    assert got["int8"] / got["fp16"] > 1.9


def test_budget_too_small_is_a_clear_error():
    with pytest.raises(TrtkvError, match="does not hold 64 sequence slots"):
        CacheBudget.plan(1000, bytes_per_block=100, bytes_per_slot=100, block_size=16, num_slots=64)


# ---------------------------------------------------------------- block manager


def test_block_manager_allocates_and_frees():
    bm = BlockManager(num_blocks=5, num_slots=2, block_size=BS)
    s = seq(9)
    bm.allocate_slot(s)
    for _ in range(3):
        bm.append_block(s)
    assert bm.num_free_blocks == 2 and bm.num_free_slots == 1
    assert bm.blocks_for(9) == 2 and bm.max_blocks(s) == (9 + 8 - 1) // BS
    bm.free(s)
    assert bm.num_free_blocks == 5 and bm.num_free_slots == 2 and s.block_table == [] and s.slot is None


# ---------------------------------------------------------------- scheduler


def test_prefill_is_chunked_at_block_boundaries():
    sched = Scheduler(BlockManager(16, 4, BS), max_num_batched_tokens=64)
    s = seq(10)
    sched.add(s)
    chunks = []
    while s.num_pending > 1 or not s.output_ids:
        out = run_step(sched)
        chunks += [(c.start, c.length) for c in out.prefill + out.decode if c.seq is s]
    assert chunks == [(0, 4), (4, 4), (8, 2)]
    for start, n in chunks:
        assert start % BS + n <= BS
    # the block a chunk seals into is allocated when that chunk is scheduled
    assert len(s.block_table) == 2


def test_a_small_token_budget_never_crosses_a_block_boundary_from_mid_block():
    """max_num_batched_tokens=3 with blocks of 4: after the first chunk the prompt resumes at offset 3 of its block,
    so the next chunk is 1 token, not 3 (which would run into the next block)."""
    sched = Scheduler(BlockManager(16, 4, BS), max_num_batched_tokens=3)
    s = seq(10)
    sched.add(s)
    chunks = []
    while not s.output_ids:
        out = run_step(sched)
        chunks += [(c.start, c.length) for c in out.prefill + out.decode if c.seq is s]
    assert chunks == [(0, 3), (3, 1), (4, 3), (7, 1), (8, 2)]
    for start, n in chunks:
        assert start % BS + n <= BS and n <= 3


def test_token_budget_limits_each_step_and_decodes_go_first():
    sched = Scheduler(BlockManager(64, 8, BS), max_num_batched_tokens=6)
    a = seq(2, max_tokens=20)
    sched.add(a)
    run_step(sched)  # a prefilled, one token sampled
    b = seq(12)
    sched.add(b)
    out = sched.schedule()
    assert [c.seq for c in out.decode] == [a]
    assert out.num_tokens <= 6
    assert [(c.seq, c.length) for c in out.prefill] == [(b, 4)]  # clipped at the block boundary, budget 5 left


def test_a_running_decode_goes_before_an_older_running_prefill_under_a_tight_budget():
    """a (older, still prefilling) and b (decoding) both running with a budget of 3: b's one token first, a gets the
    2 left (not 3, which would leave b out of the step)."""
    sched = Scheduler(BlockManager(64, 8, BS), max_num_batched_tokens=3)
    a = seq(20, max_tokens=4)
    sched.add(a)
    run_step(sched)  # a: (0, 3)
    b = seq(1, max_tokens=8)
    sched.add(b)
    out = run_step(sched)  # a: (3, 1) up to its block boundary; b admitted with the 2 left: (0, 1), samples
    assert [(c.seq, c.start, c.length) for c in out.prefill + out.decode] == [(a, 3, 1), (b, 0, 1)]
    assert sched.running == [a, b] and a.in_prefill and not b.in_prefill
    out = sched.schedule()
    assert [c.seq for c in out.decode] == [b]
    assert [(c.seq, c.start, c.length) for c in out.prefill] == [(a, 4, 2)] and out.num_tokens == 3


@pytest.mark.parametrize("step_tokens, budget, registered", [(3, 64, 2), (None, 3, 0)])
def test_prefix_registration_counts_a_step_that_ends_at_the_block_boundary_as_full(step_tokens, budget, registered):
    """Blocks of 4, steps of at most 3 tokens (max_new_tokens_per_step, not dividing the block): a prompt of 10 runs
    (0, 3) (3, 1) (4, 3) (7, 1) (8, 2); (3, 1) took all a step may from offset 3, so blocks 0 and 1 were filled by full
    steps and are registered. The same chunks cut by a token budget of 3 (steps of 4 allowed) are not full: none is."""
    from trtkv.runtime.prefix_cache import PrefixCache

    bm = BlockManager(16, 2, BS, PrefixCache(BS, "salt"))
    sched = Scheduler(bm, max_num_batched_tokens=budget, max_step_tokens=step_tokens)
    s = seq(10, max_tokens=6)
    sched.add(s)
    chunks = []
    while s.status != SequenceStatus.FINISHED:
        out = run_step(sched)
        chunks += [(c.start, c.length) for c in out.prefill + out.decode if c.seq is s and c.start < 10]
    assert chunks == [(0, 3), (3, 1), (4, 3), (7, 1), (8, 2)]
    assert len(bm.prefix.block_of) == registered
    if registered:  # a new request with the same prompt starts from them
        assert len(bm.prefix.match(seq(10))) == 2


def test_admission_waits_for_slots():
    sched = Scheduler(BlockManager(64, 2, BS))
    seqs = [seq(3, max_tokens=2) for _ in range(5)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    assert {c.seq for c in out.prefill} == set(seqs[:2])
    sched.postprocess(out)
    for c in out.prefill:
        c.seq.append_token(7)
    # drive to completion
    while sched.has_work():
        run_step(sched)
        assert len(sched.running) <= 2
        check_invariants(sched)
    assert all(s.status == SequenceStatus.FINISHED and len(s.output_ids) == 2 for s in seqs)


def test_admission_waits_for_blocks_of_the_prompt():
    sched = Scheduler(BlockManager(4, 4, BS))
    a, b = seq(12, max_tokens=2), seq(8, max_tokens=2)  # a needs 3 blocks for its prompt, b 2: not both
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert sched.running == [a] and list(sched.waiting) == [b]


def test_pool_full_preempts_newest_and_everything_finishes():
    bm = BlockManager(num_blocks=6, num_slots=4, block_size=BS)
    sched = Scheduler(bm, max_num_batched_tokens=64)
    seqs = [seq(3, max_tokens=10) for _ in range(4)]  # each grows to 12 cached tokens = 3 blocks; 4 x 3 > 6
    for s in seqs:
        sched.add(s)
    for _ in range(500):
        if not sched.has_work():
            break
        run_step(sched)
        check_invariants(sched)
    assert not sched.has_work()
    assert sched.num_preemptions > 0
    assert all(len(s.output_ids) == 10 for s in seqs)
    # the newest sequence is the one preempted first
    assert seqs[-1].num_preemptions >= 1 and seqs[0].num_preemptions == 0


def test_preempted_sequence_recomputes_prompt_and_output():
    bm = BlockManager(num_blocks=3, num_slots=2, block_size=BS)
    sched = Scheduler(bm)
    a, b = seq(3, max_tokens=8), seq(3, max_tokens=8)
    sched.add(a)
    sched.add(b)
    while b.num_preemptions == 0 and sched.has_work():
        run_step(sched)
    assert b.status == SequenceStatus.WAITING and b.num_cached == 0
    produced = len(b.output_ids)
    assert produced > 0
    # when it is readmitted, its first chunk starts at 0 and covers prompt + output tokens
    while b.status != SequenceStatus.RUNNING:
        run_step(sched)
    assert b.output_ids[:produced] == [7] * produced


def test_request_larger_than_pool_is_rejected():
    sched = Scheduler(BlockManager(4, 2, BS))
    with pytest.raises(TrtkvError, match="whole pool has 4"):
        sched.add(seq(10, max_tokens=11))  # 20 cached tokens at most = 5 blocks
    sched2 = Scheduler(BlockManager(4, 2, BS))
    sched2.add(seq(10, max_tokens=7))  # (10+7-1)//4 = 4 blocks: fits exactly


def test_request_longer_than_engine_context_is_rejected():
    sched = Scheduler(BlockManager(100, 2, BS), max_model_len=32)
    with pytest.raises(TrtkvError, match="exceeds the engine's context of 32"):
        sched.add(seq(30, max_tokens=5))


# ---------------------------------------------------------------- sampler


def naive_filter(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    order = sorted(range(len(probs)), key=lambda i: (-float(probs[i]), i))
    if top_k > 0:
        order = order[:top_k]
    total = sum(float(probs[i]) for i in order)
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p * total:
            break
        kept.append(i)
        mass += float(probs[i])
    out = torch.zeros_like(probs)
    for i in kept:
        out[i] = probs[i]
    return out / out.sum()


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (8, 0.5), (1, 0.9), (0, 0.01)])
def test_top_k_top_p_match_naive_reference(top_k, top_p):
    g = torch.Generator().manual_seed(top_k * 100 + int(top_p * 100))
    for _ in range(5):
        probs = torch.softmax(torch.randn(40, generator=g, dtype=torch.float64) * 2, -1)
        torch.testing.assert_close(filter_top_k_top_p(probs, top_k, top_p), naive_filter(probs, top_k, top_p))


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=123 + i) for i in range(6)]
    sampler = Sampler()
    a, _ = sampler(logits, params, [make_generator(p.seed) for p in params])
    # the same requests one at a time, in another order, and next to unseeded strangers
    for i in (3, 0, 5):
        tok, _ = sampler(logits[i : i + 1], [params[i]], [make_generator(params[i].seed)])
        assert tok == [a[i]]
    mixed = torch.cat([torch.randn(2, 50), logits[2:3]])
    strangers = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5), params[2]]
    tok, _ = sampler(mixed, strangers, [make_generator(None), make_generator(None), make_generator(params[2].seed)])
    assert tok[2] == a[2]


def test_sampling_follows_the_distribution_and_greedy_is_argmax():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)
    g = make_generator(7)
    p = SamplingParams(temperature=1.0, seed=7)
    counts = torch.zeros(4)
    for _ in range(4000):
        tok, _ = Sampler()(logits, [p], [g])
        counts[tok[0]] += 1
    torch.testing.assert_close(counts / counts.sum(), probs, atol=0.03, rtol=0)
    tok, lp = Sampler()(logits, [SamplingParams(temperature=0)], [g])
    assert tok == [0] and lp[0] == pytest.approx(float(probs[0].log()), abs=1e-5)
    tok, _ = Sampler()(logits, [SamplingParams(temperature=1.0, top_k=2)], [g], banned=[[0]])
    assert tok == [1]


def test_top_k_never_samples_outside_the_k_most_likely():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    g = make_generator(1)
    seen = {Sampler()(logits, [SamplingParams(temperature=2.0, top_k=2)], [g])[0][0] for _ in range(300)}
    assert seen == {0, 1}


def test_a_preempted_sequence_goes_back_to_the_front_of_the_queue():
    """The scheduler's policy says a preempted sequence goes back to the
    *front* of the queue, ahead of requests that were already waiting."""
    sched = Scheduler(BlockManager(16, 4, BS), max_num_seqs=1)
    a, b, c = seq(3), seq(3), seq(3)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [ch.seq for ch in out.prefill + out.decode] == [a]  # one slot: a runs, b and c wait
    sched.postprocess(out)
    sched.preempt(a)
    assert list(sched.waiting) == [a, b, c] and a.status == SequenceStatus.WAITING


def test_nothing_is_admitted_in_a_step_that_preempted():
    """A step that had to preempt admits nobody (the scheduler's policy,
    point 3). With prefix caching a sequence whose prompt is cached needs few blocks, so right after a preemption it
    would fit: two equal 13-token prompts and a 4-token one in a pool of 5 blocks of 4, 6 tokens a step (a case a
    random search over small pools found; without prefix caching the victim, first in the queue, never fits)."""
    from trtkv.runtime.prefix_cache import PrefixCache

    sched = Scheduler(BlockManager(5, 3, BS, PrefixCache(BS, "salt")), max_num_seqs=3, max_num_batched_tokens=6)
    prompts, max_tokens = [list(range(1, 14)), list(range(1, 14)), [1, 2, 3, 4]], [4, 7, 3]
    seqs = [Sequence(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, max_tokens)]
    for s in seqs:
        sched.add(s)
    preempting_steps = 0
    for _ in range(300):
        if not sched.has_work():
            break
        running_before = list(sched.running)
        out = sched.schedule()
        if out.preempted:
            preempting_steps += 1
            scheduled = [c.seq for c in out.prefill + out.decode]
            assert all(s in running_before for s in scheduled), "a step that preempted admitted a waiting sequence"
            assert all(v in sched.waiting and v not in sched.running for v in out.preempted)
        sampled = [c.seq for c in out.decode + out.prefill if c.samples]
        sched.postprocess(out)
        for s in sampled:
            s.append_token(7)
            if len(s.output_ids) >= s.params.max_tokens:
                sched.finish(s, "length")
    assert not sched.has_work() and preempting_steps > 0
    assert [len(s.output_ids) for s in seqs] == max_tokens


def test_a_budget_that_leaves_no_pool_block_is_refused():
    """Slots of 100 bytes and blocks of 1000: 2 slots + 1 block need 1200 bytes; 1199 bytes
    hold the slots and no block, which must be refused (a pool with no block can seal nothing)."""
    ok = CacheBudget.plan(1200, bytes_per_block=1000, bytes_per_slot=100, block_size=BS, num_slots=2)
    assert ok.num_blocks == 1
    with pytest.raises(TrtkvError, match="does not hold 2 sequence slots"):
        CacheBudget.plan(1199, bytes_per_block=1000, bytes_per_slot=100, block_size=BS, num_slots=2)
