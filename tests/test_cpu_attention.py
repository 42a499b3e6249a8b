"""trtkv's CPU attention kernels (plugins/cpu_attention.c) against float64 references, and the torch engine's ``cpu``
attention against its torch ops.

* ``dequant`` / ``decode`` against ``trtkv.quant.dequantize`` in float64 and a naive per-row
  attention, for every storage dtype and scale granularity at odd sizes (head_dim 24, blocks of 5, 3 KV heads, GQA 3),
  permuted block tables, sequences holding 0 .. n blocks, NaN in every block no sequence owns (a read of one fails the
  test), sink rows, a sliding window, soft-capping and a window ring's first block;
* the engine: ``attention="cpu"`` gives the logits of ``attention="torch"`` on tiny models of every family (windows,
  soft-caps, rings, sinks, per-layer formats), prefill chunks and decode steps;
* where the kernels cannot be had: a one-line reason, ``auto`` takes the torch ops, ``cpu`` refuses in one line.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import FAMILIES, calibration_free, random_widths

from trtkv.cache_layout import PagedKVLayout, WindowRing
from trtkv.errors import TrtkvError
from trtkv.formats import fit_formats, get_format
from trtkv.models import load_model, model_info
from trtkv.plugins import cpu_attention as ca
from trtkv.quant import QuantizedTensor, TensorParams, dequantize, quantize, quantize_block
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.torch_engine import TorchEngine
from trtkv.runtime.verify import StaticBatch

# only a machine without any C compiler skips these; a compiler that fails on the source fails them
pytestmark = pytest.mark.skipif(ca._compiler() is None, reason="no C compiler on this machine")

H, D, BS, NB = 3, 24, 5, 13
FREE3, FREE2 = (calibration_free(n, D).spec() for n in ("int3", "int2"))  # the calibration-free 3- / 2-bit layouts at D
SPECS = [
    "fp16", "int8", "fp8", "int4", FREE3, FREE2, "int8-static",
    "k=int8:channel,v=int8:head",  # static per channel / per head
    "k=int4:g8:asym,v=int8:g12:asym",  # per token group, zero-points
    "k=int2:token:sym,v=int3:bchannel:sym,block=5",
    "k=fp8_e4m3:head,v=fp8_e4m3:channel",
    # nuq: codes index the layer's codebook (per layer for K, per KV head for V; see _params)
    "k=int3:bchannel:asym:nuq,v=int4:g8:sym:nuq,block=5", "k=int2:token:asym:nuq,v=int3:bchannel:sym:nuq,block=5",
    "k=int4:bchannel:asym:smooth,v=int8:token:sym:smooth,block=5",  # smoothing without a rotation (factors per channel)
]


def _format(spec: str):
    [fmt], _ = fit_formats([spec], D)
    return fmt.with_block_size(BS)


def _params(tf, g, which="k"):
    """A static format's random scales; a nuq format's random ascending codebook in code units, one per layer for keys
    ([levels]) and one per KV head for values ([H, levels]); a smoothed format's random factors [H, D]; None without any."""
    got = {}
    if tf.smooth:
        got["smooth"] = torch.rand(H, D, generator=g) + 0.5
    if tf.codebook:
        n = tf.codebook_levels
        got["codebook"] = torch.sort(torch.randn(n if which == "k" else (H, n), generator=g) * n / 3, -1).values
    if tf.is_static:
        shape = {"per_tensor": (), "per_head": (H,), "per_channel": (H, D)}[tf.granularity]
        got["scale"] = torch.rand(shape, generator=g) * 0.05 + 0.01
    return TensorParams(**got) if got else None


def _filled_pool(lay, which, params, g, owned):
    """A pool whose blocks in ``owned`` hold quantized random rows, every other block NaN / garbage codes."""
    tf = lay.tensor_format(which)
    pool = lay.allocate(which)
    x = torch.randn(NB, H, BS, D, generator=g) * 2
    if not tf.is_quantized:
        pool.data.copy_(x.half())
    else:
        qt = quantize_block(x, tf, params, head_axis=-3) if tf.is_block_wise else quantize(x, tf, params, head_axis=-3)
        pool.data.copy_(qt.codes)
        if pool.scale is not None:
            pool.scale.copy_(qt.scale)
        if pool.zero is not None:
            pool.zero.copy_(qt.zero)
    free = [b for b in range(NB) if b not in owned]
    for t in (pool.scale, pool.zero) if tf.is_quantized else (pool.data,):
        if t is not None:
            t[free] = float("nan")
    pool.tail.copy_(torch.randn(pool.tail.shape, generator=g).half())
    return pool


def _reference_rows(lay, which, pool, params, model_space=False):
    """Every pool block dequantized in float64, stored channel space (``model_space``: the transforms undone): [NB, H, BS, D]."""
    tf = lay.tensor_format(which)
    qt = QuantizedTensor(pool.data, pool.scale, pool.zero)
    p64 = None if params is None else TensorParams(scale=None if params.scale is None else params.scale.double(),
                                                   codebook=None if params.codebook is None else params.codebook.double(),
                                                   smooth=None if params.smooth is None else params.smooth.double())
    return dequantize(qt, tf, p64, head_axis=-3, dtype=torch.float64, transforms=model_space)


def _tables(g, batch=3):
    perm = torch.randperm(NB, generator=g)
    held = torch.tensor([4, 0, 3])[:batch]
    tables = torch.full((batch, 5), -1, dtype=torch.long)
    o = 0
    for b in range(batch):
        n = int(held[b])
        tables[b, :n] = perm[o : o + n]
        o += n
    return tables, held, {int(x) for x in tables[tables >= 0]}


