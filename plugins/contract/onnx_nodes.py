"""ONNX node emission: ``make_node``, the decode pair, opset imports and output value_infos."""

from __future__ import annotations

from typing import Any, Sequence

from trtkv.errors import TrtkvError
from trtkv.formats import ELEM_TYPES

from .attrs import validate_attrs
from .shapes import output_dtypes, output_shapes
from .specs import DECODE_PARTITION, DECODE_REDUCE, DOMAIN, PLUGIN_VERSION, OpSpec, get_op
from .symbolic import INT_OPS, SYM_OPS, Sym

# op_type names the parser would import as built-in ONNX ops instead of looking up a plugin
_ONNX_BUILTIN_CLASH = {"Attention", "RotaryEmbedding", "DequantizeLinear", "QuantizeLinear", "Scatter", "Gather"}

ONNX_ELEM = {name: e.onnx for name, e in ELEM_TYPES.items()}  # onnx.TensorProto enums (trtkv.formats.ELEM_TYPES)


def onnx_attributes(op: OpSpec | str, attrs: dict[str, Any]) -> dict[str, Any]:
    """Every declared attribute (validated) plus the parser's routing attributes."""
    op = get_op(op) if isinstance(op, str) else op
    a = validate_attrs(op, attrs)
    return {**a, "plugin_namespace": DOMAIN, "plugin_version": PLUGIN_VERSION, "aot": 1}


def make_node(op: OpSpec | str, inputs: Sequence[str], outputs: Sequence[str], attrs: dict[str, Any],
              name: str | None = None):
    """An ``onnx.NodeProto`` for one trtkv op in domain ``trtkv`` (TensorRT maps it to the plugin).

    ``inputs`` / ``outputs`` are tensor names in the order of ``op.inputs`` / ``op.outputs``; an
    unused input still needs a (placeholder) tensor — TensorRT plugins have a fixed input count.
    """
    import onnx.helper

    op = get_op(op) if isinstance(op, str) else op
    if op.name in _ONNX_BUILTIN_CLASH:
        raise AssertionError(op.name)
    if len(inputs) != len(op.inputs) or any(not n for n in inputs):
        raise TrtkvError(f"{op.name} takes {len(op.inputs)} named inputs ({', '.join(t.name for t in op.inputs)}), "
                         f"got {list(inputs)}", "give placeholder tensors for unused inputs")
    if len(outputs) != len(op.outputs) or any(not n for n in outputs):
        raise TrtkvError(f"{op.name} has {len(op.outputs)} outputs ({', '.join(t.name for t in op.outputs)}), "
                         f"got {list(outputs)}")
    return onnx.helper.make_node(op.name, list(inputs), list(outputs), name=name or None, domain=DOMAIN,
                                 **onnx_attributes(op, attrs))


def make_decode_nodes(inputs: Sequence[str], out: str, attrs: dict[str, Any], *, prefix: str):
    """The two nodes of one decode attention: PagedDecodePartition -> PagedDecodeReduce.

    ``inputs`` are the PagedDecodePartition inputs; ``attrs`` the PagedDecodePartition attributes
    (the reduce node takes its subset and V's constants from ``inputs``). Returns (nodes, names of the
    three partial tensors).
    """
    parts = [f"{prefix}/part_m", f"{prefix}/part_l", f"{prefix}/part_acc"]
    a = validate_attrs(DECODE_PARTITION, attrs)
    n1 = make_node(DECODE_PARTITION, inputs, parts, a, name=f"{prefix}/partition")
    pick = {n: inputs[DECODE_PARTITION.input_index(n)] for n in ("context_lens", "v_static", "v_smooth", "hadamard")}
    red = {k: a[k] for k in (x.name for x in DECODE_REDUCE.attrs)}
    n2 = make_node(DECODE_REDUCE, [*parts, pick["context_lens"], pick["v_static"], pick["v_smooth"], pick["hadamard"]],
                   [out], red, name=f"{prefix}/reduce")
    return [n1, n2], parts


def opset_imports(onnx_opset: int = 17):
    import onnx.helper

    return [onnx.helper.make_opsetid("", onnx_opset), onnx.helper.make_opsetid(DOMAIN, 1)]


def value_infos(op: OpSpec | str, attrs: dict[str, Any], outputs: Sequence[str], input_shapes,
                symbolic: dict[str, str] | None = None):
    """ONNX value_info for a node's outputs (ONNX shape inference cannot see into custom ops).

    ``input_shapes`` may hold ints or ``Sym``; a ``Sym`` output dim becomes a dim_param (its text,
    or ``symbolic[text]`` when given).
    """
    import onnx.helper

    op = get_op(op) if isinstance(op, str) else op
    a = validate_attrs(op, attrs)
    ops = SYM_OPS if any(isinstance(d, Sym) for sh in input_shapes for d in sh) else INT_OPS
    shapes = output_shapes(op, a, input_shapes, ops)
    infos = []
    for name, shape, dt in zip(outputs, shapes, output_dtypes(op, a)):
        dims = [(symbolic or {}).get(d.text, d.text) if isinstance(d, Sym) else int(d) for d in shape]
        infos.append(onnx.helper.make_tensor_value_info(name, ONNX_ELEM[dt], dims))
    return infos
