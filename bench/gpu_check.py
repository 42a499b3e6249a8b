"""One-shot GPU check of the trtkv kernels: correctness, TensorRT-ABI launches, decode timing vs SDPA.

    python bench/gpu_check.py --out $OUT         # on a CUDA GPU (written for one H200, < 8 minutes)
    python bench/gpu_check.py --dry-run          # CPU, Triton interpreter, tiny sizes (< 1 minute)

The cache follows the sealed-block contract (docs/kv-cache-format.md): sealed blocks in the pool, each
sequence's fp16 open block (and sink rows) in ``tail[slot]``, this step's fp16 rows beside them.

Sections
1. correctness: every kernel (block seal, split-K decode, prefill) for each KV preset, CUDA vs the torch
   reference (``trtkv.plugins.reference``: seal_blocks / gather_paged, float64 attention). The pools are
   sealed by the seal kernel; tail rows past each context and unused pool blocks hold NaN.
2. TensorRT ABI: all four plugin ops compiled the way ``trtkv.plugins.trt_plugins`` compiles them for
   TensorRT (attribute constexprs, PTX parameters reordered to inputs / int32 scalars / outputs,
   Triton's hidden scratch parameters dropped) and launched through the CUDA driver API
   (cuModuleLoadData / cuLaunchKernel, raising the function's dynamic shared memory limit above 48 KiB)
   in exactly that order with the contract's grid -- what a TensorRT AOT plugin does -- compared with the
   regular Triton launch. The dry run compiles the same PTX and replaces the driver launch with a
   TensorRT-order launch on the interpreter.
3. bandwidth: device-to-device copy of a large tensor (read + write bytes / time): the reference rate.
4. decode timing: heads 32 query / 8 KV, head_dim 128, contexts 4k / 32k / 128k, batch 1 and 8: the fp16
   baseline is torch ``scaled_dot_product_attention`` (flash backend, ``enable_gqa``) on a contiguous fp16
   cache; ours is the engine's decode step: ``ctx - 1`` cached tokens (sealed blocks of the format's block
   size, the rest in the open block) plus one new row per sequence. Each timing is the median over repeats
   of CUDA-graph replays (no launch overhead) between CUDA events, after warmup. Achieved bandwidth counts
   the bytes read: codes + scales (+ zero-points) + open-block rows + new rows + query + block table.
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
from trtkv.formats import ELEM_TYPES, get_format  # noqa: E402
from trtkv.quant import TensorParams, forward_transform  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM, BLOCK = 32, 8, 128, 16  # BLOCK: cache block size of formats without their own
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
    """Sequences holding ``ctx_lens[b]`` cached tokens (sealed blocks + open block) and ``new[b]`` rows of
    this step (``ctx % block + new <= block``: a step never crosses a block boundary).

    ``seal()`` writes the sealed blocks with the seal kernel (the thing under test in section 1);
    ``k_pool / v_pool`` carry the open blocks (``tail``). Unused pool blocks and tail rows hold NaN."""

    def __init__(self, fmt_name: str, ctx_lens: list[int], new: list[int], heads_q: int, heads_kv: int,
                 head_dim: int, device, seed: int = 0):
        fmt = get_format(fmt_name)
        bs = fmt.block_size or BLOCK
        self.fmt = fmt.with_block_size(bs)
        self.ctx, self.new = ctx_lens, new
        assert all(c % bs + n <= bs for c, n in zip(ctx_lens, new)), (ctx_lens, new, bs)
        self.hq, self.hkv, self.d, self.bs = heads_q, heads_kv, head_dim, bs
        g = torch.Generator().manual_seed(seed)
        sealed = [c // bs for c in ctx_lens]
        self.max_blocks = max(sealed) + 1
        nblocks = sum(sealed) + 3
        B = len(ctx_lens)
        self.layout = PagedKVLayout(self.fmt, heads_kv, head_dim, bs, nblocks, num_slots=B + 1)
        perm = torch.randperm(nblocks, generator=g)
        bt = torch.full((B, self.max_blocks), -1, dtype=torch.int32)
        i = 0
        for b, n in enumerate(sealed):
            bt[b, :n] = perm[i:i + n]
            i += n
        self.sealed = sealed
        self.block_table = bt.to(device)
        self.slot_ids = torch.randperm(B + 1, generator=g)[:B].to(torch.int32).to(device)
        self.context_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)

        def rows(*shape):  # keys with a few outlier channels, values plain: realistic ranges
            k = torch.randn(*shape, generator=g)
            k[..., :4] *= 4
            return k.half().to(device), torch.randn(*shape, generator=g).half().to(device)

        self.k_blocks, self.v_blocks = rows(max(sum(sealed), 1), heads_kv, bs, head_dim)  # sealed blocks, in order
        self.k_tail_rows, self.v_tail_rows = rows(B, bs, heads_kv, head_dim)
        self.k_new, self.v_new = rows(sum(new), heads_kv, head_dim)
        self.k_params = make_params(self.fmt, "k", self.k_blocks.transpose(1, 2).reshape(-1, heads_kv, head_dim),
                                    heads_kv, head_dim)
        self.v_params = make_params(self.fmt, "v", self.v_blocks.transpose(1, 2).reshape(-1, heads_kv, head_dim),
                                    heads_kv, head_dim)
        self.q_dec = torch.randn(B, heads_q, head_dim, generator=g).half().to(device)
        self.q_pre = torch.randn(sum(new), heads_q, head_dim, generator=g).half().to(device)
        cu = [0]
        for n in new:
            cu.append(cu[-1] + n)
        self.cu = torch.tensor(cu, dtype=torch.int32, device=device)
        self.device = device
        self.k_pool, self.v_pool = self.empty_pools()

    def empty_pools(self):
        """Pools full of NaN / garbage codes, tails written with each sequence's open-block rows."""
        out = []
        for which in ("k", "v"):
            p = self.layout.allocate(which, self.device)
            p.data.view(torch.uint8).fill_(0x7E)
            for t in (p.scale, p.zero, p.tail):
                if t is not None:
                    t.fill_(float("nan"))
            tail_rows = self.k_tail_rows if which == "k" else self.v_tail_rows
            sink = self.layout.sink_tokens
            for b, c in enumerate(self.ctx):
                s, n = int(self.slot_ids[b]), c % self.bs
                p.tail[s, :, :n] = tail_rows[b, :n].transpose(0, 1)
                if sink and c >= self.bs:  # sink rows: read instead of the first sealed block's first rows
                    p.tail[s, :, self.bs:] = tail_rows[b, -sink:].transpose(0, 1)
            out.append(p)
        return out

    def spec(self, which: str) -> str:
        return (self.fmt.k if which == "k" else self.fmt.v).short()

    def params(self, which: str) -> TensorParams | None:
        return self.k_params if which == "k" else self.v_params

    def blocks_of(self, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [n, kv_heads, block, D], destination pool blocks [n]) of every sealed block."""
        dest = torch.cat([self.block_table[b, :n].long() for b, n in enumerate(self.sealed)]) if sum(self.sealed) \
            else torch.zeros(0, dtype=torch.long, device=self.device)
        rows = (self.k_blocks if which == "k" else self.v_blocks)[: dest.numel()]
        return rows, dest

    def seal(self, which: str, pool: KVPool) -> None:
        from trtkv.plugins import ops

        rows, dest = self.blocks_of(which)
        prm = self.params(which)
        if dest.numel():
            ops.launch_seal_into(rows, dest, pool.data, pool.scale, pool.zero, self.spec(which), _p(prm, "scale"),
                                 _p(prm, "smooth"), _p(prm, "clip"))

    def attn_args(self, kp: KVPool | None = None, vp: KVPool | None = None, prefill: bool = False) -> tuple:
        """ops.launch_paged_decode / _prefill arguments after q (and cu_seqlens)."""
        kp, vp = kp or self.k_pool, vp or self.v_pool
        if prefill:
            k_new, v_new = self.k_new, self.v_new
        else:  # decode: each sequence's first new row
            first = self.cu[:-1].long()
            k_new, v_new = self.k_new[first], self.v_new[first]
        return (kp.data, kp.scale, kp.zero, vp.data, vp.scale, vp.zero, kp.tail, vp.tail, k_new, v_new,
                self.block_table, self.context_lens, self.slot_ids, self.spec("k"), self.spec("v"),
                _p(self.k_params, "scale"), _p(self.k_params, "smooth"), _p(self.v_params, "scale"),
                _p(self.v_params, "smooth"))

    def reference(self, prefill: bool, kp: KVPool | None = None, vp: KVPool | None = None) -> torch.Tensor:
        """float64 attention over the pools (gather_paged) followed by this step's rows."""
        from trtkv.plugins import reference as ref

        a = [_cpu(x) if isinstance(x, torch.Tensor) else x for x in self.attn_args(kp, vp, prefill)]
        kpool, vpool = KVPool(a[0], a[1], a[2], a[6]), KVPool(a[3], a[4], a[5], a[7])
        q = _cpu(self.q_pre if prefill else self.q_dec)
        return ref.paged_attention_ref(q, _cpu(self.cu) if prefill else None, kpool, vpool, a[8], a[9], a[10], a[11],
                                       a[12], a[13], a[14], _cpu_params(self.k_params), _cpu_params(self.v_params))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


