"""ONNX Runtime execution of the ``trtkv::`` plugin nodes: onnxruntime-extensions Python custom ops backed by the
references of the op contract (``trtkv.plugins.reference.run_op``).

onnxruntime-extensions registers Python ops in its own domain (``ai.onnx.contrib``), with one input type list
per op type, and takes no float16 tensors. So the build writes ``model.ort.onnx`` beside ``model.onnx``: the
same graph (same external weights file) with each ``trtkv::PagedPrefillAttention`` node renamed to
``ai.onnx.contrib::PagedPrefillAttention_<kcodes>_<vcodes>`` (``i8`` / ``u8`` / ``f``), every float16 input cast
to float32 once (the op casts back to float16 before calling the reference) and its float32 output cast to
float16. ``model.onnx`` keeps the contract's nodes for TensorRT.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import torch

from trtkv.plugins import contract as C

ORT_DOMAIN = "ai.onnx.contrib"
_CODES = {onnx.TensorProto.INT8: "i8", onnx.TensorProto.UINT8: "u8", onnx.TensorProto.FLOAT16: "f", onnx.TensorProto.FLOAT: "f"}


@functools.lru_cache(maxsize=None)
def _register_variant(name: str) -> None:
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    from trtkv.plugins.reference import run_op

    spec = C.PREFILL
    kc, vc = name.split("_")[-2:]
    dt = {"i8": PyCustomOpDef.dt_int8, "u8": PyCustomOpDef.dt_uint8, "f": PyCustomOpDef.dt_float}
    by_name = {"float16": PyCustomOpDef.dt_float, "float32": PyCustomOpDef.dt_float, "int32": PyCustomOpDef.dt_int32}
    types = [dt[kc] if t.dtype == "codes:k" else dt[vc] if t.dtype == "codes:v" else by_name[t.dtype] for t in spec.inputs]
    attr_types = {int: PyCustomOpDef.dt_int64, float: PyCustomOpDef.dt_float, str: PyCustomOpDef.dt_string}
    attrs = {a.name: attr_types[a.type] for a in spec.attrs}
    half = [t.dtype == "float16" or (t.dtype.startswith("codes") and (kc if t.dtype == "codes:k" else vc) == "f") for t in spec.inputs]

    @functools.lru_cache(maxsize=None)
    def validated(items: tuple) -> C.Attrs:  # a node's attributes never change: checked and parsed once per node kind
        return C.validate_attrs(spec, dict(items))

    @onnx_op(op_type=name, inputs=types, outputs=[PyCustomOpDef.dt_float], attrs=attrs)
    def _op(*args, **kw):
        tensors = {}
        for t, a, h in zip(spec.inputs, args, half):
            x = torch.from_numpy(np.ascontiguousarray(a))
            tensors[t.name] = x.half() if h else x
        try:
            a = validated(tuple(sorted(kw.items())))
        except TypeError:  # an unhashable attribute value: validate this call's
            a = kw
        return run_op(C.PREFILL.name, a, tensors)[0].float().numpy()


def register_ort_ops(session_options) -> None:
    """Register every PagedPrefillAttention variant and the onnxruntime-extensions library on ``session_options``."""
    from onnxruntime_extensions import get_library_path

    for kc in ("i8", "u8", "f"):
        for vc in ("i8", "u8", "f"):
            _register_variant(f"{C.PREFILL.name}_{kc}_{vc}")
    session_options.register_custom_ops_library(get_library_path())


def write_ort_model(src: str, dst: str) -> None:
    """``model.ort.onnx``: ``src``'s graph (external weights shared, not loaded) with the plugin nodes made runnable by ORT."""
    m = onnx.load(src, load_external_data=False)
    F16, F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    types = {i.name: i.type.tensor_type.elem_type for i in m.graph.input}
    types.update({t.name: t.data_type for t in m.graph.initializer})
    for node in m.graph.node:  # Cast / Gather outputs feeding the op: their element types
        if node.op_type == "Cast":
            types[node.output[0]] = next(a.i for a in node.attribute if a.name == "to")
        elif node.op_type == "Gather" and node.input[0] in types:
            types[node.output[0]] = types[node.input[0]]
    spec = C.PREFILL
    k_idx = next(i for i, t in enumerate(spec.inputs) if t.name == "k_data")
    v_idx = next(i for i, t in enumerate(spec.inputs) if t.name == "v_data")
    casts: dict[str, str] = {}
    nodes = []
    for node in m.graph.node:
        if node.domain == "trtkv" and node.op_type == C.PREFILL.name:
            node.op_type = f"{C.PREFILL.name}_{_CODES[types[node.input[k_idx]]]}_{_CODES[types[node.input[v_idx]]]}"
            node.domain = ORT_DOMAIN
            keep = [a for a in node.attribute if a.name not in C.PARSER_ATTRS]
            del node.attribute[:]
            node.attribute.extend(keep)
            for i, name in enumerate(node.input):
                if types.get(name) == F16:
                    if name not in casts:
                        casts[name] = f"{name}__f32"
                        nodes.append(onnx.helper.make_node("Cast", [name], [casts[name]], to=F32, name=f"cast_{name}"))
                    node.input[i] = casts[name]
            out = node.output[0]
            node.output[0] = f"{out}__f32"
            nodes.append(node)
            nodes.append(onnx.helper.make_node("Cast", [f"{out}__f32"], [out], to=F16, name=f"cast_{out}"))
        else:
            nodes.append(node)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    del m.opset_import[:]
    m.opset_import.extend([onnx.helper.make_opsetid("", 21), onnx.helper.make_opsetid(ORT_DOMAIN, 1)])
    onnx.save(m, dst)
