"""Section 2, TensorRT ABI: all four plugin ops compiled the way ``trtkv.plugins.trt_plugins`` compiles them for
TensorRT (attribute constexprs, PTX parameters reordered to inputs / int32 scalars / outputs, Triton's
hidden scratch parameters dropped) and launched through the CUDA driver API (cuModuleLoadData /
cuLaunchKernel, raising the function's dynamic shared memory limit above 48 KiB) in exactly that order with
the contract's grid -- what a TensorRT AOT plugin does -- compared with the regular Triton launch. The dry
run compiles the same PTX and replaces the driver launch with a TensorRT-order launch on the interpreter."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from trtkv.formats import ELEM_TYPES, get_format
from trtkv.plugins.cases import DEFAULT_BLOCK, PagedCase
from trtkv.quant import hadamard_matrix, per_channel

from .common import Run, geometry, p_of, rel_err
from .driver import DriverKernel, assemble_cubin
from .timing import PreparedDecode

ENTRY = Path(__file__).resolve().parents[1] / "gpu_check.py"  # the dry run compiles in a child of the entry point
ABI_FORMATS = ("int4", "int8-static", "fp8", "int8", "fp16", "k=int4:g32:sym,v=int4:g32:sym")  # coverage first (time budget)
DRY_ABI_FORMATS = ("int8", "int4")
ABI_OPS = ("PagedKVSeal", "PagedDecodePartition", "PagedDecodeReduce", "PagedPrefillAttention")
_TORCH_DT = {n: e.torch for n, e in ELEM_TYPES.items()}  # trtkv.formats.ELEM_TYPES


def _contract_inputs(op, attrs, tensors: dict, device):
    """Tensors in contract order, placeholders (zeros, the declared rank) for unused ones."""
    from trtkv.plugins import contract as C

    out = []
    for t, d in zip(op.inputs, C.input_dtypes(op, attrs)):
        x = tensors.get(t.name) if t.used(attrs) else None
        if x is None:
            x = torch.zeros(C.placeholder_shape(t, attrs), dtype=_TORCH_DT[d], device=device)
        assert x.dtype == _TORCH_DT[d] and x.dim() == t.rank_of(attrs), (t.name, x.dtype, tuple(x.shape), d)
        out.append(x.contiguous())
    return out


def _abi_attrs(op_name: str, fmt_name: str, dry: bool):
    """The op instance the ABI check compiles. Prefill uses ``tf32`` dots (ops.PREFILL_PRECISION), whose
    head_dim-128 tiles need > 48 KiB of dynamic shared memory: the driver launch must opt in."""
    from trtkv.plugins import contract as C

    hq, hkv, d = geometry(dry)
    prec = "tf32" if op_name == "PagedPrefillAttention" else "tf32x3"
    f = get_format(fmt_name)
    return C.attrs_for(op_name, f, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                       block_size=f.block_size or DEFAULT_BLOCK, partition_size=64, precision=prec)


def _interpreter_trt_launch(op_name: str, attrs):
    """Dry run: a stand-in for the driver launch. The kernel runs on the Triton interpreter, but its
    arguments arrive as TensorRT passes them -- inputs, int32 scalars, outputs, with the contract's grid
    and the compiled constexprs -- and are matched to parameters through the TensorRT order that
    ``ptx_to_trt_abi`` gives the PTX. Everything but the PTX and the driver call is the GPU path."""
    from trtkv.plugins import contract as C
    from trtkv.plugins import kernels as K
    from trtkv.plugins import trt_plugins as T

    op = C.get_op(op_name)
    cfg = T.kernel_config(op, attrs)  # compile_kernel's config, not the interpreter's
    fn = getattr(K.load_kernels(True), C.BINDINGS[op_name].kernel)
    sig = C.kernel_signature(op, attrs, fn.arg_names, cfg["constexprs"])

    def launch(grid, block, args):
        assert len(args) == len(sig.trt_order) and block == 32 * cfg["num_warps"]
        fn[tuple(int(g) for g in grid)](**dict(zip(sig.trt_order, args)), **sig.constexprs, num_warps=cfg["num_warps"])

    return launch, cfg["constexprs"], cfg["num_warps"], 0


def _abi_data(fmt_name: str, device, dry: bool) -> PagedCase:
    """One format's data for the ABI checks: a case with pools sealed by the seal kernel, tails and new rows."""
    from trtkv.plugins import ops

    hq, hkv, d = geometry(dry)
    bs = get_format(fmt_name).block_size or DEFAULT_BLOCK
    ctx = [37, 20, 2 * bs] if dry else [700, 130, 1, 5 * bs]
    new = [min(3, bs - c % bs) for c in ctx]
    c = PagedCase(fmt_name, ctx, new, heads_q=hq, kv_heads=hkv, head_dim=d, device=device, seed=5, seal=False)
    c.seal_with(lambda which, rows, blocks, pool, p: ops.launch_seal_into(
        rows, blocks, pool.data, pool.scale, pool.zero, c.tensor_format(which), p.scale, p.smooth, p.clip))
    return c


