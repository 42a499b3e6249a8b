"""KV formats (trtkv/formats.py) against their documented rules and naive references: the DTYPES rows (code ranges from
the bit width, offsets, bit planes), the codecs against a bit-by-bit packer and every code value, byte tables; every
TensorFormat / KVFormat validation rule with its one-line message; spec strings <-> objects over every valid tensor
format and random valid KV formats, presets, per-layer formats, JSON files; every parse error path; bits and bytes
against a naive count of codes, scales, zero-points and fp16 open-block rows; ``layer(i)``, ``with_block_size``, traits;
fitting a format to a head_dim.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from trtkv.errors import TrtkvError
from trtkv.formats import (
    CALIBRATION_FREE,
    CLIP_GRID,
    DEFAULT_BLOCK_SIZE,
    DTYPES,
    ELEM_TYPES,
    MAX_SINK_TOKENS,
    PRESETS,
    SCALE_BITS,
    LayerStorage,
    TensorFormat,
    fit_format,
    fit_formats,
    get_format,
    pack_int4,
    parse_tensor_spec,
    unpack_int4,
)

INTS = {"int8": 8, "int4": 4, "int3": 3, "int2": 2}
GRANS = ("per_tensor", "per_head", "per_channel", "per_token", "per_token_group", "per_block_channel")
WORD = {"per_tensor": "tensor", "per_head": "head", "per_channel": "channel", "per_token": "token", "per_block_channel": "bchannel"}


# ---------------------------------------------------------------- the dtype rows and codecs


def test_constants():
    assert SCALE_BITS == 16 and DEFAULT_BLOCK_SIZE == 64 and MAX_SINK_TOKENS == 16
    assert CLIP_GRID == pytest.approx([1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5]) and len(CLIP_GRID) == 11


@pytest.mark.parametrize("name, bits", INTS.items())
def test_int_rows_follow_from_the_bit_width(name, bits):
    t = DTYPES[name]
    assert (t.name, t.bits, t.is_int) == (name, bits, True)
    assert (t.sym_min, t.sym_max, t.asym_max) == (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1, 2**bits - 1)
    assert t.packed_bytes_per_code == bits / 8
    if bits == 8:
        assert (t.storage, t.storage_asym, t.code_offset, t.planes, t.packed) == (torch.int8, torch.uint8, 0, (), False)
    else:
        assert (t.storage, t.code_offset, t.packed) == (torch.uint8, 2 ** (bits - 1), True)
        assert sum(t.planes) == bits and all(8 % w == 0 for w in t.planes)
    assert t.offset(True) == t.code_offset and t.offset(False) == 0


def test_float_rows():
    f16, f8 = DTYPES["fp16"], DTYPES["fp8_e4m3"]
    assert (f16.bits, f16.is_int, f16.sym_min, f16.sym_max, f16.storage, f16.planes) == (16, False, -65504.0, 65504.0, torch.float16, ())
    assert (f8.bits, f8.is_int, f8.sym_min, f8.sym_max, f8.storage, f8.planes) == (8, False, -448.0, 448.0, torch.uint8, ())
    assert set(DTYPES) == {"fp16", "fp8_e4m3", "int8", "int4", "int3", "int2"}


@pytest.mark.parametrize("name, align, per_byte, dim", [("fp16", 1, 1, 24), ("fp8_e4m3", 1, 1, 24), ("int8", 1, 1, 24), ("int4", 2, 2, 12),
                                                         ("int2", 4, 4, 6), ("int3", 8, None, 9)])
def test_packing_geometry(name, align, per_byte, dim):
    t = DTYPES[name]
    assert t.row_align == align and t.packed_dim(24) == dim
    if per_byte is None:
        with pytest.raises(ValueError, match="bit planes"):
            _ = t.codes_per_byte
        assert t.plane_layout(16) == [(0, 2, 0), (4, 1, 2)] and t.plane_layout(24) == [(0, 2, 0), (6, 1, 2)]
    else:
        assert t.codes_per_byte == per_byte


def test_storage_and_element_types():
    assert DTYPES["int8"].storage_for(True) == torch.int8 and DTYPES["int8"].storage_for(False) == torch.uint8
    assert DTYPES["int4"].storage_for(False) == torch.uint8 == DTYPES["fp8_e4m3"].storage_for(True)
    assert DTYPES["int8"].elem_type(True).name == "int8" and DTYPES["int8"].elem_type(False).name == "uint8"
    assert DTYPES["fp16"].elem_type(True).name == "float16"
    assert {n: (e.onnx, e.triton, e.trt) for n, e in ELEM_TYPES.items()} == {
        "float16": (10, "*fp16", "float16"), "bfloat16": (16, "*bf16", "bfloat16"), "float32": (1, "*fp32", "float32"), "int8": (3, "*i8", "int8"),
        "uint8": (2, "*u8", "uint8"), "int32": (6, "*i32", "int32"), "int64": (7, "*i64", "int64")}
    assert all(e.torch == getattr(torch, n) for n, e in ELEM_TYPES.items())


def naive_pack(codes: list[list[int]], planes: tuple[int, ...]) -> list[list[int]]:
    """Plane after plane; in a plane of width w, channel c sits in byte c // (8 / w) at bit (c % (8 / w)) * w."""
    out = []
    for row in codes:
        D, low, bytes_ = len(row), 0, []
        for w in planes:
            per = 8 // w
            plane = [0] * (D * w // 8)
            for c, code in enumerate(row):
                plane[c // per] |= ((code >> low) & ((1 << w) - 1)) << ((c % per) * w)
            bytes_ += plane
            low += w
        out.append(bytes_)
    return out


@pytest.mark.parametrize("name", ["int4", "int3", "int2"])
@pytest.mark.parametrize("sym", [True, False])
def test_packed_codecs_match_a_bit_by_bit_packer_and_round_trip(name, sym):
    t = DTYPES[name]
    g = torch.Generator().manual_seed(INTS[name] * 2 + sym)
    for D in (t.row_align, 3 * t.row_align, 40):
        lo, hi = (t.sym_min, t.sym_max) if sym else (0, t.asym_max)
        q = torch.randint(int(lo), int(hi) + 1, (5, D), generator=g).float()
        q[0, : min(D, int(hi - lo) + 1)] = torch.arange(lo, lo + min(D, int(hi - lo) + 1))  # every code value appears
        packed = t.encode(q, sym)
        stored = (q + (t.code_offset if sym else 0)).long().tolist()
        assert packed.dtype == torch.uint8 and packed.shape == (5, t.packed_dim(D))
        assert packed.tolist() == naive_pack(stored, t.planes)
        assert torch.equal(t.decode(packed, sym), q)
        assert torch.equal(t.stored_values(packed), torch.tensor(stored, dtype=torch.float32))
    with pytest.raises(TrtkvError, match=f"multiple of {t.row_align}"):
        t.encode(torch.zeros(1, t.row_align + 1), sym)


def test_unpacked_codecs():
    q = torch.tensor([[-128.0, -1.0, 0.0, 127.0]])
    i8 = DTYPES["int8"]
    assert i8.encode(q, True).dtype == torch.int8 and i8.encode(q, True).tolist() == [[-128, -1, 0, 127]]
    assert torch.equal(i8.decode(i8.encode(q, True), True), q)
    u = torch.tensor([[0.0, 255.0, 7.0]])
    assert i8.encode(u, False).dtype == torch.uint8 and torch.equal(i8.decode(i8.encode(u, False), False), u)
    f8 = DTYPES["fp8_e4m3"]
    x = torch.tensor([[0.0, 1.0, -2.5, 448.0, 0.1]])
    enc = f8.encode(x, True)
    assert enc.dtype == torch.uint8 and torch.equal(enc, x.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(f8.decode(enc, True), x.to(torch.float8_e4m3fn).float())
    f16 = DTYPES["fp16"]
    assert f16.encode(x, True).dtype == torch.float16 and torch.equal(f16.decode(f16.encode(x, True), True), x.half().float())


def test_byte_tables():
    i4 = DTYPES["int4"].byte_table(True)
    assert i4.shape == (256, 2) and i4[0x3A].tolist() == [0xA - 8, 0x3 - 8] and i4[0].tolist() == [-8, -8]
    assert DTYPES["int4"].byte_table(False)[0x3A].tolist() == [10, 3]
    i2 = DTYPES["int2"].byte_table(True)
    assert i2.shape == (256, 4) and i2[0b11_10_01_00].tolist() == [0 - 2, 1 - 2, 2 - 2, 3 - 2]
    i8 = DTYPES["int8"]
    assert i8.byte_table(True)[:, 0].tolist() == [b - 256 if b > 127 else b for b in range(256)]
    assert i8.byte_table(False)[:, 0].tolist() == list(range(256))
    f8 = DTYPES["fp8_e4m3"].byte_table(True)[:, 0]
    want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(f8, torch.nan_to_num(want, nan=0.0)) and not f8.isnan().any()
    for name in ("int3", "fp16"):
        with pytest.raises(ValueError):
            DTYPES[name].byte_table(True)
    p0, p1 = DTYPES["int3"].plane_tables(True)
    assert p0.shape == (256, 4) and p1.shape == (256, 8)
    assert p0[0b11_00_10_01].tolist() == [1 - 4, 2 - 4, 0 - 4, 3 - 4] and p1[0b1000_0001].tolist() == [4, 0, 0, 0, 0, 0, 0, 4]
    assert DTYPES["int3"].plane_tables(False)[0][0b11].tolist() == [3, 0, 0, 0]
    with pytest.raises(ValueError):
        DTYPES["int8"].plane_tables(True)


def test_code_fields_split_channels_by_stride():
    codes = torch.tensor([[0x21, 0x43, 0x65]], dtype=torch.uint8)  # int4: channels 1,2,3,4,5,6
    lo, hi = DTYPES["int4"].code_fields(codes)
    assert lo.tolist() == [[1, 3, 5]] and hi.tolist() == [[2, 4, 6]]
    assert [f.tolist() for f in DTYPES["int2"].code_fields(torch.tensor([[0b11_10_01_00]], dtype=torch.uint8))] == [[[0]], [[1]], [[2]], [[3]]]
    x = torch.tensor([[1, -2]], dtype=torch.int8)
    assert [f.tolist() for f in DTYPES["int8"].code_fields(x)] == [[[1, -2]]]
    with pytest.raises(ValueError):
        DTYPES["int3"].code_fields(codes)


def test_pack_int4_puts_the_even_channel_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0, 7, 8]])
    assert pack_int4(codes).tolist() == [[0x21, 0x0F, 0x87]]
    assert unpack_int4(pack_int4(codes)).tolist() == codes.tolist()
    with pytest.raises(TrtkvError, match="even last dimension"):
        pack_int4(torch.zeros(1, 3))


