"""Triton kernels of trtkv.plugins, run on CPU under the Triton interpreter, against independent references.

Interpreter mode does not depend on import order: ``trtkv.plugins.kernels.load_kernels(True)`` loads a
private copy of the kernel module with ``triton.jit`` resolved to the interpreter; the launchers are called
with ``interpret=True``. The custom-op tests set ``TRITON_INTERPRET=1`` only for their own duration
(monkeypatch), which is what the ops' CPU dispatch reads at call time.

The cache under test follows docs/kv-cache-format.md: sealed blocks in the pool (written by
``cache_layout.seal_blocks``), the open block of each sequence in ``tail[slot]`` (fp16), this step's rows
beside them. Unused pool blocks, block-table entries past the sealed blocks and tail rows past the context
hold garbage (NaN / inf scales, random codes, NaN rows) in every attention test.

Error thresholds
* seal: codes and fp16 scales / zero-points must equal ``cache_layout.seal_blocks`` (``quantize_block``)
  bit for bit. The kernel computes the same fp32 operations in the same order (IEEE ``div_rn``, fp16
  rounding of scales before the codes, half-to-even ``_rint``, exact max / min reductions). The one
  exception is the Hadamard rotation, a sum of head_dim products whose order differs between torch's
  matmul and ``tl.dot``: values may differ by an ulp, so a code may move by one where the reference value
  sits within ulps of a rounding tie, and a scale by one fp16 ulp when the group max straddles an fp16
  rounding boundary. Those cases are checked with that tolerance (<= 1 code, < 0.5% of codes, scales
  within 1 fp16 ulp), and exactly on integer-valued inputs, where every partial sum is exact in any order.
* attention: the reference is float64 softmax attention over ``gather_paged(..., slot=)`` (the same stored
  values, dequantized in float32) followed by the new rows rounded to fp16. The kernel's differences are
  fp32 arithmetic: the dequantize multiply-add, the query-side transform fold, the open rows moved into the
  stored channel space (one fp32 rotation), fp32 dot accumulation and the online-softmax rescaling, a few
  fp32 ulps each (~1e-7 relative). The threshold is 2e-5 relative to max|out|: 100x margin, still 100x
  below the error of any indexing, masking or scale bug (>= 1e-3).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from trtkv.cache_layout import PagedKVLayout, seal_blocks
from trtkv.errors import TrtkvError
from trtkv.formats import CALIBRATION_FREE, KVFormat, TensorFormat, get_format, parse_tensor_spec
from trtkv.plugins import contract as C
from trtkv.plugins import kernels as K
from trtkv.plugins import ops
from trtkv.plugins import reference as R
from trtkv.plugins.cases import PagedCase, case_params, case_rope
from trtkv.quant import hadamard_matrix, unpack_int4

ATTN_RTOL = 2e-5
INT4_G32 = "k=int4:g32:sym,v=int4:g32:sym"  # symmetric groups, no transform (llama.cpp q4_0-like)
# keys before RoPE, smoothed by the queries, rotated, 128 outliers per block; values through a codebook
INT3_NUQ = "k=int3:bchannel:asym:prerope:qsmooth:hadamard:out128,v=int3:token:sym:hadamard:nuq,block=128,sink=4"


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _ctxs(bs: int) -> list[int]:
    """Tails of 0, 1 and bs-1 rows; contexts that are exact multiples of the block size; an empty cache."""
    return [0, 1, bs - 1, bs, bs + 1, 3 * bs, 2 * bs + bs - 1, 2 * bs + 5]


def _case(fmt: KVFormat | str, head_dim: int, ratio: int, ctxs, new=None, kvh: int = 2, seed: int = 0,
         garbage: bool = True) -> PagedCase:
    """The shared paged case (``trtkv.plugins.cases``), sealed by the reference, ``ratio`` query heads per KV head."""
    return PagedCase(fmt, ctxs, new, heads_q=kvh * ratio, kv_heads=kvh, head_dim=head_dim, seed=seed, garbage=garbage)


def _as_rows(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks [n, kv_heads, block_size, head_dim] as rows [n * block_size, kv_heads, head_dim]."""
    return blocks.float().transpose(1, 2).reshape(-1, blocks.shape[1], blocks.shape[3])


def _decode(case: PagedCase, q, **kw):
    return ops.launch_paged_decode(q, *case.attn_args(), interpret=True, **kw)


def _prefill(case: PagedCase, q, **kw):
    return ops.launch_paged_prefill(q, case.cu, *case.attn_args(prefill=True), interpret=True, **kw)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    denom = ref.double().abs().max().clamp_min(1e-30)
    return float((out.double() - ref.double()).abs().max() / denom)


def _naive_attention(q, keys, values, scale):
    """Loop-by-loop float64 softmax attention of one query row over lists of key / value rows."""
    s = [float(q @ k) * scale for k in keys]
    m = max(s)
    w = [math.exp(x - m) for x in s]
    tot = sum(w)
    return sum(wi * v for wi, v in zip(w, values)) / tot


# ------------------------------------------------------------------------------------------------
# module plumbing
# ------------------------------------------------------------------------------------------------


def test_interpreter_copy_is_independent_of_import_order():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    assert isinstance(K.load_kernels(True).seal_kernel, InterpretedFunction)
    assert isinstance(K.load_kernels(False).paged_decode_partition_kernel, JITFunction)
    assert K.load_kernels(True) is K.load_kernels(True)


