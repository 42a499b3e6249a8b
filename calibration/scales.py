"""Scale choice: turn ``KVStats`` into per-layer ``LayerParams`` for a ``KVFormat``.

Static formats (per_tensor / per_head / per_channel scales) get ``scale = range / qmax`` with the
range from

* ``max``        -- the calibration absmax,
* ``percentile`` -- a percentile of |x| (histograms for per_tensor / per_head, the reservoir
  sample for per_channel), never above the absmax,
* ``mse``        -- ``ratio * absmax`` with the ratio searched on a grid, minimising the
  reconstruction error ``||fake_quantize(x) - x||^2`` on the reservoir sample, independently for
  each group the granularity allows (layer, head or channel).

``shared_kv_scale`` formats search one range for K and V together (max: the max of both).
Smoothing factors (``smooth=True``) are SmoothQuant-style ``absmax_c ** alpha`` per (layer, head,
channel), divided by their geometric mean over the head's channels. Dynamic formats get a per
(layer, head) clip ratio in ``TensorParams.clip`` with ``mse`` (grid over [0.5, 1]); ``max`` and
``percentile`` leave them unclipped. All quantization goes through ``trtkv.quant.fake_quantize``.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import torch

from trtkv.artifacts import LayerParams
from trtkv.calibration.stats import KVStats
from trtkv.errors import TrtkvError
from trtkv.formats import KVFormat, TensorFormat
from trtkv.quant import TensorParams, fake_quantize, fake_quantize_block

Method = Literal["max", "percentile", "mse"]
METHODS = ("max", "percentile", "mse")
HEAD_AXIS = -2  # reservoir rows are [tokens, heads, head_dim]
SMOOTH_FLOOR = 1e-3  # channel absmax floor, relative to the head's largest channel, before ** alpha


DEFAULT_REFINE = 2


def default_static_grid() -> torch.Tensor:
    """Coarse range ratios of the static MSE search: 0.30, 0.35, ..., 1.00 (then refined)."""
    return torch.linspace(0.3, 1.0, 15)


def default_clip_grid() -> torch.Tensor:
    """Coarse clip ratios for dynamic formats: 0.50, 0.55, ..., 1.00 (then refined)."""
    return torch.linspace(0.5, 1.0, 11)


def smoothing_factors(absmax: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """SmoothQuant-style per-channel divisors from channel absmax [..., D]: ``a**alpha / geomean``.

    Channels are floored at ``SMOOTH_FLOOR`` x the head's largest channel so dead channels do not
    blow up; the result is positive with geometric mean 1 over each head's channels.
    """
    a = absmax.double()
    floor = a.amax(-1, keepdim=True).clamp_min(1e-12) * SMOOTH_FLOOR
    s = torch.maximum(a, floor).pow(alpha)
    s = s / torch.exp(torch.log(s).mean(-1, keepdim=True))
    return s.float()


def query_smoothing_factors(stats: KVStats, pre_rope: bool = False) -> torch.Tensor:
    """Key smoothing divisors of ``qsmooth`` formats per (layer, KV head, channel) [L, H, D]: ``sqrt(rms_K / rms_Q)`` over
    the calibration tokens (post-RoPE keys as cached, queries as attention receives them, a KV head's query heads
    pooled), geometric mean 1 per head. ``pre_rope`` (``prerope`` keys, smoothed before RoPE is applied again): the keys
    before RoPE, and per channel the mean query energy of its RoPE pair (channels c and c + D/2 turn into each other as
    the distance between query and key changes, so a pre-RoPE key channel meets both).

    Why this one: the query absorbs the divisor (``q * s``, docs/kv-formats.md §2), so channel c's key error reaches the
    logits times ``E[q_c^2]``; after a rotation the quantization error is spread evenly over the channels of the smoothed
    keys, at a level set by their total energy ``sum K_c / s_c^2``. Minimising ``(sum K_c / s_c^2)(sum w_c s_c^2)``
    (energy x weighted error, ``K = E[k^2]``, ``w = E[q^2]``) gives ``s_c^4 ∝ K_c / w_c`` (Cauchy-Schwarz)."""
    k_rms = (stats.tensors["k_pre" if pre_rope else "k"].sumsq / max(stats.count, 1)).sqrt().float()
    q2 = stats.query_moment().diagonal(dim1=-2, dim2=-1).clamp_min(0)
    if pre_rope:
        half = q2.shape[-1] // 2
        q2 = (q2 + torch.cat([q2[..., half:], q2[..., :half]], -1)) / 2
    q_rms = q2.sqrt().float()
    return smoothing_factors(k_rms / q_rms.clamp_min(1e-6 * float(q_rms.max().clamp_min(1e-30))), 0.5)


def _static_range(stats: KVStats, kind: str, tf: TensorFormat, method: Method, percentile: float,
                  smooth: torch.Tensor | None) -> torch.Tensor:
    """Range (absmax-like) per layer at tf.granularity: [L], [L, H] or [L, H, D] in the transformed space."""
    g = tf.granularity
    if tf.hadamard:  # the rotated space's statistics only exist through the reservoir
        return torch.stack([_reservoir_range(_transform(stats.samples(kind, i), tf, smooth, i), g, method, percentile) for i in range(stats.num_layers)])
    if smooth is not None and g != "per_channel" and method == "percentile":
        return torch.stack([_reservoir_range(_transform(stats.samples(kind, i), tf, smooth, i), g, method, percentile) for i in range(stats.num_layers)])
    absmax = stats.absmax(kind, "per_channel")
    if smooth is not None:
        absmax = absmax / smooth
    amax = _reduce(absmax, g)
    if method == "percentile":
        if g == "per_channel":
            pct = torch.stack([_reservoir_range(_transform(stats.samples(kind, i), tf, smooth, i), g, method, percentile) for i in range(stats.num_layers)])
        else:
            pct = stats.percentile(kind, percentile, g)
        return torch.minimum(pct, amax)
    return amax


def _reduce(absmax: torch.Tensor, granularity: str) -> torch.Tensor:
    """[L, H, D] channel absmax -> [L] / [L, H] / [L, H, D]."""
    if granularity == "per_channel":
        return absmax
    if granularity == "per_head":
        return absmax.amax(-1)
    return absmax.flatten(1).amax(-1)


def _reservoir_range(x: torch.Tensor, granularity: str, method: str, percentile: float) -> torch.Tensor:
    """Range of reservoir rows x [R, H, D] at a granularity (absmax, or a percentile of |x|)."""
    a = x.abs()
    if granularity == "per_tensor":
        flat = a.flatten()
    elif granularity == "per_head":
        flat = a.transpose(0, 1).reshape(a.shape[1], -1)  # [H, R*D]
    else:
        flat = a.permute(1, 2, 0)  # [H, D, R]
    if method != "percentile" or flat.shape[-1] == 0:
        return flat.amax(-1) if flat.numel() else torch.zeros(flat.shape[:-1])
    return torch.quantile(flat.float(), percentile / 100.0, dim=-1)


def _transform(x: torch.Tensor, tf: TensorFormat, smooth: torch.Tensor | None, layer: int) -> torch.Tensor:
    from trtkv.quant import forward_transform

    params = TensorParams(smooth=smooth[layer]) if smooth is not None else None
    return forward_transform(x, tf, params, HEAD_AXIS)


def _scale(rng: torch.Tensor, tf: TensorFormat) -> torch.Tensor:
    return rng.clamp_min(1e-12) / tf.traits.sym_max


MAX_SEARCH_ELEMENTS = 1 << 23  # elements per batched fake_quantize call in the grid searches


def _tile(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """Repeat a per-head constant [G] / [G, D] for n grid candidates: [n*G] / [n*G, D] (candidate-major)."""
    return None if t is None else t.repeat(n, *([1] * (t.dim() - 1)))


def _all_layers(stats: KVStats, kind: str) -> torch.Tensor:
    """Reservoir rows of every layer side by side on the head axis: [R, L*H, D] (layer-major)."""
    r = stats.reservoir[kind].float()  # [L, R, H, D]
    L, R, H, D = r.shape
    return r.permute(1, 0, 2, 3).reshape(R, L * H, D)


def _candidate_errors(x: torch.Tensor, tf: TensorFormat, make_params, cand: torch.Tensor, granularity: str, L: int) -> torch.Tensor:
    """Squared error of rows x [R, L*H, D] for candidate ratios ``cand`` [n, L, *group], summed per group.

    All candidates and layers go through few ``fake_quantize`` calls, stacked along the head axis:
    rows become [R, n*L*H, D] and ``make_params(cand_chunk) -> TensorParams`` returns constants per
    (candidate, layer, head), in that order. Returns [n, L] (per_tensor), [n, L, H] or [n, L, H, D].
    """
    R, LH, D = x.shape
    H = LH // L
    chunk = max(1, MAX_SEARCH_ELEMENTS // max(x.numel(), 1))
    out = []
    for start in range(0, cand.shape[0], chunk):
        c = cand[start : start + chunk]
        n = c.shape[0]
        xr = x.repeat(1, n, 1)  # [R, n*L*H, D]
        e = (fake_quantize(xr, tf, make_params(c), HEAD_AXIS) - xr).square_()
        e = e.view(R, n, L, H, D).sum(0, dtype=torch.float64)  # [n, L, H, D]
        if granularity == "per_head":
            e = e.sum(-1)
        elif granularity == "per_tensor":
            e = e.sum((-1, -2))
        out.append(e)
    return torch.cat(out)


def _search(errors_of, group_shape: tuple[int, ...], grid: torch.Tensor, refine: int) -> torch.Tensor:
    """Coarse grid search per group, then ``refine`` points each side of the best at 1/(refine+1) of the grid step.

    ``errors_of(cand [n, *group_shape]) -> [n, *group_shape]``. Fine points stay inside the grid's range.
    """
    coarse = grid.view(-1, *([1] * len(group_shape))).expand(-1, *group_shape)
    err = errors_of(coarse)
    idx = err.argmin(0, keepdim=True)
    best, best_err = coarse.gather(0, idx)[0], err.gather(0, idx)[0]
    if refine > 0 and len(grid) > 1:
        step = float((grid[1:] - grid[:-1]).abs().min())
        offsets = torch.tensor([k * step / (refine + 1) for k in range(-refine, refine + 1) if k], dtype=grid.dtype)
        fine = (best.unsqueeze(0) + offsets.view(-1, *([1] * len(group_shape)))).clamp(float(grid.min()), float(grid.max()))
        ferr = errors_of(fine)
        fidx = ferr.argmin(0, keepdim=True)
        fbest, fbest_err = fine.gather(0, fidx)[0], ferr.gather(0, fidx)[0]
        best = torch.where(fbest_err < best_err, fbest, best)
    return best.float()


def _mse_static(stats: KVStats, kinds: Sequence[str], tfs: Sequence[TensorFormat], smooths: Sequence[torch.Tensor | None],
                rng: torch.Tensor, grid: torch.Tensor, refine: int) -> torch.Tensor:
    """Best range ratio per group for every layer (the shape of ``rng``: [L], [L, H] or [L, H, D]).

    With two kinds (shared K/V scale) the errors are added and one ratio is chosen for both.
    """
    g = tfs[0].granularity
    L, H = stats.num_layers, stats.num_kv_heads
    per_head = rng.float().unsqueeze(-1).expand(L, H) if rng.dim() == 1 else rng.float()  # [L, H] or [L, H, D]
    xs = [_all_layers(stats, kind) for kind in kinds]

    def errors_of(cand: torch.Tensor) -> torch.Tensor:
        total = None
        for x, tf, sm in zip(xs, tfs, smooths):
            def make(c, tf=tf, sm=sm):
                full = c.reshape(*c.shape, *([1] * (per_head.dim() + 1 - c.dim()))) * per_head  # [n, L, H(, D)]
                smooth = None if sm is None else _tile(sm.reshape(L * H, -1), c.shape[0])
                return TensorParams(scale=_scale(full.flatten(0, 2), tf), smooth=smooth)

            e = _candidate_errors(x, tf, make, cand, g, L)
            total = e if total is None else total + e
        return total

    return _search(errors_of, tuple(rng.shape), grid, refine)


def _mse_clip(stats: KVStats, kind: str, tf: TensorFormat, smooth: torch.Tensor | None, grid: torch.Tensor, refine: int) -> torch.Tensor:
    """Per (layer, head) clip ratio [L, H] minimising the dynamic format's error on the reservoir."""
    L, H = stats.num_layers, stats.num_kv_heads
    x = _all_layers(stats, kind)
    sm = None if smooth is None else smooth.reshape(L * H, -1)

    def make(c):  # c: [n, L, H]
        return TensorParams(smooth=_tile(sm, c.shape[0]), clip=c.reshape(-1).float())

    return _search(lambda cand: _candidate_errors(x, tf, make, cand, "per_head", L), (L, H), grid, refine)


