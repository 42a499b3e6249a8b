"""TensorRT plugin registration for the trtkv ops (``tensorrt.plugin``, ahead-of-time implementations).

NOT EXECUTED in this repository's CI: TensorRT's Python package cannot be installed on these
machines (its PyPI entry is a stub that downloads the real wheels from pypi.nvidia.com, which is not
reachable here). Everything this glue computes comes from ``trtkv.plugins.contract`` (op specs,
attribute checks, shapes, grids, kernel bindings, PTX argument order) and from ``compile_kernel``
below; those parts are tested on CPU (tests/test_plugin_contract.py), and ``bench/gpu_check.py``
launches the compiled PTX exactly as TensorRT would (driver API, TensorRT's argument order) on a GPU.
The ``tensorrt.plugin`` calls were written against the module's source (TensorRT 10.x / 11.x:
``_lib.register`` / ``aot_impl``, ``_plugin_class._TemplateAOTPlugin``, ``_tensor.KernelLaunchParams``).

Usage (NGC TensorRT container or a machine with ``pip install tensorrt``)::

    from trtkv.plugins.trt_plugins import register_plugins
    register_plugins()            # before parsing an ONNX model that holds trtkv nodes
    parser.parse(onnx_bytes)      # nodes op_type=PagedKVSeal, plugin_namespace="trtkv", aot=1 -> plugins

Each op is registered with ``@trtp.register`` (output shapes / dtypes from the contract) and
``@trtp.aot_impl`` (the Triton kernel compiled to PTX for the build GPU, its launch grid and integer
arguments as symbolic expressions of the input shapes). The engine then holds the PTX: serving needs
neither Python nor Triton. There is no ``@trtp.impl`` (JIT) implementation, so TensorRT always picks
the AOT one; no ``@trtp.autotune``: inputs keep the network's types, outputs the contract's, LINEAR.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import typing
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

from trtkv.errors import TrtkvError

from . import contract as C

TENSORRT_MODULES = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}


def import_tensorrt(backend: str):
    """The ``tensorrt`` or ``tensorrt_rtx`` module, or one TrtkvError saying how to get it."""
    mod = TENSORRT_MODULES[backend]
    try:
        return importlib.import_module(mod)
    except ImportError:
        if backend == "tensorrt":
            raise TrtkvError(
                "the tensorrt Python package is not installed (it cannot be installed on this CPU machine)",
                "run in NVIDIA's NGC TensorRT container (nvcr.io/nvidia/tensorrt) or `pip install tensorrt` on a CUDA machine",
            ) from None
        raise TrtkvError("the tensorrt_rtx Python package is not installed", "pip install tensorrt-rtx (or pip install 'trtkv[tensorrt-rtx]')") from None


INSTALL_FIX = (
    "run inside an NVIDIA TensorRT container (nvcr.io/nvidia/tensorrt, or the Triton server image "
    "nvcr.io/nvidia/tritonserver:<ver>-py3) or `pip install tensorrt` (>= 10.9) on a machine that can "
    "reach pypi.nvidia.com; without TensorRT use the native attention mode (no plugins)"
)


# ------------------------------------------------------------------------------------------------
# compiling a binding (triton only; runs on CPU for PTX, used by aot_impl and bench/gpu_check.py)
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AotKernel:
    """A kernel ready for TensorRT: PTX with the entry's parameters in TensorRT's order."""

    op: str
    name: str  # kernel (entry) name
    ptx: str
    num_warps: int
    shared: int  # dynamic shared memory bytes
    constexprs: dict  # the kernel's own tl.constexpr values (grids read block sizes from here)
    signature: C.KernelSignature
    arch: int
    n_regs: int | None = None  # from a cubin compile when ptxas ran
    n_spills: int | None = None

    @property
    def needs_shared_opt_in(self) -> bool:
        """More dynamic shared memory than a launch gets without raising the function's
        MAX_DYNAMIC_SHARED_SIZE_BYTES attribute (docs/plugins.md, "Block and shared memory")."""
        return self.shared > C.SHARED_MEM_DEFAULT_LIMIT


def kernel_config(op: C.OpSpec, attrs: C.Attrs, interpret: bool = False) -> dict:
    """``{"constexprs": ..., "num_warps": ...}`` of the op's kernel, from trtkv.plugins.kernels."""
    from . import kernels as K

    b = C.BINDINGS[op.name]
    if b.config == "seal":
        return K.seal_config(attrs.tensor_format("x"), attrs["head_dim"], attrs["block_size"])
    ratio = attrs["num_q_heads"] // attrs["num_kv_heads"]
    if b.config.startswith("decode."):
        prec = attrs.get("precision", "ieee")
        cfg = K.decode_config(attrs.formats.get("k", attrs.tensor_format("v")), attrs.tensor_format("v"), attrs["head_dim"], ratio,
                              attrs["partition_size"], prec, interpret=interpret)
        return cfg[b.config.split(".")[1]]
    if b.config == "prefill":
        return K.prefill_config(attrs.tensor_format("k"), attrs.tensor_format("v"), attrs["head_dim"], ratio, attrs["precision"],
                                interpret=interpret)
    raise AssertionError(b.config)


