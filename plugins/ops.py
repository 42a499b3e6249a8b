"""Python launchers and torch custom ops (namespace ``trtkv``) for the kernels in ``trtkv.plugins.kernels``.

Custom ops (importing this module registers them); the cache contract is docs/kv-cache-format.md
("Sealed blocks and the open block", "The engine step contract"):

    torch.ops.trtkv.seal_blocks(rows, blocks, data, scale, zero, fmt, static_scale=None, smooth=None, clip=None)
        -> ()                        # quantizes full blocks rows [n, kv_heads, block_size, head_dim] into
                                     # pool blocks ``blocks`` [n] (mutates data / scale / zero)
    torch.ops.trtkv.paged_decode_attention(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail,
                                           k_new, v_new, block_table, context_lens, slot_ids, k_fmt, v_fmt,
                                           k_static_scale=None, k_smooth=None, v_static_scale=None, v_smooth=None,
                                           sm_scale=None, partition_size=512, precision="auto", window=0,
                                           softcap=0.0)
        -> Tensor[batch, heads, head_dim]
    torch.ops.trtkv.paged_prefill_attention(q, cu_seqlens_q, k_data, ..., v_zero, k_tail, v_tail, k_new, v_new,
                                            block_table, context_lens, slot_ids, k_fmt, v_fmt, ...,
                                            sm_scale=None, max_seqlen_q=None, precision="auto", window=0,
                                            softcap=0.0)
        -> Tensor[total_q, heads, head_dim]

Attention of new token ``t`` of sequence ``b`` (position ``context_lens[b] + t``) covers the
``context_lens[b] // block_size`` sealed blocks through ``block_table[b]``, the open block's
``context_lens[b] % block_size`` rows in ``k_tail / v_tail[slot_ids[b]]`` (fp16) and this step's rows
``k_new / v_new`` 0 .. t (rounded to fp16; decode: row b, prefill: rows ``cu[b] ..``). Nothing is written:
the runtime stores the new rows in the open block afterwards and seals it when it is full.

``window`` > 0 (a sliding-window layer): a query at position p sees only keys at positions ``> p - window``
(transformers' rule); the kernels start at the first sealed block the window reaches and never read the
block-table entries or pool blocks before it, so a window ring's table (``WindowRing.block``) may stand there.
``softcap`` > 0 (Gemma 2): scores become ``softcap * tanh(score / softcap)`` after the ``sm_scale`` and before
the mask. Both default to 0 (none).

The custom ops take formats as ``TensorFormat.short()`` spec strings (``"int4:bchannel:asym"``: a torch op schema
carries no objects), parsed once per distinct string (``_spec_format``); the launchers, the dispatchers the custom ops
call (``seal_into``, ``decode``, ``prefill``) and the wrappers on trtkv objects (``seal_kv``, ``decode_attention``,
``prefill_attention``: what the runtime calls on its hot path) take ``TensorFormat`` objects and never parse.
Static scales may be ``[]``, ``[kv_heads]`` or ``[kv_heads, head_dim]``; smoothing factors ``[kv_heads, head_dim]``;
``clip`` ``[]`` or ``[kv_heads]``.

Dispatch: CUDA tensors run the compiled Triton kernels. CPU tensors run the same kernels under the
Triton interpreter when ``TRITON_INTERPRET=1`` is set in the environment at call time, else the torch
reference (``trtkv.plugins.reference``: seal_blocks / gather_paged + float64 attention). The meta
("fake") implementations give shapes for torch.compile / export.

``precision`` is the ``tl.dot`` input precision of the attention products: "auto" = "ieee" under the
interpreter; on GPUs "tf32x3" for decode (3-pass tf32 on tensor cores, ~fp32 accurate; decode is memory
bound) and "tf32" for prefill (one pass: operands rounded to 10 mantissa bits like fp16 flash attention,
fp32 accumulation, ~1e-3 relative on scores). Any of "ieee", "tf32", "tf32x3" may be forced.
Head dim, block size and partition limits are ``contract.LIMITS``; launch grids are ``contract``'s.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from trtkv.cache_layout import KVPool, PagedKVLayout, store_quantized
from trtkv.errors import TrtkvError
from trtkv.formats import MAX_SINK_TOKENS, KVFormat, TensorFormat, channel_offsets
from trtkv.quant import QuantizedTensor, TensorParams, codebook_of, hadamard_matrix, per_channel, widths_of
from trtkv.rope import RopeRows

from . import contract as C
from . import reference as _ref

try:
    from . import kernels as _k
except ImportError:  # triton not installed (the `kernels` extra): the CPU reference path still works
    _k = None

DEFAULT_PARTITION = C.LIMITS.default_partition

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


def _dummy(device, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(1, dtype=dtype, device=device)


def _per_channel(t: torch.Tensor | None, kv_heads: int, head_dim: int, device, what: str) -> torch.Tensor:
    """``quant.per_channel`` on ``device``; a format that needs the constant gets an error when it is missing."""
    if t is None:
        raise TrtkvError(f"this KV format needs {what}", "pass the calibrated tensors (run `trtkv calibrate`)")
    return per_channel(t.to(device=device, dtype=torch.float32), kv_heads, head_dim, what)


def _precision(precision: str, interpret: bool, gpu_default: str) -> str:
    if precision == "auto":
        return "ieee" if interpret else gpu_default
    if precision not in ("ieee", "tf32", "tf32x3"):
        raise ValueError(f"precision must be auto, ieee, tf32 or tf32x3, got {precision!r}")
    return precision


def _check_pool(fmt: TensorFormat, data, scale, zero, head_dim: int, what: str) -> None:
    fmt.check_head_dim(head_dim)
    packed = fmt.packed_dim(head_dim)
    if data.dim() != 4 or data.shape[-1] != packed:
        raise TrtkvError(f"{what} data has shape {tuple(data.shape)}, expected [blocks, kv_heads, block_size, {packed}]")
    want = fmt.storage.torch
    if data.dtype != want:
        raise TrtkvError(f"{what} data dtype {data.dtype} does not match format {fmt.short()} (want {want})")
    if fmt.is_dynamic:
        shape = fmt.scale_shape(tuple(data.shape[:1]), data.shape[1], data.shape[2], head_dim)
        if scale is None or tuple(scale.shape) != shape or scale.dtype != torch.float16:
            raise TrtkvError(f"{what} needs an fp16 scale pool of shape {shape}")
        if not fmt.symmetric and (zero is None or zero.shape != scale.shape or zero.dtype != torch.float16):
            raise TrtkvError(f"{what} needs an fp16 zero-point pool of shape {shape}")


def check_head_dim(head_dim: int) -> None:
    problem = C.LIMITS.head_dim_problem(head_dim)
    if problem:
        raise TrtkvError(f"the Triton KV kernels take head_dim that {problem}; got {head_dim}",
                         "use the torch reference path (trtkv.plugins.reference) or the native attention mode")


def check_block_size(block_size: int) -> None:
    problem = C.LIMITS.block_size_problem(block_size)
    if problem:
        raise TrtkvError(f"the Triton KV kernels take a block_size that {problem}; got {block_size}",
                         "use a supported cache block size")


def _window_softcap(window, softcap) -> tuple[int, float]:
    """A sliding window (keys at positions ``> query position - window``, transformers' rule; 0 or None: none) and an
    attention-logit soft-cap (``softcap * tanh(score / softcap)`` on the scaled scores, before the mask; 0 or None:
    none), checked."""
    window, softcap = int(window or 0), float(softcap or 0.0)
    if window < 0 or window >= 2**31:
        raise TrtkvError(f"window must be 0 (none) or a positive int32, got {window}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise TrtkvError(f"softcap must be 0 (none) or a finite positive number, got {softcap}")
    return window, softcap


def _contig(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


# ------------------------------------------------------------------------------------------------
# launchers (raw tensors; interpret=True runs the interpreter copy of the kernels)
# ------------------------------------------------------------------------------------------------


def _seal_outputs(tf: TensorFormat, n: int, kvh: int, bs: int, d: int, dev) -> KVPool:
    layout = PagedKVLayout(KVFormat(name="seal", k=tf, v=TensorFormat(dtype="fp16"), block_size=bs), kvh, d, bs, n)
    return layout.allocate("k", dev)


def _seal_extras(tf: TensorFormat, kvh: int, n: int, head_dim: int, dev, codebook, first_positions, rope, bits) -> dict:
    """The seal kernel's parameters for calibrated storage: the codebook (nuq), each block's first position and the RoPE table
    (prerope), the channel table (allocB), checked; dummies where the format has none."""
    cos, sin = _rope_table(tf, *(rope if rope is not None else (None, None)), head_dim, dev)
    out = dict(cb_ptr=_codebook_table(tf, codebook, kvh, dev), rope_cos_ptr=cos, rope_sin_ptr=sin, pos_ptr=_dummy(dev, torch.int32),
               chan_ptr=_channel_table(tf, bits, kvh, dev))
    if tf.pre_rope:
        if first_positions is None or tuple(first_positions.shape) != (n,):
            raise TrtkvError(f"{tf.short()} stores keys before RoPE: pass each sealed block's first position [{n}]",
                             "the block's index in its sequence times the block size")
        out["pos_ptr"] = first_positions.to(device=dev, dtype=torch.int32).contiguous()
    return out


def launch_seal_pool(rows, fmt, static_scale=None, smooth=None, clip=None, interpret: bool | None = None,
                     codebook=None, first_positions=None, rope=None, bits=None) -> KVPool:
    """Quantize full blocks rows [n, kv_heads, block_size, head_dim] (fp16 / bf16 / fp32) with the Triton seal
    kernel into a pool of exactly these n blocks (codes, scales, zero-points and an ``outN`` format's outlier lists):
    ``reference.seal_ref`` bit for bit (Hadamard, outlier and RoPE formats: to the last bit of a float32 sum).
    ``codebook``: a ``nuq`` format's levels; ``first_positions`` [n] and ``rope`` ``(cos, sin)`` [P, head_dim]:
    keys stored before RoPE; ``bits`` [kv_heads, head_dim]: an ``allocB`` format's code widths."""
    kern = _kernels()
    interpret = (not rows.is_cuda) if interpret is None else interpret
    tf = C.as_tensor_format(fmt)
    if rows.dim() != 4:
        raise TrtkvError(f"seal rows have shape {tuple(rows.shape)}, expected [blocks, kv_heads, block_size, head_dim]")
    n, kvh, bs, head_dim = rows.shape
    check_head_dim(head_dim)
    check_block_size(bs)
    dev = rows.device
    pool = _seal_outputs(tf, n, kvh, bs, head_dim, dev)
    if n == 0:
        return pool
    ext = _seal_extras(tf, kvh, n, head_dim, dev, codebook, first_positions, rope, bits)
    if tf.pre_rope and int(ext["pos_ptr"].max()) + bs > ext["rope_cos_ptr"].shape[0]:
        raise TrtkvError(f"the RoPE table covers positions below {ext['rope_cos_ptr'].shape[0]}, the blocks reach "
                         f"{int(ext['pos_ptr'].max()) + bs - 1}", "pass a table of every position sealed (RopeTable.upto)")
    cfg = kern.seal_config(tf, head_dim, bs)
    c = cfg["constexprs"]
    f32 = _dummy(dev)
    args = dict(
        x_ptr=rows.contiguous(), data_ptr=pool.data,
        scale_ptr=pool.scale if pool.scale is not None else _dummy(dev, torch.float16),
        zero_ptr=pool.zero if pool.zero is not None else _dummy(dev, torch.float16),
        static_scale_ptr=_per_channel(static_scale, kvh, head_dim, dev, "a static scale") if c["STATIC"] else f32,
        smooth_ptr=_per_channel(smooth, kvh, head_dim, dev, "smoothing factors") if c["SMOOTH"] else f32,
        clip_ptr=(_per_channel(clip, kvh, 1, dev, "clip")[:, 0].contiguous() if clip is not None
                  else torch.ones(kvh, dtype=torch.float32, device=dev)),
        had_ptr=hadamard_matrix(head_dim, torch.float32, dev).contiguous() if c["HAD"] else f32,
        oidx_ptr=pool.outlier_index if pool.outlier_index is not None else _dummy(dev, torch.int16),
        oval_ptr=pool.outlier_value if pool.outlier_value is not None else _dummy(dev, torch.float16),
        scratch_ptr=torch.empty(rows.shape, dtype=torch.float32, device=dev) if tf.outliers else f32,
        **ext,
        num_kv_heads=kvh,
    )
    kmod = kern.load_kernels(interpret)
    kmod.seal_kernel[C.seal_grid(n, kvh)](**args, **c, num_warps=cfg["num_warps"])
    return pool


def launch_seal(rows, fmt, static_scale=None, smooth=None, clip=None, interpret: bool | None = None):
    """``launch_seal_pool``'s (codes [n, kv_heads, block_size, packed], scale, zero) in pool-block form (None when the
    format has none), for formats without the calibrated storage features' extra inputs and outputs."""
    pool = launch_seal_pool(rows, fmt, static_scale, smooth, clip, interpret)
    return pool.data, pool.scale, pool.zero


def launch_seal_into(rows, blocks, data, scale, zero, fmt, static_scale=None, smooth=None, clip=None,
                     interpret: bool | None = None, codebook=None, outlier_index=None, outlier_value=None,
                     first_positions=None, rope=None, bits=None) -> None:
    """``launch_seal_pool`` stored at pool blocks ``blocks`` [n] of the pool tensors (in place; an ``outN`` format's
    lists into ``outlier_index`` / ``outlier_value``)."""
    tf = C.as_tensor_format(fmt)
    _check_pool(tf, data, scale, zero, rows.shape[-1], "pool")
    if data.shape[2] != rows.shape[2]:
        raise TrtkvError(f"seal rows hold blocks of {rows.shape[2]} tokens, the pool {data.shape[2]}")
    if tf.outliers and (outlier_index is None or outlier_value is None):
        raise TrtkvError(f"{tf.short()} keeps outlier lists and the pool has none", "allocate the cache with PagedKVLayout.allocate")
    sealed = launch_seal_pool(rows, tf, static_scale, smooth, clip, interpret, codebook, first_positions, rope, bits)
    store_quantized(KVPool(data, scale, zero, None, outlier_index, outlier_value), blocks,
                    QuantizedTensor(sealed.data, sealed.scale, sealed.zero, sealed.outlier_index, sealed.outlier_value), tf)


@dataclass(frozen=True)
class _Attn:
    """What both attention launchers prepare the same way: formats, geometry and the kernels' cache tensors."""

    kern: Any
    interpret: bool
    kf: TensorFormat
    vf: TensorFormat
    kvh: int
    block_size: int
    sink: int
    tensors: dict  # kernel parameter -> tensor: pools, tails, new rows, constants, block table, lengths, slots


@dataclass(frozen=True)
class SealedExtras:
    """What the calibrated storage features add to a read of the sealed blocks (all None for the others): the layers' codebooks
    (``nuq``: ``[levels]`` or ``[kv_heads, levels]`` in code units), the pools' outlier lists (``outN``:
    ``[num_blocks, kv_heads, N]`` int16 positions and fp16 values) and the model's RoPE table for keys stored before
    it (``prerope``: ``(cos, sin)`` [P, head_dim] of positions ``0 .. P - 1``, ``trtkv.rope.RopeTable.upto``); and the
    calibrated code width of each channel (``allocB``: ``[kv_heads, head_dim]``)."""

    k_codebook: torch.Tensor | None = None
    v_codebook: torch.Tensor | None = None
    k_outlier_index: torch.Tensor | None = None
    k_outlier_value: torch.Tensor | None = None
    v_outlier_index: torch.Tensor | None = None
    v_outlier_value: torch.Tensor | None = None
    rope_cos: torch.Tensor | None = None
    rope_sin: torch.Tensor | None = None
    k_bits: torch.Tensor | None = None
    v_bits: torch.Tensor | None = None

    @classmethod
    def of(cls, k_pool: KVPool, v_pool: KVPool, k_params: TensorParams | None, v_params: TensorParams | None,
           rope=None) -> "SealedExtras":
        cos, sin = rope if rope is not None else (None, None)
        return cls(_p(k_params, "codebook"), _p(v_params, "codebook"), k_pool.outlier_index, k_pool.outlier_value,
                   v_pool.outlier_index, v_pool.outlier_value, cos, sin, _p(k_params, "bits"), _p(v_params, "bits"))

    def tensors(self, kf: TensorFormat, vf: TensorFormat, kvh: int, nb: int, head_dim: int, dev) -> dict:
        """The kernels' parameters: checked tensors where the formats read them, dummies elsewhere."""
        out = {}
        for w, tf in (("k", kf), ("v", vf)):
            idx, val = getattr(self, f"{w}_outlier_index"), getattr(self, f"{w}_outlier_value")
            out[f"{w}_cb_ptr"] = _codebook_table(tf, getattr(self, f"{w}_codebook"), kvh, dev)
            out[f"{w}_chan_ptr"] = _channel_table(tf, getattr(self, f"{w}_bits"), kvh, dev)
            if tf.outliers:
                want = (nb, kvh, tf.outliers)
                if (idx is None or val is None or tuple(idx.shape) != want or tuple(val.shape) != want
                        or idx.dtype != torch.int16 or val.dtype != torch.float16):
                    raise TrtkvError(f"{tf.short()} reads outlier lists: int16 / fp16 pools of shape {list(want)}",
                                     "allocate the cache with PagedKVLayout.allocate")
                out[f"{w}_oidx_ptr"], out[f"{w}_oval_ptr"] = idx.contiguous(), val.contiguous()
            else:
                out[f"{w}_oidx_ptr"], out[f"{w}_oval_ptr"] = _dummy(dev, torch.int16), _dummy(dev, torch.float16)
        out["rope_cos_ptr"], out["rope_sin_ptr"] = _rope_table(kf, self.rope_cos, self.rope_sin, head_dim, dev)
        return out

    def check_positions(self, kf: TensorFormat, context_lens: torch.Tensor) -> None:
        """Keys stored before RoPE are rotated at every sealed position read: the table must cover them (one host
        sync, only for those formats, and not while a CUDA graph is being captured)."""
        if not kf.pre_rope or not context_lens.numel():
            return
        if context_lens.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        if int(context_lens.max()) > self.rope_cos.shape[0]:
            raise TrtkvError(f"the RoPE table covers positions below {self.rope_cos.shape[0]}, the cache holds "
                             f"{int(context_lens.max())} tokens", "pass a table of every position read (RopeTable.upto)")


NO_EXTRAS = SealedExtras()


def _codebook_table(tf: TensorFormat, book: torch.Tensor | None, kvh: int, dev) -> torch.Tensor:
    """A ``nuq`` format's codebook as the kernels read it, float32 ``[kv_heads, levels]`` (one line when it is missing
    or misshapen); a dummy for other formats."""
    if not tf.codebook:
        return _dummy(dev)
    given = codebook_of(tf, TensorParams(codebook=book))
    cb = given.to(device=dev, dtype=torch.float32).reshape(-1, given.shape[-1])
    if cb.shape[-1] != tf.codebook_levels or cb.shape[0] not in (1, kvh):
        raise TrtkvError(f"a codebook of shape {tuple(given.shape)} for {tf.short()} (wants [{tf.codebook_levels}] or "
                         f"[{kvh}, {tf.codebook_levels}])", "recalibrate with this format and model")
    return cb.expand(kvh, -1).contiguous()


def _channel_table(tf: TensorFormat, bits: torch.Tensor | None, kvh: int, dev) -> torch.Tensor:
    """An ``allocB`` format's channels as the kernels read them (``kernels._channel_codes``): int32 ``[kv_heads,
    head_dim]``, each channel's bit offset in a row (``formats.channel_offsets``) | its width << 16 (one line when
    the widths are missing or do not fit, the reference's check); a dummy for other formats."""
    widths = widths_of(tf, TensorParams(bits=bits), kvh)
    if widths is None:
        return _dummy(dev, torch.int32)
    return (channel_offsets(widths) | (widths << 16)).to(device=dev, dtype=torch.int32).contiguous()


def _rope_table(tf: TensorFormat, cos: torch.Tensor | None, sin: torch.Tensor | None, head_dim: int, dev) -> tuple:
    """The layer's RoPE table ``(cos, sin)`` [P, head_dim] float32 for keys stored before RoPE, checked; dummies else."""
    if not tf.pre_rope:
        return _dummy(dev), _dummy(dev)
    if cos is None or sin is None:
        raise TrtkvError(f"{tf.short()} stores keys before RoPE and no RoPE table was given",
                         "pass rope=RopeTable.upto(...) (the torch engine does)")
    if cos.dim() != 2 or cos.shape[1] != head_dim or sin.shape != cos.shape:
        raise TrtkvError(f"a RoPE table must be (cos, sin) [positions, {head_dim}], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    return (cos.to(device=dev, dtype=torch.float32).contiguous(), sin.to(device=dev, dtype=torch.float32).contiguous())


def _attn_tensors(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new, v_new, block_table,
                  context_lens, slot_ids, k_fmt, v_fmt, k_static_scale, k_smooth, v_static_scale, v_smooth,
                  interpret: bool | None, extras: SealedExtras = NO_EXTRAS) -> _Attn:
    """Checks every argument against q (decode: one new row per sequence, prefill: one per query row)."""
    kern = _kernels()
    interpret = (not q.is_cuda) if interpret is None else interpret
    new_rows = q.shape[0]
    kf, vf = C.as_tensor_format(k_fmt), C.as_tensor_format(v_fmt)
    head_dim = q.shape[-1]
    check_head_dim(head_dim)
    kvh, bs = k_data.shape[1], k_data.shape[2]
    check_block_size(bs)
    if q.shape[1] % kvh:
        raise TrtkvError(f"query heads {q.shape[1]} are not a multiple of kv heads {kvh}")
    _check_pool(kf, k_data, k_scale, k_zero, head_dim, "K pool")
    _check_pool(vf, v_data, v_scale, v_zero, head_dim, "V pool")
    if v_data.shape[1:3] != k_data.shape[1:3]:
        raise TrtkvError("K and V pools disagree on kv_heads / block_size")
    sink = k_tail.shape[2] - bs if k_tail is not None and k_tail.dim() == 4 else 0
    if not 0 <= sink < bs or sink > MAX_SINK_TOKENS:
        raise TrtkvError(f"K tail holds {k_tail.shape[2]} rows per slot: block_size {bs} + sink rows, at most "
                         f"min({bs - 1}, {MAX_SINK_TOKENS}) of them")
    for what, tail in (("K", k_tail), ("V", v_tail)):
        if tail is None or tail.dim() != 4 or tuple(tail.shape[1:]) != (kvh, bs + sink, head_dim) or tail.dtype != torch.float16:
            raise TrtkvError(f"{what} tail must be fp16 [num_slots, {kvh}, {bs} + {sink} sink rows, {head_dim}], got "
                             f"{None if tail is None else (tuple(tail.shape), tail.dtype)}")
    for what, new in (("K", k_new), ("V", v_new)):
        if new is None or tuple(new.shape) != (new_rows, kvh, head_dim):
            raise TrtkvError(f"new {what} rows must be [{new_rows}, {kvh}, {head_dim}], got "
                             f"{None if new is None else tuple(new.shape)}")
    dev = q.device
    f32, f16 = _dummy(dev), _dummy(dev, torch.float16)
    had = kf.hadamard or vf.hadamard
    tensors = dict(
        k_data_ptr=k_data.contiguous(), k_scale_ptr=_contig(k_scale) if k_scale is not None else f16,
        k_zero_ptr=_contig(k_zero) if k_zero is not None else f16,
        v_data_ptr=v_data.contiguous(), v_scale_ptr=_contig(v_scale) if v_scale is not None else f16,
        v_zero_ptr=_contig(v_zero) if v_zero is not None else f16,
        k_tail_ptr=k_tail.contiguous(), v_tail_ptr=v_tail.contiguous(),
        # the open block holds fp16: new rows are rounded to it as the runtime will store them
        k_new_ptr=k_new.to(torch.float16).contiguous(), v_new_ptr=v_new.to(torch.float16).contiguous(),
        k_static_ptr=_per_channel(k_static_scale, kvh, head_dim, dev, "a K static scale") if kf.is_static else f32,
        k_smooth_ptr=_per_channel(k_smooth, kvh, head_dim, dev, "K smoothing factors") if kf.smooth else f32,
        v_static_ptr=_per_channel(v_static_scale, kvh, head_dim, dev, "a V static scale") if vf.is_static else f32,
        v_smooth_ptr=_per_channel(v_smooth, kvh, head_dim, dev, "V smoothing factors") if vf.smooth else f32,
        had_ptr=hadamard_matrix(head_dim, torch.float32, dev).contiguous() if had else f32,
        block_table_ptr=block_table.to(torch.int32).contiguous(),
        context_lens_ptr=context_lens.to(torch.int32).contiguous(), slot_ids_ptr=slot_ids.to(torch.int32).contiguous(),
        **extras.tensors(kf, vf, kvh, k_data.shape[0], head_dim, dev),
    )
    extras.check_positions(kf, context_lens)
    return _Attn(kern, interpret, kf, vf, kvh, bs, sink, tensors)


def launch_paged_decode(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new, v_new,
                        block_table, context_lens, slot_ids, k_fmt, v_fmt, k_static_scale=None, k_smooth=None,
                        v_static_scale=None, v_smooth=None, sm_scale=None, partition_size: int = DEFAULT_PARTITION,
                        precision: str = "auto", interpret: bool | None = None, window: int = 0,
                        softcap: float = 0.0, extras: SealedExtras = NO_EXTRAS) -> torch.Tensor:
    """Split-K decode attention of one new token per sequence: q [batch, heads, head_dim] -> same (q's dtype).
    ``window`` > 0: keys at positions > position - window only; ``softcap`` > 0: scores capped (``_window_softcap``);
    ``extras``: codebooks, outlier lists and the RoPE table of the calibrated storage features."""
    window, softcap = _window_softcap(window, softcap)
    batch, heads, head_dim = q.shape
    A = _attn_tensors(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new, v_new, block_table,
                      context_lens, slot_ids, k_fmt, v_fmt, k_static_scale, k_smooth, v_static_scale, v_smooth, interpret,
                      extras)
    kern, interpret, kvh, block_size, t = A.kern, A.interpret, A.kvh, A.block_size, A.tensors
    problem = C.LIMITS.partition_problem(partition_size)
    if problem:
        raise TrtkvError(f"partition_size {partition_size} {problem}")
    max_blocks = block_table.shape[1]
    cfg = kern.decode_config(A.kf, A.vf, head_dim, heads // kvh, partition_size,
                             _precision(precision, interpret, DECODE_PRECISION), interpret, window > 0, softcap > 0,
                             block_size)
    grid_p, grid_r = C.decode_grids(batch, kvh, max_blocks, block_size, partition_size)
    nparts = grid_p[2]
    out = torch.empty_like(q)
    if batch == 0:
        return out
    dev = q.device
    part_m = torch.empty((batch, heads, nparts), dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((batch, heads, nparts, head_dim), dtype=torch.float32, device=dev)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    kmod = kern.load_kernels(interpret)
    kmod.paged_decode_partition_kernel[grid_p](
        q_ptr=q.contiguous(), **t, part_m_ptr=part_m, part_l_ptr=part_l,
        part_acc_ptr=part_acc, qk_scale=scale * kern.LOG2E, num_heads=heads, num_kv_heads=kvh,
        block_size=block_size, sink_tokens=A.sink, max_blocks=max_blocks, num_partitions=nparts, window=window,
        softcap=softcap, **cfg["partition"]["constexprs"], num_warps=cfg["partition"]["num_warps"])
    kmod.paged_decode_reduce_kernel[grid_r](
        part_m, part_l, part_acc, t["context_lens_ptr"], t["v_static_ptr"], t["v_smooth_ptr"],
        t["had_ptr"], out, heads, kvh, nparts, **cfg["reduce"]["constexprs"], num_warps=cfg["reduce"]["num_warps"])
    return out


def launch_paged_prefill(q, cu_seqlens_q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new,
                         v_new, block_table, context_lens, slot_ids, k_fmt, v_fmt, k_static_scale=None, k_smooth=None,
                         v_static_scale=None, v_smooth=None, sm_scale=None, max_seqlen_q: int | None = None,
                         precision: str = "auto", interpret: bool | None = None, window: int = 0,
                         softcap: float = 0.0, extras: SealedExtras = NO_EXTRAS) -> torch.Tensor:
    """Causal (chunked) prefill attention: q [total_q, heads, head_dim] -> same shape (q's dtype); ``window`` /
    ``softcap`` / ``extras`` as for ``launch_paged_decode``."""
    window, softcap = _window_softcap(window, softcap)
    total_q, heads, head_dim = q.shape
    A = _attn_tensors(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new, v_new, block_table,
                      context_lens, slot_ids, k_fmt, v_fmt, k_static_scale, k_smooth, v_static_scale, v_smooth, interpret,
                      extras)
    kern, interpret, kvh, block_size, t = A.kern, A.interpret, A.kvh, A.block_size, A.tensors
    batch = context_lens.shape[0]
    cu_seqlens_q = cu_seqlens_q.to(torch.int32).contiguous()
    out = torch.zeros_like(q)
    if total_q == 0 or batch == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # one host sync; pass it to avoid
    cfg = kern.prefill_config(A.kf, A.vf, head_dim, heads // kvh, _precision(precision, interpret, PREFILL_PRECISION),
                              interpret, window > 0, softcap > 0, block_size)
    grid = C.prefill_grid(max(max_seqlen_q, 1), kvh, batch, cfg["constexprs"]["BLOCK_M"])
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    kmod = kern.load_kernels(interpret)
    kmod.paged_prefill_kernel[grid](
        q_ptr=q.contiguous(), cu_seqlens_q_ptr=cu_seqlens_q, **t,
        out_ptr=out, qk_scale=scale * kern.LOG2E, num_heads=heads, num_kv_heads=kvh, block_size=block_size,
        sink_tokens=A.sink, max_blocks=block_table.shape[1], window=window, softcap=softcap, **cfg["constexprs"],
        num_warps=cfg["num_warps"])
    return out


# ------------------------------------------------------------------------------------------------
# torch custom ops
# ------------------------------------------------------------------------------------------------

T = torch.Tensor
OT = Optional[torch.Tensor]


@functools.lru_cache(maxsize=None)
def _spec_format(spec: str) -> TensorFormat:
    """A custom op's format argument (a schema carries strings): parsed once per distinct spec string."""
    return C.as_tensor_format(spec)


def seal_into(rows, blocks, data, scale, zero, fmt: TensorFormat, static_scale=None, smooth=None, clip=None,
              codebook=None, outlier_index=None, outlier_value=None, first_positions=None, rope=None, bits=None) -> None:
    """``seal_blocks`` on a TensorFormat: the kernel on CUDA (or under ``TRITON_INTERPRET=1``), else the reference.
    ``codebook`` (nuq), the pool's outlier lists (outN, written), ``first_positions`` [n] and ``rope`` ``(cos, sin)``
    (prerope), ``bits`` (allocB) for the calibrated storage features."""
    if rows.is_cuda or interpret_requested():
        launch_seal_into(rows, blocks, data, scale, zero, fmt, static_scale, smooth, clip, interpret=not rows.is_cuda,
                         codebook=codebook, outlier_index=outlier_index, outlier_value=outlier_value,
                         first_positions=first_positions, rope=rope, bits=bits)
    else:
        _ref.seal_into_ref(rows, blocks, data, scale, zero, fmt, static_scale, smooth, clip, codebook, outlier_index,
                           outlier_value, first_positions, rope, bits)


@torch.library.custom_op("trtkv::seal_blocks", mutates_args=("data", "scale", "zero", "outlier_index", "outlier_value"))
def seal_blocks(rows: T, blocks: T, data: T, scale: OT, zero: OT, fmt: str,
                static_scale: OT = None, smooth: OT = None, clip: OT = None, codebook: OT = None,
                outlier_index: OT = None, outlier_value: OT = None, first_positions: OT = None, rope_cos: OT = None,
                rope_sin: OT = None, bits: OT = None) -> None:
    seal_into(rows, blocks, data, scale, zero, _spec_format(fmt), static_scale, smooth, clip, codebook, outlier_index,
              outlier_value, first_positions, None if rope_cos is None else (rope_cos, rope_sin), bits)


@seal_blocks.register_fake
def _(rows, blocks, data, scale, zero, fmt, static_scale=None, smooth=None, clip=None, codebook=None, outlier_index=None,
      outlier_value=None, first_positions=None, rope_cos=None, rope_sin=None, bits=None) -> None:
    return None


def _ref_attention(q, cu, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new, v_new,
                   block_table, context_lens, slot_ids, k_fmt, v_fmt, k_static_scale, k_smooth, v_static_scale,
                   v_smooth, sm_scale, window=0, softcap=0.0, extras: SealedExtras = NO_EXTRAS):
    e = extras
    kp = KVPool(k_data, k_scale, k_zero, k_tail, e.k_outlier_index, e.k_outlier_value)
    vp = KVPool(v_data, v_scale, v_zero, v_tail, e.v_outlier_index, e.v_outlier_value)
    window, softcap = _window_softcap(window, softcap)
    rope = None if e.rope_cos is None else RopeRows(e.rope_cos, e.rope_sin)
    return _ref.paged_attention_ref(q, cu, kp, vp, k_new, v_new, block_table, context_lens, slot_ids, k_fmt, v_fmt,
                                    TensorParams(scale=k_static_scale, smooth=k_smooth, codebook=e.k_codebook),
                                    TensorParams(scale=v_static_scale, smooth=v_smooth, codebook=e.v_codebook),
                                    sm_scale, window, softcap, rope)


def decode(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new, v_new, block_table, context_lens,
           slot_ids, k_fmt: TensorFormat, v_fmt: TensorFormat, k_static_scale=None, k_smooth=None, v_static_scale=None,
           v_smooth=None, sm_scale=None, partition_size: int = DEFAULT_PARTITION, precision: str = "auto", window: int = 0,
           softcap: float = 0.0, extras: SealedExtras = NO_EXTRAS) -> torch.Tensor:
    """``paged_decode_attention`` on TensorFormats: the kernels on CUDA (or under ``TRITON_INTERPRET=1``), else the
    reference."""
    if q.is_cuda or interpret_requested():
        return launch_paged_decode(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new, v_new,
                                   block_table, context_lens, slot_ids, k_fmt, v_fmt, k_static_scale, k_smooth,
                                   v_static_scale, v_smooth, sm_scale, partition_size, precision,
                                   interpret=not q.is_cuda, window=window, softcap=softcap, extras=extras)
    return _ref_attention(q, None, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new, v_new,
                          block_table, context_lens, slot_ids, k_fmt, v_fmt, k_static_scale, k_smooth,
                          v_static_scale, v_smooth, sm_scale, window, softcap, extras)


@torch.library.custom_op("trtkv::paged_decode_attention", mutates_args=())
def paged_decode_attention(q: T, k_data: T, k_scale: OT, k_zero: OT, v_data: T, v_scale: OT, v_zero: OT,
                           k_tail: T, v_tail: T, k_new: T, v_new: T, block_table: T, context_lens: T, slot_ids: T,
                           k_fmt: str, v_fmt: str, k_static_scale: OT = None, k_smooth: OT = None,
                           v_static_scale: OT = None, v_smooth: OT = None, sm_scale: Optional[float] = None,
                           partition_size: int = DEFAULT_PARTITION, precision: str = "auto", window: int = 0,
                           softcap: float = 0.0, k_codebook: OT = None, v_codebook: OT = None,
        k_outlier_index: OT = None, k_outlier_value: OT = None, v_outlier_index: OT = None, v_outlier_value: OT = None,
        rope_cos: OT = None, rope_sin: OT = None) -> T:
    return decode(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new, v_new, block_table,
                  context_lens, slot_ids, _spec_format(k_fmt), _spec_format(v_fmt), k_static_scale, k_smooth,
                  v_static_scale, v_smooth, sm_scale, partition_size, precision, window, softcap,
                  SealedExtras(k_codebook, v_codebook, k_outlier_index, k_outlier_value, v_outlier_index,
                               v_outlier_value, rope_cos, rope_sin))


@paged_decode_attention.register_fake
def _(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new, v_new, block_table, context_lens,
      slot_ids, k_fmt, v_fmt, k_static_scale=None, k_smooth=None, v_static_scale=None, v_smooth=None, sm_scale=None,
      partition_size=DEFAULT_PARTITION, precision="auto", window=0, softcap=0.0, k_codebook=None, v_codebook=None,
      k_outlier_index=None, k_outlier_value=None, v_outlier_index=None, v_outlier_value=None, rope_cos=None, rope_sin=None):
    return torch.empty_like(q)


def prefill(q, cu_seqlens_q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new, v_new, block_table,
            context_lens, slot_ids, k_fmt: TensorFormat, v_fmt: TensorFormat, k_static_scale=None, k_smooth=None,
            v_static_scale=None, v_smooth=None, sm_scale=None, max_seqlen_q: int | None = None, precision: str = "auto",
            window: int = 0, softcap: float = 0.0, extras: SealedExtras = NO_EXTRAS) -> torch.Tensor:
    """``paged_prefill_attention`` on TensorFormats (dispatch as ``decode``)."""
    if q.is_cuda or interpret_requested():
        return launch_paged_prefill(q, cu_seqlens_q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail,
                                    k_new, v_new, block_table, context_lens, slot_ids, k_fmt, v_fmt, k_static_scale,
                                    k_smooth, v_static_scale, v_smooth, sm_scale, max_seqlen_q, precision,
                                    interpret=not q.is_cuda, window=window, softcap=softcap, extras=extras)
    return _ref_attention(q, cu_seqlens_q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new,
                          v_new, block_table, context_lens, slot_ids, k_fmt, v_fmt, k_static_scale, k_smooth,
                          v_static_scale, v_smooth, sm_scale, window, softcap, extras)


@torch.library.custom_op("trtkv::paged_prefill_attention", mutates_args=())
def paged_prefill_attention(q: T, cu_seqlens_q: T, k_data: T, k_scale: OT, k_zero: OT, v_data: T, v_scale: OT,
                            v_zero: OT, k_tail: T, v_tail: T, k_new: T, v_new: T, block_table: T, context_lens: T,
                            slot_ids: T, k_fmt: str, v_fmt: str, k_static_scale: OT = None, k_smooth: OT = None,
                            v_static_scale: OT = None, v_smooth: OT = None, sm_scale: Optional[float] = None,
                            max_seqlen_q: Optional[int] = None, precision: str = "auto", window: int = 0,
                            softcap: float = 0.0, k_codebook: OT = None, v_codebook: OT = None,
        k_outlier_index: OT = None, k_outlier_value: OT = None, v_outlier_index: OT = None, v_outlier_value: OT = None,
        rope_cos: OT = None, rope_sin: OT = None) -> T:
    return prefill(q, cu_seqlens_q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new, v_new,
                   block_table, context_lens, slot_ids, _spec_format(k_fmt), _spec_format(v_fmt), k_static_scale,
                   k_smooth, v_static_scale, v_smooth, sm_scale, max_seqlen_q, precision, window, softcap,
                   SealedExtras(k_codebook, v_codebook, k_outlier_index, k_outlier_value, v_outlier_index,
                               v_outlier_value, rope_cos, rope_sin))


@paged_prefill_attention.register_fake
def _(q, cu_seqlens_q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new, v_new, block_table,
      context_lens, slot_ids, k_fmt, v_fmt, k_static_scale=None, k_smooth=None, v_static_scale=None, v_smooth=None,
      sm_scale=None, max_seqlen_q=None, precision="auto", window=0, softcap=0.0, k_codebook=None, v_codebook=None,
      k_outlier_index=None, k_outlier_value=None, v_outlier_index=None, v_outlier_value=None, rope_cos=None, rope_sin=None):
    return torch.empty_like(q)


# ------------------------------------------------------------------------------------------------
# convenience wrappers on trtkv objects (layout, KVPool, TensorParams)
# ------------------------------------------------------------------------------------------------


def _p(params: TensorParams | None, name: str):
    return None if params is None else getattr(params, name)


def seal_kv(layout: PagedKVLayout, k_rows: torch.Tensor, v_rows: torch.Tensor, blocks: torch.Tensor,
            k_pool: KVPool, v_pool: KVPool, k_params: TensorParams | None = None,
            v_params: TensorParams | None = None, first_positions: torch.Tensor | None = None, rope=None) -> None:
    """Seal full K and V blocks [n, kv_heads, block_size, head_dim] into pool blocks ``blocks`` (``seal_into``);
    ``first_positions`` [n] and ``rope`` ``(cos, sin)``: for keys stored before RoPE."""
    for which, rows, pool, params in (("k", k_rows, k_pool, k_params), ("v", v_rows, v_pool, v_params)):
        seal_into(rows, blocks, pool.data, pool.scale, pool.zero, layout.tensor_format(which), _p(params, "scale"),
                  _p(params, "smooth"), _p(params, "clip"), _p(params, "codebook"), pool.outlier_index,
                  pool.outlier_value, first_positions, rope, _p(params, "bits"))


def _pool_args(k_pool: KVPool, v_pool: KVPool):
    return (k_pool.data, k_pool.scale, k_pool.zero, v_pool.data, v_pool.scale, v_pool.zero, k_pool.tail, v_pool.tail)


def decode_attention(q: torch.Tensor, layout: PagedKVLayout | KVFormat, k_pool: KVPool, v_pool: KVPool,
                     k_new: torch.Tensor, v_new: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                     slot_ids: torch.Tensor, k_params: TensorParams | None = None,
                     v_params: TensorParams | None = None, sm_scale: float | None = None,
                     partition_size: int = DEFAULT_PARTITION, precision: str = "auto", window: int = 0,
                     softcap: float = 0.0, rope=None) -> torch.Tensor:
    """``paged_decode_attention`` on trtkv objects (``decode``: the formats travel as objects). A sliding layer (``window``) may pass a block table whose column
    ``j`` is where the sequence's sealed block ``j`` lives only from its window's first block on
    (``cache_layout.first_window_block``): a window ring's (``WindowRing.block``); earlier entries are never read.
    The params' codebooks and the pools' outlier lists go along (``SealedExtras``); ``rope``: the model's table
    ``(cos, sin)`` [P, D] for keys stored before RoPE."""
    fmt = layout.fmt if isinstance(layout, PagedKVLayout) else layout
    return decode(
        q, *_pool_args(k_pool, v_pool), k_new, v_new, block_table, context_lens, slot_ids, fmt.k,
        fmt.v, _p(k_params, "scale"), _p(k_params, "smooth"), _p(v_params, "scale"), _p(v_params, "smooth"),
        sm_scale, partition_size, precision, int(window or 0), float(softcap or 0.0),
        SealedExtras.of(k_pool, v_pool, k_params, v_params, rope))


def prefill_attention(q: torch.Tensor, cu_seqlens_q: torch.Tensor, layout: PagedKVLayout | KVFormat, k_pool: KVPool,
                      v_pool: KVPool, k_new: torch.Tensor, v_new: torch.Tensor, block_table: torch.Tensor,
                      context_lens: torch.Tensor, slot_ids: torch.Tensor, k_params: TensorParams | None = None,
                      v_params: TensorParams | None = None, sm_scale: float | None = None,
                      max_seqlen_q: int | None = None, precision: str = "auto", window: int = 0,
                      softcap: float = 0.0, rope=None) -> torch.Tensor:
    """``paged_prefill_attention`` on trtkv objects (``prefill``; ``window``, ``softcap``, ringed block tables and
    ``rope`` as for ``decode_attention``)."""
    fmt = layout.fmt if isinstance(layout, PagedKVLayout) else layout
    return prefill(
        q, cu_seqlens_q, *_pool_args(k_pool, v_pool), k_new, v_new, block_table, context_lens, slot_ids,
        fmt.k, fmt.v, _p(k_params, "scale"), _p(k_params, "smooth"), _p(v_params, "scale"),
        _p(v_params, "smooth"), sm_scale, max_seqlen_q, precision, int(window or 0), float(softcap or 0.0),
        SealedExtras.of(k_pool, v_pool, k_params, v_params, rope))
