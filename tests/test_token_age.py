"""Token-age formats (``recent=R:FORMAT``): a sequence's newest R sealed blocks read in a wider storage than older ones.

References are naive and in float64: each sealed block decoded with the storage its age gives it (the reference codec
``trtkv.quant`` on the block's own fp16 rows; the first block without its sink rows, which stay exact), then attention
by hand. Checked against them on fresh random rows at odd sizes (blocks of 5 and 7, head dims 20 and 24, 3 KV heads
with 2 queries each), step after step, so that blocks age out of the recent set between steps:

* the eval cache (``trtkv.kv_cache.TensorStore``), both ``age_out`` choices;
* the paged cache through the torch ops (seal into the pool and the slot's ring, ``attend``), a slot reused by a new
  sequence reading none of the old sequence's ring;
* the spec grammar's round trip and each refusal as one line; bytes at a context against a naive count; the paths that
  do not read the ring refuse in one line; prefix caching is off for such a cache.
"""

from __future__ import annotations

import pytest
import torch

from trtkv.artifacts import LayerParams
from trtkv.attention import TorchOps, resolve
from trtkv.cache_layout import PagedKVLayout, block_chunks, block_rope
from trtkv.errors import TrtkvError
from trtkv.formats import PRESETS, get_format
from trtkv.kv_cache import TensorStore
from trtkv.quant import TensorParams, dequantize, quantize_block
from trtkv.rope import RopeTable
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.step import StepBatch, StepOutput

H, G, L = 3, 2, 2  # KV heads, queries per KV head, layers
SPECS = [  # (spec, head dim)
    ("k=int4:bchannel:asym:hadamard,v=int2:token:asym,block=5,sink=1,recent=2:k=int8:bchannel:asym/v=int4:g4:sym", 20),
    ("k=int2:bchannel:asym:prerope,v=int2:g4:sym:out3,block=7,sink=2,recent=3:fp16", 24),
]


def _rope(D: int) -> RopeTable:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=D * H, num_attention_heads=H, head_dim=D, rope_theta=100.0)
    return RopeTable(LlamaRotaryEmbedding(cfg), D)


def _codec(rows: torch.Tensor, tf, first: int, rope) -> torch.Tensor:
    """One block [bs, H, D] through the reference codec of ``tf`` (keys before RoPE: at positions ``first ..``)."""
    x = rows.transpose(0, 1)[None].float()
    cs = block_rope(rope, torch.tensor([first]), x.shape[2]) if tf.pre_rope else None
    return dequantize(quantize_block(x, tf, None, head_axis=-3, rope=cs), tf, None, head_axis=-3, rope=cs)[0].transpose(0, 1).double()


def aged_reference(rows: torch.Tensor, fmt, which: str, rope=None, requantize: bool = False, sealed: int | None = None) -> torch.Tensor:
    """What a query after ``rows`` [n, H, D] (fp16 values) reads of them, float64, with ``sealed`` blocks sealed (default:
    every full block, the paged cache's; the eval cache seals a full block when the next token comes): blocks older than the newest
    ``recent_blocks`` in the base storage (``requantize``: from the recent storage's values), the newest in the recent
    storage, the sink rows and the open block exact."""
    bs, sink, R = fmt.block_size, fmt.sink_tokens, fmt.recent_blocks
    base, wide = getattr(fmt, which), getattr(fmt.recent, which)
    sealed = rows.shape[0] // bs if sealed is None else sealed
    out = rows.double().clone()
    for j in range(sealed):
        blk = rows[j * bs : (j + 1) * bs].clone()
        if j == 0 and sink and base.is_quantized:
            blk[:sink] = blk[sink]
        if j >= sealed - R:
            out[j * bs : (j + 1) * bs] = _codec(blk, wide, j * bs, rope)
        else:
            src = _codec(blk, wide, j * bs, rope).float() if requantize else blk
            out[j * bs : (j + 1) * bs] = _codec(src, base, j * bs, rope)
    if sealed and sink and base.is_quantized:
        out[:sink] = rows[:sink].double()
    return out


def _fmt(spec: str) -> object:
    return get_format(spec)


# --------------------------------------------------------------------------- the eval cache


