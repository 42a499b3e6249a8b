"""Steps across blocks: the torch engine's CPU prefill seals the blocks a long chunk fills inside the step.

* the engine: one step over several blocks gives the logits and the cache of the same tokens in block-by-block steps
  (every format family, sink rows sealed in the step or before it, blocks of 5 and 8, a batch of sequences that start
  at a block boundary, inside an open block and after sealed blocks), and the decode steps after it agree too;
* which engines take such steps (``cross_blocks``) and the one-line refusal of the others;
* the scheduler: a chunk runs to the token budget, reserves every block it fills, preempts the newest sequence when
  they are not there, registers the blocks it fills for prefix caching (the partial one as full when the budget cut it);
* the runtime: greedy texts and log-probabilities equal with and without crossing, in fewer steps; a prefix hit over
  blocks sealed by a crossing step gives the same output.
"""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from trtkv.cache_layout import PagedKVLayout, WindowRing, chunk_length
from trtkv.errors import TrtkvError
from trtkv.formats import CALIBRATION_FREE, fit_formats
from trtkv.models import load_model, model_info
from trtkv.plugins import cpu_attention
from trtkv.runtime.block_manager import BlockManager
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.scheduler import Scheduler
from trtkv.runtime.sequence import SamplingParams, Sequence
from trtkv.runtime.step import StepBatch
from trtkv.runtime.torch_engine import TorchEngine

needs_c = pytest.mark.skipif(cpu_attention._compiler() is None, reason="no C compiler on this machine")
LLAMA = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def llama(tiny_models):
    d, _ = tiny_models("llama", **LLAMA)
    return model_info(str(d)), load_model(str(d), device="cpu", dtype="float32").model


def _fill(engine, cache, prompts, pre, tables, cross: bool):
    """Cache ``pre[i]`` tokens of each prompt block by block, then the rest: in one step (``cross``) or block by block.
    Returns each prompt's last logits."""
    bs = cache.block_size
    lens = [0] * len(prompts)

    def step(rows):
        seqs = [i for i, r in enumerate(rows) if r]
        sb = StepBatch.make([rows[i] for i in seqs], [lens[i] for i in seqs], [tables[i] for i in seqs], seqs)
        out = engine.step(sb, cache)
        cache.write_new_rows(sb, out)
        for i in seqs:
            lens[i] += len(rows[i])
        return {i: out.logits[j] for j, i in enumerate(seqs)}

    def blockwise(stop):
        last = {}
        while any(lens[i] < stop[i] for i in range(len(prompts))):
            rows = [p[lens[i]: lens[i] + chunk_length(lens[i], stop[i] - lens[i], bs)] if lens[i] < stop[i] else [] for i, p in enumerate(prompts)]
            last.update(step(rows))
        return last

    blockwise(pre)
    last = step([p[n:] for p, n in zip(prompts, pre)]) if cross else blockwise([len(p) for p in prompts])
    return torch.stack([last[i] for i in range(len(prompts))])


@needs_c
@pytest.mark.parametrize("kv", ["fp16", "int8", "int4", CALIBRATION_FREE["int3"], "k=int4:g8:asym,v=int8:g16:asym", "fp8",
                                # keys stored before RoPE with outlier lists, values through a codebook
                                "k=int3:bchannel:asym:prerope:qsmooth:hadamard:out5,v=int3:g8:sym:hadamard:nuq:out2,block=8,sink=4"])
