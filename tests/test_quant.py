"""trtkv.quant against an independent float64 reference written here as plain Python loops.

The reference (``ref_quantize`` / ``ref_dequantize``) walks every token, head, group and element
one by one, in float64, and decodes the stored bytes itself (int4 nibbles, e4m3 bit patterns),
so it shares no code with the vectorised torch implementation. The only allowed disagreements
are the ones float32 arithmetic must produce: an fp16 scale one ulp apart (double rounding) and
a code one step apart for a value within a hair of a rounding tie.
"""

from __future__ import annotations

import bisect
import math
import zlib

import numpy as np
import pytest
import torch
from conftest import naive_mse_range
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trtkv.errors import TrtkvError
from trtkv.formats import DTYPES, PRESETS, TensorFormat, parse_tensor_spec
from trtkv.quant import (
    QuantizedTensor,
    TensorParams,
    dequantize,
    fake_quantize,
    forward_transform,
    hadamard_matrix,
    inverse_transform,
    pack_int4,
    quantize,
    quantize_block,
    unpack_int4,
)

FP16_MAX = 65504.0


# ----------------------------------------------------------------------------- reference pieces


def f16(v: float) -> float:
    """Round a float64 to the nearest fp16 (ties to even) — numpy converts double->half correctly rounded."""
    return float(np.float16(min(max(v, -FP16_MAX), FP16_MAX)))


def f16_ulp(v: float) -> float:
    v = abs(f16(v))
    return float(np.spacing(np.float16(v)))


def ref_hadamard(n: int) -> list[list[float]]:
    """Block-diagonal Sylvester Hadamard from its closed form H[i][j] = (-1)^popcount(i & j) / sqrt(block)."""
    block = 1
    while n % (2 * block) == 0:
        block *= 2
    h = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i // block == j // block:
                a, b = i % block, j % block
                h[i][j] = (-1.0) ** bin(a & b).count("1") / math.sqrt(block)
    return h


