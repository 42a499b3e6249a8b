"""Torch references for the kernels in ``trtkv.plugins.kernels``, built on ``trtkv.quant`` / ``trtkv.cache_layout``.

These are the definitions the kernels are tested against and the CPU fallback of the custom ops:
quantize-and-append is ``cache_layout.write_paged``; attention dequantizes each sequence with
``cache_layout.gather_paged`` (transforms undone, float32) and runs softmax attention in float64.
Arguments mirror the custom ops: pools as raw tensors, formats as spec strings
(``TensorFormat.short()``), calibrated constants as optional tensors.
"""

from __future__ import annotations

import math

import torch

from trtkv.cache_layout import KVPool, PagedKVLayout, gather_paged, write_paged
from trtkv.formats import KVFormat, TensorFormat, parse_tensor_spec
from trtkv.quant import TensorParams


def as_tensor_format(spec: str | TensorFormat) -> TensorFormat:
    return spec if isinstance(spec, TensorFormat) else parse_tensor_spec(spec)


def layout_for(k_fmt: TensorFormat, v_fmt: TensorFormat, data: torch.Tensor, head_dim: int) -> PagedKVLayout:
    """A PagedKVLayout matching pool tensors ``data`` [num_blocks, kv_heads, block_size, packed_dim]."""
    nb, kvh, bs, _ = data.shape
    fmt = KVFormat(name="kernel", k=k_fmt, v=v_fmt)
    return PagedKVLayout(fmt=fmt, num_kv_heads=kvh, head_dim=head_dim, block_size=bs, num_blocks=nb)


def make_params(static_scale: torch.Tensor | None = None, smooth: torch.Tensor | None = None,
                clip: torch.Tensor | None = None) -> TensorParams:
    return TensorParams(scale=static_scale, smooth=smooth, clip=clip)


def quantize_append_ref(
    rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    fmt: str | TensorFormat,
    static_scale: torch.Tensor | None = None,
    smooth: torch.Tensor | None = None,
    clip: torch.Tensor | None = None,
) -> None:
    """``write_paged`` on raw pool tensors (in place)."""
    tf = as_tensor_format(fmt)
    layout = layout_for(tf, TensorFormat(dtype="fp16"), data, rows.shape[-1])
    write_paged(layout, "k", KVPool(data, scale, zero), rows, slot_mapping, make_params(static_scale, smooth, clip))


def dequantized_sequence(layout: PagedKVLayout, which: str, pool: KVPool, block_row: torch.Tensor, ctx: int,
                         params: TensorParams | None) -> torch.Tensor:
    """[ctx, kv_heads, head_dim] float32 of one sequence, transforms undone (``gather_paged``)."""
    return gather_paged(layout, which, pool, block_row, ctx, params)  # type: ignore[return-value]


def pool_with_new_rows(pool: KVPool, new: KVPool, block_table: torch.Tensor, context_lens: torch.Tensor,
                       cu_seqlens_q: torch.Tensor | None = None) -> KVPool:
    """A copy of ``pool`` with this step's rows written at their slots (what the runtime does after a step).

    ``new`` holds rows in pool-row form ``[rows, kv_heads, ...]``; sequence b's rows (row b for decode,
    rows ``cu[b] .. cu[b+1]-1`` for prefill) are its last positions ``context_len - n ..``."""
    out = KVPool(pool.data.clone(), None if pool.scale is None else pool.scale.clone(),
                 None if pool.zero is None else pool.zero.clone())
    bs = pool.data.shape[2]
    for b in range(context_lens.shape[0]):
        ctx = int(context_lens[b])
        r0, r1 = (b, b + 1) if cu_seqlens_q is None else (int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        n = r1 - r0
        if n == 0 or ctx == 0:
            continue
        pos = torch.arange(ctx - n, ctx)
        blk, off = block_table[b, pos // bs].long(), pos % bs
        for dst, src in ((out.data, new.data), (out.scale, new.scale), (out.zero, new.zero)):
            if dst is not None:
                dst[blk, :, off] = src[r0:r1].to(dst.dtype)
    return out


def paged_attention_ref(
    q: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    k_pool: KVPool,
    v_pool: KVPool,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    k_fmt: str | TensorFormat,
    v_fmt: str | TensorFormat,
    k_params: TensorParams | None = None,
    v_params: TensorParams | None = None,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Attention of q over the paged cache, float64 math on the float32-dequantized cache.

    Decode (``cu_seqlens_q`` None): q [batch, heads, head_dim], one query at position context_len-1.
    Prefill: q [total_q, heads, head_dim]; sequence b's ``n = cu[b+1]-cu[b]`` queries are the last n
    tokens of its context (causal). A context of length 0 gives zeros. Output in q's dtype.
    """
    kf, vf = as_tensor_format(k_fmt), as_tensor_format(v_fmt)
    head_dim = q.shape[-1]
    layout = layout_for(kf, vf, k_pool.data, head_dim)
    kvh = k_pool.data.shape[1]
    heads = q.shape[1]
    ratio = heads // kvh
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.zeros(q.shape, dtype=torch.float64)
    batch = context_lens.shape[0]
    for b in range(batch):
        ctx = int(context_lens[b])
        if cu_seqlens_q is None:
            q_rows = slice(b, b + 1)
        else:
            q_rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        qb = q[q_rows].double()  # [n, heads, D]
        n = qb.shape[0]
        if ctx == 0 or n == 0:
            continue
        k = dequantized_sequence(layout, "k", k_pool, block_table[b], ctx, k_params).double()  # [ctx, kvh, D]
        v = dequantized_sequence(layout, "v", v_pool, block_table[b], ctx, v_params).double()
        k = k.repeat_interleave(ratio, dim=1)  # [ctx, heads, D]
        v = v.repeat_interleave(ratio, dim=1)
        s = torch.einsum("qhd,khd->hqk", qb, k) * scale  # [heads, n, ctx]
        qpos = torch.arange(ctx - n, ctx).view(1, n, 1)
        kpos = torch.arange(ctx).view(1, 1, ctx)
        s = s.masked_fill(kpos > qpos, float("-inf"))
        p = torch.softmax(s, dim=-1)
        p = torch.nan_to_num(p, nan=0.0)  # rows with no visible key (ctx < n): zeros
        out[q_rows] = torch.einsum("hqk,khd->qhd", p, v)
    return out.to(q.dtype)
