"""``--attention plugin``: each layer's attention is ONE ``trtkv::PagedSealedAttention`` node.

This is the only module that emits plugin nodes, so moving to the sealed-block ops of plugins/contract.py
(being written in another branch) means changing ``emit`` here and ``builder/ort_ops.py``.

Why a provisional op and not the current contract's ``PagedPrefillAttention`` / ``PagedDecode*``: those read
new rows as quantized codes of the pool's format and per-token scales; the engine step contract attends
over the fp16 open block and the step's own fp16 rows, and the ``int4`` preset's keys have per-block
channel scales, neither of which the current ops can express. ``PagedSealedAttention`` takes exactly the
step contract's tensors (fixed arity, TensorRT-plugin style: absent tensors are placeholders of shape [1]):

    q [B, nh, T, D] (already times 1/sqrt(D)), k_new, v_new [B, H, T, D] (fp16 values), k_data, k_scale,
    k_zero, v_data, v_scale, v_zero (stacked pools, as graph inputs), k_tail, v_tail, block_tables,
    context_lens, slot_ids, k_static, k_smooth, v_static, v_smooth ([H, D] float32, ones when unused)
    -> out [B, nh, T, D]
    attributes: layer, k_format, v_format (TensorFormat.short()), block_size, num_q_heads, num_kv_heads, head_dim

Under ONNX Runtime the node runs as an onnxruntime-extensions Python custom op backed by the torch
reference (``builder/ort_ops.py``); there is no TensorRT plugin for it yet, so plugin mode builds only for
the onnxruntime backend.
"""

from __future__ import annotations

import numpy as np

from trtkv.builder.attention import BACKENDS, AttentionBackend, StepContext, _static
from trtkv.formats import TensorFormat

OP_TYPE = "PagedSealedAttention"
DOMAIN = "trtkv"
INPUTS = (
    "q", "k_new", "v_new", "k_data", "k_scale", "k_zero", "v_data", "v_scale", "v_zero", "k_tail", "v_tail",
    "block_tables", "context_lens", "slot_ids", "k_static", "k_smooth", "v_static", "v_smooth",
)


def _expand(x: np.ndarray | None, H: int, D: int) -> np.ndarray:
    if x is None:
        return np.ones((H, D), np.float32)
    return np.broadcast_to(x.reshape(H, -1) if x.size > 1 else x.reshape(1, 1), (H, D)).astype(np.float32).copy()


class PluginAttention(AttentionBackend):
    name = "plugin"
    block_sizes = (4, 8, 16, 32, 64, 128, 256)

    def format_reason(self, t: TensorFormat) -> str | None:
        return None  # the torch reference behind the op reads every format

    def emit(self, ctx: StepContext, layer: int, q: str, k_new: str, v_new: str) -> str:
        g, lay = ctx.g, ctx.layout
        H, D = lay.num_kv_heads, lay.head_dim
        graph = ctx.extra["graph_inputs"]
        ph = ctx.extra.setdefault("placeholder", g.const(np.zeros(1, np.float16), "placeholder"))
        kp, vp = ctx.params[layer].k, ctx.params[layer].v
        shared = lay.fmt.shared_kv_scale
        ks, vs = _static(kp, lay.fmt.k, H, D, vp if shared else None), _static(vp, lay.fmt.v, H, D, kp if shared else None)

        def const(x, name):
            return g.const(_expand(x, H, D), name)

        inputs = [q, k_new, v_new]
        for which in ("k", "v"):
            inputs += [graph[f"{which}_data"], graph.get(f"{which}_scale", ph), graph.get(f"{which}_zero", ph)]
        inputs += [graph["k_tail"], graph["v_tail"], graph["block_tables"], graph["context_lens"], graph["slot_ids"]]
        inputs += [
            const(ks, "k_static"), const(None if kp.smooth is None else kp.smooth.float().numpy(), "k_smooth"),
            const(vs, "v_static"), const(None if vp.smooth is None else vp.smooth.float().numpy(), "v_smooth"),
        ]
        return g.op(
            OP_TYPE, *inputs, domain=DOMAIN, layer=layer, k_format=lay.fmt.k.short(), v_format=lay.fmt.v.short(),
            block_size=lay.block_size, num_q_heads=ctx.num_heads, num_kv_heads=H, head_dim=D,
        )


BACKENDS["plugin"] = PluginAttention
