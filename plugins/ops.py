"""Python launchers and torch custom ops (namespace ``trtkv``) for the kernels in ``trtkv.plugins.kernels``.

Custom ops (importing this module registers them):

    torch.ops.trtkv.quantize_append(rows, slot_mapping, data, scale, zero, fmt,
                                    static_scale=None, smooth=None, clip=None) -> ()      # mutates pool tensors
    torch.ops.trtkv.paged_decode_attention(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero,
                                           block_table, context_lens, k_fmt, v_fmt,
                                           k_static_scale=None, k_smooth=None, v_static_scale=None, v_smooth=None,
                                           sm_scale=None, partition_size=512, max_context_len=None,
                                           precision="auto", k_new_data=None, k_new_scale=None, k_new_zero=None,
                                           v_new_data=None, v_new_scale=None, v_new_zero=None)
                                           -> Tensor[batch, heads, head_dim]
    torch.ops.trtkv.paged_prefill_attention(q, cu_seqlens_q, k_data, k_scale, k_zero, v_data, v_scale, v_zero,
                                            block_table, context_lens, k_fmt, v_fmt,
                                            k_static_scale=None, k_smooth=None, v_static_scale=None, v_smooth=None,
                                            sm_scale=None, max_seqlen_q=None, precision="auto",
                                            k_new_data=None, ..., v_new_zero=None) -> Tensor[total_q, heads, head_dim]

New rows (optional, all six or none): this step's quantized K/V in pool-row form ``[rows, kv_heads, ...]``
(decode: row b; prefill: rows cu[b] .. cu[b+1]-1) replace the pool for each sequence's last positions,
so attention sees the pool *after* the append without the pool being written (the pure-engine
contract of docs/plugins.md). Without them the pool must already hold every position.

Formats are ``TensorFormat.short()`` spec strings (``"int4:g64:asym:smooth:hadamard"``). Static scales may be
``[]``, ``[kv_heads]`` or ``[kv_heads, head_dim]``; smoothing factors ``[kv_heads, head_dim]``; ``clip`` ``[]``
or ``[kv_heads]``.

Dispatch: CUDA tensors run the compiled Triton kernels. CPU tensors run the same kernels under the
Triton interpreter when ``TRITON_INTERPRET=1`` is set in the environment at call time, else the torch
reference (``trtkv.plugins.reference``: write_paged / gather_paged + float64 attention). The meta
("fake") implementations give shapes for torch.compile / export.

``precision`` is the ``tl.dot`` input precision of the attention products: "auto" = "ieee" under the
interpreter; on GPUs "tf32x3" for decode (3-pass tf32 on tensor cores, ~fp32 accurate; decode is memory
bound) and "tf32" for prefill (one pass: operands rounded to 10 mantissa bits like fp16 flash attention,
fp32 accumulation, ~1e-3 relative on scores). Any of "ieee", "tf32", "tf32x3" may be forced.
A context of length 0 yields zeros. Decode partitions default to 512 tokens: the grid is
(batch, kv_heads, cdiv(max_context_len, 512)), so one 128k sequence with 8 KV heads runs 2048 programs.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

import torch

from trtkv.cache_layout import KVPool, PagedKVLayout
from trtkv.errors import TrtkvError
from trtkv.formats import KVFormat, TensorFormat, parse_tensor_spec
from trtkv.quant import TensorParams, hadamard_matrix

from . import reference as _ref

try:
    from . import kernels as _k
except ImportError:  # triton not installed (the `kernels` extra): the CPU reference path still works
    _k = None

DEFAULT_PARTITION = 512  # == kernels.DEFAULT_PARTITION

_REPO_CACHE = Path(__file__).resolve().parents[1] / ".triton_cache"
if (_REPO_CACHE.parent / "pyproject.toml").is_file():
    os.environ.setdefault("TRITON_CACHE_DIR", str(_REPO_CACHE))


DECODE_PRECISION = "tf32x3"  # "auto" on GPUs: decode is memory bound, so ~fp32-accurate 3-pass tf32 is nearly free
PREFILL_PRECISION = "tf32"  # prefill is compute bound: one tf32 pass (fp16-like operand rounding, fp32 accumulate)


def _kernels():
    if _k is None:
        raise TrtkvError("the Triton kernels need the triton package", "pip install 'trtkv[kernels]'")
    return _k


def interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _fmt(spec: str | TensorFormat) -> TensorFormat:
    return spec if isinstance(spec, TensorFormat) else parse_tensor_spec(spec)


def _spec(spec: str | TensorFormat) -> str:
    return spec.short() if isinstance(spec, TensorFormat) else spec


def _dummy(device, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(1, dtype=dtype, device=device)


def _per_channel(t: torch.Tensor | None, kv_heads: int, head_dim: int, device, what: str) -> torch.Tensor:
    """[] / [H] / [H, D] constant -> contiguous [H, D] float32 (the kernels' single layout)."""
    if t is None:
        raise TrtkvError(f"this KV format needs {what}", "pass the calibrated tensors (run `trtkv calibrate`)")
    t = t.to(device=device, dtype=torch.float32)
    if t.dim() == 0:
        t = t.expand(kv_heads, head_dim)
    elif t.dim() == 1:
        t = t.view(kv_heads, 1).expand(kv_heads, head_dim)
    if tuple(t.shape) != (kv_heads, head_dim):
        raise TrtkvError(f"{what} has shape {tuple(t.shape)}, expected [], [{kv_heads}] or [{kv_heads}, {head_dim}]")
    return t.contiguous()


def _precision(precision: str, interpret: bool, gpu_default: str) -> str:
    if precision == "auto":
        return "ieee" if interpret else gpu_default
    if precision not in ("ieee", "tf32", "tf32x3"):
        raise ValueError(f"precision must be auto, ieee, tf32 or tf32x3, got {precision!r}")
    return precision


def _check_pool(fmt: TensorFormat, data, scale, zero, head_dim: int, what: str) -> None:
    packed = head_dim // fmt.traits.codes_per_byte
    if data.dim() != 4 or data.shape[-1] != packed:
        raise TrtkvError(f"{what} data has shape {tuple(data.shape)}, expected [blocks, kv_heads, block_size, {packed}]")
    want = {"fp16": (torch.float16,), "fp8_e4m3": (torch.uint8,), "int4": (torch.uint8,),
            "int8": (torch.int8,) if (fmt.symmetric or fmt.is_static) else (torch.uint8,)}[fmt.dtype]
    if data.dtype not in want:
        raise TrtkvError(f"{what} data dtype {data.dtype} does not match format {fmt.short()} (want {want[0]})")
    if fmt.is_dynamic:
        g = fmt.groups(head_dim)
        if scale is None or tuple(scale.shape) != (*data.shape[:3], g) or scale.dtype != torch.float16:
            raise TrtkvError(f"{what} needs an fp16 scale pool of shape {(*data.shape[:3], g)}")
        if not fmt.symmetric and (zero is None or zero.shape != scale.shape or zero.dtype != torch.float16):
            raise TrtkvError(f"{what} needs an fp16 zero-point pool of shape {(*data.shape[:3], g)}")
    if fmt.dtype == "int4" and head_dim % 2:
        raise TrtkvError("int4 needs an even head_dim")


def check_head_dim(head_dim: int) -> None:
    """The kernels tile head_dim whole (tl.arange) and split it in even / odd halves fed to tl.dot (K >= 16)."""
    if head_dim < 32 or head_dim > 256 or head_dim & (head_dim - 1):
        raise TrtkvError(f"the Triton KV kernels support head_dim 32, 64, 128 or 256, got {head_dim}",
                         "use the torch reference path (trtkv.plugins.reference) or the native attention mode")


def _contig(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


# ------------------------------------------------------------------------------------------------
# launchers (raw tensors; interpret=True runs the interpreter copy of the kernels)
# ------------------------------------------------------------------------------------------------


def launch_quantize_append(rows, slot_mapping, data, scale, zero, fmt, static_scale=None, smooth=None, clip=None,
                           interpret: bool | None = None) -> None:
    """Quantize rows [tokens, kv_heads, head_dim] into the pool tensors (in place) with the Triton kernel."""
    _k = _kernels()
    interpret = (not rows.is_cuda) if interpret is None else interpret
    tf = _fmt(fmt)
    tokens, kvh, head_dim = rows.shape
    check_head_dim(head_dim)
    _check_pool(tf, data, scale, zero, head_dim, "pool")
    for t in (data, scale, zero):
        if t is not None and not t.is_contiguous():
            raise TrtkvError("pool tensors must be contiguous (the kernel writes them in place)")
    if tokens == 0:
        return
    dev = rows.device
    rows = rows.contiguous()
    slot_mapping = slot_mapping.contiguous()
    cfg = _k.append_config(tf, head_dim, interpret=interpret)
    c = cfg["constexprs"]
    f32 = _dummy(dev)
    args = dict(
        x_ptr=rows, slot_ptr=slot_mapping, data_ptr=data,
        scale_ptr=scale if scale is not None else _dummy(dev, torch.float16),
        zero_ptr=zero if zero is not None else _dummy(dev, torch.float16),
        static_scale_ptr=_per_channel(static_scale, kvh, head_dim, dev, "a static scale") if c["STATIC"] else f32,
        smooth_ptr=_per_channel(smooth, kvh, head_dim, dev, "smoothing factors") if c["SMOOTH"] else f32,
        clip_ptr=(_per_channel(clip, kvh, 1, dev, "clip")[:, 0].contiguous() if clip is not None
                  else torch.ones(kvh, dtype=torch.float32, device=dev)),
        had_ptr=hadamard_matrix(head_dim, torch.float32, dev).contiguous() if c["HAD"] else f32,
        num_tokens=tokens, num_kv_heads=kvh, block_size=data.shape[2],
    )
    kmod = _k.load_kernels(interpret)
    grid = _k.append_grid(tokens, kvh, c)
    kmod.quantize_append_kernel[grid](**args, **c, num_warps=cfg["num_warps"])


def _attn_common(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_fmt, v_fmt,
                 k_static_scale, k_smooth, v_static_scale, v_smooth):
    kf, vf = _fmt(k_fmt), _fmt(v_fmt)
    head_dim = q.shape[-1]
    check_head_dim(head_dim)
    kvh = k_data.shape[1]
    if q.shape[1] % kvh:
        raise TrtkvError(f"query heads {q.shape[1]} are not a multiple of kv heads {kvh}")
    _check_pool(kf, k_data, k_scale, k_zero, head_dim, "K pool")
    _check_pool(vf, v_data, v_scale, v_zero, head_dim, "V pool")
    dev = q.device
    f32, f16 = _dummy(dev), _dummy(dev, torch.float16)
    tensors = dict(
        k_data_ptr=k_data.contiguous(), k_scale_ptr=_contig(k_scale) if k_scale is not None else f16,
        k_zero_ptr=_contig(k_zero) if k_zero is not None else f16,
        v_data_ptr=v_data.contiguous(), v_scale_ptr=_contig(v_scale) if v_scale is not None else f16,
        v_zero_ptr=_contig(v_zero) if v_zero is not None else f16,
        k_static_ptr=_per_channel(k_static_scale, kvh, head_dim, dev, "a K static scale") if kf.is_static else f32,
        k_smooth_ptr=_per_channel(k_smooth, kvh, head_dim, dev, "K smoothing factors") if kf.smooth else f32,
        v_static_ptr=_per_channel(v_static_scale, kvh, head_dim, dev, "a V static scale") if vf.is_static else f32,
        v_smooth_ptr=_per_channel(v_smooth, kvh, head_dim, dev, "V smoothing factors") if vf.smooth else f32,
        had_ptr=hadamard_matrix(head_dim, torch.float32, dev).contiguous() if (kf.hadamard or vf.hadamard) else f32,
    )
    return kf, vf, tensors


def _new_rows(t: dict, kf: TensorFormat, vf: TensorFormat, rows: int, kvh: int, head_dim: int, new: tuple) -> bool:
    """Validate this step's new rows (pool-row form, ``[rows, kv_heads, ...]``) and add them to ``t``;
    without them the pool tensors stand in (never read: NEW_ROWS is off)."""
    k_data, k_scale, k_zero, v_data, v_scale, v_zero = new
    names = ("k_new_data_ptr", "k_new_scale_ptr", "k_new_zero_ptr", "v_new_data_ptr", "v_new_scale_ptr",
             "v_new_zero_ptr")
    if k_data is None and v_data is None:
        for n, src in zip(names, ("k_data_ptr", "k_scale_ptr", "k_zero_ptr", "v_data_ptr", "v_scale_ptr",
                                  "v_zero_ptr")):
            t[n] = t[src]
        return False
    if k_data is None or v_data is None:
        raise TrtkvError("new rows need both K and V (k_new_data and v_new_data)")
    for fmt, data, scale, zero, what in ((kf, k_data, k_scale, k_zero, "K"), (vf, v_data, v_scale, v_zero, "V")):
        if data.dim() != 3 or data.shape[0] != rows or data.shape[1] != kvh:
            raise TrtkvError(f"new {what} rows have shape {tuple(data.shape)}, expected [{rows}, {kvh}, packed_dim]")
        as_pool = lambda x: None if x is None else x.reshape(x.shape[0], x.shape[1], 1, x.shape[2])  # noqa: E731
        _check_pool(fmt, as_pool(data), as_pool(scale), as_pool(zero), head_dim, f"new {what} rows")
    f16 = _dummy(k_data.device, torch.float16)
    for n, x in zip(names, new):
        t[n] = x.contiguous() if x is not None else f16
    return True


def launch_paged_decode(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, block_table, context_lens, k_fmt, v_fmt,
                        k_static_scale=None, k_smooth=None, v_static_scale=None, v_smooth=None, sm_scale=None,
                        partition_size: int = DEFAULT_PARTITION, max_context_len: int | None = None,
                        precision: str = "auto", interpret: bool | None = None,
                        k_new_data=None, k_new_scale=None, k_new_zero=None, v_new_data=None, v_new_scale=None,
                        v_new_zero=None) -> torch.Tensor:
    """Split-K decode attention: q [batch, heads, head_dim] -> [batch, heads, head_dim] (q's dtype).

    With ``*_new_*`` (this step's quantized rows ``[batch, kv_heads, ...]``, the pool-row form
    ``quantize_append`` writes) the newest position ``context_len - 1`` is read from new row b instead of
    the pool: attention over the pool *after* the append, without writing it (pure-engine contract)."""
    _k = _kernels()
    interpret = (not q.is_cuda) if interpret is None else interpret
    kf, vf, t = _attn_common(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_fmt, v_fmt,
                             k_static_scale, k_smooth, v_static_scale, v_smooth)
    batch, heads, head_dim = q.shape
    kvh, block_size = k_data.shape[1], k_data.shape[2]
    new_rows = _new_rows(t, kf, vf, batch, kvh, head_dim,
                         (k_new_data, k_new_scale, k_new_zero, v_new_data, v_new_scale, v_new_zero))
    block_table = block_table.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    max_blocks = block_table.shape[1]
    if max_context_len is None:
        max_context_len = max_blocks * block_size
    cfg = _k.decode_config(kf, vf, head_dim, heads // kvh, partition_size,
                           _precision(precision, interpret, DECODE_PRECISION), interpret, new_rows=new_rows)
    grid_p, grid_r = _k.decode_grids(batch, kvh, max_context_len, partition_size)
    nparts = grid_p[2]
    out = torch.empty_like(q)
    if batch == 0:
        return out
    dev = q.device
    part_m = torch.empty((batch, heads, nparts), dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((batch, heads, nparts, head_dim), dtype=torch.float32, device=dev)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    kmod = _k.load_kernels(interpret)
    q = q.contiguous()
    kmod.paged_decode_partition_kernel[grid_p](
        q, t["k_data_ptr"], t["k_scale_ptr"], t["k_zero_ptr"], t["v_data_ptr"], t["v_scale_ptr"], t["v_zero_ptr"],
        t["k_new_data_ptr"], t["k_new_scale_ptr"], t["k_new_zero_ptr"], t["v_new_data_ptr"], t["v_new_scale_ptr"],
        t["v_new_zero_ptr"],
        t["k_static_ptr"], t["k_smooth_ptr"], t["had_ptr"], block_table, context_lens, part_m, part_l, part_acc,
        scale * _k.LOG2E, heads, kvh, block_size, max_blocks, nparts,
        **cfg["partition"]["constexprs"], num_warps=cfg["partition"]["num_warps"])
    kmod.paged_decode_reduce_kernel[grid_r](
        part_m, part_l, part_acc, context_lens, t["v_static_ptr"], t["v_smooth_ptr"], t["had_ptr"], out,
        heads, kvh, nparts, **cfg["reduce"]["constexprs"], num_warps=cfg["reduce"]["num_warps"])
    return out


def launch_paged_prefill(q, cu_seqlens_q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, block_table, context_lens,
                         k_fmt, v_fmt, k_static_scale=None, k_smooth=None, v_static_scale=None, v_smooth=None,
                         sm_scale=None, max_seqlen_q: int | None = None, precision: str = "auto",
                         interpret: bool | None = None, k_new_data=None, k_new_scale=None, k_new_zero=None,
                         v_new_data=None, v_new_scale=None, v_new_zero=None) -> torch.Tensor:
    """Causal (chunked) prefill attention: q [total_q, heads, head_dim] -> same shape (q's dtype).

    With ``*_new_*`` (``[total_q, kv_heads, ...]``) positions ``context_len - num_new ..`` of sequence b are
    read from new rows ``cu[b] ..`` instead of the pool (pure-engine contract, see launch_paged_decode)."""
    _k = _kernels()
    interpret = (not q.is_cuda) if interpret is None else interpret
    kf, vf, t = _attn_common(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_fmt, v_fmt,
                             k_static_scale, k_smooth, v_static_scale, v_smooth)
    total_q, heads, head_dim = q.shape
    kvh, block_size = k_data.shape[1], k_data.shape[2]
    new_rows = _new_rows(t, kf, vf, total_q, kvh, head_dim,
                         (k_new_data, k_new_scale, k_new_zero, v_new_data, v_new_scale, v_new_zero))
    batch = context_lens.shape[0]
    block_table = block_table.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    cu_seqlens_q = cu_seqlens_q.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    if total_q == 0 or batch == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # one host sync; pass it to avoid
    out.zero_()  # rows of sequences with an empty context stay zero
    cfg = _k.prefill_config(kf, vf, head_dim, heads // kvh, _precision(precision, interpret, PREFILL_PRECISION),
                            interpret, new_rows=new_rows)
    grid = _k.prefill_grid(max_seqlen_q, kvh, batch, cfg["constexprs"])
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    kmod = _k.load_kernels(interpret)
    kmod.paged_prefill_kernel[grid](
        q.contiguous(), cu_seqlens_q, t["k_data_ptr"], t["k_scale_ptr"], t["k_zero_ptr"], t["v_data_ptr"],
        t["v_scale_ptr"], t["v_zero_ptr"], t["k_new_data_ptr"], t["k_new_scale_ptr"], t["k_new_zero_ptr"],
        t["v_new_data_ptr"], t["v_new_scale_ptr"], t["v_new_zero_ptr"], t["k_static_ptr"], t["k_smooth_ptr"], t["v_static_ptr"], t["v_smooth_ptr"],
        t["had_ptr"], block_table, context_lens, out, scale * _k.LOG2E, heads, kvh, block_size,
        block_table.shape[1], **cfg["constexprs"], num_warps=cfg["num_warps"])
    return out


# ------------------------------------------------------------------------------------------------
# torch custom ops
# ------------------------------------------------------------------------------------------------

T = torch.Tensor
OT = Optional[torch.Tensor]


@torch.library.custom_op("trtkv::quantize_append", mutates_args=("data", "scale", "zero"))
def quantize_append(rows: T, slot_mapping: T, data: T, scale: OT, zero: OT, fmt: str,
                    static_scale: OT = None, smooth: OT = None, clip: OT = None) -> None:
    if rows.is_cuda:
        launch_quantize_append(rows, slot_mapping, data, scale, zero, fmt, static_scale, smooth, clip, interpret=False)
    elif interpret_requested():
        launch_quantize_append(rows, slot_mapping, data, scale, zero, fmt, static_scale, smooth, clip, interpret=True)
    else:
        _ref.quantize_append_ref(rows, slot_mapping, data, scale, zero, fmt, static_scale, smooth, clip)


@quantize_append.register_fake
def _(rows, slot_mapping, data, scale, zero, fmt, static_scale=None, smooth=None, clip=None) -> None:
    return None


def _ref_params(static_scale, smooth) -> TensorParams:
    return TensorParams(scale=static_scale, smooth=smooth)


@torch.library.custom_op("trtkv::paged_decode_attention", mutates_args=())
def paged_decode_attention(q: T, k_data: T, k_scale: OT, k_zero: OT, v_data: T, v_scale: OT, v_zero: OT,
                           block_table: T, context_lens: T, k_fmt: str, v_fmt: str,
                           k_static_scale: OT = None, k_smooth: OT = None, v_static_scale: OT = None,
                           v_smooth: OT = None, sm_scale: Optional[float] = None,
                           partition_size: int = DEFAULT_PARTITION, max_context_len: Optional[int] = None,
                           precision: str = "auto", k_new_data: OT = None, k_new_scale: OT = None,
                           k_new_zero: OT = None, v_new_data: OT = None, v_new_scale: OT = None,
                           v_new_zero: OT = None) -> T:
    args = (q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, block_table, context_lens, k_fmt, v_fmt,
            k_static_scale, k_smooth, v_static_scale, v_smooth, sm_scale, partition_size, max_context_len, precision)
    new = dict(k_new_data=k_new_data, k_new_scale=k_new_scale, k_new_zero=k_new_zero, v_new_data=v_new_data,
               v_new_scale=v_new_scale, v_new_zero=v_new_zero)
    if q.is_cuda or interpret_requested():
        return launch_paged_decode(*args, interpret=not q.is_cuda, **new)
    kp, vp = _ref_pools(k_data, k_scale, k_zero, v_data, v_scale, v_zero, new, block_table, context_lens, None)
    return _ref.paged_attention_ref(q, None, kp, vp, block_table, context_lens, k_fmt, v_fmt,
                                    _ref_params(k_static_scale, k_smooth), _ref_params(v_static_scale, v_smooth),
                                    sm_scale)


def _ref_pools(k_data, k_scale, k_zero, v_data, v_scale, v_zero, new: dict, block_table, context_lens, cu):
    kp, vp = KVPool(k_data, k_scale, k_zero), KVPool(v_data, v_scale, v_zero)
    if new["k_new_data"] is None:
        return kp, vp
    kn = KVPool(new["k_new_data"], new["k_new_scale"], new["k_new_zero"])
    vn = KVPool(new["v_new_data"], new["v_new_scale"], new["v_new_zero"])
    return (_ref.pool_with_new_rows(kp, kn, block_table, context_lens, cu),
            _ref.pool_with_new_rows(vp, vn, block_table, context_lens, cu))


@paged_decode_attention.register_fake
def _(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, block_table, context_lens, k_fmt, v_fmt,
      k_static_scale=None, k_smooth=None, v_static_scale=None, v_smooth=None, sm_scale=None,
      partition_size=DEFAULT_PARTITION, max_context_len=None, precision="auto", k_new_data=None,
      k_new_scale=None, k_new_zero=None, v_new_data=None, v_new_scale=None, v_new_zero=None):
    return torch.empty_like(q)


@torch.library.custom_op("trtkv::paged_prefill_attention", mutates_args=())
def paged_prefill_attention(q: T, cu_seqlens_q: T, k_data: T, k_scale: OT, k_zero: OT, v_data: T, v_scale: OT,
                            v_zero: OT, block_table: T, context_lens: T, k_fmt: str, v_fmt: str,
                            k_static_scale: OT = None, k_smooth: OT = None, v_static_scale: OT = None,
                            v_smooth: OT = None, sm_scale: Optional[float] = None,
                            max_seqlen_q: Optional[int] = None, precision: str = "auto", k_new_data: OT = None,
                            k_new_scale: OT = None, k_new_zero: OT = None, v_new_data: OT = None,
                            v_new_scale: OT = None, v_new_zero: OT = None) -> T:
    args = (q, cu_seqlens_q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, block_table, context_lens, k_fmt,
            v_fmt, k_static_scale, k_smooth, v_static_scale, v_smooth, sm_scale, max_seqlen_q, precision)
    new = dict(k_new_data=k_new_data, k_new_scale=k_new_scale, k_new_zero=k_new_zero, v_new_data=v_new_data,
               v_new_scale=v_new_scale, v_new_zero=v_new_zero)
    if q.is_cuda or interpret_requested():
        return launch_paged_prefill(*args, interpret=not q.is_cuda, **new)
    kp, vp = _ref_pools(k_data, k_scale, k_zero, v_data, v_scale, v_zero, new, block_table, context_lens, cu_seqlens_q)
    return _ref.paged_attention_ref(q, cu_seqlens_q, kp, vp, block_table, context_lens, k_fmt, v_fmt,
                                    _ref_params(k_static_scale, k_smooth), _ref_params(v_static_scale, v_smooth),
                                    sm_scale)


@paged_prefill_attention.register_fake
def _(q, cu_seqlens_q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, block_table, context_lens, k_fmt, v_fmt,
      k_static_scale=None, k_smooth=None, v_static_scale=None, v_smooth=None, sm_scale=None, max_seqlen_q=None,
      precision="auto", k_new_data=None, k_new_scale=None, k_new_zero=None, v_new_data=None, v_new_scale=None,
      v_new_zero=None):
    return torch.empty_like(q)


# ------------------------------------------------------------------------------------------------
# convenience wrappers on trtkv objects (layout, KVPool, TensorParams)
# ------------------------------------------------------------------------------------------------


def _p(params: TensorParams | None, name: str):
    return None if params is None else getattr(params, name)


def append_kv(layout: PagedKVLayout, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              k_pool: KVPool, v_pool: KVPool, k_params: TensorParams | None = None,
              v_params: TensorParams | None = None) -> None:
    """Quantize new K and V rows [tokens, kv_heads, head_dim] into their pools (``write_paged`` semantics)."""
    for which, rows, pool, params in (("k", k, k_pool, k_params), ("v", v, v_pool, v_params)):
        torch.ops.trtkv.quantize_append(rows, slot_mapping, pool.data, pool.scale, pool.zero,
                                        layout.tensor_format(which).short(), _p(params, "scale"),
                                        _p(params, "smooth"), _p(params, "clip"))


def decode_attention(q: torch.Tensor, layout: PagedKVLayout | KVFormat, k_pool: KVPool, v_pool: KVPool,
                     block_table: torch.Tensor, context_lens: torch.Tensor, k_params: TensorParams | None = None,
                     v_params: TensorParams | None = None, sm_scale: float | None = None,
                     partition_size: int = DEFAULT_PARTITION, max_context_len: int | None = None,
                     precision: str = "auto") -> torch.Tensor:
    fmt = layout.fmt if isinstance(layout, PagedKVLayout) else layout
    return torch.ops.trtkv.paged_decode_attention(
        q, k_pool.data, k_pool.scale, k_pool.zero, v_pool.data, v_pool.scale, v_pool.zero, block_table,
        context_lens, fmt.k.short(), fmt.v.short(), _p(k_params, "scale"), _p(k_params, "smooth"),
        _p(v_params, "scale"), _p(v_params, "smooth"), sm_scale, partition_size, max_context_len, precision)


def prefill_attention(q: torch.Tensor, cu_seqlens_q: torch.Tensor, layout: PagedKVLayout | KVFormat, k_pool: KVPool,
                      v_pool: KVPool, block_table: torch.Tensor, context_lens: torch.Tensor,
                      k_params: TensorParams | None = None, v_params: TensorParams | None = None,
                      sm_scale: float | None = None, max_seqlen_q: int | None = None,
                      precision: str = "auto") -> torch.Tensor:
    fmt = layout.fmt if isinstance(layout, PagedKVLayout) else layout
    return torch.ops.trtkv.paged_prefill_attention(
        q, cu_seqlens_q, k_pool.data, k_pool.scale, k_pool.zero, v_pool.data, v_pool.scale, v_pool.zero,
        block_table, context_lens, fmt.k.short(), fmt.v.short(), _p(k_params, "scale"), _p(k_params, "smooth"),
        _p(v_params, "scale"), _p(v_params, "smooth"), sm_scale, max_seqlen_q, precision)
