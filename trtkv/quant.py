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

import dataclasses
import functools
from dataclasses import dataclass

import torch

from trtkv.errors import TrtkvError
from trtkv.formats import CLIP_GRID, TensorFormat, pack_channel_codes, pack_int4, unpack_channel_codes, unpack_int4  # noqa: F401  (re-exported: the codec lives in the DTYPES rows)

FP16_MAX = 65504.0


@dataclass
class TensorParams:
    """Calibrated constants for one of K/V in one layer (all optional, by format)."""

    scale: torch.Tensor | None = None  # static scale: [] per_tensor, [H] per_head, [H, D] per_channel
    smooth: torch.Tensor | None = None  # [H, D] per-channel divisor, > 0
    clip: torch.Tensor | None = None  # dynamic formats: [] or [H] range multiplier in (0, 1]
    codebook: torch.Tensor | None = None  # nuq formats: [2**bits] or [H, 2**bits] levels in code units, ascending
    bits: torch.Tensor | None = None  # alloc formats: [H, D] code width of each channel (``TensorFormat.channel_widths``)

    def map(self, fn) -> "TensorParams":
        """A copy with ``fn`` applied to every tensor that is set (``lambda t: t.to(device)``, ``torch.Tensor.clone``):
        the one place that lists the fields."""
        return TensorParams(**{f.name: None if (t := getattr(self, f.name)) is None else fn(t) for f in dataclasses.fields(self)})

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that are set, by field name (what the calibration artifact stores)."""
        return {f.name: t for f in dataclasses.fields(self) if (t := getattr(self, f.name)) is not None}


@dataclass
class QuantizedTensor:
    """Stored form of a K or V tensor: codes in their storage dtype plus dynamic scales (and a sealed block's outliers)."""

    codes: torch.Tensor  # [..., D] (int4: [..., D/2] packed)
    scale: torch.Tensor | None = None  # dynamic: [..., groups] fp16; static: None (lives in TensorParams)
    zero: torch.Tensor | None = None  # asymmetric dynamic: [..., groups] fp16
    # ``outN`` formats, per sealed block [..., H, block_size, D']: the kept elements' positions ``token * D + channel``
    # in their block (int16, ascending) and values in the transformed space (fp16), both [..., H, N]
    outlier_index: torch.Tensor | None = None
    outlier_value: torch.Tensor | None = None


def non_finite(what: str = "tensor") -> TrtkvError:
    """The error of quantizing ``what`` that holds a NaN or inf (``check_finite``; the C seal's, which checks as it reads)."""
    return TrtkvError(f"{what} contains NaN or inf values, which cannot be quantized",
                      "check the model dtype (fp16 overflow?) and the input; run in float32")


def check_finite(x: torch.Tensor, what: str = "tensor") -> None:
    if not torch.isfinite(x).all():
        raise non_finite(what)


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


Rope = tuple  # (cos, sin) of the rows' positions, broadcastable to them (``trtkv.rope.RopeTable``): ``prerope`` keys


def _need_rope(fmt: TensorFormat, rope) -> None:
    if rope is None:
        raise TrtkvError(f"format {fmt.short()} stores keys before RoPE and no positions were given",
                         "pass the layer's RoPE table (trtkv.rope.RopeTable.per_layer(model)) to the cache")


def forward_transform(x: torch.Tensor, fmt: TensorFormat, params: TensorParams | None, head_axis: int = -2,
                      rope: Rope | None = None) -> torch.Tensor:
    """Apply the steps before quantization: undo RoPE (``prerope``: ``rope`` is the rows' ``(cos, sin)``), smooth, rotate."""
    if fmt.pre_rope:
        from trtkv.rope import rotate

        _need_rope(fmt, rope)
        x = rotate(x, rope[0].to(x.dtype), rope[1].to(x.dtype), inverse=True)
    if fmt.smooth:
        if params is None or params.smooth is None:
            raise TrtkvError("this KV format smooths channels but no smoothing factors were given", "run `trtkv calibrate` and pass --calibration")
        x = x / _per_head(params.smooth, x.dim(), head_axis).to(x.dtype)
    if fmt.hadamard:
        fmt.check_head_dim(x.shape[-1])  # an odd head_dim would make every block 1x1: a silent no-op
        x = x @ hadamard_matrix(x.shape[-1], x.dtype, x.device)
    return x


def inverse_transform(x: torch.Tensor, fmt: TensorFormat, params: TensorParams | None, head_axis: int = -2,
                      rope: Rope | None = None) -> torch.Tensor:
    """Undo ``forward_transform`` after dequantization."""
    if fmt.hadamard:
        x = x @ hadamard_matrix(x.shape[-1], x.dtype, x.device).T
    if fmt.smooth:
        assert params is not None and params.smooth is not None
        x = x * _per_head(params.smooth, x.dim(), head_axis).to(x.dtype)
    if fmt.pre_rope:
        from trtkv.rope import rotate

        _need_rope(fmt, rope)
        x = rotate(x, rope[0].to(x.dtype), rope[1].to(x.dtype))
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


def _levels(codebook: torch.Tensor, ndim: int, head_axis: int) -> torch.Tensor:
    """A ``[n]`` / ``[H, n]`` codebook shaped to broadcast against a tensor of ``ndim`` axes (head at ``head_axis``) with
    one more axis, the levels', at the end."""
    cb = codebook.float()
    if cb.dim() == 1:
        return cb
    return cb.reshape(cb.shape[0], *([1] * (ndim - 1 - head_axis % ndim)), cb.shape[1])


def nearest_level(u: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the level nearest each ``u`` (``levels`` ascending, broadcast with a trailing level axis, see ``_levels``):
    the number of midpoints between neighbouring levels below ``u`` -- a tie goes to the lower level. float32 codes."""
    mids = (levels[..., 1:] + levels[..., :-1]) * 0.5
    return (u.unsqueeze(-1) > mids).sum(-1).float()


def lookup_levels(idx: torch.Tensor, codebook: torch.Tensor, head_axis: int) -> torch.Tensor:
    """The levels of code indices ``idx`` (float, head axis at ``head_axis``) in a ``[n]`` / ``[H, n]`` codebook, float32:
    the table lookup (a LUT gather in a kernel, a Gather in a graph) that replaces a code's own value."""
    cb = codebook.float()
    i = idx.long()
    if cb.dim() == 1:
        return cb[i]
    n = cb.shape[1]
    offs = (torch.arange(cb.shape[0], device=i.device) * n).reshape(cb.shape[0], *([1] * (i.dim() - 1 - head_axis % i.dim())))
    return cb.flatten()[i + offs]


def _dynamic_range(g: torch.Tensor, fmt: TensorFormat, clip, axis: int, mask: torch.Tensor | None = None):
    """fp16 scale, zero-point (None when symmetric) and float32 reciprocal of ``g`` with one scale per slice along
    ``axis`` (kept, size 1); elements where ``mask`` is True (a block's outliers) set no range."""
    tr = fmt.traits
    if fmt.symmetric:
        a = g.abs() if mask is None else g.abs().masked_fill(mask, 0.0)
        scale = _to_fp16(a.amax(axis, keepdim=True) * clip / tr.sym_max)
        zero = None
    else:
        if mask is None:
            mn, mx = g.amin(axis, keepdim=True), g.amax(axis, keepdim=True)
        else:  # a slice of outliers only has no range: zero 0, scale 0
            mn = g.masked_fill(mask, torch.inf).amin(axis, keepdim=True)
            mx = g.masked_fill(mask, -torch.inf).amax(axis, keepdim=True)
            empty = ~torch.isfinite(mn)
            mn, mx = mn.masked_fill(empty, 0.0), mx.masked_fill(empty, 0.0)
        rng = mx - mn
        # clip shrinks [mn, mx] about its centre; written from mn so that clip=1 gives zero == fp16(mn) exactly
        zero = _to_fp16(mn + rng * (1 - clip) / 2)
        scale = _to_fp16(rng * clip / tr.asym_max)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return scale, zero, inv


def _normalized(g: torch.Tensor, zero: torch.Tensor | None, inv: torch.Tensor) -> torch.Tensor:
    """What a code rounds: ``(g - zero) / s`` (``g / s`` symmetric), in code units."""
    return (g - zero) * inv if zero is not None else g * inv


def _dynamic_codes(g: torch.Tensor, fmt: TensorFormat, clip, axis: int, levels: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None) -> QuantizedTensor:
    """Codes, fp16 scales and zero-points of ``g`` with one scale per slice along ``axis`` (kept, size 1).

    ``levels`` (a ``nuq`` format's codebook, shaped by ``_levels``): each code is the index of the nearest level instead of
    the rounded value; ``mask``: elements that set no range (outliers, kept elsewhere)."""
    tr = fmt.traits
    scale, zero, inv = _dynamic_range(g, fmt, clip, axis, mask)
    u = _normalized(g, zero, inv)
    if levels is not None:
        q = nearest_level(u, levels)
    elif fmt.symmetric:
        q = _round_codes(u, fmt, tr.sym_min, tr.sym_max)
    else:
        q = _round_codes(u, fmt, 0, tr.asym_max)
    return QuantizedTensor(codes=q, scale=scale, zero=zero)


def _searched_codes(xf: torch.Tensor, fmt: TensorFormat, mask: torch.Tensor | None = None) -> QuantizedTensor:
    """Block-channel codes with each channel's range the one of ``CLIP_GRID`` (shrinks of [min, max] about its centre,
    or of [-amax, amax]) whose dequantized block is nearest ``xf`` in squared error; ties keep the wider range.
    ``mask``: outliers (kept exactly elsewhere): they set no range and cost no error."""
    best: QuantizedTensor | None = None
    best_err = None
    for c in CLIP_GRID:
        qt = _dynamic_codes(xf, fmt, c, -2, mask=mask)
        diff = qt.codes * qt.scale + (qt.zero if qt.zero is not None else 0) - xf
        err = (diff if mask is None else diff.masked_fill(mask, 0.0)).square().sum(-2, keepdim=True)
        if best is None:
            best, best_err = qt, err
            continue
        take = err < best_err
        best = QuantizedTensor(codes=torch.where(take, qt.codes, best.codes), scale=torch.where(take, qt.scale, best.scale),
                               zero=None if qt.zero is None else torch.where(take, qt.zero, best.zero))
        best_err = torch.where(take, err, best_err)
    assert best is not None
    return best


def codebook_of(fmt: TensorFormat, params: TensorParams | None) -> torch.Tensor | None:
    """A ``nuq`` format's calibrated codebook from ``params`` (None for other formats); one line when it is missing."""
    if not fmt.codebook:
        return None
    if params is None or params.codebook is None:
        raise TrtkvError(f"format {fmt.short()} decodes through a calibrated codebook (nuq) but none was given",
                         "run `trtkv calibrate --kv FORMAT` and pass --calibration")
    return params.codebook


def widths_of(fmt: TensorFormat, params: TensorParams | None, num_kv_heads: int | None = None) -> torch.Tensor | None:
    """An ``allocB`` format's calibrated code width per channel [H, D] (int64) from ``params`` (None for other formats);
    one line when it is missing, of another number of heads, or spends more than the format's bits."""
    if fmt.allocated_bits is None:
        return None
    if params is None or params.bits is None:
        raise TrtkvError(f"format {fmt.short()} reads each channel's bits from calibration (alloc) but none were given",
                         "run `trtkv calibrate --kv FORMAT` and pass --calibration")
    w = params.bits.long()
    if not torch.equal(w.to(params.bits.dtype), params.bits) or w.dim() != 2 or (num_kv_heads is not None and w.shape[0] != num_kv_heads):
        raise TrtkvError(f"per-channel bits of shape {tuple(w.shape)} do not fit {num_kv_heads} KV heads (whole bits, [KV heads, head_dim])",
                         "pass the calibration made for this model")
    if bool((w.sum(-1) > fmt.row_code_bits(w.shape[-1])).any()) or not bool(torch.isin(w, torch.tensor(fmt.channel_widths, device=w.device)).all()):
        raise TrtkvError(f"per-channel bits {sorted(set(w.flatten().tolist()))} (at most {int(w.sum(-1).max())} per row) do not fit {fmt.short()}",
                         "recalibrate with this format (`trtkv calibrate --kv FORMAT`)")
    return w


def head_widths(widths: torch.Tensor, ndim: int, head_axis: int) -> torch.Tensor:
    """Per-channel widths [H, D] shaped to broadcast against a tensor of ``ndim`` axes with its KV-head axis at
    ``head_axis`` (int64; ``_per_head``'s reshape)."""
    return _per_head(widths, ndim, head_axis).long()


def channel_codes(xf: torch.Tensor, widths: torch.Tensor, mask: torch.Tensor | None = None) -> QuantizedTensor:
    """Codes (float, unpacked) of sealed blocks ``xf`` [..., bs, D] (tokens on axis -2) at per-channel ``widths``
    (broadcast against ``xf``, ``head_widths``), with scale and zero [..., 1, D]: per block and channel an fp16 minimum
    and step over the channel's ``2 ** width - 1`` codes; a 0-width channel stores step 0 and its (fp16) mean as the
    minimum, so that ``code * s + z`` decodes it. ``mask``: outliers, which set no range and no mean."""
    w = widths.long()
    top = (2.0 ** w - 1).to(xf.dtype)
    keep = torch.ones_like(xf, dtype=torch.bool) if mask is None else ~mask
    n = keep.sum(-2, keepdim=True)
    mn = xf.masked_fill(~keep, torch.inf).amin(-2, keepdim=True)
    mx = xf.masked_fill(~keep, -torch.inf).amax(-2, keepdim=True)
    empty = n == 0
    mn, mx = mn.masked_fill(empty, 0.0), mx.masked_fill(empty, 0.0)
    mean = (xf * keep).sum(-2, keepdim=True) / n.clamp_min(1)
    zero = _to_fp16(torch.where(w > 0, mn, mean))
    scale = _to_fp16(torch.where(w > 0, (mx - mn) / top.clamp_min(1), torch.zeros_like(mn)))
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.minimum(torch.round((xf - zero) * inv).clamp_min(0), top)
    return QuantizedTensor(codes=q, scale=scale, zero=zero)


def quantize(x: torch.Tensor, fmt: TensorFormat, params: TensorParams | None = None, head_axis: int = -2,
             rope: Rope | None = None) -> QuantizedTensor:
    """Quantize K or V (head_dim last) into its stored form, each token on its own (see ``quantize_block``); ``rope``: the
    rows' ``(cos, sin)`` for ``prerope`` keys."""
    if not fmt.is_quantized:
        return QuantizedTensor(codes=x.to(torch.float16))
    if fmt.is_block_wise:
        raise TrtkvError(f"format {fmt.short()} quantizes whole sealed blocks, not single tokens", "use quantize_block")
    if fmt.outliers:
        raise TrtkvError(f"format {fmt.short()} keeps outliers per sealed block, not per token", "use quantize_block")
    check_finite(x, "K/V input")
    return _quantize_rows(forward_transform(x.float(), fmt, params, head_axis, rope), fmt, params, head_axis)


def _quantize_rows(xf: torch.Tensor, fmt: TensorFormat, params: TensorParams | None, head_axis: int,
                   mask: torch.Tensor | None = None) -> QuantizedTensor:
    """Codes of transformed rows ``xf``, each token on its own (static scale, or per token / group); ``mask``: a sealed
    block's outliers, which set no group range."""
    tr = fmt.traits
    if fmt.is_static:
        if params is None or params.scale is None:
            raise TrtkvError(f"format {fmt.short()} needs a calibrated static scale", "run `trtkv calibrate` and pass --calibration")
        scale = _per_head(params.scale, xf.dim(), head_axis)
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = _round_codes(xf * inv, fmt, tr.sym_min, tr.sym_max)
        return QuantizedTensor(codes=fmt.traits.encode(q, True))
    g = _group(xf, fmt)  # [..., G, g]: the head axis moved one further from the end
    cb = codebook_of(fmt, params)
    levels = None if cb is None else _levels(cb, g.dim(), head_axis - 1)
    qt = _dynamic_codes(g, fmt, _dynamic_clip(params, xf.dim(), head_axis), -1, levels, None if mask is None else _group(mask, fmt))
    return QuantizedTensor(
        codes=fmt.traits.encode(qt.codes.flatten(-2), fmt.code_symmetric),
        scale=qt.scale.squeeze(-1).half(),
        zero=None if qt.zero is None else qt.zero.squeeze(-1).half(),
    )


def _deviation(xf: torch.Tensor, fmt: TensorFormat, widths: torch.Tensor | None = None) -> torch.Tensor:
    """Each element's outlier score in blocks ``xf`` [..., bs, D]: its distance from its group's centre -- its channel's
    mean over the block (per_block_channel, asymmetric; ``allocB``: in units of its channel's ``2 ** width`` levels, the
    error it would leave), its token group's mean (per token / group, asymmetric), or 0 (symmetric and static scales)."""
    if fmt.symmetric or fmt.is_static:
        return xf.abs()
    if fmt.is_block_wise:
        dev = (xf - xf.mean(-2, keepdim=True)).abs()
        return dev if widths is None else dev / (2.0 ** widths).to(dev.dtype)
    g = _group(xf, fmt)
    return (g - g.mean(-1, keepdim=True)).abs().flatten(-2)


def block_outliers(xf: torch.Tensor, fmt: TensorFormat, widths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outliers of sealed blocks ``xf`` [..., H, bs, D] (transformed): per (block, head), the ``fmt.outliers`` elements
    farthest from their group's centre (``_deviation``; ``widths``: an ``allocB`` format's, ``head_widths``; ties: the lower
    position first). Returns the mask [..., H, bs, D] (True where kept aside), the positions ``token * D + channel``
    [..., H, N] int16, ascending, and their fp16 values."""
    bs, D = xf.shape[-2:]
    fmt.check_block(bs, D)
    score = _deviation(xf, fmt, widths).flatten(-2)
    n = fmt.outliers
    # the n-th largest score per row (topk: no full sort); everything above it is kept, and of the scores equal to it
    # the lowest positions until n are -- what a stable descending sort's first n would be, without sorting the block
    nth = torch.topk(score, n, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above = score > nth
    tied = score == nth
    keep = above | (tied & (tied.cumsum(-1) <= n - above.sum(-1, keepdim=True)))
    length = score.shape[-1]  # each row's n kept positions, ascending (a topk again: nonzero would wait on a GPU)
    rank = torch.where(keep, length - torch.arange(length, device=score.device), 0)
    idx = length - torch.topk(rank, n, dim=-1).values
    return keep.view(xf.shape), idx.to(torch.int16), _to_fp16(xf.flatten(-2).gather(-1, idx)).half()


def quantize_block(x: torch.Tensor, fmt: TensorFormat, params: TensorParams | None = None, head_axis: int = -3,
                   rope: Rope | None = None) -> QuantizedTensor:
    """Quantize sealed blocks ``x`` [..., H, block_size, D] (tokens on axis -2) as the pool stores them.

    Block-wise formats (``per_block_channel``) get one fp16 scale (and zero-point) per channel over the
    block's tokens: ``scale``/``zero`` [..., H, D]. Every other format quantizes each token on its own,
    exactly as ``quantize``. ``outN`` formats first set aside each block and head's N outliers (``block_outliers``):
    they set no range and are stored beside the codes (``outlier_index`` / ``outlier_value`` [..., H, N]). ``rope``: the
    rows' ``(cos, sin)`` [..., bs, D] (broadcast over heads) for ``prerope`` keys.
    """
    if not fmt.is_quantized or not (fmt.is_block_wise or fmt.outliers):
        return quantize(x, fmt, params, head_axis, rope)
    check_finite(x, "K/V input")
    xf = forward_transform(x.float(), fmt, params, head_axis, rope)
    widths = widths_of(fmt, params, x.shape[head_axis])
    wb = None if widths is None else head_widths(widths, xf.dim(), head_axis)
    mask = oidx = oval = None
    if fmt.outliers:
        mask, oidx, oval = block_outliers(xf, fmt, wb)
    if wb is not None:
        qt = channel_codes(xf, wb, mask)
        return QuantizedTensor(codes=pack_channel_codes(qt.codes.to(torch.uint8), wb, fmt.packed_dim(xf.shape[-1])),
                               scale=qt.scale.squeeze(-2).half(), zero=qt.zero.squeeze(-2).half(), outlier_index=oidx, outlier_value=oval)
    if not fmt.is_block_wise:
        qt = _quantize_rows(xf, fmt, params, head_axis, mask)
        return dataclasses.replace(qt, outlier_index=oidx, outlier_value=oval)
    clip = 1.0 if params is None or params.clip is None else _per_head(params.clip, xf.dim(), head_axis)
    cb = codebook_of(fmt, params)
    if fmt.mse:
        qt = _searched_codes(xf, fmt, mask)
    else:
        qt = _dynamic_codes(xf, fmt, clip, -2, None if cb is None else _levels(cb, xf.dim(), head_axis), mask)
    return QuantizedTensor(
        codes=fmt.traits.encode(qt.codes, fmt.code_symmetric),
        scale=qt.scale.squeeze(-2).half(),
        zero=None if qt.zero is None else qt.zero.squeeze(-2).half(),
        outlier_index=oidx,
        outlier_value=oval,
    )


def normalized_block(x: torch.Tensor, fmt: TensorFormat, params: TensorParams | None = None, head_axis: int = -3,
                     rope: Rope | None = None):
    """What the seal of sealed blocks ``x`` [..., H, bs, D] snaps to a code, for fitting a codebook: ``(u, s, dense)``, all
    [..., H, bs, D] float32 / bool -- the normalized values (code units, before rounding or the level search), each
    element's scale (what one code unit is worth in the transformed space) and False where the element is an outlier.
    Dynamic formats only; the same range rules as ``quantize_block``."""
    if not fmt.is_dynamic:
        raise ValueError(f"{fmt.short()}: only dynamic formats have normalized values")
    xf = forward_transform(x.float(), fmt, params, head_axis, rope)
    mask = block_outliers(xf, fmt)[0] if fmt.outliers else None
    if fmt.is_block_wise:
        clip = 1.0 if params is None or params.clip is None else _per_head(params.clip, xf.dim(), head_axis)
        scale, zero, inv = _dynamic_range(xf, fmt, clip, -2, mask)
        u, s = _normalized(xf, zero, inv), scale.expand_as(xf)
    else:
        g = _group(xf, fmt)
        scale, zero, inv = _dynamic_range(g, fmt, _dynamic_clip(params, xf.dim(), head_axis), -1, None if mask is None else _group(mask, fmt))
        u, s = _normalized(g, zero, inv).flatten(-2), scale.expand_as(g).flatten(-2)
    dense = torch.ones_like(u, dtype=torch.bool) if mask is None else ~mask
    return u, s.float(), dense


def dequantize(
    qt: QuantizedTensor,
    fmt: TensorFormat,
    params: TensorParams | None = None,
    head_axis: int = -2,
    dtype: torch.dtype = torch.float32,
    transforms: bool = True,
    rope: Rope | None = None,
) -> torch.Tensor:
    """Stored form back to values in the model's channel space (transforms undone; ``transforms=False``: left in
    the stored channel space -- smoothed / rotated / before RoPE -- for consumers that fold them into the query and
    output). ``rope``: the rows' ``(cos, sin)`` for ``prerope`` keys.

    Block-wise formats: ``codes`` [..., block_size, D'] with ``scale``/``zero`` [..., D] (see ``quantize_block``);
    formats with outliers: ``codes`` of whole blocks [..., block_size, D'] with ``outlier_*`` [..., N].
    """
    if not fmt.is_quantized:
        return qt.codes.to(dtype)
    sym = fmt.symmetric or fmt.is_static
    if fmt.allocated_bits is not None:  # per-channel widths: the codes of a row by ``channel_offsets``
        c = unpack_channel_codes(qt.codes, head_widths(widths_of(fmt, params), qt.codes.dim(), head_axis)).float()
    else:
        c = fmt.traits.stored_values(qt.codes)  # codes + offset: the offset is folded into the zero-point below
    if fmt.codebook:  # a code is a table index: its value is the level (no offset)
        c, off = lookup_levels(c, codebook_of(fmt, params), head_axis), 0
    else:
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
    if qt.outlier_index is not None:
        x = restore_outliers(x, qt.outlier_index, qt.outlier_value)
    return (inverse_transform(x, fmt, params, head_axis, rope) if transforms else x).to(dtype)


def restore_outliers(x: torch.Tensor, index: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Blocks ``x`` [..., bs, D] (transformed space) with their outliers (positions ``index``, values ``value`` [..., N])
    written back over the dequantized codes."""
    return x.flatten(-2).scatter(-1, index.long(), value.to(x.dtype)).view(x.shape)


def _affine(c: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, offset: int) -> torch.Tensor:
    """``(c - offset) * scale + zero`` in one pass over ``c`` (``addcmul``): dequantization is bandwidth-bound."""
    shift = -offset * scale if offset else None
    if zero is not None:
        shift = zero if shift is None else shift + zero
    return c * scale if shift is None else torch.addcmul(shift, c, scale)


def fake_quantize(x: torch.Tensor, fmt: TensorFormat, params: TensorParams | None = None, head_axis: int = -2,
                  rope: Rope | None = None) -> torch.Tensor:
    """``dequantize(quantize(x))`` in x's dtype: what attention sees when reading the stored cache."""
    return dequantize(quantize(x, fmt, params, head_axis, rope), fmt, params, head_axis, dtype=x.dtype, rope=rope)


def fake_quantize_block(x: torch.Tensor, fmt: TensorFormat, params: TensorParams | None = None, head_axis: int = -3,
                        rope: Rope | None = None) -> torch.Tensor:
    """``dequantize(quantize_block(x))`` for sealed blocks [..., H, block_size, D], in x's dtype."""
    return dequantize(quantize_block(x, fmt, params, head_axis, rope), fmt, params, head_axis, dtype=x.dtype, rope=rope)
