"""trtkv.cache_layout: pool shapes, dtypes and byte counts per format; write -> gather through block tables."""

from __future__ import annotations

import pytest
import torch

from trtkv.cache_layout import KVPool, PagedKVLayout, gather_paged, write_paged
from trtkv.errors import TrtkvError
from trtkv.formats import PRESETS, get_format
from trtkv.quant import TensorParams, fake_quantize, quantize

# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; block_size 16
H, D, BS = 3, 64, 16

# bytes of one block (K and V, one layer), counted by hand:
# per token and head, K and V each: codes (D * bits / 8) + fp16 scale/zero per group
HAND_BYTES_PER_BLOCK = {
    "fp16": 2 * H * BS * (D * 2),  # 12288
    "int8": 2 * H * BS * (D + 2),  # 64 codes + 1 fp16 scale = 6336
    "int8-static": 2 * H * BS * D,  # static scale is a layer constant: 6144
    "fp8": 2 * H * BS * D,  # 6144
    "int4": 2 * H * BS * (D // 2 + 2 + 2),  # 32 code bytes + 1 group x (scale + zero) = 3456
    "int4-g32": 2 * H * BS * (D // 2 + 2 * 2),  # 32 code bytes + 2 groups x scale = 3456
}

EXPECTED = {
    # name: (K data dtype, K packed dim, K groups or None, K has zero)
    "fp16": (torch.float16, 64, None, False),
    "int8": (torch.int8, 64, 1, False),
    "int8-static": (torch.int8, 64, None, False),
    "fp8": (torch.uint8, 64, None, False),
    "int4": (torch.uint8, 32, 1, True),
    "int4-g32": (torch.uint8, 32, 2, False),
}


def _pool_bytes(pool: KVPool) -> int:
    return sum(t.numel() * t.element_size() for t in (pool.data, pool.scale, pool.zero) if t is not None)


@pytest.mark.parametrize("name", list(HAND_BYTES_PER_BLOCK))
def test_preset_layouts(name):
    fmt = PRESETS[name]
    lay = PagedKVLayout(fmt, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=10)
    dtype, packed, groups, has_zero = EXPECTED[name]
    assert lay.data_dtype("k") == dtype and lay.packed_dim("k") == packed
    assert lay.data_shape("k") == (10, H, BS, packed)
    assert lay.scale_shape("k") == (None if groups is None else (10, H, BS, groups))
    assert lay.zero_shape("k") == ((10, H, BS, groups) if has_zero else None)
    assert lay.bytes_per_block() == HAND_BYTES_PER_BLOCK[name]
    # the pool's byte count agrees with the per-token accounting of the format
    assert lay.bytes_per_block() == fmt.kv_bytes_per_token(1, H, D) * BS
    pools = [lay.allocate(w) for w in ("k", "v")]
    assert sum(_pool_bytes(p) for p in pools) == lay.bytes_per_block() * 10
    for w, p in zip(("k", "v"), pools):
        assert p.data.dtype == lay.data_dtype(w) and tuple(p.data.shape) == lay.data_shape(w) and not p.data.any()
        for t, shape in ((p.scale, lay.scale_shape(w)), (p.zero, lay.zero_shape(w))):
            assert (t is None) == (shape is None)
            if t is not None:
                assert t.dtype == torch.float16 and tuple(t.shape) == shape


def test_smollm2_whole_model_bytes_per_block():
    # the worked example of docs/kv-cache-format.md: 30 layers at block_size 16
    per_layer = {n: PagedKVLayout(PRESETS[n], H, D, BS, 1).bytes_per_block() for n in ("fp16", "int8", "int4")}
    assert {n: 30 * b for n, b in per_layer.items()} == {"fp16": 368640, "int8": 190080, "int4": 103680}


@pytest.mark.parametrize(
    "spec,dtype,groups,zero",
    [
        ("k=int8:token:asym,v=int8:token:asym", torch.uint8, 1, True),
        ("k=int8:g16:asym,v=int8:g16:asym", torch.uint8, 4, True),
        ("k=fp8:token,v=fp8:token", torch.uint8, 1, False),
        ("k=int4:head,v=int4:head", torch.uint8, None, False),
        ("k=int8:channel,v=int8:channel", torch.int8, None, False),
    ],
)
def test_inline_layouts(spec, dtype, groups, zero):
    lay = PagedKVLayout(get_format(spec), H, D, BS, 4)
    assert lay.data_dtype("v") == dtype
    assert lay.scale_shape("v") == (None if groups is None else (4, H, BS, groups))
    assert (lay.zero_shape("v") is not None) == zero
    code_bytes = D // 2 if "int4" in spec else D
    meta = 0 if groups is None else groups * 2 * (2 if zero else 1)
    assert lay.bytes_per_block() == 2 * H * BS * (code_bytes + meta)


def test_layout_rejections():
    with pytest.raises(TrtkvError, match="recent tokens"):
        PagedKVLayout(get_format("k=int8:token,v=int8:token,recent=32"), H, D, BS, 4)
    with pytest.raises(TrtkvError, match="even head_dim"):
        PagedKVLayout(get_format("k=int4:token,v=int8:token"), H, 25, BS, 4)
    with pytest.raises(TrtkvError, match="does not divide"):
        PagedKVLayout(get_format("k=int4:g64,v=int4:g64"), H, 96, BS, 4)
    PagedKVLayout(get_format("k=int8:token,v=int8:token"), H, 25, BS, 4)  # odd head_dim is fine for int8


# ----------------------------------------------------------------------------- write -> gather

FORMATS = list(HAND_BYTES_PER_BLOCK) + [
    "k=int8:token:asym,v=int8:g16:asym",
    "k=fp8:token,v=fp8:head",
    "k=int8:channel:smooth:hadamard,v=int4:head",
    "k=int4:g32:asym:hadamard,v=fp16",
]


def _params(fmt, which, g) -> TensorParams | None:
    t = getattr(fmt, which)
    p = TensorParams()
    if t.smooth:
        p.smooth = 0.5 + torch.rand(H, D, generator=g)
    if t.is_static:
        qmax = t.traits.sym_max
        p.scale = {
            "per_tensor": torch.tensor(3.0 / qmax),
            "per_head": (1 + torch.rand(H, generator=g)) * 3 / qmax,
            "per_channel": (1 + torch.rand(H, D, generator=g)) * 3 / qmax,
        }[t.granularity]
    return p


def _fill_garbage(pool: KVPool, g) -> None:
    """Make every slot hostile: random bytes in data, NaN in scales/zeros (and fp16 data)."""
    if pool.data.dtype == torch.float16:
        pool.data.fill_(float("nan"))
    else:
        pool.data.view(torch.uint8).copy_(torch.randint(0, 256, pool.data.shape, generator=g, dtype=torch.uint8))
    for t in (pool.scale, pool.zero):
        if t is not None:
            t.fill_(float("nan"))


@pytest.mark.parametrize("spec", FORMATS)
def test_write_then_gather_reproduces_fake_quantize(spec):
    fmt = get_format(spec)
    g = torch.Generator().manual_seed(len(spec))
    num_blocks = 12
    lay = PagedKVLayout(fmt, H, D, BS, num_blocks)
    contexts = [37, 16, 5]  # 3 blocks (last partly used), exactly one block, part of a block
    # non-contiguous, permuted blocks from the pool; -1 fills unused block-table entries
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, taken = [], 0
    for n in contexts:
        nb = -(-(n + 1) // BS)  # room for one decode token
        tables.append(perm[taken : taken + nb] + [-1] * (4 - nb))
        taken += nb
    block_tables = torch.tensor(tables, dtype=torch.int32)
    untouched = perm[taken:]

    for which in ("k", "v"):
        params = _params(fmt, which, g)
        pool = lay.allocate(which)
        _fill_garbage(pool, g)
        before = [t.clone() for t in (pool.data, pool.scale, pool.zero) if t is not None]
        rows = [torch.randn(n + 1, H, D, generator=g) * 3 for n in contexts]
        for r in rows:
            r[0, 0, :5] = 1e4  # an outlier token
            r[-1, 1] = 0.0  # a zero row

        # prefill: every sequence's first n tokens in one flat batch, with padding rows (slot -1)
        # whose contents are NaN and must be skipped
        flat, slots = [], []
        for s, n in enumerate(contexts):
            for i in range(n):
                flat.append(rows[s][i])
                slots.append(tables[s][i // BS] * BS + i % BS)
                if i % 7 == 3:
                    flat.append(torch.full((H, D), float("nan")))
                    slots.append(-1)
        write_paged(lay, which, pool, torch.stack(flat), torch.tensor(slots), params)
        # decode: one new token per sequence, plus a padding entry
        step = [rows[s][n] for s, n in enumerate(contexts)] + [torch.full((H, D), float("inf"))]
        step_slots = [tables[s][n // BS] * BS + n % BS for s, n in enumerate(contexts)] + [-1]
        write_paged(lay, which, pool, torch.stack(step), torch.tensor(step_slots), params)

        tf = getattr(fmt, which)
        for s, n in enumerate(contexts):
            want = fake_quantize(rows[s], tf, params)  # per-token quantization does not depend on the batch
            got = gather_paged(lay, which, pool, block_tables[s], n + 1, params)
            assert got.shape == (n + 1, H, D) and got.dtype == torch.float32
            assert torch.equal(got, want), f"{which}: sequence {s} differs from fake_quantize"
            raw = gather_paged(lay, which, pool, block_tables[s], n + 1, params, dequant=False)
            qt = quantize(rows[s], tf, params)
            assert torch.equal(raw.codes, qt.codes.to(raw.codes.dtype))
            for a, b in ((raw.scale, qt.scale), (raw.zero, qt.zero)):
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
            # slot arithmetic by hand: token i of sequence s lives at block tables[s][i // BS], offset i % BS
            i = n // 2
            assert torch.equal(pool.data[tables[s][i // BS], :, i % BS], qt.codes[i].to(pool.data.dtype))

        # blocks no sequence owns keep their garbage bit for bit
        after = [t for t in (pool.data, pool.scale, pool.zero) if t is not None]
        for b0, a0 in zip(before, after):
            assert torch.equal(b0[untouched].view(torch.uint8) if b0.dtype != torch.float16 else b0[untouched].view(torch.int16),
                               a0[untouched].view(torch.uint8) if a0.dtype != torch.float16 else a0[untouched].view(torch.int16))


def test_gather_reads_only_the_context():
    fmt = PRESETS["int8"]
    lay = PagedKVLayout(fmt, H, D, BS, 4)
    pool = lay.allocate("k")
    rows = torch.randn(20, H, D)
    table = torch.tensor([2, 0, -1, -1])
    write_paged(lay, "k", pool, rows, torch.tensor([2 * BS + i if i < BS else (i - BS) for i in range(20)]))
    pool.data[0, :, 4:] = 127  # garbage after the context inside the last used block
    pool.scale[0, :, 4:] = float("nan")
    assert torch.equal(gather_paged(lay, "k", pool, table, 20), fake_quantize(rows, fmt.k))
    assert torch.equal(gather_paged(lay, "k", pool, table, 7), fake_quantize(rows[:7], fmt.k))
