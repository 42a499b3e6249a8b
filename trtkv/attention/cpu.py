"""trtkv's C kernels (``plugins/cpu_attention.c``): the CPU attention that reads sealed blocks straight from the pools.

* A **decode** step (one token per sequence) is one kernel call per layer (``cpu_attention.decode_model_space``): the
  query folded by the keys' transforms, scores over the sealed blocks, the sink rows, the open block and the new row,
  the window and soft-cap, the softmax and the weighted values, transformed back once per query.
* A **prefill** chunk runs in model space: the kernels dequantize the sealed rows into one buffer with the formats'
  transforms undone (``cpu_attention.dequant``), the open block and the step's rows follow them (``context_rows``),
  and one fused ``scaled_dot_product_attention`` per sequence and query block over its keys in position order gives
  the output (``blockwise``: the same call, and the same bits, whatever chunk the block is part of), or over the whole
  step with its mask where a window or soft-cap applies.
* **Steps across blocks** (``cross_blocks``): a chunk may fill several blocks; those it fills are sealed inside the
  step (``in_step_sealed``, the pool's own seal) for the queries after them, and handed to the pool with the step's
  output, which stores them instead of quantizing the same rows again.
* The **seal** is trtkv's C seal (``cpu_attention.seal``: the reference quantizer's bytes in one call) where it takes
  the format, else the reference quantizer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trtkv.attention.base import AttentionBackend
from trtkv.attention.masks import MaskedStep
from trtkv.cache_layout import PagedKVLayout, sealing
from trtkv.plugins import cpu_attention
from trtkv.plugins.contract.capabilities import CPU_KERNELS, CPU_SEAL
from trtkv.quant import QuantizedTensor, forward_transform


@dataclass
class CpuStep(MaskedStep):
    cpu_decode: dict = dataclasses.field(default_factory=dict)  # RoPE table -> the decode's per-step arguments
    blockwise: list | None = None  # a prefill's (sequence, query rows, key columns, mask) per query block (``blockwise``)
    # a step across blocks: ``in_step`` blocks per sequence at most, their rows gathered from [open block | step rows]
    in_step_rows: torch.Tensor | None = None  # [B, in_step * bs] column of [open_max + T] each in-step sealed row is
    in_step_first: torch.Tensor | None = None  # [B] bool: the step seals the sequence's first block (its sink rows apply)

    def add_in_step(self) -> None:
        """A step across blocks: ``mask`` grown by the blocks the step seals. Each query sees the sealed blocks from before
        the step, the blocks the step seals before its own block *quantized* (as the seal will store them; ``in_step``
        more columns per block), and its own block in fp16 (the open rows only from the step's first block, this step's
        rows of its block up to itself). Where the step seals a sequence's first block, later queries read its first
        ``sink_tokens`` positions in fp16 (the sink rows) instead."""
        b, bs, dev = self.batch, self.cache.block_size, self.device
        B, T = b.input_ids.shape
        ctx = b.context_lens
        j0, opened = ctx // bs, ctx % bs
        ar = torch.arange(T, device=dev)
        jq = (ctx[:, None] + ar[None, :]) // bs  # [B, T] each query's block (and each new row's)
        self.in_step = n = int(((ctx + b.new_lens - 1) // bs - j0).max())
        S, O = self.sealed_max * bs, self.open_max
        base = self.mask[:, 0]  # [B, T, S + O + T]
        open_vis = base[:, :, S : S + O] & (jq == j0[:, None])[:, :, None]
        new_vis = base[:, :, S + O :] & (jq[:, None, :] == jq[:, :, None])
        blocks = j0[:, None] + torch.arange(n, device=dev)[None, :]  # [B, n] the in-step sealed blocks
        quant_vis = (blocks[:, None, :] < jq[:, :, None])[..., None].expand(B, T, n, bs).reshape(B, T, n * bs)
        sink = self.cache.layout.sink_tokens
        self.in_step_first = j0 == 0
        if sink:  # a first block sealed in the step: positions < sink from the fp16 rows for the queries past it
            later = (jq >= 1) & self.in_step_first[:, None]  # [B, T]
            quant_vis = quant_vis.clone()
            quant_vis[:, :, :sink] &= ~later[:, :, None]
            pos_open = torch.arange(O, device=dev)
            sink_open = pos_open[None, :] < opened.clamp(max=sink)[:, None]  # [B, O] open rows at positions < sink
            open_vis = open_vis | (later[:, :, None] & sink_open[:, None, :] & base[:, :, S : S + O])
            new_pos = ctx[:, None] + ar[None, :]  # [B, T]
            new_vis = new_vis | (later[:, :, None] & (new_pos < sink)[:, None, :] & base[:, :, S + O :])
        self.mask = torch.cat([base[:, :, :S], open_vis, new_vis, quant_vis], 2)[:, None]
        rho = torch.arange(n * bs, device=dev)[None, :]  # in-step row -> its column of [open rows | step rows]
        self.in_step_rows = torch.where(rho < opened[:, None], rho, O + rho - opened[:, None]).clamp(max=O + T - 1)


def blockwise(st: CpuStep, lay: PagedKVLayout, qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """A prefill chunk attended one sequence and one query block at a time, over that block's keys in position order --
    the sealed blocks before it (the pool's, then those a step across blocks seals, as the seal stores them) and its
    own block's fp16 rows -- with the causal mask of its own block. The call for a query block is the same whatever
    the chunk it is part of began with (a prefix-cache hit, block-by-block steps, a step across blocks, other
    sequences in the batch): the same shapes, values and column order, so the same bits (a fused attention over the
    whole padded chunk sums its keys in an order that depends on the chunk's layout). ``keys`` / ``values`` are
    ``context_rows``' ``[B, H, S + O + T (+ in_step * bs), D]``; padding rows are left zero; returns ``[B, H, G * T, D]``."""
    B, H, GT, D = qg.shape
    T = int(st.batch.input_ids.shape[1])
    G = GT // T
    if st.blockwise is None:  # the same for every layer: made once per step
        st.blockwise = _blockwise_plan(st, lay, G, qg.dtype)
    out = torch.zeros_like(qg)
    qv, ov = qg.view(B, H, G, T, D), out.view(B, H, G, T, D)
    for i, t, t1, cols, bias in st.blockwise:
        rows = t1 - t
        q = qv[i : i + 1, :, :, t:t1].reshape(1, H, G * rows, D)
        got = F.scaled_dot_product_attention(q, keys[i : i + 1].index_select(2, cols), values[i : i + 1].index_select(2, cols),
                                             attn_mask=bias, scale=scaling)
        ov[i, :, :, t:t1] = got.view(H, G, rows, D)
    return out


def _blockwise_plan(st: CpuStep, lay: PagedKVLayout, G: int, dtype) -> list:
    """``(sequence, first row, end row, key columns, additive mask)`` of each query block of the step (``blockwise``)."""
    b, bs = st.batch, st.cache.block_size
    T = int(b.input_ids.shape[1])
    S, O = st.sealed_max * bs, st.open_max
    first_in_step = S + O + T  # the column of the step's first sealed block
    plan = []
    for i, (ctx, n, held) in enumerate(zip(b.context_lens.tolist(), b.new_lens.tolist(), st.held.tolist())):
        opened, j0 = ctx % bs, ctx // bs
        t = 0
        while t < n:
            k = (ctx + t) // bs - j0  # the query block, counted from the step's first
            t1 = min(n, (j0 + k + 1) * bs - ctx)
            own = [*range(S, S + opened), *range(S + O, S + O + t1)] if k == 0 else [*range(S + O + t, S + O + t1)]
            cols = [*range(held * bs), *range(first_in_step, first_in_step + k * bs), *own]
            if lay.sink_tokens and j0 == 0 and k:  # the step sealed the first block: its sink positions are read in fp16
                cols[: lay.sink_tokens] = [S + p if p < opened else S + O + p - opened for p in range(lay.sink_tokens)]
            rows, C = t1 - t, len(cols)
            visible = torch.cat([torch.ones(rows, C - rows, dtype=torch.bool), torch.ones(rows, rows, dtype=torch.bool).tril()], 1)
            bias = torch.zeros(rows, C, dtype=dtype).masked_fill_(~visible, float("-inf"))
            bias = bias[None].expand(G, rows, C).reshape(1, 1, G * rows, C).to(st.device)
            plan.append((i, t, t1, torch.tensor(cols, device=st.device), bias))
            t = t1
    return plan


class CpuKernels(AttentionBackend):
    """trtkv's C kernels on the CPU (see the module docstring); every format the torch ops read, head dims up to 1024."""

    name = "cpu"
    path = CPU_KERNELS
    seal_path = CPU_SEAL
    runs_on = ("cpu",)
    auto_on = ("cpu",)
    cross_blocks = True
    unavailable_hint = "install a C compiler (gcc 12+), or use the torch ops (--attention torch)"

    @classmethod
    def unavailable(cls) -> str | None:
        why = cpu_attention.unavailable()
        return None if why is None else f"trtkv's CPU attention kernels are unavailable: {why}"

    def begin(self, batch, cache, valid, crossing):
        st = CpuStep(backend=self, batch=batch, cache=cache, valid=valid).build()
        if crossing:
            st.add_in_step()
        return st

    def layer_codecs(self, cache, layer: int) -> tuple:
        """The kernels' row codecs of ``layer``'s K and V (``cpu_attention.RowCodec``), made once per cache."""
        lay = cache.layout

        def make():
            return [tuple(cpu_attention.RowCodec.of(cache.layout_of(i).tensor_format(w), self.layer_params(cache, i)[j], lay.num_kv_heads,
                                                    lay.head_dim, lay.block_size) for j, w in enumerate("kv")) for i in range(cache.num_layers)]
        return self.cached(cache, "codecs", make)[layer]

    def attend(self, st, layer, q, k16, v16, scaling, window, softcap):
        """A decode step in one kernel call (``decode``); a prefill chunk in model space: the kernels' sealed rows, then
        the open block and this step's rows, one fused attention per query block (``blockwise``; the explicit softmax
        for a soft-capped model, the step's mask for a local layer)."""
        if st.cache.is_ringed(layer):
            st = st.ring_view()
        k16, v16 = k16.to(q.dtype), v16.to(q.dtype)
        B, Hq, T, D = q.shape
        H = k16.shape[1]
        G = Hq // H
        lay = st.cache.layout_of(layer)
        kc, vc = self.layer_codecs(st.cache, layer)
        qg = q.reshape(B, H, G * T, D)
        if T == 1:
            return self.decode(st, layer, lay, qg, k16, v16, kc, vc, scaling, window, softcap).view(B, Hq, T, D).transpose(1, 2)
        keys = self.context_rows(st, layer, lay, "k", k16, kc)
        values = self.context_rows(st, layer, lay, "v", v16, vc)
        if window is None and not softcap:  # every prefill chunk, so that a chunk's numbers never depend on where it began
            return blockwise(st, lay, qg.contiguous(), keys, values, scaling).view(B, Hq, T, D).transpose(1, 2)
        bias = st.mask_bias(window, G, qg.dtype)
        if softcap:  # Gemma 2: cap * tanh(scores / cap) before the mask, which the fused attention cannot
            scores = torch.tanh(qg @ keys.transpose(-1, -2) * (scaling / softcap)) * softcap
            out = (scores + bias).softmax(-1) @ values
        else:
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=bias, scale=scaling)
        return out.view(B, Hq, T, D).transpose(1, 2)

    def decode(self, st: CpuStep, layer: int, lay: PagedKVLayout, qg, k16, v16, kc, vc, scaling: float, window, softcap) -> torch.Tensor:
        """One token per sequence, the whole attention in one kernel call (``cpu_attention.decode``): [B, H, G, D]."""
        b, bs = st.batch, st.cache.block_size
        table = st.cache.rope_for(layer, lay.tensor_format("k"))  # keys stored before RoPE: this layer's table
        step = st.cpu_decode.get(table)
        if step is None:
            sealed = b.context_lens // bs
            rope = None if table is None else table.upto(int(b.context_lens.max()) + 1)
            step = st.cpu_decode[table] = cpu_attention.DecodeStep(b.block_tables, st.held, st.sealed_max, b.slot_ids, b.context_lens - sealed * bs,
                                                                    b.context_lens, st.first_pos, sealed * bs, st.sink_ok, rope)
        kpool, vpool = st.cache.pool(layer, "k"), st.cache.pool(layer, "v")
        # the formats' transforms run inside the kernel (the codecs carry them): no torch op per layer around the call
        return cpu_attention.decode_model_space(kc, vc, kpool, vpool, step, qg, k16[:, :, 0], v16[:, :, 0], scaling, window,
                                                softcap, lay.sink_tokens)

    def context_rows(self, st: CpuStep, layer: int, lay: PagedKVLayout, which: str, new_rows, codec) -> torch.Tensor:
        """``[B, H, S + open_max + T (+ in_step * bs), D]`` in ``new_rows``' dtype, in model space and the step mask's key
        order: the sealed rows (the kernels; sink rows and stale rows zero or as the pool has them), the open block,
        this step's rows, then the blocks the step seals as the seal stores them (``in_step_sealed``)."""
        pool = st.cache.pool(layer, which)
        rest = st.open_rows(layer, which, new_rows)
        if st.in_step:
            rest = torch.cat([rest, self.in_step_sealed(st, layer, which, lay, rest, codec).to(rest.dtype)], 2)
        if not st.sealed_max:
            return rest
        S = st.sealed_max * st.cache.block_size
        table = st.cache.rope_for(layer, lay.tensor_format(which))  # keys stored before RoPE: this layer's table
        rope = None if table is None else table.upto(int((st.first_pos + S).max()))
        sink, sink_ok = (lay.sink_rows(pool.tail)[st.batch.slot_ids].float(), st.sink_ok) if lay.sink_tokens else (None, None)
        out = cpu_attention.dequant(codec, pool, st.batch.block_tables, st.held, st.sealed_max, sink, sink_ok,
                                    rows=S + rest.shape[2], first_pos=st.first_pos, rope=rope)
        out[:, :, S:] = rest
        return out.to(new_rows.dtype)

    def in_step_sealed(self, st: CpuStep, layer: int, which: str, lay: PagedKVLayout, model_rows: torch.Tensor, codec) -> torch.Tensor:
        """``[B, H, in_step * bs, D]`` float32 in model space: the blocks a step across blocks seals, from its open blocks'
        and new rows ``model_rows`` [B, H, open_max + T, D] (fp16 values; a bfloat16 model's are exact in fp16), quantized
        as the pool's ``seal_rows`` quantizes them (``cache_layout.sealing``: a first block without its sink rows; this
        backend's ``quantize_blocks``) and read back by the kernels (``codec``). The codes go to the pool with the step's
        output (``StepSeals``): the pool stores them instead of quantizing the rows again."""
        B, H, _, D = model_rows.shape
        n, bs = st.in_step, lay.block_size
        rows = model_rows.float().gather(2, st.in_step_rows[:, None, :, None].expand(B, H, n * bs, D))  # a fresh tensor
        blocks = rows.view(B, H, n, bs, D).transpose(1, 2).reshape(B * n, H, bs, D)
        if lay.sink_tokens:  # the sequences whose first block the step seals: that block without its sink rows, in place
            firsts = blocks.view(B, n, H, bs, D)[:, 0]
            firsts.copy_(torch.where(st.in_step_first[:, None, None, None], sealing(firsts, 0, lay.sink_tokens)[0], firsts))
        first = (st.batch.context_lens // bs) * bs  # [B] the position of each sequence's first in-step block
        positions = first[:, None] + torch.arange(n, device=blocks.device)[None, :] * bs
        qt = self.quantize_blocks(st.cache, layer, which, blocks, positions.reshape(-1))  # the pool's own seal
        st.in_step_codes[(layer, which)] = qt
        table = st.cache.rope_for(layer, lay.tensor_format(which))  # keys stored before RoPE: this layer's table
        rope = None if table is None else table.upto(int(first.max()) + n * bs)
        return cpu_attention.dequant_blocks(codec, qt, B, first_pos=first, rope=rope)

    # ------------------------------------------------------------------ the seal

    def seal_codec(self, cache, layer: int, which: str):
        """The C seal of ``layer``'s K or V (``cpu_attention.SealCodec``; made once per cache), or None where the
        reference quantizer seals: a format the kernel does not take, a pool off the CPU."""
        def make():
            if cache.tensors["k_tail"].device.type != "cpu" or cpu_attention.unavailable() is not None:
                return None
            lay = cache.layout_of(layer)
            return cpu_attention.SealCodec.of(lay.tensor_format(which), getattr(cache.params[layer], which), lay.num_kv_heads, lay.head_dim,
                                              lay.block_size)
        return self.cached(cache, ("seal", layer, which), make)

    def quantize_blocks(self, cache, layer, which, rows, first_positions) -> QuantizedTensor:
        """trtkv's C seal where it takes the format (the reference quantizer's bytes, one call; it refuses a NaN or inf
        as ``check_finite`` does), else the reference quantizer."""
        codec = self.seal_codec(cache, layer, which)
        if codec is None:
            return super().quantize_blocks(cache, layer, which, rows, first_positions)
        tf, params = cache.layout_of(layer).tensor_format(which), getattr(cache.params[layer], which)
        return cpu_attention.seal(codec, forward_transform(rows, tf, params, head_axis=-3))
