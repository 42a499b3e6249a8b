"""ONNX Runtime execution of the ``trtkv::`` plugin nodes: onnxruntime-extensions Python custom ops backed by
the torch references (``trtkv.cache_layout.gather_paged`` + float32 attention).

onnxruntime-extensions registers Python ops in its own domain (``ai.onnx.contrib``) and one input type
list per op type, so the build writes ``model.ort.onnx`` beside ``model.onnx``: the same graph (same external
weights file) with each ``trtkv::PagedSealedAttention`` node renamed to
``ai.onnx.contrib::PagedSealedAttention_<kdata>_<vdata>`` (``i8`` or ``f`` pools). Python custom ops take no
float16 tensors, so every float16 input of those nodes (tails, scales, fp16 pools) is cast to float32 once,
before the first layer. ``model.onnx`` keeps the ``trtkv`` nodes (fp16 inputs) for TensorRT.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import torch

from trtkv.builder.plugin_nodes import INPUTS, OP_TYPE
from trtkv.cache_layout import KVPool, PagedKVLayout, gather_paged
from trtkv.formats import KVFormat, parse_tensor_spec
from trtkv.quant import TensorParams

ORT_DOMAIN = "ai.onnx.contrib"
_VARIANTS = ("i8", "f")


def variant_name(k_data_dtype: str, v_data_dtype: str) -> str:
    short = lambda d: "f" if d == "float16" else "i8"  # noqa: E731
    return f"{OP_TYPE}_{short(k_data_dtype)}_{short(v_data_dtype)}"


def _params(fmt, static: np.ndarray, smooth: np.ndarray) -> TensorParams:
    return TensorParams(scale=torch.from_numpy(static) if fmt.is_static else None, smooth=torch.from_numpy(smooth) if fmt.smooth else None)


def sealed_attention(q, k_new, v_new, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, block_tables, context_lens, slot_ids,
                     k_static, k_smooth, v_static, v_smooth, *, layer, k_format, v_format, block_size, num_q_heads, num_kv_heads, head_dim):
    """Reference of PagedSealedAttention: per sequence, the cached K/V read back (sealed blocks dequantized, open block
    fp16) and the step's rows appended, causal attention of the step's queries. Output [B, nh, T, D] float32."""
    kf, vf = parse_tensor_spec(k_format), parse_tensor_spec(v_format)
    fmt = KVFormat(name="op", k=kf, v=vf, block_size=block_size)
    lay = PagedKVLayout(fmt, num_kv_heads, head_dim, block_size, k_data.shape[1], k_tail.shape[1])
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731

    def pool(data, scale, zero, tail, tf):
        d = t(data[layer])
        if d.dtype == torch.int8 and (tf.dtype != "int8" or not (tf.symmetric or tf.is_static)):
            d = d.view(torch.uint8)  # the graph declares every 8-bit pattern int8
        has = tf.is_dynamic
        return KVPool(d, t(scale[layer]) if has else None, t(zero[layer]) if has and not tf.symmetric else None, t(tail[layer]))

    kpool, vpool = pool(k_data, k_scale, k_zero, k_tail, kf), pool(v_data, v_scale, v_zero, v_tail, vf)
    kp, vp = _params(kf, k_static, k_smooth), _params(vf, v_static, v_smooth)
    q, k_new, v_new = t(q).float(), t(k_new).float(), t(v_new).float()
    B, nh, T, D = q.shape
    grp = nh // num_kv_heads
    out = torch.zeros(B, nh, T, D)
    bt = t(block_tables)
    for b in range(B):
        c, s = int(context_lens[b]), int(slot_ids[b])
        ks = torch.cat([gather_paged(lay, "k", kpool, bt[b], c, kp, slot=s), k_new[b].transpose(0, 1)], 0)  # [c+T, H, D]
        vs = torch.cat([gather_paged(lay, "v", vpool, bt[b], c, vp, slot=s), v_new[b].transpose(0, 1)], 0)
        ks = ks.transpose(0, 1).repeat_interleave(grp, 0)  # [nh, c+T, D]
        vs = vs.transpose(0, 1).repeat_interleave(grp, 0)
        scores = q[b] @ ks.transpose(1, 2)  # [nh, T, c+T]
        causal = torch.arange(c + T)[None, :] <= (c + torch.arange(T))[:, None]
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
        out[b] = p @ vs
    return out.numpy()


@functools.lru_cache(maxsize=None)
def _register_variant(name: str) -> None:
    from onnxruntime_extensions import PyCustomOpDef, onnx_op  # noqa: PLC0415

    kd, vd = name.split("_")[-2:]
    dt = {"i8": PyCustomOpDef.dt_int8, "f": PyCustomOpDef.dt_float}
    f, i64 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int64
    h = f  # float16 inputs arrive cast to float32 (write_ort_model)
    types = [f, f, f, dt[kd], h, h, dt[vd], h, h, h, h, i64, i64, i64, f, f, f, f]
    assert len(types) == len(INPUTS)
    attrs = {"layer": PyCustomOpDef.dt_int64, "k_format": PyCustomOpDef.dt_string, "v_format": PyCustomOpDef.dt_string,
             "block_size": PyCustomOpDef.dt_int64, "num_q_heads": PyCustomOpDef.dt_int64, "num_kv_heads": PyCustomOpDef.dt_int64,
             "head_dim": PyCustomOpDef.dt_int64}

    @onnx_op(op_type=name, inputs=types, outputs=[f], attrs=attrs)
    def _op(*args, **kw):
        return sealed_attention(*args, **kw)


def register_ort_ops(session_options) -> None:
    """Register every PagedSealedAttention variant and the onnxruntime-extensions library on ``session_options``."""
    from onnxruntime_extensions import get_library_path  # noqa: PLC0415

    for kd in _VARIANTS:
        for vd in _VARIANTS:
            _register_variant(f"{OP_TYPE}_{kd}_{vd}")
    session_options.register_custom_ops_library(get_library_path())


def write_ort_model(src: str, dst: str) -> None:
    """``model.ort.onnx``: ``src``'s graph (external weights shared, not loaded) with the plugin nodes renamed for ORT."""
    m = onnx.load(src, load_external_data=False)
    F16 = onnx.TensorProto.FLOAT16
    types = {i.name: i.type.tensor_type.elem_type for i in m.graph.input}
    types.update({t.name: t.data_type for t in m.graph.initializer})
    casts: dict[str, str] = {}
    cast_nodes = []
    for node in m.graph.node:
        if node.op_type == OP_TYPE:
            kd = "float16" if types[node.input[3]] == F16 else "int8"
            vd = "float16" if types[node.input[6]] == F16 else "int8"
            node.op_type, node.domain = variant_name(kd, vd), ORT_DOMAIN
            for i, name in enumerate(node.input):
                if types.get(name) == F16:
                    if name not in casts:
                        casts[name] = f"{name}__f32"
                        cast_nodes.append(onnx.helper.make_node("Cast", [name], [casts[name]], to=onnx.TensorProto.FLOAT, name=f"cast_{name}"))
                    node.input[i] = casts[name]
    nodes = cast_nodes + list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    del m.opset_import[:]
    m.opset_import.extend([onnx.helper.make_opsetid("", 21), onnx.helper.make_opsetid(ORT_DOMAIN, 1)])
    onnx.save(m, dst)