def _static_hd(c: PagedCase, which: str):
    s = c.params[which].scale
    return None if s is None else per_channel(s, c.kvh, c.d)


def _abi_case(op_name: str, attrs, c: PagedCase, launch, constexprs: dict, num_warps: int, shared: int,
              device) -> dict:
    """Launch one op in TensorRT's argument order (``launch(grid, block, args)``) and compare with the
    regular Triton launch of the same computation. Returns ok / rel_err / status."""
    from trtkv.plugins import contract as C
    from trtkv.plugins import ops

    op = C.get_op(op_name)

    def run(tensors: dict):
        ins = _contract_inputs(op, attrs, tensors, device)
        shapes = [tuple(x.shape) for x in ins]
        outs = [torch.full(sh, 7, device=device).to(_TORCH_DT[dt])  # not zeros: unwritten outputs show
                for sh, dt in zip(C.output_shapes(op, attrs, shapes), C.output_dtypes(op, attrs))]
        L = C.launch(op, attrs, shapes, constexprs, num_warps, shared)
        launch(L.grid, L.block, [*ins, *L.scalars, *outs])
        return outs

    hadamard = hadamard_matrix(c.d, torch.float32, device)
    if op_name == "PagedKVSeal":
        blocks, prm = c.rows["k"], c.kp
        outs = run(dict(rows=blocks, static_scale=_static_hd(c, "k"), smooth=prm.smooth,
                        clip=torch.ones(c.kvh, device=device), hadamard=hadamard))
        want = ops.launch_seal(blocks, c.fmt.k, prm.scale, prm.smooth)  # regular launch
        ok = all(w is None or torch.equal(o, w) for o, w in zip(outs, want))
        return dict(ok=bool(ok), status="TensorRT-order launch == regular launch (bit-exact)" if ok else "MISMATCH")
    if op_name in ("PagedDecodePartition", "PagedDecodeReduce"):
        prec = attrs.get("precision", "tf32x3")  # the reduce has no dots
        prep = PreparedDecode(c.q_dec, c.attn_args(), prec, attrs["partition_size"])
        want = prep().clone()  # the regular partition + reduce launches
        if op_name == "PagedDecodePartition":
            part = run(c.contract_tensors(False))
            for dst, src in zip((prep.part_m, prep.part_l, prep.part_acc), part):
                assert dst.shape == src.shape, (dst.shape, src.shape)
                dst.copy_(src)
            got = prep.reduce().clone()  # the regular reduce over the TensorRT-order partials
        else:
            prep.partition()
            t = dict(part_m=prep.part_m, part_l=prep.part_l, part_acc=prep.part_acc, context_lens=c.context_lens,
                     v_static=_static_hd(c, "v"), v_smooth=p_of(c.vp, "smooth"), hadamard=hadamard)
            (got,) = run(t)
        e = rel_err(got, want)
        return dict(ok=e < 1e-3, rel_err=e, status="TensorRT-order launch vs regular decode")
    if op_name == "PagedPrefillAttention":
        want = ops.launch_paged_prefill(c.q_pre, c.cu, *c.attn_args(prefill=True), precision=attrs["precision"])
        (got,) = run(c.contract_tensors(True))
        e = rel_err(got, want)
        return dict(ok=e < 1e-3, rel_err=e, status="TensorRT-order launch vs regular prefill")
    raise AssertionError(op_name)