# ---------------------------------------------------------------- TensorFormat rules


def valid_tensor_formats():
    out = [TensorFormat(dtype="fp16")]
    for dtype, gran, sym, smooth, had, mse in itertools.product(["int8", "int4", "int3", "int2", "fp8_e4m3"], GRANS, [True, False],
                                                                 [False, True], [False, True], [False, True]):
        kw = dict(dtype=dtype, granularity=gran, symmetric=sym, smooth=smooth, hadamard=had, mse=mse)
        if gran == "per_token_group":
            kw["group_size"] = 8
        ok = not (dtype == "fp8_e4m3" and not sym) and not (not sym and gran in ("per_tensor", "per_head", "per_channel")) and not (
            mse and gran != "per_block_channel")
        if ok:
            out.append(TensorFormat(**kw))
        else:
            with pytest.raises(ValueError):
                TensorFormat(**kw)
    return out


def test_every_valid_tensor_format_round_trips_through_its_short_spec():
    fmts = valid_tensor_formats()
    assert len(fmts) > 100
    for t in fmts:
        s = t.short()
        assert parse_tensor_spec(s) == t, s
        if t.dtype != "fp16":
            parts = s.split(":")
            assert parts[0] == t.dtype and parts[1] == WORD.get(t.granularity, f"g{t.group_size}")
            assert parts[2] == ("sym" if t.symmetric else "asym")
            assert parts[3:] == [w for w, on in (("smooth", t.smooth), ("hadamard", t.hadamard), ("mse", t.mse)) if on]
    assert TensorFormat(dtype="fp16").short() == "fp16"