def _attrs_key(attrs: C.Attrs) -> tuple:
    return tuple(attrs.items())


def compile_kernel(op: C.OpSpec | str, attrs: dict, arch: int | None = None,
                   input_dtypes: Sequence[str] | None = None, output_dtypes: Sequence[str] | None = None,
                   cubin: bool = False) -> AotKernel:
    """Compile the op's Triton kernel to PTX for ``arch`` (80, 90, ...; None: the current GPU).

    Constexprs: the kernel's launch config plus the binding's attribute-derived values (softmax scale,
    head counts, block size). Pointer parameters are marked 16-byte aligned (TensorRT allocates I/O
    at >= 256 bytes). ``cubin=True`` also runs ptxas to report registers and spills.
    """
    op = C.get_op(op) if isinstance(op, str) else op
    a = C.validate_attrs(op, dict(attrs))
    key = (op.name, _attrs_key(a), arch, tuple(input_dtypes or ()), tuple(output_dtypes or ()), cubin)
    return _compile_cached(key)


@functools.lru_cache(maxsize=64)
def _compile_cached(key) -> AotKernel:
    import triton
    from triton.backends.compiler import GPUTarget

    from . import kernels as K

    op_name, attrs_items, arch, idt, odt, cubin = key
    op = C.get_op(op_name)
    a = C.validate_attrs(op, dict(attrs_items))
    b = C.BINDINGS[op.name]
    cfg = kernel_config(op, a)
    fn = getattr(K.load_kernels(interpret=False), b.kernel)  # the compiled copy, even under TRITON_INTERPRET=1
    sig = C.kernel_signature(op, a, fn.arg_names, cfg["constexprs"], idt or None, odt or None)
    if arch is None:
        target = triton.runtime.driver.active.get_current_target()
    else:
        target = GPUTarget("cuda", int(arch), 32)
    index = {p: i for i, p in enumerate(fn.arg_names)}
    attrs_hint = {(index[p],): [["tt.divisibility", 16]] for p in sig.pointer_params}
    src = triton.compiler.ASTSource(fn=fn, signature=sig.signature, constexprs=sig.constexprs, attrs=attrs_hint)
    options = {"num_warps": cfg["num_warps"]}
    compiled = triton.compile(src, target=target, options=options)
    name = compiled.metadata.name
    ptx = C.ptx_to_trt_abi(compiled.asm["ptx"], name, sig.ptx_order, sig.trt_order)
    n_regs = n_spills = None
    if cubin:
        n_regs, n_spills = getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)
        if n_regs is None:
            try:
                compiled._init_handles()  # needs a GPU; CPU-only machines keep None
                n_regs, n_spills = compiled.n_regs, compiled.n_spills
            except Exception:
                pass
    threads = C.ptx_reqntid(ptx, name)
    if threads is not None and threads != cfg["num_warps"] * 32:
        raise TrtkvError(f"{name}: PTX requires {threads} threads per block, the launch gives "
                         f"{cfg['num_warps'] * 32}", C.FIX)
    return AotKernel(op=op.name, name=name, ptx=ptx, num_warps=compiled.metadata.num_warps,
                     shared=compiled.metadata.shared, constexprs=dict(cfg["constexprs"]), signature=sig,
                     arch=target.arch, n_regs=n_regs, n_spills=n_spills)