@pytest.mark.parametrize("bs", [5, 8])
def test_a_step_across_blocks_gives_the_block_by_block_logits_and_cache(llama, kv, bs):
    info, model = llama
    [fmt], _ = fit_formats([kv], info.head_dim)
    fmt = fmt.with_block_size(bs)
    if fmt.sink_tokens:
        fmt = fmt.model_copy(update={"sink_tokens": 2})
    engine = TorchEngine(model, attention="cpu", device="cpu")
    prompts = [list(range(3, 40)), list(range(50, 63)), list(range(70, 75)), list(range(80, 110))]
    pre = [0, 3, 0, 2 * bs + 1]  # a boundary, inside the first open block, no crossing at all, after sealed blocks
    tables = [list(range(i * 10, i * 10 + 10)) for i in range(4)]
    results = []
    for cross in (False, True):
        lay = PagedKVLayout(fmt, info.num_kv_heads, info.head_dim, bs, 40, 4)
        cache = PagedKVCache(lay, info.num_layers)
        if fmt.k.smooth or fmt.v.codebook:
            from conftest import random_kv_params

            cache = PagedKVCache(lay, info.num_layers, random_kv_params(fmt, info.num_kv_heads, info.head_dim, info.num_layers, seed=5))
        if fmt.k.is_static or fmt.v.is_static:
            from trtkv.artifacts import LayerParams
            from trtkv.quant import TensorParams

            cache = PagedKVCache(lay, info.num_layers, [LayerParams(TensorParams(scale=torch.tensor(0.05)), TensorParams(scale=torch.tensor(0.04)))] * info.num_layers)
        logits = _fill(engine, cache, prompts, pre, tables, cross)
        nxt = logits.argmax(-1)
        decodes = []
        for _ in range(bs + 2):  # past the next seal
            sb = StepBatch.make([[int(t)] for t in nxt], [len(p) + len(decodes) for p in prompts], tables, list(range(4)))
            out = engine.step(sb, cache)
            cache.write_new_rows(sb, out)
            decodes.append(out.logits)
            nxt = out.logits.argmax(-1)
        results.append((logits, torch.stack(decodes, 1)))
    (a, da), (b, db) = results
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(db, da, rtol=1e-4, atol=1e-4)


@needs_c
def test_the_step_seals_every_block_it_fills(llama):
    info, model = llama
    [fmt], _ = fit_formats(["int4"], info.head_dim)
    fmt = fmt.with_block_size(4).model_copy(update={"sink_tokens": 1})
    engine = TorchEngine(model, attention="cpu", device="cpu")
    caches = []
    for cross in (False, True):
        cache = PagedKVCache(PagedKVLayout(fmt, info.num_kv_heads, info.head_dim, 4, 12, 1), info.num_layers)
        _fill(engine, cache, [list(range(3, 21))], [0], [[7, 2, 9, 4, 11]], cross)
        caches.append(cache)
    for name, t in caches[0].tensors.items():
        other = caches[1].tensors[name]
        if "tail" in name:  # fp16 rows: one rounding step at most
            torch.testing.assert_close(other.float(), t.float(), rtol=2e-3, atol=2e-3)
        else:  # codes and scales of blocks 7, 2, 9, 4 (18 tokens: 4 sealed); block 11 and the unused ones untouched
            used = torch.tensor([7, 2, 9, 4])
            assert (other[:, used].float() - t[:, used].float()).abs().max() <= 1.01 * (t[:, used].float().abs().max() * 2e-3 + 1), name
            rest = torch.tensor([b for b in range(12) if b not in (7, 2, 9, 4)])
            assert torch.equal(other[:, rest], t[:, rest]), name


