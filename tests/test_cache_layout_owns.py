"""``PagedKVLayout`` owns the cache: byte counts, allocation, tail (open block / sink) rows, symbolic shapes and the
rows a seal quantizes -- each against an independent count from the format's definition (naive loops over heads,
tokens and channels) or a hand slice, on odd geometries."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trtkv.cache_layout import PagedKVLayout, WindowRing, open_block_to_seal
from trtkv.formats import CALIBRATION_FREE, fit_formats, get_format
from trtkv.runtime.kv_pool import PagedKVCache

# bits per stored code and per fp16 scale / zero-point / tail value, as docs/kv-formats.md defines the storage dtypes
CODE_BITS = {"fp16": 16, "fp8_e4m3": 8, "int8": 8, "int4": 4, "int3": 3, "int2": 2}
FP16_BITS = 16

# (format, kv heads, head_dim, block size): int4 / int3 / int2 / fp8 / int8 / fp16, static and per-token, groups,
# zero-points, sinks, at odd head dims where the format allows them (int8 / fp8 / fp16 any, int4 even, int2 4k, int3 8k)
CASES = [
    ("k=int8:token,v=int8:token", 3, 25, 16),
    ("k=fp8:token,v=fp8:tensor", 2, 27, 8),
    ("int4", 2, 34, 16),
    ("k=int3:bchannel:asym:hadamard,v=int3:g20:sym:hadamard,block=64,sink=4", 1, 40, 16),  # bit planes
    (CALIBRATION_FREE["int2"], 3, 36, 16),
    ("int8", 2, 48, 32),
    ("k=int8:g8:asym,v=int4:token:asym", 3, 24, 4),
    ("fp16", 1, 19, 4),
    ("int8-static", 2, 21, 8),
    ("k=int4:bchannel:asym,v=int2:g4:asym,block=8,sink=3", 2, 20, 8),
    ("k=int8:head,v=int4:g6:asym", 5, 18, 4),
]
PER_LAYER = ("k=int4:bchannel:asym,v=int8:token:sym,block=16,sink=4,"
             "layers=int4:bchannel:asym/int8:token:sym|int2:bchannel:asym/int2:token:asym|int3:bchannel:asym/fp16|int4:bchannel:asym/int8:token:sym")


def _layout(spec, H, D, bs, num_blocks=5, num_slots=3) -> PagedKVLayout:
    [fmt], _ = fit_formats([spec], D)
    return PagedKVLayout(fmt.with_block_size(bs), H, D, bs, num_blocks, num_slots)


def naive_block_bits(t, H: int, bs: int, D: int) -> tuple[int, int]:
    """(code bits, scale + zero-point bits) of one sealed block of K or V, counted value by value."""
    codes = 0
    for _h in range(H):
        for _tok in range(bs):
            for _c in range(D):
                codes += CODE_BITS[t.dtype]
    if t.granularity == "per_block_channel":  # a scale per head and channel, over the block's tokens
        scales = sum(1 for _h in range(H) for _c in range(D))
    elif t.granularity == "per_token":
        scales = sum(1 for _h in range(H) for _tok in range(bs))
    elif t.granularity == "per_token_group":
        scales = sum(1 for _h in range(H) for _tok in range(bs) for _c in range(0, D, t.group_size))
    else:  # fp16 stores none; static scales are per-layer constants, not pool tensors
        scales = 0
    per = 1 if t.symmetric else 2  # a zero-point beside each scale
    return codes, scales * per * FP16_BITS


def naive_tail_bits(H: int, rows: int, D: int) -> int:
    """One slot's tail of K or V: ``rows`` fp16 rows per head."""
    return sum(FP16_BITS for _h in range(H) for _r in range(rows) for _c in range(D))


