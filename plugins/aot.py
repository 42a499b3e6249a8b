"""Ahead-of-time compilation of the plugin kernels to PTX / cubin for sm_80 and sm_90 (no GPU needed).

``kernel_configs()`` enumerates the kernel configurations (kernel x KV format x head_dim x GQA bucket);
``compile_config(cfg, arch)`` runs triton's compiler for a ``GPUTarget`` and returns the PTX, the cubin,
the kernel's entry name, num_warps, dynamic shared memory and the ptxas resource usage (registers,
spill bytes, stack frame), plus the launch grid as a formula over input shapes. This is what the
TensorRT plugin glue consumes (``tensorrt.plugin`` ``aot_impl`` takes a kernel name, PTX and launch
parameters).

The kernels follow the sealed-block cache contract (docs/kv-cache-format.md): the seal kernel quantizes
whole blocks (``BLOCK_SIZE`` is a constexpr: the format's own block size, else ``DEFAULT_BLOCK_SIZE``); the
attention kernels read sealed blocks, the fp16 open block (tail) and this step's fp16 rows. Grid formulas
are the contract's grid functions (``trtkv.plugins.contract``) evaluated on symbolic dims.

Kernel parameter order in the PTX: the runtime (non-constexpr) arguments of the Triton function in
declaration order (inputs, then outputs, then scalars; see ``KernelConfig.args``), followed by the
two scratch pointers triton >= 3.3 appends to every kernel (``global_scratch``, ``profile_scratch``;
pass null, both sizes are recorded and are 0 for these kernels).

    python -m trtkv.plugins.aot --out DIR [--arch 80 90] [--head-dims 64 128] [--lean]

writes ``DIR/<arch>/<config>.ptx|.cubin`` and ``DIR/kernels.json`` (one row per config and arch).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trtkv.formats import ELEM_TYPES, PRESETS, KVFormat, TensorFormat, get_format

_REPO_CACHE = Path(__file__).resolve().parents[1] / ".triton_cache"
if (_REPO_CACHE.parent / "pyproject.toml").is_file():
    os.environ.setdefault("TRITON_CACHE_DIR", str(_REPO_CACHE))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from . import contract as C  # noqa: E402
from . import kernels as _k  # noqa: E402
from .contract.capabilities import kernel_refusal, kernels_attend  # noqa: E402

ARCHS = (80, 90)
HEAD_DIMS = (64, 128)
GQA_RATIOS = (1, 4, 8)  # prefill buckets (BLOCK_H = next power of two); decode covers ratios <= 16 with one config
DEFAULT_PRECISION = "tf32x3"  # decode (ops.DECODE_PRECISION)
PREFILL_PRECISION = "tf32"  # prefill (ops.PREFILL_PRECISION)
SPILL_LIMIT_BYTES = 64  # ptxas spill stores above this fail tests/test_kernels_aot.py
DEFAULT_BLOCK_SIZE = 64  # cache block size of formats without their own (the sealed presets use 64)
_Q_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def _data_type(fmt: TensorFormat) -> str:
    return fmt.storage.triton


def _ptr(name: str) -> str:
    return ELEM_TYPES[name].triton


def block_size_of(fmt: KVFormat) -> int:
    return fmt.block_size or DEFAULT_BLOCK_SIZE


def _tag(fmt: TensorFormat) -> str:
    return fmt.short().replace(":", "_")


@dataclass
class KernelConfig:
    """One compilable kernel configuration."""

    kernel: str  # name of the @triton.jit function in trtkv.plugins.kernels
    name: str  # unique id: file stem of its PTX / cubin
    constexprs: dict
    signature: dict  # runtime argument -> triton type ("*fp16", "i32", "fp32", ...)
    num_warps: int
    grid: list[str]  # grid formula over the kernel's input dims (see GRID_VARS)
    args: list[str] = field(default_factory=list)  # runtime arguments in PTX parameter order

    def fn(self):
        return getattr(_k, self.kernel)


GRID_VARS = {
    "blocks": "rows.shape[0] (blocks sealed)",
    "batch": "q.shape[0] (decode) / context_lens.shape[0] (prefill)",
    "kv_heads": "k_data.shape[1]",
    "max_blocks": "block_tables.shape[1]",
    "max_seqlen_q": "max query tokens of one sequence, or total_q = q.shape[0]",
}


def _grid_text(grid) -> list[str]:
    """A contract grid evaluated on ``Sym`` dims -> its formula strings (``eval_grid`` evaluates them)."""
    return [d.text if isinstance(d, C.Sym) else str(int(d)) for d in grid]


def _v(name: str) -> C.Sym:
    return C.Sym(name, 1)


def _signature(kernel: str, types: dict, constexprs: dict) -> tuple[dict, list[str]]:
    fn = getattr(_k, kernel)
    sig, args = {}, []
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        else:
            sig[name] = types.get(name, "i32")
            args.append(name)
    return sig, args


# cache_layout.OUTLIER_INDEX_DTYPE (torch.int16) as a Triton pointer: only the Triton kernels read outlier lists (no ONNX /
# TensorRT op exchanges them, so it is no ELEM_TYPES row)
OUTLIER_INDEX_PTR = "*i16"


def _kv_types(kf: TensorFormat, vf: TensorFormat, q_dtype: str) -> dict:
    q = _ptr(_Q_DTYPES[q_dtype])
    f16, f32, i32 = _ptr("float16"), _ptr("float32"), _ptr("int32")
    return dict(q_ptr=q, out_ptr=q, k_data_ptr=_data_type(kf), v_data_ptr=_data_type(vf),
                k_scale_ptr=f16, k_zero_ptr=f16, v_scale_ptr=f16, v_zero_ptr=f16,
                k_tail_ptr=f16, v_tail_ptr=f16, k_new_ptr=f16, v_new_ptr=f16,
                k_static_ptr=f32, k_smooth_ptr=f32, v_static_ptr=f32, v_smooth_ptr=f32,
                had_ptr=f32, block_table_ptr=i32, context_lens_ptr=i32, cu_seqlens_q_ptr=i32, slot_ids_ptr=i32,
                part_m_ptr=f32, part_l_ptr=f32, part_acc_ptr=f32, qk_scale="fp32", softcap="fp32",
                k_cb_ptr=f32, v_cb_ptr=f32, k_oidx_ptr=OUTLIER_INDEX_PTR, k_oval_ptr=f16, v_oidx_ptr=OUTLIER_INDEX_PTR,
                v_oval_ptr=f16, rope_cos_ptr=f32, rope_sin_ptr=f32, k_chan_ptr=i32, v_chan_ptr=i32)


def seal_kernel_config(fmt: TensorFormat, head_dim: int, block_size: int, x_dtype: str = "fp16") -> KernelConfig:
    cfg = _k.seal_config(fmt, head_dim, block_size)
    c = cfg["constexprs"]
    f16, f32 = _ptr("float16"), _ptr("float32")
    types = dict(x_ptr=_ptr(_Q_DTYPES[x_dtype]), data_ptr=_data_type(fmt), scale_ptr=f16, zero_ptr=f16,
                 static_scale_ptr=f32, smooth_ptr=f32, clip_ptr=f32, had_ptr=f32, cb_ptr=f32, oidx_ptr=OUTLIER_INDEX_PTR,
                 oval_ptr=f16, pos_ptr=_ptr("int32"), rope_cos_ptr=f32, rope_sin_ptr=f32, scratch_ptr=f32, chan_ptr=_ptr("int32"))
    sig, args = _signature("seal_kernel", types, c)
    return KernelConfig("seal_kernel", f"seal.{_tag(fmt)}.d{head_dim}.b{block_size}.{x_dtype}", c, sig,
                        cfg["num_warps"], _grid_text(C.seal_grid(_v("blocks"), _v("kv_heads"))), args)


def decode_kernel_configs(fmt: KVFormat, head_dim: int, gqa_ratio: int = 8, q_dtype: str = "fp16",
                          partition_size: int = C.LIMITS.default_partition,
                          precision: str = DEFAULT_PRECISION, windowed: bool = False) -> list[KernelConfig]:
    """``windowed``: the partition kernel with the sliding window's and soft-cap's code (WINDOW / SOFTCAP), ``.win``."""
    cfg = _k.decode_config(fmt.k, fmt.v, head_dim, gqa_ratio, partition_size, precision, window=windowed,
                           softcap=windowed, block_size=block_size_of(fmt))
    types = _kv_types(fmt.k, fmt.v, q_dtype)
    tag = f"k-{_tag(fmt.k)}.v-{_tag(fmt.v)}.d{head_dim}.h{cfg['partition']['constexprs']['BLOCK_H']}.{q_dtype}"
    gp, gr = C.decode_grids(_v("batch"), _v("kv_heads"), _v("max_blocks"), block_size_of(fmt), partition_size,
                            C.SYM_OPS)
    pc = cfg["partition"]["constexprs"]
    sig, args = _signature("paged_decode_partition_kernel", types, pc)
    part = KernelConfig("paged_decode_partition_kernel",
                        f"paged_decode_partition.{tag}.b{block_size_of(fmt)}.p{partition_size}.{precision}"
                        + (".win" if windowed else ""),
                        pc, sig, cfg["partition"]["num_warps"], _grid_text(gp), args)
    rc = cfg["reduce"]["constexprs"]
    vtag = f"v-{_tag(fmt.v)}.d{head_dim}.h{rc['BLOCK_H']}.{q_dtype}.p{partition_size}"
    sig, args = _signature("paged_decode_reduce_kernel", types, rc)
    red = KernelConfig("paged_decode_reduce_kernel", f"paged_decode_reduce.{vtag}", rc, sig,
                       cfg["reduce"]["num_warps"], _grid_text(gr), args)
    return [part, red]


def prefill_kernel_config(fmt: KVFormat, head_dim: int, gqa_ratio: int, q_dtype: str = "fp16",
                          precision: str = PREFILL_PRECISION, windowed: bool = False) -> KernelConfig:
    cfg = _k.prefill_config(fmt.k, fmt.v, head_dim, gqa_ratio, precision, window=windowed, softcap=windowed,
                            block_size=block_size_of(fmt))
    c = cfg["constexprs"]
    sig, args = _signature("paged_prefill_kernel", _kv_types(fmt.k, fmt.v, q_dtype), c)
    name = f"paged_prefill.k-{_tag(fmt.k)}.v-{_tag(fmt.v)}.d{head_dim}.h{c['BLOCK_H']}.{q_dtype}.{precision}" + (
        ".win" if windowed else "")
    grid = C.prefill_grid(_v("max_seqlen_q"), _v("kv_heads"), _v("batch"), c["BLOCK_M"], C.SYM_OPS)
    return KernelConfig("paged_prefill_kernel", name, c, sig, cfg["num_warps"], _grid_text(grid), args)


def kernel_configs(formats: list[KVFormat] | None = None, head_dims=HEAD_DIMS, gqa_ratios=GQA_RATIOS,
                   q_dtype: str = "fp16", precision: str = DEFAULT_PRECISION,
                   prefill_precision: str = PREFILL_PRECISION) -> list[KernelConfig]:
    """Every kernel configuration of the given formats (default: every preset the attention kernels read; the seal's
    for the tensor formats the seal kernel writes), deduplicated by name."""
    formats = [f for f in PRESETS.values() if kernels_attend(f)] if formats is None else formats
    out: dict[str, KernelConfig] = {}
    for d in head_dims:
        for fmt in formats:
            for tf in (fmt.k, fmt.v):
                if kernel_refusal(tf, ("seal",)) is None:  # allocB rows: the reference quantizer seals them
                    c = seal_kernel_config(tf, d, block_size_of(fmt), q_dtype)
                    out.setdefault(c.name, c)
            for c in decode_kernel_configs(fmt, d, max(gqa_ratios), q_dtype, precision=precision):
                out.setdefault(c.name, c)
            for r in gqa_ratios:
                c = prefill_kernel_config(fmt, d, r, q_dtype, prefill_precision)
                out.setdefault(c.name, c)
    return list(out.values())


def lean_configs() -> list[KernelConfig]:
    """The subset tests/test_kernels_aot.py compiles: every kernel and format at head_dim 128, plus int4 at 64, plus
    the int4 attention kernels at head_dim 128 with the sliding window's and soft-cap's code (Gemma 2/3, Mistral)."""
    cfgs = kernel_configs(head_dims=(128,), gqa_ratios=(8,))
    cfgs += kernel_configs([PRESETS["int4"]], head_dims=(64,), gqa_ratios=(1,))
    int4 = PRESETS["int4"]
    cfgs += decode_kernel_configs(int4, 128, 8, windowed=True)[:1]
    cfgs += [prefill_kernel_config(int4, 128, 8, windowed=True)]
    seen, out = set(), []
    for c in cfgs:
        if c.name not in seen:
            seen.add(c.name)
            out.append(c)
    return out


# ------------------------------------------------------------------------------------------------
# compilation
# ------------------------------------------------------------------------------------------------


@dataclass
class CompiledConfig:
    config: str
    kernel: str
    arch: int
    name: str  # entry point in the PTX / cubin
    num_warps: int
    shared: int  # dynamic shared memory bytes to launch with
    n_regs: int
    spill_stores: int  # bytes, from ptxas -v
    spill_loads: int
    stack: int  # stack frame bytes
    grid: list[str]
    args: list[str]
    global_scratch_size: int
    profile_scratch_size: int
    ptx_version: str
    compile_s: float
    ptx: str = field(repr=False, default="")
    cubin: bytes = field(repr=False, default=b"")

    def row(self) -> dict:
        d = asdict(self)
        d.pop("ptx")
        d.pop("cubin")
        return d


def _ptxas_usage(ptx: str, arch_name: str, ptxas: str, version: str) -> dict:
    """Registers / spills / stack from ``ptxas -v`` with triton's own flags; cached beside triton's compiled kernels
    (``TRITON_CACHE_DIR``) by the PTX, the arch and ptxas's version and size (not its path: every virtual environment,
    a fresh clone's too, has its own copy), since triton caches the compile but not this."""
    key = hashlib.sha256("\0".join((ptx, arch_name, version, str(Path(ptxas).stat().st_size))).encode()).hexdigest()
    cached = Path(os.environ.get("TRITON_CACHE_DIR", _REPO_CACHE)) / "trtkv-ptxas" / f"{key}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    usage = _run_ptxas(ptx, arch_name, ptxas)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")  # written whole, then renamed: a concurrent reader never sees half
    tmp.write_text(json.dumps(usage))
    tmp.replace(cached)
    return usage