@needs_c
@pytest.mark.parametrize("kv", ["int4", CALIBRATION_FREE["int3"], "k=int4:g8:asym,v=int8:g16:asym"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_pool_stores_the_codes_the_step_attended(tiny_models, kv, dtype):
    """A crossing step hands the blocks it sealed to the pool (``StepSeals``): stored as they are, they are the bytes the
    pool's own seal makes of the step's fp16 rows (a bfloat16 model's too), sink rows included; a block that fills at the
    step's last token is the pool's to seal."""
    d, _ = tiny_models("llama", **LLAMA)
    info, model = model_info(str(d)), load_model(str(d), device="cpu", dtype=dtype).model
    [fmt], _ = fit_formats([kv], info.head_dim)
    fmt = fmt.with_block_size(4).model_copy(update={"sink_tokens": 1})
    engine = TorchEngine(model, attention="cpu", device="cpu")
    prompts, tables = [list(range(3, 14)), list(range(20, 26)), list(range(30, 38))], [[5, 1, 7], [2, 9], [0, 3]]
    sb = StepBatch.make(prompts, [0, 0, 0], tables, [0, 1, 2])
    caches = [PagedKVCache(PagedKVLayout(fmt, info.num_kv_heads, info.head_dim, 4, 10, 3), info.num_layers) for _ in range(2)]
    out = engine.step(sb, caches[0])
    assert out.sealed is not None and out.sealed.count == [2, 1, 1]  # 11, 6 and 8 tokens: the 8th fills block 1 at the end
    caches[0].write_new_rows(sb, out)
    caches[1].write_new_rows(sb, dataclasses.replace(out, sealed=None))  # the pool seals every block from the rows
    for name, t in caches[0].tensors.items():
        assert torch.equal(t, caches[1].tensors[name]), name
    zeroed = {key: dataclasses.replace(qt, codes=torch.zeros_like(qt.codes)) for key, qt in out.sealed.blocks.items()}
    caches.append(PagedKVCache(PagedKVLayout(fmt, info.num_kv_heads, info.head_dim, 4, 10, 3), info.num_layers))
    caches[2].write_new_rows(sb, dataclasses.replace(out, sealed=dataclasses.replace(out.sealed, blocks=zeroed)))
    for which in ("k", "v"):  # not quantized again: the step's (here zeroed) codes in blocks 5, 1, 2, 0; the pool's in 3
        data = caches[2].tensors[f"{which}_data"]
        assert not data[:, [5, 1, 2, 0]].any() and torch.equal(data[:, 3], caches[0].tensors[f"{which}_data"][:, 3])
        assert caches[0].tensors[f"{which}_data"][:, [5, 1, 2, 0, 3]].any()


def test_which_engines_cross_blocks(family, tiny_models, llama):
    info, model = llama
    if cpu_attention.unavailable() is None:
        assert TorchEngine(copy.deepcopy(model), attention="cpu", device="cpu").cross_blocks
    assert not TorchEngine(copy.deepcopy(model), attention="torch", device="cpu").cross_blocks
    _, sliding = family("mistral-sw")
    assert not TorchEngine(copy.deepcopy(sliding), attention="torch", device="cpu").cross_blocks
    if cpu_attention.unavailable() is None:
        assert not TorchEngine(copy.deepcopy(sliding), attention="cpu", device="cpu").cross_blocks


def test_an_engine_without_it_refuses_a_crossing_step_in_one_line(llama, family):
    info, model = llama
    [fmt], _ = fit_formats(["int8"], info.head_dim)
    cache = PagedKVCache(PagedKVLayout(fmt.with_block_size(4), info.num_kv_heads, info.head_dim, 4, 8, 1), info.num_layers)
    sb = StepBatch.make([list(range(3, 9))], [2], [[0, 1]], [0])  # 2 + 6 tokens: across a block of 4
    with pytest.raises(TrtkvError, match="crosses a block boundary") as err:
        TorchEngine(copy.deepcopy(model), attention="torch", device="cpu").step(sb, cache)
    assert "\n" not in str(err.value)
    d, _ = family("mistral-sw")
    sinfo = model_info(str(d))
    smodel = load_model(str(d), device="cpu", dtype="float32").model
    [sfmt], _ = fit_formats(["int8"], sinfo.head_dim)
    ringed = PagedKVCache(PagedKVLayout(sfmt.with_block_size(4), sinfo.num_kv_heads, sinfo.head_dim, 4, 8, 1), sinfo.num_layers,
                          ring=WindowRing.of(sinfo, 4))
    with pytest.raises(TrtkvError, match="window ring"):
        TorchEngine(smodel, attention="torch", device="cpu").step(sb, ringed)


# ------------------------------------------------------------------------------------------------ the scheduler


def _sched(num_blocks=12, budget=20, bs=4, prefix=False, slots=4):
    from trtkv.runtime.prefix_cache import PrefixCache

    pc = PrefixCache(bs, "salt", None) if prefix else None
    bm = BlockManager(num_blocks, slots, bs, pc)
    return Scheduler(bm, max_num_batched_tokens=budget, max_step_tokens=bs, cross_blocks=True)


def _seq(n, max_tokens=4, start=3):
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, temperature=0))


def _run(sched):
    out = sched.schedule()
    sched.postprocess(out)
    return out


def test_a_chunk_runs_to_the_budget_and_reserves_every_block_it_fills():
    sched = _sched(budget=11)
    a, b = _seq(14), _seq(6, start=40)
    sched.add(a)
    out = _run(sched)
    assert [(c.seq, c.start, c.length) for c in out.prefill] == [(a, 0, 11)]  # the whole budget, across blocks 0-2
    assert len(a.block_table) == 2  # it fills blocks 0 and 1 (11 tokens of blocks of 4)
    sched.add(b)
    out = _run(sched)  # a's last 3 and b want prefill chunks: 11 // 2 -> 4 tokens each at most
    assert [(c.seq, c.start, c.length) for c in out.prefill] == [(a, 11, 3), (b, 0, 4)]
    assert len(a.block_table) == 3 and len(b.block_table) == 1


