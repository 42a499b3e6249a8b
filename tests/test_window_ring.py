"""The window ring: sliding-window layers free the sealed blocks their window has passed (trtkv.cache_layout.WindowRing).

* the ring's arithmetic (``first_window_block``, ``window_ring_blocks``) against a naive count of the blocks holding
  a key position a query still reads, odd windows and block sizes included;
* the torch engine over a ringed cache gives the logits of the same engine over a cache that keeps every block, for
  every sliding family, fp16 and int4 (sink rows), two sequences of different lengths, the ring wrapping many times;
  and fewer bytes;
* the runtime: the budget pays the ring per slot and gives the rest to the global layers' blocks, every batched step's
  logits equal a kept-blocks shadow cache's over the same rows (``_shadow``), preemption (swap) restores the ring
  exactly, stats count bytes per layer type;
* refusals: prefix caching and the ONNX step network cannot take a ringed cache.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, WINDOW
from test_families import LAYER_TYPES

from trtkv.cache_layout import PagedKVLayout, WindowRing, first_window_block, window_ring_blocks
from trtkv.errors import TrtkvError
from trtkv.formats import fit_formats
from trtkv.models import SLIDING_ATTENTION, load_model, model_info
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.torch_engine import TorchEngine
from trtkv.runtime.verify import StaticBatch

SLIDING = [n for n in FAMILIES if SLIDING_ATTENTION in LAYER_TYPES[n]]


def _naive_live_blocks(context: int, window: int, bs: int) -> set[int]:
    """Sealed blocks holding a key position the query at ``context`` reads (key > context - window)."""
    sealed = context // bs
    return {p // bs for p in range(context) if p > context - window and p // bs < sealed}


@pytest.mark.parametrize("bs", [1, 3, 4, 16])
def test_ring_arithmetic_matches_a_naive_count(bs):
    for window in [1, 2, 5, 8, 13, 16, 17, 40]:
        most = 0
        for context in range(0, 4 * window + 5 * bs):
            live = _naive_live_blocks(context, window, bs)
            first = first_window_block(context, window, bs)
            assert all(b >= first for b in live) and (not live or min(live) == first), (window, bs, context)
            most = max(most, context // bs - first)
            assert len(live) <= window_ring_blocks(window, bs)
        assert window_ring_blocks(window, bs) == most  # not one block more than some step reads
    ctx = torch.tensor([0, 7, 8, 9, 100])
    assert first_window_block(ctx, 8, 4).tolist() == [first_window_block(int(c), 8, 4) for c in ctx]


def _cache(info, fmt, bs: int, num_blocks: int, slots: int, ring: bool) -> PagedKVCache:
    lay = PagedKVLayout(fmt.with_block_size(bs), info.num_kv_heads, info.head_dim, bs, num_blocks, slots)
    return PagedKVCache(lay, info.num_layers, ring=WindowRing.of(info, bs) if ring else None)


def _run(engine, cache, prompts, new_tokens):
    sb = StaticBatch(cache, len(prompts))
    steps = [sb.prefill(engine, prompts)]
    for _ in range(new_tokens):
        nxt = steps[-1].argmax(-1)
        steps.append(sb.step(engine, {i: [int(nxt[i])] for i in range(len(prompts))}))
    return torch.stack(steps, 1)


@pytest.mark.parametrize("name", SLIDING)
@pytest.mark.parametrize("kv", ["fp16", "int4"])
def test_ringed_cache_gives_the_kept_blocks_logits(family, name, kv):
    d, _ = family(name)
    info = model_info(str(d))
    model = load_model(str(d), device="cpu", dtype="float32").model
    [fmt], _ = fit_formats([kv], info.head_dim)
    bs = 4  # window 8: a ring of 2 blocks, wrapped ~10 times by 45 tokens; int4 keeps 2 sink rows (half a block)
    engine = TorchEngine(model, attention="torch", device="cpu")
    prompts = [list(range(3, 33)), list(range(40, 51))]  # 30 and 11 tokens: the sequences' first blocks differ
    kept = _cache(info, fmt, bs, 40, 2, ring=False)
    ringed = _cache(info, fmt, bs, 40, 2, ring=True)
    assert ringed.ring.ring_blocks == window_ring_blocks(WINDOW, bs) == 2
    want, got = _run(engine, kept, prompts, 15), _run(engine, ringed, prompts, 15)
    # fewer keys in the products: only the summation order differs (Gemma 3's output norm amplifies it: 1e-4). Gemma 3
    # int4 (head_dim 256, Hadamard values): those last bits flip int4 codes of later rows, and both engines sit ~1e-2 from
    # the eval cache's logits (measured 0.0095 kept, 0.016 ringed at 42 tokens); the other families stay bit-close
    bound = {("gemma3", "fp16"): 5e-4, ("gemma3", "int4"): 2e-2}.get((name, kv), 2e-5)
    assert (got - want).abs().max().item() < bound
    n_sliding = LAYER_TYPES[name].count(SLIDING_ATTENTION)
    per_block = kept.layout.bytes_per_block()
    assert kept.nbytes() - ringed.nbytes() == n_sliding * per_block * (40 - 2 * ringed.ring.ring_blocks)


def test_ring_one_block_short_changes_the_logits(family, monkeypatch):
    """The ring's size is what the window needs, not slack: a ring one block smaller gives other logits."""
    import trtkv.cache_layout as cl

    d, _ = family("mistral-sw")
    info = model_info(str(d))
    model = load_model(str(d), device="cpu", dtype="float32").model
    [fmt], _ = fit_formats(["fp16"], info.head_dim)
    engine = TorchEngine(model, attention="torch", device="cpu")
    prompts = [list(range(3, 33))]
    want = _run(engine, _cache(info, fmt, 4, 40, 1, ring=True), prompts, 4)
    monkeypatch.setattr(cl.WindowRing, "ring_blocks", property(lambda self: window_ring_blocks(self.window, self.block_size) - 1))
    got = _run(engine, _cache(info, fmt, 4, 40, 1, ring=True), prompts, 4)
    assert (got - want).abs().max().item() > 1e-3