# ------------------------------------------------------------------------------------------------
# 1. correctness
# ------------------------------------------------------------------------------------------------


def check_correctness(log: Log, device, dry: bool, budget_s: float = 1e9) -> list[dict]:
    """Kernels vs the torch reference: seal (bit-exact codes / scales but for Hadamard rounding ties),
    decode and prefill over sealed blocks + open blocks + this step's rows."""
    from trtkv.plugins import ops
    from trtkv.plugins import reference as ref

    rows = []
    if dry:
        shapes = [dict(ctx=[37, 20, 64], new=[3, 1, 16], hq=4, hkv=2, d=64)]
        formats = DRY_FORMATS
    else:
        shapes = [dict(ctx=[1, 300, 77, 1024, 63], new=[1, 4, 3, 16, 1], hq=32, hkv=8, d=128),
                  dict(ctx=[513, 45, 0], new=[1, 3, 16], hq=8, hkv=8, d=64)]
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
                bs = get_format(fmt_name).block_size or BLOCK
                new = [min(n, bs - c % bs) for c, n in zip(sh["ctx"], sh["new"])]  # within the open block
                c = Case(fmt_name, sh["ctx"], new, sh["hq"], sh["hkv"], sh["d"], device)
                # seal: kernel vs reference (bit-exact codes / scales expected; Hadamard: summation-order ties)
                for which, pool in (("k", c.k_pool), ("v", c.v_pool)):
                    c.seal(which, pool)
                    blocks, dest = c.blocks_of(which)
                    if not dest.numel():
                        continue
                    prm = c.params(which)
                    want = ref.seal_ref(_cpu(blocks), c.spec(which), _cpu(_p(prm, "scale")), _cpu(_p(prm, "smooth")),
                                        _cpu(_p(prm, "clip")))
                    got = pool.data[dest].cpu()
                    mism = float((got.view(torch.uint8) != want[0].view(torch.uint8)).float().mean()) \
                        if got.dtype != torch.float16 else float((got != want[0]).float().mean())
                    smis = 0.0
                    if want[1] is not None:  # fraction of scales not bit-equal (fp32 sum-order ties)
                        smis = float((pool.scale[dest].cpu() != want[1]).float().mean())
                    ok = mism <= 1e-3 and smis <= 1e-3
                    rows.append(dict(kernel="seal", case=f"{tag} {which}", code_mismatch=mism, scale_mismatch=smis,
                                     ok=ok))
                psize = 64 if dry else 512  # the ops default (several partitions at ctx 1024)
                e = _err(ops.launch_paged_decode(c.q_dec, *c.attn_args(), partition_size=psize), c.reference(False))
                rows.append(dict(kernel="paged_decode", case=f"{tag} part{psize}", rel_err=e, ok=e < 2e-2))
                e = _err(ops.launch_paged_decode(c.q_dec, *c.attn_args(), partition_size=16), c.reference(False))
                rows.append(dict(kernel="paged_decode", case=f"{tag} part16", rel_err=e, ok=e < 2e-2))
                e = _err(ops.launch_paged_prefill(c.q_pre, c.cu, *c.attn_args(prefill=True)), c.reference(True))
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