@pytest.mark.parametrize("waiting, decodes, budget, want", [
    (1, 0, 512, 512),  # one prompt: the whole budget
    (8, 0, 512, 64),  # eight prompts: a block each (bs 64), like block-wise steps
    (3, 0, 512, 128),  # 170 -> whole blocks
    (2, 4, 516, 256),  # four decodes first
    (20, 0, 512, 64),  # more prompts than slots: only the slots' worth count (8 slots): a block each, one at least
])
def test_the_budget_is_shared_by_the_prompts_that_want_it(waiting, decodes, budget, want):
    bm = BlockManager(400, 8, 64, None)
    sched = Scheduler(bm, max_num_batched_tokens=budget, max_step_tokens=64, cross_blocks=True)
    for i in range(decodes):
        s = _seq(3, start=10 * i + 1)
        sched.add(s)
    if decodes:
        _run(sched)
        for s in sched.running:
            s.append_token(5, 0.0)  # one token pending each: decodes
    for i in range(waiting):
        sched.add(_seq(600, start=1000 + i))
    out = sched.schedule()
    assert {c.length for c in out.prefill} == {want} or (budget - decodes) // want < waiting
    assert out.prefill[0].length == want


def test_a_crossing_chunk_without_its_blocks_preempts_the_newest():
    sched = _sched(num_blocks=2, budget=16)
    a, b = _seq(2), _seq(3, start=40)
    sched.add(a)
    sched.add(b)
    _run(sched)  # both prompts cached, no block filled
    for t in range(8):  # 8 more tokens of a to cache: 10 in all, across blocks 0 and 1
        a.append_token(60 + t, 0.0)
    out = sched.schedule()
    assert [(c.seq, c.start, c.length) for c in out.prefill] == [(a, 2, 8)]
    assert len(a.block_table) == 2 and not out.preempted
    sched.postprocess(out)
    for t in range(2):
        b.append_token(80 + t, 0.0)  # b: 2 pending, fill its block 0: no block left
    a.append_token(90, 0.0)
    out = sched.schedule()
    assert out.preempted == [b]  # the newest gives way
    assert [(c.seq, c.length) for c in out.decode] == [(a, 1)]


def _registered(sched, seq) -> list[int]:
    return [i for i, blk in enumerate(seq.block_table) if blk in sched.bm.prefix.key_of]


def test_crossing_chunks_register_what_they_fill_for_prefix_caching():
    sched = _sched(budget=10, prefix=True)
    a = _seq(22)
    sched.add(a)
    _run(sched)  # 0..10: blocks 0 and 1 filled; block 2 begun and cut by the budget: it goes on as full
    assert _registered(sched, a) == [0, 1] and a.block_full_steps
    _run(sched)  # 10..20: blocks 2, 3, 4
    assert _registered(sched, a) == [0, 1, 2, 3, 4] and a.block_full_steps
    _run(sched)  # 20..22: the prompt's end, inside block 5: not full
    assert not a.block_full_steps


def test_a_block_finished_by_decodes_is_not_registered():
    sched = _sched(budget=10, prefix=True)
    a = _seq(6, max_tokens=6)
    sched.add(a)
    _run(sched)  # 0..6: block 0 filled, block 1 begun by the prompt's end
    assert _registered(sched, a) == [0] and not a.block_full_steps
    for t in range(2):
        a.append_token(50 + t, 0.0)
        _run(sched)  # decodes: 6, then 7 fills block 1
    assert len(a.block_table) == 2 and _registered(sched, a) == [0]


# ------------------------------------------------------------------------------------------------ the runtime


