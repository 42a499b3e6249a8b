"""Fused quantized-KV kernels in OpenAI Triton: block seal, paged decode (split-K) and prefill attention.

Everything here reads the cache layout of ``trtkv.cache_layout`` (docs/kv-cache-format.md) and reproduces
the math of ``trtkv.quant`` (see ``trtkv.plugins.reference`` for the torch definitions the tests hold these to):

    data  [num_blocks, kv_heads, block_size, packed_dim]   codes (the DTYPES storage dtype of the format)
    scale [num_blocks, kv_heads, block_size, groups]       fp16, per-token dynamic formats
          [num_blocks, kv_heads, head_dim]                 fp16, per_block_channel (BCH) formats
    zero  same as scale                                    fp16, asymmetric dynamic formats
    tail  [num_slots, kv_heads, block_size + sink_tokens, head_dim]   fp16, the open blocks (model channel
          space), then the sink rows: a sequence's first sink_tokens tokens once its first block is sealed
    row of (block, head, offset) = (block * kv_heads + head) * block_size + offset

* ``seal_kernel`` quantizes whole blocks (``trtkv.quant.quantize_block``): the only way the pool is written.
* The attention kernels read, for a new token at position ``context_len + t``: the sealed blocks
  (``context_len // block_size`` of them, through the block table), the open block's
  ``context_len % block_size`` rows from ``tail[slot]`` and this step's rows ``0 .. t`` (fp16, model space);
  once a block is sealed, positions ``< sink_tokens`` come from the slot's sink rows instead of the pool.
  Sealed K / V are in the stored channel space (smoothed, rotated, static-scaled); the query is moved into
  it (``_load_query``) and the output out of it (``_store_output``). Open-block and new rows are moved into
  it on load (``_load_open``), so one query and one accumulator serve every key.
* Sliding windows and soft-capping are runtime arguments of both attention kernels (``window``, ``softcap``; 0 =
  none), their code compiled in only under the constexpr flags ``WINDOW`` / ``SOFTCAP`` (the configs' ``window`` /
  ``softcap``: kernels without them keep their registers, see aot.py): a query at position p sees keys at
  positions ``> p - window`` only, and every loop of ``_attend_cache`` starts at the lowest position the
  program's queries see, so sealed blocks (and block-table entries) before the window's first block are never
  loaded -- a window ring's logical table may name overwritten blocks there. A
  split-K partition wholly before the window writes the empty state (m = -inf, l = 0, acc = 0). ``_softcap``
  caps the natural-scale score, ``cap * tanh(x / cap)``, on the log2-domain scores (tanh from ``exp2``, stable
  for any magnitude) before the causal / window mask, as transformers does.

A stored tensor format enters a kernel as constexprs (``format_constexprs``): ``DTYPE`` one of "fp16",
"int8", "int4", "int3", "int2", "fp8_e4m3"; ``STATIC``; ``SYM``; ``GS`` the dynamic group size (head_dim for per-token);
``BCH`` per-block-channel scales; the transform flags; and the code range read from
``trtkv.formats.DTYPES`` (``QMIN`` / ``QMAX`` / ``QMAX_ASYM``, ``CODE_OFFSET``). Codes are stored in the
element type of the data pointer, so the storage dtype is never restated here. Static scales (per tensor,
per head or per channel) always arrive expanded to a ``[kv_heads, head_dim]`` float32 tensor. Launch
grids are ``trtkv.plugins.contract``'s (``seal_grid``, ``decode_grids``, ``prefill_grid``).

Channel halves. Every attention kernel works on the even and odd channels of head_dim separately
(``lo`` = channels 0, 2, 4, ..., ``hi`` = 1, 3, 5, ...): packed int4 bytes hold exactly that pair, so
unpacking costs two bit operations and no register shuffle (int2: a byte holds two such pairs, at bits 0 / 2
and 4 / 6; int3: the same low-bit plane plus a top-bit plane of D/8 bytes, docs/kv-cache-format.md);
the dot products are split in two
(``q_lo . k_lo + q_hi . k_hi``; ``p @ v_lo`` and ``p @ v_hi`` write the even and odd output channels).

Portability: only ``tl`` API present in triton 3.6 and 3.7. No libdevice (not in the interpreter):
round-half-to-even is ``_rint`` (floor based, exact for |x| < 2**23); fp8 e4m3 encode/decode are
bit manipulations (so they also compile for sm_80, which has no fp8 conversion instructions, and
run in the interpreter). Divisions that feed codes use ``tl.div_rn`` (IEEE, like torch on CPU);
plain ``/`` lowers to an approximate divide on NVIDIA GPUs.

This module is loaded twice by ``load_kernels``: once normally (``triton.jit`` → compiled GPU
kernels, AOT) and once as an interpreter copy for CPU tensors, independent of when
``TRITON_INTERPRET`` was set relative to the first import of triton.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import triton
import triton.language as tl

from trtkv.errors import TrtkvError
from trtkv.plugins import contract as _C
from trtkv.plugins.contract.capabilities import LACKS_HINT, kernel_refusal

LOG2E = 1.4426950408889634



# --------------------------------------------------------------------------------------------
# scalar helpers
# --------------------------------------------------------------------------------------------


# Reductions call tl.reduce with triton.language.standard's own combine functions -- exactly what
# tl.max / tl.min / tl.sum do -- instead of those @jit wrappers (and tl.zeros / tl.cdiv, also @jit in
# triton.language.standard): the standard library is interpreted only if TRITON_INTERPRET was set
# before triton was first imported, while this module's interpreter copy must work either way. The
# interpreter recognizes these combine functions and reduces with numpy.


@triton.jit
def _rmax(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def _rmin(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_min)


@triton.jit
def _rsum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _rint(x):
    """Round half to even (torch.round) for |x| < 2**23; every step is exact in fp32."""
    f = tl.floor(x)
    d = x - f
    half_f = f * 0.5
    odd = tl.floor(half_f) != half_f
    up = (d > 0.5) | ((d == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _fp16_round(x, FMAX: tl.constexpr):
    """The fp32 value an fp16 scale slot stores: clamp to the finite range ``FMAX`` (DTYPES["fp16"]), round to
    nearest even. Without the clamp a range above 65504 would store an infinite scale."""
    return tl.minimum(tl.maximum(x, -FMAX), FMAX).to(tl.float16).to(tl.float32)


@triton.jit
def _fp8e4m3_encode(y):
    """fp32 (already clamped to [-448, 448]) -> e4m3fn bit pattern, round to nearest even (== torch cast)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(y)
    sub = _rint(a * 512.0).to(tl.int32)  # |y| < 2**-6: multiples of 2**-9; 8 is the smallest normal (code 8)
    ab = a.to(tl.int32, bitcast=True)
    rnd = ab + 0x7FFFF + ((ab >> 20) & 1)  # round the fp32 mantissa to 3 bits, ties to even
    e = (rnd >> 23) - 120  # rebias 127 -> 7
    m = (rnd >> 20) & 7
    code = tl.where(a < 0.015625, sub, (e << 3) | m)
    return (code | sign).to(tl.uint8)


@triton.jit
def _fp8e4m3_decode(c):
    """e4m3fn bit pattern (uint8) -> fp32, exact: shift into an fp16 pattern, rescale by 2**8."""
    h = c.to(tl.int32)
    h = ((h & 0x7F) << 7) | ((h & 0x80) << 8)
    return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _codes_to_float(c, DTYPE: tl.constexpr):
    if DTYPE == "fp8_e4m3":
        return _fp8e4m3_decode(c)
    else:
        return c.to(tl.float32)


@triton.jit
def _pack_plane(bits, N: tl.constexpr, NBYTES: tl.constexpr, PER: tl.constexpr, WIDTH: tl.constexpr):
    """Fields [N, NBYTES * PER] int32 (each < 2**WIDTH) -> bytes [N, NBYTES] uint8: byte j = sum_i
    field[PER * j + i] << (WIDTH * i) (the fields' bits are disjoint, so the sum is their bitwise or)."""
    sh = tl.arange(0, PER) * WIDTH
    f = tl.reshape(bits, [N, NBYTES, PER]) << sh[None, None, :]
    return _rsum(f, 2).to(tl.uint8)


@triton.jit
def _unpack_halves(b, SHIFT: tl.constexpr, PER: tl.constexpr, WIDTH: tl.constexpr, N: tl.constexpr,
                   HALF: tl.constexpr):
    """Bytes [N, HALF // PER] (int32) holding 2 * PER fields of WIDTH bits each (field c at bit WIDTH * c)
    -> the fields of the even (SHIFT 0) or odd (SHIFT WIDTH) channels, [N, HALF] int32: even channel
    2i sits in byte i // PER at bit 2 * WIDTH * (i % PER), the odd one WIDTH bits above."""
    sh = tl.arange(0, PER) * (2 * WIDTH) + SHIFT
    f = (b[:, :, None] >> sh[None, None, :]) & ((1 << WIDTH) - 1)
    return tl.reshape(f, [N, HALF])


# --------------------------------------------------------------------------------------------
# 1. seal: quantize whole blocks
# --------------------------------------------------------------------------------------------


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _count(m):
    return _rsum(_rsum(m.to(tl.int32), 1), 0)


OUTLIER_ROWS = tl.constexpr(16)  # rows of a block the outlier selection reads at a time


