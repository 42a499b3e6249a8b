"""Codebook formats (``nuq``), dense-and-sparse outliers (``outN``), keys stored before RoPE, and what calibration fits.

Every rule is checked against an independent float64 reference (a naive loop) on fresh random inputs of odd sizes.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import naive_mse_range

from trtkv.errors import TrtkvError
from trtkv.formats import CALIBRATION_FREE, DTYPES, OUTLIER_BITS, get_format, parse_tensor_spec
from trtkv.quant import TensorParams, dequantize, fake_quantize_block, hadamard_matrix, lookup_levels, nearest_level, quantize_block

H, BS, D = 3, 5, 24  # odd numbers of heads and tokens per block; head_dim a multiple of 8 (int3)
# keys before RoPE, smoothed by the queries and rotated, with outlier lists; values through a codebook (what the int3 /
# int2 presets were before per-channel key bits; the torch engine's paths read them)
INT3_NUQ = "k=int3:bchannel:asym:prerope:qsmooth:hadamard:out128,v=int3:token:sym:hadamard:nuq,block=128,sink=4"
INT2_NUQ = "k=int2:bchannel:asym:prerope:qsmooth:hadamard:out64,v=int2:token:sym:hadamard:nuq,block=128,sink=4"
INT3_FREE, INT2_FREE = CALIBRATION_FREE["int3"], CALIBRATION_FREE["int2"]


def _fmt(spec: str):
    return get_format(f"k={spec},v=fp16,block={BS}").k


def _codebook(tf, heads=H, seed=0):
    """A random ascending codebook per head, spread like the grid's code values."""
    g = torch.Generator().manual_seed(seed)
    n = 2**tf.traits.bits
    lo, hi = (-tf.traits.asym_max / 2, tf.traits.asym_max / 2) if tf.symmetric else (0.0, float(tf.traits.asym_max))
    return torch.sort(torch.rand(heads, n, generator=g, dtype=torch.float64) * (hi - lo) + lo, -1).values.float()


# --------------------------------------------------------------------------- the format


def test_spec_words_round_trip_and_bits():
    tf = parse_tensor_spec("int3:bchannel:asym:hadamard:nuq:out24")
    assert tf.codebook and tf.outliers == 24 and tf.short() == "int3:bchannel:asym:hadamard:nuq:out24"
    fmt = get_format(f"k={tf.short()},v=int3:g32:sym:hadamard:nuq,block=64,sink=4")
    assert get_format(fmt.spec()) == fmt.model_copy(update={"name": fmt.spec()})
    # pool bits: codes + fp16 scale and zero per channel per block + 32 bits per outlier over the block's elements
    assert tf.bits_per_element(64, 64) == 3 + 32 / 64 + 24 * OUTLIER_BITS / (64 * 64)
    assert fmt.needs_calibration and not get_format(INT3_FREE).needs_calibration
    # codebooks are layer constants: 8 float32 levels per KV head for K and for V, per layer
    assert fmt.constant_bytes(30, 3) == 30 * 2 * 3 * 8 * 4 and get_format(INT3_FREE).constant_bytes(30, 3) == 0


@pytest.mark.parametrize("spec,match", [
    ("k=int8:token:nuq,v=fp16", "nuq"),
    ("k=int4:channel:nuq,v=fp16", "dynamic"),
    ("k=int4:bchannel:asym:mse:nuq,v=fp16,block=8", "give one"),
    ("k=int4:token:out4,v=fp16", "block"),
    ("k=int4:token:out4:out8,v=fp16,block=8", "give one"),
])
def test_bad_specs_are_one_line_errors(spec, match):
    with pytest.raises(TrtkvError, match=match) as e:
        get_format(spec)
    assert "\n" not in e.value.problem


def test_outlier_list_must_fit_a_block():
    from trtkv.cache_layout import PagedKVLayout

    with pytest.raises(TrtkvError, match="every element"):
        PagedKVLayout(get_format("k=int4:token:out40,v=fp16,block=4"), 1, 8, 4, 2)
    with pytest.raises(TrtkvError, match="int16"):
        PagedKVLayout(get_format("k=int4:token:out4,v=fp16,block=512"), 1, 128, 512, 2)


# --------------------------------------------------------------------------- codebooks


def _ref_codebook_block(x, tf, cb):
    """float64 loop: per (block, head, channel) asymmetric min/max over the block's tokens (fp16 scale and zero), each
    element to the nearest level (ties to the lower), value = level * s + z."""
    x = x.double()
    out = torch.empty_like(x)
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            for c in range(x.shape[3]):
                col = x[b, h, :, c]
                mn, mx = col.min(), col.max()
                z = float(torch.tensor(mn.item()).half())
                s = float(torch.tensor(((mx - mn) / tf.traits.asym_max).item()).half())
                for t in range(x.shape[2]):
                    u = (col[t].item() - z) * (1.0 / s if s else 0.0)
                    levels = cb[h].double().tolist()
                    best = min(range(len(levels)), key=lambda j: (abs(u - levels[j]), j))
                    out[b, h, t, c] = levels[best] * s + z
    return out


def test_block_codebook_codes_match_a_naive_loop():
    tf = _fmt("int3:bchannel:asym:nuq")
    cb = _codebook(tf)
    x = torch.randn(3, H, BS, D, generator=torch.Generator().manual_seed(1)) * 2 + 0.5
    got = fake_quantize_block(x, tf, TensorParams(codebook=cb)).double()
    torch.testing.assert_close(got, _ref_codebook_block(x, tf, cb), rtol=0, atol=1e-5)


