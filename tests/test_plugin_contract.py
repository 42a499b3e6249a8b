"""The TensorRT plugin contract (plugins/contract/), the registration glue without TensorRT
(plugins/trt_plugins.py, driven through a stand-in ``tensorrt.plugin``), and bench/gpu_check.py --dry-run."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import types
import typing
import warnings
from pathlib import Path

import pytest
import torch

from trtkv.cache_layout import PagedKVLayout
from trtkv.errors import TrtkvError
from trtkv.formats import ELEM_TYPES, PRESETS, get_format
from trtkv.plugins import contract as C
from trtkv.plugins.contract.capabilities import kernels_take, op_refusal
from trtkv.quant import TensorParams, hadamard_matrix, quantize_block

ROOT = Path(__file__).resolve().parents[1]
# every preset the ops take (int3 / int2 included; the calibrated-storage presets only the Triton kernels read); mse seals: rejected below
PRESET_NAMES = [n for n, f in PRESETS.items() if kernels_take(f) and not (op_refusal(f.k) or op_refusal(f.v))]
GEOM = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)


def attrs(op, fmt="int4", **kw):
    """Attributes for a format; block size: the format's own, else 16 (the cache's)."""
    kw.setdefault("block_size", get_format(fmt).block_size or 16)
    return C.attrs_for(op, fmt, **{**GEOM, **kw})


# ------------------------------------------------------------------------------------------------
# op specs
# ------------------------------------------------------------------------------------------------


def test_op_names_and_fields():
    import onnx.defs

    assert set(C.OPS) == {"PagedKVSeal", "PagedDecodePartition", "PagedDecodeReduce", "PagedPrefillAttention"}
    for op in C.OPS.values():
        assert op.plugin_id == f"trtkv::{op.name}"
        assert not onnx.defs.has(op.name), f"{op.name} would be imported as a built-in ONNX op"
        names = [t.name for t in op.inputs + op.outputs]
        assert len(set(t.name for t in op.inputs)) == len(op.inputs)
        assert len(set(t.name for t in op.outputs)) == len(op.outputs)
        attr_names = [a.name for a in op.attrs]
        assert len(set(attr_names)) == len(attr_names)
        assert not set(attr_names) & set(C.RESERVED_ATTR_NAMES)
        assert not set(attr_names) & set(names)
        assert all(a.type in (int, float, str) for a in op.attrs)
        assert all("." not in n and n.isidentifier() for n in names + attr_names)


def test_reduce_takes_the_partition_outputs():
    part = [(t.name, t.rank, t.dtype) for t in C.DECODE_PARTITION.outputs]
    red = [(t.name, t.rank, t.dtype) for t in C.DECODE_REDUCE.inputs[:3]]
    assert part == red
    assert {a.name for a in C.DECODE_REDUCE.attrs} <= {a.name for a in C.DECODE_PARTITION.attrs}


# ------------------------------------------------------------------------------------------------
# attributes
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", PRESET_NAMES)
@pytest.mark.parametrize("op", list(C.OPS))
def test_presets_validate(op, fmt):
    a = attrs(op, fmt, head_dim=64)
    assert list(a) == [x.name for x in C.get_op(op).attrs]  # declared order, all present
    assert C.validate_attrs(op, dict(a)) == a


@pytest.mark.parametrize("change, words", [
    (dict(head_dim=96), ["head_dim", "96", "power of two"]),
    (dict(head_dim=8), ["head_dim"]),
    (dict(head_dim=16), ["head_dim", "between 32 and 256"]),  # contract.LIMITS: the halves feed tl.dot (K >= 16)
    (dict(block_size=24), ["block_size", "24"]),
    (dict(block_size=8), ["block_size"]),
    (dict(block_size=256), ["block_size", "between 16 and 128"]),
    (dict(num_q_heads=12), ["num_q_heads", "12", "multiple"]),
    (dict(num_kv_heads=0), ["num_kv_heads"]),
    (dict(partition_size=48), ["partition_size", "48"]),
    (dict(sm_scale=-1.0), ["sm_scale"]),
    (dict(sm_scale=float("nan")), ["sm_scale"]),
    (dict(precision="fp8"), ["precision", "fp8"]),
    (dict(k_format="int3:bchannel:asym:mse"), ["k_format", "mse"]),
    (dict(k_format="int4:g48"), ["k_format", "group size 48"]),
    (dict(v_format="int4:g256"), ["v_format", "does not fit head_dim"]),
    (dict(head_dim="128"), ["head_dim", "not a int"]),
    (dict(block_size=16.5), ["block_size", "not a int"]),
    (dict(bogus=1), ["unknown attribute", "bogus"]),
])
def test_bad_attributes_name_the_problem(change, words):
    a = {**attrs("PagedDecodePartition", "int4"), **change}
    with pytest.raises(TrtkvError) as e:
        C.validate_attrs("PagedDecodePartition", a)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_missing_attribute_and_defaults():
    a = dict(attrs("PagedDecodePartition", "int8"))
    del a["k_format"]
    with pytest.raises(TrtkvError, match="missing attribute 'k_format'"):
        C.validate_attrs("PagedDecodePartition", a)
    b = dict(attrs("PagedDecodePartition", "int8"))
    del b["precision"], b["partition_size"]
    v = C.validate_attrs("PagedDecodePartition", b)
    assert v["precision"] == "tf32x3" and v["partition_size"] == 512


def test_attribute_values_coming_from_plugin_fields():
    """TensorRT hands attributes over as numpy scalars / bytes (INT -> int32, FLOAT -> float32, STRING -> char)."""
    np = pytest.importorskip("numpy")
    a = attrs("PagedKVSeal", "int8")
    raw = {"tensor_format": a["tensor_format"].encode(), "num_kv_heads": np.int32(8), "head_dim": np.array([128]),
           "block_size": np.int32(64)}
    v = C.validate_attrs("PagedKVSeal", raw)
    assert v == a and type(v["num_kv_heads"]) is int and type(v["tensor_format"]) is str


def test_block_size_comes_from_the_format():
    assert C.attrs_for("PagedKVSeal", "int4", **GEOM)["block_size"] == 64
    with pytest.raises(TrtkvError, match="seals blocks of 64"):
        C.attrs_for("PagedKVSeal", "int4", **GEOM, block_size=16)
    with pytest.raises(TrtkvError, match="no block size"):
        C.attrs_for("PagedKVSeal", "int8-static", **GEOM)
    assert C.attrs_for("PagedKVSeal", "int8-static", **GEOM, block_size=32)["block_size"] == 32


# ------------------------------------------------------------------------------------------------
# dtypes and shapes
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", PRESET_NAMES)
def test_seal_outputs_match_the_reference_quantizer(fmt):
    """Output shapes / dtypes of PagedKVSeal equal what trtkv.quant.quantize_block produces for real blocks."""
    f = get_format(fmt)
    for which in ("k", "v"):
        tf = f.k if which == "k" else f.v
        a = attrs("PagedKVSeal", fmt, which=which)
        n, H, bs, D = 3, GEOM["num_kv_heads"], a["block_size"], GEOM["head_dim"]
        p = TensorParams(scale=torch.tensor(0.05) if tf.is_static else None,
                         smooth=torch.ones(H, D) if tf.smooth else None)
        qt = quantize_block(torch.randn(n, H, bs, D), tf, p, head_axis=-3)
        shapes = C.output_shapes("PagedKVSeal", a, C.expected_input_shapes("PagedKVSeal", a, blocks=n))
        dts = C.output_dtypes("PagedKVSeal", a)
        assert shapes[0] == tuple(qt.codes.shape) and dts[0] == str(qt.codes.dtype).removeprefix("torch.")
        for out, ref in ((1, qt.scale), (2, qt.zero)):
            if ref is None:
                assert shapes[out] == C.placeholder_shape(C.SEAL.outputs[out], a)
            else:
                assert shapes[out] == tuple(ref.shape) and dts[out] == "float16"
        layout = PagedKVLayout(f.with_block_size(bs), H, D, bs, 4)
        assert dts[0] == str(layout.data_dtype(which)).removeprefix("torch.")


@pytest.mark.parametrize("fmt", PRESET_NAMES)
def test_pool_inputs_match_the_layout(fmt):
    f = get_format(fmt)
    a = attrs("PagedPrefillAttention", fmt, head_dim=64)
    bs = a["block_size"]
    layout = PagedKVLayout(f.with_block_size(bs), GEOM["num_kv_heads"], 64, bs, 7, num_slots=4)
    shapes = dict(zip((t.name for t in C.PREFILL.inputs), C.expected_input_shapes(C.PREFILL, a, num_blocks=7)))
    dts = dict(zip((t.name for t in C.PREFILL.inputs), C.input_dtypes(C.PREFILL, a)))
    for which in ("k", "v"):
        assert shapes[f"{which}_data"] == layout.data_shape(which)
        assert dts[f"{which}_data"] == str(layout.data_dtype(which)).removeprefix("torch.")
        for part, want in (("scale", layout.scale_shape(which)), ("zero", layout.zero_shape(which))):
            spec = C.PREFILL.input(f"{which}_{part}")
            assert shapes[f"{which}_{part}"] == (want if want is not None else C.placeholder_shape(spec, a))
        assert shapes[f"{which}_tail"] == layout.tail_shape() and dts[f"{which}_tail"] == "float16"
        assert shapes[f"{which}_new"] == (5, GEOM["num_kv_heads"], 64) and dts[f"{which}_new"] == "float16"
    assert dts["slot_ids"] == dts["context_lens"] == dts["block_tables"] == "int32"


@pytest.mark.parametrize("op", list(C.OPS))
def test_symbolic_shapes_agree_with_ints(op):
    a = attrs(op, "int4", partition_size=64)
    for dims in (dict(batch=1, tokens=1, max_blocks=1), dict(batch=3, tokens=17, max_blocks=9)):
        shapes = C.expected_input_shapes(op, a, **dims)
        ints = C.output_shapes(op, a, shapes)
        syms = C.output_shapes(op, a, [C.sym_shape(f"in{i}", s) for i, s in enumerate(shapes)], C.SYM_OPS)
        assert [tuple(C.value(d) for d in s) for s in syms] == ints


def test_sym_behaves_like_a_trt_shape_expr():
    x = C.sym_shape("t", (10,))[0]
    assert C.value(x * 4 // 3 + 1 - 2) == 12
    with pytest.raises(TypeError):
        _ = 4 * x  # ShapeExpr has no reflected operators
    with pytest.raises(TypeError):
        bool(x)
    with pytest.raises(TypeError):
        range(x)
    assert C.value(C.SYM_OPS.cdiv(x, 4)) == 3 and "cdiv(t[0], 4)" in C.SYM_OPS.cdiv(x, 4).text


def test_check_inputs():
    a = attrs("PagedDecodeReduce", "int8")
    ranks = [t.rank for t in C.DECODE_REDUCE.inputs]
    dts = C.input_dtypes(C.DECODE_REDUCE, a)
    C.check_inputs(C.DECODE_REDUCE, a, ranks, dts)
    with pytest.raises(TrtkvError, match="takes 7 inputs"):
        C.check_inputs(C.DECODE_REDUCE, a, ranks[:-1], dts[:-1])
    with pytest.raises(TrtkvError, match="part_acc has rank 3"):
        C.check_inputs(C.DECODE_REDUCE, a, [3, 3, 3, 1, 2, 2, 2], dts)
    with pytest.raises(TrtkvError, match="context_lens is float32"):
        C.check_inputs(C.DECODE_REDUCE, a, ranks, dts[:3] + ["float32"] + dts[4:])


# ------------------------------------------------------------------------------------------------
# ONNX nodes
# ------------------------------------------------------------------------------------------------


def test_make_node_routes_to_the_plugin():
    a = attrs("PagedKVSeal", "int8")
    op = C.SEAL
    n = C.make_node(op, [t.name for t in op.inputs], [t.name for t in op.outputs], a, name="seal0")
    got = {x.name: x for x in n.attribute}
    assert n.op_type == "PagedKVSeal" and n.domain == "trtkv"
    assert got["plugin_namespace"].s == b"trtkv" and got["plugin_version"].s == b"1" and got["aot"].i == 1
    assert got["tensor_format"].s == a["tensor_format"].encode() and got["head_dim"].i == 128
    assert set(got) == {x.name for x in op.attrs} | {"plugin_namespace", "plugin_version", "aot"}
    with pytest.raises(TrtkvError, match="placeholder"):
        C.make_node(op, ["rows", "static_scale"], ["c", "s", "z"], a)
    with pytest.raises(TrtkvError, match="head_dim"):
        C.make_node(op, [t.name for t in op.inputs], ["c", "s", "z"], {**a, "head_dim": 100})


def test_decode_model_is_valid_onnx():
    """A graph holding the decode pair passes the ONNX checker, with value_info for custom outputs."""
    import onnx
    import onnx.helper as h

    a = attrs("PagedDecodePartition", "int4", head_dim=64, partition_size=128)
    op = C.DECODE_PARTITION
    shapes = C.expected_input_shapes(op, a, batch=2, max_blocks=9)
    dts = C.input_dtypes(op, a)
    ins = [h.make_tensor_value_info(t.name, C.ONNX_ELEM[d], list(s)) for t, s, d in zip(op.inputs, shapes, dts)]
    extra = []
    nodes, parts = C.make_decode_nodes([t.name for t in op.inputs], "attn_out", a, prefix="layer0")
    assert [n.op_type for n in nodes] == ["PagedDecodePartition", "PagedDecodeReduce"]
    assert list(nodes[1].input) == [*parts, "context_lens", "v_static", "v_smooth", "hadamard"]
    vi = C.value_infos(op, a, parts, shapes)
    assert [d.dim_value for d in vi[2].type.tensor_type.shape.dim] == [2, 32, 5, 64]  # cdiv((9 + 1) * 64, 128)
    out = h.make_tensor_value_info("attn_out", 10, [2, 32, 64])
    graph = h.make_graph(nodes, "decode", ins + extra, [out], value_info=vi)
    model = h.make_model(graph, opset_imports=C.opset_imports())
    onnx.checker.check_model(model)
    sym = [C.sym_shape(t.name, s) for t, s in zip(op.inputs, shapes)]
    vs = C.value_infos(op, a, parts, sym, symbolic={"block_tables[0]": "batch"})
    assert vs[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert "block_tables[1]" in vs[0].type.tensor_type.shape.dim[2].dim_param


# ------------------------------------------------------------------------------------------------
# launch grids and kernel bindings
# ------------------------------------------------------------------------------------------------


def test_grids_are_the_contract_grid_functions():
    """The bindings' grids are the shared grid functions (the ones ops.py launches with), on ints and Sym."""
    pytest.importorskip("trtkv.plugins.kernels")
    from trtkv.plugins import trt_plugins as T

    a = attrs("PagedKVSeal", "int4")
    cfg = T.kernel_config(C.SEAL, a)
    for blocks in (1, 17, 1000):
        shapes = C.expected_input_shapes(C.SEAL, a, blocks=blocks)
        L = C.launch(C.SEAL, a, shapes, cfg["constexprs"], cfg["num_warps"], 0)
        assert L.grid == (blocks, 8, 1) == C.seal_grid(blocks, 8) and L.scalars == ()
        sym = [C.sym_shape(f"i{i}", s) for i, s in enumerate(shapes)]
        Ls = C.launch(C.SEAL, a, sym, cfg["constexprs"], cfg["num_warps"], 0, C.SYM_OPS)
        assert tuple(C.value(g) for g in Ls.grid) == L.grid
    a = attrs("PagedDecodePartition", "int8", partition_size=256)
    for batch, mb in ((1, 1), (8, 2048 // 64), (3, 77)):
        shapes = C.expected_input_shapes(C.DECODE_PARTITION, a, batch=batch, max_blocks=mb)
        L = C.launch(C.DECODE_PARTITION, a, shapes, {}, 4, 0)
        gp, gr = C.decode_grids(batch, 8, mb, 64, 256)
        # every context the table allows (< (mb + 1) * 64 keys with the open block and the new row) is covered
        assert L.grid == gp and gp[2] * 256 >= (mb + 1) * 64 > (gp[2] - 1) * 256 and L.scalars == (mb, gp[2])
        r = attrs("PagedDecodeReduce", "int8", partition_size=256)
        rs = C.expected_input_shapes(C.DECODE_REDUCE, r, batch=batch, partitions=gp[2])
        Lr = C.launch(C.DECODE_REDUCE, r, rs, {}, 4, 0)
        assert Lr.grid == gr == (batch, 8, 1) and Lr.scalars == (gp[2],)
    a = attrs("PagedPrefillAttention", "int8")
    cfg = T.kernel_config(C.PREFILL, a)
    shapes = C.expected_input_shapes(C.PREFILL, a, batch=3, tokens=100)
    L = C.launch(C.PREFILL, a, shapes, cfg["constexprs"], cfg["num_warps"], 0)
    bm = cfg["constexprs"]["BLOCK_M"]
    assert L.grid == C.prefill_grid(100, 8, 3, bm) == (-(-100 // bm), 8, 3) and L.block == 32 * cfg["num_warps"]


@pytest.mark.parametrize("op", list(C.OPS))
def test_bindings_cover_the_kernel_parameters(op):
    K = pytest.importorskip("trtkv.plugins.kernels")
    from trtkv.plugins import trt_plugins as T

    b = C.BINDINGS[op]
    fn = getattr(K, b.kernel)
    a = attrs(op, "int4")
    cfg = T.kernel_config(C.get_op(op), a)
    sig = C.kernel_signature(op, a, fn.arg_names, cfg["constexprs"])
    assert set(sig.signature) == set(fn.arg_names)
    assert sorted(sig.trt_order) == sorted(sig.ptx_order)
    opspec = C.get_op(op)
    n_in, n_out = len(opspec.inputs), len(opspec.outputs)
    assert [b.params[p] for p in sig.trt_order[:n_in]] == [t.name for t in opspec.inputs]
    assert list(sig.trt_order[n_in:len(sig.trt_order) - n_out]) == list(b.scalars)
    assert [b.params[p] for p in sig.trt_order[-n_out:]] == [t.name for t in opspec.outputs]
    assert all(sig.signature[p] == "i32" for p in b.scalars)
    assert all(v == "constexpr" for k, v in sig.signature.items() if k in cfg["constexprs"])
    for t in opspec.inputs:  # pointer types are the contract dtypes' Triton names (ELEM_TYPES)
        p = next(k for k, v in b.params.items() if v == t.name)
        assert sig.signature[p] == C.TRITON_PTR[C.tensor_dtype(opspec, t, a)]


def test_kernel_signature_names_a_kernel_binding_mismatch():
    K = pytest.importorskip("trtkv.plugins.kernels")
    from trtkv.plugins import trt_plugins as T

    a = attrs("PagedPrefillAttention", "int4")
    cfg = T.kernel_config(C.PREFILL, a)
    names = [n for n in K.paged_prefill_kernel.arg_names if n != "v_tail_ptr"]
    with pytest.raises(TrtkvError, match="has no parameter.*v_tail_ptr"):
        C.kernel_signature(C.PREFILL, a, names, cfg["constexprs"])
    with pytest.raises(TrtkvError, match="extra_ptr are not bound"):
        C.kernel_signature(C.PREFILL, a, [*K.paged_prefill_kernel.arg_names, "extra_ptr"], cfg["constexprs"])


# ------------------------------------------------------------------------------------------------
# the pure-engine attention contract, launched in TensorRT's argument order (Triton interpreter)
# ------------------------------------------------------------------------------------------------

_TORCH = {n: e.torch for n, e in ELEM_TYPES.items()}


def _trt_order_launch(op: str, a, tensors: dict) -> list:
    """Launch the op's kernel as a TensorRT AOT plugin would -- contract inputs (placeholders for unused
    ones), the binding's int32 scalars, outputs, in that order, with the contract's grid and the
    compiled (GPU) constexprs -- but on the Triton interpreter: arguments are matched to kernel
    parameters through ``KernelSignature.trt_order``, the order ``ptx_to_trt_abi`` gives the PTX."""
    from trtkv.plugins import kernels as K
    from trtkv.plugins import trt_plugins as T

    spec = C.get_op(op)
    cfg = T.kernel_config(spec, a)  # the config compile_kernel uses, not the interpreter's
    fn = getattr(K.load_kernels(True), C.BINDINGS[op].kernel)
    sig = C.kernel_signature(spec, a, fn.arg_names, cfg["constexprs"])
    ins = []
    for t, dt in zip(spec.inputs, C.input_dtypes(spec, a)):
        x = tensors[t.name] if t.used(a) else torch.zeros(C.placeholder_shape(t, a), dtype=_TORCH[dt])
        assert x.dtype == _TORCH[dt] and x.dim() == t.rank_of(a), (t.name, x.dtype, x.shape)
        ins.append(x.contiguous())
    shapes = [tuple(x.shape) for x in ins]
    outs = [torch.full(s, 7.0).to(_TORCH[dt]) for s, dt in zip(C.output_shapes(spec, a, shapes),
                                                                C.output_dtypes(spec, a))]
    L = C.launch(spec, a, shapes, cfg["constexprs"], cfg["num_warps"], 0)
    args = [*ins, *L.scalars, *outs]
    assert len(args) == len(sig.trt_order)
    fn[L.grid](**dict(zip(sig.trt_order, args)), **sig.constexprs, num_warps=cfg["num_warps"])
    return outs


def _contract_case(fmt_name: str, new: list[int] | None, *, hq=4, hkv=2, d=64, ctxs=(37, 5, 16, 47), seed=3):
    """Contract tensors of one attention op on the shared paged case (``trtkv.plugins.cases``: garbage
    wherever attention must not read) and its float64 reference output. ``new`` None: decode."""
    from trtkv.plugins.cases import PagedCase

    case = PagedCase(fmt_name, ctxs, new, heads_q=hq, kv_heads=hkv, head_dim=d, seed=seed)
    prefill = new is not None
    return case.contract_tensors(prefill), case.reference(case.q_pre.float() if prefill else case.q_dec.float(),
                                                          prefill)


CONTRACT_FORMATS = ["int4", "k=int8:tensor:sym,v=int4:g32:asym:smooth:hadamard",
                    "k=int8:bchannel:sym:smooth:hadamard,v=fp8:tensor:sym,block=16"]


def _err(out, ref):
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("fmt", CONTRACT_FORMATS)
def test_decode_pair_in_tensorrt_order_matches_reference_and_run_op(fmt):
    pytest.importorskip("triton")
    from trtkv.plugins import reference as R

    t, ref = _contract_case(fmt, None)
    bs = get_format(fmt).block_size or 16
    a = C.attrs_for("PagedDecodePartition", fmt, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=bs,
                    partition_size=16)
    part = _trt_order_launch("PagedDecodePartition", a, t)
    r = C.validate_attrs("PagedDecodeReduce", {k: a[k] for k in (x.name for x in C.DECODE_REDUCE.attrs)})
    (out,) = _trt_order_launch("PagedDecodeReduce", r, {**t, "part_m": part[0], "part_l": part[1], "part_acc": part[2]})
    assert part[0].shape[2] == -(-(t["block_tables"].shape[1] + 1) * bs // 16) > 2  # several partitions
    assert _err(out, ref) < 2e-3  # fp16 output
    # the contract references (what an ONNX Runtime stand-in runs) give the same result
    rp = R.run_op("PagedDecodePartition", a, t)
    (rout,) = R.run_op("PagedDecodeReduce", r, {**t, "part_m": rp[0], "part_l": rp[1], "part_acc": rp[2]})
    assert _err(rout, ref) < 2e-3 and _err(out, rout) < 2e-3


@pytest.mark.slow
@pytest.mark.parametrize("fmt", CONTRACT_FORMATS)
def test_prefill_in_tensorrt_order_matches_reference(fmt):
    pytest.importorskip("triton")
    from trtkv.plugins import reference as R

    bs = get_format(fmt).block_size or 16
    t, ref = _contract_case(fmt, [bs - 37 % bs, 3, bs, 1], ctxs=(37, 5, 16 * (bs // 16), 47))
    a = C.attrs_for("PagedPrefillAttention", fmt, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=bs)
    (out,) = _trt_order_launch("PagedPrefillAttention", a, t)
    assert _err(out, ref) < 2e-3
    (rout,) = R.run_op("PagedPrefillAttention", a, t)
    assert _err(rout, ref) < 2e-3


@pytest.mark.slow
@pytest.mark.parametrize("fmt,which", [("int4", "k"), ("int4", "v"), ("int8-static", "k"),
                                       ("k=int8:bchannel:sym:smooth,v=fp8:tensor:sym,block=16", "k")])
def test_seal_in_tensorrt_order_matches_seal_blocks(fmt, which):
    pytest.importorskip("triton")
    from trtkv.plugins import reference as R

    f = get_format(fmt)
    bs = f.block_size or 16
    a = C.attrs_for("PagedKVSeal", fmt, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=bs, which=which)
    tf = a.tensor_format("x")
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(-40, 41, (3, 2, bs, 64), generator=g).half()  # integers: exact even with a Hadamard
    t = dict(rows=rows, static_scale=torch.full((2, 64), 0.3), smooth=torch.rand(2, 64, generator=g) + 0.5,
             clip=torch.tensor([1.0, 0.9]), hadamard=hadamard_matrix(64))
    outs = _trt_order_launch("PagedKVSeal", a, t)
    want = R.seal_ref(rows, tf, t["static_scale"] if tf.is_static else None, t["smooth"] if tf.smooth else None,
                      t["clip"] if tf.is_dynamic else None)
    for o, w, spec in zip(outs, want, C.SEAL.outputs):
        if spec.used(a):
            assert torch.equal(o, w), spec.name
    assert all(torch.equal(x, y) for x, y, sp in zip(R.run_op("PagedKVSeal", a, t), want, C.SEAL.outputs) if sp.used(a))


# ------------------------------------------------------------------------------------------------
# PTX argument order
# ------------------------------------------------------------------------------------------------

FAKE_PTX = """//
.version 8.7
.target sm_90a
.address_size 64

.visible .entry kern(
\t.param .u64 .ptr .global .align 1 kern_param_0,
\t.param .u64 .ptr .global .align 1 kern_param_1,
\t.param .u32 kern_param_2,
\t.param .u64 .ptr .global .align 1 kern_param_3,
\t.param .u64 .ptr .global .align 1 kern_param_4
)
.reqntid 128
{
\tld.param.b64 \t%rd1, [kern_param_0];
\tld.param.b64 \t%rd2, [kern_param_1];
\tld.param.b32 \t%r1, [kern_param_2];
\tret;
}
"""


def test_ptx_reorder_and_hidden_params():
    # kernel order (x, out, n) + 2 hidden; TensorRT wants (x, n, out)
    ptx = C.ptx_to_trt_abi(FAKE_PTX, "kern", ["x", "out", "n"], ["x", "n", "out"])
    assert [p.split()[-1] for p in C.ptx_entry_params(ptx, "kern")] == ["kern_param_0", "kern_param_2",
                                                                          "kern_param_1"]
    assert ptx.count("kern_param_3") == 0 and C.ptx_reqntid(ptx, "kern") == 128
    assert ptx.split(".reqntid")[1] == FAKE_PTX.split(".reqntid")[1]  # body untouched
    used = FAKE_PTX.replace("\tret;", "\tld.param.b64 \t%rd3, [kern_param_3];\n\tret;")
    with pytest.raises(TrtkvError, match="hidden parameter kern_param_3 is used"):
        C.ptx_to_trt_abi(used, "kern", ["x", "out", "n"], ["x", "n", "out"])
    with pytest.raises(TrtkvError, match="no .entry"):
        C.ptx_entry_params(FAKE_PTX, "other")
    with pytest.raises(TrtkvError, match="same parameters"):
        C.ptx_to_trt_abi(FAKE_PTX, "kern", ["x", "out", "n"], ["x", "n", "y"])


@pytest.mark.slow
@pytest.mark.parametrize("op, fmt, arch", [
    ("PagedKVSeal", "int4", 90), ("PagedKVSeal", "int8-static", 80),
    ("PagedDecodePartition", "int4", 90), ("PagedDecodePartition", "int8-static", 80),
    ("PagedDecodeReduce", "int4", 90), ("PagedDecodeReduce", "fp8", 80),
    ("PagedPrefillAttention", "int4", 80), ("PagedPrefillAttention", "fp8", 90),
])
def test_compile_kernel_for_tensorrt(op, fmt, arch):
    """Real Triton compiles to PTX (no GPU needed): TensorRT's parameter order, hidden params gone."""
    pytest.importorskip("triton")
    from trtkv.plugins import trt_plugins as T

    a = attrs(op, fmt, head_dim=64)
    k = T.compile_kernel(op, a, arch=arch)
    decls = C.ptx_entry_params(k.ptx, k.name)
    assert len(decls) == len(k.signature.trt_order)
    idx = {p: i for i, p in enumerate(k.signature.ptx_order)}
    assert [d.split()[-1] for d in decls] == [f"{k.name}_param_{idx[p]}" for p in k.signature.trt_order]
    scal = set(C.BINDINGS[op].scalars)
    assert [(".u32" in d) for d in decls] == [p in scal for p in k.signature.trt_order]
    assert C.ptx_reqntid(k.ptx, k.name) == 32 * k.num_warps
    assert f".target sm_{arch}" in k.ptx and k.arch == arch
    assert "qk_scale" not in k.signature.signature or k.signature.signature["qk_scale"] == "constexpr"
    assert k.needs_shared_opt_in == (k.shared > 48 * 1024)


# ------------------------------------------------------------------------------------------------
# trt_plugins without TensorRT, and with a stand-in tensorrt.plugin
# ------------------------------------------------------------------------------------------------


def test_trt_plugins_imports_without_tensorrt():
    mod = importlib.import_module("trtkv.plugins.trt_plugins")
    assert callable(mod.register_plugins)
    try:
        import tensorrt.plugin  # noqa: F401
    except ImportError:
        with pytest.raises(TrtkvError) as e:
            mod.register_plugins()
        assert "nvcr.io/nvidia/tensorrt" in str(e.value) and "pip install tensorrt" in str(e.value)
    else:  # pragma: no cover - a machine with TensorRT
        pytest.skip("tensorrt is installed here")


class _Desc:
    def __init__(self, shape, dtype):
        self.shape_expr = tuple(shape)
        self.dtype = dtype

    @property
    def ndim(self):
        return len(self.shape_expr)


class _Sym32:
    def __init__(self, v):
        self.v = v


class _SymIntExprs(list):
    def __init__(self, n):
        super().__init__([None] * n)


class _Params:
    pass


def fake_tensorrt():
    """A stand-in for tensorrt + tensorrt.plugin with the parts the glue touches."""
    trt = types.SimpleNamespace(float16="HALF", float32="FLOAT", int8="INT8", uint8="UINT8", int32="INT32")
    reg: dict = {}

    def register(pid):
        def deco(f):
            reg.setdefault(pid, {})["register"] = f
            ns, name = pid.split("::")
            setattr(trtp.op.__dict__.setdefault(ns, types.SimpleNamespace()), name, f)
            return f
        return deco

    def aot_impl(pid):
        def deco(f):
            reg[pid]["aot_impl"] = f
            return f
        return deco

    trtp = types.SimpleNamespace(
        TensorDesc=_Desc, KernelLaunchParams=_Params, SymIntExprs=_SymIntExprs, SymInt32=_Sym32,
        from_shape_expr=lambda shape, dtype: _Desc(shape, dtype), register=register, aot_impl=aot_impl,
        cdiv=C.SYM_OPS.cdiv, max=C.SYM_OPS.max, min=C.SYM_OPS.min, op=types.SimpleNamespace())
    return trt, trtp, reg


def test_registration_glue_with_a_stand_in_tensorrt(monkeypatch):
    from trtkv.plugins import trt_plugins as T

    trt, trtp, reg = fake_tensorrt()
    monkeypatch.setattr(T, "_import_trt", lambda: (trt, trtp))
    ids = T.register_plugins()
    assert ids == [op.plugin_id for op in C.OPS.values()] and set(reg) == set(ids)
    assert T.register_plugins() == ids  # idempotent
    to_trt = T.trt_dtypes(trt)
    for op in C.OPS.values():
        f, g = reg[op.plugin_id]["register"], reg[op.plugin_id]["aot_impl"]
        # the signatures tensorrt.plugin parses: tensors, then attributes (annotated, no defaults)
        ps = list(inspect.signature(f).parameters.values())
        assert [p.name for p in ps] == [t.name for t in op.inputs] + [a.name for a in op.attrs]
        assert all(p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD for p in ps)
        assert [p.annotation for p in ps] == [_Desc] * len(op.inputs) + [a.type for a in op.attrs]
        ret = inspect.signature(f).return_annotation
        assert typing.get_origin(ret) is tuple and typing.get_args(ret) == (_Desc,) * len(op.outputs)
        gs = inspect.signature(g)
        assert list(gs.parameters) == [p.name for p in ps] + ["outputs", "tactic"]
        assert len(typing.get_args(gs.return_annotation)) == 4
        # the register function on symbolic shapes
        a = attrs(op.name, "int4", partition_size=64)
        shapes = C.expected_input_shapes(op, a, batch=3, tokens=11, max_blocks=5)
        descs = [_Desc(C.sym_shape(t.name, s), to_trt[d]) for t, s, d in zip(op.inputs, shapes, C.input_dtypes(op, a))]
        outs = f(*descs, **a)
        assert [tuple(C.value(d) for d in o.shape_expr) for o in outs] == C.output_shapes(op, a, shapes)
        assert [o.dtype for o in outs] == [to_trt[d] for d in C.output_dtypes(op, a)]
        bad = list(descs)
        bad[0] = _Desc(bad[0].shape_expr, trt.int32)
        with pytest.raises(TrtkvError, match=f"input {op.inputs[0].name} is int32, expected"):
            f(*bad, **a)


@pytest.mark.slow
@pytest.mark.parametrize("op", list(C.OPS))
def test_aot_impl_with_a_stand_in_tensorrt(monkeypatch, op):
    """aot_impl end to end on symbolic shapes: PTX, launch params and SymInt32 extra arguments."""
    pytest.importorskip("triton")
    from trtkv.plugins import trt_plugins as T

    trt, trtp, reg = fake_tensorrt()
    monkeypatch.setattr(T, "_import_trt", lambda: (trt, trtp))
    real = T.compile_kernel
    monkeypatch.setattr(T, "compile_kernel", lambda *a, **k: real(*a, **{**k, "arch": 90}))
    T.register_plugins([op])
    spec = C.get_op(op)
    a = attrs(op, "int8", head_dim=64, partition_size=64)
    to_trt = T.trt_dtypes(trt)
    shapes = C.expected_input_shapes(spec, a, batch=3, tokens=40)
    descs = [_Desc(C.sym_shape(t.name, s), to_trt[d]) for t, s, d in zip(spec.inputs, shapes, C.input_dtypes(spec, a))]
    outs = reg[spec.plugin_id]["register"](*descs, **a)
    name, ptx, params, extra = reg[spec.plugin_id]["aot_impl"](*descs, *a.values(), outs, 0)
    assert name in ptx and C.ptx_entry_params(ptx, name)
    assert params.block_x == C.ptx_reqntid(ptx, name)
    grid = tuple(C.value(params.__dict__[k]) for k in ("grid_x", "grid_y", "grid_z"))
    L = C.launch(spec, a, shapes, T.kernel_config(spec, a)["constexprs"], 4, 0)
    assert grid == L.grid
    assert all(isinstance(e, _Sym32) for e in extra) and tuple(C.value(e.v) for e in extra) == L.scalars


@pytest.mark.slow
def test_aot_impl_warns_about_shared_memory_above_48k(monkeypatch):
    """int4 prefill with tf32 dots at head_dim 128 needs more than 48 KiB of dynamic shared memory on
    sm_90, which a launch only gets after raising the function's limit (unknown whether TensorRT does);
    the decode partition with the default tf32x3 stays under it."""
    pytest.importorskip("triton")
    from trtkv.plugins import trt_plugins as T

    trt, trtp, reg = fake_tensorrt()
    monkeypatch.setattr(T, "_import_trt", lambda: (trt, trtp))
    real = T.compile_kernel
    monkeypatch.setattr(T, "compile_kernel", lambda *a, **k: real(*a, **{**k, "arch": 90}))
    to_trt = T.trt_dtypes(trt)
    for op, prec, warns in ((C.PREFILL, "tf32", True), (C.DECODE_PARTITION, "tf32x3", False)):
        T.register_plugins([op.name])
        a = attrs(op.name, "int4", precision=prec)
        shapes = C.expected_input_shapes(op, a, batch=2, max_blocks=4)
        descs = [_Desc(s, to_trt[d]) for s, d in zip(shapes, C.input_dtypes(op, a))]
        outs = reg[op.plugin_id]["register"](*descs, **a)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            _, _, params, _ = reg[op.plugin_id]["aot_impl"](*descs, *a.values(), outs, 0)
        assert any("dynamic shared memory" in str(x.message) for x in w) == warns, op.name
        assert (params.shared_mem > C.SHARED_MEM_DEFAULT_LIMIT) == warns


# ------------------------------------------------------------------------------------------------
# bench/gpu_check.py --dry-run
# ------------------------------------------------------------------------------------------------


@pytest.mark.tier2  # compiles every op for the ABI check and times them: CI's second step
@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the engine section's child (bench/gpu_engine.py --dry-run) has its own test: tests/test_gpu_engine_dry_run.py
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--skip", "engine", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = list(tmp_path.glob("gpu-check-*-dry-run.md"))
    js = list(tmp_path.glob("gpu-check-*-dry-run.json"))
    assert len(md) == 1 and len(js) == 1
    import json

    res = json.loads(js[0].read_text())
    assert res["dry_run"] and res["complete"] and res["correctness"] and all(r["ok"] for r in res["correctness"])
    assert {"seal", "paged_decode", "paged_prefill"} <= {r["kernel"] for r in res["correctness"]}
    assert res["trt_abi"] and all(r["ok"] for r in res["trt_abi"])  # every op: compiled + TensorRT-order launch
    assert {r["op"] for r in res["trt_abi"]} == set(C.OPS)
    assert all("TensorRT-order launch" in r["status"] for r in res["trt_abi"])
    paged = [r for r in res["timing"] if r["impl"].startswith("paged-")]
    assert {r["impl"] for r in res["timing"] if "us" in r} >= {"sdpa-fp16", "paged-int8", "paged-int4"}
    assert paged and all(r.get("mode") == "prepared" for r in paged)  # not the eager fallback
    for key in ("date", "env"):
        assert res[key]
    assert {"torch", "triton", "device"} <= set(res["env"])
    assert "## Decode attention timing" in md[0].read_text()


@pytest.mark.parametrize("fmt", ["k=int4:bchannel:asym:mse,v=int4:g32:sym:hadamard,block=64",
                                 "k=int2:bchannel:asym:mse,v=int2:token:asym:hadamard,block=64"])
@pytest.mark.parametrize("op", ["PagedKVSeal", "PagedDecodePartition", "PagedPrefillAttention"])
def test_formats_the_kernels_lack_are_rejected_by_name(op, fmt):
    """The searched (mse) seal exists in the reference, eval and the ONNX native decode, not in the Triton seal
    kernel: the contract says so, naming the attribute, instead of sealing with plain min / max ranges."""
    assert not kernels_take(get_format(fmt))
    with pytest.raises(TrtkvError, match="mse") as ei:
        attrs(op, fmt, block_size=64)
    assert "format" in str(ei.value)


def test_every_kernel_dtype_fills_whole_bytes_at_every_kernel_head_dim():
    """The kernels take every DTYPES row; a packed row must fill whole bytes in each bit plane (int4: head_dim % 2,
    int2: % 4, int3: % 8), which every head_dim of LIMITS (powers of two >= 32) does. A storage dtype outside
    ``dtypes`` is refused by name."""
    from trtkv.formats import DTYPES

    assert set(C.LIMITS.dtypes) == set(DTYPES)
    d = C.LIMITS.head_dim_min
    while d <= C.LIMITS.head_dim_max:
        assert not C.LIMITS.head_dim_problem(d)
        assert all(d % DTYPES[t].row_align == 0 for t in C.LIMITS.dtypes)
        d *= 2
    assert (DTYPES["int4"].row_align, DTYPES["int2"].row_align, DTYPES["int3"].row_align) == (2, 4, 8)
    assert "int3" in C.KernelLimits(dtypes=("fp16", "int4")).dtype_problem("int3")
