"""The TensorRT plugin contract (plugins/contract.py), the registration glue without TensorRT
(plugins/trt_plugins.py, driven through a stand-in ``tensorrt.plugin``), and bench/gpu_check.py --dry-run."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import torch

from trtkv.cache_layout import KVPool, PagedKVLayout
from trtkv.errors import TrtkvError
from trtkv.formats import PRESETS, get_format
from trtkv.plugins import contract as C
from trtkv.quant import quantize

ROOT = Path(__file__).resolve().parents[1]
PRESET_NAMES = [n for n, f in PRESETS.items() if not f.recent_tokens]
GEOM = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)


def attrs(op, fmt="int4", **kw):
    return C.attrs_for(op, fmt, **{**GEOM, **kw})


# ------------------------------------------------------------------------------------------------
# op specs
# ------------------------------------------------------------------------------------------------


def test_op_names_and_fields():
    import onnx.defs

    assert set(C.OPS) == {"PagedKVAppend", "PagedDecodePartition", "PagedDecodeReduce", "PagedPrefillAttention"}
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
    (dict(block_size=24), ["block_size", "24"]),
    (dict(block_size=8), ["block_size"]),
    (dict(num_q_heads=12), ["num_q_heads", "12", "multiple"]),
    (dict(num_kv_heads=0), ["num_kv_heads"]),
    (dict(partition_size=48), ["partition_size", "48"]),
    (dict(sm_scale=-1.0), ["sm_scale"]),
    (dict(sm_scale=float("nan")), ["sm_scale"]),
    (dict(precision="fp8"), ["precision", "fp8"]),
    (dict(k_format="int3:token"), ["k_format", "int3"]),
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
    a = attrs("PagedKVAppend", "int8")
    raw = {"tensor_format": a["tensor_format"].encode(), "num_kv_heads": np.int32(8), "head_dim": np.array([128])}
    v = C.validate_attrs("PagedKVAppend", raw)
    assert v == a and type(v["num_kv_heads"]) is int and type(v["tensor_format"]) is str


def test_recent_tokens_format_is_rejected():
    with pytest.raises(TrtkvError, match="recent"):
        C.attrs_for("PagedKVAppend", "k=int8:token,v=int8:token,recent=4", **GEOM)


# ------------------------------------------------------------------------------------------------
# dtypes and shapes
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", PRESET_NAMES)
def test_append_outputs_match_the_reference_quantizer(fmt):
    """Output shapes / dtypes of PagedKVAppend equal what trtkv.quant.quantize produces for real rows."""
    f = get_format(fmt)
    for which in ("k", "v"):
        tf = f.k if which == "k" else f.v
        a = C.attrs_for("PagedKVAppend", f, **GEOM, which=which)
        T, H, D = 5, GEOM["num_kv_heads"], GEOM["head_dim"]
        from trtkv.quant import TensorParams

        p = TensorParams(scale=torch.tensor(0.05) if tf.is_static else None,
                         smooth=torch.ones(H, D) if tf.smooth else None)
        qt = quantize(torch.randn(T, H, D), tf, p, head_axis=-2)
        shapes = C.output_shapes("PagedKVAppend", a, C.expected_input_shapes("PagedKVAppend", a, tokens=T))
        dts = C.output_dtypes("PagedKVAppend", a)
        assert shapes[0] == tuple(qt.codes.shape) and dts[0] == str(qt.codes.dtype).removeprefix("torch.")
        for out, ref in ((1, qt.scale), (2, qt.zero)):
            if ref is None:
                assert shapes[out] == (1, 1, 1)  # placeholder
            else:
                assert shapes[out] == tuple(ref.shape) and dts[out] == "float16"
        layout = PagedKVLayout(f, H, D, 16, 4)
        assert dts[0] == str(layout.data_dtype(which)).removeprefix("torch.")


@pytest.mark.parametrize("fmt", PRESET_NAMES)
def test_pool_inputs_match_the_layout(fmt):
    f = get_format(fmt)
    a = attrs("PagedPrefillAttention", fmt, head_dim=64)
    layout = PagedKVLayout(f, GEOM["num_kv_heads"], 64, 16, 7)
    shapes = dict(zip((t.name for t in C.PREFILL.inputs), C.expected_input_shapes(C.PREFILL, a, num_blocks=7)))
    dts = dict(zip((t.name for t in C.PREFILL.inputs), C.input_dtypes(C.PREFILL, a)))
    for which in ("k", "v"):
        assert shapes[f"{which}_data"] == layout.data_shape(which)
        assert dts[f"{which}_data"] == str(layout.data_dtype(which)).removeprefix("torch.")
        for part, want in (("scale", layout.scale_shape(which)), ("zero", layout.zero_shape(which))):
            assert shapes[f"{which}_{part}"] == (want if want is not None else (1, 1, 1, 1))
            new = shapes[f"{which}_new_{part}"]
            assert new == ((5, *want[1:2], want[3]) if want is not None else (1, 1, 1))


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
    a = attrs("PagedKVAppend", "int8")
    op = C.APPEND
    n = C.make_node(op, [t.name for t in op.inputs], [t.name for t in op.outputs], a, name="append0")
    got = {x.name: x for x in n.attribute}
    assert n.op_type == "PagedKVAppend" and n.domain == "trtkv"
    assert got["plugin_namespace"].s == b"trtkv" and got["plugin_version"].s == b"1" and got["aot"].i == 1
    assert got["tensor_format"].s == a["tensor_format"].encode() and got["head_dim"].i == 128
    assert set(got) == {x.name for x in op.attrs} | {"plugin_namespace", "plugin_version", "aot"}
    with pytest.raises(TrtkvError, match="placeholder"):
        C.make_node(op, ["rows", "dest"], ["c", "s", "z"], a)
    with pytest.raises(TrtkvError, match="head_dim"):
        C.make_node(op, [t.name for t in op.inputs], ["c", "s", "z"], {**a, "head_dim": 100})


def test_decode_model_is_valid_onnx():
    """A graph holding the decode pair passes the ONNX checker, with value_info for custom outputs."""
    import onnx
    import onnx.helper as h

    a = attrs("PagedDecodePartition", "int4", head_dim=64, partition_size=64)
    op = C.DECODE_PARTITION
    shapes = C.expected_input_shapes(op, a, batch=2, max_blocks=9)
    dts = C.input_dtypes(op, a)
    ins = [h.make_tensor_value_info(t.name, C.ONNX_ELEM[d], list(s)) for t, s, d in zip(op.inputs, shapes, dts)]
    extra = [h.make_tensor_value_info(n, 1, [1, 1]) for n in ("v_static", "v_smooth")]
    nodes, parts = C.make_decode_nodes([t.name for t in op.inputs], "attn_out", a, prefix="layer0",
                                       v_static="v_static", v_smooth="v_smooth", hadamard="hadamard")
    assert [n.op_type for n in nodes] == ["PagedDecodePartition", "PagedDecodeReduce"]
    assert nodes[1].input[:4] == [*parts, "context_lens"]
    vi = C.value_infos(op, a, parts, shapes)
    assert [d.dim_value for d in vi[2].type.tensor_type.shape.dim] == [2, 32, 3, 64]  # cdiv(9 blocks * 16, 64)
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


def test_grids_match_the_kernel_launchers():
    K = pytest.importorskip("trtkv.plugins.kernels")
    from trtkv.plugins import trt_plugins as T

    a = attrs("PagedKVAppend", "int4")
    cfg = T.kernel_config(C.APPEND, a)
    for tokens in (1, 16, 17, 1000):
        shapes = C.expected_input_shapes(C.APPEND, a, tokens=tokens)
        L = C.launch(C.APPEND, a, shapes, cfg["constexprs"], cfg["num_warps"], 0)
        assert L.grid == K.append_grid(tokens, 8, cfg["constexprs"]) and L.scalars == (tokens,)
        sym = [C.sym_shape(f"i{i}", s) for i, s in enumerate(shapes)]
        Ls = C.launch(C.APPEND, a, sym, cfg["constexprs"], cfg["num_warps"], 0, C.SYM_OPS)
        assert tuple(C.value(g) for g in Ls.grid) == L.grid
    a = attrs("PagedDecodePartition", "int8", partition_size=256)
    for batch, mb in ((1, 1), (8, 2048 // 16), (3, 77)):
        shapes = C.expected_input_shapes(C.DECODE_PARTITION, a, batch=batch, max_blocks=mb)
        L = C.launch(C.DECODE_PARTITION, a, shapes, {}, 4, 0)
        gp, gr = K.decode_grids(batch, 8, mb * 16, 256)
        assert L.grid == gp and L.scalars == (mb, gp[2])
        r = attrs("PagedDecodeReduce", "int8", partition_size=256)
        rs = C.expected_input_shapes(C.DECODE_REDUCE, r, batch=batch, partitions=gp[2])
        Lr = C.launch(C.DECODE_REDUCE, r, rs, {}, 4, 0)
        assert Lr.grid == gr and Lr.scalars == (gp[2],)
    a = attrs("PagedPrefillAttention", "int8")
    cfg = T.kernel_config(C.PREFILL, a)
    shapes = C.expected_input_shapes(C.PREFILL, a, batch=3, tokens=100)
    L = C.launch(C.PREFILL, a, shapes, cfg["constexprs"], cfg["num_warps"], 0)
    assert L.grid == K.prefill_grid(100, 8, 3, cfg["constexprs"]) and L.block == 32 * cfg["num_warps"]


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
    if b.new_rows:  # the pure-engine contract: new-row tensors bound, the kernel reads them
        assert sig.constexprs["NEW_ROWS"] is True
        for which in ("k", "v"):
            for part in ("data", "scale", "zero"):
                assert b.params[f"{which}_new_{part}_ptr"] == f"{which}_new_{part}"
                assert sig.signature[f"{which}_new_{part}_ptr"] == sig.signature[f"{which}_{part}_ptr"]
        with pytest.raises(TrtkvError, match="NEW_ROWS=True"):
            C.kernel_signature(op, a, fn.arg_names, {**cfg["constexprs"], "NEW_ROWS": False})
    else:
        assert "NEW_ROWS" not in sig.constexprs


def test_kernel_signature_names_a_kernel_binding_mismatch():
    K = pytest.importorskip("trtkv.plugins.kernels")
    from trtkv.plugins import trt_plugins as T

    a = attrs("PagedPrefillAttention", "int4")
    cfg = T.kernel_config(C.PREFILL, a)
    names = [n for n in K.paged_prefill_kernel.arg_names if n != "v_new_zero_ptr"]
    with pytest.raises(TrtkvError, match="has no parameter.*v_new_zero_ptr"):
        C.kernel_signature(C.PREFILL, a, names, cfg["constexprs"])
    with pytest.raises(TrtkvError, match="extra_ptr are not bound"):
        C.kernel_signature(C.PREFILL, a, [*K.paged_prefill_kernel.arg_names, "extra_ptr"], cfg["constexprs"])


# ------------------------------------------------------------------------------------------------
# the pure-engine attention contract, launched in TensorRT's argument order (Triton interpreter)
# ------------------------------------------------------------------------------------------------

_TORCH = {"float16": torch.float16, "float32": torch.float32, "int8": torch.int8, "uint8": torch.uint8,
          "int32": torch.int32}


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
        x = tensors[t.name] if t.used(a) else torch.zeros(C.placeholder_shape(t), dtype=_TORCH[dt])
        assert x.dtype == _TORCH[dt] and x.dim() == t.rank, (t.name, x.dtype, x.shape)
        ins.append(x.contiguous())
    shapes = [tuple(x.shape) for x in ins]
    outs = [torch.full(s, 7.0).to(_TORCH[dt]) for s, dt in zip(C.output_shapes(spec, a, shapes),
                                                                C.output_dtypes(spec, a))]
    L = C.launch(spec, a, shapes, cfg["constexprs"], cfg["num_warps"], 0)
    args = [*ins, *L.scalars, *outs]
    assert len(args) == len(sig.trt_order)
    fn[L.grid](**dict(zip(sig.trt_order, args)), **sig.constexprs, num_warps=cfg["num_warps"])
    return outs


def _pure_engine_case(fmt_name: str, new: list[int] | None, *, hq=4, hkv=2, d=64, bs=16, ctxs=(37, 5, 16), seed=3):
    """Contract tensors of one attention op under the pure-engine contract and its reference output.

    The pool holds each sequence's first ``ctx - n`` positions; the slots of its last ``n`` positions
    hold other (garbage) rows, as they do before the runtime writes this step's rows. The new rows
    are quantized into pool-row form exactly as PagedKVAppend returns them. ``new`` None: decode (one
    new row per sequence). The reference is attention over the pool after the write."""
    from trtkv.plugins import reference as R
    from trtkv.quant import TensorParams, hadamard_matrix

    f = get_format(fmt_name)
    g = torch.Generator().manual_seed(seed)
    B = len(ctxs)
    n = [1] * B if new is None else list(new)
    blocks = [-(-c // bs) for c in ctxs]
    layout = PagedKVLayout(f, hkv, d, bs, sum(blocks) + 2)
    perm = torch.randperm(layout.num_blocks, generator=g)
    bt = torch.zeros(B, max(blocks), dtype=torch.int32)
    i = 0
    for b, nb in enumerate(blocks):
        bt[b, :nb] = perm[i:i + nb]
        i += nb
    cl = torch.tensor(ctxs, dtype=torch.int32)
    cu = torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32)
    slots, is_new = [], []
    for b, c in enumerate(ctxs):
        pos = torch.arange(c)
        slots.append(bt[b, pos // bs].long() * bs + pos % bs)
        is_new.append(pos >= c - n[b])
    slots, is_new = torch.cat(slots), torch.cat(is_new)
    params, pools, new_rows = {}, {}, {}
    for which in ("k", "v"):
        tf = f.k if which == "k" else f.v
        p = TensorParams(scale=torch.tensor(0.04) if tf.is_static else None,
                         smooth=(torch.rand(hkv, d, generator=g) * 1.5 + 0.5) if tf.smooth else None)
        rows = torch.randn(len(slots), hkv, d, generator=g)
        pool = layout.allocate(which)
        args = (tf.short(), p.scale, p.smooth)
        R.quantize_append_ref(rows[~is_new], slots[~is_new], pool.data, pool.scale, pool.zero, *args)
        R.quantize_append_ref(rows[is_new] * 30, slots[is_new], pool.data, pool.scale, pool.zero, *args)  # garbage
        one = PagedKVLayout(f, hkv, d, 1, int(is_new.sum())).allocate(which)  # one-token blocks: PagedKVAppend
        R.quantize_append_ref(rows[is_new], torch.arange(int(is_new.sum())), one.data, one.scale, one.zero, *args)
        sq = lambda t: None if t is None else t[:, :, 0]  # noqa: E731
        params[which], pools[which], new_rows[which] = p, pool, KVPool(sq(one.data), sq(one.scale), sq(one.zero))
    q = torch.randn(int(cu[-1]) if new is not None else B, hq, d, generator=g).half()
    after = {w: R.pool_with_new_rows(pools[w], new_rows[w], bt, cl, None if new is None else cu) for w in "kv"}
    ref = R.paged_attention_ref(q, None if new is None else cu, after["k"], after["v"], bt, cl, f.k.short(),
                                f.v.short(), params["k"], params["v"])
    hd = lambda x: None if x is None else x.float().expand(hkv, d).contiguous()  # noqa: E731
    t = dict(q=q, cu_seqlens=cu, block_tables=bt, context_lens=cl, hadamard=hadamard_matrix(d, torch.float32))
    for w in "kv":
        t.update({f"{w}_data": pools[w].data, f"{w}_scale": pools[w].scale, f"{w}_zero": pools[w].zero,
                  f"{w}_new_data": new_rows[w].data, f"{w}_new_scale": new_rows[w].scale,
                  f"{w}_new_zero": new_rows[w].zero, f"{w}_static": hd(params[w].scale),
                  f"{w}_smooth": params[w].smooth})
    return t, ref

PURE_FORMATS = ["int4", "k=int8:tensor:sym,v=int4:g32:asym:smooth:hadamard"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", PURE_FORMATS)
def test_decode_pair_in_tensorrt_order_reads_the_new_rows(fmt):
    pytest.importorskip("triton")
    t, ref = _pure_engine_case(fmt, None)
    a = C.attrs_for("PagedDecodePartition", fmt, num_q_heads=4, num_kv_heads=2, head_dim=64, partition_size=16)
    part = _trt_order_launch("PagedDecodePartition", a, t)
    r = C.validate_attrs("PagedDecodeReduce", {k: a[k] for k in (x.name for x in C.DECODE_REDUCE.attrs)})
    t.update(part_m=part[0], part_l=part[1], part_acc=part[2])
    (out,) = _trt_order_launch("PagedDecodeReduce", r, t)
    assert part[0].shape[2] == 3  # cdiv(3 blocks * 16, 16): several partitions, some past a context
    err = float((out.double() - ref.double()).abs().max() / ref.double().abs().max())
    assert err < 2e-3, err


@pytest.mark.slow
@pytest.mark.parametrize("fmt", PURE_FORMATS)
def test_prefill_in_tensorrt_order_reads_the_new_rows(fmt):
    pytest.importorskip("triton")
    t, ref = _pure_engine_case(fmt, [3, 5, 16])  # chunked prefill, a whole new prompt, a full block
    a = C.attrs_for("PagedPrefillAttention", fmt, num_q_heads=4, num_kv_heads=2, head_dim=64)
    (out,) = _trt_order_launch("PagedPrefillAttention", a, t)
    err = float((out.double() - ref.double()).abs().max() / ref.double().abs().max())
    assert err < 2e-3, err


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
    ("PagedKVAppend", "int4", 90), ("PagedKVAppend", "int8-static", 80),
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
    assert k.constexprs.get("NEW_ROWS", False) is C.BINDINGS[op].new_rows
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
    """fp16 KV at head_dim 128: the decode partition needs 53248 B of dynamic shared memory, which a
    launch only gets after raising the function's limit (unknown whether TensorRT does)."""
    pytest.importorskip("triton")
    from trtkv.plugins import trt_plugins as T

    trt, trtp, reg = fake_tensorrt()
    monkeypatch.setattr(T, "_import_trt", lambda: (trt, trtp))
    real = T.compile_kernel
    monkeypatch.setattr(T, "compile_kernel", lambda *a, **k: real(*a, **{**k, "arch": 90}))
    op = C.DECODE_PARTITION
    T.register_plugins([op.name])
    a = attrs(op.name, "fp16")
    to_trt = T.trt_dtypes(trt)
    shapes = C.expected_input_shapes(op, a, batch=2, max_blocks=4)
    descs = [_Desc(s, to_trt[d]) for s, d in zip(shapes, C.input_dtypes(op, a))]
    outs = reg[op.plugin_id]["register"](*descs, **a)
    with pytest.warns(UserWarning, match="dynamic shared memory"):
        _, _, params, _ = reg[op.plugin_id]["aot_impl"](*descs, *a.values(), outs, 0)
    assert params.shared_mem > C.SHARED_MEM_DEFAULT_LIMIT


# ------------------------------------------------------------------------------------------------
# bench/gpu_check.py --dry-run
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = list(tmp_path.glob("gpu-check-*-dry-run.md"))
    js = list(tmp_path.glob("gpu-check-*-dry-run.json"))
    assert len(md) == 1 and len(js) == 1
    import json

    res = json.loads(js[0].read_text())
    assert res["dry_run"] and res["complete"] and res["correctness"] and all(r["ok"] for r in res["correctness"])
    assert {"paged_decode (new rows)", "paged_prefill (new rows)"} <= {r["kernel"] for r in res["correctness"]}
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
