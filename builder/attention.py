"""The step network's attention: one emitter per exporter of the attention registry, chosen by ``--attention``.

Each is an exporter of ``trtkv.attention`` (its capability row: which formats, head dims and block sizes it supports,
and the reasons a configuration is rejected, ``reasons``) and emits the attention of one layer (``emit``) over the
engine's cache inputs:

* ``native``: standard ONNX ops only (Gather, integer unpack / LUT decode, MatMul, Where, Softmax) that
  ONNX Runtime and every TensorRT flavour accept;
* ``plugin``: ``trtkv::`` nodes (builder/plugin_nodes.py), executed by TensorRT plugins on GPUs and, here,
  by onnxruntime-extensions Python custom ops backed by the torch references.

Attention of new token ``t`` of sequence ``b`` covers the sealed blocks (dequantized from the pool; the first
``sink_tokens`` positions from the tail's sink rows instead), the
open block's ``context_lens[b] % block_size`` rows and the step's own rows ``0 … t`` as fp16 values
(docs/kv-cache-format.md). K's transforms and static scale are folded into the query for the sealed
part; V's are undone once on the sealed part's output (docs/kv-formats.md section 2).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch
from onnx import TensorProto

from trtkv.attention import exporter
from trtkv.builder.graph import Graph
from trtkv.cache_layout import PagedKVLayout
from trtkv.formats import KVFormat, TensorFormat
from trtkv.plugins.contract.capabilities import ExecutionPath
from trtkv.quant import TensorParams, hadamard_matrix, per_channel

NEG_INF = float("-inf")


@dataclass
class StepContext:
    """Names of the graph tensors every layer's attention reads (built once per network)."""

    g: Graph
    layout: PagedKVLayout
    num_layers: int
    num_heads: int
    compute: int  # TensorProto.FLOAT or FLOAT16
    params: list  # per-layer LayerParams (k / v TensorParams)
    pool: dict[str, str] = field(default_factory=dict)  # k_data_flat, k_scale_flat, ..., k_tail_flat
    num_blocks: str = ""  # [1] int64: Shape(k_data)[1]
    num_slots: str = ""  # [1] int64: Shape(k_tail)[1]
    block_idx: str = ""  # [B, MB] int64: block tables clamped to >= 0
    slot_ids: str = ""  # [B]
    sealed_valid: str = ""  # [B, 1, MB*bs, 1] bool
    tail_valid: str = ""  # [B, 1, bs + sink, 1] bool
    mask: str = ""  # [B, 1, g*T, MB*bs + bs + sink + T] bool: key visible to query (rows: GQA group-major, then token)
    sealed_len: str = ""  # [1] int64: MB * bs
    layer_masks: dict[int, str] = field(default_factory=dict)  # sliding-window layers: ``mask`` and key_pos > q_pos - window
    logit_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap) before the mask
    extra: dict = field(default_factory=dict)  # backend-specific shared tensors

    def mask_for(self, layer: int) -> str:
        return self.layer_masks.get(layer, self.mask)

    @property
    def group(self) -> int:
        return self.num_heads // self.layout.num_kv_heads


class StepAttention(ABC):
    """One way to compute attention over the paged cache inside the step network."""

    name: str = ""

    @property
    def path(self) -> ExecutionPath:
        """This exporter's row of the attention registry (``trtkv.attention.EXPORTERS``)."""
        return exporter(self.name).path

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return self.path.block_sizes

    @property
    def head_dims(self) -> tuple[int, ...] | None:  # None: any (even for int4)
        return self.path.head_dims

    def reasons(self, fmt: KVFormat, head_dim: int, block_size: int) -> list[str]:
        """Why this backend cannot build ``fmt`` at this head dim and block size ([] when it can): the table's answer
        (the pool layout and the model are asked apart, by the builder)."""
        return [*self.path.size_reasons(block_size, head_dim), *self.path.format_reasons(fmt)]

    @abstractmethod
    def emit(self, ctx: StepContext, layer: int, q: str, k_new: str, v_new: str) -> str:
        """Attention output [B, nh, T, D] (compute dtype) of layer ``layer``.

        ``q`` [B, nh, T, D] after RoPE and already multiplied by 1/sqrt(D); ``k_new``/``v_new`` [B, H, T, D]
        this step's rows as fp16 values (in the compute dtype).
        """


# --------------------------------------------------------------------------- native


def _byte_lut(t: TensorFormat) -> np.ndarray:
    """The ``DtypeTraits.byte_table`` of ``t``'s codes, its rows reordered to be indexed by ``int32(x) + 128`` where
    ``x`` is the byte read as int8 (the pool's graph dtype): [256] values, or [256, 2] for int4 (the even channel
    first). One Gather decodes a whole tile."""
    table = t.traits.byte_table(t.symmetric)[(torch.arange(256) - 128) % 256]  # row i: the byte whose int8 value is i - 128
    return table.squeeze(-1).numpy()