def test_reference_attention_equals_a_naive_loop():
    """The float64 reference itself, against per-position loops over the cache contract (sealed blocks
    dequantized by hand from codes and scales, tail rows, new rows)."""
    case = _case("k=int8:bchannel:sym,v=int8:token:asym,block=16", 64, 2, [21, 3], new=[2, 1], seed=1)
    q = torch.randn(3, case.heads, 64, generator=case.gen)
    ref = case.reference(q, prefill=True)
    for b, ctx in enumerate(case.ctxs):
        slot, bs = int(case.slot_ids[b]), case.bs
        keys, vals = [], []
        for p in range(ctx + case.new[b]):
            if p < ctx // bs * bs:
                blk = int(case.block_table[b, p // bs])
                kc = case.k_pool.data[blk, :, p % bs].double()
                k = kc * case.k_pool.scale[blk].double()  # one scale per channel and block
                vc = case.v_pool.data[blk, :, p % bs].double()
                v = vc * case.v_pool.scale[blk, :, p % bs].double() + case.v_pool.zero[blk, :, p % bs].double()
            elif p < ctx:
                k, v = case.k_pool.tail[slot, :, p % bs].double(), case.v_pool.tail[slot, :, p % bs].double()
            else:
                r = int(case.cu[b]) + p - ctx
                k, v = case.k_new[r].double(), case.v_new[r].double()
            keys.append(k)
            vals.append(v)
        for t in range(case.new[b]):
            row = int(case.cu[b]) + t
            for h in range(case.heads):
                kvh = h // 2
                want = _naive_attention(q[row, h].double(), [k[kvh] for k in keys[: ctx + t + 1]],
                                        [v[kvh] for v in vals[: ctx + t + 1]], 1 / 8)
                assert torch.allclose(ref[row, h].double(), want, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# 1. seal
# ------------------------------------------------------------------------------------------------

SEAL_CASES = [  # (spec, head_dim, block_size, input dtype, kv_heads)
    ("int4:bchannel:asym", 64, 64, torch.float16, 3),
    ("int4:bchannel:sym", 128, 16, torch.float32, 2),
    ("int8:bchannel:sym:smooth", 64, 32, torch.float16, 1),
    ("int8:bchannel:asym", 128, 16, torch.bfloat16, 2),
    ("fp8_e4m3:bchannel:sym", 64, 16, torch.float16, 3),
    ("int8:token:sym", 64, 16, torch.float16, 3),
    ("int8:token:asym", 128, 16, torch.bfloat16, 2),
    ("int8:tensor:sym", 64, 16, torch.float32, 2),
    ("int8:channel:sym:smooth", 128, 16, torch.float16, 1),
    ("int4:g64:asym", 128, 16, torch.float16, 2),
    ("int4:g32:sym", 64, 32, torch.bfloat16, 2),
    ("int4:token:asym:smooth", 64, 16, torch.float32, 3),
    ("int4:head:sym", 128, 16, torch.float16, 2),
    ("fp8_e4m3:tensor:sym", 64, 16, torch.float16, 2),
    ("fp8_e4m3:g32:sym", 64, 16, torch.float32, 1),
    ("fp16", 128, 16, torch.bfloat16, 2),
    # bit-planed int3 / one-plane int2: the presets' K, V without the rotation (rotated: below), symmetric per token
    ("int3:bchannel:asym", 64, 64, torch.float16, 2),
    ("int3:g32:sym", 128, 16, torch.float16, 2),
    ("int3:token:sym", 32, 16, torch.float32, 3),
    ("int2:bchannel:asym", 64, 64, torch.float16, 2),
    ("int2:token:asym", 128, 16, torch.bfloat16, 2),
    ("int2:token:sym", 32, 16, torch.float32, 3),
]


@pytest.mark.parametrize("spec,d,bs,dtype,kvh", SEAL_CASES,
                         ids=[f"{s}-d{d}-b{b}-{str(t)[6:]}-h{h}" for s, d, b, t, h in SEAL_CASES])
def test_seal_matches_seal_blocks_bit_for_bit(spec, d, bs, dtype, kvh):
    gen = torch.Generator().manual_seed(hash(spec) % 1000 + d)
    n = 3
    rows = (torch.randn(n, kvh, bs, d, generator=gen) * (torch.rand(kvh, 1, d, generator=gen) * 3 + 0.1)).to(dtype)
    rows[0, 0, 3] = 0.0  # an all-zero token: scale 0, inverse guarded
    rows[1, 0, :, : d // 2] = 7.0  # constant channels over the block: asymmetric range 0
    rows[1, -1, 4, : d // 2] = -3.0
    tf = parse_tensor_spec(spec)
    p = case_params(tf, "v", _as_rows(rows), gen)
    if tf.is_dynamic:
        p.clip = torch.tensor([1.0, 0.83, 0.95])[:kvh]  # per-head range multiplier
    ref = R.seal_ref(rows, tf, p.scale, p.smooth, p.clip)
    out = ops.launch_seal(rows, tf, p.scale, p.smooth, p.clip, interpret=True)
    assert torch.equal(ref[0], out[0]), f"{(ref[0] != out[0]).sum()} codes differ"
    for a, b in zip(ref[1:], out[1:]):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)
    # the custom op stores the same bytes at permuted pool blocks, and no others
    layout = PagedKVLayout(KVFormat(name="t", k=tf, v=TensorFormat(dtype="fp16"), block_size=bs), kvh, d, bs, 6)
    pool = layout.allocate("k")
    blocks = torch.tensor([4, 0, 2])
    ops.launch_seal_into(rows, blocks, pool.data, pool.scale, pool.zero, tf, p.scale, p.smooth, p.clip, interpret=True)
    want = layout.allocate("k")
    seal_blocks(layout, "k", want, rows, blocks, p)
    for a, b in ((want.data, pool.data), (want.scale, pool.scale), (want.zero, pool.zero)):
        assert a is None or torch.equal(a, b)


def test_rounding_ties_go_to_even_and_clamp():
    """Static scale 1: codes are round-half-even(clamp(x)); ties, negative ties and out-of-range values."""
    vals = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, 300.0, -128.5, -1e30, 1e30, 3.49999, -0.0])
    rows = torch.zeros(1, 1, 16, 64)
    rows[0, 0, 0, : vals.numel()] = vals
    ref = R.seal_ref(rows, "int8:tensor:sym", torch.tensor(1.0))
    out = ops.launch_seal(rows, "int8:tensor:sym", torch.tensor(1.0), interpret=True)
    assert torch.equal(ref[0], out[0])
    assert out[0][0, 0, 0, : vals.numel()].tolist() == [0, 2, 2, 0, -2, -2, 126, 127, 127, -128, -128, 127, 3, 0]


def test_fp8_encoding_matches_torch_on_every_code_and_midpoint():
    """All finite e4m3 values, the midpoints between neighbours (round-to-even ties), subnormals, +-0, +-448."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)]
    pos = torch.unique(vals.abs())
    mids = (pos[1:] + pos[:-1]) / 2
    x = torch.cat([vals, mids, -mids, torch.tensor([1e-9, -1e-9, 447.9, 449.0, -1000.0])])
    d, bs = 128, 16
    n = math.ceil(x.numel() / (d * bs))
    rows = torch.zeros(n * bs * d)
    rows[: x.numel()] = x
    rows = rows.view(n, 1, bs, d)
    ref = R.seal_ref(rows, "fp8_e4m3:tensor:sym", torch.tensor(1.0))
    out = ops.launch_seal(rows, "fp8_e4m3:tensor:sym", torch.tensor(1.0), interpret=True)
    assert torch.equal(ref[0], out[0])


@pytest.mark.parametrize("spec", ["int8:token:sym", "int4:bchannel:asym", "int4:bchannel:sym", "int8:g32:asym"])
def test_dynamic_scale_overflowing_fp16_is_clamped_not_infinite(spec):
    """A group whose absmax / qmax (or range / qmax) exceeds 65504 stores the scale 65504, as trtkv.quant does
    (``_to_fp16`` clamps), never inf: fp32 inputs of 3e7, and fp16 inputs blown up by smoothing divisors."""
    tf = parse_tensor_spec(spec)
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(2, 2, 16, 64, generator=gen)
    rows[0, 1, 2, 5] = 3e7
    rows[1, 0, :, 9] = -3e7
    ref = R.seal_ref(rows, tf)
    out = ops.launch_seal(rows, tf, interpret=True)
    assert torch.isfinite(ref[1].float()).all() and (ref[1] == 65504).any()
    assert torch.equal(ref[0], out[0]) and torch.equal(ref[1], out[1])
    if ref[2] is not None:
        assert torch.equal(ref[2], out[2])
    sm_tf = tf.model_copy(update={"smooth": True})
    smooth = torch.full((2, 64), 1.0)
    smooth[:, 5] = 1e-3  # 60000 / 1e-3 = 6e7
    r16 = (torch.randn(1, 2, 16, 64, generator=gen) * 2).half()
    r16[0, :, 3, 5] = 60000.0
    ref = R.seal_ref(r16, sm_tf, smooth=smooth)
    out = ops.launch_seal(r16, sm_tf, smooth=smooth, interpret=True)
    assert (ref[1] == 65504).any() and torch.equal(ref[1], out[1]) and torch.equal(ref[0], out[0])


@pytest.mark.parametrize("spec,d", [("int4:g64:asym:smooth:hadamard", 128), ("int8:token:sym:hadamard", 64),
                                    ("fp8_e4m3:tensor:sym:hadamard", 128), ("int4:bchannel:asym:hadamard", 64),
                                    ("int3:g32:sym:hadamard", 64), ("int2:token:asym:hadamard", 64)])
def test_seal_hadamard_within_summation_order_tolerance(spec, d):
    gen = torch.Generator().manual_seed(d)
    rows = torch.randn(4, 2, 16, d, generator=gen).half()
    tf = parse_tensor_spec(spec)
    p = case_params(tf, "v", _as_rows(rows), gen)
    ref = R.seal_ref(rows, tf, p.scale, p.smooth)
    out = ops.launch_seal(rows, tf, p.scale, p.smooth, interpret=True)
    if tf.traits.packed:  # int4 / int3 / int2: the stored codes
        a, b = tf.traits.stored_values(ref[0]).int(), tf.traits.stored_values(out[0]).int()
    else:  # int8 codes; fp8: adjacent values of one sign are adjacent bit patterns
        a, b = ref[0].int(), out[0].int()
    diff = (a - b).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 5e-3
    for x, y in zip(ref[1:], out[1:]):
        if x is not None:
            rel = ((x.float() - y.float()).abs() / x.float().abs().clamp_min(1e-6)).max()
            assert rel <= 2**-10


def test_seal_hadamard_exact_on_integer_inputs():
    """Integer inputs and H = +-1/8 (head_dim 64): every partial sum is exact in any order -> bit exact."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(-60, 61, (3, 2, 16, 64), generator=gen).float()
    for spec in ("int4:g32:asym:hadamard", "int4:bchannel:asym:hadamard", "int3:g32:sym:hadamard", "int2:token:asym:hadamard"):
        ref = R.seal_ref(rows, spec)
        out = ops.launch_seal(rows, spec, interpret=True)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(ref, out))


# ------------------------------------------------------------------------------------------------
# 2. decode (split-K)
# ------------------------------------------------------------------------------------------------

DECODE_CASES = [  # (format, head_dim, gqa ratio, partition size, kv heads)
    ("int4", 64, 3, 64, 2),  # preset: K per block-channel, V per token + Hadamard, block 64
    ("int8", 128, 8, 512, 1),
    ("k=int8:bchannel:sym:smooth,v=int4:g32:asym:smooth:hadamard,block=16", 64, 1, 32, 3),
    ("k=int4:bchannel:asym,v=int4:g32:sym:hadamard,block=32,sink=5", 64, 2, 16, 2),  # sink spans a key tile edge
    ("k=fp16,v=int8:token:sym,block=16,sink=1", 64, 1, 16, 1),
    ("k=int4:bchannel:sym:hadamard,v=int8:token:asym,block=16", 128, 3, 64, 2),
    ("fp8", 64, 8, 32, 1),
    ("int8-static", 128, 1, 64, 2),
    (INT4_G32, 64, 3, 512, 3),
    ("k=fp8:channel:sym:hadamard,v=int8:head:sym", 64, 1, 16, 2),
    ("fp16", 64, 3, 64, 1),
    # the calibration-free 3- / 2-bit layouts: K per block-channel, V g32 sym (int3) / per token asym (int2), Hadamard V
    (CALIBRATION_FREE["int3"], 64, 2, 64, 2),
    (CALIBRATION_FREE["int2"], 64, 2, 64, 1),
    ("k=int3:token:sym,v=int2:token:sym,block=16", 32, 1, 16, 2),  # symmetric per token: the code offsets
]


@pytest.mark.slow
@pytest.mark.parametrize("fmt,d,ratio,part,kvh", DECODE_CASES, ids=[f"{f[:40]}-d{d}-gqa{r}-p{p}-h{h}" for f, d, r, p, h in DECODE_CASES])
def test_decode_matches_float64_reference(fmt, d, ratio, part, kvh):
    f = get_format(fmt)
    case = _case(f, d, ratio, _ctxs(f.block_size or 16), kvh=kvh, seed=d + ratio)
    q = torch.randn(len(case.ctxs), case.heads, d, generator=case.gen).half()
    ref = case.reference(q.float())
    out32 = _decode(case, q.float(), partition_size=part)  # fp32: the kernel's own error, not fp16 output rounding
    assert _rel_err(out32, ref) < ATTN_RTOL
    out = _decode(case, q, partition_size=part)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert _rel_err(out, ref.half()) < 2e-3  # fp16 output rounding only
    assert torch.isfinite(out32).all()


@pytest.mark.slow
def test_decode_ignores_garbage_bit_for_bit():
    """NaN / inf / random bytes in unused pool blocks, tail rows past the context and block-table entries
    past the sealed blocks leave the output unchanged to the bit."""
    case = _case("int4", 64, 3, _ctxs(64), seed=11, garbage=False)
    q = torch.randn(len(case.ctxs), case.heads, 64, generator=case.gen)
    clean = _decode(case, q, partition_size=64)
    case.garbage()
    assert torch.isnan(case.k_pool.tail).any() and torch.isinf(case.k_pool.scale).any()
    dirty = _decode(case, q, partition_size=64)
    assert torch.equal(clean, dirty) and torch.isfinite(dirty).all()


@pytest.mark.slow
def test_decode_partition_size_does_not_change_the_result_beyond_rounding():
    case = _case("int8", 128, 8, [257, 600, 63], seed=2)
    q = torch.randn(3, case.heads, 128, generator=case.gen)
    ref = case.reference(q)
    for part in (16, 128, 512):
        assert _rel_err(_decode(case, q, partition_size=part), ref) < ATTN_RTOL


def test_decode_sm_scale_and_bf16_query():
    case = _case(INT4_G32, 64, 1, [40, 9], seed=4)
    q = torch.randn(2, case.heads, 64, generator=case.gen)
    ref = case.reference(q, sm_scale=0.3)
    assert _rel_err(_decode(case, q, sm_scale=0.3), ref) < ATTN_RTOL
    out = _decode(case, q.bfloat16(), sm_scale=0.3)
    assert out.dtype == torch.bfloat16
    assert _rel_err(out, case.reference(q.bfloat16().float(), sm_scale=0.3)) < 1e-2  # bf16 output rounding


def test_decode_gpu_tile_config_and_tf32_precision_flag():
    """The GPU constexprs (BLOCK_N=32 at head_dim 128, BLOCK_H=16) through the interpreter; the interpreter
    evaluates fp32 dots exactly whatever input_precision says, so this checks the tile logic, not tf32."""
    case = _case("int4", 128, 4, [70, 5, 128], seed=8)
    q = torch.randn(3, case.heads, 128, generator=case.gen)
    cfg = K.decode_config(case.fmt.k, case.fmt.v, 128, 4, 64, "tf32x3", interpret=False)
    assert cfg["partition"]["constexprs"]["BLOCK_N"] == 32
    kmod = K.load_kernels(True)
    f32 = torch.zeros(1)
    k, v = case.k_pool, case.v_pool
    gp, gr = C.decode_grids(3, case.kvh, case.block_table.shape[1], 64, 64)
    pm, pl = torch.empty(3, case.heads, gp[2]), torch.empty(3, case.heads, gp[2])
    pa = torch.empty(3, case.heads, gp[2], 128)
    out = torch.empty_like(q)
    had = hadamard_matrix(128)
    kmod.paged_decode_partition_kernel[gp](q, k.data, k.scale, k.zero, v.data, v.scale, v.zero, k.tail, v.tail,
                                           case.k_new, case.v_new, f32, f32, f32, f32, had, case.block_table,
                                           case.context_lens, case.slot_ids, *[f32] * 10,  # no codebook, outliers, RoPE, widths
                                           pm, pl, pa, K.LOG2E / math.sqrt(128),
                                           case.heads, case.kvh, 64, case.layout.sink_tokens,
                                           case.block_table.shape[1], gp[2], 0, 0.0,  # no window, no cap
                                           **cfg["partition"]["constexprs"])
    kmod.paged_decode_reduce_kernel[gr](pm, pl, pa, case.context_lens, f32, f32, had, out, case.heads, case.kvh,
                                        gp[2], **cfg["reduce"]["constexprs"])
    assert _rel_err(out, case.reference(q)) < ATTN_RTOL


# ------------------------------------------------------------------------------------------------
# 3. prefill / chunked prefill
# ------------------------------------------------------------------------------------------------

PREFILL_CASES = [  # (format, head_dim, gqa ratio, kv heads)
    ("int8", 128, 3, 1),
    ("int4", 64, 8, 1),
    ("fp8", 64, 1, 3),
    ("k=int4:bchannel:asym:smooth,v=int8:token:asym:smooth:hadamard,block=16", 128, 1, 2),
    ("k=int8:bchannel:sym,v=int4:g32:sym:hadamard,block=16,sink=3", 64, 2, 2),
    (CALIBRATION_FREE["int3"], 64, 2, 1),
    ("k=int2:bchannel:asym,v=int3:token:sym,block=16,sink=2", 128, 1, 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("fmt,d,ratio,kvh", PREFILL_CASES, ids=[f"{f}-d{d}-gqa{r}-h{h}" for f, d, r, h in PREFILL_CASES])
def test_prefill_matches_float64_reference(fmt, d, ratio, kvh):
    f = get_format(fmt)
    bs = f.block_size or 16
    ctxs = [0, 0, 1, bs - 1, bs, 2 * bs + 5, 3 * bs]
    new = [bs, 3, bs - 1, 1, bs, bs - 5, 2]  # a whole first block, a short prompt, fill to the boundary, chunks
    case = _case(f, d, ratio, ctxs, new=new, kvh=kvh, seed=d * ratio)
    q = torch.randn(int(case.cu[-1]), case.heads, d, generator=case.gen)
    out = _prefill(case, q)
    ref = case.reference(q, prefill=True)
    assert _rel_err(out, ref) < ATTN_RTOL
    # decode is prefill with one new token: the first new token of each sequence through the decode kernel
    first = _case(f, d, ratio, ctxs, new=[1] * len(ctxs), kvh=kvh, seed=d * ratio, garbage=False)
    assert _rel_err(_decode(first, q[case.cu[:-1].long()], partition_size=64), first.reference(q[case.cu[:-1].long()])) < ATTN_RTOL


def test_prefill_garbage_bit_for_bit_and_padding_rows():
    ctxs, new = [30, 0, 64, 17], [2, 16, 7, 0]
    case = _case(INT4_G32, 64, 3, ctxs, new=new, seed=9, garbage=False)
    q = torch.randn(int(case.cu[-1]), case.heads, 64, generator=case.gen)
    clean = _prefill(case, q, max_seqlen_q=16)
    case.garbage()
    dirty = _prefill(case, q, max_seqlen_q=int(case.cu[-1]))  # an upper bound is fine: extra programs exit
    assert torch.equal(clean, dirty)
    assert _rel_err(dirty, case.reference(q, prefill=True)) < ATTN_RTOL
    # padded [B, T] form: rows past new_lens come last and no valid query sees them
    T = 16
    padded_cu = torch.arange(len(ctxs) + 1, dtype=torch.int32) * T
    idx = torch.cat([torch.arange(int(case.cu[b]), int(case.cu[b + 1])) for b in range(len(ctxs))])
    dest = torch.cat([torch.arange(n) + b * T for b, n in enumerate(new)])
    qp = torch.randn(len(ctxs) * T, case.heads, 64, generator=case.gen)
    kp = torch.randn(len(ctxs) * T, case.kvh, 64, generator=case.gen).half()
    vp = torch.randn(len(ctxs) * T, case.kvh, 64, generator=case.gen).half()
    qp[dest], kp[dest], vp[dest] = q[idx], case.k_new[idx], case.v_new[idx]
    a = list(case.attn_args(prefill=True))
    a[8], a[9] = kp, vp
    out = ops.launch_paged_prefill(qp, padded_cu, *a, interpret=True)
    assert _rel_err(out[dest], dirty[idx]) < ATTN_RTOL


# ------------------------------------------------------------------------------------------------
# sliding windows and soft-capping (Gemma 2/3, Mistral / Qwen2 sliding_window)
# ------------------------------------------------------------------------------------------------

# (format, head_dim, gqa ratio, partition, kv heads, contexts, [(window, softcap), ...]): windows smaller than a
# block, block-unaligned ones, one past every context; soft-caps with and without a window; sink rows (the int4
# preset, sink=3); partitions of 16 at blocks of 16, so many partitions lie wholly before the window
WINDOW_DECODE_CASES = [
    ("int4", 64, 3, 64, 2, [0, 1, 5, 63, 64, 65, 130, 201, 257], [(37, 0.0), (100, 30.0), (1000, 0.0), (0, 5.0)]),
    ("k=int8:bchannel:sym,v=int4:g32:asym:hadamard,block=16,sink=3", 64, 1, 16, 2, [2, 16, 17, 47, 81],
     [(5, 0.0), (21, 2.0)]),
]


def _flip_check(ref, base, window, softcap, ctxs, new=None):
    """The case exercises the feature: the reference with it differs from the plain one (unless the window covers
    every context and there is no cap)."""
    if softcap or any(c + n > window for c, n in zip(ctxs, new or [1] * len(ctxs))) and window:
        assert _rel_err(ref, base) > 1e-2


@pytest.mark.parametrize("fmt,d,ratio,part,kvh,ctxs,settings", WINDOW_DECODE_CASES,
                         ids=[f"{c[0]}-p{c[3]}" for c in WINDOW_DECODE_CASES])
def test_decode_window_and_softcap_match_reference(fmt, d, ratio, part, kvh, ctxs, settings):
    case = _case(get_format(fmt), d, ratio, ctxs, kvh=kvh, seed=d + len(ctxs))
    q = torch.randn(len(ctxs), case.heads, d, generator=case.gen) * 2  # large scores: the cap bites
    base = case.reference(q)
    for window, softcap in settings:
        ref = case.reference(q, window=window, softcap=softcap)
        _flip_check(ref, base, window, softcap, ctxs)
        out = _decode(case, q, partition_size=part, window=window, softcap=softcap)
        assert _rel_err(out, ref) < ATTN_RTOL, (window, softcap)


WINDOW_PREFILL_CASES = [
    ("k=int4:bchannel:asym,v=int8:token:asym,block=16,sink=2", 64, 2, 2, [0, 0, 1, 15, 16, 37, 48],
     [16, 3, 15, 1, 16, 11, 2], [(7, 0.0), (20, 10.0), (500, 0.0), (0, 3.0)]),
    ("int4", 64, 3, 1, [0, 66, 130], [64, 62, 5], [(45, 4.0)]),  # the preset: sinks, Hadamard V, blocks of 64
]


@pytest.mark.parametrize("fmt,d,ratio,kvh,ctxs,new,settings", WINDOW_PREFILL_CASES,
                         ids=[c[0] for c in WINDOW_PREFILL_CASES])
def test_prefill_window_and_softcap_match_reference(fmt, d, ratio, kvh, ctxs, new, settings):
    case = _case(get_format(fmt), d, ratio, ctxs, new=new, kvh=kvh, seed=d * ratio + 1)
    q = torch.randn(int(case.cu[-1]), case.heads, d, generator=case.gen) * 2
    base = case.reference(q, prefill=True)
    for window, softcap in settings:
        ref = case.reference(q, prefill=True, window=window, softcap=softcap)
        _flip_check(ref, base, window, softcap, ctxs, new)
        out = _prefill(case, q, window=window, softcap=softcap)
        assert _rel_err(out, ref) < ATTN_RTOL, (window, softcap)


def test_window_never_reads_blocks_before_it(monkeypatch):
    """Decode through ``ops.decode_attention`` (the custom op, interpreter): sealed blocks wholly before the window
    hold NaN scales and 0xFF codes, their block-table entries name such blocks -- the output is the windowed
    reference's on the clean cache; and a window ring: each slot's blocks written in order into
    ``WindowRing.block(slot, i)`` (older blocks overwritten), read through the logical table."""
    from trtkv.cache_layout import KVPool, WindowRing, first_window_block

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fmt, window, bs = get_format("k=int4:bchannel:asym,v=int8:token:sym,block=16,sink=2"), 27, 16
    ctxs = [150, 77, 20, 33]
    case = _case(fmt, 64, 2, ctxs, seed=5)
    q = torch.randn(len(ctxs), case.heads, 64, generator=case.gen)
    ref = case.reference(q, window=window, softcap=3.0)
    assert _rel_err(ref, case.reference(q, softcap=3.0)) > 1e-2
    args = dict(k_new=case.k_new, v_new=case.v_new, context_lens=case.context_lens, slot_ids=case.slot_ids,
                k_params=case.kp, v_params=case.vp, partition_size=32, window=window, softcap=3.0)
    # 1. NaN blocks / bad entries before the window
    table = case.block_table.clone()
    for b, c in enumerate(ctxs):
        first = first_window_block(c, window, bs)
        for j in range(first):
            blk = int(table[b, j])
            for pool in (case.k_pool, case.v_pool):
                pool.data[blk] = pool.data[blk].view(torch.uint8).fill_(0xFF).view(pool.data.dtype)
                for t in (pool.scale, pool.zero):
                    if t is not None:
                        t[blk] = float("nan")
            if j % 2:
                table[b, j] = table[b, 0]  # another NaN block (an out-of-range entry would crash the interpreter)
    out = ops.decode_attention(q, case.layout, case.k_pool, case.v_pool, block_table=table, **args)
    assert torch.isfinite(out).all() and _rel_err(out, ref) < ATTN_RTOL
    # 2. a ring: slot s holds ring blocks s * R .. s * R + R - 1, sealed block i at ring.block(s, i)
    case = _case(fmt, 64, 2, ctxs, seed=5)  # the clean cache again
    ring = WindowRing((0,), window, bs)
    R = ring.ring_blocks
    assert R < max(c // bs for c in ctxs)  # the ring wraps
    nslots = int(case.slot_ids.max()) + 1
    pools = []
    for pool in (case.k_pool, case.v_pool):
        rp = KVPool(*(None if t is None else torch.full((nslots * R, *t.shape[1:]), float("nan"), dtype=t.dtype)
                      if t.dtype == torch.float16 else torch.zeros((nslots * R, *t.shape[1:]), dtype=t.dtype)
                      for t in (pool.data, pool.scale, pool.zero)), pool.tail)
        for b, c in enumerate(ctxs):
            for i in range(c // bs):  # in sealing order: block i overwrites block i - R
                dst, src = int(ring.block(int(case.slot_ids[b]), i)), int(case.block_table[b, i])
                for t, u in zip((rp.data, rp.scale, rp.zero), (pool.data, pool.scale, pool.zero)):
                    if t is not None:
                        t[dst] = u[src]
        pools.append(rp)
    logical = ring.block(case.slot_ids[:, None].long(), torch.arange(case.block_table.shape[1])[None, :]).int()
    out = ops.decode_attention(q, case.layout, pools[0], pools[1], block_table=logical, **args)
    assert torch.isfinite(out).all() and _rel_err(out, ref) < ATTN_RTOL
    # and the prefill kernel over the ring, one new token each (= decode)
    cu = torch.arange(len(ctxs) + 1, dtype=torch.int32)
    pre = ops.prefill_attention(q, cu, case.layout, pools[0], pools[1], block_table=logical,
                                **{k: v for k, v in args.items() if k != "partition_size"})
    assert _rel_err(pre, ref) < ATTN_RTOL


# ------------------------------------------------------------------------------------------------
# the ONNX op contract's references (what an ONNX Runtime stand-in for the plugins runs)
# ------------------------------------------------------------------------------------------------


def test_run_op_references_follow_the_contract():
    case = _case("int4", 64, 3, _ctxs(64)[:4], seed=13)
    a = C.attrs_for("PagedDecodePartition", case.fmt, num_q_heads=case.heads, num_kv_heads=case.kvh, head_dim=64,
                    partition_size=64)
    t = case.contract_tensors(False, torch.randn(4, case.heads, 64, generator=case.gen).half())
    parts = R.run_op("PagedDecodePartition", a, t)
    assert [tuple(p.shape) for p in parts] == C.output_shapes("PagedDecodePartition", a, [
        tuple(t[x.name].shape) if x.name in t and t[x.name] is not None else C.placeholder_shape(x, a)
        for x in C.DECODE_PARTITION.inputs])
    red = {k: a[k] for k in (x.name for x in C.DECODE_REDUCE.attrs)}
    (out,) = R.run_op("PagedDecodeReduce", red, dict(part_m=parts[0], part_l=parts[1], part_acc=parts[2],
                                                    context_lens=case.context_lens, hadamard=hadamard_matrix(64)))
    assert _rel_err(out, case.reference(t["q"].float())) < 1e-3  # fp16 output
    # the decode kernels on the same contract tensors
    assert _rel_err(_decode(case, t["q"].float(), partition_size=64), case.reference(t["q"].float())) < ATTN_RTOL
    sa = C.attrs_for("PagedKVSeal", case.fmt, num_q_heads=3, num_kv_heads=2, head_dim=64)
    rows = torch.randn(2, 2, 64, 64, generator=case.gen).half()
    got = R.run_op("PagedKVSeal", sa, dict(rows=rows))
    want = ops.launch_seal(rows, case.fmt.k, interpret=True)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


# ------------------------------------------------------------------------------------------------
# custom ops (dispatch, fake impls) and validation
# ------------------------------------------------------------------------------------------------


def test_custom_ops_dispatch_reference_and_interpreter(monkeypatch):
    case = _case("int4", 64, 3, [20, 0, 130], seed=21)
    q = torch.randn(3, case.heads, 64, generator=case.gen)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ref_path = torch.ops.trtkv.paged_decode_attention(q, *case.op_args())
    assert torch.equal(ref_path, case.reference(q))  # CPU without TRITON_INTERPRET: the torch reference
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kern_path = torch.ops.trtkv.paged_decode_attention(q, *case.op_args(), partition_size=32)
    assert _rel_err(kern_path, ref_path) < ATTN_RTOL

    pc = _case("int4", 64, 3, [20, 0, 130], new=[4, 9, 2], seed=22)
    qp = torch.randn(15, pc.heads, 64, generator=pc.gen)
    a = torch.ops.trtkv.paged_prefill_attention(qp, pc.cu, *pc.op_args(prefill=True))
    monkeypatch.delenv("TRITON_INTERPRET")
    b = torch.ops.trtkv.paged_prefill_attention(qp, pc.cu, *pc.op_args(prefill=True))
    assert _rel_err(a, b) < ATTN_RTOL


@pytest.mark.parametrize("interpret", [False, True])
def test_seal_kv_wrapper_through_custom_op(monkeypatch, interpret):
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layout = PagedKVLayout(get_format("int4"), 2, 64, 64, 6)
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 64, 64, generator=gen).half(), torch.randn(2, 2, 64, 64, generator=gen).half()
    blocks = torch.tensor([5, 1])
    ref_k, ref_v, out_k, out_v = (layout.allocate(w) for w in ("k", "v", "k", "v"))
    seal_blocks(layout, "k", ref_k, k, blocks)
    seal_blocks(layout, "v", ref_v, v, blocks)
    ops.seal_kv(layout, k, v, blocks, out_k, out_v)
    for a, b in ((ref_k, out_k), (ref_v, out_v)):
        if interpret and a is ref_v:  # V is Hadamard-rotated: summation-order tolerance (see module docstring)
            assert (unpack_int4(a.data).int() - unpack_int4(b.data).int()).abs().max() <= 1
            continue
        assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)
        assert (a.zero is None and b.zero is None) or torch.equal(a.zero, b.zero)


def test_fake_impls_and_opcheck(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = _case("int8", 64, 2, [9, 70], seed=31, garbage=False)
    q = torch.randn(2, case.heads, 64, generator=case.gen)
    torch.library.opcheck(torch.ops.trtkv.paged_decode_attention.default, (q, *case.op_args()),
                          test_utils=("test_schema", "test_faketensor"))
    pc = _case("int8", 64, 2, [9, 70], new=[2, 1], seed=31, garbage=False)
    qp = torch.randn(3, pc.heads, 64, generator=pc.gen)
    torch.library.opcheck(torch.ops.trtkv.paged_prefill_attention.default, (qp, pc.cu, *pc.op_args(prefill=True)),
                          test_utils=("test_schema", "test_faketensor"))
    k = case.k_pool
    torch.library.opcheck(torch.ops.trtkv.seal_blocks.default,
                          (torch.randn(1, 2, 64, 64), torch.tensor([3]), k.data, k.scale, k.zero, case.fmt.k.short()),
                          test_utils=("test_schema", "test_faketensor"))


# ------------------------------------------------------------------------------------------------
# 4. codebooks (nuq), outlier lists (outN), keys stored before RoPE (prerope), bits per channel (allocB)
# ------------------------------------------------------------------------------------------------


def _seal_both(rows, tf, p, first=None, rope=None):
    """(reference pool, kernel pool) of sealing ``rows`` with format ``tf`` and case params ``p``."""
    args = (p.scale, p.smooth, p.clip)
    ref = R.seal_ref_pool(rows, tf, *args, p.codebook, first, rope, p.bits)
    out = ops.launch_seal_pool(rows, tf, *args, True, p.codebook, first, rope, p.bits)
    return ref, out


# integer-valued rows: every sum (block and group means, so every outlier score) is exact in any order, and the many
# equal scores exercise the tie rule (the lower position first) -> bit exact
SEAL_EXACT_FEATURES = [("int3:bchannel:asym:out16", 32, 16), ("int2:g16:asym:nuq:out48", 64, 32),
                ("int4:token:sym:nuq:out16", 64, 16), ("int3:bchannel:sym:nuq:out64", 128, 64),
                ("int3:g32:sym:nuq", 64, 128),
                # allocB (random widths, every width in head 0): rows of 10, 24 and 32 bytes, outliers in units of levels
                ("int8:bchannel:asym:alloc2.5:out16", 32, 16), ("int8:bchannel:asym:alloc3:out48", 64, 32),
                ("int4:bchannel:asym:alloc2", 128, 64)]


@pytest.mark.parametrize("spec,d,bs", SEAL_EXACT_FEATURES, ids=[f"{s}-d{d}-b{b}" for s, d, b in SEAL_EXACT_FEATURES])
def test_seal_codebooks_and_outliers_bit_for_bit_on_integer_inputs(spec, d, bs):
    gen = torch.Generator().manual_seed(d + bs)
    tf = parse_tensor_spec(spec)
    rows = torch.randint(-40, 41, (3, 2, bs, d), generator=gen).float()
    rows[1, 0, 5, :] *= 9  # a row of outliers in one block-head: lists and ranges must follow it
    p = case_params(tf, "k", _as_rows(rows), gen)
    ref, out = _seal_both(rows, tf, p)
    for name in ("data", "scale", "zero", "outlier_index", "outlier_value"):
        a, b = getattr(ref, name), getattr(out, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    if tf.outliers:
        assert bool((out.outlier_index.diff(dim=-1) > 0).all())  # positions ascending, each kept once
        if tf.allocated_bits is None:  # (allocB scores in units of each channel's levels: wide channels score low)
            assert (out.outlier_index[1, 0] // d == 5).sum() >= min(tf.outliers, d) // 2  # the loud row is set aside


# the int3 preset; the int2 preset's layout at blocks of 32 (its outlier counts at their share of the block: 4 / 12 would
# not tile, so 16 / 48 of a block of 32); pre-RoPE keys smoothed by the queries and rotated, with outlier lists
SEAL_FEATURE_FORMATS = [("int3", 64), ("k=int8:bchannel:asym:prerope:alloc2.25:out16,v=int2:token:sym:hadamard:nuq:out48,block=32", 64),
                        (INT3_NUQ, 64), ("k=int3:bchannel:asym:prerope:qsmooth:out16,v=fp16,block=32", 32)]


@pytest.mark.parametrize("fmt,d", SEAL_FEATURE_FORMATS)
def test_seal_of_pre_rope_keys_codebooks_and_outliers_matches_the_reference(fmt, d):
    """K (pre-RoPE; per-channel widths, or smoothed and rotated; outliers) and V (codebook): the reference's codes, scales and outlier
    lists. Where a rotation sums products, within its summation-order tolerance (module docstring); outlier lists may then
    swap an element whose score sits within an ulp of the threshold."""
    f = get_format(fmt)
    bs = f.block_size
    gen = torch.Generator().manual_seed(d)
    rope = case_rope(6 * bs, d)
    for which, tf in (("k", f.k), ("v", f.v)):
        if not tf.is_quantized:
            continue
        rows = (torch.randn(3, 2, bs, d, generator=gen) * (torch.rand(2, 1, d, generator=gen) * 2 + 0.2)).half()
        p = case_params(tf, which, _as_rows(rows), gen)
        first = torch.tensor([0, 2 * bs, 5 * bs])
        ref, out = _seal_both(rows, tf, p, first, (rope.cos, rope.sin))
        a, b = tf.traits.stored_values(ref.data).int(), tf.traits.stored_values(out.data).int()
        diff = (a - b).abs()
        if tf.hadamard:
            assert diff.max() <= 1 and (diff > 0).float().mean() < 5e-3, which
        else:
            assert diff.max() == 0, which
        for x, y in ((ref.scale, out.scale), (ref.zero, out.zero)):
            if x is not None:
                assert ((x.float() - y.float()).abs() / x.float().abs().clamp_min(1e-6)).max() <= 2**-10
        if tf.outliers:
            shared = [len(set(r.tolist()) & set(o.tolist())) for r, o in zip(ref.outlier_index.flatten(0, 1), out.outlier_index.flatten(0, 1))]
            assert min(shared) >= tf.outliers - 1 and sum(shared) >= 0.99 * ref.outlier_index.numel()
            same = ref.outlier_index == out.outlier_index
            x, y = ref.outlier_value[same].float(), out.outlier_value[same].float()
            assert ((x - y).abs() / x.abs().clamp_min(1e-6)).max() <= 2**-10  # one fp16 ulp at most


def test_seal_prerope_uses_each_blocks_position():
    """Keys stored before RoPE: RoPE is undone at each block's own positions -- a block sealed at another position stores
    other codes, the same position the same -- exactly as the reference undoes it (no rotation: bit for bit)."""
    gen = torch.Generator().manual_seed(5)
    tf = parse_tensor_spec("int4:bchannel:asym:prerope")
    rows = torch.randn(2, 1, 16, 32, generator=gen)
    rope = case_rope(200, 32)
    at = ops.launch_seal_pool(rows, tf, interpret=True, first_positions=torch.tensor([0, 160]), rope=(rope.cos, rope.sin))
    moved = ops.launch_seal_pool(rows, tf, interpret=True, first_positions=torch.tensor([0, 32]), rope=(rope.cos, rope.sin))
    ref = R.seal_ref_pool(rows, tf, first_positions=torch.tensor([0, 160]), rope=(rope.cos, rope.sin))
    assert torch.equal(at.data[0], moved.data[0]) and not torch.equal(at.data[1], moved.data[1])
    assert all(torch.equal(getattr(at, n), getattr(ref, n)) for n in ("data", "scale", "zero"))


FEATURE_ATTN_CASES = [  # (format, head_dim, gqa ratio, partition size, kv heads)
    (INT3_NUQ, 64, 3, 512, 2),
    ("k=int3:bchannel:asym:prerope:out16,v=int4:token:asym:nuq:out16,block=16,sink=2", 32, 1, 16, 2),
    ("k=int4:bchannel:sym:nuq:out32,v=int3:g16:sym:hadamard:nuq,block=32,sink=5", 64, 2, 32, 2),
    # allocB: each channel's code at its offset and width (keys before RoPE with outliers; values too)
    ("int3", 64, 3, 512, 2),  # the presets
    ("int2", 128, 2, 128, 1),
    ("k=int8:bchannel:asym:alloc2.5,v=int4:bchannel:asym:alloc3:out16,block=16,sink=2", 32, 1, 16, 2),
]


def _feature_tol(f: KVFormat) -> float:
    """Keys stored before RoPE and rotated come back to model space through an fp16 product (the precision the open
    block keeps keys in): ~1e-3 relative; every other read is the fp32 arithmetic of ATTN_RTOL."""
    return 2e-3 if f.k.pre_rope and f.k.hadamard else ATTN_RTOL


@pytest.mark.slow
@pytest.mark.parametrize("fmt,d,ratio,part,kvh", FEATURE_ATTN_CASES, ids=[f"{f[:40]}-d{d}-gqa{r}-p{p}-h{h}" for f, d, r, p, h in FEATURE_ATTN_CASES])
def test_decode_and_prefill_read_codebooks_outliers_and_prerope_keys(fmt, d, ratio, part, kvh):
    """Against float64 attention over the reference's dequantized cache (codebook levels, outlier lists written back,
    RoPE applied again at each position), with garbage everywhere attention must not read -- dead blocks' outlier lists
    included -- and contexts ending anywhere in a block (outlier formats walk tiles aligned to the block); decode also
    with a sliding window that starts inside a block."""
    f = get_format(fmt)
    bs = f.block_size
    case = PagedCase(f, _ctxs(bs), [1, 2, 1, 3, 1, 2, 1, 1], heads_q=kvh * ratio, kv_heads=kvh, head_dim=d, seed=d + ratio)
    ext = ops.SealedExtras(**case.extras_kwargs())
    q = torch.randn(len(case.ctxs), case.heads, d, generator=case.gen)
    out = ops.launch_paged_decode(q, *case.attn_args(), interpret=True, partition_size=part, extras=ext)
    assert _rel_err(out, case.reference(q)) < _feature_tol(f)
    win = bs + 3
    out = ops.launch_paged_decode(q, *case.attn_args(), interpret=True, partition_size=part, extras=ext, window=win)
    assert _rel_err(out, case.reference(q, window=win)) < _feature_tol(f)
    qp = torch.randn(case.q_pre.shape, generator=case.gen)
    out = ops.launch_paged_prefill(qp, case.cu, *case.attn_args(prefill=True), interpret=True, extras=ext)
    assert _rel_err(out, case.reference(qp, prefill=True)) < _feature_tol(f)


def test_attention_reads_each_feature():
    """Each feature changes what the kernels read (against the same reference): the outlier lists, the codebook and the
    RoPE table each, replaced, move the output far past the tolerance."""
    f = get_format(INT3_NUQ)
    case = PagedCase(f, [300, 129], heads_q=4, kv_heads=2, head_dim=64, seed=3)
    ref = case.reference()
    kw = case.extras_kwargs()
    assert _rel_err(_decode(case, case.q_dec, extras=ops.SealedExtras(**kw)), ref) < 2e-3
    other = case_rope(400, 64, base=500.0)
    for change in (dict(k_outlier_value=kw["k_outlier_value"] * 0), dict(v_codebook=kw["v_codebook"].flip(-1)),
                   dict(rope_cos=other.cos, rope_sin=other.sin)):
        assert _rel_err(_decode(case, case.q_dec, extras=ops.SealedExtras(**{**kw, **change})), ref) > 1e-2, list(change)


def test_reads_of_codebooks_outliers_and_pre_rope_keys_refuse_what_is_missing_in_one_line():
    case = PagedCase(get_format(INT3_NUQ), [130], heads_q=2, kv_heads=1, head_dim=64, seed=1)
    kw = case.extras_kwargs()
    for missing, words in (("v_codebook", "none was given"), ("k_outlier_index", "outlier lists"),
                           ("rope_cos", "no RoPE table")):
        with pytest.raises(TrtkvError, match=words) as e:
            _decode(case, case.q_dec, extras=ops.SealedExtras(**{**kw, missing: None}))
        assert "\n" not in str(e.value)
    short = case_rope(100, 64)
    with pytest.raises(TrtkvError, match="covers positions below 100"):
        _decode(case, case.q_dec, extras=ops.SealedExtras(**{**kw, "rope_cos": short.cos, "rope_sin": short.sin}))


@pytest.mark.parametrize("n, ok", [(16, True), (48, True), (64, True), (96, True), (40, False), (8, False), (2048, False)])
def test_outlier_counts_the_kernels_take(n, ok):
    """The attention kernels read a block's outlier list in chunks of its largest power-of-two divisor and the seal
    kernel's selection counts: any multiple of 16 up to 1024 (the int2 preset's 48 value outliers are three chunks). Both
    refuse the rest in one line naming what they take."""
    from trtkv.plugins.contract.capabilities import KERNEL_ATTENTION, KERNEL_SEAL, kernel_refusal

    t = parse_tensor_spec(f"int4:bchannel:asym:out{n}")
    for path in (KERNEL_ATTENTION, KERNEL_SEAL):
        why = path.tensor_reason(t)
        assert (why is None) == ok, (path.name, why)
        assert ok or ("a multiple of 16" in why and f"{n} outliers" in why and "\n" not in why)
    assert (kernel_refusal(t) is None) == ok


def test_validation_errors():
    case = _case("int8", 64, 1, [5], seed=0, garbage=False)
    q = torch.randn(1, 2, 64)
    a = list(case.attn_args())
    bad = list(a)
    bad[0] = a[0].view(torch.uint8)
    with pytest.raises(TrtkvError, match="does not match format"):  # pool dtype does not match the format
        ops.launch_paged_decode(q, *bad)
    bad = list(a)
    bad[13] = "int8:tensor:sym"
    bad[1] = None
    with pytest.raises(TrtkvError, match="static scale"):
        ops.launch_paged_decode(q, *bad)
    with pytest.raises(TrtkvError, match="multiple"):  # heads not a multiple of kv heads
        ops.launch_paged_decode(torch.randn(1, 3, 64), *a)
    bad = list(a)
    bad[6] = a[6][:, :, :8]
    with pytest.raises(TrtkvError, match="tail"):
        ops.launch_paged_decode(q, *bad)
    with pytest.raises(TrtkvError, match="head_dim"):
        ops.launch_seal(torch.zeros(1, 2, 64, 16), "int8:token:sym")
    with pytest.raises(TrtkvError, match="block_size"):
        ops.launch_seal(torch.zeros(1, 2, 8, 64), "int8:token:sym")


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 64, 128, 256])
def test_seal_warps_are_a_power_of_two_holding_the_elements_per_warp(head_dim, block_size):
    """Triton takes only powers of two; a head dim of 96 (Phi-3) at block 128 needs 6 warps' worth and gets 8."""
    warps = K.seal_config(parse_tensor_spec("int4:bchannel:asym:hadamard"), head_dim, block_size)["num_warps"]
    assert warps >= 4 and warps & (warps - 1) == 0
    assert block_size * head_dim <= warps * K.SEAL_ELEMS_PER_WARP
    assert warps == 4 or block_size * head_dim > warps // 2 * K.SEAL_ELEMS_PER_WARP  # no more than needed