@pytest.mark.parametrize("age_out", ["sealed_twice", "requantize"])
@pytest.mark.parametrize("spec,D", SPECS)
def test_eval_cache_reads_each_block_in_the_storage_its_age_gives_it(spec, D, age_out):
    fmt = _fmt(spec)
    g = torch.Generator().manual_seed(hash((spec, age_out)) % 2**31)
    n = fmt.block_size * (fmt.recent_blocks + 3) + 3  # blocks age out of the recent set as the chunks go by
    x = (torch.randn(2, H, n, D, generator=g) * 2).half().float()
    rope = _rope(D)
    for which in ("k", "v"):
        store = TensorStore(fmt, which, None, rope, age_out)
        limit = int(torch.randint(1, fmt.block_size, (1,), generator=g))
        for a, b in block_chunks(0, n, fmt.block_size, limit):
            store.append(x[:, :, a:b])
            got = store.read().double()
            for row in range(2):
                want = aged_reference(x[row, :, :b].transpose(0, 1), fmt, which, rope, age_out == "requantize", a // fmt.block_size)
                want = want.transpose(0, 1)
                assert (got[row] - want).abs().max().item() < 1e-5, (which, b)


def test_eval_cache_refuses_an_unknown_age_out():
    with pytest.raises(ValueError, match="age_out"):
        TensorStore(_fmt(SPECS[0][0]), "k", None, None, "later")


# --------------------------------------------------------------------------- the paged cache


def _attention(q, keys, values, ctx: int, scaling: float) -> torch.Tensor:
    """q [T, Hq, D] at positions ctx.. over keys / values [ctx + T, H, D], causal, float64 -> [T, Hq, D]."""
    T = q.shape[0]
    k = keys.repeat_interleave(G, 1).transpose(0, 1)
    v = values.repeat_interleave(G, 1).transpose(0, 1)
    s = (q.double().transpose(0, 1) @ k.transpose(1, 2)) * scaling  # [Hq, T, C]
    pos = torch.arange(ctx + T)
    s = s.masked_fill(pos[None, None, :] > (ctx + torch.arange(T))[None, :, None], float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.slow
@pytest.mark.parametrize("spec,D", SPECS)
def test_paged_cache_attends_each_block_in_the_storage_its_age_gives_it(spec, D):
    """Steps of random lengths (prefill chunks within a block, decode steps) over three sequences, through the torch ops;
    half-way, slot 0's sequence is freed and a new one starts there: it never reads the old sequence's ring."""
    fmt = _fmt(spec)
    bs = fmt.block_size
    g = torch.Generator().manual_seed(len(spec) + D)
    B, per_seq = 3, 12
    backend = TorchOps("cpu")
    cache = PagedKVCache(PagedKVLayout(fmt, H, D, bs, 1 + 2 * B * per_seq, B), L, [LayerParams() for _ in range(L)], attention=backend)
    for t in cache.tensors.values():  # unused pool and ring blocks hold NaN: reading one fails the comparison
        if t.is_floating_point():
            t.fill_(float("nan"))
    rope = _rope(D)
    if fmt.needs_rope:
        cache.ropes = [rope] * L
    tables = torch.tensor([[1 + b * per_seq + j for j in range(per_seq)] for b in range(B)])
    hist = [[torch.zeros(0, H, D) for _ in range(B)] for _ in range(2)]  # K / V rows of layer 1, fp16 values
    ctx = [0, 2 * bs + 1, 3 * bs - 1]
    for b in range(B):  # the starting contexts, written (and sealed) as one step's rows per piece
        for a, e in block_chunks(0, ctx[b], bs):
            batch = StepBatch.make([[0] * (e - a)], [a], tables[b : b + 1].tolist(), [b])
            rows = (torch.randn(2, L, 1, e - a, H, D, generator=g) * 2).half()
            cache.write_new_rows(batch, StepOutput(None, rows[0], rows[1]))
            for w in range(2):
                hist[w][b] = torch.cat([hist[w][b], rows[w][1, 0].float()])
    checked_recent = 0
    for step in range(16):
        if step == 8:  # slot 0 gets a new sequence, with blocks of its own
            ctx[0], hist[0][0], hist[1][0] = 0, torch.zeros(0, H, D), torch.zeros(0, H, D)
            tables[0] = torch.arange(per_seq) + 1 + B * per_seq
        new = [1 if step % 3 else int(torch.randint(1, bs - c % bs + 1, (1,), generator=g)) for c in ctx]
        T = max(new)
        batch = StepBatch(torch.zeros(B, T, dtype=torch.long), torch.tensor(ctx), torch.tensor(new), tables, torch.arange(B))
        valid = torch.arange(T)[None, :] < batch.new_lens[:, None]
        q = torch.randn(B, H * G, T, D, generator=g)
        rows = (torch.randn(2, L, B, T, H, D, generator=g) * 2).half()
        st = backend.begin(batch, cache, valid, crossing=False)
        got = backend.attend(st, 1, q, rows[0][1].transpose(1, 2), rows[1][1].transpose(1, 2), 0.35, None, None)  # [B, T, Hq, D]
        for b in range(B):
            n = new[b]
            keys = torch.cat([aged_reference(hist[0][b], fmt, "k", rope), rows[0][1, b, :n].double()])
            values = torch.cat([aged_reference(hist[1][b], fmt, "v", rope), rows[1][1, b, :n].double()])
            want = _attention(q[b, :, :n].transpose(0, 1), keys, values, ctx[b], 0.35)
            assert (got[b, :n].double() - want).abs().max().item() < 1e-3, (step, b)
            checked_recent += ctx[b] // bs > fmt.recent_blocks
        cache.write_new_rows(batch, StepOutput(None, rows[0], rows[1]))
        for b in range(B):
            for w in range(2):
                hist[w][b] = torch.cat([hist[w][b], rows[w][1, b, : new[b]].float()])
            ctx[b] += new[b]
    assert checked_recent  # some steps read blocks from both storages


def test_the_cache_counts_its_rings_of_recent_blocks():
    """``nbytes`` of the allocated tensors is the layout's count: pool blocks plus, per slot, the tails and the ring."""
    fmt = _fmt(SPECS[0][0])
    lay = PagedKVLayout(fmt, H, 20, 5, 11, 3)
    cache = PagedKVCache(lay, L, [LayerParams() for _ in range(L)], attention=TorchOps("cpu"))
    assert cache.nbytes() == L * lay.pool_bytes()
    ring = sum(t.numel() * t.element_size() for name, t in cache.tensors.items() if name.endswith("@recent"))
    assert ring == L * 3 * fmt.recent_bytes(H, 20) > 0


# --------------------------------------------------------------------------- the format


def test_spec_round_trip_and_preset_base():
    for spec, _ in SPECS:
        fmt = get_format(spec)
        again = get_format(fmt.spec())
        assert again.spec() == fmt.spec() and (again.recent, again.recent_blocks) == (fmt.recent, fmt.recent_blocks)
    aged = get_format("int2,recent=3:int4")
    assert aged.name == "int2,recent=3:int4" and (aged.k, aged.v, aged.block_size) == (PRESETS["int2"].k, PRESETS["int2"].v, 128)
    assert (aged.recent.k, aged.recent.v, aged.recent_blocks) == (PRESETS["int4"].k, PRESETS["int4"].v, 3)
    assert get_format(aged.model_dump_json() and aged.spec()).recent == aged.recent
    assert not PRESETS["int4"].token_aged and aged.token_aged


@pytest.mark.parametrize("spec,words", [
    ("int4,recent=0:int8", "R >= 1"),
    ("int4,recent=2:int4", "not wider"),
    ("int8,recent=2:int4", "not wider"),
    ("k=int4:token,v=int4:token,recent=2:int8", "add block=N"),
    ("int4,recent=2:int3", "needs a calibration"),
    ("int4,recent=2:k=int8:bchannel:asym:prerope/v=int8:token", "prerope"),
    ("int4,recent=2", "recent=R:FORMAT"),
    ("int4,recent=2:nope", "neither a preset"),
    ("k=int8:bchannel,v=int8:token,block=8,layers=int8:bchannel:sym/int8:token:sym,recent=1:fp16", "per-layer"),
])
def test_each_refusal_is_one_line(spec, words):
    with pytest.raises(TrtkvError) as e:
        get_format(spec)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_bits_at_a_context_against_a_naive_count():
    fmt = get_format(SPECS[0][0])
    D, bs, R = 20, 5, 2
    k, v = fmt.k.block_bits(bs, D), fmt.v.block_bits(bs, D)  # one KV head's bits of one block
    rk, rv = fmt.recent.k.block_bits(bs, D), fmt.recent.v.block_bits(bs, D)
    for C in (7, 40, 1003):
        sealed = C // bs
        total = sealed * (k + v) + R * (rk + rv) + 2 * fmt.tail_rows * D * 16  # pool + ring + tails, one head, K and V
        assert fmt.bits_per_element(D, C) == pytest.approx(total / (2 * C * D))
        assert fmt.sealed_bits_per_element(D, C) == pytest.approx((C * (k + v) / bs + R * (rk + rv)) / (2 * C * D))
    assert fmt.sealed_bits_per_element(D) == fmt.pool_bits_per_element(D)
    assert fmt.tail_bytes_per_slot(L, H, D) == L * (2 * H * fmt.tail_rows * D * 2 + H * R * (rk + rv) // 8)


# --------------------------------------------------------------------------- who reads it


def test_every_path_but_the_torch_ops_refuses_in_one_line():
    from trtkv.plugins.contract.capabilities import CAPABILITIES

    fmt = get_format(SPECS[0][0])
    for path in CAPABILITIES.values():
        reasons = path.reasons(fmt, None, 64, 64)
        if path.name == "torch":
            assert not reasons
            continue
        assert len(reasons) == 1 and "recent=" in reasons[0] and path.title in reasons[0] and "\n" not in reasons[0] and reasons[0].hint
    assert resolve("auto", "cpu", kv_format=fmt).name == "torch"
    with pytest.raises(TrtkvError, match="recent="):
        resolve("cpu", "cpu", kv_format=fmt)


def test_prefix_caching_is_off_for_a_token_age_cache():
    from trtkv.runtime.llm_engine import prefix_caching_off

    aged = PagedKVCache(PagedKVLayout(get_format(SPECS[0][0]), H, 20, 5, 4, 2), L, attention=TorchOps("cpu"))
    plain = PagedKVCache(PagedKVLayout(get_format("int8").with_block_size(5), H, 20, 5, 4, 2), L, attention=TorchOps("cpu"))
    assert "recent" in prefix_caching_off(aged) and prefix_caching_off(plain) is None


def test_a_recent_storage_that_does_not_fit_the_head_dim_is_refused_by_the_layout():
    with pytest.raises(TrtkvError, match="group size 32"):
        PagedKVLayout(get_format("k=int2:token:asym,v=int2:token:asym,block=8,recent=1:int4"), H, 20, 8, 4, 1)


def test_lists_of_formats_keep_a_token_age_spec_whole():
    from trtkv.formats import split_specs

    assert split_specs("int4, int2,recent=3:int4,k=int8:token,v=int8:token,block=8,int2") == [
        "int4", "int2,recent=3:int4", "k=int8:token,v=int8:token,block=8", "int2"]


def test_budget_needs_two_candidates_without_recent_in_one_line():
    from trtkv.calibration.budget import check_candidates

    with pytest.raises(TrtkvError) as e:
        check_candidates([get_format("int4"), get_format("int4,recent=2:int8")])
    assert "recent=" in str(e.value) and "\n" not in str(e.value)
    got = check_candidates([get_format("int2,recent=3:int4"), get_format("k=int2:token:sym,v=int2:token:sym,block=64"),
                            get_format("k=int4:token:sym,v=int4:token:sym,block=64")])
    assert [c.token_aged for c in got] == [False, False, True]  # the per-layer candidates widest first, then token age


def _budget_case(aged_kl: float, budget, context: int = 1024):
    """A per-layer search over int4 / int2 (1 layer, KL 0.001 + 0.004 per side narrowed to int2) and the token-age
    ``int2,recent=3:int4`` measured at ``aged_kl``; returns the choice and the token-age candidate."""
    from trtkv.calibration.budget import Score, choose_layer_bits

    base = "k=int2:token:asym,v=int2:token:asym,block=64"
    cands = [get_format("k=int4:token:asym,v=int4:token:asym,block=64"), get_format(base)]
    aged = get_format(base + ",recent=3:k=int4:token:asym/v=int4:token:asym")
    params = {aged.name: [LayerParams(k=TensorParams(scale=torch.tensor([0.5]))) for _ in range(1)]}

    def score(f, p):
        if f.token_aged:
            return Score(aged_kl, 100 * aged_kl)
        narrowed = sum(getattr(f.layer(0), s) == getattr(cands[1], s) for s in "kv")
        return Score(0.001 + 0.004 * narrowed, 100 * (0.001 + 0.004 * narrowed))

    return choose_layer_bits(score, [*cands, aged], params, budget, num_layers=1, head_dim=64, context_len=context), aged, cands


def _bits_at(f, cands, context: int) -> float:
    """Naive count: the int2 pool, plus three blocks of 64 int4 rows per sequence over ``context`` tokens."""
    return cands[1].pool_bits_per_element(64) + 3 * 64 * cands[0].pool_bits_per_element(64) / context


@pytest.mark.parametrize("aged_kl, limit, context, wins", [
    # the token-age candidate: 2.5 pool bits + a ring of 3 x 64 rows at 4.5 bits: 3.344 bits over 1024 tokens, 2.605 over 8192
    (0.002, 3.5, 1024, True),  # within the bits, less KL than the mix (int2 on one side: 3.5 bits, KL 0.005)
    (0.006, 3.5, 1024, False),  # within the bits, more KL than the mix
    (0.0, 3.0, 1024, False),  # no KL at all, but over the bits at this context (the mix: int2 on both sides, 2.5 bits)
    (0.0, 3.0, 8192, True),  # the same at 8192 tokens: the ring is spread over more tokens
])
def test_a_bits_budget_takes_the_token_age_candidate_when_it_fits_and_costs_less(aged_kl, limit, context, wins):
    from trtkv.calibration.budget import Budget, render_choice

    choice, aged, cands = _budget_case(aged_kl, Budget("bits", limit), context)
    bits = _bits_at(aged, cands, context)
    assert choice.token_age[0].bits == pytest.approx(bits, rel=1e-12)
    mix_bits = choice.mix[0] if choice.mix else choice.bits(64)
    assert mix_bits <= limit + 1e-9
    assert wins == (bits <= limit and aged_kl < (choice.mix[1].kl if choice.mix else choice.measured.kl))
    assert (choice.chosen == aged.name) == wins and choice.fmt.token_aged == wins
    if wins:
        assert choice.fmt.name == "budget" and choice.fmt.spec().endswith(aged.spec().split(",", 2)[-1]) and choice.fmt.recent == aged.recent
        assert choice.measured.kl == aged_kl and choice.bits(64) == pytest.approx(bits) and torch.equal(choice.params[0].k.scale, torch.tensor([0.5]))
        assert f"chosen: token age, `{aged.name}`" in render_choice(choice, 64) and choice.recipe_fields()["chosen"] == aged.name
    else:
        assert not choice.fmt.token_aged and choice.recipe_fields()["chosen"] == "per-layer"
    assert f"token-age candidate `{aged.name}`: {bits:.3f} bits" in render_choice(choice, 64)


@pytest.mark.parametrize("aged_kl, wins", [(0.0039, True), (0.0051, False)])
def test_a_kl_budget_takes_the_token_age_candidate_when_it_is_within_the_target_with_fewer_bits(aged_kl, wins):
    from trtkv.calibration.budget import Budget

    choice, aged, cands = _budget_case(aged_kl, Budget("kl", 0.005, margin=0), 8192)
    # the mix: int2 on one side (KL 0.005 <= 0.005), 3.5 pool bits; the token-age candidate: 2.605 bits over 8192 tokens
    assert choice.chosen == (aged.name if wins else "per-layer")
    assert choice.measured.kl == pytest.approx(aged_kl if wins else 0.005)


def test_token_age_candidates_need_the_context_their_ring_is_counted_over():
    from trtkv.calibration.budget import Budget, Score, choose_layer_bits

    cands = [get_format("int4"), get_format("k=int4:bchannel:asym,v=int4:token:asym,block=64,sink=4"), get_format("int4,recent=2:int8")]
    with pytest.raises(ValueError, match="context_len"):
        choose_layer_bits(lambda f, p: Score(0.0, 0.0), cands, {}, Budget("kl", 1.0), num_layers=1, head_dim=64)


@pytest.mark.slow
def test_the_torch_engine_computes_what_the_eval_cache_computes(tmp_path):
    """A tiny model's torch engine over a token-age paged cache (prefill in block chunks, then greedy decode steps that
    age blocks out) against the model over the eval cache on the same tokens: the same logits at every position."""
    from conftest import build_tiny_model

    from trtkv.evaluate import model_logits
    from trtkv.runtime.torch_engine import TorchEngine
    from trtkv.runtime.verify import StaticBatch

    model = build_tiny_model(tmp_path / "tiny", "llama", head_dim=32, hidden_size=96)
    fmt = get_format("k=int4:bchannel:asym:hadamard,v=int2:token:asym:hadamard,block=4,sink=1,recent=2:k=int8:bchannel:asym/v=int8:token:sym")
    cache = PagedKVCache(PagedKVLayout(fmt, model.config.num_key_value_heads, 32, 4, 40, 1), model.config.num_hidden_layers)
    engine = TorchEngine(model, kv_format=fmt)  # auto, told the format: the torch ops
    prompt = torch.randint(0, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    sb = StaticBatch(cache, 1)
    got = [sb.prefill(engine, [prompt])[0]]
    tokens = list(prompt)
    for _ in range(12):
        tokens.append(int(got[-1].argmax()))
        got.append(sb.step(engine, {0: [tokens[-1]]})[0])
    assert engine.attention_backend.name == "torch"
    want = model_logits(model, torch.tensor([tokens]), fmt)[0, len(prompt) - 1 :]
    assert (torch.stack(got[:-1]) - want[: len(got) - 1]).abs().max().item() < 1e-3


def test_a_swapped_sequence_reads_the_same_ring_in_another_slot():
    """Preemption by swapping carries the slot's ring entries: swapped out of slot 0 and into slot 1 with other blocks,
    the sequence's next step attends exactly as before (the old slot and blocks filled with NaN)."""
    from trtkv.runtime.sequence import SamplingParams, Sequence
    from trtkv.runtime.swap import Swapper

    fmt, D = _fmt(SPECS[0][0]), SPECS[0][1]
    bs, ctx = fmt.block_size, 4 * fmt.block_size + 2
    g = torch.Generator().manual_seed(11)
    backend = TorchOps("cpu")
    cache = PagedKVCache(PagedKVLayout(fmt, H, D, bs, 12, 2), L, [LayerParams() for _ in range(L)], attention=backend)
    seq = Sequence([1] * ctx, SamplingParams())
    seq.block_table, seq.slot = list(range(1, 6)), 0
    for a, e in block_chunks(0, ctx, bs):
        rows = (torch.randn(2, L, 1, e - a, H, D, generator=g) * 2).half()
        cache.write_new_rows(StepBatch.make([[0] * (e - a)], [a], [seq.block_table], [0]), StepOutput(None, rows[0], rows[1]))
    seq.num_cached = ctx
    q = torch.randn(1, H * G, 1, D, generator=g)
    k16, v16 = ((torch.randn(1, H, 1, D, generator=g) * 2).half() for _ in range(2))

    def attend() -> torch.Tensor:
        batch = StepBatch(torch.zeros(1, 1, dtype=torch.long), torch.tensor([ctx]), torch.tensor([1]), torch.tensor([seq.block_table]),
                          torch.tensor([seq.slot]))
        return backend.attend(backend.begin(batch, cache, torch.ones(1, 1, dtype=torch.bool), crossing=False), 1, q, k16, v16, 0.35, None, None)

    before = attend()
    swapper = Swapper(cache)
    swapper.swap_out(seq)
    for name, t in cache.tensors.items():  # what the slot and the blocks held is gone
        if t.is_floating_point():
            own = cache.slot_index(name, 0)
            t[:, own if own is not None else torch.tensor(seq.block_table)] = float("nan")
    seq.block_table, seq.slot = list(range(6, 11)), 1
    swapper.swap_in(seq)
    assert torch.equal(attend(), before)