@pytest.mark.parametrize("spec", ["int3:g8:sym:hadamard:nuq", "int2:token:asym:nuq", "int4:g12:sym:nuq"])
def test_token_codebook_codes_match_a_naive_loop(spec):
    tf = _fmt(spec)
    cb = _codebook(tf, seed=2)
    x = torch.randn(2, H, BS, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    xf = x @ hadamard_matrix(D, torch.float64) if tf.hadamard else x
    g = tf.groups(D)
    ref = torch.empty_like(xf)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in xf.shape[:-1])).tolist():
        row = xf[tuple(idx)]
        for gi in range(g):
            seg = row[gi * D // g : (gi + 1) * D // g]
            if tf.symmetric:
                s, z = float(torch.tensor((seg.abs().max() / tf.traits.sym_max).item()).half()), 0.0
            else:
                z = float(torch.tensor(seg.min().item()).half())
                s = float(torch.tensor(((seg.max() - seg.min()) / tf.traits.asym_max).item()).half())
            levels = cb[idx[1]].double().tolist()
            for j, v in enumerate(seg.tolist()):
                u = (v - z) * (1.0 / s)
                best = min(range(len(levels)), key=lambda k: (abs(u - levels[k]), k))
                ref[(*idx, gi * D // g + j)] = levels[best] * s + z
    if tf.hadamard:
        ref = ref @ hadamard_matrix(D, torch.float64).T
    got = fake_quantize_block(x.float(), tf, TensorParams(codebook=cb)).double()
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("spec", ["int3:bchannel:asym:hadamard", "int3:g8:sym", "int2:token:asym", "int4:bchannel:sym"])
def test_the_grid_as_codebook_reproduces_the_grid(spec):
    """The uniform grid's code values as the levels decode exactly as the plain format (the codebook generalises it)."""
    plain, nuq = _fmt(spec), _fmt(spec + ":nuq")
    x = torch.randn(2, H, BS, D, generator=torch.Generator().manual_seed(5)) * 3
    grid = DTYPES[plain.dtype].grid(plain.symmetric)
    assert grid.tolist() == list(range(-(2 ** (plain.traits.bits - 1)) if plain.symmetric else 0, 2 ** (plain.traits.bits - 1) if plain.symmetric else 2**plain.traits.bits))
    a = fake_quantize_block(x, plain)
    b = fake_quantize_block(x, nuq, TensorParams(codebook=grid))
    torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_codebook_codes_are_unsigned_table_indices_per_head():
    """Symmetric scales or not, a codebook's stored codes are indices 0 .. 2**bits - 1 (no +4 offset), and each head
    decodes through its own row."""
    tf = _fmt("int3:g8:sym:nuq")
    cb = _codebook(tf)
    x = torch.randn(1, H, BS, D, generator=torch.Generator().manual_seed(6))
    qt = quantize_block(x, tf, TensorParams(codebook=cb))
    idx = tf.traits.stored_values(qt.codes)
    assert idx.min() >= 0 and idx.max() <= 7
    levels = lookup_levels(idx, cb, head_axis=-3)
    for h in range(H):
        torch.testing.assert_close(levels[0, h], cb[h][idx[0, h].long()])
    # one row for every head ([n]) decodes like the same row repeated
    one = cb[0]
    torch.testing.assert_close(fake_quantize_block(x, tf, TensorParams(codebook=one)),
                               fake_quantize_block(x, tf, TensorParams(codebook=one.expand(H, -1).clone())))


def test_nearest_level_ties_go_to_the_lower_level():
    levels = torch.tensor([0.0, 1.0, 3.0])
    u = torch.tensor([0.5, 0.49, 0.51, 2.0, 2.0001, -5.0, 9.0])
    assert nearest_level(u, levels).tolist() == [0, 0, 1, 1, 2, 0, 2]


def test_nuq_without_a_codebook_is_refused():
    with pytest.raises(TrtkvError, match="codebook"):
        quantize_block(torch.randn(1, H, BS, D), _fmt("int3:bchannel:asym:nuq"))


# --------------------------------------------------------------------------- outliers


def _ref_outliers(xf: torch.Tensor, tf, n: int):
    """float64 loop: per (block, head) the n elements with the largest |x - centre| (ties: lower position), centre =
    channel mean over the block (bchannel asym), token-group mean (token asym), 0 (symmetric)."""
    B, Hh, T, C = xf.shape
    g = tf.groups(C) or 1
    out = []
    for b in range(B):
        for h in range(Hh):
            scores = []
            for t in range(T):
                for c in range(C):
                    if tf.symmetric:
                        centre = 0.0
                    elif tf.is_block_wise:
                        centre = xf[b, h, :, c].double().mean().item()
                    else:
                        w = C // g
                        centre = xf[b, h, t, (c // w) * w : (c // w + 1) * w].double().mean().item()
                    scores.append((-abs(xf[b, h, t, c].item() - centre), t * C + c))
            out.append(sorted(p for _, p in sorted(scores)[:n]))
    return torch.tensor(out).view(B, Hh, n)


@pytest.mark.parametrize("spec", ["int3:bchannel:asym:out7", "int4:bchannel:sym:out5", "int2:token:asym:out6", "int3:g8:sym:out9"])
def test_outliers_are_the_farthest_from_their_group_centre(spec):
    tf = _fmt(spec)
    x = torch.randn(3, H, BS, D, generator=torch.Generator().manual_seed(7))
    x[1, 2, 3, 5] = 9.0  # a plain outlier
    qt = quantize_block(x, tf)
    assert qt.outlier_index.dtype == torch.int16 and qt.outlier_value.dtype == torch.float16
    assert torch.equal(qt.outlier_index.long(), _ref_outliers(x, tf, tf.outliers))
    # the kept values are the inputs, rounded to fp16 (exact up to the pool's fp16)
    flat = x.flatten(-2).gather(-1, qt.outlier_index.long())
    torch.testing.assert_close(qt.outlier_value.float(), flat.half().float(), rtol=0, atol=0)
    deq = fake_quantize_block(x, tf)
    torch.testing.assert_close(deq.flatten(-2).gather(-1, qt.outlier_index.long()), flat.half().float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["int3", "int2"])
def test_mse_ranges_with_outliers_are_searched_over_the_bulk_only(dtype):
    """``:mse:outN`` keys: the outliers (the naive selection above) are kept exactly and neither set a range nor count
    in the search's error -- per (head, channel) the stored range is the CLIP_GRID shrink of the bulk's [min, max] with
    the least squared error over the bulk, found by a float64 loop (odd sizes: block 13, head_dim 24)."""
    from trtkv.formats import DTYPES

    tf, n = _fmt(f"{dtype}:bchannel:asym:mse:out11"), 11
    x = torch.randn(2, 3, 13, 24, generator=torch.Generator().manual_seed(23)) * torch.linspace(0.5, 3, 24)
    x[0, 1, 4, 7] = 40.0
    qt = quantize_block(x, tf, head_axis=-3)
    assert torch.equal(qt.outlier_index.long(), _ref_outliers(x, tf, n))
    got = dequantize(qt, tf, head_axis=-3).double()
    qmax = DTYPES[dtype].asym_max
    for b in range(2):
        for h in range(3):
            kept = set(_ref_outliers(x[b : b + 1, h : h + 1], tf, n).flatten().tolist())
            for c in range(24):
                rows = [t for t in range(13) if t * 24 + c not in kept]
                col = x[b, h, rows, c].double()
                best = naive_mse_range(col, qmax)
                assert float(qt.scale[b, h, c]) == pytest.approx(best[1], rel=1e-3)
                assert float(qt.zero[b, h, c]) == pytest.approx(best[2], rel=1e-3, abs=1e-3)
                assert ((got[b, h, rows, c] - col) ** 2).sum().item() <= best[0] * (1 + 1e-4) + 1e-6
    # the outliers themselves come back as their fp16 values
    flat, idx = got.flatten(-2), qt.outlier_index.long()
    assert torch.equal(flat.gather(-1, idx).float(), x.flatten(-2).gather(-1, idx).half().float())


def test_outlier_ties_keep_the_lower_position():
    tf = _fmt("int4:bchannel:sym:out2")
    x = torch.zeros(1, 1, BS, 8)
    x[0, 0, 1, 3] = x[0, 0, 4, 0] = x[0, 0, 0, 6] = -2.0  # three equal scores: positions 11, 32, 6
    qt = quantize_block(x, tf)
    assert qt.outlier_index.tolist() == [[[6, 11]]]


@pytest.mark.parametrize("spec", ["int4:bchannel:sym:out5", "int3:g8:sym:out9", "int2:token:sym:out13"])
@pytest.mark.parametrize("seed", [0, 1])
def test_outliers_among_many_equal_scores_match_the_naive_selection(spec, seed):
    """Small integers: most scores tie with others, some above the cut and several at it; the selection (topk's cut,
    then the tied positions in order) must be the naive loop's on every (block, head)."""
    tf = _fmt(spec)
    x = torch.randint(-3, 4, (4, H, BS, D), generator=torch.Generator().manual_seed(seed)).float()
    assert torch.equal(quantize_block(x, tf).outlier_index.long(), _ref_outliers(x, tf, tf.outliers))


def test_outliers_set_no_range():
    """The dense codes' ranges are those of the block without its outliers (a float64 loop), so the bulk keeps its
    resolution: one large element does not stretch its channel's scale."""
    tf = _fmt("int4:bchannel:asym:out1")
    x = torch.randn(2, H, BS, D, generator=torch.Generator().manual_seed(8))
    x[0, 1, 2, 3] = 50.0
    qt = quantize_block(x, tf)
    for b in range(2):
        for h in range(H):
            keep = torch.ones(BS * D, dtype=torch.bool)
            keep[qt.outlier_index[b, h].long()] = False
            dense = torch.where(keep.view(BS, D), x[b, h].double(), torch.nan)
            mn, mx = dense.nan_to_num(math.inf).amin(0), dense.nan_to_num(-math.inf).amax(0)
            torch.testing.assert_close(qt.zero[b, h].double(), mn.half().double(), rtol=0, atol=0)
            torch.testing.assert_close(qt.scale[b, h].double(), ((mx - mn) / 15).half().double(), rtol=0, atol=0)
    plain = fake_quantize_block(x, _fmt("int4:bchannel:asym"))
    err_plain = (plain - x)[0, 1, :, 3].abs().max()
    err_out = (fake_quantize_block(x, tf) - x)[0, 1, :, 3].abs().max()
    assert err_out < err_plain / 10


def test_outliers_and_codebook_together_with_transforms_decode_in_model_space():
    """A rotated nuq format with outliers: the outliers are restored in the rotated space, before the inverse rotation."""
    tf = _fmt("int3:bchannel:asym:hadamard:nuq:out4")
    cb = _codebook(tf)
    x = torch.randn(2, H, BS, D, generator=torch.Generator().manual_seed(9))
    p = TensorParams(codebook=cb)
    qt = quantize_block(x, tf, p)
    rot = dequantize(qt, tf, p, head_axis=-3, transforms=False)
    xf = x @ hadamard_matrix(D)
    kept = rot.flatten(-2).gather(-1, qt.outlier_index.long())
    torch.testing.assert_close(kept, xf.flatten(-2).gather(-1, qt.outlier_index.long()).half().float(), rtol=0, atol=0)
    torch.testing.assert_close(dequantize(qt, tf, p, head_axis=-3), rot @ hadamard_matrix(D).T, rtol=0, atol=1e-5)


def test_single_token_quantize_refuses_outlier_formats():
    from trtkv.quant import quantize

    with pytest.raises(TrtkvError, match="per sealed block"):
        quantize(torch.randn(4, H, D), _fmt("int4:token:out2"))


# --------------------------------------------------------------------------- fitting codebooks (calibration/codebook.py)


def _naive_lloyd(u, w, levels, iters):
    """float64 loop Lloyd-Max: assign each value to its nearest level (ties lower), move each level to its cell's
    weighted mean (an empty cell keeps its level)."""
    levels = [float(v) for v in levels]
    for _ in range(iters):
        sums = [[0.0, 0.0] for _ in levels]
        for x, wt in zip(u.tolist(), w.tolist()):
            j = min(range(len(levels)), key=lambda k: (abs(x - levels[k]), k))
            sums[j][0] += wt
            sums[j][1] += wt * x
        levels = sorted(s[1] / s[0] if s[0] > 0 else lv for s, lv in zip(sums, levels))
    return torch.tensor(levels)


def test_lloyd_max_matches_a_naive_loop_and_beats_the_grid():
    from trtkv.calibration.codebook import lloyd_max

    g = torch.Generator().manual_seed(10)
    u = torch.cat([torch.randn(301, generator=g) * 0.7 + 3.5, torch.rand(57, generator=g) * 7]).clamp(0, 7)
    w = torch.rand(u.numel(), generator=g) + 0.1
    grid = torch.arange(8.0)
    for iters in (1, 3, 25):
        torch.testing.assert_close(lloyd_max(u, w, grid, iterations=iters), _naive_lloyd(u, w, grid, iters).float(), rtol=0, atol=1e-5)

    def cost(levels):
        return float((w * (u.unsqueeze(-1) - levels).square().min(-1).values).sum())

    assert cost(lloyd_max(u, w, grid)) < 0.8 * cost(grid)
    # the weights matter: all weight on the upper half pulls every level up
    heavy = torch.where(u > 3.5, w * 100, w * 0.01)
    assert lloyd_max(u, heavy, grid).mean() > lloyd_max(u, w, grid).mean()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lloyd_max_leaves_a_level_whose_cell_holds_no_weight_where_it_is(seed):
    """Values in two tight clusters under levels spread wider (most cells empty), and a cluster whose weights are all 0:
    the levels of cells without weight stay put, as in the naive loop, and never move to 0."""
    from trtkv.calibration.codebook import lloyd_max

    g = torch.Generator().manual_seed(seed)
    n1, n2, n3 = 37 + seed, 23, 11
    u = torch.cat([torch.randn(n1, generator=g) * 0.05 + 1.3, torch.randn(n2, generator=g) * 0.05 + 5.6, torch.randn(n3, generator=g) * 0.05 + 3.4])
    w = torch.cat([torch.rand(n1 + n2, generator=g) + 0.1, torch.zeros(n3)])  # the middle cluster weighs nothing
    init = torch.linspace(-2.0, 9.0, 8) + 0.1 * torch.rand(8, generator=g)
    for iters in (1, 4, 30):
        want = _naive_lloyd(u, w, init, iters).float()
        torch.testing.assert_close(lloyd_max(u, w, init, iterations=iters), want, rtol=0, atol=1e-5)
    got = lloyd_max(u, w, init)
    assert (got == init.float()).sum() >= 4, got  # the empty cells' levels, unmoved


def test_key_channel_weights_are_the_transformed_query_second_moments():
    from trtkv.calibration.codebook import key_channel_weights

    g = torch.Generator().manual_seed(11)
    q = torch.randn(400, H, D, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3, D, dtype=torch.float64)
    moment = torch.einsum("nhd,nhe->hde", q, q) / q.shape[0]
    smooth = torch.rand(H, D, generator=g, dtype=torch.float64) + 0.5
    for spec, s in (("int3:bchannel:asym", None), ("int3:bchannel:asym:hadamard", None), ("int3:bchannel:asym:smooth:hadamard", smooth)):
        tf = _fmt(spec)
        qq = q * (s if tf.smooth else 1.0)
        if tf.hadamard:
            qq = qq @ hadamard_matrix(D, torch.float64)
        ref = qq.square().mean(0)
        ref = ref / ref.mean()
        torch.testing.assert_close(key_channel_weights(moment, tf, s).double(), ref, rtol=1e-5, atol=1e-6)


def test_sealed_blocks_cut_windows_like_the_cache():
    from trtkv.calibration.codebook import sealed_blocks

    fmt = get_format(f"k=int3:bchannel:asym,v=fp16,block={BS},sink=2")
    w = torch.randn(2, 3 * BS + 2, H, D)
    blocks = sealed_blocks(w, fmt)
    assert blocks.shape == (2, 3, H, BS, D)
    torch.testing.assert_close(blocks[1, 2, 1], w[1, 2 * BS : 3 * BS, 1])  # block 2 of window 1, head 1
    torch.testing.assert_close(blocks[0, 0, :, :2], w[0, 2:3].permute(1, 0, 2).expand(H, 2, D))  # sink rows -> row 2
    torch.testing.assert_close(blocks[0, 0, :, 2:], w[0, 2:BS].permute(1, 0, 2))


@pytest.mark.parametrize("spec", ["int3:bchannel:asym:hadamard:nuq", "int2:token:sym:nuq:out3"])
def test_fit_codebook_is_lloyd_on_the_seals_normalized_values(spec):
    """Per head, the fitted levels are the Lloyd-Max levels of exactly the values the seal normalizes (the outliers
    left out), weighted by scale^2 x the channel weight; per_head False pools the heads."""
    from trtkv.calibration.codebook import fit_codebook, lloyd_max, spread_levels
    from trtkv.quant import normalized_block

    tf = _fmt(spec)
    g = torch.Generator().manual_seed(12)
    blocks = torch.randn(4, H, BS, D, generator=g) * torch.linspace(0.5, 2, D)
    cw = torch.rand(H, D, generator=g) + 0.5
    cb = fit_codebook(blocks, tf, None, cw)
    assert cb.shape == (H, 2**tf.traits.bits) and (cb[:, 1:] > cb[:, :-1]).all()
    u, s, dense = normalized_block(blocks, tf.model_copy(update={"codebook": False}), None)
    for h in range(H):
        uh, wh = u[:, h][dense[:, h]], (s.square() * cw.view(H, 1, D))[:, h][dense[:, h]]
        torch.testing.assert_close(cb[h], lloyd_max(uh, wh, spread_levels(uh, cb.shape[1])))
    pooled = fit_codebook(blocks, tf, None, cw, per_head=False)
    assert torch.equal(pooled[0], pooled[2]) and not torch.equal(pooled[0], cb[0])


def test_calibrated_codebooks_lower_the_weighted_error_of_real_seals():
    """On sealed blocks, the fitted codebook gives a lower query-weighted key error than the uniform grid: the objective
    the fit minimises, measured through ``fake_quantize_block``."""
    from trtkv.calibration.codebook import fit_codebook

    tf = _fmt("int2:bchannel:asym:nuq")
    g = torch.Generator().manual_seed(13)
    blocks = torch.randn(16, H, BS, D, generator=g) ** 3  # heavy tails: levels should crowd the middle
    cw = torch.rand(H, D, generator=g) + 0.1
    cb = fit_codebook(blocks, tf, None, cw)

    def err(params, fmt):
        e = (fake_quantize_block(blocks, fmt, params) - blocks).square()
        return float((e * cw.view(H, 1, D)).sum())

    assert err(TensorParams(codebook=cb), tf) < 0.9 * err(None, _fmt("int2:bchannel:asym"))


# --------------------------------------------------------------------------- statistics: query moments, whole windows


def test_collect_stats_keeps_query_moments_and_whole_windows(tiny_model):
    """The query second moments equal q q^T of the queries recomputed by hand (q_proj, RoPE) for layer 0; the logits
    are untouched by the observation; the first windows' K/V are kept whole, in order."""
    from transformers.cache_utils import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from trtkv.calibration.stats import KVStats, collect_stats, observe_queries
    from trtkv.models import load_model

    d, _ = tiny_model("llama")
    lm = load_model(str(d), device="cpu", dtype="float32")
    info = lm.info
    windows = torch.randint(0, info.vocab_size, (3, 11), generator=torch.Generator().manual_seed(14))
    stats = collect_stats(lm, windows, batch_size=2, progress=False, reservoir=64, sample_windows=2)
    H, D, Hq = info.num_kv_heads, info.head_dim, info.num_heads
    attn = lm.model.model.layers[0].self_attn
    seen = {}
    hook = attn.register_forward_pre_hook(lambda m, a, kw: seen.update(h=kw["hidden_states"], pe=kw["position_embeddings"]), with_kwargs=True)
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        plain = lm.model(input_ids=windows, cache=cache, use_cache=True).logits
        with observe_queries(lm.model, lambda i, q: None):
            observed = lm.model(input_ids=windows).logits
    hook.remove()
    torch.testing.assert_close(observed, plain, rtol=0, atol=0)
    q = attn.q_proj(seen["h"]).view(3, 11, Hq, D).transpose(1, 2)
    q, _ = apply_rotary_pos_emb(q, q, *seen["pe"])
    q = q.double().reshape(3, H, Hq // H, 11, D)
    ref = torch.einsum("bhgsd,bhgse->hde", q, q)
    assert stats.query_count == 3 * 11 * (Hq // H)
    torch.testing.assert_close(stats.query[0], ref, rtol=1e-5, atol=1e-6)
    keys = cache.layers[1].keys.permute(0, 2, 1, 3)  # [B, S, H, D]
    assert stats.windows["k"].shape == (info.num_layers, 2, 11, H, D) and stats.windows["k"].dtype == torch.float16
    torch.testing.assert_close(stats.window_sample("k", 1), keys[:2].half().float())
    back = KVStats.from_tensors(stats.to_tensors())  # saved and loaded with the artifact
    torch.testing.assert_close(back.query_moment(), stats.query_moment())
    assert torch.equal(back.windows["v"], stats.windows["v"]) and back.sample_windows == 2


def test_old_statistics_load_without_query_moments_and_say_so():
    from trtkv.calibration.stats import stats_from_rows

    st = stats_from_rows({"k": [torch.randn(8, H, D)], "v": [torch.randn(8, H, D)]})
    t = st.to_tensors()
    for key in ("query.moment_sum", "meta.query_count", "meta.sample_windows"):
        t.pop(key, None)
    from trtkv.calibration.stats import KVStats

    old = KVStats.from_tensors(t)
    assert old.query is None and old.windows == {}
    with pytest.raises(TrtkvError, match="query"):
        old.query_moment()
    with pytest.raises(TrtkvError, match="windows"):
        old.window_sample("k", 0)


def test_choose_params_fits_codebooks_and_skips_their_clip():
    from trtkv.calibration.scales import choose_params
    from trtkv.calibration.stats import stats_from_rows

    g = torch.Generator().manual_seed(15)
    L, S = 2, 2 * BS + 1
    k = [torch.randn(3 * S, H, D, generator=g) * 2 for _ in range(L)]
    v = [torch.randn(3 * S, H, D, generator=g) for _ in range(L)]
    q = [torch.randn(3, 2 * H, S, D, generator=g) for _ in range(L)]
    st = stats_from_rows({"k": k, "v": v}, seq_len=S, sample_windows=2, queries=q)
    fmt = get_format(f"k=int3:bchannel:asym:hadamard:nuq,v=int3:g8:sym:nuq,block={BS}")
    params = choose_params(st, fmt, "mse")
    for lp in params:
        assert lp.k.codebook.shape == (H, 8) and lp.v.codebook.shape == (H, 8) and lp.v.clip is None
    plain = choose_params(st, get_format(f"k=int3:bchannel:asym:hadamard,v=int3:g8:sym,block={BS}"), "mse")
    assert plain[0].v.clip is not None and plain[0].k.codebook is None
    unweighted = choose_params(st, fmt, "mse", codebook_weight_keys=False)
    assert not torch.equal(unweighted[0].k.codebook, params[0].k.codebook)
    assert torch.equal(unweighted[0].v.codebook, params[0].v.codebook)  # values are never weighted by queries


def test_codebooks_round_trip_through_the_artifact():
    from trtkv.artifacts import LayerParams, params_to_tensors, tensors_to_params

    cb = torch.randn(H, 8).sort(-1).values
    p = {"int3-nuq": [LayerParams(k=TensorParams(codebook=cb), v=TensorParams(clip=torch.ones(H), codebook=cb + 1))]}
    t = params_to_tensors(p)
    assert set(t) == {"int3-nuq.layers.0.k.codebook", "int3-nuq.layers.0.v.codebook", "int3-nuq.layers.0.v.clip"}
    back = tensors_to_params(t, 1)["int3-nuq"][0]
    assert torch.equal(back.k.codebook, cb) and torch.equal(back.v.codebook, cb + 1) and back.k.clip is None


# --------------------------------------------------------------------------- the eval cache and the paged reference


NUQ_OUT = f"k=int3:bchannel:asym:hadamard:nuq:out3,v=int3:g8:sym:nuq:out2,block={BS},sink=2"


def _nuq_params(fmt, layers=1, seed=16):
    from trtkv.artifacts import LayerParams

    return [LayerParams(k=TensorParams(codebook=_codebook(fmt.k, seed=seed + i)), v=TensorParams(codebook=_codebook(fmt.v, seed=seed + 50 + i)))
            for i in range(layers)]


def test_eval_cache_stores_codes_and_outlier_lists_and_reads_the_seal():
    from trtkv.cache_layout import without_sink
    from trtkv.kv_cache import QuantizedKVLayer

    fmt = get_format(NUQ_OUT)
    [lp] = _nuq_params(fmt)
    layer = QuantizedKVLayer(fmt, lp)
    x = torch.randn(2, H, 3 * BS + 2, D, generator=torch.Generator().manual_seed(17))
    for a in range(0, x.shape[2], BS):
        k, v = layer.update(x[:, :, a : a + BS], x[:, :, a : a + BS] * 0.5)
    q = layer.k_store.quantized
    assert q.outlier_index.shape == (2, H, 3, 3) and q.codes.dtype == torch.uint8  # one list per sealed block
    blocks = x[:, :, : 3 * BS].half().float().reshape(2, H, 3, BS, D)
    blocks[:, :, 0] = without_sink(blocks[:, :, 0], 2)
    ref = fake_quantize_block(blocks, fmt.k, lp.k, head_axis=-4).reshape(2, H, 3 * BS, D)
    ref[:, :, :2] = x[:, :, :2].half().float()  # sink rows stay fp16
    torch.testing.assert_close(k[:, :, : 3 * BS], ref)
    # bytes: codes, scales, zero-points, the outlier lists and the fp16 open block + sinks, as the layout counts them
    from trtkv.cache_layout import PagedKVLayout

    lay = PagedKVLayout(fmt, H, D, BS, num_blocks=3, num_slots=2)
    assert layer.nbytes() == 2 * 3 * lay.bytes_per_block() + 2 * lay.tail_bytes_per_slot()



def test_paged_layout_counts_outlier_bytes_and_codebooks():
    from trtkv.cache_layout import PagedKVLayout

    fmt = get_format(NUQ_OUT)
    lay = PagedKVLayout(fmt, H, D, BS, num_blocks=4, num_slots=2)
    pool = lay.allocate("k")
    assert pool.outlier_index.shape == (4, H, 3) and pool.outlier_index.dtype == torch.int16 and pool.outlier_value.dtype == torch.float16
    per_block = sum(t.numel() * t.element_size() for t in (pool.data, pool.scale, pool.zero, pool.outlier_index, pool.outlier_value)) // 4
    assert lay.tensor_bytes_per_block("k") == per_block
    assert lay.bytes_per_token() * 8 / (2 * H * D) == pytest.approx(fmt.pool_bits_per_element(D))
    assert lay.constant_bytes(range(5)) == fmt.constant_bytes(5, H) == 5 * 2 * H * 8 * 4



def _hand_bits(code_bits, bs, d, scales_per_block, outliers):
    """One KV head's bits in one sealed block, by hand: codes, fp16 scales / zero-points, (fp16 value + int16 position)
    per outlier."""
    return bs * d * code_bits + scales_per_block * 16 + outliers * (16 + 16)


@pytest.mark.parametrize("seed", [0, 1])
def test_layout_bits_match_a_hand_count_for_outlier_and_codebook_formats(seed):
    """Odd sizes drawn fresh: the layout's bytes per block (what inspect and the runtime's budget read), its allocated
    tensors, the format's pool bits (what plan and eval print) and plan's rows agree with naive arithmetic; a codebook
    adds nothing per block and is the per-layer constant plan takes from the budget."""
    from trtkv.cache_layout import PagedKVLayout
    from trtkv.plan import ModelShape, plan

    g = torch.Generator().manual_seed(seed)
    heads = int(torch.randint(1, 6, (1,), generator=g)) * 2 + 1  # odd: 3 .. 11
    d = 8 * int(torch.randint(2, 6, (1,), generator=g)) + 8 * (seed % 2)  # a multiple of 8 (int3), 16 .. 48
    bs = int(torch.randint(3, 12, (1,), generator=g)) | 1  # odd
    n_k, n_v, layers = int(torch.randint(1, bs * d // 8, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)), 3
    cases = {
        # outliers on both sides: K per channel per block (scale + zero per channel), V sym per token in groups of 8
        f"k=int3:bchannel:asym:hadamard:out{n_k},v=int2:g8:sym:out{n_v},block={bs}":
            (_hand_bits(3, bs, d, 2 * d, n_k), _hand_bits(2, bs, d, bs * d // 8, n_v), 0),
        # codebooks on both sides: K asym per token (scale + zero per token), V sym groups of 8 at int4
        f"k=int3:token:asym:nuq,v=int4:g8:sym:nuq,block={bs}":
            (_hand_bits(3, bs, d, 2 * bs, 0), _hand_bits(4, bs, d, bs * d // 8, 0), layers * heads * (8 + 16) * 4),
        # both, and a plain format as the control
        f"k=int2:bchannel:asym:nuq:out{n_k},v=int3:token:sym,block={bs}":
            (_hand_bits(2, bs, d, 2 * d, n_k), _hand_bits(3, bs, d, bs, 0), layers * heads * 4 * 4),
    }
    for spec, (k_bits, v_bits, constants) in cases.items():
        fmt = get_format(spec)
        lay = PagedKVLayout(fmt, heads, d, bs, num_blocks=3, num_slots=1)
        assert lay.tensor_bytes_per_block("k") * 8 == heads * k_bits, spec
        assert lay.tensor_bytes_per_block("v") * 8 == heads * v_bits, spec
        for which in ("k", "v"):  # the allocated pool tensors hold exactly those bytes
            pool = lay.allocate(which, tail=False)
            held = sum(t.numel() * t.element_size() for t in (pool.data, pool.scale, pool.zero, pool.outlier_index, pool.outlier_value)
                       if t is not None)
            assert held == 3 * lay.tensor_bytes_per_block(which), (spec, which)
        per_element = (k_bits + v_bits) / (2 * bs * d)
        assert lay.bytes_per_token() * 8 / (2 * heads * d) == pytest.approx(per_element, rel=1e-12)
        assert fmt.pool_bits_per_element(d) == pytest.approx(per_element, rel=1e-12)
        assert lay.constant_bytes(range(layers)) == fmt.constant_bytes(layers, heads) == constants
        budget, [row] = plan(ModelShape("m", layers, heads, d), [fmt], context_len=4 * bs, gpu_bytes=2**30, reserve_fraction=0)
        assert row.pool_bits_per_element == pytest.approx(per_element, rel=1e-12) and row.constant_bytes == constants
        assert row.cached_bytes_per_token == pytest.approx(layers * lay.bytes_per_token(), rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_per_layer_formats_bytes_are_the_sum_of_its_layers_hand_counts(seed):
    """A per-layer format whose layers mix codebook, outlier and plain storages drawn at random (odd sizes): its
    codebook bytes, pool bits, per-layer block bytes and plan's row are each layer's own hand count, summed or averaged
    over the layers -- never layer 0's count taken for every layer."""
    from trtkv.cache_layout import PagedKVLayout
    from trtkv.formats import KVFormat, LayerStorage
    from trtkv.plan import ModelShape, plan

    g = torch.Generator().manual_seed(100 + seed)
    heads, d, bs = 2 * int(torch.randint(1, 5, (1,), generator=g)) + 1, 24, 2 * int(torch.randint(2, 6, (1,), generator=g)) + 1
    n_k = int(torch.randint(1, 9, (1,), generator=g))
    sides = {  # storage -> (its bits in one KV head's block, its codebook bytes per KV head)
        "int3:token:asym:nuq": (_hand_bits(3, bs, d, 2 * bs, 0), 8 * 4),
        "int4:g8:sym:nuq": (_hand_bits(4, bs, d, bs * d // 8, 0), 16 * 4),
        f"int2:bchannel:asym:out{n_k}": (_hand_bits(2, bs, d, 2 * d, n_k), 0),
        "int3:token:sym": (_hand_bits(3, bs, d, bs, 0), 0),
        "int8:token": (_hand_bits(8, bs, d, bs, 0), 0),
    }
    names = list(sides)
    layers = 5
    pick = torch.randint(0, len(names), (layers, 2), generator=g).tolist()
    pick[0] = [names.index("int8:token")] * 2  # layer 0 without codebooks: a count of layer 0 for all would be 0
    storages = [LayerStorage(k=parse_tensor_spec(names[a]), v=parse_tensor_spec(names[b])) for a, b in pick]
    fmt = KVFormat(name="mixed", k=storages[0].k, v=storages[0].v, block_size=bs, layers=tuple(storages))
    constants = sum(heads * (sides[names[a]][1] + sides[names[b]][1]) for a, b in pick)
    per_layer_bits = [(sides[names[a]][0] + sides[names[b]][0]) / (2 * bs * d) for a, b in pick]
    assert constants > 0
    assert fmt.constant_bytes(layers, heads) == constants
    assert fmt.pool_bits_per_element(d) == pytest.approx(sum(per_layer_bits) / layers, rel=1e-12)
    lay = PagedKVLayout(fmt, heads, d, bs, num_blocks=3, num_slots=1)
    assert lay.constant_bytes(range(layers)) == constants
    for i, (a, b) in enumerate(pick):
        assert lay.block_bytes([i]) * 8 == heads * (sides[names[a]][0] + sides[names[b]][0]), i
    _, [row] = plan(ModelShape("m", layers, heads, d), [fmt], context_len=4 * bs, gpu_bytes=2**30, reserve_fraction=0)
    assert row.constant_bytes == constants


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_eval_forward_equals_paged_step_by_step_decode_with_codebooks_and_outliers(tiny_model, arch):
    """The eval cache's sealed blocks with codebooks and outlier lists are what the reference paged cache (pools,
    block tables, open blocks and the pools' outlier lists, trtkv.cache_layout) holds decoding token by token."""
    from test_kv_cache import PagedReferenceCache

    from trtkv.evaluate import _forward, model_logits

    _, model = tiny_model(arch)
    n_layers, kvh, hd = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    fmt = get_format("k=int3:bchannel:asym:hadamard:nuq:out3,v=int2:token:asym:nuq:out2,block=4,sink=1")
    params = [lp for lp in _nuq_params(fmt, n_layers)]
    for lp in params:
        lp.k.codebook, lp.v.codebook = lp.k.codebook[:kvh], lp.v.codebook[:kvh]
    ids = torch.randint(0, 320, (2, 14), generator=torch.Generator().manual_seed(18))
    with torch.inference_mode():
        teacher = model_logits(model, ids, fmt, params)
        paged = PagedReferenceCache(fmt, n_layers, kvh, hd, batch=2, params=params)
        steps = torch.cat([_forward(model, ids[:, i : i + 1], paged) for i in range(14)], 1)
        grid = model_logits(model, ids, get_format("k=int3:bchannel:asym:hadamard,v=int2:token:asym,block=4,sink=1"))
    torch.testing.assert_close(steps, teacher, rtol=0, atol=1e-4)
    assert (teacher - grid).abs().max() > 5e-4  # the codebooks and outliers really change what is read


# --------------------------------------------------------------------------- the paths that do not read them yet


# (spec, the words a refusal names, the side that keeps it); and formats every path reads (no such refusal)
_S4 = ",block=64,sink=4"
NEW_FEATURES = [
    (f"k=int3:bchannel:asym:hadamard,v=int3:g32:sym:hadamard:nuq{_S4}", "codebooks (nuq)", "v"),
    (f"k=int3:bchannel:asym:hadamard:nuq,v=int3:g32:sym:hadamard{_S4}", "codebooks (nuq)", "k"),
    (f"k=int3:bchannel:asym:hadamard,v=int3:g64:sym:hadamard:out16{_S4}", "outlier lists (outN)", "v"),
    (f"k=int2:bchannel:asym:hadamard:out32,v=int2:token:sym:hadamard{_S4}", "outlier lists (outN)", "k"),
    (f"k=int3:bchannel:asym:prerope:qsmooth:hadamard,v=int3:g32:sym:hadamard{_S4}", "keys before RoPE (prerope)", "k"),
    (f"k=int8:bchannel:asym:alloc2.5,v=int3:g32:sym:hadamard{_S4}", "bits allocated per channel (allocB)", "k"),
]
READ_EVERYWHERE = [INT3_FREE, INT2_FREE, "int4", "k=int3:bchannel:asym:qsmooth:hadamard,v=int3:g32:sym:hadamard,block=64"]


# the paths that read a feature (the torch ops, the C decode kernels and the Triton kernels read them all); others: none
_ALL = {"cpu", "torch", "kernels", "seal"}
READERS = {"codebooks (nuq)": _ALL, "outlier lists (outN)": _ALL, "keys before RoPE (prerope)": _ALL,
           "bits allocated per channel (allocB)": _ALL}


@pytest.mark.parametrize("spec,words,side", NEW_FEATURES)
def test_every_path_of_the_capability_table_refuses_each_new_feature_in_one_line(spec, words, side):
    """Every path but the feature's readers refuses it in one line naming the path; the readers take it."""
    from trtkv.plugins.contract.capabilities import CAPABILITIES, kernels_take

    fmt = get_format(spec)
    readers = READERS.get(words, set())
    for path in CAPABILITIES.values():
        reasons = [r for r in path.reasons(fmt, None, 64, 64) if words in r]
        if path.name in readers:
            assert not path.layout_reasons(fmt), path.name
            continue
        assert len(reasons) == 1 and "\n" not in reasons[0] and path.title in reasons[0] and reasons[0].hint, (path.name, reasons)
        # the hint names a torch-engine path that reads it, where there is one
        assert ("--backend torch" in reasons[0].hint) == bool(readers), (path.name, reasons[0].hint)
        assert all(CAPABILITIES[r].title in reasons[0].hint for r in readers if r in ("torch", "cpu", "kernels"))
    assert kernels_take(fmt) == ("seal" in readers)  # the AOT list asks this: the Triton kernels take what they read


@pytest.mark.parametrize("spec", READ_EVERYWHERE)
def test_formats_every_path_reads_are_not_refused_for_the_new_features(spec):
    from trtkv.plugins.contract.capabilities import CAPABILITIES, kernels_take

    fmt = get_format(spec)
    for path in CAPABILITIES.values():
        assert not path.layout_reasons(fmt) and not [r for r in path.reasons(fmt, None, 64, 64) if "read yet" in r], path.name
    assert kernels_take(fmt)


def test_aot_configurations_take_every_preset_and_the_op_contract_refuses_the_calibrated_ones():
    """The Triton kernels seal and read every preset, so the AOT configuration list compiles them all (int3 / int2:
    per-channel key widths before RoPE, codebooks, int2's outlier lists); the trtkv:: ops (ONNX Runtime custom ops,
    TensorRT plugins) refuse the int3 / int2 presets' keys, and so the contract tests leave them out."""
    from trtkv.formats import PRESETS
    from trtkv.plugins import aot
    from trtkv.plugins.contract.capabilities import KERNEL_SEAL, kernels_attend, kernels_take, op_refusal

    assert not any(KERNEL_SEAL.lacks(t) for f in PRESETS.values() for t in (f.k, f.v))
    assert all(kernels_take(f) and kernels_attend(f) for f in PRESETS.values())
    assert kernels_take(get_format(INT3_NUQ)) and kernels_take(get_format(INT2_NUQ))
    assert all(op_refusal(PRESETS[n].k) for n in ("int3", "int2")) and op_refusal(get_format(INT3_NUQ).k)
    names = {c.name for c in aot.lean_configs()}
    for n in ("int3", "int2"):  # their attention and seal are compiled (and register-checked)
        f = PRESETS[n]
        assert any(c.startswith(("paged_decode_partition.", "paged_prefill.")) and f"k-{aot._tag(f.k)}." in c for c in names), n
        assert any(c.startswith(f"seal.{aot._tag(f.v)}.") for c in names), n
    assert any("prerope" in n and "alloc" in n and n.startswith("paged_decode_partition.") for n in names)
    assert any("nuq" in n and n.startswith("paged_decode_partition.") for n in names)


@pytest.mark.parametrize("spec,words,side", NEW_FEATURES)
def test_the_op_contract_refuses_each_new_feature(spec, words, side):
    """The trtkv:: ops (Triton kernels, ONNX Runtime custom ops, TensorRT plugins) share one attribute check: a format
    attribute that keeps a codebook, an outlier list or pre-RoPE keys is a one-line error naming it."""
    from trtkv.plugins.contract.attrs import attrs_for
    from trtkv.plugins.contract.specs import OPS

    for op in [op for op in OPS.values() if {"tensor_format", f"{side}_format"} & {a.name for a in op.attrs}]:  # ops that read that side
        with pytest.raises(TrtkvError, match=re.escape(words)) as e:
            attrs_for(op, spec, num_q_heads=9, num_kv_heads=3, head_dim=64, which=side)
        assert "\n" not in str(e.value) and "trtkv:: ops" in str(e.value)
    for ok in READ_EVERYWHERE:  # the control: the same ops take the formats every path reads
        for op in OPS:
            attrs_for(op, ok, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=64, which=side)


def test_the_triton_launchers_refuse_what_they_cannot_read_in_one_line():
    """The Triton kernels read every calibrated storage feature; what they refuse, each in one line naming the fix: an outlier
    count that is not a multiple of 16 (one-hot products by chunks), a codebook format without its codebook, keys stored
    before RoPE without the model's table or the blocks' first positions."""
    pytest.importorskip("triton")
    from trtkv.plugins import kernels, ops
    from trtkv.plugins.cases import case_rope

    rows = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(27))
    for spec in ("int3:bchannel:asym:out24", "int3:bchannel:asym:out8"):
        with pytest.raises(TrtkvError, match="a multiple of 16") as e:
            kernels.format_constexprs(parse_tensor_spec(spec))
        assert "\n" not in str(e.value)
    assert kernels.format_constexprs(parse_tensor_spec("int3:bchannel:asym:out48"))["OUT"] == 48  # the control
    with pytest.raises(TrtkvError, match="none was given"):
        ops.launch_seal_pool(rows, parse_tensor_spec("int3:g32:sym:nuq"), interpret=True)
    pre = parse_tensor_spec("int3:bchannel:asym:prerope")
    with pytest.raises(TrtkvError, match="no RoPE table was given"):
        ops.launch_seal_pool(rows, pre, interpret=True, first_positions=torch.tensor([0, 64]))
    rope = case_rope(100, 64)
    with pytest.raises(TrtkvError, match="first position"):
        ops.launch_seal_pool(rows, pre, interpret=True, rope=(rope.cos, rope.sin))
    with pytest.raises(TrtkvError, match="covers positions below 100"):
        ops.launch_seal_pool(rows, pre, interpret=True, rope=(rope.cos, rope.sin), first_positions=torch.tensor([0, 64]))


@pytest.mark.parametrize("spec,words,side", [f for f in NEW_FEATURES if "cpu" in READERS[f[1]]])
def test_the_cpu_c_kernels_read_each_new_feature_and_the_c_seal_leaves_it_to_the_reference(spec, words, side):
    """trtkv's C kernels: the decode codec takes every new feature (a codebook format refuses in one line when no
    codebook was calibrated); the C seal says why it leaves the format to the reference quantizer."""
    from trtkv.plugins import cpu_attention

    fmt = get_format(spec)
    tf, other = (fmt.k, fmt.v) if side == "k" else (fmt.v, fmt.k)
    assert "cpu" in READERS[words]
    if tf.codebook_levels:
        with pytest.raises(TrtkvError, match="none was given") as e:
            cpu_attention.RowCodec.of(tf, None, 3, 64, 64)
        assert "\n" not in str(e.value)
        codec = cpu_attention.RowCodec.of(tf, TensorParams(codebook=torch.linspace(-4, 3, tf.codebook_levels)), 3, 64, 64)
    elif tf.allocated_bits is not None:  # per-channel bits: missing widths are the refusal, calibrated ones are taken
        with pytest.raises(TrtkvError, match="none were given") as e:
            cpu_attention.RowCodec.of(tf, None, 3, 64, 64)
        assert "\n" not in str(e.value)
        codec = cpu_attention.RowCodec.of(tf, TensorParams(bits=torch.full((3, 64), 2.0)), 3, 64, 64)
    elif tf.smooth:  # keys before RoPE are smoothed: missing factors are the refusal, calibrated ones are taken
        with pytest.raises(TrtkvError, match="no smoothing factors were given") as e:
            cpu_attention.RowCodec.of(tf, None, 3, 64, 64)
        assert "\n" not in str(e.value)
        codec = cpu_attention.RowCodec.of(tf, TensorParams(smooth=torch.rand(3, 64) + 0.5), 3, 64, 64)
    else:
        codec = cpu_attention.RowCodec.of(tf, None, 3, 64, 64)
    assert codec.fmt.outliers == tf.outliers and codec.fmt.pre_rope == int(tf.pre_rope)
    assert words.split(" (")[0] in cpu_attention.SealCodec.reason(tf) and cpu_attention.SealCodec.of(tf, None, 3, 64, 64) is None
    assert cpu_attention.SealCodec.reason(other) is None  # the control: the other side is a plain dynamic int format
    cpu_attention.RowCodec.of(other, None, 3, 64, 64)


@pytest.mark.parametrize("attention", ["torch", "cpu", "kernels", "auto"])
def test_the_torch_engine_refuses_each_new_feature(tiny_model, attention):
    """Each attention that does not read a feature refuses it in one line; ``auto`` on CPU takes the C kernels where they
    read the format (codebooks) and the torch ops where only they do (outlier lists, keys before RoPE)."""
    from types import SimpleNamespace

    from trtkv.plugins import cpu_attention
    from trtkv.runtime.torch_engine import TorchEngine

    _, model = tiny_model("llama")
    for spec, words, _ in NEW_FEATURES:
        m = SimpleNamespace(kv_format=get_format(spec), limits=SimpleNamespace(block_size=64, max_seq_len=256), model=SimpleNamespace(head_dim=64))
        if attention == "auto":
            want = "cpu" if "cpu" in READERS.get(words, ()) and cpu_attention.unavailable() is None else "torch"
            assert TorchEngine(model, m, attention="auto", device="cpu").attention == want, words
            continue
        if attention in READERS.get(words, ()):
            assert TorchEngine(model, m, attention=attention, device="cpu").attention == attention
            continue
        with pytest.raises(TrtkvError, match=re.escape(words)):
            TorchEngine(model, m, attention=attention, device="cpu")


@pytest.mark.parametrize("spec,words,side", NEW_FEATURES)
def test_the_step_network_and_build_engine_refuse_each_new_feature(spec, words, side, tmp_path):
    """The ONNX step network refuses before a node is made; build-engine before the model is read (every backend,
    TensorRT-RTX by its own row)."""
    from trtkv.builder.build import build_engine
    from trtkv.builder.plugin_nodes import get_backend
    from trtkv.builder.step_network import build_step_network
    from trtkv.cache_layout import PagedKVLayout

    layout = PagedKVLayout(get_format(spec), 3, 64, 64, num_blocks=2, num_slots=1)
    for attention in ("native", "plugin"):
        with pytest.raises(TrtkvError, match=re.escape(words)):
            build_step_network(None, layout, [], get_backend(attention))
    for backend in ("onnxruntime", "torch"):
        with pytest.raises(TrtkvError) as e:
            build_engine("no-such-model", kv=spec, out=tmp_path / backend, backend=backend)
        # a torch-backend engine is built where one of the torch engine's attentions reads the format (the C kernels
        # read codebooks): then the model is the next thing refused
        assert (words in str(e.value)) == (backend == "onnxruntime" or not READERS.get(words)), (backend, str(e.value))
    from trtkv.plugins.contract.capabilities import backend_path

    assert any(words in r and "TensorRT-RTX" in r for r in backend_path("tensorrt-rtx").layout_reasons(get_format(spec)))


def test_the_runtime_pool_keeps_outlier_lists_and_seals_prerope_keys_only_with_the_models_rope():
    """The runtime pool holds an outN format's outlier lists beside its codes (one stacked tensor per field, so a swap
    or a copy of the cache moves them too); a prerope format's seal needs the model's RoPE table, which the torch
    engine hands over (``use_model_rope``): without it, one line naming the fix."""
    from trtkv.cache_layout import PagedKVLayout
    from trtkv.runtime.kv_pool import PagedKVCache
    from trtkv.runtime.step import StepBatch, StepOutput

    fmt = get_format("k=int3:bchannel:asym:hadamard:nuq:out4,v=int3:g32:sym:hadamard,block=16")
    cache = PagedKVCache(PagedKVLayout(fmt, 2, 32, 16, 5, 1), 3)
    assert cache.tensors["k_outlier_index"].shape == (3, 5, 2, 4) and cache.tensors["k_outlier_index"].dtype == torch.int16
    assert cache.tensors["k_outlier_value"].shape == (3, 5, 2, 4) and "v_outlier_index" not in cache.tensors
    assert cache.pool(1, "k").outlier_index.data_ptr() == cache.tensors["k_outlier_index"][1].data_ptr()
    assert cache.pool(1, "v").outlier_index is None
    pre = get_format("k=int3:bchannel:asym:prerope:hadamard,v=int3:g32:sym:hadamard,block=4")
    cache = PagedKVCache(PagedKVLayout(pre, 2, 32, 4, 5, 1), 1)
    rows = torch.randn(1, 1, 4, 2, 32, dtype=torch.float16)
    with pytest.raises(TrtkvError, match="RoPE table") as e:
        cache.write_new_rows(StepBatch.make([[1, 2, 3, 4]], [0], [[3]], [0]), StepOutput(None, rows, rows))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("spec", [
    "k=int3:bchannel:asym:prerope:qsmooth:hadamard:out5,v=int3:g8:sym:hadamard:nuq,block=4,sink=1",
    "k=int2:bchannel:asym:prerope:hadamard:out3,v=int2:token:sym:hadamard:nuq:out2,block=4",
    "k=int4:bchannel:asym:nuq,v=int4:g8:sym:out3,block=4,sink=1",
])
@pytest.mark.parametrize("attention", ["torch", "cpu"])
def test_the_torch_ops_serve_every_new_feature_like_the_eval_cache(tiny_models, spec, attention):
    """Codebooks, outlier lists and keys stored before RoPE through the torch engine -- its torch ops (block-aligned
    prefill chunks) and its C kernels (a prefill across blocks, sealing them in the step) -- then decodes; the runtime
    pool seals with the reference quantizer: RoPE undone with the table the engine handed it, outlier lists stored)
    give the eval cache's teacher-forced logits for the same tokens."""
    _serve_like_the_eval_cache(tiny_models("llama", num_hidden_layers=2), spec, attention, block=4)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [
    "k=int3:bchannel:asym:prerope:qsmooth:hadamard:out16,v=int3:g8:sym:hadamard:nuq,block=16,sink=1",
    "k=int2:bchannel:asym:prerope:hadamard:out32,v=int2:token:sym:hadamard:nuq:out16,block=16",
    "k=int4:bchannel:asym:nuq,v=int4:g8:sym:out16,block=16,sink=1",
])
def test_the_triton_kernels_serve_every_new_feature_like_the_eval_cache(tiny_models, spec, monkeypatch):
    """The same through the Triton kernels (the CUDA path, here under the interpreter): decode and prefill attention
    read the codebooks, the outlier lists and the keys stored before RoPE, and the pool seals with the Triton seal
    kernel (codebook levels, outlier selection, RoPE undone): the eval cache's logits for the same tokens."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _serve_like_the_eval_cache(tiny_models("llama", num_hidden_layers=2, head_dim=32, hidden_size=96), spec, "kernels",
                               block=16, seal_kernels=True, blocks=3, decode_steps=3)


def _serve_like_the_eval_cache(tiny, spec: str, attention: str, block: int, seal_kernels: bool = False, blocks: int = 5,
                               decode_steps: int = 7) -> None:
    """``blocks`` (at least 3) sets the longer prompt's length: the first block sealed with sinks, one sealed after it, the
    last open until the first decode step fills and seals it, read sealed by the next (``decode_steps`` at least 2); the interpreter's cost grows with both."""
    from conftest import random_kv_params

    from trtkv.cache_layout import PagedKVLayout
    from trtkv.evaluate import model_logits
    from trtkv.formats import fit_formats
    from trtkv.models import load_model, model_info
    from trtkv.runtime.kv_pool import PagedKVCache
    from trtkv.runtime.torch_engine import TorchEngine
    from trtkv.runtime.verify import StaticBatch

    d, _ = tiny
    info = model_info(str(d))
    model = load_model(str(d), device="cpu", dtype="float32").model
    [fmt], _ = fit_formats([spec], info.head_dim)
    heads, hd = info.num_kv_heads, info.head_dim
    params = random_kv_params(fmt, heads, hd, info.num_layers, seed=37)
    n = blocks * block - 1  # prompts over several sealed blocks, a first one sealed with sinks
    prompts = [list(range(3, 3 + n)), list(range(40, 40 + n - block - 3))]
    cache = PagedKVCache(PagedKVLayout(fmt, heads, hd, block, 40, 2), info.num_layers, params)
    if seal_kernels:  # the kernel backend with its seal kernel (the CUDA seal, here under the interpreter)
        from trtkv.attention.triton import TritonKernels

        attention = TritonKernels(seal_kernel=True)
    engine = TorchEngine(model, attention=attention, device="cpu")
    sb = StaticBatch(cache, len(prompts))
    steps = [sb.prefill(engine, prompts)]
    for _ in range(decode_steps):
        nxt = steps[-1].argmax(-1)
        steps.append(sb.step(engine, {i: [int(nxt[i])] for i in range(len(prompts))}))
    got = torch.stack(steps, 1)
    for w, tf in (("k", fmt.k), ("v", fmt.v)):
        if tf.outliers:  # the seals stored outlier lists
            assert cache.tensors[f"{w}_outlier_value"].abs().sum() > 0
    ids = torch.tensor([p + got[i, :-1].argmax(-1).tolist() + [0] * (len(prompts[0]) - len(p)) for i, p in enumerate(prompts)])
    with torch.inference_mode():
        want = model_logits(model, ids, fmt, params)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(got[i], want[i, len(p) - 1 : len(p) + decode_steps], rtol=0, atol=5e-4)
    with torch.inference_mode():
        grid = model_logits(model, ids, get_format("fp16"))
    assert max((got[i] - grid[i, len(p) - 1 : len(p) + decode_steps]).abs().max() for i, p in enumerate(prompts)) > 5e-3  # really quantized


# --------------------------------------------------------------------------- query-aware smoothing (qsmooth)


def _qk_stats(seed=19, L=2, S=2 * BS):
    from trtkv.calibration.stats import stats_from_rows

    perm = torch.Generator().manual_seed(0)  # the same model (channel energies, unlike the queries') for every seed
    kscale = torch.logspace(-1, 1, D)[torch.randperm(D, generator=perm)]
    qscale = torch.logspace(0.5, -0.5, D)[torch.randperm(D, generator=perm)]
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(4 * S, H, D, generator=g) * kscale for _ in range(L)]
    q = [torch.randn(4, 2 * H, S, D, generator=g) * qscale for _ in range(L)]
    v = [torch.randn(4 * S, H, D, generator=g) for _ in range(L)]
    return stats_from_rows({"k": k, "v": v}, seq_len=S, sample_windows=2, queries=q), k, q


def test_query_smoothing_factors_match_float64():
    from trtkv.calibration.scales import choose_params, query_smoothing_factors

    stats, k, q = _qk_stats()
    got = query_smoothing_factors(stats)
    for i in range(2):
        k_rms = k[i].double().square().mean(0).sqrt()  # [H, D]
        qq = q[i].double().reshape(4, H, 2, -1, D)
        q_rms = qq.square().mean((0, 2, 3)).sqrt()
        r = (k_rms / q_rms).sqrt()
        ref = r / r.log().mean(-1, keepdim=True).exp()
        torch.testing.assert_close(got[i].double(), ref, rtol=1e-4, atol=1e-6)
    qs = choose_params(stats, get_format(f"k=int3:bchannel:asym:qsmooth:hadamard,v=fp16,block={BS}"), "max")
    ab = choose_params(stats, get_format(f"k=int3:bchannel:asym:smooth:hadamard,v=fp16,block={BS}"), "max")
    torch.testing.assert_close(qs[1].k.smooth, got[1])
    assert not torch.allclose(ab[1].k.smooth, got[1])  # the rule really is the format's


def test_query_smoothing_lowers_the_logit_error_of_rotated_keys():
    """The attention logits' error ``q . (k_hat - k)`` on held-out rows is lower with the qsmooth factors than with the
    keys' absmax rule or none (the smoothing is folded into the query, so the logits themselves are unchanged)."""
    from trtkv.calibration.scales import choose_params

    stats, _, _ = _qk_stats()
    test_stats, k, q = _qk_stats(seed=20)
    errs = {}
    for word in ("", ":smooth", ":qsmooth"):
        fmt = get_format(f"k=int3:bchannel:asym{word}:hadamard,v=fp16,block={BS}")
        p = choose_params(stats, fmt, "max")[0].k
        x = k[0].reshape(-1, BS, H, D).transpose(1, 2)  # blocks [n, H, BS, D]
        e = (fake_quantize_block(x, fmt.k, p) - x).transpose(1, 2).reshape(-1, H, D)
        qh = q[0].reshape(4, H, 2, -1, D).permute(0, 2, 3, 1, 4).reshape(-1, H, D)  # query rows per KV head
        errs[word] = float(torch.einsum("qhd,khd->qkh", qh[:64], e).square().mean())
    assert errs[":qsmooth"] < 0.8 * errs[""] and errs[":qsmooth"] < errs[":smooth"]


def test_qsmooth_spec_word():
    tf = parse_tensor_spec("int2:bchannel:asym:qsmooth:hadamard")
    assert tf.smooth and tf.smooth_by == "queries" and tf.short() == "int2:bchannel:asym:qsmooth:hadamard"
    assert parse_tensor_spec("int2:bchannel:asym:smooth").smooth_by == "keys"
    for bad, match in (("k=int3:token:smooth:qsmooth,v=fp16", "give one"), ("k=fp16,v=int4:token:qsmooth", "for k=")):
        with pytest.raises(TrtkvError, match=match):
            get_format(bad)


# --------------------------------------------------------------------------- keys stored before RoPE (prerope)


def test_rope_table_is_the_models_and_rotate_inverts(tiny_model):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from trtkv.rope import RopeTable, rotate

    _, model = tiny_model("llama")
    tables = RopeTable.per_layer(model)
    assert len(tables) == model.config.num_hidden_layers and all(t is tables[0] for t in tables)  # one rotary module: one table
    table = tables[0]
    pos = torch.arange(3, 17)
    cos, sin = table.rows(3, 14)
    ref_cos, ref_sin = model.model.rotary_emb(torch.zeros(1), pos.unsqueeze(0))
    torch.testing.assert_close(cos, ref_cos[0].float())
    x = torch.randn(2, 14, 24, dtype=torch.float64)
    want, _ = apply_rotary_pos_emb(x.unsqueeze(0), x.unsqueeze(0), ref_cos.double(), ref_sin.double(), unsqueeze_dim=0)
    torch.testing.assert_close(rotate(x, cos.double(), sin.double()), want[0])
    torch.testing.assert_close(rotate(rotate(x, cos.double(), sin.double()), cos.double(), sin.double(), inverse=True), x)
    # a pair (c, c + D/2) turns by position * inv_freq[c]: the float64 angle
    theta = pos.double()[:, None] * model.model.rotary_emb.inv_freq.double()[None]
    torch.testing.assert_close(cos[:, :12].double(), theta.cos(), rtol=0, atol=1e-6)


def test_rope_tables_follow_gemma3s_layer_types(tiny_model):
    """Gemma 3's one rotary module keyed by layer type: one table per type, each layer given its type's (the float64
    check of the bases themselves is tests/test_presets_families.py)."""
    from trtkv.rope import RopeTable

    _, model = tiny_model("gemma3", num_hidden_layers=4, sliding_window_pattern=2)
    tables = RopeTable.per_layer(model)
    assert [t.layer_type for t in tables] == model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert tables[0] is tables[2] and tables[1] is tables[3] and tables[0] is not tables[1]


def test_rope_tables_refuse_a_partial_rotary_dimension(tiny_model):
    from trtkv.rope import RopeTable

    _, model = tiny_model("phi3", partial_rotary_factor=0.5)
    with pytest.raises(TrtkvError, match="partial RoPE") as e:
        RopeTable.per_layer(model)
    assert "without prerope" in e.value.fix


def test_prerope_block_matches_a_float64_loop():
    """A prerope block: each row turned back by its position's angles (pairs c, c + D/2), quantized per channel over the
    block, turned forward again."""
    tf = _fmt("int4:bchannel:asym:prerope")
    g = torch.Generator().manual_seed(21)
    x = torch.randn(2, H, BS, D, generator=g, dtype=torch.float64)
    inv_freq = 1.0 / 1000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    pos = torch.arange(7, 7 + BS, dtype=torch.float64)
    ang = torch.cat([pos[:, None] * inv_freq] * 2, -1)  # [BS, D]
    cos, sin = ang.cos(), ang.sin()
    half = D // 2

    def turn(v, sign):
        out = v.clone()
        for c in range(half):
            a, b = v[..., c], v[..., c + half]
            out[..., c] = a * cos[:, c] - sign * b * sin[:, c]
            out[..., c + half] = b * cos[:, c] + sign * a * sin[:, c]
        return out

    pre = turn(x, -1.0)
    mn, mx = pre.amin(-2, keepdim=True), pre.amax(-2, keepdim=True)
    z, s = mn.half().double(), ((mx - mn) / 15).half().double()
    deq = torch.round((pre - z) / s).clamp(0, 15) * s + z
    ref = turn(deq, 1.0)
    got = fake_quantize_block(x.float(), tf, rope=(cos.float(), sin.float())).double()
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-4)
    assert (fake_quantize_block(x.float(), _fmt("int4:bchannel:asym")).double() - got).abs().max() > 1e-3  # the frame matters
    with pytest.raises(TrtkvError, match="before RoPE"):
        quantize_block(x.float(), tf)


def test_prerope_eval_cache_needs_a_rope_table_per_layer(tiny_model):
    from trtkv.kv_cache import QuantizedKVCache
    from trtkv.rope import RopeTable

    fmt = get_format("k=int4:bchannel:asym:prerope,v=fp16,block=4")
    with pytest.raises(TrtkvError, match="no RoPE tables"):
        QuantizedKVCache(fmt, 1)
    _, model = tiny_model("llama")  # 2 layers
    with pytest.raises(TrtkvError, match="2 RoPE tables for 3 layers") as e:
        QuantizedKVCache(fmt, 3, rope=RopeTable.per_layer(model))
    assert "per_layer" in e.value.fix


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_eval_forward_equals_paged_step_by_step_decode_with_prerope_keys(tiny_model, arch):
    """Keys sealed before RoPE (the seal undoes it at the block's positions, the read applies it again) read the same
    through the eval cache as through the reference paged cache decoding token by token; qsmooth factors ride along."""
    from test_kv_cache import PagedReferenceCache

    from trtkv.artifacts import LayerParams
    from trtkv.evaluate import _forward, model_logits
    from trtkv.rope import RopeTable

    _, model = tiny_model(arch)
    n_layers, kvh, hd = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    fmt = get_format("k=int3:bchannel:asym:prerope:qsmooth:hadamard:out2,v=int3:g8:sym:hadamard,block=4,sink=1")
    g = torch.Generator().manual_seed(22)
    params = [LayerParams(k=TensorParams(smooth=torch.rand(kvh, hd, generator=g) + 0.5)) for _ in range(n_layers)]
    ids = torch.randint(0, 320, (2, 14), generator=torch.Generator().manual_seed(23))
    with torch.inference_mode():
        teacher = model_logits(model, ids, fmt, params)
        paged = PagedReferenceCache(fmt, n_layers, kvh, hd, batch=2, params=params, rope=RopeTable.per_layer(model))
        steps = torch.cat([_forward(model, ids[:, i : i + 1], paged) for i in range(14)], 1)
        post = model_logits(model, ids, get_format("k=int3:bchannel:asym:qsmooth:hadamard:out2,v=int3:g8:sym:hadamard,block=4,sink=1"), params)
    torch.testing.assert_close(steps, teacher, rtol=0, atol=1e-4)
    assert (teacher - post).abs().max() > 5e-4  # quantizing before RoPE really is another cache


def test_calibrate_fits_codebooks_per_head_or_once_per_layer(tiny_models, tmp_path, capsys):
    """``trtkv calibrate --codebooks layer`` fits one table per layer (every head's row the same), ``head`` (the
    default) one per KV head; another word is a one-line error before the model is read. Keys before RoPE have no
    reservoir error to report: the summary says n/a, not 0."""
    from trtkv.artifacts import load_calibration
    from trtkv.calibration.run import run_calibration

    d, _ = tiny_models("llama", with_tokenizer=True, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       num_hidden_layers=2)
    spec = "k=int3:bchannel:asym:prerope:hadamard,v=int3:g8:sym:hadamard:nuq,block=8"
    books = {}
    for scope in ("head", "layer"):
        art = run_calibration(str(d), "builtin:pydoc", tmp_path / scope, formats=[spec], samples=2, seq_len=64, device="cpu",
                              dtype="float32", progress=True, codebooks=scope)
        err = capsys.readouterr().err
        assert "K MSE n/a" in err and "V MSE n/a" not in err
        [params] = load_calibration(art).params.values()
        books[scope] = torch.stack([p.v.codebook for p in params])  # [L, H, levels]
    assert books["head"].shape == books["layer"].shape == (2, 2, 8)
    assert torch.equal(books["layer"][:, 0], books["layer"][:, 1])
    assert not torch.equal(books["head"][:, 0], books["head"][:, 1])
    with pytest.raises(TrtkvError, match="--codebooks") as e:
        run_calibration("no-such-model", "builtin:pydoc", tmp_path / "bad", formats=[spec], codebooks="channel", progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "bad").exists()


def test_build_engine_torch_takes_outliers_and_prerope_and_its_engine_runs_the_c_kernels(tiny_models, tmp_path):
    """build-engine --backend torch for a format with outlier lists and keys before RoPE: the build's smoke step and the
    built engine's ``auto`` attention take the C kernels on CPU (they read both), and the engine steps."""
    from trtkv.builder.build import build_engine
    from trtkv.cache_layout import PagedKVLayout
    from trtkv.models import load_model
    from trtkv.runtime.backends import open_engine
    from trtkv.runtime.kv_pool import PagedKVCache
    from trtkv.runtime.step import StepBatch

    d, _ = tiny_models("llama", with_tokenizer=True, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    spec = "k=int3:bchannel:asym:prerope:hadamard:out4,v=int3:g8:sym:hadamard,block=8,sink=1"
    out = build_engine(str(d), kv=spec, out=tmp_path / "engine", backend="torch", max_batch=2, max_seq_len=64,
                       loaded=load_model(str(d), device="cpu", dtype="float32"))
    engine = open_engine(out)
    assert engine.attention == "cpu"
    m = engine.manifest
    cache = PagedKVCache(PagedKVLayout(m.kv_format, m.model.num_kv_heads, m.model.head_dim, 8, 4, 1), m.model.num_layers)
    logits = engine.step(StepBatch.make([list(range(3, 11))], [0], [[2, 0]], [0]), cache).logits
    assert logits.shape[0] == 1 and torch.isfinite(logits).all() and cache.ropes is not None


def test_a_smaller_or_larger_block_keeps_the_outlier_lists_share():
    """``with_block_size``: an outN list is a count per block, so it scales with the block (its share of the block's
    elements stays), on both sides and in every layer of a per-layer format; a tiny block still fits its list."""
    f = get_format("k=int3:bchannel:asym:out64,v=int2:token:sym:out32,block=128,sink=4")
    for bs, (nk, nv) in ((4, (2, 1)), (32, (16, 8)), (128, (64, 32)), (256, (128, 64))):
        g = f.with_block_size(bs)
        assert (g.k.outliers, g.v.outliers, g.block_size) == (nk, nv, bs)
    layered = get_format("k=int3:bchannel:asym:out64,v=fp16,block=128,layers=int3:bchannel:asym:out64/fp16|int4:bchannel:asym/fp16")
    small = layered.with_block_size(16)
    assert [small.layer(i).k.outliers for i in range(2)] == [8, 0]
    from trtkv.cache_layout import PagedKVLayout

    PagedKVLayout(get_format(INT3_NUQ).with_block_size(4), 1, 32, 4, 2)  # out128 of a block of 128 fits a block of 4 x 32