def choose_params(
    stats: KVStats,
    fmt: KVFormat,
    method: Method = "mse",
    *,
    percentile: float = 99.9,
    smooth_alpha: float = 0.5,
    static_grid: torch.Tensor | Sequence[float] | None = None,
    clip_grid: torch.Tensor | Sequence[float] | None = None,
    refine: int = DEFAULT_REFINE,
    codebook_per_head: bool = True,
    codebook_weight_keys: bool = True,
    rope: Any = None,
) -> list[LayerParams]:
    """Per-layer parameters of ``fmt`` from ``stats`` (see the module docstring for the methods).

    Knobs: ``percentile`` (method percentile), ``smooth_alpha`` (smoothing exponent),
    ``static_grid`` (coarse range ratios for static mse, default 0.3..1.0 step 0.05), ``clip_grid``
    (coarse clip ratios for dynamic mse, default 0.5..1.0 step 0.05), ``refine`` (fine points each
    side of the coarse optimum, at 1/(refine+1) of the grid step; 0: grid only). ``nuq`` sides get a codebook
    (calibration/codebook.py: one per KV head, or with ``codebook_per_head`` False one per layer; key errors weighted by
    the queries unless ``codebook_weight_keys`` is False) and no clip: the outer levels are where the range is cut.
    ``allocB`` sides get their bits per channel (calibration/channel_bits.py; ``rope``, each layer's
    ``trtkv.rope.RopeTable``, for keys stored before RoPE).
    """
    if method not in METHODS:
        raise TrtkvError(f"unknown calibration method {method!r}", f"use one of {', '.join(METHODS)}")
    if not 0 < percentile <= 100:
        raise TrtkvError(f"percentile {percentile} is outside (0, 100]", "pass e.g. --percentile 99.9")
    needs_sample = method == "mse" or any(t.hadamard for t in (fmt.k, fmt.v))
    if needs_sample and stats.reservoir_size == 0:
        raise TrtkvError("the statistics hold no reservoir sample, which this method needs", "collect statistics with a reservoir (the default)")
    sgrid = torch.as_tensor(static_grid if static_grid is not None else default_static_grid(), dtype=torch.float32)
    cgrid = torch.as_tensor(clip_grid if clip_grid is not None else default_clip_grid(), dtype=torch.float32)
    if (sgrid <= 0).any() or (cgrid <= 0).any() or (cgrid > 1).any():
        raise TrtkvError("grid ratios must be in (0, 1] (static ranges may exceed 1)", "pass grids like torch.linspace(0.5, 1, 26)")

    L = stats.num_layers
    tfs = {"k": fmt.k, "v": fmt.v}
    smooth = {kv: (query_smoothing_factors(stats, tf.pre_rope) if tf.smooth_by == "queries"
                   else smoothing_factors(stats.absmax("k_pre" if tf.pre_rope else kv, "per_channel"), smooth_alpha))
              if tf.smooth else None for kv, tf in tfs.items()}
    scale: dict[str, torch.Tensor | None] = {"k": None, "v": None}
    clip: dict[str, torch.Tensor | None] = {"k": None, "v": None}

    static = [kv for kv, tf in tfs.items() if tf.is_quantized and tf.is_static]
    if static:
        ranges = {kv: _static_range(stats, kv, tfs[kv], method, percentile, smooth[kv]) for kv in static}
        if fmt.shared_kv_scale:
            if method == "mse":
                both = torch.maximum(ranges["k"], ranges["v"])
                ratio = _mse_static(stats, static, [tfs[kv] for kv in static], [smooth[kv] for kv in static], both, sgrid, refine)
                shared = both * ratio
            else:
                shared = torch.maximum(ranges["k"], ranges["v"])
            for kv in static:
                scale[kv] = _scale(shared, tfs[kv])
        else:
            for kv in static:
                rng = ranges[kv]
                if method == "mse":
                    ratio = _mse_static(stats, [kv], [tfs[kv]], [smooth[kv]], rng, sgrid, refine)
                    rng = rng * ratio
                scale[kv] = _scale(rng, tfs[kv])

    if method == "mse":
        for kv, tf in tfs.items():
            # block-wise ranges are per block: no clip; a codebook's outer levels clip; outliers are left out of the range;
            # the reservoir holds keys after RoPE, not the prerope frame
            if tf.is_quantized and tf.is_dynamic and not (tf.is_block_wise or tf.codebook or tf.outliers or tf.pre_rope):
                clip[kv] = _mse_clip(stats, kv, tf, smooth[kv], cgrid, refine)

    out = []
    for i in range(L):
        lp = LayerParams()
        for kv in ("k", "v"):
            tp = TensorParams(
                scale=None if scale[kv] is None else scale[kv][i].float().clone(),
                smooth=None if smooth[kv] is None else smooth[kv][i].clone(),
                clip=None if clip[kv] is None else clip[kv][i].clone(),
            )
            setattr(lp, kv, tp)
        out.append(lp)
    if any(tf.codebook for tf in tfs.values()):
        from trtkv.calibration.codebook import fit_codebooks

        fit_codebooks(stats.windows, fmt, out, stats.query if stats.query is None else stats.query_moment(),
                      per_head=codebook_per_head, weight_keys=codebook_weight_keys)
    if any(t.allocated_bits is not None for f in fmt.layer_formats() for t in (f.k, f.v)):
        from trtkv.calibration.channel_bits import allocate_channel_bits

        allocate_channel_bits(stats.windows, fmt, out, stats.query if stats.query is None else stats.query_moment(), rope,
                              weight_keys=codebook_weight_keys)
    return out


