"""Fused quantized-KV kernels in OpenAI Triton: quantize-and-append, paged decode (split-K) and prefill attention.

Everything here reads the pool layout of ``trtkv.cache_layout`` and reproduces the math of
``trtkv.quant`` (see ``trtkv.plugins.reference`` for the torch definitions the tests hold these to):

    data  [num_blocks, kv_heads, block_size, packed_dim]   int8 | uint8 | fp16
    scale [num_blocks, kv_heads, block_size, groups]       fp16 (dynamic formats)
    zero  [num_blocks, kv_heads, block_size, groups]       fp16 (asymmetric dynamic formats)
    row of (block, head, offset) = (block * kv_heads + head) * block_size + offset

A stored tensor format enters a kernel as five constexprs (``DTYPE`` one of "fp16", "int8", "int4",
"fp8_e4m3"; ``STATIC``; ``SYM``; ``GS`` the dynamic group size, head_dim for per-token) plus the
transform flags. Static scales (per tensor, per head or per channel) always arrive expanded to a
``[kv_heads, head_dim]`` float32 tensor, so one code path serves the three granularities.

Channel halves. Every attention kernel works on the even and odd channels of head_dim separately
(``lo`` = channels 0, 2, 4, ..., ``hi`` = 1, 3, 5, ...): packed int4 bytes hold exactly that pair, so
unpacking costs two bit operations and no register shuffle; the dot products are split in two
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

LOG2E = 1.4426950408889634
FP16_MAX = 65504.0

# code ranges per storage dtype (mirrors trtkv.formats.DTYPES; checked in tests)
SYM_MAX = {"int8": 127.0, "int4": 7.0, "fp8_e4m3": 448.0}
SYM_MIN = {"int8": -128.0, "int4": -8.0, "fp8_e4m3": -448.0}
ASYM_MAX = {"int8": 255.0, "int4": 15.0}


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
def _fp16_round(x):
    """The fp32 value an fp16 scale slot stores (clamp to the finite range, round to nearest even)."""
    return tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16).to(tl.float32)


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


# --------------------------------------------------------------------------------------------
# 1. quantize and append
# --------------------------------------------------------------------------------------------


@triton.jit
def quantize_append_kernel(
    x_ptr,  # [tokens, kv_heads, head_dim] fp16 / bf16 / fp32, contiguous
    slot_ptr,  # [tokens] int32 / int64 flat slots, < 0 = padding
    data_ptr,  # [num_blocks, kv_heads, block_size, packed_dim]
    scale_ptr,  # [num_blocks, kv_heads, block_size, groups] fp16 (dynamic; else dummy)
    zero_ptr,  # same, asymmetric dynamic only (else dummy)
    static_scale_ptr,  # [kv_heads, head_dim] fp32 (static; else dummy)
    smooth_ptr,  # [kv_heads, head_dim] fp32 (SMOOTH; else dummy)
    clip_ptr,  # [kv_heads] fp32 range multiplier (dynamic; else dummy)
    had_ptr,  # [head_dim, head_dim] fp32 Hadamard (HAD; else dummy)
    num_tokens,
    num_kv_heads,
    block_size,
    HEAD_DIM: tl.constexpr,
    DTYPE: tl.constexpr,
    STATIC: tl.constexpr,
    SYM: tl.constexpr,
    GS: tl.constexpr,
    SMOOTH: tl.constexpr,
    HAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAD_CHUNK: tl.constexpr = 32,
):
    """grid = (cdiv(tokens, BLOCK_T), kv_heads). Quantizes BLOCK_T rows of one KV head and scatters them."""
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=tmask, other=-1).to(tl.int64)
    valid = tmask & (slot >= 0)
    slot = tl.where(valid, slot, 0)
    dst = (slot // block_size * num_kv_heads + h) * block_size + slot % block_size  # [BLOCK_T] pool rows
    cols = tl.arange(0, HEAD_DIM)
    src = (t.to(tl.int64) * num_kv_heads + h) * HEAD_DIM
    if DTYPE == "fp16":
        x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=valid[:, None], other=0.0)
        tl.store(data_ptr + dst[:, None] * HEAD_DIM + cols[None, :], x.to(tl.float16), mask=valid[:, None])
    else:
        if HAD:
            # x @ H accumulated over HAD_CHUNK input channels: registers hold a [HAD_CHUNK, HEAD_DIM] slice of H
            x = tl.full([BLOCK_T, HEAD_DIM], 0.0, tl.float32)
            for c0 in range(0, HEAD_DIM, HAD_CHUNK):
                kk = c0 + tl.arange(0, HAD_CHUNK)
                xc = tl.load(x_ptr + src[:, None] + kk[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
                if SMOOTH:
                    xc = tl.div_rn(xc, tl.load(smooth_ptr + h * HEAD_DIM + kk)[None, :])
                hm = tl.load(had_ptr + kk[:, None] * HEAD_DIM + cols[None, :])
                x = tl.dot(xc, hm, x, input_precision="ieee")
        else:
            x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            if SMOOTH:
                x = tl.div_rn(x, tl.load(smooth_ptr + h * HEAD_DIM + cols)[None, :])

        if DTYPE == "int8":
            lo_c: tl.constexpr = -128.0
            hi_c: tl.constexpr = 127.0
            amax_c: tl.constexpr = 255.0
        elif DTYPE == "int4":
            lo_c: tl.constexpr = -8.0
            hi_c: tl.constexpr = 7.0
            amax_c: tl.constexpr = 15.0
        else:
            lo_c: tl.constexpr = -448.0
            hi_c: tl.constexpr = 448.0
            amax_c: tl.constexpr = 0.0

        if STATIC:
            sc = tl.load(static_scale_ptr + h * HEAD_DIM + cols)
            inv = tl.where(sc > 0, tl.div_rn(tl.full([HEAD_DIM], 1.0, tl.float32), tl.where(sc > 0, sc, 1.0)), 0.0)
            y = tl.minimum(tl.maximum(x * inv[None, :], lo_c), hi_c)
        else:
            G: tl.constexpr = HEAD_DIM // GS
            xg = tl.reshape(x, [BLOCK_T, G, GS])
            clip = tl.load(clip_ptr + h)
            if SYM:
                amax = _rmax(tl.abs(xg), 2)
                scale = _fp16_round(tl.div_rn(amax * clip, tl.full([BLOCK_T, G], hi_c, tl.float32)))
                inv = tl.where(scale > 0, tl.div_rn(tl.full([BLOCK_T, G], 1.0, tl.float32), tl.where(scale > 0, scale, 1.0)), 0.0)
                yg = tl.minimum(tl.maximum(xg * inv[:, :, None], lo_c), hi_c)
            else:
                mn = _rmin(xg, 2)
                mx = _rmax(xg, 2)
                rng = mx - mn
                # trtkv.quant: zero = fp16(mn + rng * (1 - clip) / 2) (== fp16(mn) unclipped), scale = fp16(rng * clip / qmax)
                zero = _fp16_round(mn + rng * (1.0 - clip) * 0.5)
                scale = _fp16_round(tl.div_rn(rng * clip, tl.full([BLOCK_T, G], amax_c, tl.float32)))
                inv = tl.where(scale > 0, tl.div_rn(tl.full([BLOCK_T, G], 1.0, tl.float32), tl.where(scale > 0, scale, 1.0)), 0.0)
                yg = tl.minimum(tl.maximum((xg - zero[:, :, None]) * inv[:, :, None], 0.0), amax_c)
                g_off = tl.arange(0, G)
                tl.store(zero_ptr + dst[:, None] * G + g_off[None, :], zero.to(tl.float16), mask=valid[:, None])
            g_off = tl.arange(0, G)
            tl.store(scale_ptr + dst[:, None] * G + g_off[None, :], scale.to(tl.float16), mask=valid[:, None])
            y = tl.reshape(yg, [BLOCK_T, HEAD_DIM])

        if DTYPE == "fp8_e4m3":
            code = _fp8e4m3_encode(y)
            tl.store(data_ptr + dst[:, None] * HEAD_DIM + cols[None, :], code, mask=valid[:, None])
        elif DTYPE == "int8":
            q = _rint(y).to(tl.int32)
            if SYM or STATIC:
                tl.store(data_ptr + dst[:, None] * HEAD_DIM + cols[None, :], q.to(tl.int8), mask=valid[:, None])
            else:
                tl.store(data_ptr + dst[:, None] * HEAD_DIM + cols[None, :], q.to(tl.uint8), mask=valid[:, None])
        else:
            q = _rint(y).to(tl.int32)
            if SYM or STATIC:
                q = q + 8
            lo, hi = tl.split(tl.reshape(q, [BLOCK_T, HEAD_DIM // 2, 2]))
            packed = (lo | (hi << 4)).to(tl.uint8)
            pcols = tl.arange(0, HEAD_DIM // 2)
            tl.store(data_ptr + dst[:, None] * (HEAD_DIM // 2) + pcols[None, :], packed, mask=valid[:, None])


# --------------------------------------------------------------------------------------------
# 2./3. attention over the paged pool (shared pieces)
# --------------------------------------------------------------------------------------------


@triton.jit
def _load_halves(data_ptr, scale_ptr, zero_ptr, row, mask,
                 HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr, STATIC: tl.constexpr, SYM: tl.constexpr,
                 GS: tl.constexpr):
    """Even / odd channels of pool rows ``row`` [N] as fp32 [N, HEAD_DIM//2], dynamic scales applied
    (static scales are folded into the query / output by the callers). Rows are read contiguously
    (vectorized) and split in registers."""
    HALF: tl.constexpr = HEAD_DIM // 2
    m2 = mask[:, None]
    N: tl.constexpr = row.shape[0]
    if DTYPE == "int4":
        j = tl.arange(0, HALF)
        b = tl.load(data_ptr + row[:, None] * HALF + j[None, :], mask=m2, other=0).to(tl.int32)
        lo = (b & 15).to(tl.float32)
        hi = (b >> 4).to(tl.float32)
        if SYM or STATIC:
            lo = lo - 8.0
            hi = hi - 8.0
    else:
        cols = tl.arange(0, HEAD_DIM)
        c = _codes_to_float(tl.load(data_ptr + row[:, None] * HEAD_DIM + cols[None, :], mask=m2, other=0), DTYPE)
        lo, hi = tl.split(tl.reshape(c, [N, HALF, 2]))
    if DTYPE != "fp16":
        if not STATIC:
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
def _attend(q_lo, q_hi, qpos, m_i, l_i, acc_lo, acc_hi, kv_start, kv_end,
            bt_row_ptr, kvh, num_kv_heads, block_size, new_row0, past,
            k_data_ptr, k_scale_ptr, k_zero_ptr, v_data_ptr, v_scale_ptr, v_zero_ptr,
            HEAD_DIM: tl.constexpr,
            K_DTYPE: tl.constexpr, K_STATIC: tl.constexpr, K_SYM: tl.constexpr, K_GS: tl.constexpr,
            V_DTYPE: tl.constexpr, V_STATIC: tl.constexpr, V_SYM: tl.constexpr, V_GS: tl.constexpr,
            BLOCK_N: tl.constexpr, PREC: tl.constexpr, FROM_NEW: tl.constexpr):
    """Online softmax (base 2) of the query rows over keys [kv_start, kv_end), causal on ``qpos`` [M].

    Keys come from the paged pool through the block table, or (FROM_NEW) from this step's new rows
    ``[tokens, kv_heads, ...]``: position ``pos`` is new row ``new_row0 + pos - past``."""
    for start in range(kv_start, kv_end, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < kv_end
        if FROM_NEW:
            row = (new_row0 + (kpos - past)).to(tl.int64) * num_kv_heads + kvh
        else:
            blk = tl.load(bt_row_ptr + kpos // block_size, mask=kmask, other=0).to(tl.int64)
            row = (blk * num_kv_heads + kvh) * block_size + kpos % block_size
        k_lo, k_hi = _load_halves(k_data_ptr, k_scale_ptr, k_zero_ptr, row, kmask,
                                  HEAD_DIM, K_DTYPE, K_STATIC, K_SYM, K_GS)
        s = tl.dot(q_lo, tl.trans(k_lo), input_precision=PREC)
        s = tl.dot(q_hi, tl.trans(k_hi), s, input_precision=PREC)
        ok = kmask[None, :] & (kpos[None, :] <= qpos[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, _rmax(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + _rsum(p, 1)
        v_lo, v_hi = _load_halves(v_data_ptr, v_scale_ptr, v_zero_ptr, row, kmask,
                                  HEAD_DIM, V_DTYPE, V_STATIC, V_SYM, V_GS)
        acc_lo = tl.dot(p, v_lo, acc_lo * alpha[:, None], input_precision=PREC)
        acc_hi = tl.dot(p, v_hi, acc_hi * alpha[:, None], input_precision=PREC)
        m_i = m_new
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
    k_data_ptr, k_scale_ptr, k_zero_ptr,  # the paged pool (read only)
    v_data_ptr, v_scale_ptr, v_zero_ptr,
    k_new_data_ptr, k_new_scale_ptr, k_new_zero_ptr,  # NEW_ROWS: this step's rows [batch, kv_heads, ...]
    v_new_data_ptr, v_new_scale_ptr, v_new_zero_ptr,  # (else dummies)
    k_static_ptr,  # [kv_heads, head_dim] fp32 (K_STATIC; else dummy)
    k_smooth_ptr,  # [kv_heads, head_dim] fp32 (K_SMOOTH; else dummy)
    had_ptr,  # [head_dim, head_dim] fp32 (K_HAD; else dummy)
    block_table_ptr,  # [batch, max_blocks] int32
    context_lens_ptr,  # [batch] int32
    part_m_ptr,  # [batch, heads, num_partitions] fp32 running max (log2 domain)
    part_l_ptr,  # [batch, heads, num_partitions] fp32 softmax denominators
    part_acc_ptr,  # [batch, heads, num_partitions, head_dim] fp32 unnormalized outputs (stored channel space)
    qk_scale,  # fp32: sm_scale * log2(e)
    num_heads,
    num_kv_heads,
    block_size,
    max_blocks,
    num_partitions,
    HEAD_DIM: tl.constexpr,
    K_DTYPE: tl.constexpr, K_STATIC: tl.constexpr, K_SYM: tl.constexpr, K_GS: tl.constexpr,
    K_SMOOTH: tl.constexpr, K_HAD: tl.constexpr,
    V_DTYPE: tl.constexpr, V_STATIC: tl.constexpr, V_SYM: tl.constexpr, V_GS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
    PREC: tl.constexpr,
    HAD_CHUNK: tl.constexpr = 32,
    NEW_ROWS: tl.constexpr = False,
):
    """grid = (batch, kv_heads, num_partitions). One program: all query heads of one KV head over
    PARTITION context tokens; partitions past the context write nothing (the reduction skips them).
    NEW_ROWS (pure-engine contract): the last position, context_len - 1, is read from new row ``b``
    instead of the pool (the pool is not written before the step)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    kv_start = part * PARTITION
    if kv_start < ctx:
        kv_end = tl.minimum(kv_start + PARTITION, ctx)
        ratio = num_heads // num_kv_heads
        hh = tl.arange(0, BLOCK_H)
        hmask = hh < ratio
        qh = kvh * ratio + hh
        cols = tl.arange(0, HEAD_DIM)
        q_lo, q_hi = _load_query(q_ptr, (b * num_heads + qh).to(tl.int64), hmask, kvh, k_smooth_ptr, k_static_ptr,
                                 had_ptr, qk_scale, BLOCK_H, HEAD_DIM, K_STATIC, K_SMOOTH, K_HAD, HAD_CHUNK)
        qpos = tl.full([BLOCK_H], 0, tl.int32) + (ctx - 1)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_H], 0.0, tl.float32)
        acc_lo = tl.full([BLOCK_H, HEAD_DIM // 2], 0.0, tl.float32)
        acc_hi = tl.full([BLOCK_H, HEAD_DIM // 2], 0.0, tl.float32)
        bt_row = block_table_ptr + b.to(tl.int64) * max_blocks
        if NEW_ROWS:
            past = ctx - 1
            m_i, l_i, acc_lo, acc_hi = _attend(
                q_lo, q_hi, qpos, m_i, l_i, acc_lo, acc_hi, kv_start, tl.minimum(kv_end, past),
                bt_row, kvh, num_kv_heads, block_size, b, past,
                k_data_ptr, k_scale_ptr, k_zero_ptr, v_data_ptr, v_scale_ptr, v_zero_ptr,
                HEAD_DIM, K_DTYPE, K_STATIC, K_SYM, K_GS, V_DTYPE, V_STATIC, V_SYM, V_GS, BLOCK_N, PREC, False)
            m_i, l_i, acc_lo, acc_hi = _attend(
                q_lo, q_hi, qpos, m_i, l_i, acc_lo, acc_hi, tl.maximum(kv_start, past), kv_end,
                bt_row, kvh, num_kv_heads, block_size, b, past,
                k_new_data_ptr, k_new_scale_ptr, k_new_zero_ptr, v_new_data_ptr, v_new_scale_ptr, v_new_zero_ptr,
                HEAD_DIM, K_DTYPE, K_STATIC, K_SYM, K_GS, V_DTYPE, V_STATIC, V_SYM, V_GS, BLOCK_N, PREC, True)
        else:
            m_i, l_i, acc_lo, acc_hi = _attend(
                q_lo, q_hi, qpos, m_i, l_i, acc_lo, acc_hi, kv_start, kv_end,
                bt_row, kvh, num_kv_heads, block_size, 0, 0,
                k_data_ptr, k_scale_ptr, k_zero_ptr, v_data_ptr, v_scale_ptr, v_zero_ptr,
                HEAD_DIM, K_DTYPE, K_STATIC, K_SYM, K_GS, V_DTYPE, V_STATIC, V_SYM, V_GS, BLOCK_N, PREC, False)
        prow = (b * num_heads + qh).to(tl.int64) * num_partitions + part
        tl.store(part_m_ptr + prow, m_i, mask=hmask)
        tl.store(part_l_ptr + prow, l_i, mask=hmask)
        acc = _join_halves(acc_lo, acc_hi, BLOCK_H, HEAD_DIM)
        tl.store(part_acc_ptr + prow[:, None] * HEAD_DIM + cols[None, :], acc, mask=hmask[:, None])


@triton.jit
def paged_decode_reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr,  # from paged_decode_partition_kernel
    context_lens_ptr,  # [batch] int32
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
    """grid = (batch, kv_heads). Merges the partitions of each query head (log-sum-exp), normalizes,
    undoes V's static scale / Hadamard / smoothing. A context of length 0 gives zeros."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + b)
    used = (ctx + PARTITION - 1) // PARTITION
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
    cu_seqlens_q_ptr,  # [batch + 1] int32: sequence b's queries are rows cu[b] .. cu[b+1]-1
    k_data_ptr, k_scale_ptr, k_zero_ptr,  # the paged pool (read only)
    v_data_ptr, v_scale_ptr, v_zero_ptr,
    k_new_data_ptr, k_new_scale_ptr, k_new_zero_ptr,  # NEW_ROWS: this step's rows [total_q, kv_heads, ...]
    v_new_data_ptr, v_new_scale_ptr, v_new_zero_ptr,  # (else dummies)
    k_static_ptr, k_smooth_ptr, v_static_ptr, v_smooth_ptr,  # [kv_heads, head_dim] fp32 or dummies
    had_ptr,  # [head_dim, head_dim] fp32 or dummy
    block_table_ptr,  # [batch, max_blocks] int32
    context_lens_ptr,  # [batch] int32, the new tokens included (they are the last num_new of the context)
    out_ptr,  # [total_q, heads, head_dim]
    qk_scale,
    num_heads,
    num_kv_heads,
    block_size,
    max_blocks,
    HEAD_DIM: tl.constexpr,
    K_DTYPE: tl.constexpr, K_STATIC: tl.constexpr, K_SYM: tl.constexpr, K_GS: tl.constexpr,
    K_SMOOTH: tl.constexpr, K_HAD: tl.constexpr,
    V_DTYPE: tl.constexpr, V_STATIC: tl.constexpr, V_SYM: tl.constexpr, V_GS: tl.constexpr,
    V_SMOOTH: tl.constexpr, V_HAD: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_H: tl.constexpr,  # query heads per KV head, padded to a power of two
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    HAD_CHUNK: tl.constexpr = 32,
    NEW_ROWS: tl.constexpr = False,
):
    """grid = (cdiv(max_seqlen_q, BLOCK_M), kv_heads, batch). Rows of a program are (token, head)
    pairs: BLOCK_M query tokens x the BLOCK_H heads sharing one KV head (GQA reads K/V once).
    NEW_ROWS (pure-engine contract): positions context_len - num_new .. context_len - 1 are read from
    new rows cu[b] .. cu[b+1]-1 instead of the pool."""
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
        qpos = ctx - num_new + tok
        kv_end = tl.minimum(ctx, ctx - num_new + m0 + BLOCK_M)
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.full([M], 0.0, tl.float32)
        acc_lo = tl.full([M, HEAD_DIM // 2], 0.0, tl.float32)
        acc_hi = tl.full([M, HEAD_DIM // 2], 0.0, tl.float32)
        bt_row = block_table_ptr + b.to(tl.int64) * max_blocks
        past = ctx - num_new
        if NEW_ROWS:
            m_i, l_i, acc_lo, acc_hi = _attend(
                q_lo, q_hi, qpos, m_i, l_i, acc_lo, acc_hi, 0, tl.minimum(kv_end, past),
                bt_row, kvh, num_kv_heads, block_size, q_begin, past,
                k_data_ptr, k_scale_ptr, k_zero_ptr, v_data_ptr, v_scale_ptr, v_zero_ptr,
                HEAD_DIM, K_DTYPE, K_STATIC, K_SYM, K_GS, V_DTYPE, V_STATIC, V_SYM, V_GS, BLOCK_N, PREC, False)
            m_i, l_i, acc_lo, acc_hi = _attend(
                q_lo, q_hi, qpos, m_i, l_i, acc_lo, acc_hi, tl.maximum(past, 0), kv_end,
                bt_row, kvh, num_kv_heads, block_size, q_begin, past,
                k_new_data_ptr, k_new_scale_ptr, k_new_zero_ptr, v_new_data_ptr, v_new_scale_ptr, v_new_zero_ptr,
                HEAD_DIM, K_DTYPE, K_STATIC, K_SYM, K_GS, V_DTYPE, V_STATIC, V_SYM, V_GS, BLOCK_N, PREC, True)
        else:
            m_i, l_i, acc_lo, acc_hi = _attend(
                q_lo, q_hi, qpos, m_i, l_i, acc_lo, acc_hi, 0, kv_end,
                bt_row, kvh, num_kv_heads, block_size, q_begin, past,
                k_data_ptr, k_scale_ptr, k_zero_ptr, v_data_ptr, v_scale_ptr, v_zero_ptr,
                HEAD_DIM, K_DTYPE, K_STATIC, K_SYM, K_GS, V_DTYPE, V_STATIC, V_SYM, V_GS, BLOCK_N, PREC, False)
        inv_l = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
        out = _join_halves(acc_lo, acc_hi, M, HEAD_DIM) * inv_l[:, None]
        _store_output(out_ptr, qrow, rmask, out, kvh, v_static_ptr, v_smooth_ptr, had_ptr,
                      HEAD_DIM, V_STATIC, V_SMOOTH, V_HAD, HAD_CHUNK)


# --------------------------------------------------------------------------------------------
# launch configuration (shared by ops.py and aot.py)
# --------------------------------------------------------------------------------------------


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def format_constexprs(spec) -> dict:
    """A TensorFormat (or its short spec string) -> the DTYPE/STATIC/SYM/GS/SMOOTH/HAD constexprs."""
    from trtkv.formats import TensorFormat, parse_tensor_spec

    fmt = spec if isinstance(spec, TensorFormat) else parse_tensor_spec(spec)
    return {
        "DTYPE": fmt.dtype,
        "STATIC": bool(fmt.is_static),
        "SYM": bool(fmt.symmetric or fmt.is_static),
        "GS": int(fmt.group_size) if fmt.granularity == "per_token_group" else 0,  # 0: per token (head_dim)
        "SMOOTH": bool(fmt.smooth),
        "HAD": bool(fmt.hadamard),
    }


def _gs(c: dict, head_dim: int) -> int:
    return c["GS"] or head_dim


def append_config(spec, head_dim: int, interpret: bool = False) -> dict:
    c = format_constexprs(spec)
    return {
        "constexprs": dict(HEAD_DIM=head_dim, DTYPE=c["DTYPE"], STATIC=c["STATIC"], SYM=c["SYM"], GS=_gs(c, head_dim),
                           SMOOTH=c["SMOOTH"], HAD=c["HAD"], BLOCK_T=64 if interpret else 16, HAD_CHUNK=32),
        "num_warps": 4,
    }


def append_grid(num_tokens: int, num_kv_heads: int, constexprs: dict) -> tuple[int, int, int]:
    return (triton.cdiv(num_tokens, constexprs["BLOCK_T"]), num_kv_heads, 1)


def _kv_constexprs(k_spec, v_spec, head_dim: int) -> dict:
    k, v = format_constexprs(k_spec), format_constexprs(v_spec)
    return dict(HEAD_DIM=head_dim,
                K_DTYPE=k["DTYPE"], K_STATIC=k["STATIC"], K_SYM=k["SYM"], K_GS=_gs(k, head_dim),
                K_SMOOTH=k["SMOOTH"], K_HAD=k["HAD"],
                V_DTYPE=v["DTYPE"], V_STATIC=v["STATIC"], V_SYM=v["SYM"], V_GS=_gs(v, head_dim),
                V_SMOOTH=v["SMOOTH"], V_HAD=v["HAD"])


DEFAULT_PARTITION = 512


def decode_config(k_spec, v_spec, head_dim: int, gqa_ratio: int, partition_size: int = DEFAULT_PARTITION,
                  precision: str = "ieee", interpret: bool = False, new_rows: bool = True) -> dict:
    """Constexprs of the two decode kernels. ``partition_size`` is a power of two >= 16.

    ``new_rows`` (default: the pure-engine contract of the TensorRT plugins) reads the newest token from
    this step's new rows instead of the pool; the torch launchers pass False when the pool already holds it."""
    kv = _kv_constexprs(k_spec, v_spec, head_dim)
    block_h = max(16, next_pow2(gqa_ratio))
    block_n = 64 if (interpret or head_dim <= 64) else 32
    block_n = min(block_n, partition_size)
    if partition_size % block_n or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size {partition_size} must be a power of two >= 16")
    part = {k: v for k, v in kv.items() if k not in ("V_SMOOTH", "V_HAD")}
    part.update(BLOCK_H=block_h, BLOCK_N=block_n, PARTITION=partition_size, PREC=precision, HAD_CHUNK=32,
                NEW_ROWS=bool(new_rows))
    red = dict(HEAD_DIM=head_dim, V_STATIC=kv["V_STATIC"], V_SMOOTH=kv["V_SMOOTH"], V_HAD=kv["V_HAD"],
               BLOCK_H=block_h, PARTITION=partition_size, HAD_CHUNK=32)
    return {"partition": {"constexprs": part, "num_warps": 4}, "reduce": {"constexprs": red, "num_warps": 4}}


def num_partitions(max_context_len: int, partition_size: int = DEFAULT_PARTITION) -> int:
    return max(1, triton.cdiv(int(max_context_len), partition_size))


def decode_grids(batch: int, num_kv_heads: int, max_context_len: int, partition_size: int = DEFAULT_PARTITION):
    """(partition grid, reduce grid); max_context_len bounds the context (e.g. max_blocks * block_size)."""
    return (batch, num_kv_heads, num_partitions(max_context_len, partition_size)), (batch, num_kv_heads, 1)


def prefill_config(k_spec, v_spec, head_dim: int, gqa_ratio: int, precision: str = "ieee",
                   interpret: bool = False, new_rows: bool = True) -> dict:
    """Constexprs of the prefill kernel. Rows of a program = BLOCK_M tokens x BLOCK_H heads (>= 16).

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
    block_m = max(1, rows // block_h, 16 // block_h)
    kv.update(BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_N=block_n, PREC=precision, HAD_CHUNK=32,
              NEW_ROWS=bool(new_rows))
    return {"constexprs": kv, "num_warps": warps}


def prefill_grid(max_seqlen_q: int, num_kv_heads: int, batch: int, constexprs: dict) -> tuple[int, int, int]:
    """max_seqlen_q may be any upper bound (e.g. total_q_tokens): extra programs exit at once."""
    return (max(1, triton.cdiv(int(max_seqlen_q), constexprs["BLOCK_M"])), num_kv_heads, batch)


# --------------------------------------------------------------------------------------------
# compiled / interpreted copies of this module
# --------------------------------------------------------------------------------------------

_COPIES: dict[bool, ModuleType] = {}


def load_kernels(interpret: bool) -> ModuleType:
    """This module with ``triton.jit`` resolved for the GPU (interpret=False) or the interpreter.

    triton decides between compiled and interpreted kernels when ``@triton.jit`` runs, i.e. at import;
    loading a private copy of the file under the opposite setting gives both in one process.
    """
    if interpret in _COPIES:
        return _COPIES[interpret]
    from triton import knobs

    this = sys.modules[__name__]
    if bool(knobs.runtime.interpret) == interpret:
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
    "quantize_append_kernel",
    "paged_decode_partition_kernel",
    "paged_decode_reduce_kernel",
    "paged_prefill_kernel",
    "format_constexprs",
    "append_config",
    "append_grid",
    "decode_config",
    "decode_grids",
    "num_partitions",
    "prefill_config",
    "prefill_grid",
    "load_kernels",
    "LOG2E",
]
