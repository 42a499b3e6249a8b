"""Triton kernels of trtkv.plugins, run on CPU under the Triton interpreter, against the torch references.

Interpreter mode does not depend on import order: ``trtkv.plugins.kernels.load_kernels(True)`` loads a
private copy of the kernel module with ``triton.jit`` resolved to the interpreter, so another test module
importing triton (or the compiled kernels) first does not matter; the launchers are called with
``interpret=True``. The custom-op tests set ``TRITON_INTERPRET=1`` only for their own duration
(monkeypatch), which is what the ops' CPU dispatch reads at call time.

Error thresholds
* quantize-and-append: codes and fp16 scales / zero-points must equal ``cache_layout.write_paged`` bit for
  bit. The kernel computes the same fp32 operations in the same order (IEEE ``div_rn``, fp16 rounding of
  scales before the codes, half-to-even ``_rint``). The one exception is the Hadamard rotation, a sum of
  head_dim products whose order differs between torch's matmul and ``tl.dot``: values may differ by an
  ulp, so a code may move by one where the reference value sits within ulps of a rounding tie, and a
  scale by one fp16 ulp when the group max straddles an fp16 rounding boundary. Those cases are checked
  with that tolerance (<= 1 code, < 0.5% of codes, scales within 1 fp16 ulp), and exactly on integer-valued
  inputs, where every partial sum is exact in any order.
* attention: the reference runs float64 softmax attention on the cache dequantized by ``gather_paged``
  (float32), i.e. the SAME stored values. The kernel's only differences are fp32 arithmetic: the
  dequantize multiply-add, the query-side transform fold (q*smooth@H*scale instead of undoing it on K),
  fp32 dot accumulation over head_dim and over up to 257 keys, exp2 of fp32 scores and the online-softmax
  rescaling. Each contributes a few fp32 ulps (~1e-7 relative); measured max error is ~2e-7 relative to
  max|out|. The threshold is 2e-5 relative to max|out| (100x margin, still 100x below the error
  of any indexing, masking or scale bug, which shows up at >= 1e-3).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from trtkv.cache_layout import KVPool, PagedKVLayout, write_paged  # noqa: E402
from trtkv.errors import TrtkvError  # noqa: E402
from trtkv.formats import DTYPES, KVFormat, TensorFormat, get_format, parse_tensor_spec  # noqa: E402
from trtkv.quant import TensorParams  # noqa: E402
from trtkv.plugins import kernels as K  # noqa: E402
from trtkv.plugins import ops  # noqa: E402
from trtkv.plugins import reference as R  # noqa: E402

ATTN_RTOL = 2e-5


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _params(tf: TensorFormat, kvh: int, d: int, gen: torch.Generator) -> TensorParams:
    p = TensorParams()
    if tf.is_static:
        qmax = DTYPES[tf.dtype].sym_max
        if tf.granularity == "per_tensor":
            p.scale = torch.tensor(3.5 / qmax)
        elif tf.granularity == "per_head":
            p.scale = (torch.rand(kvh, generator=gen) + 2.5) / qmax
        else:
            p.scale = (torch.rand(kvh, d, generator=gen) + 2.5) / qmax
    if tf.smooth:
        p.smooth = torch.rand(kvh, d, generator=gen) * 1.5 + 0.25
    return p


def _fill_garbage(layout: PagedKVLayout, pool: KVPool, block_table, ctxs, gen) -> None:
    """Scribble over every pool slot that no sequence's context covers (NaN / inf scales included)."""
    bs = layout.block_size
    live = torch.zeros(layout.num_blocks, bs, dtype=torch.bool)
    for b, ctx in enumerate(ctxs):
        pos = torch.arange(ctx)
        live[block_table[b, pos // bs].long(), pos % bs] = True
    dead = ~live  # [blocks, bs]
    data = pool.data
    rnd = torch.randint(0, 256, data.shape, generator=gen, dtype=torch.int32)
    if data.dtype == torch.float16:
        junk = (torch.randn(data.shape, generator=gen) * 1e4).half()
        junk[..., 0] = float("nan")
    else:
        junk = rnd.to(torch.uint8).view(data.dtype) if data.dtype == torch.int8 else rnd.to(torch.uint8)
    m = dead[:, None, :, None].expand_as(data)
    data[m] = junk[m]
    for t in (pool.scale, pool.zero):
        if t is not None:
            mm = dead[:, None, :, None].expand_as(t)
            j = torch.full(t.shape, float("nan"), dtype=torch.float16)
            j[..., ::2] = float("inf")
            t[mm] = j[mm]


class Case:
    """A paged cache holding random K/V for sequences of the given context lengths."""

    def __init__(self, fmt: KVFormat | str, head_dim: int, ratio: int, ctxs, kvh: int = 2, block_size: int = 16,
                 seed: int = 0, garbage: bool = True):
        self.fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        gen = torch.Generator().manual_seed(seed)
        self.gen = gen
        self.ctxs = list(ctxs)
        self.kvh, self.heads, self.d = kvh, kvh * ratio, head_dim
        max_blocks = max(1, math.ceil(max(self.ctxs + [1]) / block_size)) + 1  # one spare block per row
        num_blocks = len(self.ctxs) * max_blocks + 3
        self.layout = PagedKVLayout(self.fmt, kvh, head_dim, block_size, num_blocks)
        perm = torch.randperm(num_blocks, generator=gen)[: len(self.ctxs) * max_blocks]
        self.block_table = perm.view(len(self.ctxs), max_blocks).to(torch.int32)
        self.context_lens = torch.tensor(self.ctxs, dtype=torch.int32)
        self.kp = _params(self.fmt.k, kvh, head_dim, gen)
        self.vp = _params(self.fmt.v, kvh, head_dim, gen)
        self.k_pool, self.v_pool = self.layout.allocate("k"), self.layout.allocate("v")
        for b, ctx in enumerate(self.ctxs):
            if ctx == 0:
                continue
            pos = torch.arange(ctx)
            slots = self.block_table[b, pos // block_size].long() * block_size + pos % block_size
            scale_ch = torch.rand(kvh, head_dim, generator=gen) * 2 + 0.2  # channel outliers, like real keys
            k = torch.randn(ctx, kvh, head_dim, generator=gen) * scale_ch
            v = torch.randn(ctx, kvh, head_dim, generator=gen)
            write_paged(self.layout, "k", self.k_pool, k, slots, self.kp)
            write_paged(self.layout, "v", self.v_pool, v, slots, self.vp)
        if garbage:
            self.garbage()

    def garbage(self):
        for pool in (self.k_pool, self.v_pool):
            _fill_garbage(self.layout, pool, self.block_table, self.ctxs, self.gen)

    def pool_args(self):
        k, v = self.k_pool, self.v_pool
        return (k.data, k.scale, k.zero, v.data, v.scale, v.zero)

    def fmt_args(self):
        return (self.fmt.k.short(), self.fmt.v.short(), self.kp.scale, self.kp.smooth, self.vp.scale, self.vp.smooth)

    def decode(self, q, **kw):
        k_data, k_scale, k_zero, v_data, v_scale, v_zero = self.pool_args()
        kf, vf, ks, ksm, vs, vsm = self.fmt_args()
        return ops.launch_paged_decode(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, self.block_table,
                                       self.context_lens, kf, vf, ks, ksm, vs, vsm, interpret=True, **kw)

    def prefill(self, q, cu, **kw):
        k_data, k_scale, k_zero, v_data, v_scale, v_zero = self.pool_args()
        kf, vf, ks, ksm, vs, vsm = self.fmt_args()
        return ops.launch_paged_prefill(q, cu, k_data, k_scale, k_zero, v_data, v_scale, v_zero, self.block_table,
                                        self.context_lens, kf, vf, ks, ksm, vs, vsm, interpret=True, **kw)

    def reference(self, q, cu=None, sm_scale=None):
        return R.paged_attention_ref(q, cu, self.k_pool, self.v_pool, self.block_table, self.context_lens,
                                     self.fmt.k, self.fmt.v, self.kp, self.vp, sm_scale)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    denom = ref.double().abs().max().clamp_min(1e-30)
    return float((out.double() - ref.double()).abs().max() / denom)


# ------------------------------------------------------------------------------------------------
# module plumbing
# ------------------------------------------------------------------------------------------------


def test_interpreter_copy_is_independent_of_import_order():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    assert isinstance(K.load_kernels(True).quantize_append_kernel, InterpretedFunction)
    assert isinstance(K.load_kernels(False).paged_decode_partition_kernel, JITFunction)
    assert K.load_kernels(True) is K.load_kernels(True)


def test_code_ranges_mirror_the_dtype_registry():
    for name, mx in K.SYM_MAX.items():
        assert DTYPES[name].sym_max == mx and DTYPES[name].sym_min == K.SYM_MIN[name]
    for name, mx in K.ASYM_MAX.items():
        assert DTYPES[name].asym_max == mx
    assert ops.DEFAULT_PARTITION == K.DEFAULT_PARTITION


# ------------------------------------------------------------------------------------------------
# 1. quantize and append
# ------------------------------------------------------------------------------------------------


def _append_both(spec: str, rows, slots, params: TensorParams, block_size=16, num_blocks=None):
    tf = parse_tensor_spec(spec)
    kvh, d = rows.shape[1], rows.shape[2]
    num_blocks = num_blocks or (rows.shape[0] // block_size + 4)
    layout = PagedKVLayout(KVFormat(name="t", k=tf, v=TensorFormat(dtype="fp16")), kvh, d, block_size, num_blocks)
    ref, out = layout.allocate("k"), layout.allocate("k")
    write_paged(layout, "k", ref, rows, slots, params)
    ops.launch_quantize_append(rows, slots, out.data, out.scale, out.zero, spec, params.scale, params.smooth,
                               params.clip, interpret=True)
    return ref, out


APPEND_CASES = [  # (spec, head_dim, input dtype)
    ("int8:token:sym", 64, torch.float16),
    ("int8:token:asym", 128, torch.bfloat16),
    ("int8:tensor:sym", 64, torch.float32),
    ("int8:channel:sym:smooth", 128, torch.float16),
    ("int4:g64:asym", 128, torch.float16),
    ("int4:g32:sym", 64, torch.bfloat16),
    ("int4:token:asym:smooth", 64, torch.float32),
    ("int4:head:sym", 128, torch.float16),
    ("fp8_e4m3:tensor:sym", 64, torch.float16),
    ("fp8_e4m3:channel:sym", 128, torch.bfloat16),
    ("fp8_e4m3:g32:sym", 64, torch.float32),
    ("fp16", 128, torch.bfloat16),
]


@pytest.mark.parametrize("spec,d,dtype", APPEND_CASES, ids=[f"{s}-d{d}-{str(t)[6:]}" for s, d, t in APPEND_CASES])
def test_append_matches_write_paged_bit_for_bit(spec, d, dtype):
    gen = torch.Generator().manual_seed(hash(spec) % 1000 + d)
    tokens, kvh = 83, 2
    rows = (torch.randn(tokens, kvh, d, generator=gen) * (torch.rand(kvh, d, generator=gen) * 3 + 0.1)).to(dtype)
    rows[3] = 0.0  # all-zero rows: scale 0, inverse guarded
    rows[4, 0, : d // 2] = 7.0  # constant groups: asymmetric range 0
    slots = torch.randperm(tokens + 40, generator=gen)[:tokens]
    slots[[5, 17, 60]] = -1  # padding tokens: skipped
    tf = parse_tensor_spec(spec)
    params = _params(tf, kvh, d, gen)
    if tf.is_dynamic:
        params.clip = torch.tensor([1.0, 0.83])  # per-head range multiplier
    ref, out = _append_both(spec, rows, slots, params)
    assert torch.equal(ref.data, out.data), f"{(ref.data != out.data).sum()} codes differ"
    for a, b in ((ref.scale, out.scale), (ref.zero, out.zero)):
        if a is not None:
            assert torch.equal(a, b)


def test_rounding_ties_go_to_even_and_clamp():
    """Static scale 1: codes are round-half-even(clamp(x)); ties, negative ties and out-of-range values."""
    vals = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, 300.0, -128.5, -1e30, 1e30, 3.49999, -0.0])
    d = 64
    rows = torch.zeros(1, 1, d)
    rows[0, 0, : vals.numel()] = vals
    ref, out = _append_both("int8:tensor:sym", rows, torch.tensor([0]), TensorParams(scale=torch.tensor(1.0)))
    assert torch.equal(ref.data, out.data)
    assert out.data[0, 0, 0, : vals.numel()].tolist() == [0, 2, 2, 0, -2, -2, 126, 127, 127, -128, -128, 127, 3, 0]


def test_fp8_encoding_matches_torch_on_every_code_and_midpoint():
    """All finite e4m3 values, the midpoints between neighbours (round-to-even ties), subnormals, +-0, +-448."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)]
    pos = torch.unique(vals.abs())
    mids = (pos[1:] + pos[:-1]) / 2
    x = torch.cat([vals, mids, -mids, torch.tensor([1e-9, -1e-9, 447.9, 449.0, -1000.0])])
    d = 128
    n = math.ceil(x.numel() / d)
    rows = torch.zeros(n * d)
    rows[: x.numel()] = x
    rows = rows.view(n, 1, d)
    ref, out = _append_both("fp8_e4m3:tensor:sym", rows, torch.arange(n), TensorParams(scale=torch.tensor(1.0)))
    assert torch.equal(ref.data, out.data)


@pytest.mark.parametrize("spec,d", [("int4:g64:asym:smooth:hadamard", 128), ("int8:token:sym:hadamard", 64),
                                    ("fp8_e4m3:tensor:sym:hadamard", 128)])
def test_append_hadamard_within_summation_order_tolerance(spec, d):
    gen = torch.Generator().manual_seed(d)
    tokens, kvh = 70, 2
    rows = torch.randn(tokens, kvh, d, generator=gen).half()
    slots = torch.randperm(tokens, generator=gen)
    tf = parse_tensor_spec(spec)
    params = _params(tf, kvh, d, gen)
    ref, out = _append_both(spec, rows, slots, params)
    if tf.dtype == "int4":
        from trtkv.quant import unpack_int4

        a, b = unpack_int4(ref.data).int(), unpack_int4(out.data).int()
    else:  # int8 codes; fp8: adjacent values of one sign are adjacent bit patterns
        a, b = ref.data.int(), out.data.int()
    diff = (a - b).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 5e-3
    for x, y in ((ref.scale, out.scale), (ref.zero, out.zero)):
        if x is not None:
            rel = ((x.float() - y.float()).abs() / x.float().abs().clamp_min(1e-6)).max()
            assert rel <= 2**-10


def test_append_hadamard_exact_on_integer_inputs():
    """Integer inputs and H = +-1/8 (head_dim 64): every partial sum is exact in any order -> bit exact."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(-60, 61, (50, 2, 64), generator=gen).float()
    spec = "int4:g32:asym:hadamard"
    ref, out = _append_both(spec, rows, torch.randperm(50, generator=gen), TensorParams())
    assert torch.equal(ref.data, out.data) and torch.equal(ref.scale, out.scale) and torch.equal(ref.zero, out.zero)


def test_append_gpu_tile_config_matches():
    """The GPU launch config (BLOCK_T=16, not the interpreter's 64) through the same launcher path."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(37, 2, 64, generator=gen).half()
    slots = torch.randperm(64, generator=gen)[:37]
    tf = parse_tensor_spec("int4:g32:asym")
    layout = PagedKVLayout(KVFormat(name="t", k=tf, v=TensorFormat(dtype="fp16")), 2, 64, 16, 4)
    ref, out = layout.allocate("k"), layout.allocate("k")
    write_paged(layout, "k", ref, rows, slots)
    kmod = K.load_kernels(True)
    cfg = K.append_config(tf, 64, interpret=False)
    assert cfg["constexprs"]["BLOCK_T"] == 16
    dummy = torch.zeros(1)
    kmod.quantize_append_kernel[K.append_grid(37, 2, cfg["constexprs"])](
        rows, slots, out.data, out.scale, out.zero, dummy, dummy, torch.ones(2), dummy, 37, 2, 16,
        **cfg["constexprs"])
    assert torch.equal(ref.data, out.data) and torch.equal(ref.scale, out.scale)


# ------------------------------------------------------------------------------------------------
# 2. paged decode attention
# ------------------------------------------------------------------------------------------------

CTXS = [1, 17, 0, 100, 257]
DECODE_CASES = [  # (format, head_dim, gqa ratio, partition size)
    ("int8", 64, 1, 512),
    ("int4", 128, 8, 64),
    ("int4", 64, 3, 512),
    ("int4-g32", 64, 8, 512),
    ("fp8", 128, 3, 64),
    ("fp16", 64, 1, 64),
    ("int8-static", 128, 1, 512),
    ("k=int8:token:asym:smooth,v=int4:g32:asym:smooth:hadamard", 64, 3, 64),
    ("k=fp8:channel:sym:hadamard,v=int8:head:sym", 128, 8, 512),
]


@pytest.mark.parametrize("fmt,d,ratio,part", DECODE_CASES, ids=[f"{f}-d{d}-gqa{r}-p{p}" for f, d, r, p in DECODE_CASES])
def test_decode_matches_float64_reference(fmt, d, ratio, part):
    case = Case(fmt, d, ratio, CTXS, seed=d + ratio)
    q = torch.randn(len(CTXS), case.heads, d, generator=case.gen).half()
    out = case.decode(q, partition_size=part)
    ref = case.reference(q.float())
    assert out.dtype == q.dtype and out.shape == q.shape
    # compare in fp32: the kernel's fp16 output rounding is not an error of the kernel
    out32 = case.decode(q.float(), partition_size=part)
    assert _rel_err(out32, ref) < ATTN_RTOL
    assert _rel_err(out, ref.half()) < 2e-3  # fp16 output rounding only
    assert torch.all(out32[CTXS.index(0)] == 0)  # empty context -> zeros


def test_decode_ignores_garbage_past_context_and_block_table_padding():
    case = Case("int4", 64, 3, CTXS, seed=11, garbage=False)
    q = torch.randn(len(CTXS), case.heads, 64, generator=case.gen)
    clean = case.decode(q, partition_size=64)
    case.garbage()
    bt = case.block_table.clone()
    for b, ctx in enumerate(CTXS):  # unused block-table entries may hold anything, even invalid indices
        bt[b, math.ceil(ctx / 16):] = 10**6
    case.block_table = bt
    dirty = case.decode(q, partition_size=64)
    assert torch.equal(clean, dirty)
    assert torch.isfinite(dirty).all()


def test_decode_partition_size_does_not_change_the_result_beyond_rounding():
    case = Case("int8", 128, 8, [257, 600], seed=2)
    q = torch.randn(2, case.heads, 128, generator=case.gen)
    ref = case.reference(q)
    for part in (32, 128, 512):
        assert _rel_err(case.decode(q, partition_size=part), ref) < ATTN_RTOL


def test_decode_sm_scale_and_bf16_query():
    case = Case("int4-g32", 64, 1, [40, 9], seed=4)
    q = torch.randn(2, case.heads, 64, generator=case.gen)
    ref = case.reference(q, sm_scale=0.3)
    assert _rel_err(case.decode(q, sm_scale=0.3), ref) < ATTN_RTOL
    out = case.decode(q.bfloat16(), sm_scale=0.3)
    assert out.dtype == torch.bfloat16
    assert _rel_err(out, case.reference(q.bfloat16().float(), sm_scale=0.3)) < 1e-2  # bf16 output rounding


def test_decode_gpu_tile_config_and_tf32_precision_flag():
    """The GPU constexprs (BLOCK_N=32 at head_dim 128, BLOCK_H=16) through the interpreter; the interpreter
    evaluates fp32 dots exactly whatever input_precision says, so this checks the tile logic, not tf32."""
    case = Case("int4", 128, 4, [70, 5], seed=8)
    q = torch.randn(2, case.heads, 128, generator=case.gen)
    k_data, k_scale, k_zero, v_data, v_scale, v_zero = case.pool_args()
    cfg = K.decode_config(case.fmt.k, case.fmt.v, 128, 4, 64, "tf32x3", interpret=False, new_rows=False)
    assert cfg["partition"]["constexprs"]["BLOCK_N"] == 32
    kmod = K.load_kernels(True)
    f32 = torch.zeros(1)
    from trtkv.quant import hadamard_matrix

    had = hadamard_matrix(128)
    (gp, gr) = K.decode_grids(2, case.kvh, 80, 64)
    pm, pl, pa = torch.empty(2, case.heads, gp[2]), torch.empty(2, case.heads, gp[2]), torch.empty(2, case.heads, gp[2], 128)
    out = torch.empty_like(q)
    kmod.paged_decode_partition_kernel[gp](q, k_data, k_scale, k_zero, v_data, v_scale, v_zero,
                                           k_data, k_scale, k_zero, v_data, v_scale, v_zero, f32, case.kp.smooth,
                                           had, case.block_table, case.context_lens, pm, pl, pa,
                                           K.LOG2E / math.sqrt(128), case.heads, case.kvh, 16,
                                           case.block_table.shape[1], gp[2], **cfg["partition"]["constexprs"])
    kmod.paged_decode_reduce_kernel[gr](pm, pl, pa, case.context_lens, f32, f32, had, out, case.heads, case.kvh,
                                        gp[2], **cfg["reduce"]["constexprs"])
    assert _rel_err(out, case.reference(q)) < ATTN_RTOL


# ------------------------------------------------------------------------------------------------
# 3. prefill / chunked prefill
# ------------------------------------------------------------------------------------------------

PREFILL_CASES = [  # (format, head_dim, gqa ratio)
    ("int8", 128, 3),
    ("int4", 64, 8),
    ("fp8", 64, 1),
    ("k=int4:g32:asym:smooth:hadamard,v=int8:token:asym:smooth:hadamard", 128, 1),
]


@pytest.mark.parametrize("fmt,d,ratio", PREFILL_CASES, ids=[f"{f}-d{d}-gqa{r}" for f, d, r in PREFILL_CASES])
def test_prefill_matches_float64_reference(fmt, d, ratio):
    ctxs = [1, 17, 0, 100, 257]
    num_new = [1, 5, 0, 100, 33]  # full prefill of 100, chunked prefill of the last 33 of 257, decode-like 1
    case = Case(fmt, d, ratio, ctxs, seed=d * ratio)
    cu = torch.tensor([0] + list(torch.tensor(num_new).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), case.heads, d, generator=case.gen)
    out = case.prefill(q, cu)
    ref = case.reference(q, cu)
    assert _rel_err(out, ref) < ATTN_RTOL
    # decode is prefill with one new token: the two kernels agree
    last = cu[1:] - 1
    sel = [b for b in range(len(ctxs)) if num_new[b] > 0]
    qd = torch.zeros(len(ctxs), case.heads, d)
    for b in sel:
        qd[b] = q[last[b]]
    dec = case.decode(qd, partition_size=64)
    for b in sel:
        assert _rel_err(dec[b], out[last[b]]) < ATTN_RTOL


def test_prefill_garbage_and_padding_rows():
    ctxs = [30, 0, 64]
    case = Case("int4-g32", 64, 3, ctxs, seed=9, garbage=False)
    cu = torch.tensor([0, 30, 30, 40], dtype=torch.int32)
    q = torch.randn(40, case.heads, 64, generator=case.gen)
    clean = case.prefill(q, cu, max_seqlen_q=30)
    case.garbage()
    dirty = case.prefill(q, cu, max_seqlen_q=40)  # an upper bound is fine: extra programs exit
    assert torch.equal(clean, dirty)
    assert _rel_err(dirty, case.reference(q, cu)) < ATTN_RTOL


# ------------------------------------------------------------------------------------------------
# pure-engine contract: this step's new rows passed beside the read-only pool
# ------------------------------------------------------------------------------------------------


def _rows_form(fmt: TensorFormat, rows: torch.Tensor, params: TensorParams):
    """Quantize rows [n, kv_heads, D] into pool-row form ([n, kv_heads, packed], [n, kv_heads, groups]) with
    the append kernel on a pool of one-token blocks (what the PagedKVAppend plugin returns)."""
    n, kvh, d = rows.shape
    layout = PagedKVLayout(KVFormat(name="t", k=fmt, v=TensorFormat(dtype="fp16")), kvh, d, 1, max(n, 1))
    pool = layout.allocate("k")
    ops.launch_quantize_append(rows, torch.arange(n), pool.data, pool.scale, pool.zero, fmt, params.scale,
                               params.smooth, params.clip, interpret=True)
    sq = lambda t: None if t is None else t[:, :, 0]  # noqa: E731
    return sq(pool.data), sq(pool.scale), sq(pool.zero)


@pytest.mark.parametrize("fmt,d,ratio", [("int4", 64, 3), ("k=int8:channel:sym:smooth,v=fp8:token:sym:hadamard", 128, 8),
                                         ("fp16", 64, 1)])
def test_new_rows_equal_attention_over_the_pool_after_the_write(fmt, d, ratio, monkeypatch):
    ctxs = [1, 17, 0, 100, 257]
    case = Case(fmt, d, ratio, ctxs, seed=d + 7)
    gen = case.gen
    # decode: the newest position of every sequence is garbage in the pool; the new row holds it
    k_rows = torch.randn(len(ctxs), case.kvh, d, generator=gen)
    v_rows = torch.randn(len(ctxs), case.kvh, d, generator=gen)
    kn = _rows_form(case.fmt.k, k_rows, case.kp)
    vn = _rows_form(case.fmt.v, v_rows, case.vp)
    new = dict(zip(("k_new_data", "k_new_scale", "k_new_zero", "v_new_data", "v_new_scale", "v_new_zero"), kn + vn))
    q = torch.randn(len(ctxs), case.heads, d, generator=gen)
    out = case.decode(q, partition_size=64, **new)
    after_k = R.pool_with_new_rows(case.k_pool, KVPool(*kn), case.block_table, case.context_lens)
    after_v = R.pool_with_new_rows(case.v_pool, KVPool(*vn), case.block_table, case.context_lens)
    ref = R.paged_attention_ref(q, None, after_k, after_v, case.block_table, case.context_lens, case.fmt.k,
                                case.fmt.v, case.kp, case.vp)
    assert _rel_err(out, ref) < ATTN_RTOL
    # the same rows written by the append kernel into the pool (runtime path) give the same attention
    for which, rows, pool, params in (("k", k_rows, case.k_pool, case.kp), ("v", v_rows, case.v_pool, case.vp)):
        slots = torch.tensor([int(case.block_table[b, (c - 1) // 16]) * 16 + (c - 1) % 16 if c else -1
                              for b, c in enumerate(ctxs)])
        ops.launch_quantize_append(rows, slots, pool.data, pool.scale, pool.zero, case.layout.tensor_format(which),
                                   params.scale, params.smooth, params.clip, interpret=True)
    assert _rel_err(case.decode(q, partition_size=64), out) < ATTN_RTOL

    # prefill / chunked prefill: the last num_new positions come from the new rows
    num_new = [1, 5, 0, 100, 33]
    cu = torch.tensor([0] + list(torch.tensor(num_new).cumsum(0)), dtype=torch.int32)
    tq = int(cu[-1])
    kr, vr = torch.randn(tq, case.kvh, d, generator=gen), torch.randn(tq, case.kvh, d, generator=gen)
    kn, vn = _rows_form(case.fmt.k, kr, case.kp), _rows_form(case.fmt.v, vr, case.vp)
    new = dict(zip(new, kn + vn))
    qp = torch.randn(tq, case.heads, d, generator=gen)
    out = case.prefill(qp, cu, **new)
    after_k = R.pool_with_new_rows(case.k_pool, KVPool(*kn), case.block_table, case.context_lens, cu)
    after_v = R.pool_with_new_rows(case.v_pool, KVPool(*vn), case.block_table, case.context_lens, cu)
    ref = R.paged_attention_ref(qp, cu, after_k, after_v, case.block_table, case.context_lens, case.fmt.k,
                                case.fmt.v, case.kp, case.vp)
    assert _rel_err(out, ref) < ATTN_RTOL
    # the custom op's reference branch (no TRITON_INTERPRET) applies the same contract
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    via_op = torch.ops.trtkv.paged_prefill_attention(qp, cu, *case.pool_args(), case.block_table, case.context_lens,
                                                     *case.fmt_args(), **new)
    assert _rel_err(via_op, ref) < 1e-12


# ------------------------------------------------------------------------------------------------
# custom ops (dispatch, fake impls) and validation
# ------------------------------------------------------------------------------------------------


def test_custom_ops_dispatch_reference_and_interpreter(monkeypatch):
    case = Case("int4", 64, 3, [20, 0, 45], seed=21)
    q = torch.randn(3, case.heads, 64, generator=case.gen)
    args = (q, *case.pool_args(), case.block_table, case.context_lens, *case.fmt_args())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ref_path = torch.ops.trtkv.paged_decode_attention(*args)
    assert torch.equal(ref_path, case.reference(q))  # CPU without TRITON_INTERPRET: the torch reference
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kern_path = torch.ops.trtkv.paged_decode_attention(*args, partition_size=32)
    assert _rel_err(kern_path, ref_path) < ATTN_RTOL

    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    qp = torch.randn(9, case.heads, 64, generator=case.gen)
    pargs = (qp, cu, *case.pool_args(), case.block_table, case.context_lens, *case.fmt_args())
    a = torch.ops.trtkv.paged_prefill_attention(*pargs)
    monkeypatch.delenv("TRITON_INTERPRET")
    b = torch.ops.trtkv.paged_prefill_attention(*pargs)
    assert _rel_err(a, b) < ATTN_RTOL


@pytest.mark.parametrize("interpret", [False, True])
def test_append_kv_wrapper_through_custom_op(monkeypatch, interpret):
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fmt = get_format("int4")
    layout = PagedKVLayout(fmt, 2, 64, 16, 6)
    gen = torch.Generator().manual_seed(1)
    kp = TensorParams(smooth=torch.rand(2, 64, generator=gen) + 0.5)
    k, v = torch.randn(30, 2, 64, generator=gen).half(), torch.randn(30, 2, 64, generator=gen).half()
    slots = torch.randperm(96, generator=gen)[:30]
    ref_k, ref_v, out_k, out_v = (layout.allocate(w) for w in ("k", "v", "k", "v"))
    write_paged(layout, "k", ref_k, k, slots, kp)
    write_paged(layout, "v", ref_v, v, slots)
    ops.append_kv(layout, k, v, slots, out_k, out_v, kp, None)
    for a, b in ((ref_k, out_k), (ref_v, out_v)):
        assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)


def test_fake_impls_and_opcheck(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = Case("int8", 64, 2, [9, 3], seed=31, garbage=False)
    q = torch.randn(2, case.heads, 64, generator=case.gen)
    args = (q, *case.pool_args(), case.block_table, case.context_lens, *case.fmt_args())
    torch.library.opcheck(torch.ops.trtkv.paged_decode_attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    qp = torch.randn(3, case.heads, 64, generator=case.gen)
    torch.library.opcheck(torch.ops.trtkv.paged_prefill_attention.default,
                          (qp, cu, *case.pool_args(), case.block_table, case.context_lens, *case.fmt_args()),
                          test_utils=("test_schema", "test_faketensor"))
    rows = torch.randn(4, 2, 64)
    k = case.k_pool
    torch.library.opcheck(torch.ops.trtkv.quantize_append.default,
                          (rows, torch.tensor([0, 1, -1, 5]), k.data, k.scale, k.zero, "int8:token:sym"),
                          test_utils=("test_schema", "test_faketensor"))


def test_validation_errors():
    case = Case("int8", 64, 1, [5], seed=0, garbage=False)
    q = torch.randn(1, 2, 64)
    k_data, k_scale, k_zero, v_data, v_scale, v_zero = case.pool_args()
    with pytest.raises(TrtkvError):  # pool dtype does not match the format
        ops.launch_paged_decode(q, k_data.view(torch.uint8), k_scale, k_zero, v_data, v_scale, v_zero,
                                case.block_table, case.context_lens, "int8:token:sym", "int8:token:sym")
    with pytest.raises(TrtkvError):  # missing static scale
        ops.launch_paged_decode(q, k_data, None, None, v_data, v_scale, v_zero, case.block_table, case.context_lens,
                                "int8:tensor:sym", "int8:token:sym")
    with pytest.raises(TrtkvError):  # heads not a multiple of kv heads
        ops.launch_paged_decode(torch.randn(1, 3, 64), *case.pool_args(), case.block_table, case.context_lens,
                                "int8:token:sym", "int8:token:sym")