@pytest.mark.parametrize("spec,H,D,bs", CASES)
def test_byte_counts_match_a_naive_count(spec, H, D, bs):
    lay = _layout(spec, H, D, bs)
    fmt = lay.fmt
    block = 0
    for which in ("k", "v"):
        codes, scales = naive_block_bits(getattr(fmt, which), H, bs, D)
        assert (codes + scales) % 8 == 0
        assert lay.tensor_bytes_per_block(which) == (codes + scales) // 8
        block += (codes + scales) // 8
    assert lay.bytes_per_block() == block
    assert lay.bytes_per_token() == block / bs
    # the format's own amortised accounting (bits per element) agrees
    assert lay.bytes_per_token() == pytest.approx(fmt.kv_bytes_per_token(1, H, D), rel=1e-12)
    rows = bs + fmt.sink_tokens
    tail = 2 * naive_tail_bits(H, rows, D) // 8
    assert lay.tail_rows == rows and lay.tail_bytes_per_slot() == tail
    assert lay.pool_bytes() == lay.num_blocks * block + lay.num_slots * tail


@pytest.mark.parametrize("spec,H,D,bs", CASES)
@pytest.mark.parametrize("layers", [None, 3])
def test_allocation_is_the_layout(spec, H, D, bs, layers):
    lay = _layout(spec, H, D, bs, num_blocks=7, num_slots=2)
    n = 1 if layers is None else layers
    total = 0
    for which in ("k", "v"):
        t = getattr(lay.fmt, which)
        pool = lay.allocate(which, layers=layers)
        lead = (7,) if layers is None else (layers, 7)
        assert tuple(pool.data.shape) == lay.data_shape(which, layers=layers) == (*lead, H, bs, lay.packed_dim(which))
        assert pool.data.dtype == lay.data_dtype(which)
        codes, scales = naive_block_bits(t, H, bs, D)
        assert pool.data.numel() * pool.data.element_size() * 8 == n * 7 * codes
        meta = sum(x.numel() * x.element_size() for x in (pool.scale, pool.zero) if x is not None)
        assert meta * 8 == n * 7 * scales
        for x, shape in ((pool.scale, lay.scale_shape(which, layers=layers)), (pool.zero, lay.zero_shape(which, layers=layers))):
            assert (x is None) == (shape is None)
            if x is not None:
                assert tuple(x.shape) == shape and x.dtype == torch.float16 and not x.any()
        assert (pool.zero is None) == (t.symmetric or not t.is_dynamic)
        assert tuple(pool.tail.shape) == lay.tail_shape(layers=layers) == (*lead[:-1], 2, H, bs + lay.fmt.sink_tokens, D)
        assert pool.tail.dtype == torch.float16 and not pool.tail.any() and not pool.data.any()
        assert lay.allocate(which, layers=layers, tail=False).tail is None
        total += sum(x.numel() * x.element_size() for x in (pool.data, pool.scale, pool.zero, pool.tail) if x is not None)
    assert total == n * lay.pool_bytes()


@pytest.mark.parametrize("ring", [False, True])
def test_paged_cache_allocates_what_the_layouts_count(ring):
    """A per-layer format (int4 / int2 / int3-fp16 layers) in PagedKVCache, with and without a window ring: every tensor
    the layout's, and the bytes the naive count of each layer's storage."""
    H, D, bs, nb, ns, L = 2, 32, 16, 9, 3, 4
    lay = PagedKVLayout(get_format(PER_LAYER), H, D, bs, nb, ns)
    r = WindowRing((1, 3), 40, bs) if ring else None
    cache = PagedKVCache(lay, L, ring=r)
    want = 0
    for i in range(L):
        f = lay.fmt.layer(i)
        blocks = ns * r.ring_blocks if r is not None and i in r.layers else nb
        want += blocks * sum(sum(naive_block_bits(t, H, bs, D)) for t in (f.k, f.v)) // 8
        want += ns * 2 * naive_tail_bits(H, bs + 4, D) // 8
        assert cache.layout_of(i) == lay.layer(i)
        for which in ("k", "v"):
            pool, li = cache.pool(i, which), dataclasses.replace(lay.layer(i), num_blocks=blocks)
            assert tuple(pool.data.shape) == li.data_shape(which) and pool.data.dtype == li.data_dtype(which)
            assert (None if pool.scale is None else tuple(pool.scale.shape)) == li.scale_shape(which)
            assert (None if pool.zero is None else tuple(pool.zero.shape)) == li.zero_shape(which)
            assert tuple(pool.tail.shape) == li.tail_shape()
    assert cache.nbytes() == want
    assert lay.block_bytes(range(L)) == sum(sum(sum(naive_block_bits(t, H, bs, D)) for t in (lay.fmt.layer(i).k, lay.fmt.layer(i).v))
                                            for i in range(L)) // 8


