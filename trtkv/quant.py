"""Reference quantization math: the one torch definition kernels, ONNX graphs and plugins are tested against.

Conventions (documented in docs/kv-formats.md):
- a scale is the dequantization multiplier: ``x ≈ code * scale`` (symmetric) or ``code * scale + zero``
  (asymmetric, ``zero`` is the float group minimum);
- dynamic scales and zero-points are rounded to fp16 *before* the codes are computed, so a kernel that
  stores fp16 scales reproduces the codes bit for bit; rounding is half-to-even (``torch.round``);
- int4 codes are unsigned nibbles (symmetric codes are stored offset by +8), two per byte,
  the even channel in the low nibble; int8 symmetric codes are ``int8``, asymmetric ``uint8``;
  fp8 codes are the e4m3fn bit pattern in ``uint8``;
- K/V tensors have head_dim last and the KV-head axis at ``head_axis`` (``-2`` for the
  ``[tokens, heads, head_dim]`` rows the kernels use, ``-3`` for transformers' ``[batch, heads, seq, head_dim]``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from trtkv.errors import TrtkvError
from trtkv.formats import CLIP_GRID, TensorFormat, pack_int4, unpack_int4  # noqa: F401  (re-exported: the codec lives in the DTYPES rows)

FP16_MAX = 65504.0


@dataclass
class TensorParams:
    """Calibrated constants for one of K/V in one layer (all optional, by format)."""

    scale: torch.Tensor | None = None  # static scale: [] per_tensor, [H] per_head, [H, D] per_channel
    smooth: torch.Tensor | None = None  # [H, D] per-channel divisor, > 0
    clip: torch.Tensor | None = None  # dynamic formats: [] or [H] range multiplier in (0, 1]


@dataclass
class QuantizedTensor:
    """Stored form of a K or V tensor: codes in their storage dtype plus dynamic scales."""

    codes: torch.Tensor  # [..., D] (int4: [..., D/2] packed)
    scale: torch.Tensor | None = None  # dynamic: [..., groups] fp16; static: None (lives in TensorParams)
    zero: torch.Tensor | None = None  # asymmetric dynamic: [..., groups] fp16


def check_finite(x: torch.Tensor, what: str = "tensor") -> None:
    if not torch.isfinite(x).all():
        raise TrtkvError(
            f"{what} contains NaN or inf values, which cannot be quantized",
            "check the model dtype (fp16 overflow?) and the input; run in float32",
        )


@functools.lru_cache(maxsize=16)
def _hadamard_cpu(n: int) -> torch.Tensor:
    block = n & -n  # largest power of two dividing n
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / block**0.5
    return torch.block_diag(*([h] * (n // block)))


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Orthonormal (block-diagonal) Sylvester Hadamard matrix of size n; blocks are the largest power of two dividing n."""
    return _hadamard_cpu(n).to(dtype=dtype, device=device)


def per_channel(t: torch.Tensor, num_kv_heads: int, head_dim: int, what: str = "constant") -> torch.Tensor:
    """A calibrated constant stored ``[]`` (per tensor), ``[H]`` (per head) or ``[H, D]`` (per channel) as the one
    layout kernels, graphs and plugins read: contiguous float32 ``[H, D]``."""
    t = torch.as_tensor(t).float()
    if t.dim() == 0:
        t = t.expand(num_kv_heads, head_dim)
    elif t.dim() == 1 and t.shape[0] == num_kv_heads:
        t = t.view(num_kv_heads, 1).expand(num_kv_heads, head_dim)
    if tuple(t.shape) != (num_kv_heads, head_dim):
        raise TrtkvError(f"{what} has shape {tuple(t.shape)}, expected [], [{num_kv_heads}] or [{num_kv_heads}, {head_dim}]",
                         "pass the calibration made for this model (`trtkv calibrate`)")
    return t.contiguous()


def _per_head(t: torch.Tensor, ndim: int, head_axis: int) -> torch.Tensor:
    """Reshape a [], [H] or [H, D] constant to broadcast against a tensor whose head axis is ``head_axis``.

    Not ``per_channel``: the reference math keeps float64 constants float64 (the float64 references), and a
    per-head clip must broadcast against channel groups ``[..., G, g]``, which an ``[H, D]`` expansion cannot."""
    t = t.float() if t.dtype != torch.float64 else t
    if t.dim() == 0:
        return t
    head_pos = head_axis % ndim
    between = ndim - 1 - head_pos - 1  # axes between head and head_dim
    if t.dim() == 1:  # [H]
        return t.reshape(t.shape[0], *([1] * (between + 1)))
    return t.reshape(t.shape[0], *([1] * between), t.shape[1])  # [H, D]