def _llm(model, tokenizer, fmt, *, cross: bool, prefix: bool = False, num_blocks=64):
    from trtkv.runtime.block_manager import CacheBudget
    from trtkv.runtime.config import RuntimeConfig
    from trtkv.runtime.llm_engine import LLMEngine

    cfg = model.config
    bs = 8
    fmt = fmt.with_block_size(bs)
    manifest = SimpleNamespace(
        limits=SimpleNamespace(max_batch=4, max_seq_len=256, block_size=bs, max_new_tokens_per_step=bs, max_num_blocks=10**6, max_num_slots=64),
        model=SimpleNamespace(eos_token_ids=[0], vocab_size=cfg.vocab_size), kv_spec=fmt.name, kv_format=fmt)
    layout = PagedKVLayout(fmt, cfg.num_key_value_heads, cfg.head_dim, bs, num_blocks, 4)
    cache = PagedKVCache(layout, cfg.num_hidden_layers)
    engine = TorchEngine(copy.deepcopy(model), attention="cpu", device="cpu")
    if not cross:  # the same engine, taking one block per step (the property is the class's: shadowed on a subclass)
        engine.__class__ = type("OneBlockPerStep", (TorchEngine,), {"cross_blocks": False})
    budget = CacheBudget(0, layout.bytes_per_block(), layout.tail_bytes_per_slot(), bs, 4, num_blocks)
    return LLMEngine(engine, manifest, cache, tokenizer, RuntimeConfig(max_seqs=4, max_batched_tokens=48, enable_prefix_caching=prefix), budget)


NEAR_TIE = 0.01  # nats: a top-2 margin a one-code difference in a sealed block can flip on this tiny random model


@needs_c
@pytest.mark.parametrize("kv", ["fp16", "int4"])
def test_the_runtime_gives_the_same_texts_in_fewer_steps(small_llama, tokenizer, kv):
    [fmt], _ = fit_formats([kv], small_llama.config.head_dim)
    prompts = [list(range(5, 60)), list(range(100, 131)), list(range(200, 209))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = {}
    for cross in (False, True):
        llm = _llm(small_llama, tokenizer, fmt, cross=cross)
        assert llm.scheduler.cross_blocks is cross
        outs = llm.generate(prompts, params)
        got[cross] = ([o.new_token_ids for o in outs], [o.new_logprobs for o in outs], llm.stats()["steps"])
    # The two runs chunk the prefill differently, so a sealed block's values differ in the last bits and a code at a
    # rounding edge can flip: the texts must agree up to the first near-tie of the float32 model (top-2 margin under
    # NEAR_TIE nats), where either token is right; most tokens sit before one.
    compared = 0
    for prompt, a, b, la, lb in zip(prompts, got[True][0], got[False][0], got[True][1], got[False][1]):
        with torch.no_grad():
            logp = small_llama(torch.tensor([prompt + b])).logits[0, len(prompt) - 1:-1].double().log_softmax(-1)
        top2 = logp.topk(2, -1).values
        decided = next((i for i, m in enumerate((top2[:, 0] - top2[:, 1]).tolist()) if m < NEAR_TIE), len(b))
        assert a[:decided] == b[:decided], (a, b, decided)
        compared += decided
        if a == b:
            torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-4, atol=1e-4)
    assert compared >= 2 * sum(len(b) for b in got[False][0]) // 3, "too few decided tokens to compare: pick other prompts"
    assert got[True][2] < got[False][2]


@needs_c
def test_a_prefix_hit_over_blocks_sealed_across_gives_the_same_output(small_llama, tokenizer):
    [fmt], _ = fit_formats(["int8"], small_llama.config.head_dim)
    llm = _llm(small_llama, tokenizer, fmt, cross=True, prefix=True)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = list(range(5, 70))
    first = llm.generate([prompt], params)[0].new_token_ids
    again = llm.generate([prompt], params)[0].new_token_ids
    assert llm.stats()["prefix_hit_tokens"] >= 48
    assert again == first


