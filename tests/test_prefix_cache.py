"""Prefix caching over sealed blocks (runtime/prefix_cache.py), over the torch reference engine: no server.

A hit never changes an output (tokens and log-probabilities equal to the same requests without the cache,
every preset format, sink rows included); it reuses exactly the blocks the rules allow (full blocks of a
matching chain, never the last block of a prompt that ends at a block boundary, nothing for a prefix
shorter than a block); shared blocks survive their other holders' finish and preemption; cached blocks
are evicted least recently released first when the pool needs them.
"""

from __future__ import annotations

import pytest
from test_runtime_faults import BS, greedy, make_llm

from trtkv.formats import PRESETS
from trtkv.plugins.contract.capabilities import TORCH_OPS
from trtkv.runtime.block_manager import BlockManager
from trtkv.runtime.prefix_cache import PrefixCache
from trtkv.runtime.sequence import SamplingParams, Sequence

BASE = list(range(100, 118))  # 18 tokens: 4 full blocks of 4 and 2 more

# the presets the torch engine serves (the capability table's torch row: every preset)
SERVED_PRESETS = [n for n, f in PRESETS.items() if not (TORCH_OPS.lacks(f.k) or TORCH_OPS.lacks(f.v))]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(small_llama):
    return small_llama


def second_round(first_output: list[int]) -> list[tuple[list[int], int]]:
    """Prompts that follow BASE, each with the tokens a hit may reuse (blocks of 4)."""
    return [
        (BASE[:10] + [7, 8, 9], 8),  # shares 2 full blocks, then differs inside the third
        (BASE[:8], 4),  # exactly 2 blocks: the last one is recomputed for the logits
        (BASE[:3] + [60, 61], 0),  # shares less than one block
        (BASE + first_output[:3], 16),  # a second turn: the block of prompt end + first outputs was filled by decodes: not reused
        (BASE[:16], 12),  # exactly 4 blocks
    ]


def run(llm, first_output=None):
    first = llm.generate([BASE], greedy(6))[0]
    rest = second_round(first_output or first.new_token_ids)
    outs = llm.generate([p for p, _ in rest], greedy(8))
    return first, outs, sum(n for _, n in rest)


@pytest.mark.parametrize("fmt", SERVED_PRESETS)
def test_a_hit_never_changes_an_output(model, tokenizer, fmt):
    off = make_llm(model, tokenizer, fmt, enable_prefix_caching=False)
    want_first, want, _ = run(off)
    on = make_llm(model, tokenizer, fmt)
    first, got, reusable = run(on, want_first.new_token_ids)
    assert first.new_token_ids == want_first.new_token_ids
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    assert [o.new_logprobs for o in got] == [o.new_logprobs for o in want]
    stats = on.stats()
    assert stats["prefix_hit_tokens"] == reusable, "the hits reused other blocks than the rules allow"
    assert stats["prefix_hit_rate"] == reusable / stats["prompt_tokens"]
    assert off.stats()["prefix_hit_tokens"] == 0
    assert stats["blocks_used"] == 0 and stats["blocks_cached"] > 0
    assert stats["blocks_cached"] + stats["blocks_free"] == stats["blocks_total"]


def test_sink_rows_are_restored_from_the_first_blocks_entry(model, tokenizer):
    """int4 keeps 2 sink rows at block size 4. Two slots: the hit lands in the slot another prompt used, whose
    sink rows are that prompt's; without the entry's copy the hit reads them."""
    llm = make_llm(model, tokenizer, "int4", num_slots=2)
    assert llm.cache.layout.sink_tokens == 2
    llm.generate([[90, 91, 92, 93, 94]], greedy(2))  # slot 0: other sink rows
    llm.generate([BASE[:5]], greedy(1))  # slot 1: seals and caches BASE's first block
    got = llm.generate([BASE[:6]], greedy(8))[0]  # slot 0 again, a hit of one block
    assert llm.stats()["prefix_hit_tokens"] == 4
    want = make_llm(model, tokenizer, "int4", num_slots=2, enable_prefix_caching=False).generate([BASE[:6]], greedy(8))[0]
    assert got.new_token_ids == want.new_token_ids and got.new_logprobs == want.new_logprobs


def test_shared_blocks_outlive_their_owner_and_a_preempted_holder(model, tokenizer):
    """A small pool: requests sharing BASE preempt each other (swap to host); outputs equal a large pool without the cache."""
    prompts = [BASE + [i, i + 1] for i in (1, 3, 5, 7)]
    want = make_llm(model, tokenizer, "int4", num_blocks=64, enable_prefix_caching=False).generate(prompts, greedy(12))
    small = make_llm(model, tokenizer, "int4", num_blocks=11)
    small.generate([BASE], greedy(1))  # BASE's 4 blocks cached
    got = small.generate(prompts, greedy(12))
    assert small.scheduler.num_preemptions > 0, "the pool was not small enough to preempt"
    assert small.stats()["prefix_hit_tokens"] >= 4 * 16
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    assert [o.new_logprobs for o in got] == [o.new_logprobs for o in want]
    assert small.block_manager.num_free_blocks == 11 and not small.scheduler.swapper.saved