def _run_ptxas(ptx: str, arch_name: str, ptxas: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([ptxas, "-v", "-lineinfo", "--regAllocOptLevel=2", f"--gpu-name={arch_name}", str(src),
                              "-o", str(Path(tmp) / "k.o")], capture_output=True, text=True, check=True)
    log = res.stderr + res.stdout

    def grab(pat: str) -> int:
        m = re.search(pat, log)
        return int(m.group(1)) if m else 0

    return {"n_regs": grab(r"Used (\d+) registers"), "spill_stores": grab(r"(\d+) bytes spill stores"),
            "spill_loads": grab(r"(\d+) bytes spill loads"), "stack": grab(r"(\d+) bytes stack frame")}


def _pointer_attrs(cfg: KernelConfig) -> dict:
    """Every pointer argument is 16-byte aligned (torch / TensorRT allocations are 256-byte aligned):
    the hint triton's JIT adds at launch, which lets loads and stores vectorize."""
    names = cfg.fn().arg_names
    return {(names.index(a),): [["tt.divisibility", 16]] for a in cfg.args if cfg.signature[a].startswith("*")}


def compile_config(cfg: KernelConfig, arch: int, options: dict | None = None) -> CompiledConfig:
    """Compile one configuration for sm_<arch> (80 or 90) on any machine."""
    from triton.backends.nvidia.compiler import get_ptxas

    t0 = time.time()
    src = ASTSource(cfg.fn(), signature=cfg.signature, constexprs=cfg.constexprs, attrs=_pointer_attrs(cfg))
    opts = {"num_warps": cfg.num_warps, **(options or {})}
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    ptx = ck.asm["ptx"]
    target = re.search(r"^\.target\s+(\w+)", ptx, re.M)
    version = re.search(r"^\.version\s+([\d.]+)", ptx, re.M)
    tool = get_ptxas(arch)
    usage = _ptxas_usage(ptx, target.group(1) if target else f"sm_{arch}", tool.path, str(tool.version))
    md = ck.metadata
    return CompiledConfig(
        config=cfg.name, kernel=cfg.kernel, arch=arch, name=md.name, num_warps=md.num_warps, shared=md.shared,
        grid=cfg.grid, args=cfg.args, global_scratch_size=getattr(md, "global_scratch_size", 0) or 0,
        profile_scratch_size=getattr(md, "profile_scratch_size", 0) or 0,
        ptx_version=version.group(1) if version else "", compile_s=round(time.time() - t0, 2),
        ptx=ptx, cubin=ck.asm["cubin"], **usage)


def eval_grid(grid: list[str], **dims: int) -> tuple[int, int, int]:
    """Evaluate a grid formula (``KernelConfig.grid``) for concrete dims, e.g. ``eval_grid(g, batch=2, kv_heads=8,
    max_blocks=64)``."""
    env = {"cdiv": lambda a, b: -(-int(a) // int(b)), **dims}
    return tuple(int(eval(expr, {"__builtins__": {}}, env)) for expr in grid)


def compile_for(fmt: KVFormat | str, head_dim: int, gqa_ratio: int, arch: int, q_dtype: str = "fp16",
                decode_precision: str = DEFAULT_PRECISION,
                prefill_precision: str = PREFILL_PRECISION) -> dict[str, CompiledConfig]:
    """Everything one model layer needs, compiled for sm_<arch>: keys "seal_k", "seal_v",
    "decode_partition", "decode_reduce", "prefill" (what the TensorRT plugin glue calls)."""
    fmt = get_format(fmt)
    part, red = decode_kernel_configs(fmt, head_dim, gqa_ratio, q_dtype, precision=decode_precision)
    bs = block_size_of(fmt)
    cfgs = {"seal_k": seal_kernel_config(fmt.k, head_dim, bs, q_dtype),
            "seal_v": seal_kernel_config(fmt.v, head_dim, bs, q_dtype),
            "decode_partition": part, "decode_reduce": red,
            "prefill": prefill_kernel_config(fmt, head_dim, gqa_ratio, q_dtype, prefill_precision)}
    return {key: compile_config(c, arch) for key, c in cfgs.items()}


def _compile_job(job: tuple[KernelConfig, int]) -> CompiledConfig:
    return compile_config(*job)


def compile_all(configs: list[KernelConfig], archs=ARCHS, out_dir: str | Path | None = None,
                verbose: bool = False, workers: int | None = None) -> list[CompiledConfig]:
    """Every configuration for every arch, in that order, on ``workers`` processes (default: one per core). Each
    compile is one core's work for about a second when triton's cache is cold, so on a fresh machine the whole
    table's minutes divide by the cores; forked workers start at once (they compile on the CPU, no CUDA)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(cfg, arch) for arch in archs for cfg in configs]
    workers = max(1, min(len(jobs), workers or os.cpu_count() or 1))
    results = []
    with contextlib.ExitStack() as stack:
        if workers == 1:
            done = map(_compile_job, jobs)
        else:
            pool = stack.enter_context(ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")))
            done = pool.map(_compile_job, jobs)
        for (cfg, arch), res in zip(jobs, done):  # in order, as they finish
            results.append(res)
            if verbose:
                print(f"sm_{arch} {cfg.name}: regs {res.n_regs} spills {res.spill_stores}/{res.spill_loads} "
                      f"smem {res.shared} ({res.compile_s}s)", file=sys.stderr)
            if out_dir is not None:
                d = Path(out_dir) / f"sm_{arch}"
                d.mkdir(parents=True, exist_ok=True)
                (d / f"{cfg.name}.ptx").write_text(res.ptx)
                (d / f"{cfg.name}.cubin").write_bytes(res.cubin)
    if out_dir is not None:
        table = {"triton_version": triton.__version__, "grid_vars": GRID_VARS,
                 "kernels": [r.row() for r in results],
                 "configs": {c.name: {"kernel": c.kernel, "constexprs": c.constexprs, "signature": c.signature}
                             for c in configs}}
        Path(out_dir, "kernels.json").write_text(json.dumps(table, indent=1))
    return results


def format_table(results: list[CompiledConfig]) -> str:
    lines = [f"{'config':90s} {'arch':>5s} {'regs':>5s} {'spill':>6s} {'stack':>6s} {'smem':>7s}"]
    for r in results:
        lines.append(f"{r.config:90s} sm_{r.arch:<2d} {r.n_regs:5d} {r.spill_stores:6d} {r.stack:6d} {r.shared:7d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtkv.plugins.aot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="output directory for PTX, cubin and the table (default: none; the compiles still fill TRITON_CACHE_DIR)")
    ap.add_argument("--arch", type=int, nargs="+", default=list(ARCHS))
    ap.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    ap.add_argument("--gqa-ratios", type=int, nargs="+", default=list(GQA_RATIOS))
    ap.add_argument("--formats", nargs="+", default=None, help="presets or spec strings (default: every preset the kernels read)")
    ap.add_argument("--precision", default=DEFAULT_PRECISION, choices=["ieee", "tf32", "tf32x3"], help="decode dots")
    ap.add_argument("--prefill-precision", default=PREFILL_PRECISION, choices=["ieee", "tf32", "tf32x3"])
    ap.add_argument("--q-dtype", default="fp16", choices=["fp16", "bf16", "fp32"], help="query / new K,V dtype")
    ap.add_argument("--lean", action="store_true", help="the test subset only")
    a = ap.parse_args(argv)
    if a.lean:
        configs = lean_configs()
    else:
        fmts = None if a.formats is None else [get_format(f) for f in a.formats]
        configs = kernel_configs(fmts, tuple(a.head_dims), tuple(a.gqa_ratios), q_dtype=a.q_dtype,
                                 precision=a.precision, prefill_precision=a.prefill_precision)
    results = compile_all(configs, tuple(a.arch), a.out, verbose=True)
    print(format_table(results))
    bad = [r for r in results if r.spill_stores > SPILL_LIMIT_BYTES]
    print(f"{len(results)} kernels compiled{f' to {a.out}' if a.out else ''}; {len(bad)} spill more than {SPILL_LIMIT_BYTES} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