def test_swap_in_restores_the_ring_into_a_slot_another_sequence_used(family):
    """Swap out a sequence (sealed blocks, open block + sinks, ring blocks), let another sequence take its slot and
    blocks and overwrite everything, bring it back: every entry it owns equals what it held before, ring included."""
    from trtkv.runtime.block_manager import BlockManager
    from trtkv.runtime.kv_pool import RING
    from trtkv.runtime.sequence import SamplingParams, Sequence
    from trtkv.runtime.swap import Swapper

    info = model_info(str(family("gemma3")[0]))
    [fmt], _ = fit_formats(["int4"], info.head_dim)
    cache = _cache(info, fmt, 4, 12, 2, ring=True)
    assert any(n.endswith(RING) for n in cache.tensors) and cache.layout.sink_tokens
    gen = torch.Generator().manual_seed(0)

    def scramble():
        for t in cache.tensors.values():
            t.copy_(torch.randint(-100, 100, t.shape, generator=gen).to(t.dtype))

    def owned(seq, n_blocks):
        out = {}
        for name, t in cache.tensors.items():
            own = cache.slot_index(name, seq.slot)
            out[name] = (t[:, own] if own is not None else t[:, seq.block_table[:n_blocks]]).clone()
        return out

    bm, swapper = BlockManager(12, 2, 4), Swapper(cache)
    seq = Sequence(list(range(1, 30)), SamplingParams())
    bm.allocate_slot(seq)
    for _ in range(4):
        bm.append_block(seq)
    seq.num_cached = 14  # 3 sealed blocks, 2 rows in the open block
    scramble()
    want = owned(seq, 3)
    swapper.swap_out(seq)
    bm.free(seq)
    other = Sequence(list(range(40, 60)), SamplingParams())  # takes the free slot and blocks, writes everywhere
    bm.allocate_slot(other)
    for _ in range(5):
        bm.append_block(other)
    other_slot = other.slot
    third = Sequence([1, 2], SamplingParams())
    bm.allocate_slot(third)  # holds seq's old slot: seq comes back into the one `other` used
    scramble()
    bm.free(other)
    bm.allocate_slot(seq)
    assert seq.slot == other_slot
    for _ in range(swapper.blocks_needed(seq)):
        bm.append_block(seq)
    swapper.swap_in(seq)
    assert seq.num_cached == 14
    got = owned(seq, 3)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _llm(engine_dir, **kw):
    from trtkv.runtime.llm_engine import LLMEngine, RuntimeConfig

    return LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(**{"kv_memory_gib": 0.002, "max_seqs": 4, **kw}))


