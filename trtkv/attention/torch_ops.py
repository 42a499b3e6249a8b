"""The torch ops: the torch engine's reference attention, vectorized torch on any device, sealing with ``trtkv.quant``.

The batch's sealed blocks are gathered with one ``index_select`` per pool tensor, the sink rows and open blocks by
slot, then one masked softmax attention per layer with GQA folded into the query axis. The quantized blocks are never
dequantized where the format allows (the int4 / int8 presets), by two folds of the affine codec
``x = (c - off) * s + z``:

* keys with one scale (+ zero) per channel per sealed block: ``q . x = (q * s) . c + q . (z - off * s)``, the scale
  folded into the query per block (``folded_key_scores``);
* values with a scale (+ zero) per token (group): ``sum_t p_t x_t = sum_t (p_t s_t) c_t + sum_t p_t (z_t - off s_t)``,
  the scale folded into the probabilities (``folded_value_output``);

the smoothing and Hadamard transforms folded into the query (``fold_query``) and undone once on the output. Every
other format is read through ``trtkv.quant.dequantize`` (``context_kv``). The seal is the reference quantizer
(``AttentionBackend.quantize_blocks``).
"""

from __future__ import annotations

import torch

from trtkv.attention.base import AttentionBackend
from trtkv.attention.masks import MaskedStep
from trtkv.cache_layout import PagedKVLayout, block_rope
from trtkv.plugins.contract.capabilities import TORCH_OPS
from trtkv.quant import TensorParams, dequantize, forward_transform, hadamard_matrix, inverse_transform


def unfolded(fmt) -> bool:
    """A format whose sealed rows are dequantized whole (``context_kv``), not folded into the query or probabilities:
    codes through a codebook, outlier lists written over the codes, keys stored before RoPE, rows of per-channel widths."""
    return bool(fmt.codebook or fmt.outliers or fmt.pre_rope or fmt.allocated_bits is not None)


def folds_key_scales(fmt) -> bool:
    """Keys whose integer codes have one scale (+ zero) per channel per sealed block: attention folds the scales
    into the query (``(q * s) . c + q . z``) instead of dequantizing every key (the int4 / int8 presets)."""
    return fmt.is_quantized and fmt.is_block_wise and fmt.traits.is_int and len(fmt.traits.planes) <= 1 and not unfolded(fmt)


def folds_value_scales(fmt) -> bool:
    """Values whose integer codes have a scale (+ zero) per token (group): attention folds the scales into the
    probabilities (``sum_t p_t s_t c_t``) instead of dequantizing every value (the int4 / int8 presets)."""
    return (fmt.is_quantized and fmt.traits.is_int and not fmt.is_static and not fmt.is_block_wise and len(fmt.traits.planes) <= 1
            and not unfolded(fmt))


def fold_query(q: torch.Tensor, fmt, params: TensorParams) -> torch.Tensor:
    """q [B, H, n, D] such that ``fold(q) . k_stored == q . k_model`` for ``k_model = inverse_transform(k_stored)``
    = ``(k_stored @ H^T) * smooth``: ``(q * smooth) @ H`` (the transpose of ``trtkv.quant.inverse_transform``)."""
    if fmt.smooth:
        q = q * params.smooth.to(q.dtype).view(1, q.shape[1], 1, q.shape[-1])
    if fmt.hadamard:
        q = q @ hadamard_matrix(q.shape[-1], q.dtype, q.device)
    return q


