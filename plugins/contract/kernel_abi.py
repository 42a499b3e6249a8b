"""Kernel bindings: contract tensors <-> Triton kernel parameters, launches, signatures, PTX in TensorRT's order.

A tensorrt.plugin AOT kernel is launched with its arguments in the order
    input tensors (op.inputs order), extra int32 scalars (aot_impl's SymIntExprs), output tensors
(tensorrt.plugin.aot_impl docstring; _TemplateAOTPlugin.get_launch_params), nothing after. Triton
kernels take their parameters in their own order and (since triton 3.3) two trailing hidden
pointers (global / profile scratch). ``ptx_to_trt_abi`` reorders the .entry parameter list of the
PTX to the TensorRT order and drops the hidden ones when the kernel body never reads them. Every
float / shape-independent kernel argument is compiled in as a constexpr (TensorRT's extra
arguments are integers only), every shape-dependent integer becomes an extra SymInt32.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from trtkv.errors import TrtkvError
from trtkv.formats import ELEM_TYPES

from .attrs import Attrs
from .shapes import input_dtypes, num_partitions, output_dtypes
from .specs import FIX, OpSpec, get_op
from .symbolic import INT_OPS, SymOps, decode_grids, decode_reduce_grid, prefill_grid, seal_grid


@dataclass(frozen=True)
class Binding:
    """How one op maps onto one Triton kernel."""

    kernel: str  # attribute name in trtkv.plugins.kernels
    config: str  # which launch config of trtkv.plugins.kernels supplies the kernel's own constexprs
    params: dict[str, str]  # kernel parameter -> contract tensor name (inputs and outputs)
    scalars: tuple[str, ...]  # kernel parameters passed as extra int32 arguments, in this order
    consts: Callable[[Attrs], dict[str, Any]]  # kernel parameters compiled in as constexprs
    grid: Callable[[Attrs, dict, dict, SymOps], tuple]  # (attrs, input shapes by name, constexprs, ops)
    scalar_values: Callable[[Attrs, dict, dict, SymOps], tuple]  # values of ``scalars``, same signature


LOG2E = 1.4426950408889634


def _qk_scale(a: Attrs) -> float:
    return float(a["sm_scale"]) * LOG2E


# the attention kernels' sliding window / soft-cap: the ONNX ops carry neither (a windowed or soft-capped model
# runs the torch engine), so the plugins compile them in as 0 = none and the branches vanish
_NO_WINDOW = dict(window=0, softcap=0.0)

_POOL_PARAMS = {f"{w}_{p}_ptr": f"{w}_{p}" for w in "kv" for p in ("data", "scale", "zero", "tail", "new")}
_CONST_PARAMS = dict(k_static_ptr="k_static", k_smooth_ptr="k_smooth", v_static_ptr="v_static",
                     v_smooth_ptr="v_smooth", had_ptr="hadamard")
_SEQ_PARAMS = dict(block_table_ptr="block_tables", context_lens_ptr="context_lens", slot_ids_ptr="slot_ids")
# the tables of codebook, outlier, pre-RoPE and per-channel-width formats: the ONNX ops take none of those formats (attrs refuse
# them), so the plugins compile these parameters in as None and they leave the PTX
_NO_EXTRAS = dict(k_cb_ptr=None, v_cb_ptr=None, k_oidx_ptr=None, k_oval_ptr=None, v_oidx_ptr=None, v_oval_ptr=None,
                  rope_cos_ptr=None, rope_sin_ptr=None, k_chan_ptr=None, v_chan_ptr=None)
_NO_SEAL_EXTRAS = dict(cb_ptr=None, oidx_ptr=None, oval_ptr=None, pos_ptr=None, rope_cos_ptr=None, rope_sin_ptr=None,
                       scratch_ptr=None, chan_ptr=None)

BINDINGS: dict[str, Binding] = {
    "PagedKVSeal": Binding(
        kernel="seal_kernel",
        config="seal",
        params=dict(x_ptr="rows", data_ptr="codes", scale_ptr="scale", zero_ptr="zero",
                    static_scale_ptr="static_scale", smooth_ptr="smooth", clip_ptr="clip", had_ptr="hadamard"),
        scalars=(),
        consts=lambda a: dict(num_kv_heads=a["num_kv_heads"], **_NO_SEAL_EXTRAS),
        grid=lambda a, s, c, ops: seal_grid(s["rows"][0], a["num_kv_heads"], ops),
        scalar_values=lambda a, s, c, ops: (),
    ),
    "PagedDecodePartition": Binding(
        kernel="paged_decode_partition_kernel",
        config="decode.partition",
        params=dict(q_ptr="q", **_POOL_PARAMS, **_CONST_PARAMS, **_SEQ_PARAMS,
                    part_m_ptr="part_m", part_l_ptr="part_l", part_acc_ptr="part_acc"),
        scalars=("max_blocks", "num_partitions"),
        consts=lambda a: dict(qk_scale=_qk_scale(a), num_heads=a["num_q_heads"], num_kv_heads=a["num_kv_heads"],
                              block_size=a["block_size"], sink_tokens=a["sink_tokens"], **_NO_WINDOW, **_NO_EXTRAS),
        grid=lambda a, s, c, ops: decode_grids(s["block_tables"][0], a["num_kv_heads"], s["block_tables"][1],
                                               a["block_size"], a["partition_size"], ops)[0],
        scalar_values=lambda a, s, c, ops: (s["block_tables"][1], num_partitions(s["block_tables"][1], a, ops)),
    ),
    "PagedDecodeReduce": Binding(
        kernel="paged_decode_reduce_kernel",
        config="decode.reduce",
        params=dict(part_m_ptr="part_m", part_l_ptr="part_l", part_acc_ptr="part_acc",
                    context_lens_ptr="context_lens", v_static_ptr="v_static", v_smooth_ptr="v_smooth",
                    had_ptr="hadamard", out_ptr="out"),
        scalars=("num_partitions",),
        consts=lambda a: dict(num_heads=a["num_q_heads"], num_kv_heads=a["num_kv_heads"]),
        grid=lambda a, s, c, ops: decode_reduce_grid(s["part_m"][0], a["num_kv_heads"], ops),
        scalar_values=lambda a, s, c, ops: (s["part_m"][2],),
    ),
    "PagedPrefillAttention": Binding(
        kernel="paged_prefill_kernel",
        config="prefill",
        params=dict(q_ptr="q", cu_seqlens_q_ptr="cu_seqlens", **_POOL_PARAMS, **_CONST_PARAMS, **_SEQ_PARAMS,
                    out_ptr="out"),
        scalars=("max_blocks",),
        consts=lambda a: dict(qk_scale=_qk_scale(a), num_heads=a["num_q_heads"], num_kv_heads=a["num_kv_heads"],
                              block_size=a["block_size"], sink_tokens=a["sink_tokens"], **_NO_WINDOW, **_NO_EXTRAS),
        # any query count bounds one sequence's: programs past a sequence's queries exit at once
        grid=lambda a, s, c, ops: prefill_grid(s["q"][0], a["num_kv_heads"], s["context_lens"][0], c["BLOCK_M"], ops),
        scalar_values=lambda a, s, c, ops: (s["block_tables"][1],),
    ),
}


# Dynamic shared memory a kernel may use without opting in: a launch asking for more fails
# (CUDA_ERROR_INVALID_VALUE) unless the function's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES was raised
# first (Triton's launcher and bench/gpu_check.py do; for TensorRT see docs/plugins.md, "Block and shared memory").
SHARED_MEM_DEFAULT_LIMIT = 48 * 1024


@dataclass(frozen=True)
class Launch:
    """A kernel launch in TensorRT terms, every field an int or a symbolic expression."""

    grid: tuple[Any, Any, Any]
    block: int
    shared_mem: int
    scalars: tuple[Any, ...]


def launch(op: OpSpec | str, attrs: Attrs, shapes: Sequence[Sequence[Any]], constexprs: dict, num_warps: int,
           shared_mem: int, ops: SymOps = INT_OPS) -> Launch:
    """Grid, block, shared memory and extra scalar arguments as expressions of the input shapes."""
    op = get_op(op) if isinstance(op, str) else op
    b = BINDINGS[op.name]
    s = {t.name: tuple(sh) for t, sh in zip(op.inputs, shapes)}
    grid = tuple(b.grid(attrs, s, constexprs, ops))
    return Launch(grid=grid, block=num_warps * 32, shared_mem=int(shared_mem),
                  scalars=tuple(b.scalar_values(attrs, s, constexprs, ops)))


@dataclass(frozen=True)
class KernelSignature:
    """What compiling a binding needs: the Triton signature and the TensorRT parameter order."""

    signature: dict[str, str]  # kernel parameter -> triton type ("*fp16", "i32", "constexpr")
    constexprs: dict[str, Any]
    ptx_order: tuple[str, ...]  # non-constexpr kernel parameters in kernel (= PTX) order
    trt_order: tuple[str, ...]  # the same parameters in TensorRT order (inputs, scalars, outputs)
    pointer_params: tuple[str, ...]


TRITON_PTR = {name: e.triton for name, e in ELEM_TYPES.items()}  # trtkv.formats.ELEM_TYPES


def kernel_signature(op: OpSpec | str, attrs: Attrs, arg_names: Sequence[str], kernel_constexprs: dict[str, Any],
                     input_dtypes_: Sequence[str] | None = None, output_dtypes_: Sequence[str] | None = None,
                     ) -> KernelSignature:
    """Map an op instance onto a kernel whose parameters are ``arg_names`` (the JITFunction's).

    ``kernel_constexprs`` are the kernel's own ``tl.constexpr`` values (from its launch config).
    Raises TrtkvError naming kernel parameters the binding leaves unbound or names that the kernel
    lacks (the binding table and trtkv.plugins.kernels disagree), and, for the attention ops, when the
    kernel constexprs do not select the new-rows path (``NEW_ROWS=True``) the contract needs.
    """
    op = get_op(op) if isinstance(op, str) else op
    b = BINDINGS[op.name]
    consts = {**b.consts(attrs), **kernel_constexprs}
    names = list(arg_names)
    missing = [p for p in list(b.params) + list(b.scalars) + list(b.consts(attrs)) if p not in names]
    if missing:
        raise TrtkvError(f"{op.name}: kernel {b.kernel} has no parameter(s) {', '.join(missing)}",
                         "update contract.BINDINGS to the kernel's signature (docs/plugins.md, 'Argument order')")
    unbound = [p for p in names if p not in b.params and p not in b.scalars and p not in consts]
    if unbound:
        raise TrtkvError(f"{op.name}: kernel {b.kernel} parameter(s) {', '.join(unbound)} are not bound", FIX)
    idt = list(input_dtypes_) if input_dtypes_ is not None else input_dtypes(op, attrs)
    odt = list(output_dtypes_) if output_dtypes_ is not None else output_dtypes(op, attrs)
    dtype_of = {t.name: d for t, d in zip(op.inputs, idt)} | {t.name: d for t, d in zip(op.outputs, odt)}
    sig, ptrs = {}, []
    for p in names:
        if p in consts:
            sig[p] = "constexpr"
        elif p in b.scalars:
            sig[p] = "i32"
        else:
            sig[p] = TRITON_PTR[dtype_of[b.params[p]]]
            ptrs.append(p)
    ptx_order = tuple(p for p in names if sig[p] != "constexpr")
    by_tensor = {v: k for k, v in b.params.items()}
    trt_order = (tuple(by_tensor[t.name] for t in op.inputs) + tuple(b.scalars)
                 + tuple(by_tensor[t.name] for t in op.outputs))
    assert sorted(trt_order) == sorted(ptx_order), (trt_order, ptx_order)
    return KernelSignature(signature=sig, constexprs={k: v for k, v in consts.items() if k in names},
                           ptx_order=ptx_order, trt_order=trt_order, pointer_params=tuple(ptrs))


_ENTRY = re.compile(r"\.entry\s+(?P<name>[A-Za-z_$][\w$]*)\s*\((?P<params>[^)]*)\)", re.S)


def ptx_entry_params(ptx: str, kernel_name: str) -> list[str]:
    """The .param declaration lines of one .entry, in order (stripped, without trailing commas)."""
    for m in _ENTRY.finditer(ptx):
        if m.group("name") == kernel_name:
            return [p.strip().rstrip(",").strip() for p in m.group("params").split("\n") if p.strip()]
    raise TrtkvError(f"PTX has no .entry {kernel_name}", "pass the kernel name from the compiled metadata")


def ptx_reqntid(ptx: str, kernel_name: str) -> int | None:
    """Threads per block the PTX requires (``.reqntid``), if declared."""
    for m in _ENTRY.finditer(ptx):
        if m.group("name") == kernel_name:
            tail = ptx[m.end():m.end() + 200]
            r = re.match(r"\s*\.reqntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", tail)
            if not r:
                return None
            return math.prod(int(x) for x in r.groups() if x)
    raise TrtkvError(f"PTX has no .entry {kernel_name}")


def ptx_to_trt_abi(ptx: str, kernel_name: str, ptx_order: Sequence[str], trt_order: Sequence[str]) -> str:
    """Reorder an .entry's parameters from the kernel's order to TensorRT's and drop hidden ones.

    ``ptx_order`` names the kernel's non-constexpr parameters as they appear in the PTX (Triton names
    them ``<kernel>_param_<i>``); declarations after them are Triton's hidden scratch pointers, dropped
    only if the body never loads them. The body refers to parameters by name, so reordering the
    declarations changes the launch ABI and nothing else.
    """
    decls = ptx_entry_params(ptx, kernel_name)
    n = len(ptx_order)
    if len(decls) < n:
        raise TrtkvError(f"{kernel_name}: PTX declares {len(decls)} parameters, the binding expects {n}", FIX)
    names = []
    for i, d in enumerate(decls):
        m = re.search(r"([A-Za-z_$][\w$]*)\s*$", d)
        assert m, d
        names.append(m.group(1))
        if m.group(1) != f"{kernel_name}_param_{i}":
            raise TrtkvError(f"{kernel_name}: unexpected PTX parameter name {m.group(1)!r}", FIX)
    m = next(m for m in _ENTRY.finditer(ptx) if m.group("name") == kernel_name)
    body = ptx[m.end():]
    for hidden in names[n:]:
        if re.search(rf"\[\s*{re.escape(hidden)}\s*(\+\s*\d+\s*)?\]", body):
            raise TrtkvError(f"{kernel_name}: hidden parameter {hidden} is used by the kernel (global scratch?)",
                             "TensorRT cannot pass it; change the kernel so it needs no scratch memory")
    index = {p: i for i, p in enumerate(ptx_order)}
    if sorted(index) != sorted(trt_order):
        raise TrtkvError(f"{kernel_name}: the TensorRT order does not list the same parameters", FIX)
    new = [decls[index[p]] for p in trt_order]
    block = "\n" + ",\n".join("\t" + d for d in new) + "\n"
    return ptx[:m.start("params")] + block + ptx[m.end("params"):]