def _plane_lut(t: TensorFormat, plane: int) -> np.ndarray:
    """``DtypeTraits.plane_tables`` of a bit-plane dtype (int3), plane ``plane``, indexed like ``_byte_lut``."""
    return t.traits.plane_tables(t.symmetric)[plane][(torch.arange(256) - 128) % 256].numpy()


def _static(p: TensorParams | None, t: TensorFormat, H: int, D: int, shared: TensorParams | None = None) -> np.ndarray | None:
    """A static scale as the [H, D] float32 constant (``quant.per_channel``), or None for a dynamic format."""
    if not t.is_static:
        return None
    s = p.scale if p is not None and p.scale is not None else (shared.scale if shared is not None else None)
    assert s is not None, "static format without a scale (checked by the builder)"
    return per_channel(s, H, D, "a static scale").numpy()


def _lut(ctx: StepContext, t: TensorFormat, plane: int | None = None) -> str:
    """One initializer per decode table (per bit plane for int3), shared by every layer."""
    key = f"lut_{t.dtype}_{'sym' if t.symmetric else 'asym'}" + ("" if plane is None else f"_p{plane}")
    if key not in ctx.extra:
        ctx.extra[key] = ctx.g.const(_byte_lut(t) if plane is None else _plane_lut(t, plane), key)
    return ctx.extra[key]