# ------------------------------------------------------------------------------------------------
# tensorrt.plugin registration (never executed here)
# ------------------------------------------------------------------------------------------------


def _import_trt():
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as exc:
        raise TrtkvError(f"TensorRT's Python plugin API (tensorrt.plugin) is not importable: {exc}",
                         INSTALL_FIX) from None
    if not hasattr(trtp, "aot_impl") or not hasattr(trtp, "KernelLaunchParams"):
        raise TrtkvError("this TensorRT has no ahead-of-time Python plugins (tensorrt.plugin.aot_impl)",
                         "use TensorRT >= 10.9")
    return trt, trtp


def trt_ops(trtp) -> C.SymOps:
    """cdiv / max / min for tensorrt.plugin shape expressions (two ints stay Python ints:
    ``trtp.cdiv`` refuses them)."""

    def wrap(py, sym):
        def f(x, y):
            if isinstance(x, int) and isinstance(y, int):
                return py(x, y)
            return sym(x, y)

        return f

    return C.SymOps(cdiv=wrap(C.INT_OPS.cdiv, trtp.cdiv), max=wrap(max, trtp.max), min=wrap(min, trtp.min))


def trt_dtypes(trt) -> dict[str, Any]:
    """Contract dtype name -> ``trt.DataType``, from ``trtkv.formats.ELEM_TYPES``."""
    from trtkv.formats import ELEM_TYPES

    return {name: getattr(trt, e.trt) for name, e in ELEM_TYPES.items() if hasattr(trt, e.trt)}


def _signature(params: list[tuple[str, Any]], ret) -> inspect.Signature:
    P = inspect.Parameter
    return inspect.Signature([P(n, P.POSITIONAL_OR_KEYWORD, annotation=t) for n, t in params], return_annotation=ret)