@pytest.mark.parametrize("kw, words", [
    (dict(dtype="fp16", granularity="per_token"), "fp16 storage takes no scales"),
    (dict(dtype="fp16", symmetric=False), "fp16 storage takes no scales"),
    (dict(dtype="fp16", smooth=True), "fp16 storage takes no scales"),
    (dict(dtype="fp16", hadamard=True), "fp16 storage takes no scales"),
    (dict(dtype="fp16", group_size=4), "fp16 storage takes no scales"),
    (dict(dtype="int8"), "int8 needs a scale granularity"),
    (dict(dtype="fp8_e4m3", granularity="per_token", symmetric=False), "fp8_e4m3 is symmetric only"),
    (dict(dtype="int4", granularity="per_token_group"), "per_token_group needs group_size"),
    (dict(dtype="int4", granularity="per_token", group_size=8), "group_size only applies"),
    (dict(dtype="int8", granularity="per_head", symmetric=False), "asymmetric"),
    (dict(dtype="int8", granularity="per_channel", symmetric=False), "asymmetric"),
    (dict(dtype="int4", granularity="per_token", mse=True), "mse"),
    (dict(dtype="int4", granularity="per_token_group", group_size=1), "group_size"),
])
def test_tensor_format_refusals(kw, words):
    with pytest.raises(ValueError, match=words):
        TensorFormat(**kw)


def test_tensor_format_traits():
    t = parse_tensor_spec("int4:g8:asym:smooth")
    assert t.traits is DTYPES["int4"] and t.is_quantized and not t.is_static and t.is_dynamic and not t.is_block_wise
    assert t.storage.name == "uint8" and parse_tensor_spec("int8:token:sym").storage.name == "int8"
    assert parse_tensor_spec("int8:token:asym").storage.name == "uint8"
    for word, static, dynamic, block in (("tensor", True, False, False), ("head", True, False, False), ("channel", True, False, False),
                                         ("token", False, True, False), ("g4", False, True, False), ("bchannel", False, True, True)):
        f = parse_tensor_spec(f"int8:{word}")
        assert (f.is_static, f.is_dynamic, f.is_block_wise) == (static, dynamic, block), word
    fp = TensorFormat(dtype="fp16")
    assert not fp.is_quantized and not fp.is_static and not fp.is_dynamic and fp.groups(64) == 0 and fp.scale_shape((), 2, 16, 64) is None