@pytest.fixture
def threads(request):
    """torch's thread count for the test (the kernels split their work over it), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 4], indirect=True)  # 4 threads: the 9 [B, H] pairs in unequal shares
@pytest.mark.parametrize("spec", SPECS)
def test_dequant_matches_float64(spec, threads):
    g = torch.Generator().manual_seed(7)
    fmt = _format(spec)
    lay = PagedKVLayout(fmt, H, D, BS, NB, 3)
    tables, held, owned = _tables(g)
    nb = int(held.max())
    for which in ("k", "v"):
        tf = lay.tensor_format(which)
        params = _params(tf, g, which)
        pool = _filled_pool(lay, which, params, g, owned)
        ref = _reference_rows(lay, which, pool, params, model_space=True)  # the kernels undo the rotation
        want = torch.zeros(3, H, nb * BS, D, dtype=torch.float64)
        for b in range(3):
            for j in range(int(held[b])):
                want[b, :, j * BS : (j + 1) * BS] = ref[tables[b, j]]
        codec = ca.RowCodec.of(tf, params, H, D, BS)
        got = ca.dequant(codec, pool, tables, held, nb)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
        roomy = ca.dequant(codec, pool, tables, held, nb, rows=nb * BS + 3)  # rows left after them for the caller
        assert roomy.shape == (3, H, nb * BS + 3, D) and torch.equal(roomy[:, :, : nb * BS], got)


def test_dequant_takes_sink_rows_where_told():
    g = torch.Generator().manual_seed(3)
    fmt = _format("int4")
    lay = PagedKVLayout(fmt, H, D, BS, NB, 3)
    tables, held, owned = _tables(g)
    tf = lay.tensor_format("k")
    pool = _filled_pool(lay, "k", None, g, owned)
    codec = ca.RowCodec.of(tf, None, H, D, BS)
    sink = torch.randn(3, H, 2, D, generator=g)
    ok = torch.tensor([True, True, False])
    plain = ca.dequant(codec, pool, tables, held, 4)
    got = ca.dequant(codec, pool, tables, held, 4, sink, ok)
    assert torch.equal(got[0, :, :2], sink[0])  # sequence 0: its first two rows are the sink rows
    assert torch.equal(got[0, :, 2:], plain[0, :, 2:])
    assert torch.equal(got[2], plain[2])  # sink_ok False: the pool's rows
    assert torch.equal(got[1], torch.zeros_like(got[1]))  # no sealed block: no sink rows either


def _naive_decode(kref, vref, kpool, vpool, lay, tables, held, slots, open_len, q_pos, first_pos, q, qf, nk, nv, scaling,
                  window, softcap, sink, sink_ok):
    """One query group per (sequence, head), row by row in float64: (sealed part in stored space, the rest in model space)."""
    B, _, n, _ = q.shape
    out_s = torch.zeros(B, H, n, D, dtype=torch.float64)
    out_r = torch.zeros(B, H, n, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            keys = []  # (position, key, value, query, into the sealed part?)
            s = int(slots[b])
            use_sink = sink and int(held[b]) > 0 and bool(sink_ok[b])
            for j in range(int(held[b])):
                blk = int(tables[b, j])
                for t in range(BS):
                    pos = int(first_pos[b]) + j * BS + t
                    if j == 0 and t < sink and use_sink:
                        keys.append((pos, kpool.tail[s, h, BS + t].double(), vpool.tail[s, h, BS + t].double(), q, False))
                    else:
                        keys.append((pos, kref[blk, h, t], vref[blk, h, t], qf, True))
            base = (int(q_pos[b]) // BS) * BS
            for o in range(int(open_len[b])):
                keys.append((base + o, kpool.tail[s, h, o].double(), vpool.tail[s, h, o].double(), q, False))
            keys.append((int(q_pos[b]), nk[b, h].double(), nv[b, h].double(), q, False))
            for i in range(n):
                sc = []
                for pos, k, _, qq, _ in keys:
                    if window and pos <= int(q_pos[b]) - window:
                        sc.append(-math.inf)
                        continue
                    x = float(qq[b, h, i].double() @ k) * scaling
                    sc.append(softcap * math.tanh(x / softcap) if softcap else x)
                p = torch.tensor(sc, dtype=torch.float64).softmax(0)
                for w, (_, _, v, _, sealed) in zip(p, keys):
                    (out_s if sealed else out_r)[b, h, i] += w * v
    return out_s, out_r


@pytest.mark.parametrize("spec, window, softcap, ring", [
    ("int4", 0, 0.0, False),  # sink rows (int4 keeps 4; here fitted to the block of 5)
    ("int8", 9, 0.0, False),  # a window inside the sealed blocks
    ("fp16", 0, 3.0, False),  # soft-capping
    ("k=int4:g8:asym,v=int3:bchannel:sym,block=5", 7, 2.0, True),  # a ring view: column 0 starts past block 0
    ("fp8", 0, 0.0, False),
    # the scales folded into the query / the probabilities: static per channel keys and per head values; symmetric
    # per-block-channel keys with value groups that carry zero-points; asymmetric per-block-channel values
    ("k=int8:channel,v=int8:head", 0, 0.0, False),
    ("k=int4:bchannel:sym,v=int8:g12:asym,block=5", 5, 0.0, False),
    ("k=int3:bchannel:asym,v=int4:bchannel:asym,block=5", 0, 0.0, False),
    # codebooks: keys' per layer folded like any per-block-channel code, values' per KV head in token groups; a ring view
    ("k=int3:bchannel:asym:nuq,v=int4:g8:sym:nuq,block=5", 7, 0.0, True),
    ("k=int2:token:asym:nuq,v=int3:bchannel:asym:nuq,block=5", 0, 2.0, False),
])
def test_decode_matches_a_naive_float64_attention(spec, window, softcap, ring):
    g = torch.Generator().manual_seed(11)
    fmt = _format(spec)
    if fmt.sink_tokens:
        fmt = fmt.model_copy(update={"sink_tokens": 2})  # sink rows inside the block of 5
    lay = PagedKVLayout(fmt, H, D, BS, NB, 3)
    tables, held, owned = _tables(g)
    nb = int(held.max())
    kp, vp = (_params(lay.tensor_format(w), g, w) for w in "kv")
    kpool, vpool = _filled_pool(lay, "k", kp, g, owned), _filled_pool(lay, "v", vp, g, owned)
    kref, vref = _reference_rows(lay, "k", kpool, kp), _reference_rows(lay, "v", vpool, vp)
    kc, vc = ca.RowCodec.of(lay.tensor_format("k"), kp, H, D, BS), ca.RowCodec.of(lay.tensor_format("v"), vp, H, D, BS)
    slots = torch.tensor([2, 0, 1])
    first = torch.tensor([3, 0, 1]) if ring else torch.zeros(3, dtype=torch.long)  # the ring view's first sealed block
    open_len = torch.tensor([2, 4, 0])
    q_pos = (first + held) * BS + open_len
    sink_ok = first == 0
    step = ca.DecodeStep(tables, held, nb, slots, open_len, q_pos, first * BS, (q_pos // BS) * BS, sink_ok)
    n = 3
    q, qf = torch.randn(3, H, n, D, generator=g), torch.randn(3, H, n, D, generator=g)
    nk, nv = torch.randn(3, H, D, generator=g), torch.randn(3, H, D, generator=g)
    got_s, got_r = ca.decode(kc, vc, kpool, vpool, step, q, qf, nk, nv, 0.3, window or None, softcap or None, lay.sink_tokens)
    want_s, want_r = _naive_decode(kref, vref, kpool, vpool, lay, tables, held, slots, open_len, q_pos, first * BS, q, qf, nk, nv, 0.3,
                                   window, softcap, lay.sink_tokens, sink_ok)
    torch.testing.assert_close(got_s.double(), want_s, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_r.double(), want_r, rtol=1e-4, atol=1e-5)



@pytest.mark.parametrize("spec", ["int4", "k=int4:token:asym,v=int4:g8:sym", "int8"])
def test_wide_rows_take_the_vector_decoders(spec, monkeypatch):
    """A head dim of 72: two 32-channel passes of the vectorized int4 row decoder and a tail of 8 (the module's D of 24
    takes the tail loop only), against float64, in the dequant and in the decode with its folded scales."""
    monkeypatch.setitem(globals(), "D", 72)
    test_dequant_matches_float64(spec, torch.get_num_threads())
    test_decode_matches_a_naive_float64_attention(spec, 0, 0.0, False)



@pytest.mark.parametrize("spec", [calibration_free("int3", 64).spec(), calibration_free("int2", 64).spec(),
                                  "k=int3:bchannel:asym:nuq,v=int2:g16:sym:nuq,block=13", "k=int2:token:asym,v=int3:g32:asym"])
def test_long_blocks_take_the_batched_dots_and_the_32_channel_decoders(spec, monkeypatch):
    """Blocks of 13 rows at a head dim of 64: the score dots in batches of 8 rows and a remainder, the 2- and 1-bit
    planes spread 32 channels at a time (codebooks too), against float64 in the dequant and the decode."""
    monkeypatch.setitem(globals(), "D", 64)
    monkeypatch.setitem(globals(), "BS", 13)
    test_dequant_matches_float64(spec, torch.get_num_threads())
    test_decode_matches_a_naive_float64_attention(spec, 0, 0.0, False)


@pytest.mark.parametrize("spec", ["k=int4:bchannel:asym:smooth:hadamard,v=int4:g8:sym:smooth:hadamard,block=5,sink=2",
                                  "k=int8:token:asym:smooth,v=int8:bchannel:sym:hadamard,block=5", "fp16",
                                  "k=int3:bchannel:asym:smooth:hadamard:nuq,v=int3:g8:sym:hadamard:nuq,block=5,sink=2"])
def test_decode_in_model_space_applies_the_formats_transforms(spec):
    """decode_model_space (the transforms inside the kernel) against decode with the torch transforms around it: the
    query folded by trtkv.quant's rule ((q * smooth) @ H) and the sealed part undone by inverse_transform, then added."""
    from trtkv.attention.torch_ops import fold_query
    from trtkv.quant import inverse_transform

    g = torch.Generator().manual_seed(17)
    fmt = _format(spec)
    lay = PagedKVLayout(fmt, H, D, BS, NB, 3)
    tables, held, owned = _tables(g)
    params = {}
    for w in "kv":
        tf = lay.tensor_format(w)
        book = _params(tf, g, w).codebook if tf.codebook else None
        params[w] = TensorParams(smooth=torch.rand(H, D, generator=g) * 1.5 + 0.5 if tf.smooth else None, codebook=book)
    kpool, vpool = (_filled_pool(lay, w, params[w], g, owned) for w in "kv")
    kc, vc = (ca.RowCodec.of(lay.tensor_format(w), params[w], H, D, BS) for w in "kv")
    slots, open_len = torch.tensor([2, 0, 1]), torch.tensor([2, 4, 0])
    q_pos = held * BS + open_len
    step = ca.DecodeStep(tables, held, int(held.max()), slots, open_len, q_pos, torch.zeros(3, dtype=torch.long), (q_pos // BS) * BS)
    q = torch.randn(3, H, 3, D, generator=g)
    nk, nv = torch.randn(3, H, D, generator=g), torch.randn(3, H, D, generator=g)
    sealed, rest = ca.decode(kc, vc, kpool, vpool, step, q, fold_query(q, lay.tensor_format("k"), params["k"]), nk, nv, 0.3, None, None,
                             lay.sink_tokens)
    want = rest + inverse_transform(sealed, lay.tensor_format("v"), params["v"], head_axis=-3)
    got = ca.decode_model_space(kc, vc, kpool, vpool, step, q, nk, nv, 0.3, None, None, lay.sink_tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ outlier lists and keys stored before RoPE

# (spec, head_dim): the butterflies of the rotation in blocks of 8 with an AVX2 register (24 = 3 x 8), of 64 (the
# loops of strides >= 8) and of 4 (20: the scalar loop only); outliers on both sides, codebooks on the values
FEATURE_CASES = [
    ("k=int3:bchannel:asym:prerope:qsmooth:hadamard:out4,v=int3:g8:sym:hadamard:nuq:out3,block=5,sink=2", 24),
    ("k=int3:bchannel:asym:prerope:qsmooth:hadamard:out7,v=int3:g32:sym:hadamard:nuq,block=5", 64),
    ("k=int2:bchannel:asym:prerope:smooth:hadamard:out3,v=int2:token:sym:hadamard:nuq,block=5", 20),
    ("k=int2:bchannel:asym:prerope:out3,v=int4:g8:sym:out2,block=5", 24),  # prerope without transforms
    ("k=int4:bchannel:asym:out6,v=int8:bchannel:asym:out2,block=5,sink=2", 24),  # outliers only
    # the vector path (head_dim a multiple of 16): rows of 6 vectors, Hadamard blocks of 16; no rotation; head_dim 128
    ("k=int3:bchannel:asym:prerope:qsmooth:hadamard:out5,v=int3:g16:sym:hadamard,block=5,sink=2", 48),
    ("k=int2:bchannel:asym:prerope:smooth:out2,v=int4:g16:sym,block=5", 32),
    ("k=int4:bchannel:asym:prerope:hadamard:out3,v=int4:g32:sym:hadamard,block=3", 128),
    # allocB keys (random widths per channel): by vectors of 8 channels (rows of 9, 32 and 48 bytes, the padded copy
    # at a block's end), by codes (head_dim 20; rows of 2 bytes at head_dim 4); value outliers over per-token zero-points
    ("k=int8:bchannel:asym:prerope:alloc3:out3,v=int4:token:asym:out3,block=5,sink=2", 24),
    ("k=int8:bchannel:asym:prerope:alloc4:out3,v=int2:token:sym:hadamard:nuq:out2,block=5", 64),
    ("k=int4:bchannel:asym:alloc3:out2,v=int8:bchannel:asym:out2,block=5", 128),
    ("k=int8:bchannel:asym:prerope:alloc2:out2,v=int4:token:asym:out2,block=5", 20),
    ("k=int8:bchannel:asym:alloc4,v=int8:token:asym:out1,block=5", 4),
]


ROPE_HALVES_DIFFER = False  # set by a test: tables whose two halves differ (the kernels then read whole rows)


def _rope_table(P, d, g):
    """A RoPE table (cos, sin) [P, d] in the rotate-half layout with an attention scaling of 1.1 (the kernels must take
    the table's values as they are); its halves equal (every model's: the kernels read the first alone) unless
    ROPE_HALVES_DIFFER, then the second half's angles and scaling differ."""
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(P, dtype=torch.float64)[:, None] * inv[None, :]
    scale = torch.cat([torch.full((d // 2,), 1.1), torch.full((d // 2,), 0.9 if ROPE_HALVES_DIFFER else 1.1)]).double()
    ang = torch.cat([ang, ang * 1.3 if ROPE_HALVES_DIFFER else ang], -1)
    return (ang.cos() * scale).float(), (ang.sin() * scale).float()


def _feature_params(tf, g, d):
    book = torch.sort(torch.randn(H, tf.codebook_levels, generator=g) * tf.codebook_levels / 3, -1).values if tf.codebook else None
    return TensorParams(smooth=torch.rand(H, d, generator=g) + 0.5 if tf.smooth else None, codebook=book,
                        bits=random_widths(tf, H, d, g) if tf.allocated_bits is not None else None)


def _feature_pool(lay, which, params, g, block_pos, rope):
    """A pool of random blocks sealed as the runtime seals them (outlier lists, keys before RoPE at each block's first
    position ``block_pos`` [NB]), NaN scales in unowned blocks, and every block dequantized in float64 in model space
    (its rows rotated at their positions) and in stored space: (pool, model [NB, H, BS, d], stored [NB, H, BS, d])."""
    from trtkv.cache_layout import store_quantized

    tf = lay.tensor_format(which)
    d = lay.head_dim
    pool = lay.allocate(which)
    x = torch.randn(NB, H, BS, d, generator=g) * 2
    x[:, :, 1, 3] += 9.0  # an element an outlier list keeps
    pos = block_pos[:, None] + torch.arange(BS)
    cos, sin = rope[0][pos][:, None], rope[1][pos][:, None]
    qt = quantize_block(x, tf, params, head_axis=-3, rope=(cos, sin) if tf.pre_rope else None)
    store_quantized(pool, torch.arange(NB), qt, tf)
    p64 = params.map(torch.Tensor.double)
    model = dequantize(qt, tf, p64, head_axis=-3, dtype=torch.float64, rope=(cos.double(), sin.double()) if tf.pre_rope else None)
    stored = dequantize(qt, tf, p64, head_axis=-3, dtype=torch.float64, transforms=False)
    pool.tail.copy_(torch.randn(pool.tail.shape, generator=g).half())
    return pool, model, stored


def _feature_setup(spec, d, g, ring):
    [fmt], _ = fit_formats([spec], d)
    lay = PagedKVLayout(fmt.with_block_size(BS), H, d, BS, NB, 3)
    tables, held, owned = _tables(g)
    first = torch.tensor([3, 0, 1]) if ring else torch.zeros(3, dtype=torch.long)  # a ring view's first sealed block
    block_pos = torch.zeros(NB, dtype=torch.long)
    for b in range(3):
        for j in range(int(held[b])):
            block_pos[tables[b, j]] = (first[b] + j) * BS
    rope = _rope_table(int(block_pos.max()) + 4 * BS, d, g)
    params = {w: _feature_params(lay.tensor_format(w), g, d) for w in "kv"}
    pools = {w: _feature_pool(lay, w, params[w], g, block_pos, rope) for w in "kv"}
    for w in "kv":
        free = [blk for blk in range(NB) if blk not in owned]
        pools[w][0].scale[free] = float("nan")  # a read of a block nobody owns fails the test
    return lay, tables, held, first, rope, params, pools


@pytest.mark.parametrize("spec, d", FEATURE_CASES)
def test_dequant_reads_outliers_and_keys_before_rope(spec, d, monkeypatch):
    """``dequant`` of outN / prerope formats against float64 ``dequantize``: outliers written over the codes, keys stored
    before RoPE back in model space at their sequences' positions (a ring view's too), sink rows taken as given after
    that; a missing or short RoPE table is refused in one line."""
    monkeypatch.setitem(globals(), "D", d)
    g = torch.Generator().manual_seed(23)
    lay, tables, held, first, rope, params, pools = _feature_setup(spec, d, g, ring=True)
    nb = int(held.max())
    sink = torch.randn(3, H, 2, d, generator=g)
    for w in "kv":
        tf = lay.tensor_format(w)
        pool, ref, _ = pools[w]  # model space: transforms undone, keys stored before RoPE rotated at their positions
        want = torch.zeros(3, H, nb * BS, d, dtype=torch.float64)
        for b in range(3):
            for j in range(int(held[b])):
                want[b, :, j * BS : (j + 1) * BS] = ref[tables[b, j]]
        codec = ca.RowCodec.of(tf, params[w], H, d, BS)
        got = ca.dequant(codec, pool, tables, held, nb, first_pos=first * BS, rope=rope)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        with_sink = ca.dequant(codec, pool, tables, held, nb, sink, torch.ones(3, dtype=torch.bool), first_pos=first * BS, rope=rope)
        assert torch.equal(with_sink[0, :, :2], sink[0]) and torch.equal(with_sink[0, :, 2:], got[0, :, 2:])
        if tf.pre_rope:
            with pytest.raises(TrtkvError, match="RoPE table") as e:
                ca.dequant(codec, pool, tables, held, nb)
            assert "\n" not in str(e.value)
            short = tuple(t[: int((first * BS + held * BS).max()) - 1] for t in rope)
            with pytest.raises(TrtkvError, match="covers positions below"):
                ca.dequant(codec, pool, tables, held, nb, first_pos=first * BS, rope=short)


@pytest.mark.parametrize("spec, d", FEATURE_CASES)
@pytest.mark.parametrize("ring", [False, True])
def test_decode_reads_outliers_and_keys_before_rope(spec, d, ring, monkeypatch):
    """``decode_model_space`` of outN / prerope formats against a naive float64 attention over the float64 model-space
    rows (keys rotated at their positions, outliers restored), with sink rows, a window and a ring view's positions."""
    monkeypatch.setitem(globals(), "D", d)
    g = torch.Generator().manual_seed(29)
    lay, tables, held, first, rope, params, pools = _feature_setup(spec, d, g, ring)
    (kpool, kmodel, _), (vpool, vmodel, _) = pools["k"], pools["v"]
    kc, vc = (ca.RowCodec.of(lay.tensor_format(w), params[w], H, d, BS) for w in "kv")
    slots, open_len = torch.tensor([2, 0, 1]), torch.tensor([2, 4, 0])
    q_pos = (first + held) * BS + open_len
    sink_ok = first == 0
    step = ca.DecodeStep(tables, held, int(held.max()), slots, open_len, q_pos, first * BS, (q_pos // BS) * BS, sink_ok, rope)
    q = torch.randn(3, H, 3, d, generator=g)
    nk, nv = torch.randn(3, H, d, generator=g), torch.randn(3, H, d, generator=g)
    window = 9 if ring else 0
    got = ca.decode_model_space(kc, vc, kpool, vpool, step, q, nk, nv, 0.3, window or None, None, lay.sink_tokens)
    want_s, want_r = _naive_decode(kmodel, vmodel, kpool, vpool, lay, tables, held, slots, open_len, q_pos, first * BS, q, q, nk, nv,
                                   0.3, window, 0.0, lay.sink_tokens, sink_ok)
    torch.testing.assert_close(got.double(), want_s + want_r, rtol=1e-4, atol=1e-5)
    if lay.tensor_format("k").pre_rope:
        with pytest.raises(TrtkvError, match="RoPE table"):
            bare = ca.DecodeStep(tables, held, int(held.max()), slots, open_len, q_pos, first * BS, (q_pos // BS) * BS, sink_ok)
            ca.decode_model_space(kc, vc, kpool, vpool, bare, q, nk, nv, 0.3)


@pytest.mark.parametrize("spec, d", [c for c in FEATURE_CASES if "prerope" in c[0]])
def test_a_rope_table_with_unequal_halves_is_read_whole(spec, d, monkeypatch):
    """The kernels read the first half of a RoPE table whose halves are equal (every supported model's), else whole
    rows: keys before RoPE against float64 with a table whose halves differ, in the dequant and the decode."""
    monkeypatch.setitem(globals(), "ROPE_HALVES_DIFFER", True)
    cos, sin = _rope_table(9, d, None)
    assert ca._rope((cos, sin))[2:] == (d, d // 2) and not torch.equal(cos[:, : d // 2], cos[:, d // 2 :])
    monkeypatch.setitem(globals(), "ROPE_HALVES_DIFFER", False)
    half = ca._rope(_rope_table(9, d, None))
    assert half[2:] == (d // 2, 0) and half[0].shape == (9, d // 2)
    with torch.inference_mode():  # the engine's table: inference tensors, read once per table object
        table = _rope_table(9, d, None)
        assert ca._rope(table) is ca._rope(table) and ca._rope(tuple(t.clone() for t in table)) is not ca._rope(table)
    monkeypatch.setitem(globals(), "ROPE_HALVES_DIFFER", True)
    test_dequant_reads_outliers_and_keys_before_rope(spec, d, monkeypatch)
    test_decode_reads_outliers_and_keys_before_rope(spec, d, True, monkeypatch)


# ---------------------------------------------------------------------------------------------- the engine


def _logits(engine, cache, prompts, new_tokens):
    sb = StaticBatch(cache, len(prompts))
    steps = [sb.prefill(engine, prompts)]
    for _ in range(new_tokens):
        nxt = steps[-1].argmax(-1)
        steps.append(sb.step(engine, {i: [int(nxt[i])] for i in range(len(prompts))}))
    return torch.stack(steps, 1)


@pytest.mark.parametrize("name, kv, ring", [
    # Gemma 3 in fp16: its norms amplify a float-rounding flip of one int4 code at a seal into 1e-2 .. 1e-1 (the
    # kernels' decode is checked against float64 above; test_window_ring.py says the same of the ring)
    ("mistral-sw", "int4", True), ("qwen2-sw", "int8", False), ("gemma2", "int4", False), ("gemma3", "fp16", True),
    ("phi3", "fp16", False), ("qwen3", calibration_free("int3", 128).spec(), False), ("mistral-sw", "k=int4:g8:asym,v=int2:token:asym", False),
])
def test_engine_cpu_attention_gives_the_torch_ops_logits(family, name, kv, ring):
    d, _ = family(name)
    info = model_info(str(d))
    model = load_model(str(d), device="cpu", dtype="float32").model
    [fmt], _ = fit_formats([kv], info.head_dim)
    bs = 4
    results = {}
    for attention in ("torch", "cpu"):
        lay = PagedKVLayout(fmt.with_block_size(bs), info.num_kv_heads, info.head_dim, bs, 40, 2)
        cache = PagedKVCache(lay, info.num_layers, ring=WindowRing.of(info, bs) if ring else None)
        engine = TorchEngine(model, attention=attention, device="cpu")
        results[attention] = _logits(engine, cache, [list(range(3, 30)), list(range(40, 51))], 9)
    torch.testing.assert_close(results["cpu"], results["torch"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", ["k=int3:bchannel:asym:qsmooth:hadamard,v=int3:g8:sym:hadamard:nuq,block=4,sink=1",
                                  "k=int2:bchannel:asym:nuq,v=int2:token:asym:nuq,block=4"])
def test_engine_serves_codebook_formats_like_the_eval_cache(tiny_models, spec):
    """A nuq format through the torch engine's C kernels (prefill chunks, then decodes; the pool's seal snaps to the
    nearest level with the reference quantizer) gives the eval cache's teacher-forced logits for the same tokens, and
    so do the torch ops (they dequantize the sealed rows through the codebook)."""
    from conftest import random_kv_params

    from trtkv.evaluate import model_logits

    d, _ = tiny_models("llama", num_hidden_layers=2)
    info = model_info(str(d))
    model = load_model(str(d), device="cpu", dtype="float32").model
    [fmt], _ = fit_formats([spec], info.head_dim)
    H, hd = info.num_kv_heads, info.head_dim
    params = random_kv_params(fmt, H, hd, info.num_layers, seed=31, key_books_per_layer=True)
    prompts = [list(range(3, 22)), list(range(40, 59))]
    lay = PagedKVLayout(fmt, H, hd, 4, 40, 2)
    got = _logits(TorchEngine(model, attention="cpu", device="cpu"), PagedKVCache(lay, info.num_layers, params), prompts, 7)
    ids = torch.tensor([p + got[i, :-1].argmax(-1).tolist() for i, p in enumerate(prompts)])
    with torch.inference_mode():
        want = model_logits(model, ids, fmt, params)[:, len(prompts[0]) - 1 :]
    torch.testing.assert_close(got, want, rtol=0, atol=5e-4)
    ops = _logits(TorchEngine(model, attention="torch", device="cpu"), PagedKVCache(lay, info.num_layers, params), prompts, 7)
    torch.testing.assert_close(ops, want, rtol=0, atol=5e-4)


def test_engine_cpu_attention_with_a_per_layer_format(tiny_models):
    d, _ = tiny_models("llama", num_hidden_layers=3)
    info = model_info(str(d))
    model = load_model(str(d), device="cpu", dtype="float32").model
    from trtkv.formats import KVFormat, LayerStorage

    fitted, _ = fit_formats(["int8", "int4", calibration_free("int2", info.head_dim)], info.head_dim)
    int8, int4, int2 = (f.with_block_size(4) for f in fitted)
    layers = (LayerStorage(k=int8.k, v=int4.v), LayerStorage(k=int4.k, v=int2.v), LayerStorage(k=get_format("fp16").k, v=int8.v))
    fmt = KVFormat(name="mixed", k=layers[0].k, v=layers[0].v, block_size=4, sink_tokens=1, layers=layers)
    results = {}
    for attention in ("torch", "cpu"):
        lay = PagedKVLayout(fmt.with_block_size(4), info.num_kv_heads, info.head_dim, 4, 40, 2)
        engine = TorchEngine(model, attention=attention, device="cpu")
        results[attention] = _logits(engine, PagedKVCache(lay, info.num_layers), [list(range(3, 30)), list(range(40, 51))], 6)
    torch.testing.assert_close(results["cpu"], results["torch"], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- unavailable


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """The library looked up again, compiled into an empty cache; restored afterwards."""
    monkeypatch.setenv("TRTKV_CACHE", str(tmp_path / "cache"))
    ca._library.cache_clear()
    yield
    ca._library.cache_clear()


def test_no_compiler_is_one_line_and_auto_takes_the_torch_ops(fresh_library, monkeypatch, tiny_models):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", "/nonexistent")
    reason = ca.unavailable()
    assert reason and "compiler" in reason and "\n" not in reason
    _, model = tiny_models("llama")
    assert TorchEngine(model, device="cpu").attention == "torch"
    with pytest.raises(TrtkvError, match="CPU attention kernels are unavailable") as info:
        TorchEngine(model, attention="cpu", device="cpu")
    assert "\n" not in str(info.value)


def test_a_failing_compile_is_one_line_and_leaves_no_library(fresh_library, monkeypatch, tmp_path):
    bad = tmp_path / "badcc"
    bad.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo badcc 1.0 && exit 0\necho 'x.c:1: error: no' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CC", str(bad))
    reason = ca.unavailable()
    assert reason.startswith("compiling cpu_attention.c with") and "error" in reason and "\n" not in reason
    assert not list((tmp_path / "cache" / "cpu-kernels").glob("*.so"))


def test_a_compiler_without_openmp_builds_a_one_thread_library(fresh_library, monkeypatch, tmp_path):
    """-fopenmp refused: the library is built without it, links no OpenMP runtime, and its decode split over threads
    still gives the one-thread result (the ranges run one after the other)."""
    real = ca._compiler()
    cc = tmp_path / "noompcc"
    cc.write_text(f"#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = -fopenmp ] && echo 'cc: error: unsupported option -fopenmp' >&2 && exit 1; done\n"
                  f"exec {real} \"$@\"\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    assert ca.unavailable() is None
    built = list((tmp_path / "cache" / "cpu-kernels").glob("cpu_attention-*.so"))
    assert len(built) == 1 and b"GOMP_parallel" not in built[0].read_bytes()
    test_decode_split_over_threads_is_the_one_thread_result("int4", 3)


def test_switched_off_by_the_environment(fresh_library, monkeypatch):
    monkeypatch.setenv("TRTKV_CPU_KERNELS", "0")
    assert ca.unavailable() == "TRTKV_CPU_KERNELS=0"


def test_compiled_once_into_the_cache(fresh_library, tmp_path):
    assert ca.unavailable() is None
    built = list((tmp_path / "cache" / "cpu-kernels").glob("cpu_attention-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    ca._library.cache_clear()
    assert ca.unavailable() is None and built[0].stat().st_mtime_ns == mtime  # found, not rebuilt


def test_refuses_a_non_cpu_pool():
    fmt = _format("int8")
    lay = PagedKVLayout(fmt, H, D, BS, NB, 3)
    pool = lay.allocate("k")
    pool.data = pool.data.transpose(1, 2)  # not contiguous
    codec = ca.RowCodec.of(lay.tensor_format("k"), None, H, D, BS)
    with pytest.raises(TrtkvError, match="contiguous CPU pools"):
        ca.dequant(codec, pool, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 1)


assert set(FAMILIES) >= {"mistral-sw", "qwen2-sw", "gemma2", "gemma3", "phi3", "qwen3"}


def test_auto_takes_the_cpu_kernels_on_cpu(tiny_models):
    _, model = tiny_models("llama")
    assert TorchEngine(model, device="cpu").attention == "cpu"


# ---------------------------------------------------------------------------------------------- the seal


@pytest.mark.parametrize("threads", [1, 4], indirect=True)  # 4 threads: 18 (block, head) slabs in unequal shares
@pytest.mark.parametrize("spec", ["int8", "int4", FREE3, FREE2, "k=int4:g8:asym,v=int8:g12:asym", "k=int8:token:asym,v=int2:token:sym",
                                  "k=int3:bchannel:sym,v=int4:token:asym,block=5"])
def test_the_c_seal_writes_the_reference_quantizers_bytes(spec, threads):
    from trtkv.quant import forward_transform

    g = torch.Generator().manual_seed(13)
    fmt = _format(spec)
    for tf in (fmt.k, fmt.v):
        for clip in (None, torch.tensor(0.9), torch.tensor([0.8, 1.0, 0.95])):
            params = TensorParams(clip=clip, smooth=torch.rand(H, D, generator=g) + 0.5) if clip is not None else None
            if params is not None and not tf.smooth:
                params = TensorParams(clip=clip)
            codec = ca.SealCodec.of(tf, params, H, D, BS)
            assert codec is not None
            x = torch.randn(6, H, BS, D, generator=g) * 3
            x[2] = 0.0  # an all-zero block: scale 0
            x[3, 1] = 1.5  # a constant head: range 0
            x[4, 0, :, :3] = 7.25  # ties at code boundaries
            ref = quantize_block(x, tf, params, head_axis=-3)
            got = ca.seal(codec, forward_transform(x, tf, params, head_axis=-3))
            assert got.codes.dtype == ref.codes.dtype and torch.equal(got.codes, ref.codes), (spec, tf.short(), clip)
            assert torch.equal(got.scale, ref.scale) and (ref.zero is None) == (got.zero is None)
            assert ref.zero is None or torch.equal(got.zero, ref.zero)


@pytest.mark.parametrize("threads", [1, 3], indirect=True)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_the_c_seal_refuses_nan_and_inf_in_one_line(bad, threads):
    """The C seal checks every element as it reads (the pool no longer runs ``check_finite`` before it): a NaN or inf in
    any (block, head) slab -- the first, the last -- is the reference quantizer's one-line error, from ``seal`` and from
    the pool's write, which then stores nothing."""
    from trtkv.runtime.step import StepBatch, StepOutput

    fmt = _format("int4")
    codec = ca.SealCodec.of(fmt.k, None, H, D, BS)
    for slab in [(0, 0), (5, H - 1)]:
        x = torch.randn(6, H, BS, D)
        x[slab][BS - 1, D - 1] = bad
        with pytest.raises(TrtkvError, match="NaN or inf") as e:
            ca.seal(codec, x)
        assert "\n" not in str(e.value) and e.value.fix
    cache = PagedKVCache(PagedKVLayout(fmt, H, D, BS, NB, 1), 1)
    k = torch.randn(1, 1, BS, H, D).half()
    k[0, 0, 2, 1, 3] = bad
    before = {name: t.clone() for name, t in cache.tensors.items() if "tail" not in name}
    with pytest.raises(TrtkvError, match="NaN or inf"):
        cache.write_new_rows(StepBatch.make([[0] * BS], [0], [[3, 4]], [0]), StepOutput(None, k, -k.abs()))
    assert all(torch.equal(t, cache.tensors[name]) for name, t in before.items())


_GUARD_PAGE_READ = """
import ctypes, mmap, torch
from trtkv.formats import parse_tensor_spec
from trtkv.plugins import cpu_attention as ca
from trtkv.quant import TensorParams, quantize_block
g = torch.Generator().manual_seed(3)
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
page = mmap.PAGESIZE
for spec, d in {cases!r}:
    tf = parse_tensor_spec(spec)
    params = TensorParams(bits=torch.full((2, d), float(tf.allocated_bits)))  # every row ends in a code
    qt = quantize_block(torch.randn(3, 2, 5, d, generator=g), tf, params, head_axis=-3)
    want = ca.dequant_blocks(ca.RowCodec.of(tf, params, 2, d, 5), qt, 3)
    m = mmap.mmap(-1, 2 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    assert libc.mprotect(base + page, page, 0) == 0  # PROT_NONE: any read past the codes faults
    end = torch.frombuffer(m, dtype=torch.uint8)[page - qt.codes.numel() : page]  # the codes' last byte ends the page
    qt.codes = end.view(qt.codes.shape).copy_(qt.codes)
    got = ca.dequant_blocks(ca.RowCodec.of(tf, params, 2, d, 5), qt, 3)
    assert torch.equal(got, want), spec
print("read within the pool")
"""


def test_alloc_rows_are_never_read_past_the_pool():
    """The allocB decoders load more bytes than a code needs (16 for 8 channels, 4 for one): the rows of the pool's last
    block that such a load would carry past the pool are read from a padded copy (vectors) or byte by byte (codes). A
    pool whose codes end where an unreadable page starts decodes as before, in a child process (a fault would kill it):
    rows of 9 bytes by vectors, of 5 and of 2 bytes by codes."""
    import subprocess
    import sys

    cases = [("int8:bchannel:asym:alloc3", 24), ("int8:bchannel:asym:alloc2", 20), ("int8:bchannel:asym:alloc4", 4)]
    script = _GUARD_PAGE_READ.format(cases=cases)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "read within the pool" in run.stdout, (run.returncode, run.stderr[-2000:])


@pytest.mark.parametrize("threads", [1, 4], indirect=True)
@pytest.mark.parametrize("spec", ["int4", FREE3, "k=int3:bchannel:asym:nuq,v=int4:g8:sym:nuq,block=5"] + [s for s, d in FEATURE_CASES if d == D])
def test_dequant_blocks_reads_a_seals_blocks_like_float64(spec, threads):
    """``dequant_blocks`` (a step across blocks reads back the blocks it seals): the seal's n blocks per sequence, in
    order, as ``dequantize`` in float64 -- model space, keys stored before RoPE rotated at each sequence's
    positions (``first_pos``), outliers written over the codes, codebooks looked up."""
    g = torch.Generator().manual_seed(31)
    [fmt], _ = fit_formats([spec], D)
    fmt = fmt.with_block_size(BS)
    B, n = 3, 2
    first = torch.tensor([0, 2 * BS, 7 * BS])
    rope = _rope_table(int(first.max()) + n * BS, D, g)
    for which in ("k", "v"):
        tf = fmt.k if which == "k" else fmt.v
        params = _feature_params(tf, g, D)
        pos = (first[:, None] + torch.arange(n)[None, :] * BS).reshape(-1)[:, None] + torch.arange(BS)  # [B * n, BS]
        cos, sin = rope[0][pos][:, None], rope[1][pos][:, None]
        x = torch.randn(B * n, H, BS, D, generator=g) * 2
        x[:, :, 1, 3] += 9.0
        qt = quantize_block(x, tf, params, head_axis=-3, rope=(cos, sin) if tf.pre_rope else None)
        p64 = params.map(torch.Tensor.double)
        want = dequantize(qt, tf, p64, head_axis=-3, dtype=torch.float64, rope=(cos.double(), sin.double()) if tf.pre_rope else None)
        want = want.view(B, n, H, BS, D).transpose(1, 2).reshape(B, H, n * BS, D)
        got = ca.dequant_blocks(ca.RowCodec.of(tf, params, H, D, BS), qt, B, first_pos=first, rope=rope)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec, why", [("fp16", "not an integer"), ("fp8", "not an integer"), ("int8-static", "static"),
                                       ("k=int4:bchannel:asym:mse,v=int4:token:sym,block=5", "mse")])
def test_the_c_seal_leaves_other_formats_to_the_reference(spec, why):
    fmt = _format(spec)
    assert why in ca.SealCodec.reason(fmt.k) and ca.SealCodec.of(fmt.k, None, H, D, BS) is None


def test_the_pool_seals_with_the_reference_without_the_kernels(fresh_library, monkeypatch):
    from trtkv.runtime.step import StepBatch, StepOutput

    fmt = _format("int4").model_copy(update={"sink_tokens": 1})
    lay = PagedKVLayout(fmt, H, D, BS, NB, 2)
    k = (torch.randn(2, 2, 2 * BS + 1, H, D) * 2).half()
    caches = []
    for off in ("1", "0"):
        monkeypatch.setenv("TRTKV_CPU_KERNELS", off)
        ca._library.cache_clear()
        cache = PagedKVCache(lay, 2)
        assert cache.sealer.name == ("cpu" if off == "1" else "torch")  # auto's choice on the CPU
        cache.write_new_rows(StepBatch.make([[0] * (2 * BS + 1)] * 2, [0, 0], [[3, 4, 5], [6, 7, 8]], [0, 1]), StepOutput(None, k, -k))
        caches.append(cache)
    for name, t in caches[0].tensors.items():
        assert torch.equal(caches[1].tensors[name], t), name


@pytest.mark.parametrize("threads", [2, 3, 5, 64])
@pytest.mark.parametrize("spec", ["int4", "k=int4:g8:asym,v=int3:bchannel:sym,block=5"])
def test_decode_split_over_threads_is_the_one_thread_result(spec, threads):
    """The [B, H] pairs split over POSIX threads (uneven sequences: ranges of equal rows read; more threads than pairs
    included): every pair's output bit for bit the one-thread call's, and the naive float64 attention's."""
    prev = torch.get_num_threads()
    outs = []
    try:
        for t in (1, threads):
            torch.set_num_threads(t)
            g = torch.Generator().manual_seed(5)
            lay = PagedKVLayout(_format(spec), H, D, BS, NB, 3)
            tables, held, owned = _tables(g)
            kp, vp = (_params(lay.tensor_format(w), g, w) for w in "kv")
            kpool, vpool = _filled_pool(lay, "k", kp, g, owned), _filled_pool(lay, "v", vp, g, owned)
            kc, vc = ca.RowCodec.of(lay.tensor_format("k"), kp, H, D, BS), ca.RowCodec.of(lay.tensor_format("v"), vp, H, D, BS)
            slots, open_len = torch.tensor([2, 0, 1]), torch.tensor([2, 4, 0])
            q_pos, first = held * BS + open_len, torch.zeros(3, dtype=torch.long)
            step = ca.DecodeStep(tables, held, int(held.max()), slots, open_len, q_pos, first, (q_pos // BS) * BS, first == 0)
            q, nk, nv = torch.randn(3, H, 3, D, generator=g), torch.randn(3, H, D, generator=g), torch.randn(3, H, D, generator=g)
            outs.append(ca.decode(kc, vc, kpool, vpool, step, q, q, nk, nv, 0.3, None, None, lay.sink_tokens))
    finally:
        torch.set_num_threads(prev)
    kref, vref = _reference_rows(lay, "k", kpool, kp), _reference_rows(lay, "v", vpool, vp)
    want = _naive_decode(kref, vref, kpool, vpool, lay, tables, held, slots, open_len, q_pos, first, q, q, nk, nv, 0.3, 0, 0.0,
                         lay.sink_tokens, first == 0)
    for got, one, ref in zip(outs[1], outs[0], want):
        assert torch.equal(got, one)
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)