_TORCH_DT = {n: e.torch for n, e in ELEM_TYPES.items()}  # trtkv.formats.ELEM_TYPES


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
            x = torch.zeros(C.placeholder_shape(t, attrs), dtype=_TORCH_DT[d], device=device)
        assert x.dtype == _TORCH_DT[d] and x.dim() == t.rank_of(attrs), (t.name, x.dtype, tuple(x.shape), d)
        out.append(x.contiguous())
    return out


ABI_FORMATS = ("int4", "int8-static", "fp8", "int8", "fp16", "int4-g32")  # coverage first (time budget)
DRY_ABI_FORMATS = ("int8", "int4")
ABI_OPS = ("PagedKVSeal", "PagedDecodePartition", "PagedDecodeReduce", "PagedPrefillAttention")


def _abi_attrs(op_name: str, fmt_name: str, dry: bool):
    """The op instance the ABI check compiles. Prefill uses ``tf32`` dots (ops.PREFILL_PRECISION), whose
    head_dim-128 tiles need > 48 KiB of dynamic shared memory: the driver launch must opt in."""
    from trtkv.plugins import contract as C

    hq, hkv, d = (4, 2, 64) if dry else (32, 8, 128)
    prec = "tf32" if op_name == "PagedPrefillAttention" else "tf32x3"
    f = get_format(fmt_name)
    return C.attrs_for(op_name, f, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=f.block_size or BLOCK,
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
    """One format's data for the ABI checks: a case with sealed pools (seal kernel), tails and new rows."""

    def __init__(self, fmt_name: str, device, dry: bool):
        hq, hkv, d = (4, 2, 64) if dry else (32, 8, 128)
        bs = get_format(fmt_name).block_size or BLOCK
        ctx = [37, 20, 2 * bs] if dry else [700, 130, 1, 5 * bs]
        new = [min(3, bs - c % bs) for c in ctx]
        c = self.c = Case(fmt_name, ctx, new, hq, hkv, d, device, seed=5)
        c.seal("k", c.k_pool)
        c.seal("v", c.v_pool)

    def attention_tensors(self, prefill: bool) -> dict:
        """Contract tensors of PagedDecodePartition / PagedPrefillAttention."""
        from trtkv.quant import hadamard_matrix

        c = self.c
        a = c.attn_args(prefill=prefill)
        t = dict(q=c.q_pre if prefill else c.q_dec, cu_seqlens=c.cu, block_tables=c.block_table,
                 context_lens=c.context_lens, slot_ids=c.slot_ids, k_new=a[8], v_new=a[9],
                 hadamard=hadamard_matrix(c.d, torch.float32, c.device),
                 k_static=_static_hd(c.k_params, c.hkv, c.d, c.device), k_smooth=_p(c.k_params, "smooth"),
                 v_static=_static_hd(c.v_params, c.hkv, c.d, c.device), v_smooth=_p(c.v_params, "smooth"))
        for w, pool in (("k", c.k_pool), ("v", c.v_pool)):
            t.update({f"{w}_data": pool.data, f"{w}_scale": pool.scale, f"{w}_zero": pool.zero, f"{w}_tail": pool.tail})
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

    if op_name == "PagedKVSeal":
        which = "k"
        blocks, _ = c.blocks_of(which)
        prm = c.params(which)
        outs = run(dict(rows=blocks, static_scale=_static_hd(prm, c.hkv, c.d, device), smooth=_p(prm, "smooth"),
                        clip=torch.ones(c.hkv, device=device), hadamard=_hadamard(c.d, device)))
        want = ops.launch_seal(blocks, c.spec(which), _p(prm, "scale"), _p(prm, "smooth"))  # regular launch
        ok = all(w is None or torch.equal(o, w) for o, w in zip(outs, want))
        return dict(ok=bool(ok), status="TensorRT-order launch == regular launch (bit-exact)" if ok else "MISMATCH")
    if op_name in ("PagedDecodePartition", "PagedDecodeReduce"):
        prec = attrs.get("precision", "tf32x3")  # the reduce has no dots
        prep = PreparedDecode(c.q_dec, c.attn_args(), prec, attrs["partition_size"])
        want = prep().clone()  # the regular partition + reduce launches
        if op_name == "PagedDecodePartition":
            part = run(data.attention_tensors(False))
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
        return dict(ok=e < 1e-3, rel_err=e, status="TensorRT-order launch vs regular decode")
    if op_name == "PagedPrefillAttention":
        want = ops.launch_paged_prefill(c.q_pre, c.cu, *c.attn_args(prefill=True), precision=attrs["precision"])
        (got,) = run(data.attention_tensors(True))
        e = _err(got, want)
        return dict(ok=e < 1e-3, rel_err=e, status="TensorRT-order launch vs regular prefill")
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


def _paged_setup(fmt_name, B, ctx, hq, hkv, d, device):
    """B sequences holding ``ctx - 1`` cached tokens -- sealed blocks of the format's block size in the pool,
    the rest in the open block -- plus this step's one new row each (the engine's decode step). Random
    codes / scales: timing only."""
    fmt = get_format(fmt_name)
    bs = fmt.block_size or BLOCK
    cached = ctx - 1
    sealed = cached // bs
    blocks = max(B * sealed, 1)
    lay = PagedKVLayout(fmt, hkv, d, bs, blocks, num_slots=B)
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
        p.tail.normal_()
        pools.append(p)
    bt = torch.randperm(blocks, device=device).to(torch.int32)[: B * sealed].view(B, sealed).contiguous() if sealed \
        else torch.zeros(B, 1, dtype=torch.int32, device=device)
    cl = torch.full((B,), cached, dtype=torch.int32, device=device)
    slots = torch.arange(B, dtype=torch.int32, device=device)
    q = torch.randn(B, hq, d, dtype=torch.float16, device=device)
    k_new = torch.randn(B, hkv, d, dtype=torch.float16, device=device)
    v_new = torch.randn(B, hkv, d, dtype=torch.float16, device=device)
    k_params = make_params(fmt, "k", torch.randn(4, hkv, d, device=device), hkv, d)
    v_params = make_params(fmt, "v", torch.randn(4, hkv, d, device=device), hkv, d)
    read = q.numel() * 2 + bt.numel() * 4 + cl.numel() * 4 + (k_new.numel() + v_new.numel()) * 2
    for p in pools:  # every sealed block and the open rows
        for t in (p.data, p.scale, p.zero):
            if t is not None:
                read += t.numel() * t.element_size() * (B * sealed) // blocks
        read += 2 * B * hkv * (cached % bs) * d
    args = (pools[0].data, pools[0].scale, pools[0].zero, pools[1].data, pools[1].scale, pools[1].zero,
            pools[0].tail, pools[1].tail, k_new, v_new, bt, cl, slots, fmt.k.short(), fmt.v.short(),
            _p(k_params, "scale"), _p(k_params, "smooth"), _p(v_params, "scale"), _p(v_params, "smooth"))
    return q, args, read


class PreparedDecode:
    """The two decode launches of ``ops.launch_paged_decode`` with every tensor prepared once, so a call is
    only the launches (capturable in a CUDA graph: no allocation, no host copy). Kernel arguments are
    passed by parameter name, so a reordered kernel signature cannot shift them.

    ``args``: ops.launch_paged_decode's arguments after q up to v_smooth (pools, tails, new rows, block
    table, context lengths, slots, formats, constants)."""

    def __init__(self, q, args: tuple, precision: str, partition_size: int = 512, interpret: bool | None = None):
        from trtkv.plugins import contract as C
        from trtkv.plugins import kernels as K
        from trtkv.plugins import ops

        (k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new, v_new, bt, cl, slots, k_fmt, v_fmt,
         k_static, k_smooth, v_static, v_smooth) = args
        interpret = (not q.is_cuda) if interpret is None else interpret
        B, heads, d = q.shape
        kf, vf, t, sink = ops._attn_tensors(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail,
                                            k_new, v_new, k_fmt, v_fmt, k_static, k_smooth, v_static, v_smooth, B)
        kvh, bs = k_data.shape[1], k_data.shape[2]
        cfg = K.decode_config(kf, vf, d, heads // kvh, partition_size, precision, interpret=interpret)
        bt, cl, slots = bt.to(torch.int32).contiguous(), cl.to(torch.int32).contiguous(), slots.to(torch.int32).contiguous()
        self.grid_p, self.grid_r = C.decode_grids(B, kvh, bt.shape[1], bs, partition_size)
        S = self.grid_p[2]
        self.part_m = torch.empty(B, heads, S, device=q.device)
        self.part_l = torch.empty_like(self.part_m)
        self.part_acc = torch.empty(B, heads, S, d, device=q.device)
        self.out = torch.empty_like(q)
        kmod = K.load_kernels(interpret)
        self._part, self._red = kmod.paged_decode_partition_kernel, kmod.paged_decode_reduce_kernel
        common = dict(block_table_ptr=bt, context_lens_ptr=cl, slot_ids_ptr=slots, q_ptr=q.contiguous(),
                      part_m_ptr=self.part_m, part_l_ptr=self.part_l, part_acc_ptr=self.part_acc, out_ptr=self.out,
                      qk_scale=(1.0 / math.sqrt(d)) * K.LOG2E, num_heads=heads, num_kv_heads=kvh, block_size=bs,
                      sink_tokens=sink, max_blocks=bt.shape[1], num_partitions=S, **t)
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
    """Decode attention of one new token per sequence as the TensorRT engine runs it: ``ctx - 1`` cached
    tokens (sealed blocks + open block) and the step's new row, vs fp16 SDPA over ``ctx``."""
    from trtkv.plugins import ops

    rows = []
    if dry:
        grid = [(64, 1), (160, 2)]
        hq, hkv, d = 4, 2, 64
    else:
        grid = [(c, b) for c in CONTEXTS for b in BATCHES]
        hq, hkv, d = HEADS_Q, HEADS_KV, HEAD_DIM
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
                q, args, read = _paged_setup(fmt_name, B, ctx, hq, hkv, d, device)
                for prec in (("ieee",) if dry else ("tf32x3", "tf32")):
                    mode = "prepared"
                    try:
                        fn = PreparedDecode(q, args, prec)
                        want = ops.launch_paged_decode(q, *args, precision=prec)
                        same = _err(fn(), want)
                        assert same < 1e-3, f"prepared decode differs from ops.launch_paged_decode: {same}"
                        t = timer(fn)
                    except Exception as exc:  # kernels changed under this script: time the stable op API
                        log(f"prepared decode unavailable ({type(exc).__name__}: {str(exc)[:200]}); timing "
                            "ops.launch_paged_decode eagerly (includes Python launch overhead)")
                        mode = "ops-eager"
                        fn = (lambda prec=prec: ops.launch_paged_decode(q, *args, precision=prec))
                        t = timer(fn) if dry else _time_cuda(fn, use_graph=False)
                    rows.append(dict(impl=f"paged-{fmt_name}", precision=prec, mode=mode, ctx=ctx, batch=B,
                                     us=t * 1e6, bytes_read=read, gbs=read / t / 1e9, bw_frac=read / t / copy_bw,
                                     speedup=(base / t) if base else None))
                    log(_fmt_row(rows[-1]))
                del args, fn
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
          "## Decode attention timing (one new token per sequence: sealed blocks + open block + the new row)", "",
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
                  geometry=("heads 4 q / 2 kv, head_dim 64, block: the format's (else 16)" if args.dry_run else
                            f"heads {HEADS_Q} q / {HEADS_KV} kv, head_dim {HEAD_DIM}, block: the format's (int8 / int4: "
                            f"64), else {BLOCK}; fp16 queries"),
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
