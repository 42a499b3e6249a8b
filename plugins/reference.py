"""Torch references for the kernels in ``trtkv.plugins.kernels``, built on ``trtkv.quant`` / ``trtkv.cache_layout``.

These are the definitions the kernels are tested against and the CPU fallback of the custom ops:

* seal: ``cache_layout.seal_blocks`` (``trtkv.quant.quantize_block``) on whole blocks;
* attention: each sequence's cached keys / values are ``cache_layout.gather_paged(..., slot=)`` (sealed
  blocks dequantized, transforms undone, then the open block's rows from the tail), followed by this
  step's new rows (fp16 values); softmax attention runs in float64, causal within the step.

Arguments mirror the custom ops: pools as raw tensors, formats as spec strings (``TensorFormat.short()``),
calibrated constants as optional tensors. ``run_op`` evaluates one ``trtkv::`` ONNX op of
``trtkv.plugins.contract`` on its named input tensors (what an ONNX Runtime stand-in for the TensorRT
plugins calls).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trtkv.cache_layout import KVPool, PagedKVLayout, gather_paged, seal_blocks, store_quantized
from trtkv.formats import KVFormat, TensorFormat
from trtkv.quant import QuantizedTensor, TensorParams, per_channel
from trtkv.rope import RopeRows

from . import contract as C
from .contract import as_tensor_format


def layout_for(k_fmt: TensorFormat, v_fmt: TensorFormat, data: torch.Tensor, head_dim: int,
               num_slots: int = 0, sink_tokens: int = 0) -> PagedKVLayout:
    """A PagedKVLayout matching pool tensors ``data`` [num_blocks, kv_heads, block_size, packed_dim]."""
    nb, kvh, bs, _ = data.shape
    fmt = KVFormat(name="kernel", k=k_fmt, v=v_fmt, block_size=bs, sink_tokens=sink_tokens)
    return PagedKVLayout(fmt=fmt, num_kv_heads=kvh, head_dim=head_dim, block_size=bs, num_blocks=nb,
                         num_slots=num_slots)


def seal_ref_pool(
    rows: torch.Tensor,
    fmt: str | TensorFormat,
    static_scale: torch.Tensor | None = None,
    smooth: torch.Tensor | None = None,
    clip: torch.Tensor | None = None,
    codebook: torch.Tensor | None = None,
    first_positions: torch.Tensor | None = None,
    rope=None,
    bits: torch.Tensor | None = None,
) -> KVPool:
    """Quantize full blocks ``rows`` [n, kv_heads, block_size, head_dim] into a pool of exactly these n blocks (codes,
    scale, zero and an ``outN`` format's outlier lists; ``seal_blocks``). ``codebook``: a ``nuq`` format's levels;
    ``first_positions`` [n] and ``rope`` (``(cos, sin)`` [P, D] or a ``RopeTable``): keys stored before RoPE; ``bits``:
    an ``allocB`` format's code widths."""
    tf = as_tensor_format(fmt)
    n, kvh, bs, d = rows.shape
    layout = PagedKVLayout(KVFormat(name="seal", k=tf, v=TensorFormat(dtype="fp16"), block_size=bs), kvh, d, bs, n)
    pool = layout.allocate("k")
    if n:
        seal_blocks(layout, "k", pool, rows, torch.arange(n), TensorParams(static_scale, smooth, clip, codebook=codebook, bits=bits),
                    first_positions, _rope_rows(rope))
    return pool


def seal_ref(rows, fmt, static_scale=None, smooth=None, clip=None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``seal_ref_pool``'s (codes, scale, zero) in pool-block form, for formats without the calibrated storage features."""
    pool = seal_ref_pool(rows, fmt, static_scale, smooth, clip)
    return pool.data, pool.scale, pool.zero


def _rope_rows(rope):
    """A RoPE table given as ``(cos, sin)`` rows as the reference readers take it (``RopeRows``); anything else as is."""
    return RopeRows(rope[0].cpu(), rope[1].cpu()) if isinstance(rope, tuple) else rope


def seal_into_ref(rows, blocks, data, scale, zero, fmt, static_scale=None, smooth=None, clip=None, codebook=None,
                  outlier_index=None, outlier_value=None, first_positions=None, rope=None, bits=None) -> None:
    """``seal_ref`` stored at pool blocks ``blocks`` [n] of the raw pool tensors (in place)."""
    tf = as_tensor_format(fmt)
    p = seal_ref_pool(rows, tf, static_scale, smooth, clip, codebook, first_positions, rope, bits)
    store_quantized(KVPool(data, scale, zero, None, outlier_index, outlier_value), blocks,
                    QuantizedTensor(p.data, p.scale, p.zero, p.outlier_index, p.outlier_value), tf)


def cached_sequence(layout: PagedKVLayout, which: str, pool: KVPool, block_row: torch.Tensor, ctx: int, slot: int,
                    params: TensorParams | None, rope=None) -> torch.Tensor:
    """[ctx, kv_heads, head_dim] float32 of one sequence's cache, transforms undone (``gather_paged``; ``rope`` for
    keys stored before RoPE)."""
    return gather_paged(layout, which, pool, block_row, ctx, params, slot=slot, rope=rope)  # type: ignore[arg-type]


def paged_attention_ref(
    q: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    k_pool: KVPool,
    v_pool: KVPool,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    slot_ids: torch.Tensor,
    k_fmt: str | TensorFormat,
    v_fmt: str | TensorFormat,
    k_params: TensorParams | None = None,
    v_params: TensorParams | None = None,
    sm_scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
    rope=None,
) -> torch.Tensor:
    """Attention of this step's queries over the cache (sealed pool blocks + open block) and the step's own
    rows, float64 math on the float32-dequantized cache.

    ``k_pool`` / ``v_pool`` carry ``tail`` [num_slots, kv_heads, block_size + sink_tokens, head_dim] (the sink
    rows replace positions ``< sink_tokens`` once a block is sealed). ``context_lens`` are the
    tokens cached before the step. Decode (``cu_seqlens_q`` None): q / k_new / v_new [batch, ...], one new token
    per sequence at position ``context_lens[b]``. Prefill: q / k_new / v_new [total, ...]; sequence b's rows
    ``cu[b] .. cu[b+1]-1`` are positions ``context_lens[b] ..`` (causal). New rows are rounded to fp16 (what
    the open block will hold). Output in q's dtype.

    ``window`` > 0: a query at position p attends only to keys at positions ``> p - window`` (transformers'
    sliding window); cached positions below the step's first query's window are dropped before any product (so
    whatever the pool holds there -- a window ring's overwritten blocks, NaN -- never enters). ``softcap`` > 0:
    scores ``s * sm_scale`` become ``softcap * tanh(s * sm_scale / softcap)`` before the mask (Gemma 2).
    The pools' outlier lists and the params' codebooks are read where the formats keep them; ``rope`` (a
    ``RopeTable`` or ``trtkv.rope.RopeRows``) rotates keys stored before RoPE at their positions.
    """
    kf, vf = as_tensor_format(k_fmt), as_tensor_format(v_fmt)
    head_dim = q.shape[-1]
    layout = layout_for(kf, vf, k_pool.data, head_dim, sink_tokens=k_pool.tail.shape[2] - k_pool.data.shape[2])
    kvh = k_pool.data.shape[1]
    ratio = q.shape[1] // kvh
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(context_lens.shape[0]):
        ctx = int(context_lens[b])
        rows = slice(b, b + 1) if cu_seqlens_q is None else slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        qb = q[rows].double()  # [n, heads, D]
        n = qb.shape[0]
        if n == 0:
            continue
        slot = int(slot_ids[b])
        k = torch.cat([cached_sequence(layout, "k", k_pool, block_table[b], ctx, slot, k_params, rope).double(),
                       k_new[rows].half().double()])  # [ctx + n, kvh, D]
        v = torch.cat([cached_sequence(layout, "v", v_pool, block_table[b], ctx, slot, v_params).double(),
                       v_new[rows].half().double()])
        lo = max(0, ctx - window + 1) if window > 0 else 0  # the lowest key position any query of the step sees
        k = k[lo:].repeat_interleave(ratio, dim=1)
        v = v[lo:].repeat_interleave(ratio, dim=1)
        s = torch.einsum("qhd,khd->hqk", qb, k) * scale  # [heads, n, ctx + n - lo]
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        qpos = torch.arange(ctx, ctx + n).view(1, n, 1)
        kpos = torch.arange(lo, ctx + n).view(1, 1, ctx + n - lo)
        hidden = kpos > qpos
        if window > 0:
            hidden = hidden | (kpos <= qpos - window)
        s = s.masked_fill(hidden, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
    return out.to(q.dtype)


# ------------------------------------------------------------------------------------------------
# the ONNX op contract, evaluated on named tensors
# ------------------------------------------------------------------------------------------------


def _expand(t: torch.Tensor | None, kvh: int, d: int) -> torch.Tensor | None:
    return None if t is None else per_channel(t, kvh, d)


def run_op(op: str, attrs: dict[str, Any], tensors: dict[str, torch.Tensor | None]) -> list[torch.Tensor]:
    """Outputs of one ``trtkv::`` op (``trtkv.plugins.contract``) on its named inputs, by the references.

    Unused inputs (placeholders) may be missing or None. ``PagedDecodePartition`` returns its partial
    states for a single partition holding the whole context (``part_m`` / ``part_l`` / ``part_acc`` with the
    contract's partition count, the rest empty: ``l = 0``), so that ``PagedDecodeReduce`` -- which merges
    whatever partitions it is given -- returns the attention output; the pair equals ``paged_attention_ref``.
    """
    spec = C.get_op(op)
    a = attrs if isinstance(attrs, C.Attrs) and attrs.op is spec else C.validate_attrs(spec, dict(attrs))  # validated once: kept
    t = {x.name: (tensors.get(x.name) if x.used(a) else None) for x in spec.inputs}
    D, kvh = a["head_dim"], a["num_kv_heads"]
    if spec.name == "PagedKVSeal":
        f = a.tensor_format("x")
        codes, s, z = seal_ref(t["rows"], f, t["static_scale"], _expand(t["smooth"], kvh, D), t["clip"])
        outs = [codes, s, z]
        shapes = C.output_shapes(spec, a, C.expected_input_shapes(spec, a, blocks=t["rows"].shape[0]))
        return [o if o is not None else torch.zeros(sh, dtype=torch.float16) for o, sh in zip(outs, shapes)]
    if spec.name == "PagedDecodeReduce":
        m, l, acc = t["part_m"].double(), t["part_l"].double(), t["part_acc"].double()
        mm = m.amax(-1, keepdim=True)
        mm = torch.where(torch.isfinite(mm), mm, torch.zeros_like(mm))
        w = torch.exp2(m - mm)
        den = (l * w).sum(-1)
        o = (acc * w[..., None]).sum(-2) / torch.where(den > 0, den, torch.ones_like(den))[..., None]
        vf = a.tensor_format("v")
        vp = TensorParams(scale=_expand(t["v_static"], kvh, D), smooth=_expand(t["v_smooth"], kvh, D))
        o = _stored_to_model(o, vf, vp, kvh)
        return [o.to(torch.float16)]
    kf, vf = a.tensor_format("k"), a.tensor_format("v")
    kp = TensorParams(scale=_expand(t["k_static"], kvh, D), smooth=_expand(t["k_smooth"], kvh, D))
    vp = TensorParams(scale=_expand(t["v_static"], kvh, D), smooth=_expand(t["v_smooth"], kvh, D))
    pools = {w: KVPool(t[f"{w}_data"], t[f"{w}_scale"], t[f"{w}_zero"], t[f"{w}_tail"]) for w in "kv"}
    cu = t.get("cu_seqlens")
    out = paged_attention_ref(t["q"].float(), cu, pools["k"], pools["v"], t["k_new"], t["v_new"], t["block_tables"],
                              t["context_lens"], t["slot_ids"], kf, vf, kp, vp, a["sm_scale"])
    if spec.name == "PagedPrefillAttention":
        return [out.to(torch.float16)]
    # PagedDecodePartition: one partition holding everything, in V's stored channel space, log2 domain
    B, Hq, _ = t["q"].shape
    S = C.num_partitions(t["block_tables"].shape[1], a)
    part_m = torch.full((B, Hq, S), float("-inf"))
    part_l = torch.zeros(B, Hq, S)
    part_acc = torch.zeros(B, Hq, S, D)
    part_m[:, :, 0] = 0.0
    part_l[:, :, 0] = 1.0
    part_acc[:, :, 0] = _model_to_stored(out.double(), vf, vp, kvh).float()
    return [part_m, part_l, part_acc]


def _model_to_stored(o: torch.Tensor, vf: TensorFormat, vp: TensorParams, kvh: int) -> torch.Tensor:
    """Attention outputs [B, Hq, D] from V's model space to its stored space (the partition's ``part_acc``)."""
    from trtkv.quant import forward_transform

    B, Hq, D = o.shape
    x = forward_transform(o.view(B, kvh, Hq // kvh, D), vf, _double(vp), head_axis=-3) if (vf.smooth or vf.hadamard) \
        else o.view(B, kvh, Hq // kvh, D)
    if vf.is_static:
        x = x / _per_kv(vp.scale, x)
    return x.reshape(B, Hq, D)


def _stored_to_model(o: torch.Tensor, vf: TensorFormat, vp: TensorParams, kvh: int) -> torch.Tensor:
    from trtkv.quant import inverse_transform

    B, Hq, D = o.shape
    x = o.view(B, kvh, Hq // kvh, D)
    if vf.is_static:
        x = x * _per_kv(vp.scale, x)
    if vf.smooth or vf.hadamard:
        x = inverse_transform(x, vf, _double(vp), head_axis=-3)
    return x.reshape(B, Hq, D)


def _double(p: TensorParams) -> TensorParams:
    return TensorParams(scale=None if p.scale is None else p.scale.double(),
                        smooth=None if p.smooth is None else p.smooth.double())


def _per_kv(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[kv_heads, D] static scale broadcast over [B, kv_heads, group, D]."""
    return scale.double()[None, :, None, :]
