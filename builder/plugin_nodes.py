"""``--attention plugin``: each layer's attention is one ``trtkv::PagedPrefillAttention`` node of the sealed-block
op contract (``trtkv.plugins.contract``), in its padded form (``cu_seqlens = arange(B + 1) * T``), which covers
decode steps too.

This is the only module that emits plugin nodes (``contract.make_node``). Per layer: ``q`` ``[B*T, nh, D]``
fp16 (already times 1/sqrt(D), so ``sm_scale = 1``), ``k_new`` / ``v_new`` ``[B*T, H, D]`` fp16 (the open block's
values), that layer's pool and tail slices, int32 ``block_tables`` / ``context_lens`` / ``slot_ids``, the KV
constants ``[H, D]`` float32 and the Hadamard matrix; tensors a format does not use are placeholders
(``contract.placeholder_shape``). Pools keep their storage dtype (uint8 codes) at the boundary of a plugin graph,
as the contract declares them. Under ONNX Runtime the node runs as an onnxruntime-extensions Python op backed
by ``trtkv.plugins.reference.run_op`` (``plugins/ort_ops.py``).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from trtkv.builder.attention import NativeAttention, StepAttention, StepContext, _static
from trtkv.plugins import contract as C
from trtkv.quant import hadamard_matrix, per_channel

OP_TYPE = C.PREFILL.name  # the op every layer emits; plugins/ort_ops.py runs it under ONNX Runtime


class PluginAttention(StepAttention):
    name = "plugin"  # block sizes, head dims and storage dtypes: the capability table's ``plugin`` row

    def emit(self, ctx: StepContext, layer: int, q: str, k_new: str, v_new: str) -> str:
        g, lay = ctx.g, ctx.layout
        H, D, nh = lay.num_kv_heads, lay.head_dim, ctx.num_heads
        gi = ctx.extra["graph_inputs"]
        shared = self._shared(ctx)
        spec = C.get_op(OP_TYPE)
        attrs = C.attrs_for(spec, lay.fmt, num_q_heads=nh, num_kv_heads=H, head_dim=D, block_size=lay.block_size, sm_scale=1.0)
        kp, vp = ctx.params[layer].k, ctx.params[layer].v
        sh = lay.fmt.shared_kv_scale
        consts = {
            "k_static": _static(kp, lay.fmt.k, H, D, vp if sh else None),
            "k_smooth": None if kp.smooth is None else per_channel(kp.smooth, H, D, "K smoothing factors").numpy(),
            "v_static": _static(vp, lay.fmt.v, H, D, kp if sh else None),
            "v_smooth": None if vp.smooth is None else per_channel(vp.smooth, H, D, "V smoothing factors").numpy(),
            "hadamard": hadamard_matrix(D).numpy().astype(np.float32),
        }
        layer_idx = g.scalar(layer, np.int64)

        def packed(x, heads):  # [B, n, T, D] -> [B*T, n, D] fp16
            return g.cast(g.reshape(g.transpose(x, (0, 2, 1, 3)), (-1, heads, D)), TensorProto.FLOAT16)

        named = {"q": packed(q, nh), "k_new": packed(k_new, H), "v_new": packed(v_new, H), "cu_seqlens": shared["cu_seqlens"],
                 "block_tables": shared["block_tables"], "context_lens": shared["context_lens"], "slot_ids": shared["slot_ids"]}
        inputs = []
        for t in spec.inputs:
            if t.name in named:
                inputs.append(named[t.name])
            elif not t.used(attrs):
                dt = C.tensor_dtype(spec, t, attrs)
                inputs.append(g.const(np.zeros(C.placeholder_shape(t, attrs), {"float16": np.float16, "float32": np.float32, "int8": np.int8, "uint8": np.uint8}[dt]), f"ph_{t.name}"))
            elif t.name in consts:
                inputs.append(g.const(consts[t.name], t.name))
            else:  # pool / tail tensors: this layer's slice of the stacked graph input
                inputs.append(g.gather(gi[t.name], layer_idx))
        out = g.fresh("plugin_out")
        g.nodes.append(C.make_node(spec, inputs, [out], attrs, name=g.fresh(f"{OP_TYPE}_{layer}")))
        o = g.transpose(g.op("Reshape", out, ctx.extra["bt_nh_d"]), (0, 2, 1, 3))  # [B, T, nh, D] -> [B, nh, T, D]
        return o if ctx.compute == TensorProto.FLOAT16 else g.cast(o, ctx.compute)

    @staticmethod
    def _shared(ctx: StepContext) -> dict:
        if "plugin_shared" not in ctx.extra:
            g, gi = ctx.g, ctx.extra["graph_inputs"]
            B, T = ctx.extra["B"], ctx.extra["T"]
            i32 = TensorProto.INT32
            rng = g.op("Range", g.scalar(0, np.int64), g.op("Squeeze", g.add(B, g.i64(1)), g.i64(0)), g.scalar(1, np.int64))
            ctx.extra["bt_nh_d"] = g.concat(B, T, g.i64(ctx.num_heads), g.i64(ctx.layout.head_dim), axis=0)
            ctx.extra["plugin_shared"] = {
                "cu_seqlens": g.cast(g.mul(rng, g.op("Squeeze", T, g.i64(0))), i32),
                "block_tables": g.cast(gi["block_tables"], i32),
                "context_lens": g.cast(gi["context_lens"], i32),
                "slot_ids": g.cast(gi["slot_ids"], i32),
            }
        return ctx.extra["plugin_shared"]


# the --attention modes: the one registry, here because it names both backends (attention.py knows neither mode)
ATTENTION_MODES: dict[str, type[StepAttention]] = {"native": NativeAttention, "plugin": PluginAttention}


def get_backend(name: str) -> StepAttention:
    return ATTENTION_MODES[name]()