def e4m3_value(byte: int) -> float:
    """Decode one float8_e4m3fn bit pattern: 1 sign, 4 exponent (bias 7), 3 mantissa bits, no inf, S.1111.111 = NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 15 and man == 7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


_E4M3_POS = [e4m3_value(b) for b in range(0x7F)]  # bytes 0x00..0x7E, increasing, 0x7E = 448


def e4m3_encode(v: float) -> int:
    """Nearest e4m3fn pattern to v (|v| <= 448), ties to the even pattern; sign kept for -0."""
    neg = math.copysign(1.0, v) < 0
    a = abs(v)
    assert a <= 448.0
    i = bisect.bisect_left(_E4M3_POS, a)
    if i < len(_E4M3_POS) and _E4M3_POS[i] == a:
        b = i
    else:
        lo, hi = i - 1, i
        dlo, dhi = a - _E4M3_POS[lo], _E4M3_POS[hi] - a
        b = lo if dlo < dhi else hi if dhi < dlo else (lo if lo % 2 == 0 else hi)
    return b | (0x80 if neg else 0)


def code_range(fmt: TensorFormat) -> tuple[float, float]:
    tr = DTYPES[fmt.dtype]
    if fmt.symmetric or fmt.is_static:
        return tr.sym_min, tr.sym_max
    return 0, tr.asym_max


def ref_quantize(x: torch.Tensor, fmt: TensorFormat, params: TensorParams | None, head_axis: int) -> dict:
    """Naive float64 quantizer: every token, head, group and element in a Python loop.

    Returns, each as a float64 array: ``y`` (transformed input), ``u`` (unrounded code value),
    ``code`` (the code value: integer, or the e4m3 value), ``byte`` (fp8 bit patterns),
    per-group ``scale``/``zero`` (fp16-rounded) and ``scale_exact``/``zero_exact`` (before rounding).
    """
    xs = x.double().numpy()
    d = xs.shape[-1]
    lead = xs.shape[:-1]
    hpos = head_axis % xs.ndim
    qmin, qmax = code_range(fmt)
    is_fp8 = fmt.dtype == "fp8_e4m3"
    sm = None if params is None or params.smooth is None else params.smooth.double().tolist()
    had = ref_hadamard(d) if fmt.hadamard else None
    st_scale = None if params is None or params.scale is None else params.scale.double().tolist()
    clip = None if params is None or params.clip is None else params.clip.double().tolist()
    n_groups = fmt.groups(d) if fmt.is_dynamic else 0
    out = {k: np.zeros(xs.shape) for k in ("y", "u", "code", "byte")}
    for k in ("scale", "zero", "scale_exact", "zero_exact"):
        out[k] = np.zeros((*lead, max(n_groups, 1)))

    def to_code(u: float) -> tuple[float, int]:
        if is_fp8:
            b = e4m3_encode(min(max(u, qmin), qmax))
            return e4m3_value(b), b
        return float(min(max(round(u), qmin), qmax)), 0  # Python's round() is half-to-even

    for idx in np.ndindex(*lead):
        h = idx[hpos]
        row = [float(xs[idx + (c,)]) for c in range(d)]
        if fmt.smooth:
            row = [row[c] / sm[h][c] for c in range(d)]
        if fmt.hadamard:
            row = [sum(row[j] * had[j][c] for j in range(d)) for c in range(d)]
        for c in range(d):
            out["y"][idx + (c,)] = row[c]
        if fmt.is_static:
            for c in range(d):
                s = st_scale if fmt.granularity == "per_tensor" else st_scale[h] if fmt.granularity == "per_head" else st_scale[h][c]
                u = row[c] / s if s > 0 else 0.0
                out["u"][idx + (c,)] = u
                out["code"][idx + (c,)], out["byte"][idx + (c,)] = to_code(u)
            continue
        g = d // n_groups
        cl = 1.0 if clip is None else clip if isinstance(clip, float) else clip[h]
        for gi in range(n_groups):
            vals = row[gi * g : (gi + 1) * g]
            if fmt.symmetric:
                s_exact = max(abs(v) for v in vals) * cl / qmax
                z_exact = 0.0
            else:
                mn, mx = min(vals), max(vals)
                s_exact = (mx - mn) * cl / qmax
                z_exact = mn + (mx - mn) * (1 - cl) / 2  # clipping shrinks [mn, mx] about its centre
            s, z = f16(s_exact), f16(z_exact)  # fp16 scale/zero are fixed before the codes
            out["scale"][idx + (gi,)], out["zero"][idx + (gi,)] = s, z
            out["scale_exact"][idx + (gi,)], out["zero_exact"][idx + (gi,)] = s_exact, z_exact
            for j, v in enumerate(vals):
                c = gi * g + j
                u = (v - z) / s if s > 0 else 0.0
                out["u"][idx + (c,)] = u
                out["code"][idx + (c,)], out["byte"][idx + (c,)] = to_code(u)
    return out


def decode_stored(qt: QuantizedTensor, fmt: TensorFormat, d: int) -> np.ndarray:
    """Code values from the stored tensor, decoded byte by byte without trtkv's unpack."""
    raw = qt.codes.contiguous()
    if fmt.dtype == "fp8_e4m3":
        assert raw.dtype == torch.uint8
        by = raw.numpy()
        return np.vectorize(e4m3_value, otypes=[float])(by)
    if fmt.dtype == "int8":
        assert raw.dtype == (torch.int8 if (fmt.symmetric or fmt.is_static) else torch.uint8)
        return raw.numpy().astype(np.float64)
    sym = fmt.symmetric or fmt.is_static
    if fmt.dtype in ("int3", "int2"):  # docs/kv-cache-format.md: int2 four codes per byte; int3 a 2-bit plane then a 1-bit plane
        assert raw.dtype == torch.uint8 and raw.shape[-1] == d * (3 if fmt.dtype == "int3" else 2) // 8
        by = raw.numpy()
        out = np.zeros((*by.shape[:-1], d))
        for idx in np.ndindex(*by.shape[:-1]):
            for c in range(d):
                code = (int(by[idx + (c // 4,)]) >> (2 * (c % 4))) & 3
                if fmt.dtype == "int3":
                    code |= ((int(by[idx + (d // 4 + c // 8,)]) >> (c % 8)) & 1) << 2
                out[idx + (c,)] = code - ((4 if fmt.dtype == "int3" else 2) if sym else 0)
        return out
    assert raw.dtype == torch.uint8 and raw.shape[-1] == d // 2
    by = raw.numpy()
    out = np.zeros((*by.shape[:-1], d))
    offset = 8 if sym else 0
    for idx in np.ndindex(*by.shape[:-1]):
        for c in range(d):
            b = int(by[idx + (c // 2,)])
            nib = b & 0xF if c % 2 == 0 else b >> 4  # even channel = low nibble
            out[idx + (c,)] = nib - offset
    return out


def ref_dequantize(code: np.ndarray, scale, zero, fmt: TensorFormat, params: TensorParams | None, head_axis: int) -> np.ndarray:
    """Naive dequantization of code values, transforms undone element by element."""
    d = code.shape[-1]
    lead = code.shape[:-1]
    hpos = head_axis % code.ndim
    had = ref_hadamard(d) if fmt.hadamard else None
    sm = None if not fmt.smooth else params.smooth.double().tolist()
    st_scale = None if not fmt.is_static else params.scale.double().tolist()
    out = np.zeros(code.shape)
    for idx in np.ndindex(*lead):
        h = idx[hpos]
        row = []
        for c in range(d):
            if fmt.is_static:
                s = st_scale if fmt.granularity == "per_tensor" else st_scale[h] if fmt.granularity == "per_head" else st_scale[h][c]
                row.append(code[idx + (c,)] * s)
            else:
                gi = c // (d // fmt.groups(d))
                z = 0.0 if fmt.symmetric else float(zero[idx + (gi,)])
                row.append(code[idx + (c,)] * float(scale[idx + (gi,)]) + z)
        if fmt.hadamard:  # x = y @ H^T
            row = [sum(row[j] * had[c][j] for j in range(d)) for c in range(d)]
        if fmt.smooth:
            row = [row[c] * sm[h][c] for c in range(d)]
        for c in range(d):
            out[idx + (c,)] = row[c]
    return out


# ----------------------------------------------------------------------------- inputs


def make_input(shape, seed: int, pathological: bool = True) -> torch.Tensor:
    """Random rows plus special rows: zeros, constant, negative-only, 1e4 outliers, tiny, offset."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2
    rows = x.view(-1, shape[-1])
    d = shape[-1]
    rows[0] = 0.0
    rows[1] = 0.75  # constant, fp16-exact
    rows[2] = -(torch.rand(d, generator=g) + 0.1)  # negative only
    rows[3, ::7] = 1e4 * torch.sign(torch.randn(rows[3, ::7].shape, generator=g))  # extreme outliers
    rows[4, 1::5] = 1e-6  # tiny entries among normal ones
    if pathological:
        rows[5] = torch.randn(d, generator=g) * 1e-6  # tiny row: fp16 scale underflows
        rows[6] = 1000.2  # constant not representable in fp16
        rows[7] = 100 + torch.rand(d, generator=g)  # offset 100x the range
    return x


def layout_shape(head_axis: int, d: int) -> tuple[int, ...]:
    return (7, 3, d) if head_axis == -2 else (2, 3, 5, d)  # [tokens, heads, D] | [batch, heads, seq, D]


def make_params(fmt: TensorFormat, heads: int, d: int, seed: int, clip=None) -> TensorParams:
    g = torch.Generator().manual_seed(seed + 1)
    qmax = DTYPES[fmt.dtype].sym_max
    p = TensorParams()
    if fmt.smooth:
        p.smooth = 0.5 + 1.5 * torch.rand(heads, d, generator=g)
    if fmt.is_static:
        if fmt.granularity == "per_tensor":
            p.scale = torch.tensor(3.0 / qmax)
        elif fmt.granularity == "per_head":
            p.scale = (1 + 3 * torch.rand(heads, generator=g)) / qmax
        else:
            p.scale = (1 + 3 * torch.rand(heads, d, generator=g)) / qmax
            p.scale[0, 1] = 0.0  # a dead channel: scale 0 stores code 0
    if clip is not None:
        p.clip = clip
    return p


# ----------------------------------------------------------------------------- comparison


def _clamp_code(u: np.ndarray, fmt: TensorFormat) -> np.ndarray:
    """Naive code value (rounded, saturated) of each unrounded u."""
    qmin, qmax = code_range(fmt)
    if fmt.dtype == "fp8_e4m3":
        return np.vectorize(lambda v: e4m3_value(e4m3_encode(min(max(v, qmin), qmax))), otypes=[float])(u)
    return np.vectorize(lambda v: float(min(max(round(v), qmin), qmax)), otypes=[float])(u)


def float32_slack(x: torch.Tensor, fmt: TensorFormat, params: TensorParams | None, ref_y: np.ndarray) -> np.ndarray:
    """Per-element bound on how far the implementation's float32 transformed value may sit from float64.

    Smoothing is one float32 division (2^-24 relative); a Hadamard output is a float32 dot product
    whose rounding error is bounded by ~d * 2^-24 * sum_j |x_j h_j| — generous: 2^-22 * L1 of the row.
    """
    slack = np.abs(ref_y) * 2.0**-22
    if fmt.hadamard:
        xs = x.double()
        if fmt.smooth:
            xs = xs / 0.5  # smoothing factors are >= 0.5 in these tests
        slack = slack + 2.0**-22 * xs.abs().sum(-1, keepdim=True).numpy()
    return slack


def check_against_reference(x, fmt, params, head_axis):
    d = x.shape[-1]
    qt = quantize(x, fmt, params, head_axis)
    ref = ref_quantize(x, fmt, params, head_axis)
    got = decode_stored(qt, fmt, d)
    slack = float32_slack(x, fmt, params, ref["y"])
    _, qmax = code_range(fmt)

    # 1. the stored fp16 scale / zero: the reference's, up to an fp16 ulp (float32 double rounding)
    #    plus what the float32 transform may move a group's extremes by
    if fmt.is_dynamic:
        gs = d // fmt.groups(d)
        assert qt.scale is not None and qt.scale.dtype == torch.float16
        assert qt.scale.shape == (*x.shape[:-1], fmt.groups(d))
        group_slack = slack.reshape(*slack.shape[:-1], fmt.groups(d), gs).max(-1)
        s_got = qt.scale.double().numpy()
        s_tol = np.vectorize(f16_ulp)(ref["scale"]) + 2 * group_slack / qmax
        assert np.all(np.abs(s_got - ref["scale"]) <= s_tol), "dynamic scale differs from the reference"
        if fmt.symmetric:
            assert qt.zero is None
            z_got = np.zeros_like(s_got)
        else:
            assert qt.zero is not None and qt.zero.dtype == torch.float16
            z_got = qt.zero.double().numpy()
            z_tol = np.vectorize(f16_ulp)(ref["zero"]) + group_slack
            assert np.all(np.abs(z_got - ref["zero"]) <= z_tol), "zero-point differs from the reference"
        s_el, z_el = np.repeat(s_got, gs, -1), np.repeat(z_got, gs, -1)
    else:
        assert qt.scale is None and qt.zero is None
        u_ref = ref["u"]

    # 2. the codes: each must be the naive rounding of (y - zero) / scale with the *stored* scale and
    #    zero, where y may move by the float32 slack; codes exactly equal to the reference's own
    #    almost everywhere
    if fmt.is_dynamic:
        with np.errstate(divide="ignore", invalid="ignore"):
            u_alt = np.where(s_el > 0, (ref["y"] - z_el) / s_el, 0.0)
            delta = np.where(s_el > 0, slack / s_el, 0.0) + 1e-5 * np.abs(u_alt) + 1e-6
    else:
        u_alt = u_ref
        st = params.scale.double()
        hpos = head_axis % x.dim()
        s_full = (st if st.dim() == 0 else st.reshape(-1, *([1] * (x.dim() - hpos - 1))) if st.dim() == 1
                  else st.reshape(st.shape[0], *([1] * (x.dim() - hpos - 2)), d)).expand(x.shape).numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            delta = np.where(s_full > 0, slack / s_full, 0.0) + 1e-5 * np.abs(u_alt) + 1e-6
    lo, hi = _clamp_code(u_alt - delta, fmt), _clamp_code(u_alt + delta, fmt)
    outside = (got < lo) | (got > hi)
    assert not outside.any(), (
        f"{outside.sum()} codes are not the rounding of their value: got {got[outside][:5]}, "
        f"allowed [{lo[outside][:5]}, {hi[outside][:5]}], u={u_alt[outside][:5]}"
    )
    well_conditioned = delta < 1e-2
    assert (got != ref["code"])[well_conditioned].mean() <= 0.01

    # 3. dequantize: the stored form back to values, against the naive dequantizer of the same stored form
    deq = dequantize(qt, fmt, params, head_axis).double().numpy()
    s_np = None if qt.scale is None else qt.scale.double().numpy()
    z_np = None if qt.zero is None else qt.zero.double().numpy()
    want = ref_dequantize(got, s_np, z_np, fmt, params, head_axis)
    rowmax = np.abs(want).max(-1, keepdims=True)
    assert np.all(np.abs(deq - want) <= 2e-6 * rowmax + 1e-30), "dequantize disagrees with the reference"
    return qt, ref


SPECS = [
    # dynamic
    ("int8:token:sym", 24),
    ("int8:token:asym", 40),
    ("int8:g8:asym", 24),
    ("int8:g32:sym:hadamard", 96),
    ("int8:token:asym:smooth:hadamard", 96),
    ("int4:g32:asym", 64),
    ("int4:g64:asym:smooth:hadamard", 64),
    ("int4:g8:sym", 24),
    ("int4:token:sym", 40),
    ("int4:g40:asym:hadamard", 40),
    ("fp8:token", 40),
    ("fp8:g8", 24),
    ("fp8:token:hadamard", 96),
    # static
    ("int8:tensor", 40),
    ("int8:head", 24),
    ("int8:channel", 96),
    ("int8:channel:smooth:hadamard", 96),
    ("int8:tensor:smooth", 24),
    ("fp8:tensor", 64),
    ("fp8:head", 40),
    ("fp8:channel:smooth", 24),
    ("int4:channel", 64),
    ("int4:head:hadamard", 24),
]


@pytest.mark.parametrize("head_axis", [-2, -3])
@pytest.mark.parametrize("spec,d", SPECS, ids=[s for s, _ in SPECS])
def test_matches_reference(spec, d, head_axis):
    fmt = parse_tensor_spec(spec)
    x = make_input(layout_shape(head_axis, d), seed=zlib.crc32(f"{spec}{head_axis}".encode()) % 1000)
    check_against_reference(x, fmt, make_params(fmt, 3, d, seed=d), head_axis)


# codebook (nuq) tensors decode through calibrated levels, not the grid this reference computes: their own naive loops
# are in tests/test_codebooks_outliers.py
PER_TOKEN_PRESET_TENSORS = [(p, w) for p in PRESETS for w in "kv" if getattr(PRESETS[p], w).is_quantized
                            and not getattr(PRESETS[p], w).is_block_wise and not getattr(PRESETS[p], w).codebook]


@pytest.mark.parametrize("preset,which", PER_TOKEN_PRESET_TENSORS)
def test_presets_match_reference(preset, which):  # block-wise tensors: test_quantize_block_matches_naive_per_channel_reference
    fmt = getattr(PRESETS[preset], which)
    x = make_input((9, 3, 64), seed=len(preset))  # SmolLM2-135M: 3 KV heads, head_dim 64
    check_against_reference(x, fmt, make_params(fmt, 3, 64, seed=5), -2)


@pytest.mark.parametrize("head_axis", [-2, -3])
@pytest.mark.parametrize(
    "spec,d,clip",
    [
        ("int8:token:sym", 40, torch.tensor([0.9, 0.5, 1.0])),
        ("int8:g8:asym", 24, torch.tensor(0.7)),
        ("int4:g32:asym:hadamard", 96, torch.tensor([0.6, 0.8, 0.95])),
        ("int4:g8:sym", 24, torch.tensor(0.85)),
        ("fp8:token", 40, torch.tensor([0.25, 1.0, 0.5])),
    ],
)
def test_clip_matches_reference(spec, d, clip, head_axis):
    fmt = parse_tensor_spec(spec)
    x = make_input(layout_shape(head_axis, d), seed=11, pathological=False)
    qt, ref = check_against_reference(x, fmt, make_params(fmt, 3, d, seed=3, clip=clip), head_axis)
    qmin, qmax = code_range(fmt)
    if clip.dim() and fmt.dtype != "fp8_e4m3":  # a clipped head saturates its extreme codes
        assert (ref["u"] > qmax + 0.5).any() or (ref["u"] < qmin - 0.5).any()


# ----------------------------------------------------------------------------- error bounds

SPEC_D = dict(SPECS)
INT_SPECS = [s for s, _ in SPECS if not s.startswith("fp8")]


def _transformed_error(x, fmt, params, head_axis):
    """|y - (code*scale + zero)| in the rotated/smoothed space, the space where the codes live."""
    qt = quantize(x, fmt, params, head_axis)
    bare = fmt.model_copy(update={"smooth": False, "hadamard": False})
    y = forward_transform(x.double(), fmt, params, head_axis)
    yhat = dequantize(qt, bare, params, head_axis, dtype=torch.float64)
    return qt, (y - yhat).abs().numpy()


def _per_element(t: torch.Tensor | None, fmt: TensorFormat, d: int) -> np.ndarray:
    return np.repeat(t.double().numpy(), d // fmt.groups(d), axis=-1)


@pytest.mark.parametrize("spec", sorted(set(s for s in INT_SPECS if not parse_tensor_spec(s).is_static)))
@pytest.mark.parametrize("head_axis", [-2, -3])
def test_dynamic_int_error_within_half_step(spec, head_axis):
    # Why scale/2: rounding to the nearest code moves a value by at most half a step, and nothing
    # is clamped, because the group's range maps onto the code range: symmetric amax -> qmax,
    # asymmetric [min, max] -> [0, qmax]. Rounding the scale (and zero) to fp16 first shifts the
    # extreme codes by at most qmax * 2^-11 (< 0.13 of a step for int8) plus |min| * 2^-11 / scale,
    # which stays below half a step for these inputs (fp16-normal scales, |min| <= ~3x range).
    d = SPEC_D[spec]
    fmt = parse_tensor_spec(spec)
    x = make_input(layout_shape(head_axis, d), seed=7, pathological=False)
    params = make_params(fmt, 3, d, seed=2)
    qt, err = _transformed_error(x, fmt, params, head_axis)
    half = _per_element(qt.scale, fmt, d) / 2
    assert np.all(err <= half * (1 + 1e-5) + 1e-7 * np.abs(x.numpy()).max(-1, keepdims=True) * fmt.hadamard)


@pytest.mark.parametrize("spec", sorted(set(s for s in INT_SPECS if parse_tensor_spec(s).is_static)))
def test_static_int_error_within_half_step_unless_saturated(spec):
    # Static scales are calibrated constants: values inside [qmin*s, qmax*s] round to the nearest
    # step (error <= s/2); values outside saturate at the end code.
    d = SPEC_D[spec]
    fmt = parse_tensor_spec(spec)
    x = make_input((6, 3, d), seed=8)
    params = make_params(fmt, 3, d, seed=4)
    qt, err = _transformed_error(x, fmt, params, -2)
    s = params.scale.double()
    s = (s if s.dim() == 0 else s[:, None] if s.dim() == 1 else s).expand(3, d).numpy()
    y = forward_transform(x.double(), fmt, params, -2).numpy()
    qmin, qmax = code_range(fmt)
    inside = (y >= (qmin - 0.5) * s) & (y <= (qmax + 0.5) * s) & (s > 0)
    assert (~inside).any()  # the 1e4 outliers saturate
    assert np.all(err[inside] <= np.broadcast_to(s, y.shape)[inside] / 2 * (1 + 1e-5) + 1e-9)


@pytest.mark.parametrize("spec", ["int8:token:sym", "int8:token:asym", "int4:g8:asym", "int4:g8:sym", "int8:g8:asym:hadamard"])
def test_dynamic_error_bound_including_fp16_rounding_of_scale_and_zero(spec):
    # The general bound, true for every input incl. tiny values and offset/constant groups:
    # unclamped codes are within s/2; a clamped code errs by at most the range that fp16 rounding
    # of the stored scale and zero cut off: |z - z_exact| + qmax * |s - s_exact|.
    d = 24
    fmt = parse_tensor_spec(spec)
    x = make_input((8, 3, d), seed=9, pathological=True)
    params = make_params(fmt, 3, d, seed=1)
    qt, err = _transformed_error(x, fmt, params, -2)
    ref = ref_quantize(x, fmt, params, -2)
    _, qmax = code_range(fmt)
    s = _per_element(qt.scale, fmt, d)
    cut = np.abs(ref["zero"] - ref["zero_exact"]) + qmax * np.abs(ref["scale"] - ref["scale_exact"])
    assert np.all(err <= s / 2 + np.repeat(cut, d // fmt.groups(d), axis=-1) + 1e-6 * s + 1e-12)


@pytest.mark.xfail(strict=True, reason="fp16 round-to-nearest of the stored scale/zero can cut off part of a "
                   "group's range (tiny groups whose scale underflows, groups offset far from 0); reported")
@pytest.mark.parametrize("spec,row", [("int8:token:sym", "tiny"), ("int8:token:asym", "offset"), ("int8:token:asym", "constant")])
def test_half_step_bound_fails_when_fp16_rounding_cuts_the_range(spec, row):
    fmt = parse_tensor_spec(spec)
    g = torch.Generator().manual_seed(0)
    x = {"tiny": torch.randn(1, 1, 64, generator=g) * 1e-6,
         "offset": torch.linspace(100.03, 101.03, 64).view(1, 1, 64),  # zero rounds to 100.0
         "constant": torch.full((1, 1, 64), 1000.2)}[row]
    qt, err = _transformed_error(x, fmt, None, -2)
    assert np.all(err <= qt.scale.double().numpy() / 2 * (1 + 1e-5))


# ----------------------------------------------------------------------------- rounding and codes


def test_round_half_to_even_and_saturation_static_int8():
    fmt = parse_tensor_spec("int8:tensor")
    x = torch.tensor([[[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, -128.5, 200.0, -300.0, 3.49]]])
    qt = quantize(x, fmt, TensorParams(scale=torch.tensor(1.0)))
    assert qt.codes.dtype == torch.int8
    assert qt.codes.flatten().tolist() == [0, 2, 2, -0, -2, -2, 126, 127, -128, 127, -128, 3]


def test_int4_symmetric_static_stored_plus_8_even_channel_low_nibble():
    fmt = parse_tensor_spec("int4:tensor")
    x = torch.tensor([[[-8.0, 7.0, 0.0, -1.0, 3.0, -20.0]]])
    qt = quantize(x, fmt, TensorParams(scale=torch.tensor(1.0)))
    # codes -8, 7, 0, -1, 3, -8 -> nibbles 0, 15, 8, 7, 11, 0 -> bytes (hi << 4 | lo)
    assert qt.codes.dtype == torch.uint8
    assert qt.codes.flatten().tolist() == [0xF0, 0x78, 0x0B]
    assert dequantize(qt, fmt, TensorParams(scale=torch.tensor(1.0))).flatten().tolist() == [-8, 7, 0, -1, 3, -8]


def test_dynamic_scale_is_rounded_to_fp16_before_codes():
    fmt = parse_tensor_spec("int8:token")
    s_exact = 1.0 / 127
    s16 = f16(s_exact)
    assert s16 != s_exact
    # find values whose code differs between the exact and the fp16 scale
    cands = [k / 4096 for k in range(1, 4096) if round((k / 4096) / s16) != round((k / 4096) / s_exact)]
    cands = [v for v in cands if abs(abs(v / s16 - math.floor(v / s16)) - 0.5) > 1e-3]
    assert cands
    vals = [1.0] + cands[:30] + [-v for v in cands[:30]] + [0.0]
    x = torch.tensor(vals, dtype=torch.float32).view(1, 1, -1)
    qt = quantize(x, fmt)
    assert float(qt.scale) == s16
    want = [round(float(v) / s16) for v in x.flatten().double()]
    assert qt.codes.flatten().tolist() == want


def test_asymmetric_zero_is_fp16_group_min_and_codes_unsigned():
    fmt = parse_tensor_spec("int8:g4:asym")
    x = torch.tensor([[[1e-6, 1e4, 3.0, 2.0, -5.0, -1.0, -2.0, -3.0]]])
    qt = quantize(x, fmt)
    assert qt.codes.dtype == torch.uint8
    assert qt.zero.flatten().tolist() == [f16(float(np.float32(1e-6))), -5.0]
    assert qt.scale.flatten().tolist() == [f16((1e4 - float(np.float32(1e-6))) / 255), f16(4.0 / 255)]
    assert qt.codes[0, 0, 0] == 0 and qt.codes[0, 0, 1] == 255 and qt.codes[0, 0, 4] == 0 and qt.codes[0, 0, 5] == 255


@pytest.mark.parametrize("spec", ["int8:token:sym", "int8:token:asym", "int4:g8:asym", "int4:g8:sym", "fp8:token"])
def test_zero_and_constant_groups(spec):
    fmt = parse_tensor_spec(spec)
    x = torch.zeros(2, 2, 16)
    x[1, 0] = 0.75
    x[1, 1] = -2.5
    qt = quantize(x, fmt)
    y = dequantize(qt, fmt)
    assert (qt.scale[0] == 0).all() and (y[0] == 0).all()  # all-zero groups: scale 0, exact zeros
    if not fmt.symmetric:  # asymmetric: max == min gives scale 0 and zero == the (fp16-exact) constant
        assert (qt.scale[1] == 0).all() and torch.equal(y, x)
    else:  # symmetric: the constant maps to +-qmax (int) or 448 (fp8) of an fp16 scale
        assert torch.allclose(y, x, rtol=2**-8, atol=0)


def test_nibble_order_hand_built_byte():
    assert pack_int4(torch.tensor([3, 10], dtype=torch.uint8)).tolist() == [0xA3]
    assert unpack_int4(torch.tensor([0xA3], dtype=torch.uint8)).tolist() == [3, 10]
    assert pack_int4(torch.tensor([[15, 0, 1, 2]], dtype=torch.uint8)).tolist() == [[0x0F, 0x21]]


def test_pack_int4_odd_length_raises():
    with pytest.raises(TrtkvError, match="even"):
        pack_int4(torch.zeros(3, dtype=torch.uint8))


@settings(max_examples=200, deadline=None)
@given(st.tuples(st.integers(1, 3), st.integers(1, 40)).flatmap(lambda s: hnp.arrays(np.uint8, (s[0], 2 * s[1]), elements=st.integers(0, 15))))
def test_int4_pack_unpack_roundtrip(nibbles):
    t = torch.from_numpy(nibbles.copy())
    packed = pack_int4(t)
    assert packed.dtype == torch.uint8 and packed.shape == (*t.shape[:-1], t.shape[-1] // 2)
    for idx in np.ndindex(*packed.shape):  # naive: byte = odd << 4 | even
        assert int(packed[idx]) == int(nibbles[idx[:-1] + (2 * idx[-1],)]) | (int(nibbles[idx[:-1] + (2 * idx[-1] + 1,)]) << 4)
    assert torch.equal(unpack_int4(packed), t)


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.uint8, st.tuples(st.integers(1, 3), st.integers(1, 20)), elements=st.integers(0, 255)))
def test_int4_unpack_pack_roundtrip_any_byte(by):
    t = torch.from_numpy(by.copy())
    assert torch.equal(pack_int4(unpack_int4(t)), t)


IDEMPOTENT = [
    ("int8:token:sym", 24),
    ("int8:token:asym", 40),
    ("int8:g8:asym", 24),
    ("int4:g8:sym", 24),
    ("int4:g32:asym", 64),
    ("int4:g64:asym:smooth:hadamard", 64),
    ("int8:g32:sym:hadamard", 96),
    ("int8:channel", 40),
    ("int4:head:smooth:hadamard", 24),
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(
    case=st.sampled_from(IDEMPOTENT),
    data=st.data(),
    tokens=st.integers(1, 3),
)
def test_requantize_is_idempotent_on_codes(case, data, tokens):
    spec, d = case
    fmt = parse_tensor_spec(spec)
    x = data.draw(hnp.arrays(np.float32, (tokens, 2, d), elements=st.floats(-8, 8, width=32)))
    x = torch.from_numpy(x)
    params = make_params(fmt, 2, d, seed=d)
    if fmt.is_dynamic:
        # the regime where fp16 scale/zero rounding cannot clamp codes (see the bound tests):
        # fp16-normal scales, group min no further from 0 than ~3x the group's range
        y = forward_transform(x.double(), fmt, params)
        grp = y.reshape(tokens, 2, fmt.groups(d), -1)
        amax = grp.abs().amax(-1)
        rng = grp.amax(-1) - grp.amin(-1)
        assume(bool((amax >= 0.05).all()))
        if not fmt.symmetric:
            assume(bool((grp.amin(-1).abs() <= 3 * rng).all()))
    q1 = quantize(x, fmt, params)
    q2 = quantize(dequantize(q1, fmt, params), fmt, params)
    assert torch.equal(q1.codes, q2.codes)


def test_nan_inf_raise():
    for spec in ("int8:token", "int4:g8:asym", "fp8:tensor", "int8:channel:smooth:hadamard"):
        fmt = parse_tensor_spec(spec)
        params = make_params(fmt, 2, 16, seed=0)
        for bad in (math.nan, math.inf, -math.inf):
            x = torch.randn(3, 2, 16)
            x[1, 1, 5] = bad
            with pytest.raises(TrtkvError, match="NaN or inf") as ei:
                quantize(x, fmt, params)
            assert ei.value.fix  # the message says what to do


def test_missing_calibration_raises():
    with pytest.raises(TrtkvError, match="static scale"):
        quantize(torch.randn(2, 2, 8), parse_tensor_spec("int8:tensor"))
    with pytest.raises(TrtkvError, match="smooth"):
        quantize(torch.randn(2, 2, 8), parse_tensor_spec("int8:token:smooth"))


def test_fp16_format_passthrough():
    fmt = TensorFormat(dtype="fp16")
    x = torch.randn(4, 2, 24)
    qt = quantize(x, fmt)
    assert qt.codes.dtype == torch.float16 and qt.scale is None
    assert torch.equal(dequantize(qt, fmt), x.half().float())
    assert fake_quantize(x.half(), parse_tensor_spec("int8:token")).dtype == torch.float16


# ----------------------------------------------------------------------------- fp8


def test_e4m3_reference_matches_torch_cast():
    g = torch.Generator().manual_seed(0)
    vals = torch.cat([
        (torch.rand(4000, generator=g) * 2 - 1) * 448,
        torch.randn(2000, generator=g) * 2.0**-7,  # subnormal range
        torch.tensor([_E4M3_POS[i] for i in range(len(_E4M3_POS))]),
        torch.tensor([(_E4M3_POS[i] + _E4M3_POS[i + 1]) / 2 for i in range(len(_E4M3_POS) - 1)]),  # exact ties
        -torch.tensor([(_E4M3_POS[i] + _E4M3_POS[i + 1]) / 2 for i in range(len(_E4M3_POS) - 1)]),
    ]).float()
    got = vals.to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    want = [e4m3_encode(float(v)) for v in vals.double()]
    assert got == want
    assert torch.finfo(torch.float8_e4m3fn).max == 448 == DTYPES["fp8_e4m3"].sym_max


def test_fp8_static_codes_are_torch_cast_with_saturation():
    fmt = parse_tensor_spec("fp8:tensor")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 2, 32, generator=g) * 100
    x[0, 0, :4] = torch.tensor([500.0, -1000.0, 448.0, 463.0])
    qt = quantize(x, fmt, TensorParams(scale=torch.tensor(1.0)))
    assert qt.codes.dtype == torch.uint8
    assert torch.equal(qt.codes, x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    assert qt.codes[0, 0, :4].tolist() == [0x7E, 0xFE, 0x7E, 0x7E]  # saturate at +-448, never NaN


# ----------------------------------------------------------------------------- transforms


@pytest.mark.parametrize("n", [1, 2, 8, 24, 25, 40, 64, 96, 128])
def test_hadamard_matrix(n):
    h = hadamard_matrix(n, torch.float64)
    ref = torch.tensor(ref_hadamard(n), dtype=torch.float64)
    assert torch.allclose(h, ref, atol=1e-15, rtol=0)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-13, rtol=0)  # orthonormal
    assert torch.equal(h, h.T)
    block = n & -n
    off = h.clone()
    for b in range(0, n, block):
        off[b : b + block, b : b + block] = 0
    assert (off == 0).all()  # block diagonal: 96 -> three 32x32 blocks, 24 -> three 8x8, 25 -> identity
    assert (h[:block, :block].abs() == 1 / math.sqrt(block)).all()


@pytest.mark.parametrize("head_axis", [-2, -3])
@pytest.mark.parametrize("d", [24, 96, 128])
def test_transforms_exactly_inverted_in_float64(d, head_axis):
    fmt = parse_tensor_spec("int8:token:smooth:hadamard")
    shape = layout_shape(head_axis, d)
    g = torch.Generator().manual_seed(d)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    params = TensorParams(smooth=0.5 + torch.rand(3, d, generator=g, dtype=torch.float64))
    y = forward_transform(x, fmt, params, head_axis)
    assert y.dtype == torch.float64
    # naive check of the forward transform on a few rows
    h = ref_hadamard(d)
    hpos = head_axis % x.dim()
    for idx in [(0,) * (x.dim() - 1), tuple(s - 1 for s in x.shape[:-1])]:
        hh = idx[hpos]
        row = [float(x[idx][c]) / float(params.smooth[hh, c]) for c in range(d)]
        want = [sum(row[j] * h[j][c] for j in range(d)) for c in range(d)]
        assert np.allclose(y[idx].numpy(), want, atol=1e-12, rtol=0)
    assert torch.allclose(inverse_transform(y, fmt, params, head_axis), x, atol=1e-12, rtol=0)


def test_key_transforms_fold_into_query_value_transforms_into_output():
    # K: q . k == (q * smooth) @ H . (k / smooth) @ H, so the query absorbs K's transforms.
    # V: p @ v == ((p @ ((v / smooth) @ H)) @ H^T) * smooth, so the output absorbs V's.
    g = torch.Generator().manual_seed(0)
    heads, d, t = 3, 96, 11
    fmt = parse_tensor_spec("int8:token:smooth:hadamard")
    q = torch.randn(heads, d, generator=g, dtype=torch.float64)
    k = torch.randn(t, heads, d, generator=g, dtype=torch.float64)
    v = torch.randn(t, heads, d, generator=g, dtype=torch.float64)
    sk = TensorParams(smooth=0.5 + torch.rand(heads, d, generator=g, dtype=torch.float64))
    sv = TensorParams(smooth=0.5 + torch.rand(heads, d, generator=g, dtype=torch.float64))
    hm = hadamard_matrix(d, torch.float64)
    scores = torch.einsum("hd,thd->ht", q, k)
    q_folded = (q * sk.smooth) @ hm
    assert torch.allclose(torch.einsum("hd,thd->ht", q_folded, forward_transform(k, fmt, sk)), scores, atol=1e-10)
    p = torch.softmax(scores, -1)
    out = torch.einsum("ht,thd->hd", p, v)
    out_rot = torch.einsum("ht,thd->hd", p, forward_transform(v, fmt, sv))
    assert torch.allclose((out_rot @ hm.T) * sv.smooth, out, atol=1e-10)


def test_hadamard_on_odd_head_dim_is_refused():
    """An odd head_dim would make every Hadamard block 1x1: a silent no-op, so it is an error."""
    from trtkv.formats import get_format

    fmt = get_format("k=int8:token:hadamard,v=int8:token").k
    with pytest.raises(TrtkvError, match="even head_dim"):
        quantize(torch.randn(3, 2, 15), fmt)


# ----------------------------------------------------------------------------- sealed blocks: per channel over a block


def ref_quantize_block(x: torch.Tensor, fmt: TensorFormat, clip: list[float] | None) -> dict:
    """Naive float64 per_block_channel quantizer of blocks x [n, H, bs, D]: every block, head and channel in a loop."""
    xs = x.double().numpy()
    n, heads, bs, d = xs.shape
    qmin, qmax = code_range(fmt)
    had = ref_hadamard(d) if fmt.hadamard else None
    out = {"code": np.zeros(xs.shape), "scale": np.zeros((n, heads, d)), "zero": np.zeros((n, heads, d)), "y": np.zeros(xs.shape)}
    for b in range(n):
        for h in range(heads):
            rows = [[float(xs[b, h, t, c]) for c in range(d)] for t in range(bs)]
            if had is not None:
                rows = [[sum(r[j] * had[j][c] for j in range(d)) for c in range(d)] for r in rows]
            cl = 1.0 if clip is None else clip[h]
            for c in range(d):
                col = [rows[t][c] for t in range(bs)]
                if fmt.symmetric:
                    s, z = f16(max(abs(v) for v in col) * cl / qmax), 0.0
                else:
                    mn, mx = min(col), max(col)
                    s, z = f16((mx - mn) * cl / qmax), f16(mn + (mx - mn) * (1 - cl) / 2)
                out["scale"][b, h, c], out["zero"][b, h, c] = s, z
                for t in range(bs):
                    u = (col[t] - z) / s if s > 0 else 0.0
                    out["code"][b, h, t, c] = min(max(round(u), qmin), qmax)
                    out["y"][b, h, t, c] = col[t]
    return out


@pytest.mark.parametrize(
    "spec,shape,clip",
    [
        ("int4:bchannel:asym", (3, 3, 16, 8), None),
        ("int4:bchannel:sym", (2, 2, 7, 6), None),  # odd block, tiny head_dim
        ("int8:bchannel:asym", (2, 3, 5, 10), [0.9, 1.0, 0.75]),
        ("int8:bchannel:sym:hadamard", (1, 2, 9, 8), None),
        ("int4:bchannel:asym:hadamard", (2, 1, 64, 16), [0.8]),
    ],
)
def test_quantize_block_matches_naive_per_channel_reference(spec, shape, clip):
    fmt = parse_tensor_spec(spec)
    x = make_input(shape, seed=zlib.crc32(spec.encode()))
    x[0, 0, :, 0] = 3.0  # a constant channel: zero range
    x[-1, -1, 0, -1] = 1e3  # an outlier token in one channel only
    params = TensorParams(clip=None if clip is None else torch.tensor(clip))
    qt = quantize_block(x, fmt, params)
    ref = ref_quantize_block(x, fmt, clip)
    assert qt.scale.shape == shape[:2] + (shape[3],) and qt.scale.dtype == torch.float16
    assert (qt.zero is None) == fmt.symmetric
    np.testing.assert_allclose(qt.scale.double().numpy(), ref["scale"], rtol=2**-10, atol=0)  # at most one fp16 ulp
    if qt.zero is not None:
        np.testing.assert_allclose(qt.zero.double().numpy(), ref["zero"], rtol=2**-10, atol=1e-7)
    codes = unpack_int4(qt.codes).double().numpy() if fmt.dtype == "int4" else qt.codes.double().numpy()
    if fmt.dtype == "int4" and fmt.symmetric:
        codes = codes - 8
    mismatch = np.abs(codes - ref["code"])
    assert mismatch.max() <= 1 and (mismatch > 0).mean() < 0.01  # off by one only on float32 rounding ties
    # dequantized values sit within half a step of the (transformed) input, plus fp16 rounding of the zero
    back = dequantize(qt, fmt, params, head_axis=-3).double()
    if clip is None and not fmt.hadamard:  # (a rotation spreads the per-channel bound over channels)
        step = qt.scale.double().unsqueeze(-2)
        err = (back - x.double()).abs()
        assert (err <= step * 0.5 + 1e-3 * x.double().abs().amax() * 2**-10 + 1e-6).all()


def test_block_wise_formats_refuse_single_token_quantization():
    fmt = parse_tensor_spec("int4:bchannel:asym")
    with pytest.raises(TrtkvError, match="whole sealed blocks"):
        quantize(torch.randn(4, 2, 8), fmt)


def test_quantize_block_of_per_token_format_equals_quantize():
    fmt = PRESETS["int4"].v  # per token, rotated
    x = make_input((3, 3, 16, 64), seed=11)
    a, b = quantize_block(x, fmt), quantize(x, fmt, head_axis=-3)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale) and a.zero is None and b.zero is None


# ----------------------------------------------------------------------------- mutations the suite must catch


@pytest.mark.parametrize("spec", ["int4:token:sym", "int8:g8:asym", "int4:bchannel:sym", "int4:bchannel:asym"])
def test_scale_beyond_fp16_range_saturates_instead_of_becoming_inf(spec):
    fmt = parse_tensor_spec(spec)
    x = torch.randn(2, 2, 8, 16)
    x[0, 0] = torch.linspace(-2e8, 2e8, 8 * 16).reshape(8, 16)  # range / qmax far above 65504 in every slice of this head
    qt = quantize_block(x, fmt) if fmt.is_block_wise else quantize(x, fmt, head_axis=-3)
    assert torch.isfinite(qt.scale.float()).all() and qt.scale.float().max() == FP16_MAX
    assert torch.isfinite(dequantize(qt, fmt, head_axis=-3)).all()


def test_clip_ratio_scales_the_range_not_the_code_range():
    # clip 0.5 on symmetric int8 per token: scale = 0.5 * absmax / 127, so the absmax saturates at 127
    fmt = parse_tensor_spec("int8:token:sym")
    x = torch.tensor([[[1.0, -2.0, 4.0, 0.5]]])
    qt = quantize(x, fmt, TensorParams(clip=torch.tensor(0.5)), head_axis=-3)
    assert qt.scale.float().item() == pytest.approx(f16(0.5 * 4.0 / 127), rel=0)
    assert qt.codes.tolist() == [[[64, -127, 127, 32]]]


@pytest.mark.parametrize("dtype", ["int4", "int3", "int2"])
def test_mse_block_channel_ranges_match_a_naive_search(dtype):
    """``:mse`` block-channel keys: per (head, channel) the stored range is the CLIP_GRID shrink whose dequantized
    block has the least squared error, found here by a plain per-channel float64 loop over the grid (odd block of 13
    tokens, head_dim 24); never worse than min/max."""
    from trtkv.formats import DTYPES, parse_tensor_spec
    from trtkv.quant import dequantize, quantize_block

    g = torch.Generator().manual_seed(17)
    x = torch.randn(3, 13, 24, generator=g) * torch.rand(24, generator=g) * 4
    x[0, 2, 5] = 30.0  # an outlier token in one channel
    tf, plain = parse_tensor_spec(f"{dtype}:bchannel:asym:mse"), parse_tensor_spec(f"{dtype}:bchannel:asym")
    qt = quantize_block(x, tf, head_axis=-3)
    got = dequantize(qt, tf, head_axis=-3).double()
    qmax = DTYPES[dtype].asym_max
    for h in range(3):
        for c in range(24):
            col = x[h, :, c].double()
            best = naive_mse_range(col, qmax)
            assert float(qt.scale[h, c]) == pytest.approx(best[1], rel=1e-3) and float(qt.zero[h, c]) == pytest.approx(best[2], rel=1e-3, abs=1e-3)
            assert ((got[h, :, c] - col) ** 2).sum().item() <= best[0] * (1 + 1e-4) + 1e-6
    e_mse = (got - x.double()).square().sum().item()
    e_plain = (dequantize(quantize_block(x, plain, head_axis=-3), plain, head_axis=-3).double() - x.double()).square().sum().item()
    assert e_mse < e_plain