class NativeAttention(StepAttention):
    name = "native"

    # ------------------------------------------------------------------ decode of the gathered pool

    def _codes(self, ctx: StepContext, which: str, layer: int) -> str:
        """Sealed codes of layer ``layer`` as values [B, H, MB, bs, D] (compute dtype): the pool in transformed space.

        Gather(pool, block_table) -> Transpose -> decode -> times the gathered dynamic scales (+ zero). Decode: fp16
        and int8 codes are a Cast; unsigned int8, fp8 bits and packed int4 (all int8 at the graph boundary) are one
        Gather from a 256-entry table indexed by int32(x) + 128 (no bit ops, no UINT8 tensors: TensorRT-RTX has neither).
        """
        g, lay = ctx.g, ctx.layout
        t = lay.tensor_format(which)
        D = lay.head_dim
        idx = g.add(ctx.block_idx, g.mul(g.scalar(layer, np.int64), ctx.num_blocks))  # [B, MB] into the flattened [L*NB, ...]
        codes = g.transpose(g.gather(ctx.pool[f"{which}_data"], idx), (0, 2, 1, 3, 4))  # [B, H, MB, bs, P]
        f32 = TensorProto.FLOAT
        if t.storage.name != "uint8":  # fp16 values and signed int8 codes are their own values
            x = g.cast(codes, f32)
        elif len(t.traits.planes) > 1:  # bit planes (int3): one Gather per plane's bytes, the planes' values summed
            xi = g.add(g.cast(codes, TensorProto.INT32), g.scalar(128, np.int32))
            parts = []
            for k, (byte, width, _) in enumerate(t.traits.plane_layout(D)):
                sl = g.op("Slice", xi, g.i64(byte), g.i64(byte + D * width // 8), g.i64(4))
                parts.append(g.reshape(g.gather(_lut(ctx, t, k), sl), (0, 0, 0, 0, D)))
            x = parts[0]
            for part in parts[1:]:
                x = g.add(x, part)
        else:  # uint8 storage declared int8: LUT[int8 + 128] = the code values of the byte
            x = g.gather(_lut(ctx, t), g.add(g.cast(codes, TensorProto.INT32), g.scalar(128, np.int32)))
            if t.traits.packed:  # [..., P, codes per byte] -> [..., D], channel order within a byte
                x = g.reshape(x, (0, 0, 0, 0, D))
        if t.is_dynamic:
            x = self._apply_dynamic(ctx, which, idx, x, t)
        return x if ctx.compute == f32 else g.cast(x, ctx.compute)

    def _apply_dynamic(self, ctx: StepContext, which: str, idx: str, x: str, t: TensorFormat) -> str:
        g, D = ctx.g, ctx.layout.head_dim
        f32 = TensorProto.FLOAT

        rank = len(ctx.layout.scale_shape(which, "MB", layers="B"))  # [B, MB, H, D] block-wise, [B, MB, H, bs, G] per token

        def gathered(name: str) -> str:  # heads before blocks, as the data: [B, H, MB, 1, D] / [B, H, MB, bs, G, 1]
            s = g.transpose(g.gather(ctx.pool[f"{which}_{name}"], idx), (0, 2, 1, *range(3, rank)))
            return g.cast(g.unsqueeze(s, 3 if t.is_block_wise else -1), f32)

        if t.is_block_wise:
            x = g.mul(x, gathered("scale"))
            return x if t.symmetric else g.add(x, gathered("zero"))
        G = t.groups(D)
        xg = g.reshape(x, (0, 0, 0, 0, G, D // G))
        xg = g.mul(xg, gathered("scale"))
        if not t.symmetric:
            xg = g.add(xg, gathered("zero"))
        return g.reshape(xg, (0, 0, 0, 0, D))

    def _sealed(self, ctx: StepContext, which: str, layer: int) -> str:
        """[B, H, MB*bs, D] sealed values in transformed space, zero where not readable (NaN-safe)."""
        g = ctx.g
        x = g.reshape(self._codes(ctx, which, layer), (0, 0, -1, ctx.layout.head_dim))
        return g.where(ctx.sealed_valid, x, g.scalar(0.0, _np_dtype(ctx.compute)))

    def _tail(self, ctx: StepContext, which: str, layer: int) -> str:
        """[B, H, bs + sink, D] open-block and sink rows (compute dtype), zero where a sequence does not read them."""
        g = ctx.g
        idx = g.add(ctx.slot_ids, g.mul(g.scalar(layer, np.int64), ctx.num_slots))
        x = g.gather(ctx.pool[f"{which}_tail"], idx)
        if ctx.compute != TensorProto.FLOAT16:
            x = g.cast(x, ctx.compute)
        return g.where(ctx.tail_valid, x, g.scalar(0.0, _np_dtype(ctx.compute)))

    # ------------------------------------------------------------------ attention

    def emit(self, ctx: StepContext, layer: int, q: str, k_new: str, v_new: str) -> str:
        g, lay = ctx.g, ctx.layout
        H, D = lay.num_kv_heads, lay.head_dim
        npd = _np_dtype(ctx.compute)
        kf, vf = lay.fmt.k, lay.fmt.v
        kp, vp = ctx.params[layer].k, ctx.params[layer].v
        # queries of a GQA group as rows of their KV head: [B, nh, T, D] -> [B, H, g*T, D]
        qg = g.reshape(q, (0, H, -1, D))
        # K side: fold smoothing, rotation and static scale into the query of the sealed part
        qs = qg
        if kf.smooth:
            qs = g.mul(qs, g.const(per_channel(kp.smooth, H, D, "K smoothing factors").numpy().reshape(H, 1, D).astype(npd), "k_smooth"))
        if kf.hadamard:
            qs = g.matmul(qs, g.const(hadamard_matrix(D).numpy().astype(npd), "hadamard"))
        ks = _static(kp, kf, H, D, vp if lay.fmt.shared_kv_scale else None)
        if ks is not None:
            qs = g.mul(qs, g.const(ks.reshape(H, 1, D).astype(npd), "k_static"))
        k_sealed = self._sealed(ctx, "k", layer)
        k_rest = g.concat(self._tail(ctx, "k", layer), k_new, axis=2)  # [B, H, bs + sink + T, D]
        s_sealed = g.matmul(qs, g.transpose(k_sealed, (0, 1, 3, 2)))
        s_rest = g.matmul(qg, g.transpose(k_rest, (0, 1, 3, 2)))
        scores = g.concat(s_sealed, s_rest, axis=-1)  # [B, H, g*T, Kl]
        if ctx.compute != TensorProto.FLOAT:
            scores = g.cast(scores, TensorProto.FLOAT)
        if ctx.logit_softcap:
            cap = g.scalar(ctx.logit_softcap, np.float32)
            scores = g.mul(g.op("Tanh", g.div(scores, cap)), cap)
        scores = g.where(ctx.mask_for(layer), scores, g.scalar(NEG_INF, np.float32))
        p = g.op("Softmax", scores, axis=-1)
        if ctx.compute != TensorProto.FLOAT:
            p = g.cast(p, ctx.compute)
        big = g.i64(2**62)
        p_sealed = g.op("Slice", p, g.i64(0), ctx.sealed_len, g.i64(3))
        p_rest = g.op("Slice", p, ctx.sealed_len, big, g.i64(3))
        # V side: attend over the stored values, then undo V's static scale, rotation, smoothing once
        o = g.matmul(p_sealed, self._sealed(ctx, "v", layer))  # [B, H, g*T, D]
        vs = _static(vp, vf, H, D, kp if lay.fmt.shared_kv_scale else None)
        if vs is not None:
            o = g.mul(o, g.const(vs.reshape(H, 1, D).astype(npd), "v_static"))
        if vf.hadamard:
            o = g.matmul(o, g.const(hadamard_matrix(D).numpy().T.copy().astype(npd), "hadamard_t"))
        if vf.smooth:
            o = g.mul(o, g.const(per_channel(vp.smooth, H, D, "V smoothing factors").numpy().reshape(H, 1, D).astype(npd), "v_smooth"))
        v_rest = g.concat(self._tail(ctx, "v", layer), v_new, axis=2)
        o = g.add(o, g.matmul(p_rest, v_rest))
        return g.op("Reshape", o, ctx.extra["q_shape"])  # [B, H, g*T, D] -> [B, nh, T, D]


def _np_dtype(elem: int):
    return np.float16 if elem == TensorProto.FLOAT16 else np.float32