def reservoir_error(stats: KVStats, fmt: KVFormat, params: Sequence[LayerParams]) -> dict[str, list[float]]:
    """Mean squared reconstruction error per layer on the reservoir: ``{"k": [...], "v": [...]}``."""
    out: dict[str, list[float]] = {"k": [], "v": []}
    if stats.reservoir_size == 0:
        return out
    for kv, tf in (("k", fmt.k), ("v", fmt.v)):
        if tf.pre_rope:  # reservoir rows are keys after RoPE at unknown positions: no error to report in the prerope frame
            continue
        for i, lp in enumerate(params):
            x = stats.samples(kv, i)
            if tf.is_block_wise or tf.outliers:  # reservoir rows grouped into pseudo-blocks of block_size rows [n, H, bs, D]
                bs = fmt.block_size or 1
                n = x.shape[0] // bs
                x = x[: n * bs].reshape(n, bs, *x.shape[1:]).transpose(1, 2)
                err = fake_quantize_block(x, tf, getattr(lp, kv)) - x
            else:
                err = fake_quantize(x, tf, getattr(lp, kv), HEAD_AXIS) - x
            out[kv].append(float(err.square().mean(dtype=torch.float64)))
    return out


def clip_ratio(stats: KVStats, fmt: KVFormat, params: Sequence[LayerParams]) -> dict[str, list[float | None]]:
    """Per layer, the chosen range as a fraction of the max-calibration range (mean over groups).

    Static: ``scale * qmax / absmax`` (transformed space); dynamic: the clip ratio (1.0 if none);
    unquantized: None.
    """
    out: dict[str, list[float | None]] = {"k": [], "v": []}
    for kv, tf in (("k", fmt.k), ("v", fmt.v)):
        if tf.is_static and tf.is_quantized:
            sm = None
            if tf.smooth and params and getattr(params[0], kv).smooth is not None:
                sm = torch.stack([getattr(lp, kv).smooth for lp in params])
            if tf.hadamard and stats.reservoir_size:
                amax = torch.stack([_reservoir_range(_transform(stats.samples(kv, i), tf, sm, i), tf.granularity, "max", 100) for i in range(stats.num_layers)])
            else:
                a = stats.absmax(kv, "per_channel")
                amax = _reduce(a / sm if sm is not None else a, tf.granularity)
                if fmt.shared_kv_scale:  # relative to the shared (K and V) range
                    amax = torch.maximum(_reduce(stats.absmax("k", "per_channel"), "per_tensor"), _reduce(stats.absmax("v", "per_channel"), "per_tensor"))
            for i, lp in enumerate(params):
                s = getattr(lp, kv).scale
                r = (s * tf.traits.sym_max / amax[i].clamp_min(1e-12)).mean()
                out[kv].append(float(r))
        elif tf.is_quantized:
            out[kv] = [float(getattr(lp, kv).clip.mean()) if getattr(lp, kv).clip is not None else 1.0 for lp in params]
        else:
            out[kv] = [None] * len(params)
    return out