@triton.jit
def _outlier_bits(x, centre, unit, SYM: tl.constexpr, BCH: tl.constexpr, GS: tl.constexpr):
    """Outlier scores of rows ``x`` [R, D] as int32 bit patterns (monotone: the scores are >= 0): the distance from
    the group's centre (``quant._deviation``): the channel's block mean ``centre`` [D] (BCH; times ``unit`` [D], an
    allocB channel's 2^-width, else 1: exact powers of two), the row group's mean (per token / group), or 0
    (symmetric and static)."""
    R: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    if SYM:
        score = tl.abs(x)
    elif BCH:
        score = tl.abs(x - centre[None, :]) * unit[None, :]
    else:
        xg = tl.reshape(x, [R, D // GS, GS])
        score = tl.reshape(tl.abs(xg - (_rsum(xg, 2) / GS)[:, :, None]), [R, D])
    return score.to(tl.int32, bitcast=True)


@triton.jit
def _outlier_threshold(xs, centre, unit, NOUT: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, SYM: tl.constexpr,
                       BCH: tl.constexpr, GS: tl.constexpr):
    """Where a block's ``NOUT`` outliers end (``trtkv.quant.block_outliers``: a stable descending sort on the score,
    ties to the lower flat position), without a sort: ``(thr, last)`` -- the NOUT-th largest score's bit pattern
    (bisection, 31 counting passes over the block in scratch ``xs``), and the flat position of the last kept element
    equal to it (bisection, 16 passes). An element is an outlier when its score's bits exceed ``thr``, or equal it at
    a flat position ``<= last``."""
    r = tl.arange(0, OUTLIER_ROWS)
    c = tl.arange(0, D)
    lo = tl.full([1], 0, tl.int32)  # count(bits >= lo) >= NOUT
    hi = tl.full([1], 0x7F800001, tl.int32)  # count(bits >= hi) < NOUT (above +inf)
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        cnt = tl.full([1], 0, tl.int32)
        for r0 in range(0, BS, OUTLIER_ROWS):
            bits = _outlier_bits(tl.load(xs + (r0 + r)[:, None] * D + c[None, :]), centre, unit, SYM, BCH, GS)
            cnt += _count(bits >= mid[:, None])
        take = cnt >= NOUT
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid)
    above = tl.full([1], 0, tl.int32)
    for r0 in range(0, BS, OUTLIER_ROWS):
        above += _count(_outlier_bits(tl.load(xs + (r0 + r)[:, None] * D + c[None, :]), centre, unit, SYM, BCH, GS) > lo[:, None])
    need = NOUT - above  # >= 1 of the elements equal to the threshold are kept, lowest positions first
    f_lo = tl.full([1], -1, tl.int32)  # count(equal & flat <= f_lo) < need
    f_hi = tl.full([1], BS * D - 1, tl.int32)  # count(equal & flat <= f_hi) >= need
    for _ in range(16):  # BS * D <= 2**15 (int16 positions, formats.MAX_OUTLIER_POSITIONS)
        mid = f_lo + (f_hi - f_lo) // 2
        cnt = tl.full([1], 0, tl.int32)
        for r0 in range(0, BS, OUTLIER_ROWS):
            bits = _outlier_bits(tl.load(xs + (r0 + r)[:, None] * D + c[None, :]), centre, unit, SYM, BCH, GS)
            flat = (r0 + r)[:, None] * D + c[None, :]
            cnt += _count((bits == lo[:, None]) & (flat <= mid[:, None]))
        enough = cnt >= need
        f_lo = tl.where(enough, f_lo, mid)
        f_hi = tl.where(enough, mid, f_hi)
    return lo, f_hi


@triton.jit
def _is_outlier(x, centre, unit, thr, last, rows, cols, SYM: tl.constexpr, BCH: tl.constexpr, GS: tl.constexpr):
    """Which elements of rows ``x`` [R, D] (block rows ``rows``, channels ``cols``) are outliers (``_outlier_threshold``)."""
    bits = _outlier_bits(x, centre, unit, SYM, BCH, GS)
    flat = rows[:, None] * x.shape[1] + cols[None, :]
    return (bits > thr[:, None]) | ((bits == thr[:, None]) & (flat <= last[:, None]))


@triton.jit
def _store_outliers(xs, centre, unit, thr, last, oidx_ptr, oval_ptr, BS: tl.constexpr, D: tl.constexpr, SYM: tl.constexpr,
                    BCH: tl.constexpr, GS: tl.constexpr, SCALE_MAX: tl.constexpr):
    """Write a block's outlier list -- positions ``row * D + channel`` ascending (int16), values fp16 -- streaming the
    block from scratch ``xs`` in chunks of rows: each outlier's place is the count of outliers before it."""
    r = tl.arange(0, OUTLIER_ROWS)
    c = tl.arange(0, D)
    done = tl.full([1], 0, tl.int32)
    for r0 in range(0, BS, OUTLIER_ROWS):
        x = tl.load(xs + (r0 + r)[:, None] * D + c[None, :])
        m = _is_outlier(x, centre, unit, thr, last, r0 + r, c, SYM, BCH, GS)
        mi = m.to(tl.int32)
        within = tl.associative_scan(mi, 1, _add) - mi
        per_row = _rsum(mi, 1)
        place = done[:, None] + (tl.associative_scan(per_row, 0, _add) - per_row)[:, None] + within
        tl.store(oidx_ptr + place, ((r0 + r)[:, None] * D + c[None, :]).to(tl.int16), mask=m)
        tl.store(oval_ptr + place, _fp16_round(x, SCALE_MAX).to(tl.float16), mask=m)
        done += _count(m)


@triton.jit
def _nearest_level(u, cb_ptr, h, LEVELS: tl.constexpr):
    """Index of the codebook level nearest each ``u`` (code units): the count of midpoints between neighbouring levels
    below it, a tie to the lower level (``trtkv.quant.nearest_level``)."""
    q = tl.where(u == u, 0.0, 0.0)
    for lv in tl.static_range(LEVELS - 1):
        mid = (tl.load(cb_ptr + h * LEVELS + lv) + tl.load(cb_ptr + h * LEVELS + lv + 1)) * 0.5
        q = q + tl.where(u > mid, 1.0, 0.0)
    return q


@triton.jit
def _aside(v, sel, fill, OUT: tl.constexpr):
    """``v`` with the outliers ``sel`` replaced by ``fill`` (they set no range); ``v`` itself without outliers."""
    if OUT > 0:
        return tl.where(sel, fill, v)
    else:
        return v


@triton.jit
def _unrope(x_ptr, src, kk, pos, cos_ptr, sin_ptr, HEAD_DIM: tl.constexpr):
    """Input channels ``kk`` of rows at ``src`` (model space, after RoPE) with RoPE undone at the rows' positions ``pos``
    [R]: ``(x cos - rotate_half(x) sin) / (cos^2 + sin^2)`` (``trtkv.rope.rotate(..., inverse=True)``)."""
    partner = (kk + HEAD_DIM // 2) % HEAD_DIM
    sign = tl.where(kk < HEAD_DIM // 2, -1.0, 1.0)[None, :]
    x = tl.load(x_ptr + src[:, None] + kk[None, :]).to(tl.float32)
    xr = tl.load(x_ptr + src[:, None] + partner[None, :]).to(tl.float32) * sign
    tp = pos.to(tl.int64)[:, None] * HEAD_DIM + kk[None, :]
    c = tl.load(cos_ptr + tp)
    sn = tl.load(sin_ptr + tp)
    return tl.div_rn(x * c - xr * sn, c * c + sn * sn)


@triton.jit
def _seal_channels(x, sel, meta, data_ptr, scale_ptr, zero_ptr, rows, sptr, BLOCK_SIZE: tl.constexpr, OUT: tl.constexpr,
                   RB: tl.constexpr, RBP: tl.constexpr, SCALE_MAX: tl.constexpr):
    """An ``allocB`` block ``x`` [BLOCK_SIZE, D] (outliers ``sel`` set aside) at the widths of the channel table's row
    ``meta`` [D] (``quant.channel_codes``): per channel an fp16 minimum and step over its 2^width - 1 codes (the
    outliers set no range and no mean; a 0-width channel stores step 0 and its mean as the minimum); then rows of RB
    bytes packed at each channel's bit offset (``formats.pack_channel_codes``) by two one-hot products, low and high
    byte of each shifted code: fp16 integers below 256 whose bits never overlap within a byte, so the sums are exact."""
    width = meta >> 16
    top = ((1 << width) - 1).to(tl.float32)
    if OUT > 0:
        keep = tl.where(sel, 0.0, 1.0)
    else:
        keep = tl.full(x.shape, 1.0, tl.float32)
    n = _rsum(keep, 0)
    mn = _rmin(_aside(x, sel, float("inf"), OUT), 0)
    mx = _rmax(_aside(x, sel, float("-inf"), OUT), 0)
    mn = tl.where(n > 0, mn, 0.0)
    mx = tl.where(n > 0, mx, 0.0)
    mean = tl.div_rn(_rsum(x * keep, 0), tl.maximum(n, 1.0))
    zero = _fp16_round(tl.where(width > 0, mn, mean), SCALE_MAX)
    scale = _fp16_round(tl.where(width > 0, tl.div_rn(mx - mn, tl.maximum(top, 1.0)), 0.0), SCALE_MAX)
    inv = tl.where(scale > 0, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), tl.where(scale > 0, scale, 1.0)), 0.0)
    q = tl.minimum(tl.maximum(_rint((x - zero[None, :]) * inv[None, :]), 0.0), top[None, :]).to(tl.int32)
    tl.store(scale_ptr + sptr, scale.to(tl.float16))
    tl.store(zero_ptr + sptr, zero.to(tl.float16))
    off = meta & 0xFFFF
    shifted = q << (off & 7)[None, :]  # at most 15 bits: the code's byte and the next
    k = tl.arange(0, RBP)
    byte = off >> 3
    onto_lo = (byte[:, None] == k[None, :]).to(tl.float16)  # [D, RBP]
    onto_hi = ((byte + 1)[:, None] == k[None, :]).to(tl.float16)
    packed = tl.dot((shifted & 255).to(tl.float16), onto_lo) + tl.dot((shifted >> 8).to(tl.float16), onto_hi)
    tl.store(data_ptr + rows[:, None] * RB + k[None, :], packed.to(tl.int32).to(tl.uint8), mask=(k < RB)[None, :])


@triton.jit
def seal_kernel(
    x_ptr,  # [n, kv_heads, BLOCK_SIZE, head_dim] fp16 / bf16 / fp32, contiguous: the open blocks to seal
    data_ptr,  # [n, kv_heads, BLOCK_SIZE, packed_dim] codes (the pool's storage dtype: stores convert to it)
    scale_ptr,  # per-token [n, kv_heads, BLOCK_SIZE, groups] / BCH [n, kv_heads, head_dim] fp16 (dynamic; else dummy)
    zero_ptr,  # same, asymmetric dynamic only (else dummy)
    static_scale_ptr,  # [kv_heads, head_dim] fp32 (STATIC; else dummy)
    smooth_ptr,  # [kv_heads, head_dim] fp32 (SMOOTH; else dummy)
    clip_ptr,  # [kv_heads] fp32 range multiplier (dynamic; else dummy)
    had_ptr,  # [head_dim, head_dim] fp32 Hadamard (HAD; else dummy)
    cb_ptr,  # [kv_heads, LEVELS] fp32 codebook (LEVELS; else dummy or constexpr None)
    oidx_ptr, oval_ptr,  # [n, kv_heads, OUT] int16 / fp16 outlier lists written (OUT; else dummies)
    pos_ptr,  # [n] int32: each block's first position (PRE; else dummy)
    rope_cos_ptr, rope_sin_ptr,  # [P, head_dim] fp32 RoPE table (PRE; else dummies)
    scratch_ptr,  # [n, kv_heads, BLOCK_SIZE, head_dim] fp32 the transformed block while its outliers are chosen (OUT)
    chan_ptr,  # [kv_heads, head_dim] int32 channel table (RB: bit offset | width << 16; else dummy or constexpr None)
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DTYPE: tl.constexpr,
    STATIC: tl.constexpr,
    SYM: tl.constexpr,
    GS: tl.constexpr,
    BCH: tl.constexpr,
    SMOOTH: tl.constexpr,
    HAD: tl.constexpr,
    QMIN: tl.constexpr,  # symmetric code range (trtkv.formats.DTYPES sym_min / sym_max)
    QMAX: tl.constexpr,
    QMAX_ASYM: tl.constexpr,  # asymmetric codes 0 .. QMAX_ASYM (DTYPES asym_max)
    CODE_OFFSET: tl.constexpr,  # added to symmetric codes stored unsigned (packed int4: 8)
    SCALE_MAX: tl.constexpr,  # largest finite scale / zero-point (fp16: DTYPES["fp16"].sym_max)
    HAD_CHUNK: tl.constexpr = 32,
    LEVELS: tl.constexpr = 0,  # nuq: codes are the nearest of LEVELS codebook levels
    OUT: tl.constexpr = 0,  # outN: OUT elements per block-head set aside (no range), kept as fp16 with positions
    PRE: tl.constexpr = False,  # keys stored before RoPE: RoPE undone at the rows' positions first
    RB: tl.constexpr = 0,  # allocB: bytes per row, each channel its own code width (0: none)
    RBP: tl.constexpr = 16,  # RB rounded up to a power of two >= 16 (the packing product's width)
):
    """grid = contract.seal_grid(n, kv_heads): one program quantizes one block of one KV head as
    ``trtkv.quant.quantize_block`` does -- per token (GS channels per scale) or, BCH, one scale and
    zero-point per channel over the block's tokens, RB: at each channel's own width (``_seal_channels``) -- and writes
    it in pool-block form (with its outlier list)."""
    blk = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.arange(0, BLOCK_SIZE)
    cols = tl.arange(0, HEAD_DIM)
    bh = blk.to(tl.int64) * num_kv_heads + h
    rows = bh * BLOCK_SIZE + t  # input rows and output rows alike
    src = rows * HEAD_DIM
    if PRE:
        pos = tl.load(pos_ptr + blk) + t
    if DTYPE == "fp16":
        x = tl.load(x_ptr + src[:, None] + cols[None, :])
        tl.store(data_ptr + src[:, None] + cols[None, :], x.to(tl.float16))
    else:
        if HAD:
            # x @ H accumulated over HAD_CHUNK input channels: registers hold a [HAD_CHUNK, HEAD_DIM] slice of H
            x = tl.full([BLOCK_SIZE, HEAD_DIM], 0.0, tl.float32)
            for c0 in tl.range(0, HEAD_DIM, HAD_CHUNK, num_stages=1):  # no multi-buffered slices
                kk = c0 + tl.arange(0, HAD_CHUNK)
                if PRE:
                    xc = _unrope(x_ptr, src, kk, pos, rope_cos_ptr, rope_sin_ptr, HEAD_DIM)
                else:
                    xc = tl.load(x_ptr + src[:, None] + kk[None, :]).to(tl.float32)
                if SMOOTH:
                    xc = tl.div_rn(xc, tl.load(smooth_ptr + h * HEAD_DIM + kk)[None, :])
                hm = tl.load(had_ptr + kk[:, None] * HEAD_DIM + cols[None, :])
                x = tl.dot(xc, hm, x, input_precision="ieee")
        else:
            if PRE:
                x = _unrope(x_ptr, src, cols, pos, rope_cos_ptr, rope_sin_ptr, HEAD_DIM)
            else:
                x = tl.load(x_ptr + src[:, None] + cols[None, :]).to(tl.float32)
            if SMOOTH:
                x = tl.div_rn(x, tl.load(smooth_ptr + h * HEAD_DIM + cols)[None, :])

        if RB > 0:  # scores in units of each channel's levels
            meta = tl.load(chan_ptr + h * HEAD_DIM + cols)
            unit = ((127 - (meta >> 16)) << 23).to(tl.float32, bitcast=True)  # 2^-width, exactly
        else:
            meta = cols
            unit = tl.full([HEAD_DIM], 1.0, tl.float32)
        if OUT > 0:
            # the block-head's OUT elements farthest from their group's centre (``quant._deviation``) set no range.
            # The block waits in global scratch and the selection streams it in chunks of rows: the whole block
            # in registers beside its scores spills hundreds of bytes at 128 x 128.
            xs = scratch_ptr + bh * (BLOCK_SIZE * HEAD_DIM)
            tl.store(xs + t[:, None] * HEAD_DIM + cols[None, :], x)
            centre = _rsum(x, 0) / BLOCK_SIZE  # per channel (BCH, asymmetric)
            tl.debug_barrier()
            thr, last = _outlier_threshold(xs, centre, unit, OUT, BLOCK_SIZE, HEAD_DIM, SYM or STATIC, BCH, GS)
            sel = _is_outlier(x, centre, unit, thr, last, t, cols, SYM or STATIC, BCH, GS)
            _store_outliers(xs, centre, unit, thr, last, oidx_ptr + bh * OUT, oval_ptr + bh * OUT, BLOCK_SIZE, HEAD_DIM,
                            SYM or STATIC, BCH, GS, SCALE_MAX)
        else:
            sel = x  # unused: _aside keeps every element

        if RB > 0:
            _seal_channels(x, sel, meta, data_ptr, scale_ptr, zero_ptr, rows, bh * HEAD_DIM + cols, BLOCK_SIZE, OUT, RB,
                           RBP, SCALE_MAX)
        else:
            if STATIC:
                sc = tl.load(static_scale_ptr + h * HEAD_DIM + cols)
                inv = tl.where(sc > 0, tl.div_rn(tl.full([HEAD_DIM], 1.0, tl.float32), tl.where(sc > 0, sc, 1.0)), 0.0)
                y = tl.minimum(tl.maximum(x * inv[None, :], QMIN), QMAX)
            elif BCH:
                # one scale (and zero-point) per channel over the block's tokens (axis 0)
                clip = tl.load(clip_ptr + h)
                sptr = bh * HEAD_DIM + cols
                if SYM:
                    amax = _rmax(_aside(tl.abs(x), sel, 0.0, OUT), 0)
                    scale = _fp16_round(tl.div_rn(amax * clip, tl.full([HEAD_DIM], QMAX, tl.float32)), SCALE_MAX)
                    inv = tl.where(scale > 0, tl.div_rn(tl.full([HEAD_DIM], 1.0, tl.float32), tl.where(scale > 0, scale, 1.0)), 0.0)
                    u = x * inv[None, :]
                    y = tl.minimum(tl.maximum(u, QMIN), QMAX)
                else:
                    mn = _rmin(_aside(x, sel, float("inf"), OUT), 0)
                    mx = _rmax(_aside(x, sel, float("-inf"), OUT), 0)
                    if OUT > 0:  # a channel of outliers only has no range: zero 0, scale 0
                        empty = mn == float("inf")
                        mn = tl.where(empty, 0.0, mn)
                        mx = tl.where(empty, 0.0, mx)
                    rng = mx - mn
                    zero = _fp16_round(mn + rng * (1.0 - clip) * 0.5, SCALE_MAX)
                    scale = _fp16_round(tl.div_rn(rng * clip, tl.full([HEAD_DIM], QMAX_ASYM, tl.float32)), SCALE_MAX)
                    inv = tl.where(scale > 0, tl.div_rn(tl.full([HEAD_DIM], 1.0, tl.float32), tl.where(scale > 0, scale, 1.0)), 0.0)
                    u = (x - zero[None, :]) * inv[None, :]
                    y = tl.minimum(tl.maximum(u, 0.0), QMAX_ASYM)
                    tl.store(zero_ptr + sptr, zero.to(tl.float16))
                if LEVELS > 0:
                    y = _nearest_level(u, cb_ptr, h, LEVELS)
                tl.store(scale_ptr + sptr, scale.to(tl.float16))
            else:
                G: tl.constexpr = HEAD_DIM // GS
                xg = tl.reshape(x, [BLOCK_SIZE, G, GS])
                selg = tl.reshape(sel, [BLOCK_SIZE, G, GS])
                clip = tl.load(clip_ptr + h)
                g_off = tl.arange(0, G)
                sptr = rows[:, None] * G + g_off[None, :]
                if SYM:
                    amax = _rmax(_aside(tl.abs(xg), selg, 0.0, OUT), 2)
                    scale = _fp16_round(tl.div_rn(amax * clip, tl.full([BLOCK_SIZE, G], QMAX, tl.float32)), SCALE_MAX)
                    inv = tl.where(scale > 0, tl.div_rn(tl.full([BLOCK_SIZE, G], 1.0, tl.float32), tl.where(scale > 0, scale, 1.0)), 0.0)
                    ug = xg * inv[:, :, None]
                    yg = tl.minimum(tl.maximum(ug, QMIN), QMAX)
                else:
                    mn = _rmin(_aside(xg, selg, float("inf"), OUT), 2)
                    mx = _rmax(_aside(xg, selg, float("-inf"), OUT), 2)
                    if OUT > 0:
                        empty = mn == float("inf")
                        mn = tl.where(empty, 0.0, mn)
                        mx = tl.where(empty, 0.0, mx)
                    rng = mx - mn
                    # trtkv.quant: zero = fp16(mn + rng * (1 - clip) / 2) (== fp16(mn) unclipped), scale = fp16(rng * clip / qmax)
                    zero = _fp16_round(mn + rng * (1.0 - clip) * 0.5, SCALE_MAX)
                    scale = _fp16_round(tl.div_rn(rng * clip, tl.full([BLOCK_SIZE, G], QMAX_ASYM, tl.float32)), SCALE_MAX)
                    inv = tl.where(scale > 0, tl.div_rn(tl.full([BLOCK_SIZE, G], 1.0, tl.float32), tl.where(scale > 0, scale, 1.0)), 0.0)
                    ug = (xg - zero[:, :, None]) * inv[:, :, None]
                    yg = tl.minimum(tl.maximum(ug, 0.0), QMAX_ASYM)
                    tl.store(zero_ptr + sptr, zero.to(tl.float16))
                if LEVELS > 0:
                    yg = _nearest_level(ug, cb_ptr, h, LEVELS)
                tl.store(scale_ptr + sptr, scale.to(tl.float16))
                y = tl.reshape(yg, [BLOCK_SIZE, HEAD_DIM])

            if DTYPE == "fp8_e4m3":
                tl.store(data_ptr + src[:, None] + cols[None, :], _fp8e4m3_encode(y))
            elif DTYPE == "int8":
                q = _rint(y).to(tl.int32)
                tl.store(data_ptr + src[:, None] + cols[None, :], q.to(data_ptr.dtype.element_ty))
            else:
                q = _rint(y).to(tl.int32)
                if SYM or STATIC:
                    q = q + CODE_OFFSET
                if DTYPE == "int4":
                    lo, hi = tl.split(tl.reshape(q, [BLOCK_SIZE, HEAD_DIM // 2, 2]))
                    packed = (lo | (hi << 4)).to(tl.uint8)
                    pcols = tl.arange(0, HEAD_DIM // 2)
                    tl.store(data_ptr + rows[:, None] * (HEAD_DIM // 2) + pcols[None, :], packed)
                elif DTYPE == "int2":
                    # byte j = sum_i code[4j + i] << 2i
                    pcols = tl.arange(0, HEAD_DIM // 4)
                    tl.store(data_ptr + rows[:, None] * (HEAD_DIM // 4) + pcols[None, :],
                             _pack_plane(q, BLOCK_SIZE, HEAD_DIM // 4, 4, 2))
                else:  # int3: the low two bits (plane of D/4 bytes as int2's), then the top bits (D/8 bytes, 8 per byte)
                    PACKED: tl.constexpr = HEAD_DIM * 3 // 8
                    pcols = tl.arange(0, HEAD_DIM // 4)
                    tl.store(data_ptr + rows[:, None] * PACKED + pcols[None, :],
                             _pack_plane(q & 3, BLOCK_SIZE, HEAD_DIM // 4, 4, 2))
                    tcols = tl.arange(0, HEAD_DIM // 8)
                    tl.store(data_ptr + rows[:, None] * PACKED + HEAD_DIM // 4 + tcols[None, :],
                             _pack_plane(q >> 2, BLOCK_SIZE, HEAD_DIM // 8, 8, 1))


# --------------------------------------------------------------------------------------------
# 2./3. attention over sealed blocks, the open block and this step's rows (shared pieces)
# --------------------------------------------------------------------------------------------


@triton.jit
def _channel_codes(data_ptr, row, m2, meta, RB: tl.constexpr):
    """``allocB`` rows of RB bytes: the codes of channels ``meta`` [HALF] (int32, bit offset | width << 16:
    ``ops._channel_table``) in rows ``row`` [N], as float32 [N, HALF] -- each from its byte and the next (the row's
    last byte standing in past it: a code that starts there ends there), shifted and masked to its width (0: no code)."""
    off = meta & 0xFFFF
    byte = off >> 3
    base = row[:, None] * RB
    b0 = tl.load(data_ptr + base + byte[None, :], mask=m2, other=0).to(tl.int32)
    b1 = tl.load(data_ptr + base + tl.minimum(byte + 1, RB - 1)[None, :], mask=m2, other=0).to(tl.int32)
    pair = b0 | (b1 << 8)
    return ((pair >> (off & 7)[None, :]) & ((1 << (meta >> 16)) - 1)[None, :]).to(tl.float32)


@triton.jit
def _load_halves(data_ptr, scale_ptr, zero_ptr, row, bh, mask,
                 HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr, STATIC: tl.constexpr, SYM: tl.constexpr,
                 GS: tl.constexpr, BCH: tl.constexpr, CODE_OFFSET: tl.constexpr, cb_ptr, kvh, LEVELS: tl.constexpr,
                 chan_ptr, RB: tl.constexpr):
    """Even / odd channels of sealed pool rows ``row`` [N] (block-head index ``bh`` [N]) as fp32
    [N, HEAD_DIM//2], dynamic scales applied (static scales are folded into the query / output by the
    callers). Rows are read contiguously (vectorized) and split in registers. ``LEVELS`` > 0 (``nuq``): a code
    is an index into KV head ``kvh``'s row of the codebook ``cb_ptr`` [kv_heads, LEVELS] (the level, in code
    units, replaces the code's own value; no offset). ``RB`` > 0 (``allocB``): rows of RB bytes whose channels have
    their own widths, KV head ``kvh``'s row of the channel table ``chan_ptr`` [kv_heads, HEAD_DIM] (``_channel_codes``);
    their scales are per block and channel (BCH, asymmetric)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    m2 = mask[:, None]
    N: tl.constexpr = row.shape[0]
    j = tl.arange(0, HALF)
    if RB > 0:
        lo = _channel_codes(data_ptr, row, m2, tl.load(chan_ptr + kvh * HEAD_DIM + 2 * j), RB)
        hi = _channel_codes(data_ptr, row, m2, tl.load(chan_ptr + kvh * HEAD_DIM + 2 * j + 1), RB)
    elif DTYPE == "int4" or DTYPE == "int2" or DTYPE == "int3":
        if DTYPE == "int4":
            b = tl.load(data_ptr + row[:, None] * HALF + j[None, :], mask=m2, other=0).to(tl.int32)
            lo_c = b & 15
            hi_c = b >> 4
        else:
            # low two bits: byte i // 2 of the row holds channels 2i, 2i+1 at bits 4 (i % 2) and 4 (i % 2) + 2
            PACKED: tl.constexpr = HEAD_DIM // 4 if DTYPE == "int2" else HEAD_DIM * 3 // 8
            jb = tl.arange(0, HEAD_DIM // 4)
            b = tl.load(data_ptr + row[:, None] * PACKED + jb[None, :], mask=m2, other=0).to(tl.int32)
            lo_c = _unpack_halves(b, 0, 2, 2, N, HALF)
            hi_c = _unpack_halves(b, 2, 2, 2, N, HALF)
            if DTYPE == "int3":
                # top bit: byte D/4 + i // 4 holds channels 2i, 2i+1 at bits 2 (i % 4) and 2 (i % 4) + 1
                jt = tl.arange(0, HEAD_DIM // 8)
                t = tl.load(data_ptr + row[:, None] * PACKED + HEAD_DIM // 4 + jt[None, :], mask=m2, other=0).to(tl.int32)
                lo_c = lo_c | (_unpack_halves(t, 0, 4, 1, N, HALF) << 2)
                hi_c = hi_c | (_unpack_halves(t, 1, 4, 1, N, HALF) << 2)
        if LEVELS > 0:  # nuq: a table lookup (the codebook is a few floats per head: cached)
            lo = tl.load(cb_ptr + kvh * LEVELS + lo_c)
            hi = tl.load(cb_ptr + kvh * LEVELS + hi_c)
        else:
            lo = lo_c.to(tl.float32)
            hi = hi_c.to(tl.float32)
            if SYM or STATIC:
                lo = lo - CODE_OFFSET
                hi = hi - CODE_OFFSET
    else:
        cols = tl.arange(0, HEAD_DIM)
        c = _codes_to_float(tl.load(data_ptr + row[:, None] * HEAD_DIM + cols[None, :], mask=m2, other=0), DTYPE)
        lo, hi = tl.split(tl.reshape(c, [N, HALF, 2]))
    if DTYPE != "fp16":
        if BCH:
            sp = bh[:, None] * HEAD_DIM + 2 * j[None, :]
            lo = lo * tl.load(scale_ptr + sp, mask=m2, other=0.0).to(tl.float32)
            hi = hi * tl.load(scale_ptr + sp + 1, mask=m2, other=0.0).to(tl.float32)
            if not SYM:
                lo = lo + tl.load(zero_ptr + sp, mask=m2, other=0.0).to(tl.float32)
                hi = hi + tl.load(zero_ptr + sp + 1, mask=m2, other=0.0).to(tl.float32)
        elif not STATIC:
            G: tl.constexpr = HEAD_DIM // GS
            if G == 1:
                s = tl.load(scale_ptr + row, mask=mask, other=0.0).to(tl.float32)[:, None]
                lo = lo * s
                hi = hi * s
                if not SYM:
                    z = tl.load(zero_ptr + row, mask=mask, other=0.0).to(tl.float32)[:, None]
                    lo = lo + z
                    hi = hi + z
            else:
                g = tl.arange(0, G)
                gptr = row[:, None] * G + g[None, :]
                s = tl.load(scale_ptr + gptr, mask=m2, other=0.0).to(tl.float32)[:, :, None]
                lo = tl.reshape(lo, [N, G, GS // 2]) * s
                hi = tl.reshape(hi, [N, G, GS // 2]) * s
                if not SYM:
                    z = tl.load(zero_ptr + gptr, mask=m2, other=0.0).to(tl.float32)[:, :, None]
                    lo = lo + z
                    hi = hi + z
                lo = tl.reshape(lo, [N, HALF])
                hi = tl.reshape(hi, [N, HALF])
    return lo, hi


@triton.jit
def _load_open(tail_ptr, new_ptr, trow, nrow, tmask, nmask, kvh, smooth_ptr, static_ptr, had_ptr,
               N: tl.constexpr, HEAD_DIM: tl.constexpr, STATIC: tl.constexpr, SMOOTH: tl.constexpr,
               HAD: tl.constexpr, HAD_CHUNK: tl.constexpr):
    """fp16 rows in model space -- open-block rows ``trow`` of the tail where ``tmask``, this step's rows
    ``nrow`` where ``nmask`` -- moved to the stored channel space of the sealed blocks,
    ``((x / smooth) @ H) / static``, as even / odd halves [N, HEAD_DIM//2] fp32 (zeros where masked), so the
    folded query and the stored-space accumulator serve sealed and open rows alike."""
    HALF: tl.constexpr = HEAD_DIM // 2
    if HAD:
        j = tl.arange(0, HALF)
        lo = tl.full([N, HALF], 0.0, tl.float32)
        hi = tl.full([N, HALF], 0.0, tl.float32)
        for c0 in tl.range(0, HEAD_DIM, HAD_CHUNK, num_stages=1):  # no multi-buffered H slices
            kk = c0 + tl.arange(0, HAD_CHUNK)
            x = (tl.load(tail_ptr + trow[:, None] * HEAD_DIM + kk[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
                 + tl.load(new_ptr + nrow[:, None] * HEAD_DIM + kk[None, :], mask=nmask[:, None], other=0.0).to(tl.float32))
            if SMOOTH:
                x = x / tl.load(smooth_ptr + kvh * HEAD_DIM + kk)[None, :]
            hp = had_ptr + kk[:, None] * HEAD_DIM + 2 * j[None, :]
            lo = tl.dot(x, tl.load(hp), lo, input_precision="ieee")
            hi = tl.dot(x, tl.load(hp + 1), hi, input_precision="ieee")
        if STATIC:
            s_lo = tl.load(static_ptr + kvh * HEAD_DIM + 2 * j)
            s_hi = tl.load(static_ptr + kvh * HEAD_DIM + 2 * j + 1)
            lo = lo * tl.where(s_lo > 0, 1.0 / tl.where(s_lo > 0, s_lo, 1.0), 0.0)[None, :]
            hi = hi * tl.where(s_hi > 0, 1.0 / tl.where(s_hi > 0, s_hi, 1.0), 0.0)[None, :]
    else:
        # whole rows, read contiguously (vectorized) and split in registers, as _load_halves does
        cols = tl.arange(0, HEAD_DIM)
        x = (tl.load(tail_ptr + trow[:, None] * HEAD_DIM + cols[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
             + tl.load(new_ptr + nrow[:, None] * HEAD_DIM + cols[None, :], mask=nmask[:, None], other=0.0).to(tl.float32))
        if SMOOTH:
            x = x / tl.load(smooth_ptr + kvh * HEAD_DIM + cols)[None, :]
        if STATIC:
            sc = tl.load(static_ptr + kvh * HEAD_DIM + cols)
            x = x * tl.where(sc > 0, 1.0 / tl.where(sc > 0, sc, 1.0), 0.0)[None, :]
        lo, hi = tl.split(tl.reshape(x, [N, HALF, 2]))
    return lo, hi


@triton.jit
def _load_query(q_ptr, qrow, qmask, kvh, smooth_ptr, static_ptr, had_ptr, qk_scale,
                M: tl.constexpr, HEAD_DIM: tl.constexpr, K_STATIC: tl.constexpr, K_SMOOTH: tl.constexpr,
                K_HAD: tl.constexpr, HAD_CHUNK: tl.constexpr):
    """Query rows ``qrow`` [M] with K's transforms and static scale folded in:
    ((q * smooth) @ H) * static * qk_scale, as even / odd channel halves [M, HEAD_DIM//2] fp32.
    The rotation is accumulated over HAD_CHUNK input channels (a [HAD_CHUNK, HEAD_DIM] slice of H
    in registers, not all of it)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    j = tl.arange(0, HALF)
    base = q_ptr + qrow[:, None] * HEAD_DIM
    if K_HAD:
        q_lo = tl.full([M, HALF], 0.0, tl.float32)
        q_hi = tl.full([M, HALF], 0.0, tl.float32)
        for c0 in range(0, HEAD_DIM, HAD_CHUNK):
            kk = c0 + tl.arange(0, HAD_CHUNK)
            qc = tl.load(base + kk[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
            if K_SMOOTH:
                qc = qc * tl.load(smooth_ptr + kvh * HEAD_DIM + kk)[None, :]
            h_ptr = had_ptr + kk[:, None] * HEAD_DIM + 2 * j[None, :]
            q_lo = tl.dot(qc, tl.load(h_ptr), q_lo, input_precision="ieee")
            q_hi = tl.dot(qc, tl.load(h_ptr + 1), q_hi, input_precision="ieee")
    else:
        q_lo = tl.load(base + 2 * j[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
        q_hi = tl.load(base + 2 * j[None, :] + 1, mask=qmask[:, None], other=0.0).to(tl.float32)
        if K_SMOOTH:
            q_lo = q_lo * tl.load(smooth_ptr + kvh * HEAD_DIM + 2 * j)[None, :]
            q_hi = q_hi * tl.load(smooth_ptr + kvh * HEAD_DIM + 2 * j + 1)[None, :]
    q_lo = q_lo * qk_scale
    q_hi = q_hi * qk_scale
    if K_STATIC:
        q_lo = q_lo * tl.load(static_ptr + kvh * HEAD_DIM + 2 * j)[None, :]
        q_hi = q_hi * tl.load(static_ptr + kvh * HEAD_DIM + 2 * j + 1)[None, :]
    return q_lo, q_hi


@triton.jit
def _softcap(s, cap):
    """Soft-capping of base-2 scores ``s = x * log2(e)``: ``cap * tanh(x / cap)`` of the natural-scale score x, back
    in the log2 domain. tanh without libdevice, stably: tanh(|y|) = (1 - t) / (1 + t) with t = exp(-2 |y|) =
    exp2(-2 |s| / cap) in (0, 1] (never overflows), the sign restored."""
    t = tl.exp2(-2.0 * tl.abs(s) / cap)
    c = (cap * 1.4426950408889634) * ((1.0 - t) / (1.0 + t))
    return tl.where(s < 0, -c, c)


@triton.jit
def _softmax_scores(q_lo, q_hi, k_lo, k_hi, qpos, kpos, kmask, m_i, l_i, window, softcap, PREC: tl.constexpr):
    """Scores (base 2) of one key tile, soft-capped (``softcap`` > 0), causal on ``qpos`` and, ``window`` > 0, limited
    to keys at positions ``> qpos - window``; returns p, the rescale factor and the new state."""
    s = tl.dot(q_lo, tl.trans(k_lo), input_precision=PREC)
    s = tl.dot(q_hi, tl.trans(k_hi), s, input_precision=PREC)
    if softcap > 0:  # on the scaled score, before the mask (transformers' order)
        s = _softcap(s, softcap)
    ok = kmask[None, :] & (kpos[None, :] <= qpos[:, None])
    if window > 0:
        ok = ok & (kpos[None, :] > qpos[:, None] - window)
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, _rmax(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + _rsum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _window_and_cap(window, softcap, lowest_qpos, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """``window`` / ``softcap`` as ``_attend_cache`` takes them: the runtime values where the constexpr flags compile
    their code in, else the constant 0 (the branches vanish: kernels without them compile as before, no extra
    registers); and ``win_lo``, the lowest key position a query at ``lowest_qpos`` or later sees."""
    win_lo = lowest_qpos * 0
    if WINDOW:
        win = window
        if win > 0:
            win_lo = tl.maximum(lowest_qpos - win + 1, 0)
    else:
        win = 0
    if SOFTCAP:
        cap = softcap
    else:
        cap = 0.0
    return win_lo, win, cap


@triton.jit
def _restore_outliers(lo, hi, oidx_ptr, oval_ptr, bh, off, HEAD_DIM: tl.constexpr, NOUT: tl.constexpr):
    """Even / odd halves [N, HEAD_DIM//2] of rows at offsets ``off`` [N] of one sealed block-head ``bh`` with that
    block's outlier list (``NOUT`` positions ``token * HEAD_DIM + channel`` int16, fp16 values; a multiple of 16, read in
    chunks of its largest power-of-two divisor) written over them.
    The scatter is two one-hot products per half: rows [N, NOUT] x (channel one-hot, times the value) [NOUT, HALF],
    fp16 operands with one non-zero term per output, so exact on tensor cores and in the interpreter alike."""
    HALF: tl.constexpr = HEAD_DIM // 2
    CH: tl.constexpr = NOUT & -NOUT  # the list in chunks of its largest power-of-two divisor (>= 16: LIMITS)
    j2 = 2 * tl.arange(0, HALF)
    for c in tl.static_range(0, NOUT, CH):  # a position is listed once, so the chunks write disjoint elements
        o = c + tl.arange(0, CH)
        idx = tl.load(oidx_ptr + bh * NOUT + o).to(tl.int32)
        val = tl.load(oval_ptr + bh * NOUT + o).to(tl.float16)
        hit = (off[:, None] == (idx // HEAD_DIM)[None, :]).to(tl.float16)  # [N, CH]
        ch = idx % HEAD_DIM
        c_lo = (ch[:, None] == j2[None, :]).to(tl.float16)  # [CH, HALF]
        c_hi = (ch[:, None] == j2[None, :] + 1).to(tl.float16)
        lo = tl.where(tl.dot(hit, c_lo) > 0, tl.dot(hit, c_lo * val[:, None]), lo)
        hi = tl.where(tl.dot(hit, c_hi) > 0, tl.dot(hit, c_hi * val[:, None]), hi)
    return lo, hi


@triton.jit
def _model_half(k16, jsel, kvh, smooth_ptr, had_ptr, B: tl.constexpr, HEAD_DIM: tl.constexpr, SMOOTH: tl.constexpr):
    """Model channels ``2 * jsel + B`` [HALF] of rotated stored rows: ``((x @ H^T) * smooth)[:, 2 jsel + B]``, [N, HALF]
    fp32: one product of the whole rows ``k16`` [N, HEAD_DIM] (fp16, the precision the open block keeps keys in) by
    the [HEAD_DIM, HALF] slice of H^T (fp16)."""
    c = 2 * jsel + B
    i = tl.arange(0, HEAD_DIM)
    u = tl.dot(k16, tl.load(had_ptr + c[None, :] * HEAD_DIM + i[:, None]).to(tl.float16))
    if SMOOTH:
        u = u * tl.load(smooth_ptr + kvh * HEAD_DIM + c)[None, :]
    return u


@triton.jit
def _swap_quarters(x, N: tl.constexpr, HALF: tl.constexpr):
    """``x`` [N, HALF] with its two halves swapped (column j takes column (j + HALF / 2) % HALF): a permutation of
    registers, where a one-hot product picking the partners compiled to spills of ~20 KiB per thread (sm_80 / sm_90)."""
    a, b = tl.split(tl.permute(tl.reshape(x, [N, 2, HALF // 2]), (0, 2, 1)))
    return tl.reshape(tl.permute(tl.join(b, a), (0, 2, 1)), [N, HALF])


@triton.jit
def _keys_to_model_space(lo, hi, kpos, kmask, kvh, smooth_ptr, had_ptr, cos_ptr, sin_ptr, HEAD_DIM: tl.constexpr,
                         SMOOTH: tl.constexpr, HAD: tl.constexpr):
    """Keys stored before RoPE (``prerope``), as halves in the stored space, back in the model's space: rotation
    undone, smoothing undone, then RoPE at positions ``kpos`` from the model's table ``cos`` / ``sin`` [P, HEAD_DIM]
    (``trtkv.rope.rotate``: ``u * cos + rotate_half(u) * sin``, ``rotate_half(u)[c] = -u[c + D/2]`` below D/2,
    ``u[c - D/2]`` above). Channel ``2j + B`` pairs with ``2 ((j + D/4) % HALF) + B``: the same half, so each half
    is two products (its own channels and its partners') and no register shuffle."""
    HALF: tl.constexpr = HEAD_DIM // 2
    N: tl.constexpr = lo.shape[0]
    j = tl.arange(0, HALF)
    partner = (j + HEAD_DIM // 4) % HALF
    sign = tl.where(j < HEAD_DIM // 4, -1.0, 1.0)[None, :]
    m2 = kmask[:, None]
    trow = kpos.to(tl.int64)[:, None] * HEAD_DIM
    if HAD:
        k16 = tl.reshape(tl.join(lo, hi), [N, HEAD_DIM]).to(tl.float16)
        u_lo = _model_half(k16, j, kvh, smooth_ptr, had_ptr, 0, HEAD_DIM, SMOOTH)
        r_lo = _model_half(k16, partner, kvh, smooth_ptr, had_ptr, 0, HEAD_DIM, SMOOTH) * sign
        u_hi = _model_half(k16, j, kvh, smooth_ptr, had_ptr, 1, HEAD_DIM, SMOOTH)
        r_hi = _model_half(k16, partner, kvh, smooth_ptr, had_ptr, 1, HEAD_DIM, SMOOTH) * sign
    else:  # no rotation: each half is its own model channels; the partners are the half's two quarters swapped
        u_lo = lo
        u_hi = hi
        if SMOOTH:
            u_lo = u_lo * tl.load(smooth_ptr + kvh * HEAD_DIM + 2 * j)[None, :]
            u_hi = u_hi * tl.load(smooth_ptr + kvh * HEAD_DIM + 2 * j + 1)[None, :]
        r_lo = _swap_quarters(u_lo, N, HALF) * sign
        r_hi = _swap_quarters(u_hi, N, HALF) * sign
    out_lo = (u_lo * tl.load(cos_ptr + trow + 2 * j[None, :], mask=m2, other=0.0)
              + r_lo * tl.load(sin_ptr + trow + 2 * j[None, :], mask=m2, other=0.0))
    out_hi = (u_hi * tl.load(cos_ptr + trow + 2 * j[None, :] + 1, mask=m2, other=0.0)
              + r_hi * tl.load(sin_ptr + trow + 2 * j[None, :] + 1, mask=m2, other=0.0))
    return out_lo, out_hi


@triton.jit
def _attend_sealed(q_lo, q_hi, qpos, m_i, l_i, acc_lo, acc_hi, kv_start, kv_end, window, softcap,
                   bt_row_ptr, kvh, num_kv_heads, block_size,
                   k_data_ptr, k_scale_ptr, k_zero_ptr, v_data_ptr, v_scale_ptr, v_zero_ptr,
                   k_cb_ptr, v_cb_ptr, k_oidx_ptr, k_oval_ptr, v_oidx_ptr, v_oval_ptr, rope_cos_ptr, rope_sin_ptr,
                   k_smooth_ptr, had_ptr, k_chan_ptr, v_chan_ptr,
                   HEAD_DIM: tl.constexpr,
                   K_DTYPE: tl.constexpr, K_STATIC: tl.constexpr, K_SYM: tl.constexpr, K_GS: tl.constexpr,
                   K_BCH: tl.constexpr, K_OFF: tl.constexpr,
                   V_DTYPE: tl.constexpr, V_STATIC: tl.constexpr, V_SYM: tl.constexpr, V_GS: tl.constexpr,
                   V_BCH: tl.constexpr, V_OFF: tl.constexpr,
                   K_LEVELS: tl.constexpr, V_LEVELS: tl.constexpr, K_OUT: tl.constexpr, V_OUT: tl.constexpr,
                   K_PRE: tl.constexpr, K_PRE_SMOOTH: tl.constexpr, K_PRE_HAD: tl.constexpr,
                   K_RB: tl.constexpr, V_RB: tl.constexpr,
                   BLOCK_N: tl.constexpr, PREC: tl.constexpr, SEALED_STAGES: tl.constexpr):
    """Online softmax of the query rows over sealed positions [kv_start, kv_end) (all below
    ``(context_len // block_size) * block_size``), read from the pool through the block table: only the entries of
    the blocks holding those positions are read (with a window, the caller starts at the first one it reaches).

    Formats with outlier lists (``K_OUT`` / ``V_OUT``) walk tiles aligned to BLOCK_N (which divides the block
    size, ``decode_config``), so a tile lies in one block and reads one list. Keys stored before RoPE (``K_PRE``)
    are brought to the model's space per tile (``_keys_to_model_space``); their query is not folded."""
    first = kv_start
    if K_OUT > 0 or V_OUT > 0:
        first = (kv_start // BLOCK_N) * BLOCK_N
    for start in tl.range(first, kv_end, BLOCK_N, num_stages=SEALED_STAGES):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < kv_end
        if K_OUT > 0 or V_OUT > 0:
            kmask = kmask & (kpos >= kv_start)
        blk = tl.load(bt_row_ptr + kpos // block_size, mask=kmask, other=0).to(tl.int64)
        bh = blk * num_kv_heads + kvh
        row = bh * block_size + kpos % block_size
        k_lo, k_hi = _load_halves(k_data_ptr, k_scale_ptr, k_zero_ptr, row, bh, kmask,
                                  HEAD_DIM, K_DTYPE, K_STATIC, K_SYM, K_GS, K_BCH, K_OFF, k_cb_ptr, kvh, K_LEVELS, k_chan_ptr, K_RB)
        if K_OUT > 0 or V_OUT > 0:
            bh_tile = tl.load(bt_row_ptr + start // block_size).to(tl.int64) * num_kv_heads + kvh
        if K_OUT > 0:
            k_lo, k_hi = _restore_outliers(k_lo, k_hi, k_oidx_ptr, k_oval_ptr, bh_tile, kpos % block_size, HEAD_DIM, K_OUT)
        if K_PRE:
            k_lo, k_hi = _keys_to_model_space(k_lo, k_hi, kpos, kmask, kvh, k_smooth_ptr, had_ptr, rope_cos_ptr,
                                              rope_sin_ptr, HEAD_DIM, K_PRE_SMOOTH, K_PRE_HAD)
        p, alpha, m_i, l_i = _softmax_scores(q_lo, q_hi, k_lo, k_hi, qpos, kpos, kmask, m_i, l_i, window, softcap, PREC)
        v_lo, v_hi = _load_halves(v_data_ptr, v_scale_ptr, v_zero_ptr, row, bh, kmask,
                                  HEAD_DIM, V_DTYPE, V_STATIC, V_SYM, V_GS, V_BCH, V_OFF, v_cb_ptr, kvh, V_LEVELS, v_chan_ptr, V_RB)
        if V_OUT > 0:
            v_lo, v_hi = _restore_outliers(v_lo, v_hi, v_oidx_ptr, v_oval_ptr, bh_tile, kpos % block_size, HEAD_DIM, V_OUT)
        acc_lo = tl.dot(p, v_lo, acc_lo * alpha[:, None], input_precision=PREC)
        acc_hi = tl.dot(p, v_hi, acc_hi * alpha[:, None], input_precision=PREC)
    return m_i, l_i, acc_lo, acc_hi


@triton.jit
def _attend_open(q_lo, q_hi, qpos, m_i, l_i, acc_lo, acc_hi, kv_start, kv_end, window, softcap,
                 open_start, open_len, tail_row0, new_row0, kvh, num_kv_heads,
                 k_tail_ptr, v_tail_ptr, k_new_ptr, v_new_ptr,
                 k_static_ptr, k_smooth_ptr, v_static_ptr, v_smooth_ptr, had_ptr,
                 HEAD_DIM: tl.constexpr,
                 K_STATIC: tl.constexpr, K_SMOOTH: tl.constexpr, K_HAD: tl.constexpr,
                 V_STATIC: tl.constexpr, V_SMOOTH: tl.constexpr, V_HAD: tl.constexpr,
                 BLOCK_N: tl.constexpr, PREC: tl.constexpr, HAD_CHUNK: tl.constexpr):
    """Online softmax over positions [kv_start, kv_end) of the open block (which starts at position
    ``open_start``): offsets < ``open_len`` are tail rows ``tail_row0 + offset``, later ones this step's
    rows ``new_row0 + offset - open_len`` (fp16, model space, moved to the stored space on load)."""
    # not software-pipelined (num_stages=1): at most a block of rows, and multi-buffering its fp16 loads
    # would cost ~14 KiB of shared memory (decode at head_dim 128 over the 48 KiB launch limit)
    for start in tl.range(kv_start, kv_end, BLOCK_N, num_stages=1):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < kv_end
        off = kpos - open_start
        tmask = kmask & (off < open_len)
        nmask = kmask & (off >= open_len)
        trow = tail_row0 + off
        nrow = (new_row0 + (off - open_len)).to(tl.int64) * num_kv_heads + kvh
        k_lo, k_hi = _load_open(k_tail_ptr, k_new_ptr, trow, nrow, tmask, nmask, kvh, k_smooth_ptr, k_static_ptr,
                                had_ptr, BLOCK_N, HEAD_DIM, K_STATIC, K_SMOOTH, K_HAD, HAD_CHUNK)
        p, alpha, m_i, l_i = _softmax_scores(q_lo, q_hi, k_lo, k_hi, qpos, kpos, kmask, m_i, l_i, window, softcap, PREC)
        v_lo, v_hi = _load_open(v_tail_ptr, v_new_ptr, trow, nrow, tmask, nmask, kvh, v_smooth_ptr, v_static_ptr,
                                had_ptr, BLOCK_N, HEAD_DIM, V_STATIC, V_SMOOTH, V_HAD, HAD_CHUNK)
        acc_lo = tl.dot(p, v_lo, acc_lo * alpha[:, None], input_precision=PREC)
        acc_hi = tl.dot(p, v_hi, acc_hi * alpha[:, None], input_precision=PREC)
    return m_i, l_i, acc_lo, acc_hi


@triton.jit
def _attend_cache(q_lo, q_hi, qpos, kv_start, kv_end, ctx, new_row0, b, kvh,
                  k_data_ptr, k_scale_ptr, k_zero_ptr, v_data_ptr, v_scale_ptr, v_zero_ptr,
                  k_tail_ptr, v_tail_ptr, k_new_ptr, v_new_ptr, k_static_ptr, k_smooth_ptr, v_static_ptr, v_smooth_ptr,
                  had_ptr, block_table_ptr, slot_ids_ptr, num_kv_heads, block_size, sink_tokens, max_blocks,
                  k_cb_ptr, v_cb_ptr, k_oidx_ptr, k_oval_ptr, v_oidx_ptr, v_oval_ptr, rope_cos_ptr, rope_sin_ptr,
                  k_chan_ptr, v_chan_ptr, win_lo, window, softcap, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  K_DTYPE: tl.constexpr, K_STATIC: tl.constexpr, K_SYM: tl.constexpr, K_GS: tl.constexpr,
                  K_BCH: tl.constexpr, K_OFF: tl.constexpr, K_SMOOTH: tl.constexpr, K_HAD: tl.constexpr,
                  V_DTYPE: tl.constexpr, V_STATIC: tl.constexpr, V_SYM: tl.constexpr, V_GS: tl.constexpr,
                  V_BCH: tl.constexpr, V_OFF: tl.constexpr, V_SMOOTH: tl.constexpr, V_HAD: tl.constexpr,
                  K_LEVELS: tl.constexpr, V_LEVELS: tl.constexpr, K_OUT: tl.constexpr, V_OUT: tl.constexpr,
                  K_PRE: tl.constexpr, K_PRE_SMOOTH: tl.constexpr, K_PRE_HAD: tl.constexpr,
                  K_RB: tl.constexpr, V_RB: tl.constexpr,
                  BLOCK_N: tl.constexpr, PREC: tl.constexpr, OPEN_N: tl.constexpr, HAD_CHUNK: tl.constexpr,
                  SEALED_STAGES: tl.constexpr):
    """Softmax state of ROWS query rows over keys [kv_start, kv_end) of sequence b: the sink rows, the sealed
    blocks, then the open block and new rows from ``new_row0`` (one code for decode partitions and prefill).

    Sliding window (``window`` > 0): a row at position p sees keys at positions > p - window; ``win_lo`` is the
    lowest position any row of the program sees (``max(0, min(qpos) - window + 1)``), and every loop starts there,
    so sealed blocks below it -- in a window ring, overwritten ones -- are never loaded, nor their table entries.
    A decode partition wholly below it attends nothing and writes m = -inf, l = 0, acc = 0 (the reduction's
    neutral element). ``softcap`` > 0: Gemma 2's ``softcap * tanh(score / softcap)`` (``_softcap``)."""
    sealed_end = (ctx // block_size) * block_size
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.full([ROWS], 0.0, tl.float32)
    acc_lo = tl.full([ROWS, HEAD_DIM // 2], 0.0, tl.float32)
    acc_hi = tl.full([ROWS, HEAD_DIM // 2], 0.0, tl.float32)
    bt_row = block_table_ptr + b.to(tl.int64) * max_blocks
    slot = tl.load(slot_ids_ptr + b).to(tl.int64)
    tail_row0 = (slot * num_kv_heads + kvh) * (block_size + sink_tokens)
    sink_end = tl.where(sealed_end > 0, sink_tokens, 0)  # positions read from the sink rows
    m_i, l_i, acc_lo, acc_hi = _attend_open(
        q_lo, q_hi, qpos, m_i, l_i, acc_lo, acc_hi, tl.maximum(kv_start, win_lo), tl.minimum(kv_end, sink_end),
        window, softcap, 0, sink_end, tail_row0 + block_size, new_row0, kvh, num_kv_heads,
        k_tail_ptr, v_tail_ptr, k_new_ptr, v_new_ptr, k_static_ptr, k_smooth_ptr, v_static_ptr, v_smooth_ptr,
        had_ptr, HEAD_DIM, K_STATIC, K_SMOOTH, K_HAD, V_STATIC, V_SMOOTH, V_HAD, OPEN_N, PREC, HAD_CHUNK)
    m_i, l_i, acc_lo, acc_hi = _attend_sealed(
        q_lo, q_hi, qpos, m_i, l_i, acc_lo, acc_hi, tl.maximum(tl.maximum(kv_start, sink_end), win_lo),
        tl.minimum(kv_end, sealed_end), window, softcap, bt_row, kvh, num_kv_heads, block_size,
        k_data_ptr, k_scale_ptr, k_zero_ptr, v_data_ptr, v_scale_ptr, v_zero_ptr,
        k_cb_ptr, v_cb_ptr, k_oidx_ptr, k_oval_ptr, v_oidx_ptr, v_oval_ptr, rope_cos_ptr, rope_sin_ptr, k_smooth_ptr, had_ptr,
        k_chan_ptr, v_chan_ptr,
        HEAD_DIM, K_DTYPE, K_STATIC, K_SYM, K_GS, K_BCH, K_OFF, V_DTYPE, V_STATIC, V_SYM, V_GS, V_BCH, V_OFF,
        K_LEVELS, V_LEVELS, K_OUT, V_OUT, K_PRE, K_PRE_SMOOTH, K_PRE_HAD, K_RB, V_RB, BLOCK_N, PREC, SEALED_STAGES)
    m_i, l_i, acc_lo, acc_hi = _attend_open(
        q_lo, q_hi, qpos, m_i, l_i, acc_lo, acc_hi, tl.maximum(tl.maximum(kv_start, sealed_end), win_lo), kv_end,
        window, softcap, sealed_end, ctx - sealed_end, tail_row0, new_row0, kvh, num_kv_heads,
        k_tail_ptr, v_tail_ptr, k_new_ptr, v_new_ptr, k_static_ptr, k_smooth_ptr, v_static_ptr, v_smooth_ptr,
        had_ptr, HEAD_DIM, K_STATIC, K_SMOOTH, K_HAD, V_STATIC, V_SMOOTH, V_HAD, OPEN_N, PREC, HAD_CHUNK)
    return m_i, l_i, acc_lo, acc_hi


@triton.jit
def _join_halves(lo, hi, M: tl.constexpr, HEAD_DIM: tl.constexpr):
    return tl.reshape(tl.join(lo, hi), [M, HEAD_DIM])


@triton.jit
def _store_output(out_ptr, orow, omask, out, kvh, v_static_ptr, v_smooth_ptr, had_ptr,
                  HEAD_DIM: tl.constexpr, V_STATIC: tl.constexpr, V_SMOOTH: tl.constexpr, V_HAD: tl.constexpr,
                  HAD_CHUNK: tl.constexpr):
    """Store normalized rows out [M, HEAD_DIM] (stored channel space) at ``orow`` in model space:
    * static scale, @ H^T (HAD_CHUNK output channels at a time), * smoothing."""
    cols = tl.arange(0, HEAD_DIM)
    if V_STATIC:
        out = out * tl.load(v_static_ptr + kvh * HEAD_DIM + cols)[None, :]
    if V_HAD:
        for c0 in range(0, HEAD_DIM, HAD_CHUNK):
            cc = c0 + tl.arange(0, HAD_CHUNK)
            ht = tl.load(had_ptr + cc[None, :] * HEAD_DIM + cols[:, None])  # H^T[:, cc]
            o = tl.dot(out, ht, input_precision="ieee")
            if V_SMOOTH:
                o = o * tl.load(v_smooth_ptr + kvh * HEAD_DIM + cc)[None, :]
            tl.store(out_ptr + orow[:, None] * HEAD_DIM + cc[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=omask[:, None])
    else:
        if V_SMOOTH:
            out = out * tl.load(v_smooth_ptr + kvh * HEAD_DIM + cols)[None, :]
        tl.store(out_ptr + orow[:, None] * HEAD_DIM + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=omask[:, None])


# --------------------------------------------------------------------------------------------
# 2. decode: split-K partitions + reduction
# --------------------------------------------------------------------------------------------

@triton.jit
def paged_decode_partition_kernel(
    q_ptr,  # [batch, heads, head_dim] fp16 / bf16 / fp32, contiguous
    k_data_ptr, k_scale_ptr, k_zero_ptr,  # sealed pool blocks (read only)
    v_data_ptr, v_scale_ptr, v_zero_ptr,
    k_tail_ptr, v_tail_ptr,  # open blocks + sink rows [num_slots, kv_heads, block_size + sink_tokens, head_dim] fp16
    k_new_ptr, v_new_ptr,  # this step's rows [batch, kv_heads, head_dim] fp16 (model space)
    k_static_ptr, k_smooth_ptr, v_static_ptr, v_smooth_ptr,  # [kv_heads, head_dim] fp32 or dummies
    had_ptr,  # [head_dim, head_dim] fp32 (K_HAD or V_HAD; else dummy)
    block_table_ptr,  # [batch, max_blocks] int32
    context_lens_ptr,  # [batch] int32: tokens cached before this step
    slot_ids_ptr,  # [batch] int32: open-block slot of each sequence
    k_cb_ptr, v_cb_ptr,  # [kv_heads, LEVELS] fp32 codebooks (nuq; else dummies or constexpr None)
    k_oidx_ptr, k_oval_ptr, v_oidx_ptr, v_oval_ptr,  # [num_blocks, kv_heads, OUT] int16 / fp16 outlier lists (outN)
    rope_cos_ptr, rope_sin_ptr,  # [P, head_dim] fp32 RoPE table of positions 0 .. P-1 (K_PRE; else dummies)
    k_chan_ptr, v_chan_ptr,  # [kv_heads, head_dim] int32 channel tables (allocB: bit offset | width << 16; else dummies)
    part_m_ptr,  # [batch, heads, num_partitions] fp32 running max (log2 domain)
    part_l_ptr,  # [batch, heads, num_partitions] fp32 softmax denominators
    part_acc_ptr,  # [batch, heads, num_partitions, head_dim] fp32 unnormalized outputs (V's stored channel space)
    qk_scale,  # fp32: sm_scale * log2(e)
    num_heads,
    num_kv_heads,
    block_size,
    sink_tokens,
    max_blocks,
    num_partitions,
    window,  # int: sliding window (keys at positions > query position - window), 0 = none
    softcap,  # fp32: attention-logit soft-capping (cap * tanh(score / cap)), 0 = none
    HEAD_DIM: tl.constexpr,
    K_DTYPE: tl.constexpr, K_STATIC: tl.constexpr, K_SYM: tl.constexpr, K_GS: tl.constexpr, K_BCH: tl.constexpr,
    K_OFF: tl.constexpr, K_SMOOTH: tl.constexpr, K_HAD: tl.constexpr,
    V_DTYPE: tl.constexpr, V_STATIC: tl.constexpr, V_SYM: tl.constexpr, V_GS: tl.constexpr, V_BCH: tl.constexpr,
    V_OFF: tl.constexpr, V_SMOOTH: tl.constexpr, V_HAD: tl.constexpr,
    K_LEVELS: tl.constexpr, V_LEVELS: tl.constexpr, K_OUT: tl.constexpr, V_OUT: tl.constexpr,
    K_PRE: tl.constexpr, K_PRE_SMOOTH: tl.constexpr, K_PRE_HAD: tl.constexpr,
    K_RB: tl.constexpr, V_RB: tl.constexpr,  # allocB: bytes per row (0: none)
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
    PREC: tl.constexpr,
    OPEN_N: tl.constexpr,
    HAD_CHUNK: tl.constexpr = 32,
    SEALED_STAGES: tl.constexpr = None,  # software-pipelining stages of the sealed loop (None: the launch's)
    WINDOW: tl.constexpr = False,  # compile the window's code (``window`` may still be 0); False: window ignored
    SOFTCAP: tl.constexpr = False,  # compile the soft-cap's code; False: softcap ignored
):
    """grid = contract.decode_grids(...)[0] = (batch, kv_heads, num_partitions). One program: all query
    heads of one KV head over PARTITION of the context_len + 1 keys (sealed blocks, open block, the new row
    at position context_len); partitions past them write nothing (the reduction skips them). With a window,
    a partition wholly before ``context_len - window + 1`` loads no key and writes the empty state (m = -inf,
    l = 0, acc = 0), which the reduction merges as nothing."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    total = ctx + 1
    kv_start = part * PARTITION
    if kv_start < total:
        kv_end = tl.minimum(kv_start + PARTITION, total)
        ratio = num_heads // num_kv_heads
        hh = tl.arange(0, BLOCK_H)
        hmask = hh < ratio
        qh = kvh * ratio + hh
        cols = tl.arange(0, HEAD_DIM)
        q_lo, q_hi = _load_query(q_ptr, (b * num_heads + qh).to(tl.int64), hmask, kvh, k_smooth_ptr, k_static_ptr,
                                 had_ptr, qk_scale, BLOCK_H, HEAD_DIM, K_STATIC, K_SMOOTH, K_HAD, HAD_CHUNK)
        qpos = tl.full([BLOCK_H], 0, tl.int32) + ctx
        win_lo, win, cap = _window_and_cap(window, softcap, ctx, WINDOW, SOFTCAP)
        m_i, l_i, acc_lo, acc_hi = _attend_cache(
            q_lo, q_hi, qpos, kv_start, kv_end, ctx, b, b, kvh,
            k_data_ptr, k_scale_ptr, k_zero_ptr, v_data_ptr, v_scale_ptr, v_zero_ptr,
            k_tail_ptr, v_tail_ptr, k_new_ptr, v_new_ptr, k_static_ptr, k_smooth_ptr, v_static_ptr, v_smooth_ptr,
            had_ptr, block_table_ptr, slot_ids_ptr, num_kv_heads, block_size, sink_tokens, max_blocks,
            k_cb_ptr, v_cb_ptr, k_oidx_ptr, k_oval_ptr, v_oidx_ptr, v_oval_ptr, rope_cos_ptr, rope_sin_ptr,
            k_chan_ptr, v_chan_ptr,
            win_lo, win, cap, BLOCK_H, HEAD_DIM, K_DTYPE, K_STATIC, K_SYM, K_GS, K_BCH, K_OFF, K_SMOOTH, K_HAD,
            V_DTYPE, V_STATIC, V_SYM, V_GS, V_BCH, V_OFF, V_SMOOTH, V_HAD,
            K_LEVELS, V_LEVELS, K_OUT, V_OUT, K_PRE, K_PRE_SMOOTH, K_PRE_HAD, K_RB, V_RB, BLOCK_N, PREC, OPEN_N, HAD_CHUNK,
            SEALED_STAGES)
        prow = (b * num_heads + qh).to(tl.int64) * num_partitions + part
        tl.store(part_m_ptr + prow, m_i, mask=hmask)
        tl.store(part_l_ptr + prow, l_i, mask=hmask)
        acc = _join_halves(acc_lo, acc_hi, BLOCK_H, HEAD_DIM)
        tl.store(part_acc_ptr + prow[:, None] * HEAD_DIM + cols[None, :], acc, mask=hmask[:, None])


@triton.jit
def paged_decode_reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr,  # from paged_decode_partition_kernel
    context_lens_ptr,  # [batch] int32 (tokens cached before the step)
    v_static_ptr,  # [kv_heads, head_dim] fp32 (V_STATIC; else dummy)
    v_smooth_ptr,  # [kv_heads, head_dim] fp32 (V_SMOOTH; else dummy)
    had_ptr,  # [head_dim, head_dim] fp32 (V_HAD; else dummy)
    out_ptr,  # [batch, heads, head_dim] (dtype of q)
    num_heads,
    num_kv_heads,
    num_partitions,
    HEAD_DIM: tl.constexpr,
    V_STATIC: tl.constexpr, V_SMOOTH: tl.constexpr, V_HAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PARTITION: tl.constexpr,
    HAD_CHUNK: tl.constexpr = 32,
):
    """grid = contract.decode_grids(...)[1] = (batch, kv_heads, 1). Merges the partitions holding the
    context_len + 1 keys of each query head (log-sum-exp), normalizes, undoes V's static scale /
    Hadamard / smoothing."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + b)
    used = (ctx + PARTITION) // PARTITION  # cdiv(ctx + 1, PARTITION)
    ratio = num_heads // num_kv_heads
    hh = tl.arange(0, BLOCK_H)
    hmask = hh < ratio
    qh = kvh * ratio + hh
    cols = tl.arange(0, HEAD_DIM)
    base = (b * num_heads + qh).to(tl.int64) * num_partitions
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, HEAD_DIM], 0.0, tl.float32)
    for p in range(0, used):
        m_p = tl.load(part_m_ptr + base + p, mask=hmask, other=float("-inf"))
        l_p = tl.load(part_l_ptr + base + p, mask=hmask, other=0.0)
        a_p = tl.load(part_acc_ptr + (base + p)[:, None] * HEAD_DIM + cols[None, :], mask=hmask[:, None], other=0.0)
        m_new = tl.maximum(m, m_p)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        beta = tl.exp2(m_p - m_safe)
        l = l * alpha + l_p * beta
        acc = acc * alpha[:, None] + a_p * beta[:, None]
        m = m_new
    inv_l = tl.where(l > 0, 1.0 / tl.where(l > 0, l, 1.0), 0.0)
    _store_output(out_ptr, (b * num_heads + qh).to(tl.int64), hmask, acc * inv_l[:, None], kvh, v_static_ptr,
                  v_smooth_ptr, had_ptr, HEAD_DIM, V_STATIC, V_SMOOTH, V_HAD, HAD_CHUNK)


# --------------------------------------------------------------------------------------------
# 3. prefill / chunked prefill
# --------------------------------------------------------------------------------------------


@triton.jit
def paged_prefill_kernel(
    q_ptr,  # [total_q, heads, head_dim], contiguous
    cu_seqlens_q_ptr,  # [batch + 1] int32: sequence b's queries / new rows are rows cu[b] .. cu[b+1]-1
    k_data_ptr, k_scale_ptr, k_zero_ptr,  # sealed pool blocks (read only)
    v_data_ptr, v_scale_ptr, v_zero_ptr,
    k_tail_ptr, v_tail_ptr,  # open blocks + sink rows [num_slots, kv_heads, block_size + sink_tokens, head_dim] fp16
    k_new_ptr, v_new_ptr,  # this step's rows [total_q, kv_heads, head_dim] fp16 (model space)
    k_static_ptr, k_smooth_ptr, v_static_ptr, v_smooth_ptr,  # [kv_heads, head_dim] fp32 or dummies
    had_ptr,  # [head_dim, head_dim] fp32 or dummy
    block_table_ptr,  # [batch, max_blocks] int32
    context_lens_ptr,  # [batch] int32: tokens cached before this step
    slot_ids_ptr,  # [batch] int32
    k_cb_ptr, v_cb_ptr,  # as for paged_decode_partition_kernel
    k_oidx_ptr, k_oval_ptr, v_oidx_ptr, v_oval_ptr,
    rope_cos_ptr, rope_sin_ptr,
    k_chan_ptr, v_chan_ptr,
    out_ptr,  # [total_q, heads, head_dim]
    qk_scale,
    num_heads,
    num_kv_heads,
    block_size,
    sink_tokens,
    max_blocks,
    window,  # int: sliding window (keys at positions > query position - window), 0 = none
    softcap,  # fp32: attention-logit soft-capping (cap * tanh(score / cap)), 0 = none
    HEAD_DIM: tl.constexpr,
    K_DTYPE: tl.constexpr, K_STATIC: tl.constexpr, K_SYM: tl.constexpr, K_GS: tl.constexpr, K_BCH: tl.constexpr,
    K_OFF: tl.constexpr, K_SMOOTH: tl.constexpr, K_HAD: tl.constexpr,
    V_DTYPE: tl.constexpr, V_STATIC: tl.constexpr, V_SYM: tl.constexpr, V_GS: tl.constexpr, V_BCH: tl.constexpr,
    V_OFF: tl.constexpr, V_SMOOTH: tl.constexpr, V_HAD: tl.constexpr,
    K_LEVELS: tl.constexpr, V_LEVELS: tl.constexpr, K_OUT: tl.constexpr, V_OUT: tl.constexpr,
    K_PRE: tl.constexpr, K_PRE_SMOOTH: tl.constexpr, K_PRE_HAD: tl.constexpr,
    K_RB: tl.constexpr, V_RB: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_H: tl.constexpr,  # query heads per KV head, padded to a power of two
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    OPEN_N: tl.constexpr,
    HAD_CHUNK: tl.constexpr = 32,
    SEALED_STAGES: tl.constexpr = None,  # software-pipelining stages of the sealed loop (None: the launch's)
    WINDOW: tl.constexpr = False,  # as for paged_decode_partition_kernel
    SOFTCAP: tl.constexpr = False,
):
    """grid = contract.prefill_grid(max_seqlen_q, kv_heads, batch, BLOCK_M). Rows of a program are (token,
    head) pairs: BLOCK_M query tokens x the BLOCK_H heads sharing one KV head (GQA reads K/V once). New
    token t of sequence b sits at position context_len + t and sees the sealed blocks, the open block and
    new rows 0 .. t (with a window, only those at positions > context_len + t - window)."""
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    q_begin = tl.load(cu_seqlens_q_ptr + b)
    num_new = tl.load(cu_seqlens_q_ptr + b + 1) - q_begin
    m0 = pid_m * BLOCK_M
    if m0 < num_new:
        ctx = tl.load(context_lens_ptr + b)
        ratio = num_heads // num_kv_heads
        M: tl.constexpr = BLOCK_M * BLOCK_H
        r = tl.arange(0, M)
        tok = m0 + r // BLOCK_H
        hh = r % BLOCK_H
        rmask = (tok < num_new) & (hh < ratio)
        qrow = ((q_begin + tok) * num_heads + kvh * ratio + hh).to(tl.int64)
        q_lo, q_hi = _load_query(q_ptr, qrow, rmask, kvh, k_smooth_ptr, k_static_ptr, had_ptr, qk_scale,
                                 M, HEAD_DIM, K_STATIC, K_SMOOTH, K_HAD, HAD_CHUNK)
        qpos = ctx + tok
        kv_end = ctx + tl.minimum(num_new, m0 + BLOCK_M)
        win_lo, win, cap = _window_and_cap(window, softcap, ctx + m0, WINDOW, SOFTCAP)  # the first query token's position
        m_i, l_i, acc_lo, acc_hi = _attend_cache(
            q_lo, q_hi, qpos, 0, kv_end, ctx, q_begin, b, kvh,
            k_data_ptr, k_scale_ptr, k_zero_ptr, v_data_ptr, v_scale_ptr, v_zero_ptr,
            k_tail_ptr, v_tail_ptr, k_new_ptr, v_new_ptr, k_static_ptr, k_smooth_ptr, v_static_ptr, v_smooth_ptr,
            had_ptr, block_table_ptr, slot_ids_ptr, num_kv_heads, block_size, sink_tokens, max_blocks,
            k_cb_ptr, v_cb_ptr, k_oidx_ptr, k_oval_ptr, v_oidx_ptr, v_oval_ptr, rope_cos_ptr, rope_sin_ptr,
            k_chan_ptr, v_chan_ptr,
            win_lo, win, cap, M, HEAD_DIM, K_DTYPE, K_STATIC, K_SYM, K_GS, K_BCH, K_OFF, K_SMOOTH, K_HAD,
            V_DTYPE, V_STATIC, V_SYM, V_GS, V_BCH, V_OFF, V_SMOOTH, V_HAD,
            K_LEVELS, V_LEVELS, K_OUT, V_OUT, K_PRE, K_PRE_SMOOTH, K_PRE_HAD, K_RB, V_RB, BLOCK_N, PREC, OPEN_N, HAD_CHUNK,
            SEALED_STAGES)
        inv_l = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
        out = _join_halves(acc_lo, acc_hi, M, HEAD_DIM) * inv_l[:, None]
        _store_output(out_ptr, qrow, rmask, out, kvh, v_static_ptr, v_smooth_ptr, had_ptr,
                      HEAD_DIM, V_STATIC, V_SMOOTH, V_HAD, HAD_CHUNK)


# --------------------------------------------------------------------------------------------
# launch configuration (read by ops.py, aot.py and the TensorRT glue; grids are contract's)
# --------------------------------------------------------------------------------------------


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def format_constexprs(spec, paths: tuple[str, ...] = ("kernels", "seal")) -> dict:
    """A TensorFormat (or its short spec string) -> the constexprs of its storage: DTYPE / STATIC / SYM / GS /
    BCH / SMOOTH / HAD, the code range from ``trtkv.formats.DTYPES`` (QMIN / QMAX / QMAX_ASYM, and
    CODE_OFFSET: the bias of symmetric codes stored unsigned, i.e. packed int4) and the calibrated storage features
    (LEVELS / OUT / PRE / ALLOC), for the capability table's rows ``paths`` (the attention kernels', the seal's)."""
    fmt = _C.as_tensor_format(spec)
    if (why := kernel_refusal(fmt, paths)) is not None:
        raise TrtkvError(f"{fmt.short()} {why}", LACKS_HINT)
    tr = fmt.traits
    sym = bool(fmt.symmetric or fmt.is_static)
    return {
        "DTYPE": fmt.dtype,
        "STATIC": bool(fmt.is_static),
        "SYM": sym,
        "GS": int(fmt.group_size) if fmt.granularity == "per_token_group" else 0,  # 0: per token (head_dim)
        "BCH": bool(fmt.is_block_wise),
        "SMOOTH": bool(fmt.smooth),
        "HAD": bool(fmt.hadamard),
        "QMIN": float(tr.sym_min),
        "QMAX": float(tr.sym_max),
        "QMAX_ASYM": float(tr.asym_max),
        "CODE_OFFSET": tr.offset(fmt.code_symmetric),  # a codebook's codes are unsigned table indices
        "LEVELS": fmt.codebook_levels,  # nuq: codes index a [kv_heads, LEVELS] table (0: none)
        "OUT": int(fmt.outliers or 0),  # outN: each sealed block-head keeps OUT outliers (0: none)
        "PRE": bool(fmt.pre_rope),  # keys stored before RoPE
        "ALLOC": fmt.allocated_bits is not None,  # allocB: each channel its own code width (rows of packed_dim bytes)
    }


def _gs(c: dict, head_dim: int) -> int:
    return c["GS"] or head_dim


def _row_bytes(spec, c: dict, head_dim: int) -> int:
    """An ``allocB`` format's bytes per row (RB; 0: not one)."""
    return _C.as_tensor_format(spec).packed_dim(head_dim) if c["ALLOC"] else 0


def seal_config(spec, head_dim: int, block_size: int) -> dict:
    from trtkv.formats import DTYPES

    c = format_constexprs(spec, ("seal",))
    return {
        "constexprs": dict(HEAD_DIM=head_dim, BLOCK_SIZE=block_size, DTYPE=c["DTYPE"], STATIC=c["STATIC"],
                           SYM=c["SYM"], GS=_gs(c, head_dim), BCH=c["BCH"], SMOOTH=c["SMOOTH"], HAD=c["HAD"],
                           QMIN=c["QMIN"], QMAX=c["QMAX"], QMAX_ASYM=c["QMAX_ASYM"], CODE_OFFSET=c["CODE_OFFSET"],
                           # outlier selection / keys before RoPE: the rotation in slices of 16 channels (registers)
                           SCALE_MAX=float(DTYPES["fp16"].sym_max), HAD_CHUNK=16 if (c["OUT"] or c["PRE"]) else 32,
                           LEVELS=c["LEVELS"], OUT=c["OUT"], PRE=c["PRE"], RB=_row_bytes(spec, c, head_dim),
                           RBP=max(16, next_pow2(_row_bytes(spec, c, head_dim)))),
        "num_warps": seal_warps(head_dim, block_size),
    }


SEAL_ELEMS_PER_WARP = 64 * 128 // 4  # a [64, 128] block on 4 warps compiles without spills on sm_80 / sm_90


def seal_warps(head_dim: int, block_size: int) -> int:
    """Warps of one seal program: the block's elements per warp at most ``SEAL_ELEMS_PER_WARP`` (a block of 128 on 4
    warps spills ~250 B of registers), at least 4, a power of two (Triton's; head dims such as 96 give other ratios)."""
    need = -(-block_size * head_dim // SEAL_ELEMS_PER_WARP)
    return max(4, 1 << (need - 1).bit_length())


def _kv_constexprs(k_spec, v_spec, head_dim: int) -> dict:
    """The attention kernels' format constexprs. ``{W}_SMOOTH`` / ``{W}_HAD`` say what is folded into the query
    (K) or the output (V) and moved into the stored space on load (open rows); keys stored before RoPE fold
    nothing -- their sealed tiles come to the model's space instead, with ``K_PRE_SMOOTH`` / ``K_PRE_HAD``."""
    out = dict(HEAD_DIM=head_dim)
    for W, spec in (("K", k_spec), ("V", v_spec)):
        c = format_constexprs(spec, ("kernels",))
        fold = not c["PRE"]
        out.update({f"{W}_DTYPE": c["DTYPE"], f"{W}_STATIC": c["STATIC"], f"{W}_SYM": c["SYM"],
                    f"{W}_GS": _gs(c, head_dim), f"{W}_BCH": c["BCH"], f"{W}_OFF": c["CODE_OFFSET"],
                    f"{W}_SMOOTH": c["SMOOTH"] and fold, f"{W}_HAD": c["HAD"] and fold,
                    f"{W}_LEVELS": c["LEVELS"], f"{W}_OUT": c["OUT"],
                    f"{W}_RB": _row_bytes(spec, c, head_dim)})
        if W == "K":
            out.update(K_PRE=c["PRE"], K_PRE_SMOOTH=c["SMOOTH"] and c["PRE"], K_PRE_HAD=c["HAD"] and c["PRE"])
        elif c["PRE"]:
            raise TrtkvError(f"{_C.as_tensor_format(spec).short()}: values are never stored before RoPE", "drop prerope from v=")
    return out


def _sealed_stages(kv: dict) -> int | None:
    """Pipelining stages of the sealed loop: one for keys stored before RoPE or outlier lists (their per-tile slices
    of H and one-hot operands would be multi-buffered in shared memory: ~350 KiB at head_dim 128) and for rows of
    per-channel widths (their gathered byte pairs spilled 144 B at 4 warps, sm_90), else the launch's."""
    return 1 if (kv["K_PRE"] or kv["K_OUT"] or kv["V_OUT"] or kv["K_RB"] or kv["V_RB"]) else None


def _key_tile(block_n: int, kv: dict, block_size: int | None, interpret: bool) -> int:
    """The sealed loop's key tile: formats with outlier lists read one block's list per tile, so the tile divides
    the block size (the kernels' block sizes are powers of two from 16, ``LIMITS``); on GPUs those and keys stored
    before RoPE take tiles of 32 rows (their per-tile products need the registers)."""
    if _sealed_stages(kv) == 1 and not interpret:
        block_n = min(block_n, 32)
    if (kv["K_OUT"] or kv["V_OUT"]) and block_size:
        return min(block_n, block_size)
    return block_n


DEFAULT_PARTITION = _C.LIMITS.default_partition


def decode_config(k_spec, v_spec, head_dim: int, gqa_ratio: int, partition_size: int = DEFAULT_PARTITION,
                  precision: str = "ieee", interpret: bool = False, window: bool = False,
                  softcap: bool = False, block_size: int | None = None) -> dict:
    """Constexprs of the two decode kernels (``partition_size``: contract.LIMITS); ``window`` / ``softcap``: compile
    the sliding window's / soft-cap's code (the WINDOW / SOFTCAP flags; their values are runtime arguments);
    ``block_size``: the cache's (formats with outlier lists tile within a block, ``_key_tile``)."""
    kv = _kv_constexprs(k_spec, v_spec, head_dim)
    block_h = max(16, next_pow2(gqa_ratio))
    block_n = 64 if (interpret or head_dim <= 64) else 32
    block_n = _key_tile(min(block_n, partition_size), kv, block_size, interpret)
    problem = _C.LIMITS.partition_problem(partition_size)
    if problem or partition_size % block_n:
        raise ValueError(f"partition_size {partition_size} {problem or 'must be a multiple of the key tile'}")
    part = dict(kv)
    # OPEN_N: key tile of the open block (at most block_size rows): small, so that its fp16 loads and the
    # transforms into the stored space add few registers to the sealed loop's (no spills, see aot.py)
    # HAD_CHUNK 16: the query fold and the open rows' rotation hold [16, head_dim] slices of H (32 spills at
    # head_dim 128 when K and V are both rotated, sm_90)
    part.update(BLOCK_H=block_h, BLOCK_N=block_n, PARTITION=partition_size, PREC=precision, HAD_CHUNK=16,
                OPEN_N=16, WINDOW=bool(window), SOFTCAP=bool(softcap), SEALED_STAGES=_sealed_stages(kv))
    red = dict(HEAD_DIM=head_dim, V_STATIC=kv["V_STATIC"], V_SMOOTH=kv["V_SMOOTH"], V_HAD=kv["V_HAD"],
               BLOCK_H=block_h, PARTITION=partition_size, HAD_CHUNK=32)
    # keys brought to model space per tile / outlier lists written over it: twice the registers (8 warps)
    warps = 8 if part["SEALED_STAGES"] == 1 else 4
    return {"partition": {"constexprs": part, "num_warps": warps}, "reduce": {"constexprs": red, "num_warps": 4}}


def prefill_config(k_spec, v_spec, head_dim: int, gqa_ratio: int, precision: str = "ieee",
                   interpret: bool = False, window: bool = False, softcap: bool = False,
                   block_size: int | None = None) -> dict:
    """Constexprs of the prefill kernel (``window`` / ``softcap`` as for ``decode_config``). Rows of a program =
    BLOCK_M tokens x BLOCK_H heads (>= 16).

    Tile sizes keep ptxas from spilling on sm_80 / sm_90 (see plugins/aot.py): "tf32" dots take 64 rows,
    "tf32x3" / "ieee" (3x the operand registers) 16 rows."""
    kv = _kv_constexprs(k_spec, v_spec, head_dim)
    block_h = next_pow2(gqa_ratio)
    if interpret:
        rows, block_n, warps = 64, 64, 4  # the interpreter pays per operation, not per element
    elif precision == "tf32":
        rows, block_n, warps = 64, (64 if head_dim <= 64 else 32), (4 if head_dim <= 64 else 8)
    else:
        rows, block_n, warps = 16, 32, 4
    if _sealed_stages(kv) == 1 and not interpret:  # keys brought to model space / outlier lists: 16 rows, 8 warps
        rows, warps = min(rows, 16), 8
    block_m = max(1, rows // block_h, 16 // block_h)
    block_n = _key_tile(block_n, kv, block_size, interpret)
    kv.update(BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_N=block_n, PREC=precision, HAD_CHUNK=32, OPEN_N=16,
              WINDOW=bool(window), SOFTCAP=bool(softcap), SEALED_STAGES=_sealed_stages(kv))
    return {"constexprs": kv, "num_warps": warps}


# --------------------------------------------------------------------------------------------
# compiled / interpreted copies of this module
# --------------------------------------------------------------------------------------------

_COPIES: dict[bool, ModuleType] = {}
# how this module's @triton.jit resolved at import (TRITON_INTERPRET may be set later, e.g. by a test)
_IMPORTED_INTERPRETED = bool(triton.knobs.runtime.interpret)


def load_kernels(interpret: bool) -> ModuleType:
    """This module with ``triton.jit`` resolved for the GPU (interpret=False) or the interpreter.

    triton decides between compiled and interpreted kernels when ``@triton.jit`` runs, i.e. at import;
    loading a private copy of the file under the opposite setting gives both in one process.
    """
    if interpret in _COPIES:
        return _COPIES[interpret]
    from triton import knobs

    this = sys.modules[__name__]
    if _IMPORTED_INTERPRETED == interpret:
        mod = this
    else:
        name = f"{__name__}_{'interp' if interpret else 'compiled'}"
        spec = importlib.util.spec_from_file_location(name, __file__)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        with knobs.runtime.scope():
            knobs.runtime.interpret = interpret
            spec.loader.exec_module(mod)
        sys.modules[name] = mod
    _COPIES[interpret] = mod
    return mod


__all__ = [
    "seal_kernel",
    "paged_decode_partition_kernel",
    "paged_decode_reduce_kernel",
    "paged_prefill_kernel",
    "format_constexprs",
    "seal_config",
    "decode_config",
    "prefill_config",
    "load_kernels",
    "LOG2E",
]
