"""trtkv.cache_layout: pool shapes, dtypes and byte counts per format; write -> gather through block tables."""

from __future__ import annotations

import pytest
import torch

from trtkv.cache_layout import (
    KVPool,
    PagedKVLayout,
    block_chunks,
    chunk_length,
    gather_paged,
    seal_blocks,
    seal_open_block,
    slot_mapping,
    write_tail,
)
from trtkv.errors import TrtkvError
from trtkv.formats import CALIBRATION_FREE, PRESETS, get_format
from trtkv.quant import TensorParams, fake_quantize_block, quantize, quantize_block

# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; block_size 16 (formats are stored with sealed blocks of BS)
H, D, BS = 3, 64, 16
INT8_TOKEN = "k=int8:token,v=int8:token"  # every token quantized on write, one scale per token
INT4_TOKEN = "k=int4:token:asym:smooth:hadamard,v=int4:token:asym:hadamard"
INT4_G32 = "k=int4:g32:sym,v=int4:g32:sym"
INT3_FREE, INT2_FREE = CALIBRATION_FREE["int3"], CALIBRATION_FREE["int2"]

# bytes of one pool block (K and V, one layer), counted by hand:
# per token and head, K and V each: codes (D * bits / 8) + fp16 scale/zero per group; block-wise
# (per channel per block) formats: one fp16 scale + zero per channel and head per block
HAND_BYTES_PER_BLOCK = {
    "fp16": 2 * H * BS * (D * 2),  # 12288
    "int8": H * BS * D + H * D * 2 + H * BS * (D + 2),  # K codes + one fp16 scale per channel per block; V per token
    INT8_TOKEN: 2 * H * BS * (D + 2),
    "int8-static": 2 * H * BS * D,  # static scale is a layer constant: 6144
    "fp8": 2 * H * BS * D,  # 6144
    "int4": H * BS * D // 2 + H * D * 2 * 2 + H * BS * (D // 2 + 2 * 2),  # K per channel per block; V 2 groups x scale
    INT4_TOKEN: 2 * H * BS * (D // 2 + 2 + 2),  # 32 code bytes + 1 group x (scale + zero) = 3456
    INT4_G32: 2 * H * BS * (D // 2 + 2 * 2),  # 32 code bytes + 2 groups x scale = 3456
    INT3_FREE: H * BS * D * 3 // 8 + H * D * 2 * 2 + H * BS * (D * 3 // 8 + 2 * 2),  # 24 code bytes per row (bit planes 2 + 1)
    INT2_FREE: H * BS * D // 4 + H * D * 2 * 2 + H * BS * (D // 4 + 2 + 2),  # 16 code bytes per row; V one scale + zero per token
}

EXPECTED = {
    # name: (K data dtype, K packed dim, K scale shape per block or None, K has zero)
    "fp16": (torch.float16, 64, None, False),
    "int8": (torch.int8, 64, (H, D), False),
    INT8_TOKEN: (torch.int8, 64, (H, BS, 1), False),
    "int8-static": (torch.int8, 64, None, False),
    "fp8": (torch.uint8, 64, None, False),
    "int4": (torch.uint8, 32, (H, D), True),
    INT4_TOKEN: (torch.uint8, 32, (H, BS, 1), True),
    INT4_G32: (torch.uint8, 32, (H, BS, 2), False),
    INT3_FREE: (torch.uint8, 24, (H, D), True),
    INT2_FREE: (torch.uint8, 16, (H, D), True),
}


def _fmt(name):
    return get_format(name).with_block_size(BS)


def _pool_bytes(pool: KVPool) -> int:
    return sum(t.numel() * t.element_size() for t in (pool.data, pool.scale, pool.zero) if t is not None)


@pytest.mark.parametrize("name", list(HAND_BYTES_PER_BLOCK))
def test_preset_layouts(name):
    fmt = _fmt(name)
    lay = PagedKVLayout(fmt, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=10, num_slots=5)
    dtype, packed, scale, has_zero = EXPECTED[name]
    assert lay.data_dtype("k") == dtype and lay.packed_dim("k") == packed
    assert lay.data_shape("k") == (10, H, BS, packed)
    assert lay.scale_shape("k") == (None if scale is None else (10, *scale))
    assert lay.zero_shape("k") == ((10, *scale) if has_zero else None)
    assert lay.bytes_per_block() == HAND_BYTES_PER_BLOCK[name]
    # the pool's byte count agrees with the format's pool accounting; the open blocks are per slot
    assert lay.bytes_per_block() == fmt.kv_bytes_per_token(1, H, D) * BS
    tail_rows = BS + {"int4": 4, INT3_FREE: 4, INT2_FREE: 4}.get(name, 0)  # the open block, then the 4 sink tokens
    assert lay.tail_bytes_per_slot() == fmt.tail_bytes_per_slot(1, H, D) == 2 * H * tail_rows * D * 2
    pools = [lay.allocate(w) for w in ("k", "v")]
    assert all(p.tail.shape == (5, H, tail_rows, D) and p.tail.dtype == torch.float16 for p in pools)
    assert sum(_pool_bytes(p) for p in pools) == lay.bytes_per_block() * 10
    for w, p in zip(("k", "v"), pools):
        assert p.data.dtype == lay.data_dtype(w) and tuple(p.data.shape) == lay.data_shape(w) and not p.data.any()
        for t, shape in ((p.scale, lay.scale_shape(w)), (p.zero, lay.zero_shape(w))):
            assert (t is None) == (shape is None)
            if t is not None:
                assert t.dtype == torch.float16 and tuple(t.shape) == shape


def test_smollm2_whole_model_bytes_per_block():
    # the worked example of docs/kv-cache-format.md: 30 layers at block_size 16
    per_layer = {n: PagedKVLayout(_fmt(n), H, D, BS, 1).bytes_per_block() for n in ("fp16", INT8_TOKEN, INT4_TOKEN)}
    assert {n: 30 * b for n, b in per_layer.items()} == {"fp16": 368640, INT8_TOKEN: 190080, INT4_TOKEN: 103680}
    # the int4 preset at its own block size, 64: 4.5 bits per element in the pool, 64 tokens per block
    int4 = PagedKVLayout(PRESETS["int4"], H, D, 64, 1)
    assert 30 * int4.bytes_per_block() == 30 * 2 * 3 * 64 * 64 * 4.5 / 8 == 414720


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
    with pytest.raises(TrtkvError, match="seals blocks of 32") as ei:
        PagedKVLayout(get_format("k=int8:token,v=int8:token,block=32"), H, D, BS, 4)
    assert "block=16" in ei.value.fix
    with pytest.raises(TrtkvError, match="even head_dim"):
        PagedKVLayout(get_format("k=int4:token,v=int8:token"), H, 25, BS, 4)
    with pytest.raises(TrtkvError, match="does not divide"):
        PagedKVLayout(get_format("k=int4:g64,v=int4:g64"), H, 96, BS, 4)
    PagedKVLayout(get_format("k=int8:token,v=int8:token"), H, 25, BS, 4)  # odd head_dim is fine for int8


# ----------------------------------------------------------------------------- seal / open block -> gather

FORMATS = list(HAND_BYTES_PER_BLOCK) + [
    "k=int8:token:asym,v=int8:g16:asym",
    "k=fp8:token,v=fp8:head",
    "k=int8:channel:smooth:hadamard,v=int4:head",
    "k=int4:g32:asym:hadamard,v=fp16",
    "k=int4:bchannel:sym:hadamard,v=int8:bchannel:asym,block=16",
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
    """Make every slot hostile: random bytes in data, NaN in scales/zeros, fp16 data and the open blocks."""
    if pool.data.dtype == torch.float16:
        pool.data.fill_(float("nan"))
    else:
        pool.data.view(torch.uint8).copy_(torch.randint(0, 256, pool.data.shape, generator=g, dtype=torch.uint8))
    for t in (pool.scale, pool.zero, pool.tail):
        if t is not None:
            t.fill_(float("nan"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)


@pytest.mark.parametrize("spec", FORMATS)
def test_sealed_blocks_and_open_block_read_back_as_the_quantizer_defines(spec):
    fmt = get_format(spec).with_block_size(BS)
    g = torch.Generator().manual_seed(len(spec))
    num_blocks = 12
    lay = PagedKVLayout(fmt, H, D, BS, num_blocks, num_slots=4)
    contexts = [37, 16, 5]  # 2 sealed blocks + 5 open; exactly one sealed block, open block empty; only open rows
    slots = [3, 0, 2]  # open-block slots, not in sequence order
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, permuted pool blocks
    tables, taken = [], 0
    for n in contexts:
        nb = n // BS
        tables.append(perm[taken : taken + nb] + [-1] * (4 - nb))
        taken += nb
    block_tables = torch.tensor(tables, dtype=torch.int32)
    untouched = perm[taken:]

    for which in ("k", "v"):
        tf = getattr(fmt, which)
        params = _params(fmt, which, g)
        pool = lay.allocate(which)
        _fill_garbage(pool, g)
        before = [t.clone() for t in (pool.data, pool.scale, pool.zero) if t is not None]
        rows = [(torch.randn(n, H, D, generator=g) * 3).half().float() for n in contexts]  # fp16, as the open block held them
        for r in rows:
            r[0, 0, :5] = 1e3  # an outlier token
            r[-1, 1] = 0.0  # a zero row
        for s, n in enumerate(contexts):  # as the runtime fills a slot: open block rows, sealed when full
            for i in range(n // BS):
                write_tail(pool, slots[s], rows[s][i * BS : (i + 1) * BS].half(), 0, BS)
                seal_open_block(lay, which, pool, slots[s], int(block_tables[s, i]), i, params)
            if n % BS:
                write_tail(pool, slots[s], rows[s][n // BS * BS :].half(), 0, BS)

        sink = lay.sink_tokens
        for s, n in enumerate(contexts):
            sealed = n // BS
            got = gather_paged(lay, which, pool, block_tables[s], n, params, slot=slots[s])
            assert got.shape == (n, H, D) and got.dtype == torch.float32
            want = rows[s].clone()
            quantized_rows = rows[s][: sealed * BS].clone()
            quantized_rows[:sink] = rows[s][sink]  # the first block is quantized with its sink tokens replaced
            if sealed:  # independent of the pool: the quantizer applied to the same blocks
                blocks = quantized_rows.reshape(sealed, BS, H, D).transpose(1, 2)
                want[: sealed * BS] = fake_quantize_block(blocks, tf, params).transpose(1, 2).reshape(-1, H, D)
                want[:sink] = rows[s][:sink]  # ... and read back from the sink rows, unquantized
                if tf.is_quantized:
                    assert not torch.equal(want[: sealed * BS], rows[s][: sealed * BS])
            assert torch.equal(got, want), f"{which}: sequence {s} differs"
            # the block that sealed tokens 0..BS-1 holds their codes, byte for byte, at table entry 0
            if sealed:
                qt = quantize_block(quantized_rows[:BS].transpose(0, 1), tf, params)
                assert torch.equal(pool.data[tables[s][0]], qt.codes.to(pool.data.dtype))
                if not tf.is_block_wise and tf.is_quantized:  # per-token formats: each token's bytes on its own
                    one = quantize(quantized_rows[:BS], tf, params, head_axis=-2)  # [BS, H, ...] token rows
                    assert torch.equal(one.codes.transpose(0, 1).to(pool.data.dtype), pool.data[tables[s][0]])

        # blocks no sequence owns keep their garbage bit for bit
        after = [t for t in (pool.data, pool.scale, pool.zero) if t is not None]
        for b0, a0 in zip(before, after):
            assert torch.equal(_bits(b0[untouched]), _bits(a0[untouched]))


def test_gather_reads_only_the_context():
    fmt = PRESETS["int8"].with_block_size(BS)
    lay = PagedKVLayout(fmt, H, D, BS, 4, num_slots=2)
    pool = lay.allocate("k")
    rows = torch.randn(20, H, D).half().float()
    table = torch.tensor([2, -1, -1, -1])
    seal_blocks(lay, "k", pool, rows[:BS].transpose(0, 1)[None], table[:1])
    write_tail(pool, 1, rows[BS:].half(), 0, BS)
    pool.tail[1, :, 4:] = float("nan")  # garbage after the open rows
    pool.data[0], pool.scale[0] = 127, float("nan")  # an unlisted block
    want = torch.cat([fake_quantize_block(rows[:BS].transpose(0, 1), fmt.k).transpose(0, 1), rows[BS:]])
    assert torch.equal(gather_paged(lay, "k", pool, table, 20, slot=1), want)
    assert torch.equal(gather_paged(lay, "k", pool, table, 17, slot=1), want[:17])
    assert torch.equal(gather_paged(lay, "k", pool, table, 16), want[:16])  # no open rows: no slot needed
    with pytest.raises(ValueError, match="open block"):
        gather_paged(lay, "k", pool, table, 18)


def test_slot_mapping_is_block_table_arithmetic():
    table = torch.tensor([[7, 2, 5], [1, 0, 3]])
    pos = torch.tensor([[0, 15, 16, 40], [3, 17, 33, 47]])
    want = [[7 * 16 + 0, 7 * 16 + 15, 2 * 16 + 0, 5 * 16 + 8], [1 * 16 + 3, 0 * 16 + 1, 3 * 16 + 1, 3 * 16 + 15]]
    assert slot_mapping(table, pos, 16).tolist() == want
    assert slot_mapping(table[0], pos[0], 16).tolist() == want[0]


# ----------------------------------------------------------------------------- chunks never cross a block boundary


def _naive_chunks(start: int, remaining: int, limit: int | None, block_size: int | None) -> list[tuple[int, int]]:
    """Token by token: a token opens a new chunk at a block boundary or when the current one holds ``limit``."""
    out: list[list[int]] = []
    for p in range(start, start + remaining):
        if not out or (block_size and p % block_size == 0) or (limit is not None and out[-1][1] - out[-1][0] == limit):
            out.append([p, p])
        out[-1][1] = p + 1
    return [tuple(c) for c in out]


def test_block_chunks_match_a_naive_token_loop():
    rng = torch.Generator().manual_seed(11)
    for _ in range(3000):
        start, remaining, limit, bs = (int(v) for v in torch.randint(1, 40, (4,), generator=rng))
        start -= 1  # 0 … 38
        bs = None if bs > 33 else bs  # some without sealed blocks
        limit = None if limit > 30 else limit
        chunks = block_chunks(start, remaining, bs, limit)
        assert chunks == _naive_chunks(start, remaining, limit, bs), (start, remaining, limit, bs)
        assert [p for a, b in chunks for p in range(a, b)] == list(range(start, start + remaining))  # exactly the tokens
        for a, b in chunks:
            assert b > a and (limit is None or b - a <= limit)
            assert not bs or a // bs == (b - 1) // bs  # inside one block, whatever the offset of ``start``
        assert chunk_length(start, remaining, bs, limit) == chunks[0][1] - chunks[0][0]
    with pytest.raises(ValueError, match="no progress"):
        block_chunks(0, 5, 4, 0)


def test_each_layer_is_sealed_with_its_own_static_scale():
    """A static format's codes of layer i are
    x / scale_i; read back with layer i's scale they are within half a step of x. Layer 0's scale is 50x finer,
    so layer 1 sealed with it would clamp at 127 codes and read back 127 * 0.5, far from x."""
    from trtkv.artifacts import LayerParams
    from trtkv.cache_layout import gather_paged
    from trtkv.quant import TensorParams

    scales = (0.01, 0.5)
    params = [LayerParams(k=TensorParams(scale=torch.tensor(s)), v=TensorParams(scale=torch.tensor(s))) for s in scales]
    from trtkv.runtime.kv_pool import PagedKVCache

    cache = PagedKVCache(PagedKVLayout(get_format("k=int8:tensor,v=int8:tensor"), 1, 8, BS, 8, 2), 2, params)
    g = torch.Generator().manual_seed(5)
    x = torch.stack([(torch.rand(1, BS, 8, generator=g) * 2 - 1) * (100 * s) for s in scales])  # [L, H, bs, D], |x| < 100 steps
    for name in ("k_tail", "v_tail"):
        cache.tensors[name][:, 0, :, :BS] = x.half()
    cache.seal(0, 2, 1)  # slot 0 into pool block 2, the sequence's block 1 (no sinks)
    for layer, s in enumerate(scales):
        for which in ("k", "v"):
            got = gather_paged(cache.layout_of(layer), which, cache.pool(layer, which), torch.tensor([2]), BS, getattr(params[layer], which))
            want = x[layer].half().float().transpose(0, 1)  # [bs, H, D]
            assert (got - want).abs().max() <= 0.5 * s * 1.01, (layer, which)