def test_prefill_chunks_share_an_engine_call_only_when_padding_stays_small():
    from trtkv.runtime.llm_engine import PAD_LIMIT, padded_batches
    from trtkv.runtime.scheduler import Chunk

    def chunks(*lengths):
        return [Chunk(_seq(600, start=i * 700 + 1), 0, n) for i, n in enumerate(lengths)]

    def shape(groups):
        return [[c.length for c in g] for g in groups]

    assert shape(padded_batches(chunks(2, 500), 8)) == [[500], [2]]  # padding 2 -> 500 would double the work
    assert shape(padded_batches(chunks(64, 64, 64, 64), 8)) == [[64, 64, 64, 64]]
    assert shape(padded_batches(chunks(64, 64, 64), 2)) == [[64, 64], [64]]  # max_batch
    assert shape(padded_batches(chunks(100, 90, 10), 8)) == [[100, 90], [10]]  # 2 x 100 <= 1.25 x 190; 3 x 100 > 1.25 x 200
    assert shape(padded_batches(chunks(1, 1, 1), 8)) == [[1, 1, 1]]  # decodes
    for lengths in ([5, 3, 9, 9, 1, 40], [64] * 9 + [7], [300, 200, 100, 50]):
        groups = padded_batches(chunks(*lengths), 4)
        assert sorted(c.length for g in groups for c in g) == sorted(lengths)  # every chunk once
        for g in groups:
            assert len(g) <= 4 and len(g) * max(c.length for c in g) <= PAD_LIMIT * sum(c.length for c in g) or len(g) == 1


@pytest.mark.parametrize("kv", ["int4", "int8", "fp8"])
def test_rows_across_blocks_seal_the_codes_of_block_by_block_writes(llama, kv):
    """write_new_rows over several blocks seals them with one quantization per layer: the same bytes as block by block
    (sink rows of a first block included)."""
    info, _ = llama
    [fmt], _ = fit_formats([kv], info.head_dim)
    fmt = fmt.with_block_size(4)
    if fmt.sink_tokens:
        fmt = fmt.model_copy(update={"sink_tokens": 1})
    from trtkv.artifacts import LayerParams
    from trtkv.quant import TensorParams
    from trtkv.runtime.step import StepOutput

    params = [LayerParams(TensorParams(scale=torch.tensor(0.07)), TensorParams(scale=torch.tensor(0.05)))] * info.num_layers
    g = torch.Generator().manual_seed(3)
    L, H, D = info.num_layers, info.num_kv_heads, info.head_dim
    rows = [(torch.randn(L, 1, n, H, D, generator=g) * 2).half() for n in (11, 7)]  # two sequences: 11 tokens from 0, 7 from 2
    caches = []
    for cross in (False, True):
        cache = PagedKVCache(PagedKVLayout(fmt, H, D, 4, 12, 2), L, params)
        for b, (start, k) in enumerate(zip((0, 2), rows)):
            pieces = [(start, k.shape[2])] if cross else [(p, e - p) for p, e in __import__("trtkv.cache_layout", fromlist=["block_chunks"]).block_chunks(start, k.shape[2], 4)]
            if start and b == 1:  # sequence 1's first two tokens already in its open block
                cache.write_new_rows(StepBatch.make([[0, 0]], [0], [[6, 7, 8]], [1]), StepOutput(None, k[:, :, :2] * 0 + 1, k[:, :, :2] * 0 - 1))
            for p, n in pieces:
                o = p - start
                sb = StepBatch.make([[0] * n], [p], [[2, 9, 4] if b == 0 else [6, 7, 8]], [b])
                cache.write_new_rows(sb, StepOutput(None, k[:, :, o : o + n], -k[:, :, o : o + n]))
        caches.append(cache)
    for name, t in caches[0].tensors.items():
        assert torch.equal(caches[1].tensors[name], t), name


def test_seal_rows_with_one_ring_block_twice_keeps_the_later(family):
    """A window ring can map two blocks of one step to one ring block: sealed in order, the later one wins."""
    d, _ = family("mistral-sw")
    info = model_info(str(d))
    [fmt], _ = fit_formats(["int8"], info.head_dim)
    ring = WindowRing.of(info, 4)
    g = torch.Generator().manual_seed(5)
    L, H, D = info.num_layers, info.num_kv_heads, info.head_dim
    blocks = [(torch.randn(L, H, 4, D, generator=g)).half() for _ in range(ring.ring_blocks + 1)]
    together = PagedKVCache(PagedKVLayout(fmt.with_block_size(4), H, D, 4, 8, 1), L, ring=ring)
    one_by_one = PagedKVCache(PagedKVLayout(fmt.with_block_size(4), H, D, 4, 8, 1), L, ring=ring)
    items = [(0, i, i, k, -k) for i, k in enumerate(blocks)]  # index 0 and index ring_blocks share a ring block
    together.seal_rows(items)
    for item in items:
        one_by_one.seal_rows([item])
    for name, t in together.tensors.items():
        assert torch.equal(one_by_one.tensors[name], t), name