@pytest.mark.parametrize("spec, D, groups, shape", [
    ("int8:token", 24, 1, (3, 2, 16, 1)), ("int4:g8", 24, 3, (3, 2, 16, 3)), ("int4:g24", 24, 1, (3, 2, 16, 1)),
    ("int4:bchannel:asym", 24, 0, (3, 2, 24)), ("int8:tensor", 24, 0, None), ("int8:channel", 24, 0, None),
])
def test_groups_and_scale_shapes(spec, D, groups, shape):
    t = parse_tensor_spec(spec)
    assert t.groups(D) == groups and t.scale_shape((3,), 2, 16, D) == shape
    symbolic = None if shape is None else ("L", "N", "H", D) if t.is_block_wise else ("L", "N", "H", "B", groups)
    assert t.scale_shape(("L", "N"), "H", "B", D) == symbolic  # dimensions but head_dim may be symbolic


def test_check_head_dim_names_the_rule():
    with pytest.raises(TrtkvError, match="group size 16 does not divide head_dim 24"):
        parse_tensor_spec("int4:g16").check_head_dim(24)
    with pytest.raises(TrtkvError, match="int4 packs two codes per byte and needs an even head_dim, got 25"):
        parse_tensor_spec("int4:token").check_head_dim(25)
    with pytest.raises(TrtkvError, match=r"int3 packs bit planes \(2, 1\) and needs a head_dim that is a multiple of 8, got 12"):
        parse_tensor_spec("int3:token").check_head_dim(12)
    with pytest.raises(TrtkvError, match="int2 packs 4 codes per byte and needs a head_dim that is a multiple of 4, got 6"):
        parse_tensor_spec("int2:token").check_head_dim(6)
    with pytest.raises(TrtkvError, match="Hadamard rotation needs an even head_dim, got 25"):
        parse_tensor_spec("int8:token:hadamard").check_head_dim(25)
    for spec, D in (("int8:token", 25), ("int4:token", 26), ("int3:token", 16), ("int2:token", 4), ("int4:g13", 26), ("fp16", 7),
                    ("int8:token:hadamard", 26), ("int4:g2:hadamard", 6)):
        parse_tensor_spec(spec).check_head_dim(D)