def test_cached_blocks_are_evicted_lru_when_the_pool_needs_them(model, tokenizer):
    llm = make_llm(model, tokenizer, "int8", num_blocks=10)
    other = list(range(200, 217))
    llm.generate([BASE], greedy(1))  # 4 cached blocks
    llm.generate([other], greedy(1))  # 4 more, released after BASE's
    assert llm.stats()["blocks_cached"] == 8 and llm.stats()["blocks_free"] == 2
    big = list(range(300, 317))
    later = [BASE[:13], other[:13]]  # each could reuse 3 blocks
    want = make_llm(model, tokenizer, "int8", enable_prefix_caching=False).generate([big, *later], greedy(3))
    got = [llm.generate([big], greedy(3))[0]]  # needs 4 blocks: the 2 free ones, then the 2 least recently released
    assert llm.stats()["blocks_evicted"] == 2
    hits = []
    for p in later:
        before = llm.stats()["prefix_hit_tokens"]
        got.append(llm.generate([p], greedy(3))[0])
        hits.append(llm.stats()["prefix_hit_tokens"] - before)
    assert hits == [8, 12], "BASE lost its last two blocks (a chain goes from its end); the other prefix none"
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    assert [o.new_logprobs for o in got] == [o.new_logprobs for o in want]


def test_block_manager_counts_free_used_and_cached():
    bm = BlockManager(6, 2, BS, PrefixCache(BS, "salt"))
    a, b = (Sequence(list(range(9)), SamplingParams()) for _ in range(2))
    for s in (a, b):
        bm.allocate_slot(s)
    bm.append_block(a), bm.append_block(a)
    bm.prefix.register(a, 0), bm.prefix.register(a, 1)
    hit = bm.prefix.match(b)
    assert hit == a.block_table
    bm.prefix.take(b, hit)
    assert b.num_cached == 8 and bm.num_used_blocks == 2
    bm.free(a)
    assert bm.num_used_blocks == 2 and bm.num_cached_blocks == 0, "a block another sequence holds was released"
    bm.free(b)
    assert bm.num_cached_blocks == 2 and len(bm.free_blocks) == 4 and bm.num_free_blocks == 6
    assert list(bm.prefix.lru) == [hit[1], hit[0]], "a chain is released from its end"


def test_admission_does_not_count_the_cached_blocks_a_hit_takes():
    """Free list empty, 2 cached blocks, both of them a waiting prompt's hit: nothing is left for its third
    block, so it waits (counted as allocatable, they would admit it into a step that cannot seal)."""
    from trtkv.runtime.scheduler import Scheduler

    bm = BlockManager(5, 3, BS, PrefixCache(BS, "salt"))
    sched = Scheduler(bm, max_num_batched_tokens=64)
    a = Sequence(list(range(9)), SamplingParams())
    bm.allocate_slot(a)
    hit = [bm.append_block(a), bm.append_block(a)]
    bm.prefix.register(a, 0), bm.prefix.register(a, 1)
    bm.free(a)
    c = Sequence(list(range(50, 63)), SamplingParams())
    bm.allocate_slot(c)
    for _ in range(3):
        bm.append_block(c)
    assert not bm.free_blocks and bm.num_cached_blocks == 2
    b = Sequence(list(range(8)) + [70, 71, 72, 73, 74], SamplingParams(max_tokens=1))
    sched.add(b)
    assert sched.schedule().empty and b in sched.waiting and bm.num_cached_blocks == 2
    bm.free(c)
    out = sched.schedule()
    assert [(ch.seq, ch.start, ch.length) for ch in out.prefill] == [(b, 8, 4)] and b.block_table[:2] == hit


def test_keys_depend_on_the_kv_format(model, tokenizer):
    """The same tokens in another format seal other bytes: their keys differ (the salt, ``prefix_salt``)."""
    from trtkv.runtime.llm_engine import prefix_salt

    llms = [make_llm(model, tokenizer, f) for f in ("int4", "int8")]
    salts = [prefix_salt(llm.manifest, llm.engine) for llm in llms]
    keys = [llm.block_manager.prefix.keys(Sequence(BASE, SamplingParams()), 4) for llm in llms]
    assert salts[0] != salts[1] and not set(keys[0]) & set(keys[1])