def _compiled_in_child(r: Run) -> dict | list:
    """The dry run compiles in a child process: triton cannot compile kernels in a process that imported it
    with TRITON_INTERPRET=1 (its own library functions are interpreter objects there)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "abi.json"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        proc = subprocess.run([sys.executable, str(ENTRY), "--dry-run", "--abi-json", str(path)], env=env,
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0 or not path.is_file():
            r.log(proc.stdout[-2000:] + proc.stderr[-2000:])
            return [dict(op="*", fmt="*", ok=False, error=f"ABI child process failed (rc {proc.returncode})")]
        return {(x["op"], x["fmt"]): x for x in json.loads(path.read_text())}


def run(r: Run) -> None:
    """Every op compiled like trt_plugins.compile_kernel (PTX reordered to TensorRT's ABI) and launched in
    TensorRT's argument order with the contract's grid: on a GPU the PTX through the CUDA driver (what a
    TensorRT AOT plugin does); in the dry run a stand-in launch on the Triton interpreter. Compared with
    the regular Triton launch of the same computation (attention: stale pool + this step's new rows)."""
    from trtkv.plugins import trt_plugins as T

    dry, device, log, rows = r.dry, r.device, r.log, r.result["trt_abi"]
    compiled = None  # compile here
    if dry and os.environ.get("TRITON_INTERPRET") == "1":
        compiled = _compiled_in_child(r)
        if isinstance(compiled, list):
            rows.extend(compiled)
            return
    t_start = time.time()
    for fmt_name in DRY_ABI_FORMATS if dry else ABI_FORMATS:
        if time.time() - t_start > r.budget_s:
            rows.extend(dict(op=op_name, fmt=fmt_name, ok=None, status="skipped: time budget") for op_name in ABI_OPS)
            log(f"trt-abi {fmt_name}: skipped (time budget)")
            continue
        data = None
        for op_name in ABI_OPS:
            row = dict(op=op_name, fmt=fmt_name)
            try:
                a = _abi_attrs(op_name, fmt_name, dry)
                if compiled is not None:  # dry-run parent: the child compiled, the interpreter launches
                    row.update(compiled[(op_name, fmt_name)])
                    if not row.get("ok"):
                        rows.append(row)
                        continue
                    launch, cexpr, warps, shared = _interpreter_trt_launch(op_name, a)
                    how = row["status"] + "; TensorRT-order launch on the interpreter: "
                else:
                    k = T.compile_kernel(op_name, a, arch=90 if dry else None)
                    row.update(kernel=k.name, arch=k.arch, num_warps=k.num_warps, shared=k.shared,
                               smem_opt_in=k.needs_shared_opt_in, params=len(k.signature.trt_order),
                               precision=a.get("precision"))
                    if dry or device == "cpu":  # the dry run's compile-only child
                        assemble_cubin(k.ptx, k.arch)  # the reordered PTX is still valid PTX
                        row.update(ok=True, status="compiled, PTX reordered (ptxas accepts it)")
                        rows.append(row)
                        continue
                    dk = DriverKernel(k.ptx, k.name, k.shared, k.arch)
                    launch = dk.launch
                    cexpr, warps, shared = k.constexprs, k.num_warps, k.shared
                    row["loaded_as"] = dk.loaded_as
                    how = (f"driver launch of the TensorRT-order {dk.loaded_as}"
                           + (" (> 48 KiB smem, opted in)" if k.needs_shared_opt_in else "") + ": ")
                if data is None:
                    data = _abi_data(fmt_name, device, dry)
                res = _abi_case(op_name, a, data, launch, cexpr, warps, shared, device)
                row.update(res, status=how + res["status"])
            except Exception as exc:
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
                log(traceback.format_exc(limit=4))
            rows.append(row)
            log(f"trt-abi {op_name} {fmt_name}: {row.get('status', row.get('error'))}"
                + (f" rel_err={row['rel_err']:.1e}" if "rel_err" in row else ""))


def report(result: dict) -> list[str]:
    L = ["## TensorRT ABI (PTX reordered for TensorRT; launched in TensorRT's argument order: CUDA driver "
         "on a GPU, Triton interpreter stand-in in the dry run)", "",
         "| op | format | kernel | precision | warps | smem B | status | ok |", "|---|---|---|---|---|---|---|---|"]
    for r in result["trt_abi"]:
        status = r.get("status", "") + (f" rel_err={r['rel_err']:.1e}" if "rel_err" in r else "")
        if r.get("error"):
            status = (status + " " if status else "") + "ERROR " + r["error"]
        L.append(f"| {r['op']} | {r['fmt']} | {r.get('kernel', '')} | {r.get('precision') or ''} | "
                 f"{r.get('num_warps', '')} | {r.get('shared', '')} | {status} | {r['ok']} |")
    return L