def forward_transform(x: torch.Tensor, fmt: TensorFormat, params: TensorParams | None, head_axis: int = -2) -> torch.Tensor:
    """Apply smoothing and rotation, the steps before quantization."""
    if fmt.smooth:
        if params is None or params.smooth is None:
            raise TrtkvError("this KV format smooths channels but no smoothing factors were given", "run `trtkv calibrate` and pass --calibration")
        x = x / _per_head(params.smooth, x.dim(), head_axis).to(x.dtype)
    if fmt.hadamard:
        fmt.check_head_dim(x.shape[-1])  # an odd head_dim would make every block 1x1: a silent no-op
        x = x @ hadamard_matrix(x.shape[-1], x.dtype, x.device)
    return x


def inverse_transform(x: torch.Tensor, fmt: TensorFormat, params: TensorParams | None, head_axis: int = -2) -> torch.Tensor:
    """Undo ``forward_transform`` after dequantization."""
    if fmt.hadamard:
        x = x @ hadamard_matrix(x.shape[-1], x.dtype, x.device).T
    if fmt.smooth:
        assert params is not None and params.smooth is not None
        x = x * _per_head(params.smooth, x.dim(), head_axis).to(x.dtype)
    return x


def _to_fp16(t: torch.Tensor) -> torch.Tensor:
    """Round to the fp16 value a pool would store, keeping the compute dtype."""
    return t.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).to(t.dtype)


def _group(x: torch.Tensor, fmt: TensorFormat) -> torch.Tensor:
    groups = fmt.groups(x.shape[-1])
    return x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)


def _dynamic_clip(params: TensorParams | None, ndim: int, head_axis: int) -> torch.Tensor | float:
    if params is None or params.clip is None:
        return 1.0
    # x is grouped to [..., G, g]: the head axis moved one further from the end
    return _per_head(params.clip, ndim + 1, head_axis - 1) if params.clip.dim() else params.clip.float()


def _round_codes(y: torch.Tensor, fmt: TensorFormat, lo: float, hi: float) -> torch.Tensor:
    if not fmt.traits.is_int:
        return y.clamp(lo, hi)  # fp8: rounding happens in the encoding cast (round to nearest even)
    return torch.round(y).clamp(lo, hi)


def _dynamic_codes(g: torch.Tensor, fmt: TensorFormat, clip, axis: int) -> QuantizedTensor:
    """Codes, fp16 scales and zero-points of ``g`` with one scale per slice along ``axis`` (kept, size 1)."""
    tr = fmt.traits
    if fmt.symmetric:
        scale = _to_fp16(g.abs().amax(axis, keepdim=True) * clip / tr.sym_max)
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = _round_codes(g * inv, fmt, tr.sym_min, tr.sym_max)
        return QuantizedTensor(codes=q, scale=scale)
    mn, mx = g.amin(axis, keepdim=True), g.amax(axis, keepdim=True)
    rng = mx - mn
    # clip shrinks [mn, mx] about its centre; written from mn so that clip=1 gives zero == fp16(mn) exactly
    zero = _to_fp16(mn + rng * (1 - clip) / 2)
    scale = _to_fp16(rng * clip / tr.asym_max)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = _round_codes((g - zero) * inv, fmt, 0, tr.asym_max)
    return QuantizedTensor(codes=q, scale=scale, zero=zero)


def _searched_codes(xf: torch.Tensor, fmt: TensorFormat) -> QuantizedTensor:
    """Block-channel codes with each channel's range the one of ``CLIP_GRID`` (shrinks of [min, max] about its centre,
    or of [-amax, amax]) whose dequantized block is nearest ``xf`` in squared error; ties keep the wider range."""
    best: QuantizedTensor | None = None
    best_err = None
    for c in CLIP_GRID:
        qt = _dynamic_codes(xf, fmt, c, -2)
        deq = qt.codes * qt.scale + (qt.zero if qt.zero is not None else 0)
        err = (deq - xf).square().sum(-2, keepdim=True)
        if best is None:
            best, best_err = qt, err
            continue
        take = err < best_err
        best = QuantizedTensor(codes=torch.where(take, qt.codes, best.codes), scale=torch.where(take, qt.scale, best.scale),
                               zero=None if qt.zero is None else torch.where(take, qt.zero, best.zero))
        best_err = torch.where(take, err, best_err)
    assert best is not None
    return best


