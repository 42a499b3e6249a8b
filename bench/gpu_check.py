"""One-shot GPU check of the trtkv kernels: correctness, TensorRT-ABI launches, decode timing vs SDPA.

    python bench/gpu_check.py [--out DIR]        # on a CUDA GPU (written for one H200, < 8 minutes)
    python bench/gpu_check.py --dry-run          # CPU, Triton interpreter, tiny sizes (< 1 minute)

Sections
1. correctness: every kernel (quantize-append, split-K decode, prefill) for each KV preset, CUDA vs the
   torch reference (``trtkv.plugins.reference``: write_paged / gather_paged, float64 attention).
2. TensorRT ABI: the kernels compiled the way ``trtkv.plugins.trt_plugins`` compiles them for TensorRT
   (attribute constexprs, PTX parameters reordered to inputs / int32 scalars / outputs, Triton's hidden
   scratch parameters dropped) and launched through the CUDA driver API in exactly that order with the
   contract's grid -- what a TensorRT AOT plugin does -- compared with the regular launch.
3. bandwidth: device-to-device copy of a large tensor (read + write bytes / time): the reference rate.
4. decode timing: heads 32 query / 8 KV, head_dim 128, block 16, contexts 4k / 32k / 128k, batch 1
   and 8: the fp16 baseline is torch ``scaled_dot_product_attention`` (flash backend, ``enable_gqa``) on a
   contiguous fp16 cache; ours reads the paged fp16 / int8 / int4 pools. Each timing is the median
   over repeats of CUDA-graph replays (no launch overhead) between CUDA events, after warmup. Achieved
   bandwidth counts the bytes actually read: codes + scales (+ zero-points) + query (+ block table).
5. targets: int4 >= 2.5x faster than fp16 SDPA at 32k batch 8 and >= 70% of copy bandwidth;
   int8 >= 1.6x.

Writes ``<out>/gpu-check-<date>-<device>.md`` and ``.json`` (default out: bench/results).
"""

from __future__ import annotations

import os
import sys

DRY = "--dry-run" in sys.argv
if DRY and "--abi-json" not in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import ctypes  # noqa: E402
import datetime as _dt  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from trtkv.cache_layout import KVPool, PagedKVLayout  # noqa: E402
from trtkv.formats import PRESETS, get_format  # noqa: E402
from trtkv.quant import TensorParams, forward_transform  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM, BLOCK = 32, 8, 128, 16
CONTEXTS = (4096, 32768, 131072)
BATCHES = (1, 8)
TIMED_FORMATS = ("fp16", "int8", "int4")
CHECK_FORMATS = ("fp16", "int8", "int8-static", "fp8", "int4", "int4-g32")
TARGETS = {"int4_speedup": 2.5, "int4_bw_frac": 0.70, "int8_speedup": 1.6}


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


class Log:
    def __init__(self):
        self.t0 = time.time()
        self.lines: list[str] = []

    def __call__(self, msg: str = "") -> None:
        line = f"[{time.time() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self.lines.append(msg)


def versions() -> dict:
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "platform": platform.platform()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), capability=f"{p.major}.{p.minor}",
                    sm_count=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
        try:
            info["driver"] = _driver_version()
        except Exception:
            pass
    else:
        info.update(device=f"cpu ({platform.processor() or platform.machine()})")
    return info


def make_params(fmt, which: str, x: torch.Tensor, heads: int, head_dim: int) -> TensorParams | None:
    """Stand-in calibration for static / smoothed formats: smoothing factors in [0.5, 2], static scales
    from the transformed data's absolute maximum (what `trtkv calibrate` would pick, roughly)."""
    tf = fmt.k if which == "k" else fmt.v
    if not (tf.is_static or tf.smooth):
        return None
    g = torch.Generator().manual_seed(7 if which == "k" else 8)
    p = TensorParams()
    if tf.smooth:
        p.smooth = (torch.rand(heads, head_dim, generator=g) * 1.5 + 0.5).to(x.device)
    if tf.is_static:
        xt = forward_transform(x.float(), tf, p, head_axis=-2)
        p.scale = (xt.abs().amax() / tf.traits.sym_max).reshape(()).to(x.device)
    return p


def _p(params: TensorParams | None, name: str):
    return None if params is None else getattr(params, name)


def _cpu(t):
    return None if t is None else t.detach().cpu()


def _cpu_params(p: TensorParams | None) -> TensorParams | None:
    return None if p is None else TensorParams(scale=_cpu(p.scale), smooth=_cpu(p.smooth), clip=_cpu(p.clip))


