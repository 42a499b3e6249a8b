"""trtkv.formats: the dtype traits table, presets, spec strings, JSON, and bit/byte accounting."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from trtkv.errors import TrtkvError
from trtkv.formats import (
    DTYPES,
    DYNAMIC_GRANULARITIES,
    PRESETS,
    SCALE_BITS,
    STATIC_GRANULARITIES,
    KVFormat,
    TensorFormat,
    get_format,
    parse_tensor_spec,
)

KIB = 1024


# ----------------------------------------------------------------------------- traits table


def test_dtype_traits_table():
    assert set(DTYPES) == {"fp16", "fp8_e4m3", "int8", "int4"}
    for name, tr in DTYPES.items():
        assert tr.name == name
        assert tr.storage.itemsize * 8 == tr.bits * tr.codes_per_byte  # one storage element holds codes_per_byte codes
        assert tr.packed_bytes_per_code == tr.bits / 8
        if tr.is_int:
            assert (tr.sym_min, tr.sym_max) == (-(2 ** (tr.bits - 1)), 2 ** (tr.bits - 1) - 1)
            assert tr.asym_max == 2**tr.bits - 1
    assert DTYPES["int4"].codes_per_byte == 2 and DTYPES["int4"].storage == torch.uint8
    assert DTYPES["int8"].storage == torch.int8
    assert DTYPES["fp8_e4m3"].storage == torch.uint8  # e4m3fn bit patterns
    assert DTYPES["fp8_e4m3"].sym_max == torch.finfo(torch.float8_e4m3fn).max == 448
    assert DTYPES["fp16"].sym_max == torch.finfo(torch.float16).max
    assert SCALE_BITS == 16


# ----------------------------------------------------------------------------- presets


def test_presets_exist_and_are_consistent():
    assert {"fp16", "int8", "fp8", "int4"} <= set(PRESETS)
    for name, fmt in PRESETS.items():
        assert fmt.name == name and fmt.description
    assert not PRESETS["fp16"].is_quantized
    assert PRESETS["int8"].k == TensorFormat(dtype="int8", granularity="per_token")
    assert PRESETS["fp8"].k.dtype == PRESETS["fp8"].v.dtype == "fp8_e4m3" and PRESETS["fp8"].k.is_static
    assert PRESETS["int4"].k.smooth and PRESETS["int4"].k.hadamard and not PRESETS["int4"].v.smooth
    assert PRESETS["int8-static"].shared_kv_scale and PRESETS["int8-static"].needs_calibration
    assert PRESETS["int4"].needs_calibration  # K smoothing factors come from calibration
    assert not PRESETS["int8"].needs_calibration and not PRESETS["int4-g32"].needs_calibration


def _same_format(a: KVFormat, b: KVFormat) -> bool:
    """Equal as a cache format (name and description are labels, not part of the spec string)."""
    drop = {"name", "description"}
    return a.model_dump(exclude=drop) == b.model_dump(exclude=drop)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_spec_and_json_round_trip(name, tmp_path):
    fmt = PRESETS[name]
    again = get_format(fmt.spec())
    assert _same_format(again, fmt) and again.spec() == fmt.spec()
    assert KVFormat.model_validate_json(fmt.model_dump_json()) == fmt
    path = tmp_path / f"{name}.json"
    path.write_text(fmt.model_dump_json(indent=2))
    assert get_format(str(path)) == fmt
    assert get_format(name) is fmt
    assert get_format(fmt) is fmt


# ----------------------------------------------------------------------------- spec strings

INLINE = [
    (
        "k=int4:g64:asym:smooth:hadamard,v=int4:token:asym",
        dict(dtype="int4", granularity="per_token_group", group_size=64, symmetric=False, smooth=True, hadamard=True),
        dict(dtype="int4", granularity="per_token", symmetric=False),
        0,
        False,
    ),
    ("k=int8:token,v=fp16", dict(dtype="int8", granularity="per_token"), dict(dtype="fp16"), 0, False),
    (
        "k=fp8:tensor,v=fp8_e4m3:head,recent=64",
        dict(dtype="fp8_e4m3", granularity="per_tensor"),
        dict(dtype="fp8_e4m3", granularity="per_head"),
        64,
        False,
    ),
    ("k=int8:tensor,v=int8:tensor,shared", dict(dtype="int8", granularity="per_tensor"), dict(dtype="int8", granularity="per_tensor"), 0, True),
    ("k=int8 : channel : smooth, v=int8:head ", dict(dtype="int8", granularity="per_channel", smooth=True), dict(dtype="int8", granularity="per_head"), 0, False),
    ("k=int4:g32:sym,v=int4:g32", dict(dtype="int4", granularity="per_token_group", group_size=32), dict(dtype="int4", granularity="per_token_group", group_size=32), 0, False),
    ("k=int8:g16:asym:hadamard,v=fp8:token", dict(dtype="int8", granularity="per_token_group", group_size=16, symmetric=False, hadamard=True), dict(dtype="fp8_e4m3", granularity="per_token"), 0, False),
]


@pytest.mark.parametrize("spec,k,v,recent,shared", INLINE, ids=[i[0].strip() for i in INLINE])
def test_inline_specs(spec, k, v, recent, shared):
    fmt = get_format(spec)
    assert fmt.k == TensorFormat(**k) and fmt.v == TensorFormat(**v)
    assert fmt.recent_tokens == recent and fmt.shared_kv_scale == shared
    again = get_format(fmt.spec())
    assert _same_format(again, fmt) and again.spec() == fmt.spec()


def test_inline_int4_g32_equals_preset():
    assert _same_format(get_format("k=int4:g32,v=int4:g32:sym"), PRESETS["int4-g32"])


@st.composite
def tensor_formats(draw) -> TensorFormat:
    """Any valid TensorFormat, built constructively (the rules are tested in test_validation_rules)."""
    dtype = draw(st.sampled_from(list(DTYPES)))
    if dtype == "fp16":
        return TensorFormat(dtype="fp16")
    gran = draw(st.sampled_from(STATIC_GRANULARITIES + DYNAMIC_GRANULARITIES))
    return TensorFormat(
        dtype=dtype,
        granularity=gran,
        group_size=draw(st.integers(2, 256)) if gran == "per_token_group" else None,
        symmetric=True if dtype == "fp8_e4m3" or gran in STATIC_GRANULARITIES else draw(st.booleans()),
        smooth=draw(st.booleans()),
        hadamard=draw(st.booleans()),
    )


@settings(max_examples=300, deadline=None)
@given(tensor_formats())
def test_every_valid_tensor_format_round_trips_through_its_short_spec(tf):
    assert parse_tensor_spec(tf.short()) == tf


@settings(max_examples=150, deadline=None)
@given(tensor_formats(), tensor_formats(), st.integers(0, 4096), st.booleans())
def test_every_valid_kv_format_round_trips(k, v, recent, shared):
    shared = shared and k.granularity == v.granularity == "per_tensor"
    fmt = KVFormat(name="x", k=k, v=v, recent_tokens=recent, shared_kv_scale=shared)
    again = get_format(fmt.spec())
    assert _same_format(again, fmt) and again.spec() == fmt.spec()
    assert KVFormat.model_validate_json(fmt.model_dump_json()) == fmt


def test_validation_rules():
    ok = [
        dict(dtype="fp16"),
        dict(dtype="int8", granularity="per_tensor"),
        dict(dtype="int4", granularity="per_token_group", group_size=32, symmetric=False),
        dict(dtype="fp8_e4m3", granularity="per_channel", smooth=True, hadamard=True),
    ]
    bad = [
        dict(dtype="fp16", granularity="per_token"),
        dict(dtype="fp16", hadamard=True),
        dict(dtype="fp16", group_size=32),
        dict(dtype="fp16", symmetric=False),
        dict(dtype="int8"),  # no granularity
        dict(dtype="fp8_e4m3", granularity="per_token", symmetric=False),
        dict(dtype="int4", granularity="per_token_group"),  # no group size
        dict(dtype="int4", granularity="per_token", group_size=32),
        dict(dtype="int8", granularity="per_head", symmetric=False),  # static asym
        dict(dtype="int4", granularity="per_token_group", group_size=1),
        dict(dtype="int2", granularity="per_token"),
        dict(dtype="int8", granularity="per_token", extra=1),
    ]
    for f in ok:
        TensorFormat(**f)
    for f in bad:
        with pytest.raises(ValidationError):
            TensorFormat(**f)
    with pytest.raises(ValidationError):  # shared scale needs per-tensor static K and V
        KVFormat(name="x", k=TensorFormat(dtype="int8", granularity="per_head"), v=TensorFormat(dtype="int8", granularity="per_head"), shared_kv_scale=True)


INVALID = [
    ("int3", ["unknown KV format", "'int3'"]),
    ("k=int3:token,v=int8:token", ["dtype", "'int3'"]),
    ("k=fp8:token:asym,v=fp8:token", ["symmetric only"]),
    ("k=int8:tensor:asym,v=int8:token", ["asymmetric", "dynamic"]),
    ("k=int4:g,v=int8:token", ["unknown word 'g'"]),
    ("k=int4:per_token_group,v=int8:token", ["unknown word 'per_token_group'"]),
    ("k=int8:token:fast,v=int8:token", ["unknown word 'fast'"]),
    ("k=int8:token,v=int8:token,foo=1", ["unknown field 'foo'"]),
    ("k=int8,v=int8:token", ["needs a scale granularity"]),
    ("k=fp16:token,v=fp16", ["fp16", "no scales"]),
    ("k=int4:g1,v=int4:token", ["group_size", "(got 1)"]),
    ("k=int8:token,v=int8:token,recent=-1", ["recent_tokens", "(got -1)"]),
    ("k=int8:token,v=int8:token,recent=many", ["'many'"]),
    ("k=int8:token,v=int8:token,shared", ["shared_kv_scale", "per_tensor"]),
    ("k=,v=int8:token", ["empty tensor spec"]),
    ("k=int8:token:tensor,v=int8:token", ["conflicting granularity words", "'token'", "'tensor'"]),
    ("k=int8:g32:token,v=int8:token", ["conflicting granularity words", "'g32'", "'token'"]),
    ("k=int8:token:sym:asym,v=int8:token", ["conflicting symmetry words", "'sym'", "'asym'"]),
    ("k=int4:g64:smooth:smooth,v=int4:token", ["repeated word 'smooth'"]),
    ("k=int8:token,v=int8:token,k=int4:token", ["repeated field", "'k=int8:token'", "'k=int4:token'"]),
    ("k=int8:token,v=int8:token,recent=4,recent=8", ["repeated field", "'recent=4'", "'recent=8'"]),
    ("does/not/exist.json", ["does not exist", "does/not/exist.json"]),
]


@pytest.mark.parametrize("spec,words", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_specs_name_problem_and_fix(spec, words):
    with pytest.raises(TrtkvError) as ei:
        get_format(spec)
    err = ei.value
    for w in words:
        assert w in err.problem, f"{w!r} not in {err.problem!r}"
    assert err.fix and "preset" in err.fix and "k=" in err.fix  # the fix: presets, a JSON file, or the grammar
    assert err.fix in str(err) and err.problem in str(err)


@pytest.mark.parametrize(
    "content,words",
    [
        ('{"name": "x", "k": {"dtype": "int4", "granularity": "per_token_group"}, "v": {"dtype": "fp16"}}', ["group_size"]),
        ('{"name": "x", "v": {"dtype": "fp16"}}', ["k", "Field required"]),
        ('{"name": "x", "k": {"dtype": "int9", "granularity": "per_token"}, "v": {"dtype": "fp16"}}', ["k.dtype", "'int9'"]),
        ('{"name": "x", "k": {"dtype": "fp16"}, "v": {"dtype": "fp16"}, "bits": 3}', ["bits", "Extra inputs"]),
        ("{not json", ["Expecting property name"]),
    ],
)
def test_invalid_json_files(tmp_path, content, words):
    path = tmp_path / "fmt.json"
    path.write_text(content)
    with pytest.raises(TrtkvError) as ei:
        get_format(str(path))
    for w in words:
        assert w in ei.value.problem, ei.value.problem
    assert str(path) in ei.value.problem


@pytest.mark.parametrize("spec,missing", [("k=int8:token", "v="), ("v=int8:token,recent=4", "k=")])
def test_missing_k_or_v_is_named(spec, missing):
    with pytest.raises(TrtkvError) as ei:
        get_format(spec)
    assert f"missing {missing}" in ei.value.problem and "unknown KV format" not in ei.value.problem
    assert missing in ei.value.fix


def test_group_size_must_divide_head_dim():
    tf = TensorFormat(dtype="int4", granularity="per_token_group", group_size=64)
    assert tf.groups(128) == 2 and tf.groups(64) == 1
    with pytest.raises(TrtkvError, match="does not divide head_dim 96") as ei:
        tf.groups(96)
    assert "divides" in ei.value.fix


# ----------------------------------------------------------------------------- bit / byte accounting


def test_llama7b_fp16_is_512_kib_per_token():
    # 2 (K and V) x 32 layers x 32 KV heads x 128 channels x 2 bytes = 524288 B = 512 KiB
    assert PRESETS["fp16"].bits_per_element(128) == 16
    assert PRESETS["fp16"].kv_bytes_per_token(32, 32, 128) == 512 * KIB


def test_int8_per_token_bits_and_bytes():
    # 128 int8 codes + one fp16 scale per token and head: 8 + 16/128 bits per element
    assert PRESETS["int8"].k.bits_per_element(128) == 8 + 16 / 128
    assert PRESETS["int8"].bits_per_element(128) == 8.125
    # LLaMA-7B: per token, layer and KV head: K 128 + 2 bytes, V 128 + 2 bytes
    assert PRESETS["int8"].kv_bytes_per_token(32, 32, 128) == 32 * 32 * 2 * (128 + 2)
    assert PRESETS["int8"].bits_per_element(64) == 8 + 16 / 64


def test_int4_asym_g64_is_4_5_bits():
    # head_dim 128: two groups, each with an fp16 scale and an fp16 zero: 4 + 2*2*16/128 = 4.5
    assert PRESETS["int4"].k.bits_per_element(128) == 4.5
    assert PRESETS["int4"].bits_per_element(128) == 4.5
    # per token, layer, head: K 64 code bytes + 2 groups x 4 bytes; V the same
    assert PRESETS["int4"].kv_bytes_per_token(32, 32, 128) == 32 * 32 * 2 * (64 + 8)
    # symmetric g32: 4 + 16/32 = 4.5 as well (one fp16 scale per 32 codes)
    assert PRESETS["int4-g32"].bits_per_element(128) == 4.5
    assert get_format("k=int4:g32:asym,v=int4:g32:asym").bits_per_element(128) == 5.0


def test_static_formats_carry_no_per_token_metadata():
    for name in ("int8-static", "fp8"):
        assert PRESETS[name].bits_per_element(128) == 8
        assert PRESETS[name].kv_bytes_per_token(32, 32, 128) == 256 * KIB
    assert get_format("k=int4:channel,v=int4:head").bits_per_element(64) == 4


def test_mixed_k_and_v():
    fmt = get_format("k=int4:g64:asym,v=int8:token")
    assert fmt.bits_per_element(128) == (4.5 + 8.125) / 2
    fmt = get_format("k=fp16,v=int4:token:asym")
    assert fmt.bits_per_element(64) == (16 + 4 + 32 / 64) / 2


def test_recent_tokens_counted_at_the_context_length():
    fmt = get_format("k=int4:g64:asym,v=int4:g64:asym,recent=128")
    # L = 512: 128 tokens in fp16 (16 bits), 384 quantized at 4.5 bits
    assert fmt.bits_per_element(128, 512) == (128 * 16 + 384 * 4.5) / 512 == 7.375
    # a context shorter than the window is all fp16
    assert fmt.bits_per_element(128, 100) == 16
    assert fmt.bits_per_element(128, 128) == 16
    # the long-context limit: the fp16 window vanishes
    assert fmt.bits_per_element(128) == 4.5
    assert fmt.bits_per_element(128, 10**9) == pytest.approx(4.5, abs=1e-5)
    # bytes at L = 512 for SmolLM2-135M (30 layers, 3 KV heads, head_dim 64): g64 = one group
    smol = (128 * (2 * 30 * 3 * 64 * 2) + 384 * (2 * 30 * 3 * (32 + 4))) / 512
    assert fmt.kv_bytes_per_token(30, 3, 64, 512) == smol
    assert PRESETS["int4"].bits_per_element(128, 512) == 4.5  # recent=0: context length irrelevant