def quantize(x: torch.Tensor, fmt: TensorFormat, params: TensorParams | None = None, head_axis: int = -2) -> QuantizedTensor:
    """Quantize K or V (head_dim last) into its stored form, each token on its own (see ``quantize_block``)."""
    if not fmt.is_quantized:
        return QuantizedTensor(codes=x.to(torch.float16))
    if fmt.is_block_wise:
        raise TrtkvError(f"format {fmt.short()} quantizes whole sealed blocks, not single tokens", "use quantize_block")
    check_finite(x, "K/V input")
    tr = fmt.traits
    xf = forward_transform(x.float(), fmt, params, head_axis)
    if fmt.is_static:
        if params is None or params.scale is None:
            raise TrtkvError(f"format {fmt.short()} needs a calibrated static scale", "run `trtkv calibrate` and pass --calibration")
        scale = _per_head(params.scale, xf.dim(), head_axis)
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = _round_codes(xf * inv, fmt, tr.sym_min, tr.sym_max)
        return QuantizedTensor(codes=fmt.traits.encode(q, True))
    qt = _dynamic_codes(_group(xf, fmt), fmt, _dynamic_clip(params, xf.dim(), head_axis), -1)  # groups [..., G, g]
    return QuantizedTensor(
        codes=fmt.traits.encode(qt.codes.flatten(-2), fmt.symmetric),
        scale=qt.scale.squeeze(-1).half(),
        zero=None if qt.zero is None else qt.zero.squeeze(-1).half(),
    )


def quantize_block(x: torch.Tensor, fmt: TensorFormat, params: TensorParams | None = None, head_axis: int = -3) -> QuantizedTensor:
    """Quantize sealed blocks ``x`` [..., H, block_size, D] (tokens on axis -2) as the pool stores them.

    Block-wise formats (``per_block_channel``) get one fp16 scale (and zero-point) per channel over the
    block's tokens: ``scale``/``zero`` [..., H, D]. Every other format quantizes each token on its own,
    exactly as ``quantize``.
    """
    if not fmt.is_block_wise:
        return quantize(x, fmt, params, head_axis)
    check_finite(x, "K/V input")
    xf = forward_transform(x.float(), fmt, params, head_axis)
    clip = 1.0 if params is None or params.clip is None else _per_head(params.clip, xf.dim(), head_axis)
    qt = _searched_codes(xf, fmt) if fmt.mse else _dynamic_codes(xf, fmt, clip, -2)
    return QuantizedTensor(
        codes=fmt.traits.encode(qt.codes, fmt.symmetric),
        scale=qt.scale.squeeze(-2).half(),
        zero=None if qt.zero is None else qt.zero.squeeze(-2).half(),
    )


def dequantize(
    qt: QuantizedTensor,
    fmt: TensorFormat,
    params: TensorParams | None = None,
    head_axis: int = -2,
    dtype: torch.dtype = torch.float32,
    transforms: bool = True,
) -> torch.Tensor:
    """Stored form back to values in the model's channel space (transforms undone; ``transforms=False``: left in
    the stored channel space -- smoothed / rotated -- for consumers that fold them into the query and output).

    Block-wise formats: ``codes`` [..., block_size, D'] with ``scale``/``zero`` [..., D] (see ``quantize_block``).
    """
    if not fmt.is_quantized:
        return qt.codes.to(dtype)
    sym = fmt.symmetric or fmt.is_static
    c = fmt.traits.stored_values(qt.codes)  # codes + offset: the offset is folded into the zero-point below
    off = fmt.traits.offset(sym)
    if fmt.is_static:
        assert params is not None and params.scale is not None
        x = _affine(c, _per_head(params.scale, c.dim(), head_axis), None, off)
    elif fmt.is_block_wise:
        assert qt.scale is not None and (sym or qt.zero is not None)
        x = _affine(c, qt.scale.float().unsqueeze(-2), None if sym else qt.zero.float().unsqueeze(-2), off)
    else:
        assert qt.scale is not None and (sym or qt.zero is not None)
        x = _affine(_group(c, fmt), qt.scale.float().unsqueeze(-1), None if sym else qt.zero.float().unsqueeze(-1), off).flatten(-2)
    return (inverse_transform(x, fmt, params, head_axis) if transforms else x).to(dtype)


def _affine(c: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, offset: int) -> torch.Tensor:
    """``(c - offset) * scale + zero`` in one pass over ``c`` (``addcmul``): dequantization is bandwidth-bound."""
    shift = -offset * scale if offset else None
    if zero is not None:
        shift = zero if shift is None else shift + zero
    return c * scale if shift is None else torch.addcmul(shift, c, scale)


def fake_quantize(x: torch.Tensor, fmt: TensorFormat, params: TensorParams | None = None, head_axis: int = -2) -> torch.Tensor:
    """``dequantize(quantize(x))`` in x's dtype: what attention sees when reading the stored cache."""
    return dequantize(quantize(x, fmt, params, head_axis), fmt, params, head_axis, dtype=x.dtype)


def fake_quantize_block(x: torch.Tensor, fmt: TensorFormat, params: TensorParams | None = None, head_axis: int = -3) -> torch.Tensor:
    """``dequantize(quantize_block(x))`` for sealed blocks [..., H, block_size, D], in x's dtype."""
    return dequantize(quantize_block(x, fmt, params, head_axis), fmt, params, head_axis, dtype=x.dtype)
