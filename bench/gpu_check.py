"""One-shot GPU check of the trtkv kernels: correctness, TensorRT-ABI launches, decode timing vs SDPA.

    python bench/gpu_check.py --out $OUT         # on a CUDA GPU (written for one H200, < 8 minutes)
    python bench/gpu_check.py --dry-run          # CPU, Triton interpreter, tiny sizes (< 1 minute)

Sections
1. correctness: every kernel (quantize-append, split-K decode, prefill) for each KV preset, CUDA vs the
   torch reference (``trtkv.plugins.reference``: write_paged / gather_paged, float64 attention). Decode
   and prefill run twice: over the pool holding every position (the torch runtime's path) and over a
   pool whose step slots hold stale rows, with this step's rows passed beside it (``NEW_ROWS``: the
   pure-engine path of the TensorRT plugins).
2. TensorRT ABI: all four plugin ops compiled the way ``trtkv.plugins.trt_plugins`` compiles them for
   TensorRT (attribute constexprs, ``NEW_ROWS=True``, PTX parameters reordered to inputs / int32 scalars
   / outputs, Triton's hidden scratch parameters dropped) and launched through the CUDA driver API
   (cuModuleLoadData / cuLaunchKernel, raising the function's dynamic shared memory limit above 48 KiB)
   in exactly that order with the contract's grid -- what a TensorRT AOT plugin does -- compared with the
   regular Triton launch. The dry run compiles the same PTX and replaces the driver launch with a
   TensorRT-order launch on the interpreter.
3. bandwidth: device-to-device copy of a large tensor (read + write bytes / time): the reference rate.
4. decode timing: heads 32 query / 8 KV, head_dim 128, block 16, contexts 4k / 32k / 128k, batch 1
   and 8: the fp16 baseline is torch ``scaled_dot_product_attention`` (flash backend, ``enable_gqa``) on a
   contiguous fp16 cache; ours is the engine's decode step: paged fp16 / int8 / int4 pools holding
   ``ctx - 1`` tokens plus one new row per sequence read beside them (``NEW_ROWS``). Each timing is the
   median over repeats of CUDA-graph replays (no launch overhead) between CUDA events, after warmup.
   Achieved bandwidth counts the bytes read: codes + scales (+ zero-points) + new rows + query + block table.
5. targets: int4 >= 2.5x faster than fp16 SDPA at 32k batch 8 and >= 70% of copy bandwidth;
   int8 >= 1.6x.

Writes ``<out>/gpu-check-<date>-<device>.md`` and ``.json`` (default out: bench/results) with the date,
device, driver, torch / triton / CUDA versions; both are rewritten after each section, so a run cut
short still leaves its results (marked incomplete). Section time budgets: ``BUDGETS_S``.
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
from trtkv.formats import get_format  # noqa: E402
from trtkv.quant import TensorParams, forward_transform  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM, BLOCK = 32, 8, 128, 16
CONTEXTS = (4096, 32768, 131072)
BATCHES = (1, 8)
TIMED_FORMATS = ("fp16", "int8", "int4")
CHECK_FORMATS = ("int4", "int8", "fp16", "int8-static", "fp8", "int4-g32")  # most important first (time budget)
DRY_FORMATS = ("fp16", "int8", "int4")  # the dry run's correctness formats
TARGETS = {"int4_speedup": 2.5, "int4_bw_frac": 0.70, "int8_speedup": 1.6}
BUDGETS_S = {"correctness": 120, "abi": 100, "timing": 150}  # per section, GPU run (see main)


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
    """A paged cache of ``ctx_lens[b]`` tokens per sequence whose last ``new[b]`` are this step's (prefill).

    ``pools()`` are empty pools; ``write(...)`` fills them with the append kernel. For the pure-engine
    contract, ``stale(pool, which, mask)`` is a copy whose slots of the masked positions hold other rows
    (as before the runtime writes the step's rows) and ``new_rows(which, mask)`` are the masked
    positions' rows in pool-row form, quantized by the append kernel (what PagedKVAppend returns).
    Masks: ``is_new`` (prefill: the last ``new[b]`` positions), ``is_last`` (decode: the last position)."""

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
        self.is_last = torch.zeros(total, dtype=torch.bool)
        for b, c in enumerate(ctx_lens):
            self.is_new[starts[b] + c - new[b]:starts[b] + c] = True
            self.is_last[starts[b] + c - 1] = c > 0
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

    def spec(self, which: str) -> str:
        return (self.fmt.k if which == "k" else self.fmt.v).short()

    def rows(self, which: str) -> torch.Tensor:
        return self.k_rows if which == "k" else self.v_rows

    def params(self, which: str) -> TensorParams | None:
        return self.k_params if which == "k" else self.v_params

    def write(self, which: str, pool: KVPool, rows: torch.Tensor, slots: torch.Tensor) -> None:
        from trtkv.plugins import ops

        prm = self.params(which)
        ops.launch_quantize_append(rows, slots, pool.data, pool.scale, pool.zero, self.spec(which),
                                   _p(prm, "scale"), _p(prm, "smooth"), _p(prm, "clip"))

    def stale(self, pool: KVPool, which: str, mask: torch.Tensor) -> KVPool:
        out = KVPool(pool.data.clone(), _clone(pool.scale), _clone(pool.zero))
        m = mask.to(self.slots.device)
        self.write(which, out, self.rows(which)[m] * 30, self.slots[m])  # other rows: garbage at those slots
        return out

    def new_rows(self, which: str, mask: torch.Tensor) -> tuple:
        """(data, scale, zero) ``[n, kv_heads, ...]``: the append kernel on a pool of one-token blocks."""
        n = int(mask.sum())
        pool = PagedKVLayout(self.fmt, self.hkv, self.d, 1, max(n, 1)).allocate(which, self.device)
        self.write(which, pool, self.rows(which)[mask.to(self.slots.device)],
                   torch.arange(n, dtype=torch.int32, device=self.device))
        sq = lambda t: None if t is None else t.reshape(t.shape[0], t.shape[1], t.shape[3])  # noqa: E731
        return sq(pool.data), sq(pool.scale), sq(pool.zero)

    def new_kwargs(self, mask: torch.Tensor) -> dict:
        """``k_new_data=..., v_new_zero=...`` for the ops launchers."""
        kn, vn = self.new_rows("k", mask), self.new_rows("v", mask)
        names = ("k_new_data", "k_new_scale", "k_new_zero", "v_new_data", "v_new_scale", "v_new_zero")
        return dict(zip(names, kn + vn))

    def attn_args(self, kp: KVPool, vp: KVPool) -> tuple:
        """The pool / table / format / constant arguments of ops.launch_paged_decode / _prefill."""
        return (kp.data, kp.scale, kp.zero, vp.data, vp.scale, vp.zero, self.block_table, self.context_lens,
                self.spec("k"), self.spec("v"), _p(self.k_params, "scale"), _p(self.k_params, "smooth"),
                _p(self.v_params, "scale"), _p(self.v_params, "smooth"))

    def reference(self, q, cu, kp: KVPool, vp: KVPool, new: dict | None = None) -> torch.Tensor:
        """float64 attention over the pools (with ``new`` rows: over the pools after their write)."""
        from trtkv.plugins import reference as ref

        k_cpu, v_cpu = _cpu_pool(kp), _cpu_pool(vp)
        bt, cl, cu_c = _cpu(self.block_table), _cpu(self.context_lens), _cpu(cu)
        if new is not None:
            n = {k: _cpu(v) for k, v in new.items()}
            k_cpu = ref.pool_with_new_rows(k_cpu, KVPool(n["k_new_data"], n["k_new_scale"], n["k_new_zero"]), bt, cl,
                                           cu_c)
            v_cpu = ref.pool_with_new_rows(v_cpu, KVPool(n["v_new_data"], n["v_new_scale"], n["v_new_zero"]), bt, cl,
                                           cu_c)
        return ref.paged_attention_ref(_cpu(q), cu_c, k_cpu, v_cpu, bt, cl, self.spec("k"), self.spec("v"),
                                       _cpu_params(self.k_params), _cpu_params(self.v_params))


def _clone(t):
    return None if t is None else t.clone()


def _cpu_pool(p: KVPool) -> KVPool:
    return KVPool(_cpu(p.data), _cpu(p.scale), _cpu(p.zero))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


# ------------------------------------------------------------------------------------------------
# 1. correctness
# ------------------------------------------------------------------------------------------------


def check_correctness(log: Log, device, dry: bool, budget_s: float = 1e9) -> list[dict]:
    """Kernels vs the torch reference: append (bit-exact codes / scales), decode and prefill over the pool
    (the torch runtime's path: the pool already holds the step's rows) and over a stale pool plus this
    step's new rows (the pure-engine path of the TensorRT plugins, ``NEW_ROWS``)."""
    from trtkv.plugins import ops
    from trtkv.plugins import reference as ref

    rows = []
    if dry:
        shapes = [dict(ctx=[37, 20], new=[3, 1], hq=4, hkv=2, d=64, bs=16)]
        formats = DRY_FORMATS
    else:
        shapes = [dict(ctx=[1, 300, 77, 1024], new=[1, 5, 77, 16], hq=32, hkv=8, d=128, bs=16),
                  dict(ctx=[513, 45], new=[1, 45], hq=8, hkv=8, d=64, bs=32)]
        formats = CHECK_FORMATS
    t_start = time.time()
    # the timing geometry for every format first, then the second shape (the budget may cut it short)
    for sh in shapes:
        for fmt_name in formats:
            tag = f"{fmt_name} d{sh['d']} hq{sh['hq']}/{sh['hkv']} ctx{sh['ctx']}"
            if time.time() - t_start > budget_s:
                rows.append(dict(kernel="*", case=tag, ok=None, error="skipped: time budget"))
                log(f"correctness {tag}: skipped (time budget)")
                continue
            try:
                c = Case(fmt_name, sh["ctx"], sh["new"], sh["hq"], sh["hkv"], sh["d"], sh["bs"], device)
                kp, vp = c.pools()
                # append: kernel vs reference write (bit-exact codes / scales expected)
                for which, pool in (("k", kp), ("v", vp)):
                    prm = c.params(which)
                    c.write(which, pool, c.rows(which), c.slots)
                    rpool = c.layout.allocate(which, "cpu")
                    ref.quantize_append_ref(_cpu(c.rows(which)), _cpu(c.slots), rpool.data, rpool.scale, rpool.zero,
                                            c.spec(which), _cpu(_p(prm, "scale")), _cpu(_p(prm, "smooth")),
                                            _cpu(_p(prm, "clip")))
                    got = pool.data.cpu()
                    mism = float((got.view(torch.uint8) != rpool.data.view(torch.uint8)).float().mean()) \
                        if got.dtype != torch.float16 else float((got != rpool.data).float().mean())
                    smis = 0.0
                    if rpool.scale is not None:  # fraction of scales not bit-equal (fp32 sum-order ties)
                        smis = float((pool.scale.cpu() != rpool.scale).float().mean())
                    ok = mism <= 1e-3 and smis <= 1e-3
                    rows.append(dict(kernel="quantize_append", case=f"{tag} {which}", code_mismatch=mism,
                                     scale_mismatch=smis, ok=ok))
                # decode / prefill over the full pool (torch runtime: the pool holds the step's rows)
                args = c.attn_args(kp, vp)
                r = c.reference(c.q_dec, None, kp, vp)
                psize = 64 if dry else 512  # the ops default (several partitions at ctx 1024)
                e = _err(ops.launch_paged_decode(c.q_dec, *args, partition_size=psize), r)
                rows.append(dict(kernel="paged_decode", case=f"{tag} part{psize}", rel_err=e, ok=e < 2e-2))
                r = c.reference(c.q_pre, c.cu, kp, vp)
                e = _err(ops.launch_paged_prefill(c.q_pre, c.cu, *args), r)
                rows.append(dict(kernel="paged_prefill", case=tag, rel_err=e, ok=e < 2e-2))
                # pure engine: the step's slots hold stale rows, the new rows come beside the pool
                for kernel, mask, q, cu in (("paged_decode", c.is_last, c.q_dec, None),
                                            ("paged_prefill", c.is_new, c.q_pre, c.cu)):
                    ks, vs = c.stale(kp, "k", mask), c.stale(vp, "v", mask)
                    new = c.new_kwargs(mask)
                    if cu is None:  # partition 64: many partitions; the ABI check's regular launch reuses it
                        out = ops.launch_paged_decode(q, *c.attn_args(ks, vs), partition_size=64, **new)
                    else:
                        out = ops.launch_paged_prefill(q, cu, *c.attn_args(ks, vs), **new)
                    e = _err(out, c.reference(q, cu, ks, vs, new))
                    rows.append(dict(kernel=f"{kernel} (new rows)", case=f"{tag}{' part64' if cu is None else ''}",
                                     rel_err=e, ok=e < 2e-2))
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


def _cu_error_name(rc: int) -> str:
    name = ctypes.c_char_p()
    _libcuda().cuGetErrorName(rc, ctypes.byref(name))
    return name.value.decode() if name.value else str(rc)


CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # cuda.h, CUfunction_attribute


class DriverKernel:
    """A PTX kernel loaded with cuModuleLoadData and launched with cuLaunchKernel, like TensorRT does.

    Dynamic shared memory above 48 KiB needs the function's MAX_DYNAMIC_SHARED_SIZE_BYTES raised first
    (cuFuncSetAttribute), as Triton's own launcher does. If the driver cannot JIT the PTX (its PTX ISA is
    newer than the driver: CUDA_ERROR_UNSUPPORTED_PTX_VERSION), the same reordered PTX is assembled with
    Triton's bundled ptxas and loaded as a cubin; ``loaded_as`` says which (a TensorRT engine holding the
    PTX would need a driver that accepts it)."""

    def __init__(self, ptx: str, name: str, shared: int, arch: int | None = None):
        cu = _libcuda()
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # make the primary context current on this thread
        self.module = ctypes.c_void_p()
        self.loaded_as = "ptx"
        rc = cu.cuModuleLoadData(ctypes.byref(self.module), ctypes.c_char_p(ptx.encode() + b"\0"))
        if rc != 0:
            err = _cu_error_name(rc)
            version = re.search(r"^\.version\s+([\d.]+)", ptx, re.M)
            image = _assemble_cubin(ptx, arch)  # raises if ptxas fails too
            self.module = ctypes.c_void_p()
            _cu_check(cu.cuModuleLoadData(ctypes.byref(self.module), ctypes.c_char_p(image)), "cuModuleLoadData(cubin)")
            self.loaded_as = f"cubin (driver rejected PTX ISA {version.group(1) if version else '?'}: {err})"
        self.fn = ctypes.c_void_p()
        _cu_check(cu.cuModuleGetFunction(ctypes.byref(self.fn), self.module, name.encode()), "cuModuleGetFunction")
        if shared > 48 * 1024:
            _cu_check(cu.cuFuncSetAttribute(self.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                            ctypes.c_int(shared)), "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
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


_TORCH_DT = {"float16": torch.float16, "float32": torch.float32, "int8": torch.int8, "uint8": torch.uint8,
             "int32": torch.int32}


def _assemble_cubin(ptx: str, arch: int | None) -> bytes:
    """The PTX assembled by Triton's bundled ptxas for its own ``.target``."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    target = re.search(r"^\.target\s+(\w+)", ptx, re.M)
    gpu = target.group(1) if target else f"sm_{arch or 90}"
    arch = arch or int(re.sub(r"\D", "", gpu))
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        subprocess.run([get_ptxas(arch).path, f"--gpu-name={gpu}", str(src), "-o", str(dst)], check=True,
                       capture_output=True, text=True)
        return dst.read_bytes()


def _contract_inputs(op, attrs, tensors: dict, device):
    """Tensors in contract order, placeholders (zeros, the declared rank) for unused ones."""
    from trtkv.plugins import contract as C

    out = []
    for t, d in zip(op.inputs, C.input_dtypes(op, attrs)):
        x = tensors.get(t.name) if t.used(attrs) else None
        if x is None:
            x = torch.zeros(C.placeholder_shape(t), dtype=_TORCH_DT[d], device=device)
        assert x.dtype == _TORCH_DT[d] and x.dim() == t.rank, (t.name, x.dtype, tuple(x.shape), d)
        out.append(x.contiguous())
    return out


ABI_FORMATS = ("int4", "int8-static", "fp8", "int8", "fp16", "int4-g32")  # coverage first (time budget)
DRY_ABI_FORMATS = ("int8", "int4")
ABI_OPS = ("PagedKVAppend", "PagedDecodePartition", "PagedDecodeReduce", "PagedPrefillAttention")


def _abi_attrs(op_name: str, fmt_name: str, dry: bool):
    """The op instance the ABI check compiles. Prefill uses ``tf32`` dots (ops.PREFILL_PRECISION), whose
    head_dim-128 tiles need > 48 KiB of dynamic shared memory: the driver launch must opt in."""
    from trtkv.plugins import contract as C

    hq, hkv, d = (4, 2, 64) if dry else (32, 8, 128)
    prec = "tf32" if op_name == "PagedPrefillAttention" else "tf32x3"
    return C.attrs_for(op_name, get_format(fmt_name), num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=16,
                       partition_size=64, precision=prec)


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


class _AbiData:
    """One format's data for the ABI checks: a case, its pools with stale step slots, the new rows."""

    def __init__(self, fmt_name: str, device, dry: bool):
        hq, hkv, d = (4, 2, 64) if dry else (32, 8, 128)
        ctx, new = ([37, 20], [3, 20]) if dry else ([700, 130, 1], [16, 130, 1])
        c = self.c = Case(fmt_name, ctx, new, hq, hkv, d, 16, device, seed=5)
        kp, vp = c.pools()
        c.write("k", kp, c.k_rows, c.slots)
        c.write("v", vp, c.v_rows, c.slots)
        self.dec = (c.stale(kp, "k", c.is_last), c.stale(vp, "v", c.is_last), c.new_kwargs(c.is_last))
        self.pre = (c.stale(kp, "k", c.is_new), c.stale(vp, "v", c.is_new), c.new_kwargs(c.is_new))

    def attention_tensors(self, which: str) -> dict:
        """Contract tensors of PagedDecodePartition ('dec') / PagedPrefillAttention ('pre')."""
        from trtkv.quant import hadamard_matrix

        c = self.c
        kp, vp, new = self.dec if which == "dec" else self.pre
        t = dict(q=c.q_dec if which == "dec" else c.q_pre, cu_seqlens=c.cu, block_tables=c.block_table,
                 context_lens=c.context_lens, hadamard=hadamard_matrix(c.d, torch.float32, c.device),
                 k_static=_static_hd(c.k_params, c.hkv, c.d, c.device), k_smooth=_p(c.k_params, "smooth"),
                 v_static=_static_hd(c.v_params, c.hkv, c.d, c.device), v_smooth=_p(c.v_params, "smooth"))
        for w, pool in (("k", kp), ("v", vp)):
            t.update({f"{w}_data": pool.data, f"{w}_scale": pool.scale, f"{w}_zero": pool.zero})
        t.update(new)
        return t


def _abi_case(op_name: str, attrs, data: _AbiData, launch, constexprs: dict, num_warps: int, shared: int,
              device) -> dict:
    """Launch one op in TensorRT's argument order (``launch(grid, block, args)``) and compare with the
    regular Triton launch of the same computation. Returns ok / rel_err / status."""
    from trtkv.plugins import contract as C
    from trtkv.plugins import ops

    op = C.get_op(op_name)
    c = data.c

    def run(tensors: dict):
        ins = _contract_inputs(op, attrs, tensors, device)
        shapes = [tuple(x.shape) for x in ins]
        outs = [torch.full(sh, 7, device=device).to(_TORCH_DT[dt])  # not zeros: unwritten outputs show
                for sh, dt in zip(C.output_shapes(op, attrs, shapes), C.output_dtypes(op, attrs))]
        L = C.launch(op, attrs, shapes, constexprs, num_warps, shared)
        launch(L.grid, L.block, [*ins, *L.scalars, *outs])
        return outs

    if op_name == "PagedKVAppend":
        which = "k"
        rows_t = c.rows(which)
        prm = c.params(which)
        dest = torch.arange(rows_t.shape[0], dtype=torch.int32, device=device)
        codes, scale, zero = run(dict(rows=rows_t, dest=dest, static_scale=_static_hd(prm, c.hkv, c.d, device),
                                      smooth=_p(prm, "smooth"), clip=torch.ones(c.hkv, device=device),
                                      hadamard=_hadamard(c.d, device)))
        want = c.new_rows(which, torch.ones(rows_t.shape[0], dtype=torch.bool))  # regular launch, same rows
        ok = torch.equal(codes, want[0]) and (want[1] is None or torch.equal(scale, want[1])) \
            and (want[2] is None or torch.equal(zero, want[2]))
        return dict(ok=bool(ok), status="TensorRT-order launch == regular launch (bit-exact)" if ok else "MISMATCH")
    if op_name in ("PagedDecodePartition", "PagedDecodeReduce"):
        kp, vp, new = data.dec
        prec = attrs.get("precision", "tf32x3")  # the reduce has no dots
        prep = PreparedDecode(c.q_dec, c.attn_args(kp, vp), new, c.max_blocks * c.bs, prec, attrs["partition_size"])
        want = prep().clone()  # the regular partition + reduce launches
        if op_name == "PagedDecodePartition":
            part = run(data.attention_tensors("dec"))
            for dst, src in zip((prep.part_m, prep.part_l, prep.part_acc), part):
                assert dst.shape == src.shape, (dst.shape, src.shape)
                dst.copy_(src)
            got = prep.reduce().clone()  # the regular reduce over the TensorRT-order partials
        else:
            prep.partition()
            t = dict(part_m=prep.part_m, part_l=prep.part_l, part_acc=prep.part_acc, context_lens=c.context_lens,
                     v_static=_static_hd(c.v_params, c.hkv, c.d, device), v_smooth=_p(c.v_params, "smooth"),
                     hadamard=_hadamard(c.d, device))
            (got,) = run(t)
        e = _err(got, want)
        return dict(ok=e < 1e-3, rel_err=e, status="TensorRT-order launch vs regular decode (new rows)")
    if op_name == "PagedPrefillAttention":
        kp, vp, new = data.pre
        want = ops.launch_paged_prefill(c.q_pre, c.cu, *c.attn_args(kp, vp), precision=attrs["precision"], **new)
        (got,) = run(data.attention_tensors("pre"))
        e = _err(got, want)
        return dict(ok=e < 1e-3, rel_err=e, status="TensorRT-order launch vs regular prefill (new rows)")
    raise AssertionError(op_name)


def check_trt_abi(log: Log, device, dry: bool, budget_s: float = 1e9) -> list[dict]:
    """Every op compiled like trt_plugins.compile_kernel (PTX reordered to TensorRT's ABI) and launched in
    TensorRT's argument order with the contract's grid: on a GPU the PTX through the CUDA driver (what a
    TensorRT AOT plugin does); in the dry run a stand-in launch on the Triton interpreter. Compared with
    the regular Triton launch of the same computation (attention: stale pool + this step's new rows).

    The dry run compiles in a child process: triton cannot compile kernels in a process that imported
    it with TRITON_INTERPRET=1 (its own library functions are interpreter objects there)."""
    from trtkv.plugins import contract as C
    from trtkv.plugins import trt_plugins as T

    formats = DRY_ABI_FORMATS if dry else ABI_FORMATS
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
            compiled = {(r["op"], r["fmt"]): r for r in json.loads(path.read_text())}
    else:
        compiled = None  # compile here
    rows = []
    t_start = time.time()
    for fmt_name in formats:
        if time.time() - t_start > budget_s:
            for op_name in ABI_OPS:
                rows.append(dict(op=op_name, fmt=fmt_name, ok=None, status="skipped: time budget"))
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
                        _assemble_cubin(k.ptx, k.arch)  # the reordered PTX is still valid PTX
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
                    data = _AbiData(fmt_name, device, dry)
                res = _abi_case(op_name, a, data, launch, cexpr, warps, shared, device)
                row.update(res, status=how + res["status"])
            except Exception as exc:
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
                log(traceback.format_exc(limit=4))
            rows.append(row)
            log(f"trt-abi {op_name} {fmt_name}: {row.get('status', row.get('error'))}"
                + (f" rel_err={row['rel_err']:.1e}" if "rel_err" in row else ""))
    return rows


def _static_hd(p: TensorParams | None, hkv: int, d: int, device):
    if p is None or p.scale is None:
        return None
    s = p.scale.float().to(device)
    return s.expand(hkv, d).contiguous() if s.dim() == 0 else s.reshape(hkv, -1).expand(hkv, d).contiguous()


def _hadamard(d: int, device):
    from trtkv.quant import hadamard_matrix

    return hadamard_matrix(d, torch.float32, device)


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
    """A pool holding B sequences of ``ctx - 1`` tokens plus this step's one new row per sequence in
    pool-row form (the pure-engine decode step a TensorRT engine runs). Random codes / scales: timing only."""
    fmt = get_format(fmt_name)
    blocks = B * math.ceil(ctx / bs)
    lay = PagedKVLayout(fmt, hkv, d, bs, blocks)
    one = PagedKVLayout(fmt, hkv, d, 1, B)  # B one-token blocks: [B, kv_heads, 1, ...] = new rows
    pools, new = [], {}
    for which in ("k", "v"):
        for layout, keep in ((lay, True), (one, False)):
            p = layout.allocate(which, device)
            if p.data.dtype == torch.float16:
                p.data.normal_()
            else:
                p.data.view(torch.uint8).random_(0, 255)
            if p.scale is not None:
                p.scale.uniform_(0.01, 0.02)
            if p.zero is not None:
                p.zero.uniform_(-0.1, 0.1)
            if keep:
                pools.append(p)
            else:
                sq = lambda t: None if t is None else t.reshape(B, hkv, t.shape[3])  # noqa: E731
                new.update({f"{which}_new_data": sq(p.data), f"{which}_new_scale": sq(p.scale),
                            f"{which}_new_zero": sq(p.zero)})
    bt = torch.randperm(blocks, device=device).to(torch.int32).view(B, -1).contiguous()
    cl = torch.full((B,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(B, hq, d, dtype=torch.float16, device=device)
    k_params = make_params(fmt, "k", torch.randn(4, hkv, d, device=device), hkv, d)
    v_params = make_params(fmt, "v", torch.randn(4, hkv, d, device=device), hkv, d)
    read = q.numel() * 2 + bt.numel() * 4 + cl.numel() * 4
    for p in pools:  # all ctx slots (the newest slot is not read: a small overcount, 1 / ctx)
        for t in (p.data, p.scale, p.zero):
            if t is not None:
                read += t.numel() * t.element_size()
    read += sum(t.numel() * t.element_size() for t in new.values() if t is not None)
    return fmt, pools, new, bt, cl, q, k_params, v_params, read


class PreparedDecode:
    """The two decode launches of ``ops.launch_paged_decode`` with every tensor prepared once, so a call is
    only the launches (capturable in a CUDA graph: no allocation, no host copy). Kernel arguments are
    passed by parameter name, so a reordered kernel signature cannot shift them.

    ``args``: ops.launch_paged_decode's arguments after q up to v_smooth (pools, block table, context
    lengths, formats, constants); ``new``: ``k_new_data=..`` this step's rows (NEW_ROWS) or None (the pool
    holds every position)."""

    def __init__(self, q, args: tuple, new: dict | None, max_context_len: int, precision: str,
                 partition_size: int = 512, interpret: bool | None = None):
        from trtkv.plugins import kernels as K
        from trtkv.plugins import ops

        (k_data, k_scale, k_zero, v_data, v_scale, v_zero, bt, cl, k_fmt, v_fmt, k_static, k_smooth, v_static,
         v_smooth) = args
        interpret = (not q.is_cuda) if interpret is None else interpret
        kf, vf, t = ops._attn_common(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_fmt, v_fmt,
                                     k_static, k_smooth, v_static, v_smooth)
        B, heads, d = q.shape
        kvh, bs = k_data.shape[1], k_data.shape[2]
        names = ("k_new_data", "k_new_scale", "k_new_zero", "v_new_data", "v_new_scale", "v_new_zero")
        self.new_rows = ops._new_rows(t, kf, vf, B, kvh, d, tuple((new or {}).get(n) for n in names))
        cfg = K.decode_config(kf, vf, d, heads // kvh, partition_size, precision, interpret=interpret,
                              new_rows=self.new_rows)
        self.grid_p, self.grid_r = K.decode_grids(B, kvh, max_context_len, partition_size)
        S = self.grid_p[2]
        self.part_m = torch.empty(B, heads, S, device=q.device)
        self.part_l = torch.empty_like(self.part_m)
        self.part_acc = torch.empty(B, heads, S, d, device=q.device)
        self.out = torch.empty_like(q)
        kmod = K.load_kernels(interpret)
        self._part, self._red = kmod.paged_decode_partition_kernel, kmod.paged_decode_reduce_kernel
        bt, cl = bt.to(torch.int32).contiguous(), cl.to(torch.int32).contiguous()
        common = dict(block_table_ptr=bt, context_lens_ptr=cl, q_ptr=q.contiguous(), part_m_ptr=self.part_m,
                      part_l_ptr=self.part_l, part_acc_ptr=self.part_acc, out_ptr=self.out,
                      qk_scale=(1.0 / math.sqrt(d)) * K.LOG2E, num_heads=heads, num_kv_heads=kvh, block_size=bs,
                      max_blocks=bt.shape[1], num_partitions=S, **t)
        self._p_args = {n: common[n] for n in self._part.arg_names if n in common}
        self._p_args.update(cfg["partition"]["constexprs"], num_warps=cfg["partition"]["num_warps"])
        self._r_args = {n: common[n] for n in self._red.arg_names if n in common}
        self._r_args.update(cfg["reduce"]["constexprs"], num_warps=cfg["reduce"]["num_warps"])

    def partition(self):
        self._part[self.grid_p](**self._p_args)
        return self.part_m, self.part_l, self.part_acc

    def reduce(self):
        self._red[self.grid_r](**self._r_args)
        return self.out

    def __call__(self):
        self.partition()
        return self.reduce()


def decode_timing(log: Log, device, dry: bool, copy_bw: float, budget_s: float = 1e9) -> list[dict]:
    """Decode attention of one new token per sequence as the TensorRT engine runs it: the pool holds
    ``ctx - 1`` tokens and the step's new row comes beside it (NEW_ROWS), vs fp16 SDPA over ``ctx``."""
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
                fmt, (kp, vp), new, bt, cl, q, kpar, vpar, read = _paged_setup(fmt_name, B, ctx, hq, hkv, d, bs,
                                                                              device)
                args = (kp.data, kp.scale, kp.zero, vp.data, vp.scale, vp.zero, bt, cl, fmt.k.short(),
                        fmt.v.short(), _p(kpar, "scale"), _p(kpar, "smooth"), _p(vpar, "scale"), _p(vpar, "smooth"))
                for prec in (("ieee",) if dry else ("tf32x3", "tf32")):
                    mode = "prepared"
                    try:
                        fn = PreparedDecode(q, args, new, ctx, prec)
                        assert fn.new_rows
                        want = ops.launch_paged_decode(q, *args, max_context_len=ctx, precision=prec, **new)
                        same = _err(fn(), want)
                        assert same < 1e-3, f"prepared decode differs from ops.launch_paged_decode: {same}"
                        t = timer(fn)
                    except Exception as exc:  # kernels changed under this script: time the stable op API
                        log(f"prepared decode unavailable ({type(exc).__name__}: {str(exc)[:200]}); timing "
                            "ops.launch_paged_decode eagerly (includes Python launch overhead)")
                        mode = "ops-eager"
                        fn = (lambda prec=prec: ops.launch_paged_decode(q, *args, max_context_len=ctx, precision=prec,
                                                                        **new))
                        t = timer(fn) if dry else _time_cuda(fn, use_graph=False)
                    rows.append(dict(impl=f"paged-{fmt_name}", precision=prec, mode=mode, ctx=ctx, batch=B,
                                     us=t * 1e6, bytes_read=read, gbs=read / t / 1e9, bw_frac=read / t / copy_bw,
                                     speedup=(base / t) if base else None))
                    log(_fmt_row(rows[-1]))
                del kp, vp, new, fn
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
         f"- geometry (timing): {result['geometry']}", f"- wall time: {result['seconds']:.0f} s",
         *([] if result.get("complete") else ["- **incomplete**: written after a section; the run did not finish"]),
         ""]
    L += ["## Correctness (kernel vs torch reference)", "", "| kernel | case | metric | ok |", "|---|---|---|---|"]
    for r in result["correctness"]:
        metric = r.get("error") or ", ".join(f"{k}={v:.2e}" for k, v in r.items()
                                             if isinstance(v, float))
        L.append(f"| {r['kernel']} | {r['case']} | {metric} | {r['ok']} |")
    L += ["", "## TensorRT ABI (PTX reordered for TensorRT; launched in TensorRT's argument order: CUDA driver "
          "on a GPU, Triton interpreter stand-in in the dry run)", "",
          "| op | format | kernel | precision | warps | smem B | status | ok |", "|---|---|---|---|---|---|---|---|"]
    for r in result["trt_abi"]:
        status = r.get("status", "") + (f" rel_err={r['rel_err']:.1e}" if "rel_err" in r else "")
        if r.get("error"):
            status = (status + " " if status else "") + "ERROR " + r["error"]
        L.append(f"| {r['op']} | {r['fmt']} | {r.get('kernel', '')} | {r.get('precision') or ''} | "
                 f"{r.get('num_warps', '')} | {r.get('shared', '')} | {status} | {r['ok']} |")
    cb = result["copy"]
    L += ["", f"## Bandwidth reference: device copy {cb['bandwidth_gbs']:.0f} GB/s" if cb else
          "## Bandwidth reference: not measured yet", "",
          "## Decode attention timing (one new token per sequence, read beside the pool: the engine's step)", "",
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
                            f"heads {HEADS_Q} q / {HEADS_KV} kv, head_dim {HEAD_DIM}, block {BLOCK}, fp16 queries"),
                  correctness=[], trt_abi=[], copy=None, timing=[], targets=[], seconds=0.0, complete=False)
    out_dir = Path(args.out)

    def checkpoint():  # the report is rewritten after every section: a run cut short still leaves one
        result["seconds"] = time.time() - t0
        return write_report(out_dir, result)

    # section budgets (seconds) keep a GPU run under ~8 minutes even when compiles are slow; a section
    # checks its budget before each case, so it can overrun by one case
    if "correctness" not in args.skip:
        result["correctness"] = check_correctness(log, device, args.dry_run, BUDGETS_S["correctness"])
        checkpoint()
    if "abi" not in args.skip:
        result["trt_abi"] = check_trt_abi(log, device, args.dry_run, BUDGETS_S["abi"])
        checkpoint()
    result["copy"] = copy_bandwidth(log, device, args.dry_run)
    if "timing" not in args.skip:
        result["timing"] = decode_timing(log, device, args.dry_run, result["copy"]["bandwidth_gbs"] * 1e9,
                                         BUDGETS_S["timing"])
    result["targets"] = evaluate_targets(result["timing"], args.dry_run)
    result["complete"] = True
    jp, mp = checkpoint()
    for t in result["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["ok"]]
        log(f"target {t['target']}: want {t['want']}, got {t['got']}: {verdict}")
    failed = [r for r in result["correctness"] + result["trt_abi"] if r["ok"] is False]
    log(f"wrote {mp} and {jp}; correctness/abi failures: {len(failed)}; {result['seconds']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
