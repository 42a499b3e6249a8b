"""A small ONNX graph builder over ``onnx.helper`` and numpy: named initializers, one call per node.

The step network is written with this directly (not ``torch.onnx.export``) so that every pattern in it is
one we chose and measured under ONNX Runtime and TensorRT-RTX (docs/builder.md).
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 21
DTYPE = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}
NP_DTYPE = {"fp32": np.float32, "fp16": np.float16}
ONNX_NAMES = {
    TensorProto.FLOAT: "float32",
    TensorProto.FLOAT16: "float16",
    TensorProto.INT8: "int8",
    TensorProto.UINT8: "uint8",
    TensorProto.INT32: "int32",
    TensorProto.INT64: "int64",
    TensorProto.BOOL: "bool",
}


class Graph:
    """Accumulates nodes, initializers, inputs and outputs; ``model()`` makes the ModelProto."""

    def __init__(self, name: str, custom_domains: dict[str, int] | None = None):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.value_infos: list[onnx.ValueInfoProto] = []
        self.custom_domains = dict(custom_domains or {})
        self._ids = itertools.count()
        self._const_cache: dict[tuple, str] = {}

    def fresh(self, hint: str) -> str:
        return f"{hint}_{next(self._ids)}"

    # ------------------------------------------------------------------ declarations

    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, name: str, elem_type: int, shape: list) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def const(self, value, hint: str = "c", dtype=None) -> str:
        """An initializer from a numpy array (small scalars / index vectors are shared by value)."""
        arr = np.asarray(value, dtype=dtype) if dtype is not None or not isinstance(value, np.ndarray) else value
        key = None
        if arr.size <= 16:
            key = (arr.dtype.str, arr.shape, arr.tobytes())
            if key in self._const_cache:
                return self._const_cache[key]
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(arr.copy(order="C"), name))  # ascontiguousarray would make a 0-d scalar [1]
        if key is not None:
            self._const_cache[key] = name
        return name

    def i64(self, *values: int) -> str:
        return self.const(np.array(values, dtype=np.int64), "i64")

    def scalar(self, value, dtype) -> str:
        return self.const(np.array(value, dtype=dtype), "s")

    # ------------------------------------------------------------------ nodes

    def op(self, op_type: str, *inputs: str, outputs: int | list[str] = 1, domain: str = "", name: str | None = None, **attrs):
        """Add a node; returns its output name (or list of names when ``outputs`` > 1)."""
        outs = outputs if isinstance(outputs, list) else [self.fresh(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name or self.fresh(f"n_{op_type}"), domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    # shorthands used everywhere in the step network
    def add(self, a, b):
        return self.op("Add", a, b)

    def sub(self, a, b):
        return self.op("Sub", a, b)

    def mul(self, a, b):
        return self.op("Mul", a, b)

    def div(self, a, b):
        return self.op("Div", a, b)

    def matmul(self, a, b):
        return self.op("MatMul", a, b)

    def cast(self, x, to: int):
        return self.op("Cast", x, to=to)

    def reshape(self, x, shape):
        return self.op("Reshape", x, shape if isinstance(shape, str) else self.i64(*shape))

    def transpose(self, x, perm):
        return self.op("Transpose", x, perm=list(perm))

    def unsqueeze(self, x, *axes):
        return self.op("Unsqueeze", x, self.i64(*axes))

    def concat(self, *xs, axis: int):
        return self.op("Concat", *xs, axis=axis)

    def gather(self, x, idx, axis: int = 0):
        return self.op("Gather", x, idx, axis=axis)

    def shape_dim(self, x, axis: int) -> str:
        """``Shape(x)[axis]`` as a 1-element int64 tensor."""
        return self.op("Shape", x, start=axis, end=axis + 1)

    def where(self, cond, a, b):
        return self.op("Where", cond, a, b)

    # ------------------------------------------------------------------ finish

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers, value_info=self.value_infos)
        opsets = [helper.make_opsetid("", OPSET)] + [helper.make_opsetid(d, v) for d, v in self.custom_domains.items()]
        m = helper.make_model(graph, opset_imports=opsets, producer_name="trtkv")
        m.ir_version = 10
        return m