class Case:
    """A paged cache holding ``ctx_lens[b] - new[b]`` tokens per sequence, plus ``new[b]`` new rows."""

    def __init__(self, fmt_name: str, ctx_lens: list[int], new: list[int], heads_q: int, heads_kv: int,
                 head_dim: int, block: int, device, seed: int = 0):
        self.fmt = get_format(fmt_name)
        self.ctx = ctx_lens
        self.new = new
        self.hq, self.hkv, self.d, self.bs = heads_q, heads_kv, head_dim, block
        g = torch.Generator().manual_seed(seed)
        blocks_per = [math.ceil(c / block) for c in ctx_lens]
        self.max_blocks = max(blocks_per)
        nblocks = sum(blocks_per) + 3
        self.layout = PagedKVLayout(self.fmt, heads_kv, head_dim, block, nblocks)
        perm = torch.randperm(nblocks, generator=g)
        bt = torch.zeros(len(ctx_lens), self.max_blocks, dtype=torch.int32)
        i = 0
        for b, n in enumerate(blocks_per):
            bt[b, :n] = perm[i:i + n]
            i += n
        self.block_table = bt.to(device)
        self.context_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
        total = sum(ctx_lens)
        # keys with a few outlier channels, values plain: quantization sees realistic ranges
        k = torch.randn(total, heads_kv, head_dim, generator=g)
        k[..., :4] *= 4
        v = torch.randn(total, heads_kv, head_dim, generator=g)
        self.k_rows = k.half().to(device)
        self.v_rows = v.half().to(device)
        slots = []
        for b, c in enumerate(ctx_lens):
            pos = torch.arange(c)
            slots.append(bt[b, pos // block].long() * block + pos % block)
        self.slots = torch.cat(slots).to(torch.int32).to(device)
        starts = [sum(ctx_lens[:b]) for b in range(len(ctx_lens))]
        self.is_new = torch.zeros(total, dtype=torch.bool)
        for b, c in enumerate(ctx_lens):
            self.is_new[starts[b] + c - new[b]:starts[b] + c] = True
        self.k_params = make_params(self.fmt, "k", self.k_rows, heads_kv, head_dim)
        self.v_params = make_params(self.fmt, "v", self.v_rows, heads_kv, head_dim)
        nq = sum(new)
        self.q_dec = torch.randn(len(ctx_lens), heads_q, head_dim, generator=g).half().to(device)
        self.q_pre = torch.randn(nq, heads_q, head_dim, generator=g).half().to(device)
        cu = [0]
        for n in new:
            cu.append(cu[-1] + n)
        self.cu = torch.tensor(cu, dtype=torch.int32, device=device)
        self.device = device

    def pools(self):
        return self.layout.allocate("k", self.device), self.layout.allocate("v", self.device)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


# ------------------------------------------------------------------------------------------------
# 1. correctness
# ------------------------------------------------------------------------------------------------


def check_correctness(log: Log, device, dry: bool, budget_s: float = 1e9) -> list[dict]:
    from trtkv.plugins import ops
    from trtkv.plugins import reference as ref

    rows = []
    if dry:
        shapes = [dict(ctx=[37, 20], new=[3, 1], hq=4, hkv=2, d=64, bs=16)]
        formats = ("fp16", "int8", "int4")
    else:
        shapes = [dict(ctx=[1, 300, 77, 1024], new=[1, 5, 77, 16], hq=32, hkv=8, d=128, bs=16),
                  dict(ctx=[513, 45], new=[1, 45], hq=8, hkv=8, d=64, bs=32)]
        formats = CHECK_FORMATS
    t_start = time.time()
    for fmt_name in formats:
        for sh in shapes:
            tag = f"{fmt_name} d{sh['d']} hq{sh['hq']}/{sh['hkv']} ctx{sh['ctx']}"
            if time.time() - t_start > budget_s:
                rows.append(dict(kernel="*", case=tag, ok=None, error="skipped: time budget"))
                log(f"correctness {tag}: skipped (time budget)")
                continue
            try:
                c = Case(fmt_name, sh["ctx"], sh["new"], sh["hq"], sh["hkv"], sh["d"], sh["bs"], device)
                kp, vp = c.pools()
                kf, vf = c.fmt.k.short(), c.fmt.v.short()
                # append: kernel vs reference write (bit-exact codes / scales expected)
                for which, rows_t, pool, prm, spec in (("k", c.k_rows, kp, c.k_params, kf),
                                                       ("v", c.v_rows, vp, c.v_params, vf)):
                    ops.launch_quantize_append(rows_t, c.slots, pool.data, pool.scale, pool.zero, spec,
                                               _p(prm, "scale"), _p(prm, "smooth"), _p(prm, "clip"))
                    rpool = c.layout.allocate(which, "cpu")
                    ref.quantize_append_ref(_cpu(rows_t), _cpu(c.slots), rpool.data, rpool.scale, rpool.zero, spec,
                                            _cpu(_p(prm, "scale")), _cpu(_p(prm, "smooth")), _cpu(_p(prm, "clip")))
                    got = pool.data.cpu()
                    mism = float((got.view(torch.uint8) != rpool.data.view(torch.uint8)).float().mean()) \
                        if got.dtype != torch.float16 else float((got != rpool.data).float().mean())
                    smis = 0.0
                    if rpool.scale is not None:  # fraction of scales not bit-equal (fp32 sum-order ties)
                        smis = float((pool.scale.cpu() != rpool.scale).float().mean())
                    ok = mism <= 1e-3 and smis <= 1e-3
                    rows.append(dict(kernel="quantize_append", case=f"{tag} {which}", code_mismatch=mism,
                                     scale_mismatch=smis, ok=ok))
                # decode over the full pool
                k_cpu = KVPool(_cpu(kp.data), _cpu(kp.scale), _cpu(kp.zero))
                v_cpu = KVPool(_cpu(vp.data), _cpu(vp.scale), _cpu(vp.zero))
                args = (kp.data, kp.scale, kp.zero, vp.data, vp.scale, vp.zero, c.block_table, c.context_lens,
                        kf, vf, _p(c.k_params, "scale"), _p(c.k_params, "smooth"), _p(c.v_params, "scale"),
                        _p(c.v_params, "smooth"))
                for psize in ((64,) if dry else (512, 64)):
                    out = ops.launch_paged_decode(c.q_dec, *args, partition_size=psize)
                    r = ref.paged_attention_ref(_cpu(c.q_dec), None, k_cpu, v_cpu, _cpu(c.block_table),
                                                _cpu(c.context_lens), kf, vf, _cpu_params(c.k_params),
                                                _cpu_params(c.v_params))
                    e = _err(out, r)
                    rows.append(dict(kernel="paged_decode", case=f"{tag} part{psize}", rel_err=e, ok=e < 2e-2))
                out = ops.launch_paged_prefill(c.q_pre, c.cu, *args)
                r = ref.paged_attention_ref(_cpu(c.q_pre), _cpu(c.cu), k_cpu, v_cpu, _cpu(c.block_table),
                                            _cpu(c.context_lens), kf, vf, _cpu_params(c.k_params),
                                            _cpu_params(c.v_params))
                e = _err(out, r)
                rows.append(dict(kernel="paged_prefill", case=tag, rel_err=e, ok=e < 2e-2))
            except Exception as exc:  # one failing case must not hide the others
                rows.append(dict(kernel="?", case=tag, ok=False, error=f"{type(exc).__name__}: {exc}"[:400]))
                log(traceback.format_exc(limit=3))
            bad = [r_ for r_ in rows if r_["case"].startswith(tag) and r_["ok"] is False]
            log(f"correctness {tag}: {'ok' if not bad else 'FAIL ' + str(bad)[:300]}")
    return rows


# ------------------------------------------------------------------------------------------------
# 2. TensorRT-ABI launches (driver API, TensorRT's argument order)
# ------------------------------------------------------------------------------------------------

_CU = None


def _libcuda():
    global _CU
    if _CU is None:
        _CU = ctypes.CDLL("libcuda.so.1")
    return _CU


def _cu_check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _libcuda().cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {name.value.decode() if name.value else rc}")


def _driver_version() -> int:
    v = ctypes.c_int()
    _cu_check(_libcuda().cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
    return v.value


class DriverKernel:
    """A PTX kernel loaded with cuModuleLoadData and launched with cuLaunchKernel, like TensorRT does."""

    def __init__(self, ptx: str, name: str, shared: int):
        cu = _libcuda()
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # make the primary context current on this thread
        self.module = ctypes.c_void_p()
        _cu_check(cu.cuModuleLoadData(ctypes.byref(self.module), ctypes.c_char_p(ptx.encode() + b"\0")),
                  "cuModuleLoadData")
        self.fn = ctypes.c_void_p()
        _cu_check(cu.cuModuleGetFunction(ctypes.byref(self.fn), self.module, name.encode()), "cuModuleGetFunction")
        if shared > 48 * 1024:
            _cu_check(cu.cuFuncSetAttribute(self.fn, 8, ctypes.c_int(shared)), "cuFuncSetAttribute")  # MAX_DYNAMIC_SHARED
        self.shared = shared

    def launch(self, grid, block: int, args: list) -> None:
        cu = _libcuda()
        holders = []
        for a in args:
            if isinstance(a, torch.Tensor):
                holders.append(ctypes.c_uint64(a.data_ptr()))
            else:
                holders.append(ctypes.c_int32(int(a)))
        arr = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        gx, gy, gz = (int(x) for x in grid)
        _cu_check(cu.cuLaunchKernel(self.fn, gx, gy, gz, block, 1, 1, self.shared, stream, arr, None),
                  "cuLaunchKernel")


def _contract_inputs(op, attrs, tensors: dict, device):
    """Tensors in contract order, placeholders (ones, the declared rank) for unused ones."""
    from trtkv.plugins import contract as C

    dt = {"float16": torch.float16, "float32": torch.float32, "int8": torch.int8, "uint8": torch.uint8,
          "int32": torch.int32}
    out = []
    for t, d in zip(op.inputs, C.input_dtypes(op, attrs)):
        x = tensors.get(t.name) if t.used(attrs) else None
        if x is None:
            x = torch.zeros(C.placeholder_shape(t), dtype=dt[d], device=device)
        assert x.dtype == dt[d], (t.name, x.dtype, d)
        out.append(x.contiguous())
    return out


def check_trt_abi(log: Log, device, dry: bool) -> list[dict]:
    """Compile like trt_plugins.compile_kernel; on a GPU launch via the driver in TensorRT's order.

    The dry run compiles in a child process: triton cannot compile kernels in a process that imported
    it with TRITON_INTERPRET=1 (its own library functions are interpreter objects there)."""
    if dry and os.environ.get("TRITON_INTERPRET") == "1":
        import subprocess
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "abi.json"
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            proc = subprocess.run([sys.executable, __file__, "--dry-run", "--abi-json", str(path)], env=env,
                                  capture_output=True, text=True, timeout=300)
            if proc.returncode != 0 or not path.is_file():
                log(proc.stdout[-2000:] + proc.stderr[-2000:])
                return [dict(op="*", fmt="*", ok=False, error=f"ABI child process failed (rc {proc.returncode})")]
            rows = json.loads(path.read_text())
        for r in rows:
            log(f"trt-abi {r['op']} {r['fmt']}: {r.get('status', r.get('error'))}")
        return rows
    from trtkv.plugins import contract as C
    from trtkv.plugins import ops
    from trtkv.plugins import trt_plugins as T
    from trtkv.quant import hadamard_matrix

    rows = []
    arch = 90 if dry else None
    formats = ("int8", "int4") if dry else CHECK_FORMATS
    hq, hkv, d = (4, 2, 64) if dry else (32, 8, 128)
    for fmt_name in formats:
        fmt = get_format(fmt_name)
        for op_name in ("PagedKVAppend", "PagedDecodePartition", "PagedDecodeReduce", "PagedPrefillAttention"):
            tag = f"{op_name} {fmt_name}"
            try:
                a = C.attrs_for(op_name, fmt, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=16,
                                partition_size=64)
                try:
                    k = T.compile_kernel(op_name, a, arch=arch)
                except Exception as exc:
                    if "has no parameter" in str(exc):
                        rows.append(dict(op=op_name, fmt=fmt_name, ok=None, status="pending kernel support",
                                         detail=str(exc)[:200]))
                        continue
                    raise
                row = dict(op=op_name, fmt=fmt_name, kernel=k.name, arch=k.arch, num_warps=k.num_warps,
                           shared=k.shared, params=len(k.signature.trt_order))
                if dry or device == "cpu":
                    row.update(ok=True, status="compiled (PTX reordered); launch needs a GPU")
                    rows.append(row)
                    continue
                if op_name == "PagedKVAppend":
                    c = Case(fmt_name, [50, 7], [50, 7], hq, hkv, d, 16, device)
                    prm = c.k_params
                    T_ = c.k_rows.shape[0]
                    dest = torch.arange(T_, dtype=torch.int32, device=device)
                    tens = dict(rows=c.k_rows, dest=dest, static_scale=_static_hd(prm, hkv, d, device),
                                smooth=_p(prm, "smooth"), clip=torch.ones(hkv, device=device),
                                hadamard=hadamard_matrix(d, torch.float32, device))
                    ins = _contract_inputs(C.get_op(op_name), a, tens, device)
                    shapes = [tuple(x.shape) for x in ins]
                    oshapes = C.output_shapes(op_name, a, shapes)
                    odt = C.output_dtypes(op_name, a)
                    dt = {"float16": torch.float16, "int8": torch.int8, "uint8": torch.uint8}
                    outs = [torch.zeros(s, dtype=dt[x], device=device) for s, x in zip(oshapes, odt)]
                    L = C.launch(op_name, a, shapes, k.constexprs, k.num_warps, k.shared)
                    DriverKernel(k.ptx, k.name, k.shared).launch(L.grid, L.block, [*ins, *L.scalars, *outs])
                    # regular launch into a one-token-block pool (the same rows)
                    lay = PagedKVLayout(fmt, hkv, d, 1, T_)
                    pool = lay.allocate("k", device)
                    ops.launch_quantize_append(c.k_rows, dest, pool.data, pool.scale, pool.zero, fmt.k.short(),
                                               _p(prm, "scale"), _p(prm, "smooth"), None)
                    ok = torch.equal(outs[0].view(-1), pool.data.reshape(-1))
                    if pool.scale is not None:
                        ok = ok and torch.equal(outs[1].reshape(-1), pool.scale.reshape(-1))
                    row.update(ok=bool(ok), status="driver launch == regular launch" if ok else "MISMATCH")
                elif op_name == "PagedDecodeReduce":
                    c = Case(fmt_name, [700, 130], [1, 1], hq, hkv, d, 16, device)
                    kp, vp = c.pools()
                    for rows_t, pool, prm, spec in ((c.k_rows, kp, c.k_params, fmt.k.short()),
                                                    (c.v_rows, vp, c.v_params, fmt.v.short())):
                        ops.launch_quantize_append(rows_t, c.slots, pool.data, pool.scale, pool.zero, spec,
                                                   _p(prm, "scale"), _p(prm, "smooth"), None)
                    want = ops.launch_paged_decode(
                        c.q_dec, kp.data, kp.scale, kp.zero, vp.data, vp.scale, vp.zero, c.block_table,
                        c.context_lens, fmt.k.short(), fmt.v.short(), _p(c.k_params, "scale"),
                        _p(c.k_params, "smooth"), _p(c.v_params, "scale"), _p(c.v_params, "smooth"),
                        partition_size=64, precision="tf32x3")
                    part = _decode_partials(c, kp, vp, fmt, a, device)
                    tens = dict(part_m=part[0], part_l=part[1], part_acc=part[2], context_lens=c.context_lens,
                                v_static=_static_hd(c.v_params, hkv, d, device), v_smooth=_p(c.v_params, "smooth"),
                                hadamard=hadamard_matrix(d, torch.float32, device))
                    ins = _contract_inputs(C.get_op(op_name), a, tens, device)
                    shapes = [tuple(x.shape) for x in ins]
                    out = torch.zeros(C.output_shapes(op_name, a, shapes)[0], dtype=torch.float16, device=device)
                    L = C.launch(op_name, a, shapes, k.constexprs, k.num_warps, k.shared)
                    DriverKernel(k.ptx, k.name, k.shared).launch(L.grid, L.block, [*ins, *L.scalars, out])
                    e = _err(out, want)
                    row.update(ok=e < 1e-3, rel_err=e, status="driver launch vs regular decode")
                else:
                    row.update(ok=None, status="compiled; launch check not written for this op yet")
                rows.append(row)
            except Exception as exc:
                rows.append(dict(op=op_name, fmt=fmt_name, ok=False, error=f"{type(exc).__name__}: {exc}"[:400]))
            log(f"trt-abi {tag}: {rows[-1].get('status', rows[-1].get('error'))}")
    return rows


def _static_hd(p: TensorParams | None, hkv: int, d: int, device):
    if p is None or p.scale is None:
        return None
    s = p.scale.float().to(device)
    return s.expand(hkv, d).contiguous() if s.dim() == 0 else s.reshape(hkv, -1).expand(hkv, d).contiguous()


def _decode_partials(c: Case, kp: KVPool, vp: KVPool, fmt, attrs, device):
    """Run the regular partition kernel to get (part_m, part_l, part_acc) for the reduce check."""
    from trtkv.plugins import kernels as K
    from trtkv.quant import hadamard_matrix

    B = c.q_dec.shape[0]
    cfg = K.decode_config(fmt.k, fmt.v, c.d, c.hq // c.hkv, attrs["partition_size"], "tf32x3")
    grid_p, _ = K.decode_grids(B, c.hkv, c.max_blocks * c.bs, attrs["partition_size"])
    S = grid_p[2]
    m = torch.empty(B, c.hq, S, device=device)
    l_ = torch.empty_like(m)
    acc = torch.empty(B, c.hq, S, c.d, device=device)
    f32, f16 = torch.zeros(1, device=device), torch.zeros(1, dtype=torch.float16, device=device)
    had = hadamard_matrix(c.d, torch.float32, device) if fmt.k.hadamard else f32
    ks = _static_hd(c.k_params, c.hkv, c.d, device)
    K.paged_decode_partition_kernel[grid_p](
        c.q_dec, kp.data, kp.scale if kp.scale is not None else f16, kp.zero if kp.zero is not None else f16,
        vp.data, vp.scale if vp.scale is not None else f16, vp.zero if vp.zero is not None else f16,
        ks if ks is not None else f32, _p(c.k_params, "smooth") if fmt.k.smooth else f32, had,
        c.block_table, c.context_lens, m, l_, acc, attrs["sm_scale"] * K.LOG2E, c.hq, c.hkv, c.bs, c.max_blocks, S,
        **cfg["partition"]["constexprs"], num_warps=cfg["partition"]["num_warps"])
    # partitions past a context are never written; the reduce kernel never reads them
    return m, l_, acc


# ------------------------------------------------------------------------------------------------
# 3./4. bandwidth and decode timing
# ------------------------------------------------------------------------------------------------


def _time_cuda(fn, warmup: int = 3, reps: int = 5, inner: int = 20, use_graph: bool = True) -> float:
    """Median seconds per call: CUDA-graph replays of ``inner`` calls (eager if capture fails)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = None
    try:
        if not use_graph:
            raise RuntimeError("eager timing requested")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception:
        graph = None
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if graph is not None:
            graph.replay()
        else:
            for _ in range(inner):
                fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / inner)
    return statistics.median(times)


def _time_cpu(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(log: Log, device, dry: bool) -> dict:
    n = (1 << 20) if dry else (2 << 30)  # bytes
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    t = (_time_cpu if dry else _time_cuda)(lambda: dst.copy_(src))
    bw = 2 * n / t
    log(f"copy bandwidth: {bw / 1e9:.1f} GB/s ({n / 2**20:.0f} MiB copy, read + write)")
    return dict(bytes=n, seconds=t, bandwidth_gbs=bw / 1e9)


def _sdpa_setup(B, ctx, hq, hkv, d, device):
    q = torch.randn(B, hq, 1, d, dtype=torch.float16, device=device)
    k = torch.randn(B, hkv, ctx, d, dtype=torch.float16, device=device)
    v = torch.randn(B, hkv, ctx, d, dtype=torch.float16, device=device)
    return q, k, v


def _sdpa_fn(q, k, v, dry: bool):
    """(callable, backend name): flash with enable_gqa, else the default dispatcher with enable_gqa."""
    import torch.nn.functional as F

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover
        SDPBackend = sdpa_kernel = None
    tries = []
    if sdpa_kernel is not None and not dry:
        tries.append(("flash+enable_gqa", lambda: _with(sdpa_kernel(SDPBackend.FLASH_ATTENTION),
                                                         lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))))
        tries.append(("efficient+enable_gqa", lambda: _with(sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION),
                                                             lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))))
    tries.append(("default+enable_gqa", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)))
    for name, fn in tries:
        try:
            fn()
            return fn, name
        except Exception:
            continue
    raise RuntimeError("no SDPA backend ran")


def _with(ctx, fn):
    with ctx:
        return fn()


def _paged_setup(fmt_name, B, ctx, hq, hkv, d, bs, device):
    """A pool holding B sequences of ``ctx`` tokens (random codes / scales: timing only)."""
    fmt = get_format(fmt_name)
    blocks = B * math.ceil(ctx / bs)
    lay = PagedKVLayout(fmt, hkv, d, bs, blocks)
    pools = []
    for which in ("k", "v"):
        p = lay.allocate(which, device)
        if p.data.dtype == torch.float16:
            p.data.normal_()
        else:
            p.data.view(torch.uint8).random_(0, 255)
        if p.scale is not None:
            p.scale.uniform_(0.01, 0.02)
        if p.zero is not None:
            p.zero.uniform_(-0.1, 0.1)
        pools.append(p)
    bt = torch.randperm(blocks, device=device).to(torch.int32).view(B, -1).contiguous()
    cl = torch.full((B,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(B, hq, d, dtype=torch.float16, device=device)
    k_params = make_params(fmt, "k", torch.randn(4, hkv, d, device=device), hkv, d)
    v_params = make_params(fmt, "v", torch.randn(4, hkv, d, device=device), hkv, d)
    read = q.numel() * 2 + bt.numel() * 4 + cl.numel() * 4
    for p in pools:
        for t in (p.data, p.scale, p.zero):
            if t is not None:
                read += t.numel() * t.element_size()
    return fmt, pools, bt, cl, q, k_params, v_params, read


def prepared_decode(args: tuple, ctx: int, precision: str, partition_size: int = 512):
    """The two decode kernels of ``ops.launch_paged_decode`` with every tensor prepared once, so the
    timed call is only the launches (capturable in a CUDA graph: no allocation, no host copy)."""
    from trtkv.plugins import kernels as K
    from trtkv.plugins import ops

    (q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, bt, cl, k_fmt, v_fmt, k_static, k_smooth, v_static,
     v_smooth) = args
    kf, vf, t = ops._attn_common(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_fmt, v_fmt,
                                 k_static, k_smooth, v_static, v_smooth)
    B, heads, d = q.shape
    kvh, bs = k_data.shape[1], k_data.shape[2]
    cfg = K.decode_config(kf, vf, d, heads // kvh, partition_size, precision)
    grid_p, grid_r = K.decode_grids(B, kvh, ctx, partition_size)
    S = grid_p[2]
    part_m = torch.empty(B, heads, S, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(B, heads, S, d, device=q.device)
    out = torch.empty_like(q)
    qk = (1.0 / math.sqrt(d)) * K.LOG2E

    def run():
        K.paged_decode_partition_kernel[grid_p](
            q, t["k_data_ptr"], t["k_scale_ptr"], t["k_zero_ptr"], t["v_data_ptr"], t["v_scale_ptr"],
            t["v_zero_ptr"], t["k_static_ptr"], t["k_smooth_ptr"], t["had_ptr"], bt, cl, part_m, part_l, part_acc,
            qk, heads, kvh, bs, bt.shape[1], S, **cfg["partition"]["constexprs"],
            num_warps=cfg["partition"]["num_warps"])
        K.paged_decode_reduce_kernel[grid_r](
            part_m, part_l, part_acc, cl, t["v_static_ptr"], t["v_smooth_ptr"], t["had_ptr"], out, heads, kvh, S,
            **cfg["reduce"]["constexprs"], num_warps=cfg["reduce"]["num_warps"])
        return out

    return run


def decode_timing(log: Log, device, dry: bool, copy_bw: float, budget_s: float = 1e9) -> list[dict]:
    from trtkv.plugins import ops

    rows = []
    if dry:
        grid = [(64, 1), (128, 2)]
        hq, hkv, d, bs = 4, 2, 64, 16
    else:
        grid = [(c, b) for c in CONTEXTS for b in BATCHES]
        hq, hkv, d, bs = HEADS_Q, HEADS_KV, HEAD_DIM, BLOCK
    timer = _time_cpu if dry else _time_cuda
    t_start = time.time()
    for ctx, B in grid:
        if time.time() - t_start > budget_s:
            rows.append(dict(impl="*", ctx=ctx, batch=B, error="skipped: time budget"))
            log(_fmt_row(rows[-1]))
            continue
        base = None
        try:
            q, k, v = _sdpa_setup(B, ctx, hq, hkv, d, device)
            fn, backend = _sdpa_fn(q, k, v, dry)
            t = timer(fn)
            read = (q.numel() + k.numel() + v.numel()) * 2
            base = t
            rows.append(dict(impl="sdpa-fp16", backend=backend, ctx=ctx, batch=B, us=t * 1e6, bytes_read=read,
                             gbs=read / t / 1e9, bw_frac=read / t / copy_bw, speedup=1.0))
            del q, k, v, fn
        except Exception as exc:
            rows.append(dict(impl="sdpa-fp16", ctx=ctx, batch=B, error=f"{type(exc).__name__}: {exc}"[:300]))
        log(_fmt_row(rows[-1]))
        for fmt_name in TIMED_FORMATS:
            try:
                fmt, (kp, vp), bt, cl, q, kpar, vpar, read = _paged_setup(fmt_name, B, ctx, hq, hkv, d, bs, device)
                args = (q, kp.data, kp.scale, kp.zero, vp.data, vp.scale, vp.zero, bt, cl, fmt.k.short(),
                        fmt.v.short(), _p(kpar, "scale"), _p(kpar, "smooth"), _p(vpar, "scale"), _p(vpar, "smooth"))
                for prec in (("ieee",) if dry else ("tf32x3", "tf32")):
                    mode = "prepared"
                    try:
                        fn = prepared_decode(args, ctx, prec)
                        want = ops.launch_paged_decode(*args, max_context_len=ctx, precision=prec)
                        same = _err(fn(), want)
                        assert same < 1e-3, f"prepared decode differs from ops.launch_paged_decode: {same}"
                        t = timer(fn)
                    except Exception as exc:  # kernels changed under this script: time the stable op API
                        log(f"prepared decode unavailable ({type(exc).__name__}: {str(exc)[:200]}); timing "
                            "ops.launch_paged_decode eagerly (includes Python launch overhead)")
                        mode = "ops-eager"
                        fn = (lambda prec=prec: ops.launch_paged_decode(*args, max_context_len=ctx, precision=prec))
                        t = timer(fn) if dry else _time_cuda(fn, use_graph=False)
                    rows.append(dict(impl=f"paged-{fmt_name}", precision=prec, mode=mode, ctx=ctx, batch=B,
                                     us=t * 1e6, bytes_read=read, gbs=read / t / 1e9, bw_frac=read / t / copy_bw,
                                     speedup=(base / t) if base else None))
                    log(_fmt_row(rows[-1]))
                del kp, vp, fn
            except Exception as exc:
                rows.append(dict(impl=f"paged-{fmt_name}", ctx=ctx, batch=B, error=f"{type(exc).__name__}: {exc}"[:300]))
                log(_fmt_row(rows[-1]))
        if not dry:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return rows


def _fmt_row(r: dict) -> str:
    if "error" in r:
        return f"timing {r['impl']} ctx={r['ctx']} B={r['batch']}: ERROR {r['error']}"
    sp = f" speedup {r['speedup']:.2f}x" if r.get("speedup") else ""
    extra = f" [{r.get('backend') or r.get('precision')}]"
    return (f"timing {r['impl']}{extra} ctx={r['ctx']} B={r['batch']}: {r['us']:.1f} us, "
            f"{r['gbs']:.0f} GB/s ({100 * r['bw_frac']:.0f}% of copy){sp}")


def evaluate_targets(timing: list[dict], dry: bool) -> list[dict]:
    ctx, B = (128, 2) if dry else (32768, 8)

    def best(impl):
        rs = [r for r in timing if r.get("impl") == impl and r["ctx"] == ctx and r["batch"] == B and "us" in r]
        return min(rs, key=lambda r: r["us"]) if rs else None

    out = []
    i4, i8 = best("paged-int4"), best("paged-int8")
    if dry:  # CPU interpreter timings say nothing about the GPU targets
        return [dict(target="(dry run: targets are evaluated on a GPU only)", want=None, got=None, ok=None)]
    out.append(dict(target=f"int4 speedup vs fp16 SDPA at ctx {ctx}, batch {B}", want=TARGETS["int4_speedup"],
                    got=i4 and i4["speedup"], ok=bool(i4 and i4["speedup"] and i4["speedup"] >= TARGETS["int4_speedup"])))
    out.append(dict(target=f"int4 fraction of copy bandwidth at ctx {ctx}, batch {B}", want=TARGETS["int4_bw_frac"],
                    got=i4 and i4["bw_frac"], ok=bool(i4 and i4["bw_frac"] >= TARGETS["int4_bw_frac"])))
    out.append(dict(target=f"int8 speedup vs fp16 SDPA at ctx {ctx}, batch {B}", want=TARGETS["int8_speedup"],
                    got=i8 and i8["speedup"], ok=bool(i8 and i8["speedup"] and i8["speedup"] >= TARGETS["int8_speedup"])))
    return out


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------


def write_report(out_dir: Path, result: dict) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = re.sub(r"[^A-Za-z0-9]+", "-", result["env"].get("device", "unknown")).strip("-").lower()
    stem = f"gpu-check-{result['date'][:10]}-{dev}" + ("-dry-run" if result["dry_run"] else "")
    jp, mp = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    jp.write_text(json.dumps(result, indent=1, default=str))
    L = [f"# trtkv GPU check{' (dry run: CPU, Triton interpreter, tiny sizes)' if result['dry_run'] else ''}", "",
         f"- date: {result['date']}", *(f"- {k}: {v}" for k, v in result["env"].items()),
         f"- geometry (timing): {result['geometry']}", f"- wall time: {result['seconds']:.0f} s", ""]
    L += ["## Correctness (kernel vs torch reference)", "", "| kernel | case | metric | ok |", "|---|---|---|---|"]
    for r in result["correctness"]:
        metric = r.get("error") or ", ".join(f"{k}={v:.2e}" for k, v in r.items()
                                             if isinstance(v, float))
        L.append(f"| {r['kernel']} | {r['case']} | {metric} | {r['ok']} |")
    L += ["", "## TensorRT ABI (PTX reordered for TensorRT, launched via the driver in TensorRT's order)", "",
          "| op | format | kernel | warps | smem | status | ok |", "|---|---|---|---|---|---|---|"]
    for r in result["trt_abi"]:
        status = r.get("status", "") + (f" rel_err={r['rel_err']:.1e}" if "rel_err" in r else "")
        L.append(f"| {r['op']} | {r['fmt']} | {r.get('kernel', '')} | {r.get('num_warps', '')} | "
                 f"{r.get('shared', '')} | {status or r.get('error', '')} | {r['ok']} |")
    cb = result["copy"]
    L += ["", f"## Bandwidth reference: device copy {cb['bandwidth_gbs']:.0f} GB/s", "",
          "## Decode attention timing", "",
          "| impl | prec/backend | ctx | batch | us | GB/s | % copy | speedup vs SDPA |", "|---|---|---|---|---|---|---|---|"]
    for r in result["timing"]:
        if "error" in r:
            L.append(f"| {r['impl']} | | {r['ctx']} | {r['batch']} | ERROR {r['error']} | | | |")
            continue
        sp = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        how = (r.get("precision") or r.get("backend") or "") + (" (eager op)" if r.get("mode") == "ops-eager" else "")
        L.append(f"| {r['impl']} | {how} | {r['ctx']} | {r['batch']} | "
                 f"{r['us']:.1f} | {r['gbs']:.0f} | {100 * r['bw_frac']:.0f}% | {sp} |")
    L += ["", "## Targets", "", "| target | want | got | ok |", "|---|---|---|---|"]
    for t in result["targets"]:
        got = f"{t['got']:.2f}" if isinstance(t["got"], float) else str(t["got"])
        L.append(f"| {t['target']} | {t['want']} | {got} | {t['ok']} |")
    mp.write_text("\n".join(L) + "\n")
    return jp, mp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter at tiny sizes")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="output directory")
    ap.add_argument("--skip", nargs="*", default=[], choices=["correctness", "abi", "timing"])
    ap.add_argument("--abi-json", help=argparse.SUPPRESS)  # internal: the dry run's compile-only child
    args = ap.parse_args(argv)
    log = Log()
    if args.abi_json:
        rows = check_trt_abi(log, "cpu", True)
        Path(args.abi_json).write_text(json.dumps(rows, default=str))
        return 0
    if args.dry_run:
        device = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run, or on a GPU machine", file=sys.stderr)
        return 2
    else:
        device = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = False
    env = versions()
    log(f"env: {env}")
    t0 = time.time()
    result = dict(date=_dt.datetime.now().isoformat(timespec="seconds"), dry_run=args.dry_run, env=env,
                  geometry=("heads 4 q / 2 kv, head_dim 64, block 16" if args.dry_run else
                            f"heads {HEADS_Q} q / {HEADS_KV} kv, head_dim {HEAD_DIM}, block {BLOCK}, fp16 queries"))
    # budgets keep a GPU run under ~8 minutes even when compiles are slow
    result["correctness"] = [] if "correctness" in args.skip else check_correctness(log, device, args.dry_run, 150)
    result["trt_abi"] = [] if "abi" in args.skip else check_trt_abi(log, device, args.dry_run)
    result["copy"] = copy_bandwidth(log, device, args.dry_run)
    result["timing"] = [] if "timing" in args.skip else decode_timing(log, device, args.dry_run,
                                                                       result["copy"]["bandwidth_gbs"] * 1e9, 150)
    result["targets"] = evaluate_targets(result["timing"], args.dry_run)
    result["seconds"] = time.time() - t0
    jp, mp = write_report(Path(args.out), result)
    for t in result["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["ok"]]
        log(f"target {t['target']}: want {t['want']}, got {t['got']}: {verdict}")
    failed = [r for r in result["correctness"] + result["trt_abi"] if r["ok"] is False]
    log(f"wrote {mp} and {jp}; correctness/abi failures: {len(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