@pytest.fixture(scope="module")
def gemma3_engine(family, tmp_path_factory):
    from trtkv.builder.build import build_engine

    return build_engine(str(family("gemma3")[0]), None, "int4", tmp_path_factory.mktemp("ring") / "eng", backend="torch",
                        block_size=16, max_batch=4, max_seq_len=256)


def _shadow(llm) -> list[tuple[float, bool]]:
    """Run a cache that keeps every block beside ``llm``'s ringed one: each step also runs over it, and the ringed
    step's new rows are written into both, so both hold the same rows (the shadow seals its own blocks from them).
    Returns, per step, the largest logit gap and whether the greedy tokens agree.

    Why not compare against a separate kept-blocks runtime's text: on the tiny random int4 Gemma 3 greedy text is
    chaotic in float rounding. The ring sums over fewer keys than the kept cache's masked ones (1e-6 apart), the
    fp16 open-block rows and then int4 codes at the seal flip, and the texts part (measured: prompt 1 from token 34
    on). A kept runtime given one inert padding row per step parts from itself the same way (from token 30)."""
    ringed = llm.cache
    kept = PagedKVCache(ringed.layout, ringed.num_layers, ringed.params)
    assert kept.ring is None and ringed.ring is not None
    gaps: list[tuple[float, bool]] = []
    step, write = llm.engine.step, ringed.write_new_rows

    def shadow_step(batch, cache):
        out = step(batch, cache)
        ref = step(batch, kept)
        gaps.append(((out.logits - ref.logits).abs().max().item(), torch.equal(out.logits.argmax(-1), ref.logits.argmax(-1))))
        return out

    def shadow_write(batch, out):
        kept.write_new_rows(batch, out)
        return write(batch, out)

    llm.engine.step, ringed.write_new_rows = shadow_step, shadow_write
    return gaps