@pytest.mark.parametrize("spec,H,D,bs", CASES)
def test_shapes_take_symbolic_dims(spec, H, D, bs):
    """What a graph declares (``num_blocks`` / ``num_slots`` / ``num_layers`` names) is the int shape with names in place."""
    lay = _layout(spec, H, D, bs, num_blocks=6, num_slots=4)
    for which in ("k", "v"):
        assert lay.data_shape(which, "NB", layers="L") == ("L", "NB", *lay.data_shape(which)[1:])
        assert lay.data_shape(which, 11, layers=2) == (2, 11, *lay.data_shape(which)[1:])
        for get in (lay.scale_shape, lay.zero_shape):
            got, plain = get(which, "NB", layers="L"), get(which)
            assert got == (None if plain is None else ("L", "NB", *plain[1:]))
    assert lay.tail_shape("S", layers="L") == ("L", "S", *lay.tail_shape()[1:]) and lay.tail_shape()[0] == 4


@pytest.mark.parametrize("spec,H,D,bs", [c for c in CASES if c[3] > 4] + [("k=int8:token,v=int8:token,block=8,sink=3", 2, 7, 8)])
def test_tail_rows_are_the_hand_slices(spec, H, D, bs):
    lay = _layout(spec, H, D, bs)
    sink = lay.sink_tokens
    g = torch.Generator().manual_seed(bs * D + H)
    for lead in ((), (3,), (2, 5)):
        tail = torch.randn(*lead, H, bs + sink, D, generator=g).half()
        assert torch.equal(lay.open_rows(tail), tail[..., :bs, :])
        n = int(torch.randint(0, bs + 1, (), generator=g))
        assert torch.equal(lay.open_rows(tail, n), tail[..., :n, :])
        assert torch.equal(lay.sink_rows(tail), tail[..., bs : bs + sink, :])
        before = tail.clone()
        lay.sink_rows(tail).fill_(7)  # a view: writes land in the tail's sink rows only
        assert (tail[..., bs:, :] == 7).all() and torch.equal(tail[..., :bs, :], before[..., :bs, :])


@pytest.mark.parametrize("spec", ["int4", "k=int8:token,v=int8:token,block=8,sink=3", "int8"])
@pytest.mark.parametrize("block_index", [0, 1])
def test_open_block_to_seal_quantizes_the_block_without_its_sink(spec, block_index):
    """The rows a seal quantizes: the open block, a first block's sink rows replaced by row ``sink`` (and those rows
    kept in the tail's sink rows); other slots untouched."""
    H, D, bs = 3, 16, 8
    lay = _layout(spec, H, D, bs, num_slots=4)
    sink = lay.sink_tokens
    pool = lay.allocate("k")
    g = torch.Generator().manual_seed(block_index + sink)
    pool.tail.copy_(torch.randn(pool.tail.shape, generator=g).half())
    before = pool.tail.clone()
    rows = open_block_to_seal(lay, pool, 2, block_index)
    want = before[2:3, :, :bs].float().clone()
    if block_index == 0 and sink:
        for r in range(sink):
            want[:, :, r] = want[:, :, sink]
    assert rows.dtype == torch.float32 and torch.equal(rows, want)
    after = before.clone()
    if block_index == 0:
        after[2, :, bs : bs + sink] = before[2, :, :sink]
    assert torch.equal(pool.tail, after)