def _make_register(op: C.OpSpec, trt, trtp):
    """The ``@trtp.register`` function: ``(tensors..., attrs...) -> Tuple[TensorDesc, ...]``.

    tensorrt.plugin reads input names, attribute names and types from the signature, so it is built
    from the contract (``__signature__``)."""
    to_trt = trt_dtypes(trt)
    from_trt = {v: k for k, v in to_trt.items()}
    ops = trt_ops(trtp)
    sig = _signature([(t.name, trtp.TensorDesc) for t in op.inputs] + [(a.name, a.type) for a in op.attrs],
                     typing.Tuple[tuple([trtp.TensorDesc] * len(op.outputs))])

    def register_fn(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        descs = [bound.arguments[t.name] for t in op.inputs]
        attrs = C.validate_attrs(op, {a.name: bound.arguments[a.name] for a in op.attrs})
        dts = [from_trt.get(d.dtype, str(d.dtype)) for d in descs]
        C.check_inputs(op, attrs, [d.ndim for d in descs], dts)
        shapes = [tuple(d.shape_expr) for d in descs]
        outs = C.output_shapes(op, attrs, shapes, ops)
        return tuple(trtp.from_shape_expr(tuple(s), dtype=to_trt[dt])
                     for s, dt in zip(outs, C.output_dtypes(op, attrs)))

    register_fn.__signature__ = sig
    register_fn.__name__ = register_fn.__qualname__ = f"{op.name}_register"
    return register_fn


def _make_aot_impl(op: C.OpSpec, trt, trtp):
    """The ``@trtp.aot_impl`` function: ``(tensors..., attrs..., outputs, tactic) ->
    (kernel name, PTX, KernelLaunchParams, SymIntExprs)``.

    TensorRT calls it positionally with *all* attributes in plugin-field order (the register order
    when the ONNX parser created the plugin), so it declares all of them."""
    from_trt = {v: k for k, v in trt_dtypes(trt).items()}
    ops = trt_ops(trtp)
    ret = typing.Tuple[typing.Union[str, bytes], typing.Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]
    sig = _signature([(t.name, trtp.TensorDesc) for t in op.inputs] + [(a.name, a.type) for a in op.attrs]
                     + [("outputs", typing.Tuple[tuple([trtp.TensorDesc] * len(op.outputs))]), ("tactic", int)], ret)
    n_in, n_at = len(op.inputs), len(op.attrs)

    def aot_fn(*args):
        descs, vals = args[:n_in], args[n_in:n_in + n_at]
        outputs = args[n_in + n_at]
        attrs = C.validate_attrs(op, dict(zip((a.name for a in op.attrs), vals)))
        k = compile_kernel(op, attrs, arch=None,
                           input_dtypes=[from_trt[d.dtype] for d in descs],
                           output_dtypes=[from_trt[d.dtype] for d in outputs])
        if k.needs_shared_opt_in:
            warnings.warn(f"{op.name}: kernel {k.name} uses {k.shared} B of dynamic shared memory (> 48 KiB). "
                          "If the engine's launch fails with an invalid-argument error, TensorRT did not raise "
                          "the function's limit; precision='tf32x3' keeps the quantized formats under 48 KiB "
                          "(docs/plugins.md, 'Block and shared memory')", stacklevel=2)
        shapes = [tuple(d.shape_expr) for d in descs]
        L = C.launch(op, attrs, shapes, k.constexprs, k.num_warps, k.shared, ops)
        params = trtp.KernelLaunchParams()
        params.grid_x, params.grid_y, params.grid_z = L.grid
        params.block_x = L.block
        # dynamic shared memory in bytes (IKernelLaunchParams::setSharedMem); tensorrt.plugin passes it on
        # as is. Whether TensorRT raises the function's MAX_DYNAMIC_SHARED_SIZE_BYTES for > 48 KiB is not
        # documented (docs/plugins.md, "Block and shared memory"); k.needs_shared_opt_in flags such kernels.
        params.shared_mem = L.shared_mem
        extra = trtp.SymIntExprs(len(L.scalars))
        for i, s in enumerate(L.scalars):
            extra[i] = trtp.SymInt32(s)  # get_launch_params rejects anything but SymInt32
        return k.name, k.ptx, params, extra

    aot_fn.__signature__ = sig
    aot_fn.__name__ = aot_fn.__qualname__ = f"{op.name}_aot_impl"
    return aot_fn


def register_plugins(names: Sequence[str] | None = None) -> list[str]:
    """Register the trtkv ops with TensorRT's plugin registry (idempotent); returns their plugin ids.

    Raises TrtkvError when tensorrt.plugin is not importable (the message names the fix).
    """
    trt, trtp = _import_trt()
    done = []
    for name in names or list(C.OPS):
        op = C.get_op(name)
        ns = getattr(trtp.op, C.DOMAIN, None) if hasattr(trtp.op, C.DOMAIN) else None
        if ns is None or not hasattr(ns, op.name):
            trtp.register(op.plugin_id)(_make_register(op, trt, trtp))
            trtp.aot_impl(op.plugin_id)(_make_aot_impl(op, trt, trtp))
        done.append(op.plugin_id)
    return done


def add_plugin(network, op: C.OpSpec | str, inputs: Sequence[Any], attrs: dict):
    """Add one trtkv op to a ``trt.INetworkDefinition`` (network-API builds; ONNX builds use ``make_node``).

    Attributes are passed in the contract's order (the AOT implementation receives them positionally).
    """
    trt, trtp = _import_trt()
    op = C.get_op(op) if isinstance(op, str) else op
    register_plugins([op.name])
    a = C.validate_attrs(op, attrs)
    plugin = getattr(getattr(trtp.op, C.DOMAIN), op.name)
    return network.add_plugin(plugin(*inputs, **dict(a)), aot=True)


__all__ = ["AotKernel", "compile_kernel", "kernel_config", "register_plugins", "add_plugin", "trt_ops",
           "trt_dtypes", "INSTALL_FIX"]
