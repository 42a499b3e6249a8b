"""The ONNX op contract of the trtkv TensorRT plugins, and the pure parts of their registration.

Nothing here imports tensorrt or triton: op specs, attribute validation, ONNX node emission, output
shape / dtype inference, launch grids and kernel-argument bindings are plain functions, tested on CPU.
``trtkv.plugins.trt_plugins`` is the thin TensorRT glue that feeds them ``tensorrt.plugin`` objects.
One module per concept; this package re-exports the public names (``from trtkv.plugins import contract as C``):

* ``symbolic``   -- ``Sym`` / ``SymOps`` (ints, test expressions, TensorRT shape expressions) and the launch grids
* ``limits``     -- ``LIMITS``: what the kernels accept (head dim, block size, partition size)
* ``specs``      -- the four ops (``OPS``): their ``OpTensor`` inputs / outputs and ``AttrSpec`` attributes
* ``attrs``      -- ``validate_attrs`` / ``attrs_for``: an op instance's ``Attrs``, tensor formats parsed once
* ``shapes``     -- dtypes, placeholders, output and expected input shapes of an op instance
* ``onnx_nodes`` -- ``make_node``, ``make_decode_nodes``, ``value_infos``
* ``kernel_abi`` -- ``BINDINGS`` (op <-> Triton kernel), ``launch``, ``kernel_signature``, PTX in TensorRT's order

How an ONNX node becomes a plugin (TensorRT's ONNX parser, ``FallbackPluginImporter``): a node whose
``op_type`` is not a built-in ONNX op is looked up in the plugin registry by ``op_type`` (the plugin
name), the string attribute ``plugin_namespace`` and ``plugin_version`` (default "1"). The node's
domain is not consulted by the parser; we still put the nodes in domain ``trtkv`` so the model is
valid ONNX (with an ``opset_import`` for ``trtkv``). The parser passes the node attributes whose names
the plugin creator declares (for a ``tensorrt.plugin`` op: the attribute parameters of the
``@trtp.register`` function, in that order) as plugin fields: INT -> int32, FLOAT -> float32,
STRING -> char. A declared attribute missing from the node is skipped with a warning, after which the
QDP call fails, so ``make_node`` always writes every attribute. ``aot=1`` asks the parser for the
ahead-of-time implementation (no Python at serve time).

Engines are pure functions (docs/plugins.md, docs/kv-cache-format.md "The engine step contract"). No op
writes the paged pool or the open blocks:

* ``PagedKVSeal`` quantizes full open blocks ``[blocks, kv_heads, block_size, head_dim]`` (fp16) and
  *returns* their codes / scales / zero-points in pool-block form; the runtime stores them at the pool
  blocks it allocated (``cache_layout.seal_blocks`` writes the same bytes).
* The attention ops read, for new token ``t`` of sequence ``b`` (position ``context_lens[b] + t``): the
  ``context_lens[b] // block_size`` sealed blocks through the block table (dequantized), the open block's
  ``context_lens[b] % block_size`` rows from ``k_tail / v_tail[slot_ids[b]]`` (fp16) and this step's new
  rows ``0 .. t`` (fp16, causal). The result equals float64 attention over ``gather_paged(..., slot=)``
  followed by the new rows (``reference.paged_attention_ref``). A step never crosses a block boundary.

Decode attention is split-K (flash-decoding): an AOT plugin launches exactly one kernel, so the op is
two nodes, ``PagedDecodePartition`` (partial softmax states per context partition) and
``PagedDecodeReduce`` (log-sum-exp merge, normalization, V's output transforms); ``make_decode_nodes``
emits both.
"""

from .attrs import FORMAT_ATTRS, Attrs, as_tensor_format, attrs_for, validate_attrs
from .kernel_abi import (
                         BINDINGS,
                         LOG2E,
                         SHARED_MEM_DEFAULT_LIMIT,
                         TRITON_PTR,
                         Binding,
                         KernelSignature,
                         Launch,
                         kernel_signature,
                         launch,
                         ptx_entry_params,
                         ptx_reqntid,
                         ptx_to_trt_abi,
)
from .limits import LIMITS, KernelLimits
from .onnx_nodes import ONNX_ELEM, make_decode_nodes, make_node, onnx_attributes, opset_imports, value_infos
from .shapes import check_inputs, codes_dtype, expected_input_shapes, input_dtypes, num_partitions, output_dtypes, output_shapes, placeholder_shape, tensor_dtype
from .specs import DECODE_PARTITION, DECODE_REDUCE, DOMAIN, FIX, OPS, PARSER_ATTRS, PLUGIN_VERSION, PREFILL, RESERVED_ATTR_NAMES, SEAL, AttrSpec, OpSpec, OpTensor, get_op
from .symbolic import INT_OPS, SYM_OPS, Sym, SymOps, decode_grids, decode_partitions, decode_reduce_grid, prefill_grid, seal_grid, sym_shape, value

__all__ = [
    "FORMAT_ATTRS", "Attrs", "as_tensor_format", "attrs_for", "validate_attrs",
    "BINDINGS", "LOG2E", "SHARED_MEM_DEFAULT_LIMIT", "TRITON_PTR", "Binding", "KernelSignature", "Launch",
    "kernel_signature", "launch", "ptx_entry_params", "ptx_reqntid", "ptx_to_trt_abi",
    "LIMITS", "KernelLimits",
    "ONNX_ELEM", "make_decode_nodes", "make_node", "onnx_attributes", "opset_imports", "value_infos",
    "check_inputs", "codes_dtype", "expected_input_shapes", "input_dtypes", "num_partitions", "output_dtypes",
    "output_shapes", "placeholder_shape", "tensor_dtype",
    "DECODE_PARTITION", "DECODE_REDUCE", "DOMAIN", "FIX", "OPS", "PARSER_ATTRS", "PLUGIN_VERSION", "PREFILL",
    "RESERVED_ATTR_NAMES", "SEAL", "AttrSpec", "OpSpec", "OpTensor", "get_op",
    "INT_OPS", "SYM_OPS", "Sym", "SymOps", "decode_grids", "decode_partitions", "decode_reduce_grid",
    "prefill_grid", "seal_grid", "sym_shape", "value",
]