def _shift(fmt, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor | None:
    """``z - off * s``: what ``(c - off) * s + z`` adds to ``c * s`` (None: nothing)."""
    off = fmt.traits.offset(fmt.symmetric)
    if off:
        return -off * scale if zero is None else zero - off * scale
    return zero


def _fields(fmt, codes: torch.Tensor, shape) -> list[torch.Tensor]:
    """The stored codes as float fields ``shape[:-1] + [D / n]`` (``DtypeTraits.code_fields``: channel ``i::n``)."""
    fields = fmt.traits.code_fields(codes)
    return [f.float().view(*shape[:-1], shape[-1] // len(fields)) for f in fields]


def folded_key_scores(st: MaskedStep, layer: int, qs: torch.Tensor) -> torch.Tensor:
    """Scores ``[B, nb, H, n, bs]`` of the query ``qs`` [B, H, n, D] (stored channel space) against the sealed keys,
    without dequantizing them: ``(c - off) * s + z`` per channel per block is folded into the query, and packed
    codes enter the product field by field (int4: the even channels' nibbles, then the odd ones')."""
    cache, fmt = st.cache, st.cache.layout_of(layer).tensor_format("k")
    B, H, n, D = qs.shape
    qt = st.sealed_blocks(cache.pool(layer, "k"))
    nb = st.sealed_max
    fields = _fields(fmt, qt.codes, (B, nb, H, -1, D))
    scale = qt.scale.float().view(B, nb, H, 1, D)
    shift = _shift(fmt, scale, None if qt.zero is None else qt.zero.float().view(B, nb, H, 1, D))
    if not st.sealed_all_valid:  # blocks past a sequence's sealed ones are other owners': their scales may be NaN
        bs = qt.codes.shape[-2]
        invalid = st.kv_invalid[:, : nb * bs].view(B, nb, bs)[:, :, :1].view(B, nb, 1, 1, 1)
        scale = scale.masked_fill(invalid, 0)
        shift = None if shift is None else shift.masked_fill(invalid, 0)
    qb = qs[:, None]  # [B, 1, H, n, D]
    qsc = qb * scale
    per = len(fields)
    # (a strided query slice would send bmm down its per-matrix loop: 30x slower; the copy is small)
    scores = qsc @ fields[0].transpose(-1, -2) if per == 1 else sum(qsc[..., i::per].contiguous() @ f.transpose(-1, -2) for i, f in enumerate(fields))
    return scores if shift is None else scores + (qb * shift).sum(-1, keepdim=True)


def folded_value_output(st: MaskedStep, layer: int, ps: torch.Tensor, params: TensorParams) -> torch.Tensor:
    """``sum_t p_t v_t`` [B, H, n, D] (model space) over the sealed values for block-major probabilities ``ps``
    [B, nb, H, n, bs], without dequantizing them: ``v = (c - off) * s + z`` per token (group) gives
    ``sum_t (p_t s_t) c_t + sum_t p_t (z_t - off * s_t)``. Positions ``< sink`` come from the sink rows."""
    lay = st.cache.layout_of(layer)
    fmt = lay.tensor_format("v")
    pool = st.cache.pool(layer, "v")
    B, nb, H, n, bs = ps.shape
    D, sink = lay.head_dim, lay.sink_tokens
    groups = fmt.groups(D)
    qt = st.sealed_blocks(pool)
    fields = _fields(fmt, qt.codes, (B, nb, H, bs, D))
    scale = qt.scale.float().view(B, nb, H, bs, groups)
    shift = _shift(fmt, scale, None if qt.zero is None else qt.zero.float().view(B, nb, H, bs, groups))
    if not st.sealed_all_valid:  # other owners' blocks may hold NaN scales; their probabilities are 0
        invalid = st.kv_invalid[:, : nb * bs].view(B, nb, 1, bs, 1)
        scale = scale.masked_fill(invalid, 0)
        shift = None if shift is None else shift.masked_fill(invalid, 0)
    p_sink = None
    if sink:  # the sink positions' probabilities go to the sink rows (where column 0 is the sequence's first block)
        p_sink = st.where_sink(ps[:, 0, :, :, :sink], torch.zeros_like(ps[:, 0, :, :, :sink]))
        ps = ps.clone()
        ps[:, 0, :, :, :sink] -= p_sink
    per = len(fields)
    if groups == 1:  # one scale per token: into the probabilities
        w = ps * scale[..., 0][:, :, :, None]  # [B, nb, H, n, bs]
    else:  # a scale per group of channels: onto the (fresh float) codes in place, cheaper than a product per group
        w, gw = ps, D // groups // per  # channels of one group in one field
        for f in fields:
            f.view(B, nb, H, bs, groups, gw).mul_(scale[..., None])
    out = ps.new_empty(B, nb, H, n, D // per, per)
    for i, f in enumerate(fields):
        out[..., i] = w @ f
    out = out.view(B, nb, H, n, D).sum(1)
    if shift is not None:
        out = out + torch.einsum("xbhnt,xbhtg->xhng", ps, shift).repeat_interleave(D // groups, -1)
    out = inverse_transform(out, fmt, params, head_axis=-3)
    if p_sink is not None:
        rows = lay.sink_rows(pool.tail)[st.batch.slot_ids].to(out.dtype)
        if not st.sealed_all_valid:  # a slot without a sealed block holds stale sink rows
            rows = rows.masked_fill(st.kv_invalid[:, None, :sink, None], 0)
        out = out + p_sink @ rows
    return out


def context_kv(st: MaskedStep, layer: int, which: str, new_rows: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Every sequence's keys (or values), the batched form of ``cache_layout.gather_paged``, in two parts:

    * sealed ``[B, sealed_max, H, block_size, D]`` (block-major as in the pool; None when no sequence has a sealed
      block): ``trtkv.quant.dequantize`` left in the format's **stored channel space** (``transforms=False``), the
      caller folds the transforms into the query and the output instead of undoing them on every row; positions
      ``< sink`` from the sink rows (moved into stored space). Keys stored before RoPE (``prerope``, ``unfolded``)
      come back in model space instead: transforms undone and RoPE applied at each row's position;
    * the rest ``[B, H, open_max + T, D]`` in model space: the open block, then this step's rows ``new_rows``.

    Context rows that do not exist are zero (``st.kv_valid`` says which exist)."""
    cache, b = st.cache, st.batch
    lay: PagedKVLayout = cache.layout_of(layer)
    pool = cache.pool(layer, which)
    fmt = lay.tensor_format(which)
    params = st.backend.layer_params(cache, layer)[0 if which == "k" else 1]
    bs, sink, H, D = lay.block_size, lay.sink_tokens, lay.num_kv_heads, lay.head_dim
    B, dtype = b.batch_size, new_rows.dtype
    S = st.sealed_max * bs
    sealed = None
    if st.sealed_max:
        nb = st.sealed_max
        rope = None
        if fmt.pre_rope:  # keys stored before RoPE: back in model space, rotated at their positions (no fold)
            first = st.first_pos[:, None] + torch.arange(nb, device=st.first_pos.device)[None, :] * bs
            rope = block_rope(cache.rope_for(layer, fmt), first.reshape(-1), bs)
        x = dequantize(st.sealed_blocks(pool), fmt, params, head_axis=-3, dtype=dtype, transforms=rope is not None, rope=rope)
        sealed = x.view(B, nb, H, bs, D)  # block-major, as stored: no transpose copy
        if sink:
            rows = lay.sink_rows(pool.tail)[b.slot_ids].to(dtype)
            rows = rows if fmt.pre_rope else forward_transform(rows, fmt, params, head_axis=-3)
            sealed[:, 0, :, :sink] = st.where_sink(rows, sealed[:, 0, :, :sink])
        if not st.sealed_all_valid:  # other owners' blocks may hold NaN
            sealed.masked_fill_(st.kv_invalid[:, :S].view(B, nb, 1, bs, 1), 0)
    return sealed, st.open_rows(layer, which, new_rows)


class TorchOps(AttentionBackend):
    """Vectorized torch ops (see the module docstring): the reference path, on any device, every format."""

    name = "torch"
    path = TORCH_OPS
    runs_on = ("cpu", "cuda")
    auto_on = ("cpu", "cuda")  # the last resort of ``auto``

    def begin(self, batch, cache, valid, crossing):
        return MaskedStep(backend=self, batch=batch, cache=cache, valid=valid).build()

    def attend(self, st, layer, q, k16, v16, scaling, window, softcap):
        """Softmax attention over [sealed (stored space) | open block + new rows (model space)] keys: K's transforms
        folded into the query for the sealed part, V's undone once on the sealed part's output."""
        if st.cache.is_ringed(layer):
            st = st.ring_view()
        k16, v16 = k16.to(q.dtype), v16.to(q.dtype)
        B, Hq, T, D = q.shape
        H = k16.shape[1]
        G = Hq // H
        lay = st.cache.layout_of(layer)
        kp, vp = self.layer_params(st.cache, layer)
        qg = q.reshape(B, H, G * T, D)
        kfmt = lay.tensor_format("k")
        if st.sealed_max and folds_key_scales(kfmt):
            ks, kr = None, st.open_rows(layer, "k", k16)
            sealed = folded_key_scores(st, layer, fold_query(qg, kfmt, kp))
            if lay.sink_tokens:  # the first block's first rows are read from the sink rows (model space, fp16)
                sink = lay.sink_rows(st.cache.pool(layer, "k").tail)[st.batch.slot_ids].to(qg.dtype)
                if not st.sealed_all_valid:  # a slot without a sealed block holds stale sink rows
                    sink = sink.masked_fill(st.kv_invalid[:, None, : lay.sink_tokens, None], 0)
                sealed[:, 0, :, :, : lay.sink_tokens] = st.where_sink(qg @ sink.transpose(-1, -2), sealed[:, 0, :, :, : lay.sink_tokens])
        else:
            ks, kr = context_kv(st, layer, "k", k16)
            sealed = None if ks is None else (qg if kfmt.pre_rope else fold_query(qg, kfmt, kp))[:, None] @ ks.transpose(-1, -2)
        vfmt = lay.tensor_format("v")
        fold_v = bool(st.sealed_max) and folds_value_scales(vfmt)
        vs, vr = (None, st.open_rows(layer, "v", v16)) if fold_v else context_kv(st, layer, "v", v16)
        scores = qg @ kr.transpose(-1, -2)
        S = 0
        if sealed is not None:  # [B, 1, H, n, D] @ [B, nb, H, D, bs] -> [B, nb, H, n, bs] -> [B, H, n, nb * bs]
            nb, bs = sealed.shape[1], sealed.shape[4]
            S = nb * bs
            scores = torch.cat([sealed.permute(0, 2, 3, 1, 4).reshape(B, H, G * T, S), scores], -1)
        scores = scores * scaling
        if softcap:  # Gemma 2: cap * tanh(scores / cap), before the mask (as transformers does)
            scores = torch.tanh(scores / softcap) * softcap
        p = (scores + st.mask_bias(window, G, scores.dtype)).softmax(-1)
        out = p[..., S:] @ vr
        if S:
            ps = p[..., :S].reshape(B, H, G * T, nb, bs).permute(0, 3, 1, 2, 4)  # block-major [B, nb, H, n, bs]
            if fold_v:
                out = out + folded_value_output(st, layer, ps, vp)
            else:  # [B, nb, H, n, bs] @ [B, nb, H, bs, D], summed over blocks
                out = out + inverse_transform((ps @ vs).sum(1), vfmt, vp, head_axis=-3)
        return out.view(B, Hq, T, D).transpose(1, 2)  # [B, T, Hq, D]