def test_runtime_frees_window_blocks_with_the_same_text(gemma3_engine):
    """The budget's split, the per-layer-type stats, and each batched step's logits (so its greedy text) those of
    the kept-blocks engine over the same rows (``_shadow`` says why not the text of a separate kept runtime)."""
    from trtkv.runtime.sequence import SamplingParams

    prompts = ["The quick brown fox jumps over the lazy dog " * 3, "Pack my box with five dozen liquor jugs"]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    kept, ringed = _llm(gemma3_engine, free_window_blocks=False), _llm(gemma3_engine)
    assert kept.cache.ring is None and ringed.cache.ring is not None
    lay = ringed.cache.layout
    # the budget: each slot pays its ring (5 sliding layers), the global layer's blocks take the rest
    ring_bytes = ringed.cache.ring.ring_blocks * lay.bytes_per_block() * 5
    assert ringed.budget.bytes_per_slot == kept.budget.bytes_per_slot + ring_bytes
    assert ringed.budget.bytes_per_block == kept.budget.bytes_per_block // 6
    assert ringed.budget.num_blocks > 5 * kept.budget.num_blocks
    assert ringed.cache.nbytes() <= ringed.budget.budget_bytes
    seen = []
    gaps = _shadow(ringed)
    got = ringed.generate(prompts, params, on_output=lambda o: seen.append(ringed.stats()))
    kept.generate(prompts, params)
    assert [len(o.new_token_ids) for o in got] == [40, 40]
    assert max(g for g, _ in gaps) < 1e-4 and all(same for _, same in gaps)  # measured <= 5e-6
    s = max(seen, key=lambda s: s["kv_bytes_used_full_attention"])
    assert s["prefix_caching"] is False and kept.stats()["prefix_caching"] is True
    # per layer type: 5 sliding layers hold at most their ring, the global one every sealed block
    per_slot = lay.tail_bytes_per_slot()
    assert s["kv_bytes_used_sliding_attention"] <= 2 * 5 * (ring_bytes // 5 + per_slot)
    assert s["kv_bytes_used_full_attention"] > s["kv_bytes_used_sliding_attention"] / 5
    assert "keep a ring of" in ringed.describe_cache()


def test_batched_ring_steps_equal_a_kept_shadow(gemma3_engine):
    """Four sequences of odd, different lengths batched and a fifth taking a finished one's slot (prefill chunks
    beside decodes, block boundaries crossed at different steps, each ring wrapped several times): every step's
    logits equal those of a cache that keeps every block over the same rows (``_shadow``), and so do one-at-a-time
    steps. Checked to fail on a ring read through batch rows instead of slots, on one first block for the whole
    batch, and on seals into slot 0's or the next slot's ring."""
    from trtkv.runtime.sequence import SamplingParams

    prompts = [list(range(3, 8)), list(range(20, 43)), list(range(50, 91)), list(range(100, 157)), list(range(160, 173))]
    lengths = [45, 29, 37, 21, 27]  # prompts of 5, 23, 41, 57, 13 tokens; the fifth waits for a slot
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    for max_seqs in (4, 1):
        llm = _llm(gemma3_engine, max_seqs=max_seqs)
        assert llm.cache.ring.ring_blocks == 1 and llm.cache.block_size == 16
        gaps = _shadow(llm)
        got = llm.generate(prompts, params)
        assert [len(o.new_token_ids) for o in got] == lengths
        assert max(g for g, _ in gaps) < 1e-4 and all(same for _, same in gaps), (max_seqs, max(gaps))
        assert llm.stats_counters["peak_running"] == max_seqs


def test_preempted_sequence_resumes_its_ring_exactly(gemma3_engine):
    """A pool too small for both sequences: one is preempted (swapped out, ring blocks included) and resumes; the
    texts equal those of a run without preemption."""
    from trtkv.runtime.sequence import SamplingParams

    prompts = ["The quick brown fox jumps over the lazy dog " * 2, "Pack my box with five dozen liquor jugs " * 2]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    roomy = _llm(gemma3_engine)
    want = [o.text for o in roomy.generate(prompts, params)]
    lay = roomy.cache.layout
    slot_bytes, block_bytes = roomy.budget.bytes_per_slot, roomy.budget.bytes_per_block
    tight = _llm(gemma3_engine, max_seqs=2, kv_memory_gib=(2 * slot_bytes + 9 * block_bytes) / 2**30)
    assert tight.budget.num_blocks == 9 and lay.block_size == 16
    got = [o.text for o in tight.generate(prompts, params)]
    assert tight.scheduler.num_preemptions > 0
    assert got == want


def test_prefix_caching_and_onnx_engines_refuse_a_ringed_cache(family, tmp_path):
    from trtkv.runtime.backends import OnnxRuntimeEngine
    from trtkv.runtime.prefix_cache import PrefixCache
    from trtkv.runtime.step import StepBatch

    info = model_info(str(family("gemma2")[0]))
    [fmt], _ = fit_formats(["int4"], info.head_dim)
    cache = _cache(info, fmt, 16, 4, 1, ring=True)
    with pytest.raises(TrtkvError, match="prefix caching needs every layer's sealed blocks") as e:
        PrefixCache(16, "salt", cache)
    assert "--keep-window-blocks" in e.value.fix
    ort = OnnxRuntimeEngine.__new__(OnnxRuntimeEngine)  # feeds() is where any step network meets the cache
    ort.manifest = None
    with pytest.raises(TrtkvError, match="reads every layer from one stack of pools through the block tables"):
        ort.feeds(StepBatch.make([[1]], [0], [[]], [0]), cache)