def naive_bits(t: TensorFormat, D: int, bs: int | None) -> float:
    """Bits of one token row of D codes (``allocB``: B per element) plus its share of fp16 scales (and zero-points when
    asymmetric) and of the block's outliers (an fp16 value and an int16 position each), per element."""
    bits = t.allocated_bits * D if t.allocated_bits else {"fp16": 16, "fp8_e4m3": 8, "int8": 8, "int4": 4, "int3": 3, "int2": 2}[t.dtype] * D
    bits += t.outliers * 32 / bs if t.outliers else 0
    per = 16 * (1 if t.symmetric else 2)
    if t.granularity == "per_token":
        bits += per
    elif t.granularity == "per_token_group":
        bits += per * (D // t.group_size)
    elif t.granularity == "per_block_channel":
        bits += per * D / bs  # one per channel, over the block's tokens
    return bits / D


@pytest.mark.parametrize("D, bs", [(24, 16), (40, 8), (64, 64), (8, 3)])
def test_bits_per_element_is_the_naive_count(D, bs):
    for t in valid_tensor_formats():
        if t.group_size and D % t.group_size:
            continue
        assert t.bits_per_element(D, bs) == pytest.approx(naive_bits(t, D, bs)), t.short()
    with pytest.raises(ValueError, match="block size"):
        parse_tensor_spec("int4:bchannel").bits_per_element(D)


# ---------------------------------------------------------------- KVFormat rules, specs


@pytest.mark.parametrize("name, spec, pool_bits", [
    ("fp16", "k=fp16,v=fp16", 16.0),
    ("fp8", "k=fp8_e4m3:tensor:sym,v=fp8_e4m3:tensor:sym", 8.0),
    ("int8-static", "k=int8:tensor:sym,v=int8:tensor:sym,shared", 8.0),
    ("int8", "k=int8:bchannel:sym,v=int8:token:sym,block=64", 8.25),
    ("int4", "k=int4:bchannel:asym:hadamard,v=int4:g32:sym:hadamard,block=64,sink=4", 4.5),
    ("int3", "k=int8:bchannel:asym:prerope:alloc3.5,v=int3:token:sym:hadamard:nuq,block=128,sink=4", 3.5),
    ("int2", "k=int8:bchannel:asym:prerope:alloc2.25:out16,v=int2:token:sym:hadamard:nuq:out48,block=128,sink=4", 2.5),
])
def test_presets(name, spec, pool_bits):
    p = get_format(name)
    assert p is PRESETS[name] and p.name == name and p.spec() == spec and p.description
    assert p.pool_bits_per_element(64) == pytest.approx(pool_bits)
    assert get_format(spec).model_copy(update={"name": name, "description": p.description}) == p
    assert list(PRESETS) == ["fp16", "fp8", "int8-static", "int8", "int4", "int3", "int2"]


def random_kv_spec(rng: random.Random) -> str:
    def tensor():
        dtype = rng.choice(["fp16", "int8", "int4", "int3", "int2", "fp8"])
        if dtype == "fp16":
            return "fp16"
        gran = rng.choice(["tensor", "head", "channel", "token", "g8", "g16", "bchannel"])
        sym = "sym" if dtype == "fp8" or gran in ("tensor", "head", "channel") else rng.choice(["sym", "asym"])
        words = [dtype, gran, sym] + [w for w in ("smooth", "hadamard") if rng.random() < 0.3]
        if gran == "bchannel" and rng.random() < 0.3:
            words.append("mse")
        return ":".join(words)

    spec = f"k={tensor()},v={tensor()},block={rng.choice([4, 16, 64])}"
    if rng.random() < 0.5:
        spec += f",sink={rng.randrange(0, 4)}"
    if rng.random() < 0.3:
        spec += ",layers=" + "|".join(f"{tensor()}/{tensor()}" for _ in range(rng.randrange(1, 4)))
    return spec


def test_random_specs_round_trip():
    rng = random.Random(7)
    done = 0
    for _ in range(300):
        spec = random_kv_spec(rng)
        if ",layers=" in spec:  # k / v must be layer 0's
            head, _, layers = spec.partition(",layers=")
            k0, v0 = layers.split("|")[0].split("/")
            spec = f"k={k0},v={v0}," + head.split(",", 2)[2] + ",layers=" + layers
        f = get_format(spec)
        again = get_format(f.spec())
        assert again.model_copy(update={"name": f.name}) == f, spec
        assert f.spec() == again.spec()
        done += 1
    assert done == 300


def test_spaces_around_spec_words_are_ignored():
    assert parse_tensor_spec(" int4 : g8 : asym ") == parse_tensor_spec("int4:g8:asym")
    assert parse_tensor_spec("int8::token:") == parse_tensor_spec("int8:token")
    assert get_format("k= int8:token , v=fp16 ,block= 16").spec() == "k=int8:token:sym,v=fp16,block=16"


@pytest.mark.parametrize("alias", ["fp8", "e4m3", "fp8_e4m3"])
def test_fp8_aliases(alias):
    assert parse_tensor_spec(f"{alias}:tensor").dtype == "fp8_e4m3"


def test_a_spec_names_itself_and_a_per_layer_spec_counts_its_layers():
    assert get_format("k=int8:token,v=int4:g8:sym,block=16").name == "k=int8:token,v=int4:g8:sym,block=16"
    f = get_format("k=int4:token:sym,v=int8:token,block=8,layers=int4:token:sym/int8:token|int2:token/int3:g8")
    assert f.name == "k=int4:token:sym,v=int8:token,block=8,layers=<2 layers>" and f.num_layers == 2 and f.is_per_layer
    assert f.spec() == "k=int4:token:sym,v=int8:token:sym,block=8,layers=int4:token:sym/int8:token:sym|int2:token:sym/int3:g8:sym"
    assert LayerStorage(k=parse_tensor_spec("int2:token"), v=parse_tensor_spec("fp16")).short() == "int2:token:sym/fp16"
    assert get_format(f) is f


@pytest.mark.parametrize("spec, words", [
    ("xyz", "unknown KV format 'xyz'"),
    ("k=fp16", "is missing v="),
    ("v=fp16", "is missing k="),
    ("k=,v=fp16", "empty tensor spec"),
    ("k=int4:zz,v=fp16", "unknown word 'zz'"),
    ("k=int4:token:sym:sym,v=fp16", "repeated word 'sym'"),
    ("k=int4:token:sym:asym,v=fp16", "conflicting symmetry words 'sym' and 'asym'"),
    ("k=int4:token:g8,v=fp16", "conflicting granularity words 'token' and 'g8'"),
    ("k=int4:token:hadamard:hadamard,v=fp16", "repeated word 'hadamard'"),
    ("k=int4:g8x,v=fp16", "unknown word 'g8x'"),
    ("k=int4:g,v=fp16", "unknown word 'g'"),
    ("k=fp8:tensor,v=e5m2:tensor", "dtype: Input should be"),
    ("k=int9:token,v=fp16", "dtype: Input should be"),
    ("k=fp16,v=fp16,bogus=1", "unknown field 'bogus'"),
    ("k=fp16,v=fp16,k=fp16", "repeated field 'k=fp16' and 'k=fp16': give k once"),
    ("k=fp16,v=fp16,block=x", "invalid literal"),
    ("k=fp16,v=fp16,block=0", "block_size: Input should be greater than or equal to 1 (got 0)"),
    ("k=fp16,v=fp16,block=64,sink=17", "sink_tokens: Input should be less than or equal to 16 (got 17)"),
    ("k=fp16,v=fp16,sink=2", "sink=2 needs sealed blocks of more than 2 tokens"),
    ("k=fp16,v=fp16,block=4,sink=4", "sink=4 needs sealed blocks of more than 4 tokens"),
    ("k=fp16,v=fp16,shared", "shared_kv_scale needs per_tensor static scales on both K and V"),
    ("k=int8:tensor,v=int8:head,shared", "shared_kv_scale needs per_tensor"),
    ("k=fp16,v=fp16,shared=1", "unknown field 'shared'"),
    ("k=int4:bchannel,v=fp16", "per_block_channel (bchannel) scales need sealed blocks"),
    ("k=int4:tensor:asym,v=fp16", "asymmetric"),
    ("k=int8:token,v=int8:token,layers=int4:token:sym/int8:token", "must be its layer 0's"),
    ("k=int8:tensor,v=int8:tensor,shared,layers=int8:tensor/int8:tensor", "shared_kv_scale is per-tensor static: not for a per-layer format"),
    ("k=int8:token,v=int8:token,layers=int8:token/int8:token|int4:bchannel/int8:token", "layer 1: per_block_channel"),
    ("k=int8:token,v=int8:token,layers=int8:token/int8:token|int8:token/int4:bchannel", "layer 1: per_block_channel"),
    ("k=int8:token,v=int8:token,layers=int8:token/int4:token:sym", "must be its layer 0's"),
])
def test_every_parse_error_is_one_line_naming_the_problem(spec, words):
    with pytest.raises(TrtkvError) as info:
        get_format(spec)
    problem = info.value.problem
    assert words in problem and "\n" not in str(info.value) and "Value error" not in problem
    if not problem.startswith(("unknown KV format", "KV format")):
        assert problem.startswith(f"invalid KV format {spec!r}: ")
    assert "preset" in info.value.fix or "add " in info.value.fix


def test_json_files(tmp_path):
    p = tmp_path / "f.json"
    p.write_text(PRESETS["int4"].model_dump_json())
    assert get_format(str(p)) == PRESETS["int4"]
    with pytest.raises(TrtkvError, match="does not exist"):
        get_format(str(tmp_path / "none.json"))
    p.write_text("{ not json")
    with pytest.raises(TrtkvError, match="invalid KV format"):
        get_format(str(p))
    p.write_text(json.dumps({"name": "x", "k": {"dtype": "int8"}, "v": {"dtype": "fp16"}}))
    with pytest.raises(TrtkvError) as info:
        get_format(str(p))
    assert "k: int8 needs a scale granularity" in info.value.problem and "Value error" not in info.value.problem
    p.write_text(json.dumps({"name": "x", "v": {"dtype": "fp16"}}))
    with pytest.raises(TrtkvError, match="k: Field required") as info:
        get_format(str(p))
    assert "(got" not in info.value.problem


# ---------------------------------------------------------------- KVFormat properties and byte counts


def test_layer_i_is_that_layers_storage_with_the_formats_blocks_and_sinks():
    f = get_format("k=int4:bchannel:asym,v=int8:token,block=16,sink=3,layers=int4:bchannel:asym/int8:token|int2:token:asym/int3:g8")
    l1 = f.layer(1)
    assert (l1.name, l1.k.short(), l1.v.short(), l1.block_size, l1.sink_tokens, l1.layers) == (
        f.name + "[1]", "int2:token:asym", "int3:g8:sym", 16, 3, ())
    assert f.layer(0).k == f.k and [x.name for x in f.layer_formats()] == [f.name + "[0]", f.name + "[1]"]
    plain = PRESETS["int4"]
    assert plain.layer(5) is plain and plain.layer_formats() == [plain] and plain.num_layers is None and not plain.is_per_layer
    f.check_layers(2)
    plain.check_layers(7)
    for n in (1, 3):
        with pytest.raises(TrtkvError, match=f"storage for 2 layers but the model has {n}"):
            f.check_layers(n)


def test_with_block_size():
    p = PRESETS["int4"]
    assert p.with_block_size(64) is p
    b = p.with_block_size(16)
    assert (b.name, b.block_size, b.sink_tokens, b.k, b.v) == ("int4@block16", 16, 4, p.k, p.v)
    assert p.with_block_size(6).sink_tokens == 3 and p.with_block_size(4).sink_tokens == 2  # capped at half a block
    assert b.with_block_size(32).name == "int4@block32"
    assert PRESETS["fp16"].with_block_size(8).block_size == 8 and PRESETS["fp16"].with_block_size(8).sink_tokens == 0
    per = get_format("k=int8:token,v=int8:token,block=8,sink=2,layers=int8:token/int8:token|int4:token:sym/int8:token")
    w = per.with_block_size(32)
    assert w.layers == per.layers and w.layer(1).block_size == 32 and w.sink_tokens == 2


@pytest.mark.parametrize("spec, quantized, calibrated, sealed", [
    ("fp16", False, False, False), ("int8-static", True, True, False), ("k=int8:token,v=int8:token", True, False, False),
    ("int4", True, False, True), ("int3", True, True, True), ("k=int4:token:asym:smooth,v=int4:token", True, True, False),
    ("k=fp16,v=int8:token", True, False, False), ("k=int8:head,v=fp16", True, True, False),
    ("k=int8:token,v=int8:token,layers=int8:token/int8:token|int8:token/int8:channel", True, True, False),
    ("k=fp16,v=fp16,layers=fp16/fp16|int8:token/fp16", True, False, False),
])
def test_traits(spec, quantized, calibrated, sealed):
    f = get_format(spec)
    assert (f.is_quantized, f.needs_calibration, f.sealed) == (quantized, calibrated, sealed)


def _fits(spec: str, D: int) -> bool:
    return not any((t.group_size and D % t.group_size) or (t.allocated_bits and t.allocated_bits * D % 8)
                   for lf in get_format(spec).layer_formats() for t in (lf.k, lf.v))


@pytest.mark.parametrize("spec, H, D", [(spec, H, D) for spec in [
    "int8", "int4", "int3", "int2", "fp16", "k=int8:token,v=int8:token", "k=int4:g32,v=int4:g32", *CALIBRATION_FREE.values(),
    "k=int8:token,v=int4:bchannel:asym,block=8,sink=3,layers=int8:token/int4:bchannel:asym|int2:g8:asym/int3:token"]
    for H, D in [(2, 24), (3, 64), (1, 40)] if _fits(spec, D)])
def test_bytes_are_the_naive_count(spec, H, D):
    f = get_format(spec)
    bs = f.block_size or 64
    per_layer = [(naive_bits(lf.k, D, bs) + naive_bits(lf.v, D, bs)) / 2 for lf in f.layer_formats()]
    pool = sum(per_layer) / len(per_layer)
    assert f.pool_bits_per_element(D) == pytest.approx(pool)
    tail_rows = (f.block_size or 0) + f.sink_tokens
    assert f.tail_rows == tail_rows and f.tail_bytes(H, D) == H * tail_rows * D * 2
    L = f.num_layers or 5
    assert f.tail_bytes_per_slot(L, H, D) == 2 * L * H * tail_rows * D * 2
    for ctx in (1, bs - 1, bs, 3 * bs + 5, 1000):
        if f.block_size is None:
            want = pool
        else:
            sealed = (ctx // bs) * bs
            want = (sealed * pool + tail_rows * 16) / ctx  # the slot's fp16 rows are paid once, whatever the context
        assert f.bits_per_element(D, ctx) == pytest.approx(want), ctx
        assert f.kv_bytes_per_token(L, H, D, ctx) == pytest.approx(2 * L * H * D * want / 8)
    assert f.bits_per_element(D) == pytest.approx(pool) and f.kv_bytes_per_token(L, H, D) == pytest.approx(2 * L * H * D * pool / 8)


# ---------------------------------------------------------------- fitting to a head_dim


@pytest.mark.parametrize("spec, D, kg, vg, note", [
    ("k=int4:g64,v=int4:g64", 32, 32, 32, "K g64->g32, V g64->g32"),
    ("k=int4:g64,v=int8:token", 48, 48, None, "K g64->g48"),
    ("k=int8:token,v=int4:g64", 80, None, 40, "V g64->g40"),
    ("k=int4:g64,v=int4:g64", 96, 48, 48, "K g64->g48, V g64->g48"),
    ("k=int4:g32,v=int4:g7", 70, 14, 7, "K g32->g14"),
])
def test_group_sizes_become_the_largest_divisor_up_to_them(spec, D, kg, vg, note):
    f, got = fit_format(get_format(spec), D)
    assert (f.k.group_size, f.v.group_size) == (kg, vg)
    assert got == f"{spec} at head_dim {D}: {note}" and f.description.endswith(f"[fitted to head_dim {D}]")


def test_fitting_leaves_a_fitting_format_alone_and_notes_hadamard_blocks():
    p = PRESETS["int4"]
    assert fit_format(p, 64) == (p, None) and fit_format(p, 128) == (p, None)
    f, note = fit_format(p, 96)  # 32 | 96: Hadamard blocks of 32; g32 fits
    assert f is p and note == "int4 at head_dim 96: Hadamard blocks of 32"
    f, note = fit_format(p, 80)  # V's g32: 20 is the largest divisor of 80 up to 32; 16 the largest power of two in 80
    assert note == "int4 at head_dim 80: V g32->g20, Hadamard blocks of 16" and f.v.group_size == 20 and f.k == p.k
    f, note = fit_format(get_format("k=int4:g64:hadamard,v=int8:token"), 48)
    assert note == "k=int4:g64:hadamard,v=int8:token at head_dim 48: K g64->g48, Hadamard blocks of 16"


@pytest.mark.parametrize("spec, D, why", [
    ("int4", 63, "even head_dim"),
    ("k=int3:token,v=int3:token", 20, "multiple of 8"),
    ("k=int8:token:hadamard,v=fp16", 25, "Hadamard rotation needs an even head_dim"),
    ("k=int4:g3,v=fp16", 1, "no group size from 2 to 3 divides head_dim 1"),
])
def test_a_format_that_cannot_fit_says_why(spec, D, why):
    f, note = fit_format(get_format(spec), D)
    assert f is None and why in note and note.startswith(get_format(spec).name + ": ")


def test_fit_formats_fits_presets_refuses_written_group_sizes_and_skips_optional_ones():
    fmts, notes = fit_formats(["int4", "int8", "k=int8:token,v=int8:token"], 48)
    assert [f.v.group_size for f in fmts[:1]] == [24] and notes == ["int4 at head_dim 48: V g32->g24, Hadamard blocks of 16"]
    with pytest.raises(TrtkvError, match="group size 32 does not divide the model's head_dim 48") as info:
        fit_formats(["k=int4:g32,v=int8:token"], 48)
    assert "g12, g16, g24" in info.value.fix
    impostor = PRESETS["int4"].model_copy(update={"v": parse_tensor_spec("int4:g32:sym")})  # named int4, not the preset
    with pytest.raises(TrtkvError, match="group size 32 does not divide"):
        fit_formats([impostor], 48)
    fmts, notes = fit_formats(["k=int4:g32,v=int8:token"], 48, optional=True)
    assert fmts[0].k.group_size == 24
    fmts, notes = fit_formats(["int8", "int4", "int3"], 63, optional=True)
    assert [f.name for f in fmts] == ["int8"] and len(notes) == 2 and all(n.startswith("skipped ") for n in notes)
    with pytest.raises(TrtkvError) as info:
        fit_formats(["int3"], 12)  # its values: int3 codes in bit planes
    assert "int3 needs a head_dim that is a multiple of 8" in info.value.fix and "hadamard" not in info.value.fix
    with pytest.raises(TrtkvError) as info:
        fit_formats(["int4"], 63)
    assert "int4 needs a head_dim that is a multiple of 2" in info.value.fix and "hadamard needs an even head_dim" in info.value.fix


def test_fit_format_may_take_the_whole_head_dim_as_the_group():
    """A group size that does not divide head_dim becomes the largest
    divisor of head_dim up to it -- head_dim itself when the group is larger (g64 -> g32 at 32, g80 -> g48 at 48)."""
    from trtkv.formats import fit_format

    for g, d in ((64, 32), (80, 48)):
        fmt, note = fit_format(get_format(f"k=int4:g{g}:sym,v=int8:g{g}:sym"), d)
        assert (fmt.k.group_size, fmt.v.group_size) == (d, d) and f"K g{g}->g{d}" in note and f"V g{g}->g{d}" in note
    fmt, note = fit_format(get_format("k=int4:g64:sym,v=int4:g64:sym"), 96)  # 64 does not divide 96: 48 does
    assert fmt.k.group_size == 48


def test_a_per_layer_formats_k_and_v_must_be_its_layer_0s():
    """A per-layer format's k / v are layer 0's; a spec whose v differs is refused."""
    ok = get_format("k=int4:token:sym,v=int8:token,layers=int4:token:sym/int8:token|int8:token/int8:token")
    assert ok.layer(0).v == ok.v and ok.num_layers == 2
    for spec in ("k=int4:token:sym,v=int4:token:sym,layers=int4:token:sym/int8:token|int8:token/int8:token",
                 "k=int8:token,v=int8:token,layers=int4:token:sym/int8:token|int8:token/int8:token"):
        with pytest.raises(TrtkvError, match="must be its layer 0's"):
            get_format(spec)


def test_a_spec_with_mse_round_trips():
    """Spec() is the inverse of the parser, mse included."""
    fmt = get_format("k=int4:bchannel:asym:hadamard:mse,v=int4:g8:sym,block=16")
    assert fmt.k.mse and get_format(fmt.spec()) == fmt.model_copy(update={"name": fmt.spec()})


def test_a_format_with_one_quantized_side_is_quantized():
    """A format that stores K in fp16 and V in int8 is a quantized format."""
    assert get_format("k=fp16,v=int8:token").is_quantized
    assert not get_format("k=fp16,v=fp16").is_quantized
