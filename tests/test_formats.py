"""trtkv.formats: the dtype traits table, presets, spec strings, JSON, and bit/byte accounting."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from trtkv.errors import TrtkvError
from trtkv.formats import (
    CALIBRATION_FREE,
    DTYPES,
    DYNAMIC_GRANULARITIES,
    PRESETS,
    RETIRED,
    SCALE_BITS,
    SPEC_HELP,
    STATIC_GRANULARITIES,
    KVFormat,
    TensorFormat,
    fit_format,
    get_format,
    parse_tensor_spec,
)

KIB = 1024


# ----------------------------------------------------------------------------- traits table


def test_dtype_traits_table():
    assert set(DTYPES) == {"fp16", "fp8_e4m3", "int8", "int4", "int3", "int2"}
    for name, tr in DTYPES.items():
        assert tr.name == name
        if len(tr.planes) <= 1:
            assert tr.storage.itemsize * 8 == tr.bits * tr.codes_per_byte  # one storage element holds codes_per_byte codes
        assert sum(tr.planes) == (tr.bits if tr.packed else 0)  # bit planes cover every bit of a packed code
        assert tr.packed_dim(64) * tr.storage.itemsize * 8 == 64 * tr.bits  # a row of 64 codes fills whole elements
        assert tr.packed_bytes_per_code == tr.bits / 8
        if tr.is_int:
            assert (tr.sym_min, tr.sym_max) == (-(2 ** (tr.bits - 1)), 2 ** (tr.bits - 1) - 1)
            assert tr.asym_max == 2**tr.bits - 1
    assert DTYPES["int4"].codes_per_byte == 2 and DTYPES["int4"].storage == torch.uint8
    assert DTYPES["int2"].codes_per_byte == 4 and DTYPES["int2"].row_align == 4 and DTYPES["int2"].code_offset == 2
    assert DTYPES["int3"].planes == (2, 1) and DTYPES["int3"].row_align == 8 and DTYPES["int3"].code_offset == 4
    assert [DTYPES[n].packed_dim(128) for n in ("int4", "int3", "int2")] == [64, 48, 32]
    with pytest.raises(ValueError, match="bit planes"):
        _ = DTYPES["int3"].codes_per_byte
    assert DTYPES["int8"].storage == torch.int8
    assert DTYPES["fp8_e4m3"].storage == torch.uint8  # e4m3fn bit patterns
    assert DTYPES["fp8_e4m3"].sym_max == torch.finfo(torch.float8_e4m3fn).max == 448
    assert DTYPES["fp16"].sym_max == torch.finfo(torch.float16).max
    assert SCALE_BITS == 16


# ----------------------------------------------------------------------------- presets


def test_presets_are_the_handful_the_docs_name():
    """At most 8 names a user chooses among (``budget``, the name ``trtkv calibrate --budget`` saves, is the 8th); the
    torch-free list the --help texts read is the same, in order."""
    from trtkv.preset_names import BUDGET_NAME, KV_HELP, PRESET_NAMES

    assert len(PRESETS) + 1 <= 8 and BUDGET_NAME not in PRESETS
    assert tuple(PRESETS) == PRESET_NAMES == ("fp16", "fp8", "int8-static", "int8", "int4", "int3", "int2")
    assert all(f"{n}," in KV_HELP or f"{n})" in KV_HELP for n in PRESETS)
    for name, fmt in PRESETS.items():
        assert fmt.name == name and fmt.description
    assert not PRESETS["fp16"].is_quantized
    assert PRESETS["int8"].k == TensorFormat(dtype="int8", granularity="per_block_channel") and PRESETS["int8"].block_size == 64
    assert PRESETS["fp8"].k.dtype == PRESETS["fp8"].v.dtype == "fp8_e4m3" and PRESETS["fp8"].k.is_static
    assert PRESETS["int4"].k == TensorFormat(dtype="int4", granularity="per_block_channel", symmetric=False, hadamard=True)
    assert PRESETS["int4"].v.hadamard and PRESETS["int4"].block_size == 64 and PRESETS["int4"].sealed
    assert PRESETS["int8-static"].shared_kv_scale and PRESETS["int8-static"].needs_calibration
    for name in ("int3", "int2"):  # keys before RoPE with calibrated per-channel widths, values through calibrated codebooks
        k, v = PRESETS[name].k, PRESETS[name].v
        assert k.pre_rope and k.allocated_bits and k.dtype == "int8" and v.codebook and v.dtype == name and v.hadamard
        assert PRESETS[name].block_size == 128 and PRESETS[name].sink_tokens == 4 and PRESETS[name].needs_calibration
    for name in ("int8", "int4"):  # dynamic scales and rotations only: usable without calibration
        assert not PRESETS[name].needs_calibration


def test_spec_help_lists_the_presets_and_the_pasted_error_is_the_real_one():
    """SPEC_HELP is generated from PRESETS; the invalid-spec error pasted in docs/kv-formats.md is what the CLI prints."""
    from typer.testing import CliRunner

    from trtkv.cli import app

    assert "use a preset (" + ", ".join(PRESETS) + ")" in SPEC_HELP
    with pytest.raises(TrtkvError) as e:
        get_format("int5")
    assert e.value.fix == SPEC_HELP
    res = CliRunner().invoke(app, ["eval", "--kv", "k=int5:token,v=int8:token"], terminal_width=1000)
    line = res.output.strip()
    assert res.exit_code == 2 and SPEC_HELP in line
    doc = (Path(__file__).resolve().parents[1] / "docs" / "kv-formats.md").read_text()
    assert line in doc.splitlines()


# the calibration-free layouts of the names the int3 / int2 presets took over (every engine path reads them)
INT3_FREE, INT2_FREE = CALIBRATION_FREE["int3"], CALIBRATION_FREE["int2"]
INT8_TOKEN = "k=int8:token:sym,v=int8:token:sym"  # int8 quantized on write (no sealed blocks)


@pytest.mark.parametrize("name", list(RETIRED))
def test_a_retired_name_answers_with_its_replacement_in_one_line(name):
    """Every retired preset or --budget-formats set name is refused with one line naming what replaces it, and the
    replacement is something ``get_format`` takes (a preset, a spec string, or presets to list)."""
    use, why = RETIRED[name]
    with pytest.raises(TrtkvError) as e:
        get_format(name)
    assert "\n" not in str(e.value) and name in e.value.problem and why in e.value.problem and use in e.value.fix
    assert name not in PRESETS
    for one in use.split(",") if "=" not in use else [use]:  # a set's replacement: a list of presets
        assert get_format(one).is_quantized


def test_the_retired_recipes_are_spelled_out_exactly():
    """The spec strings of the retired presets store what those presets stored (a few spot checks by field)."""
    assert get_format(RETIRED["int3-alloc"][0]) is PRESETS["int3"] and get_format(RETIRED["int2-alloc"][0]) is PRESETS["int2"]
    nuq3 = get_format(RETIRED["int3-nuq"][0])
    assert nuq3.k.pre_rope and nuq3.k.smooth_by == "queries" and nuq3.k.outliers == 128 and nuq3.v.codebook and nuq3.block_size == 128
    assert get_format(RETIRED["int3-nuq-kout64"][0]).k.outliers == 64 and get_format(RETIRED["int2-nuq-kout128"][0]).k.outliers == 128
    b128 = get_format(RETIRED["int4-b128"][0])
    assert (b128.k, b128.v, b128.sink_tokens, b128.block_size) == (PRESETS["int4"].k, PRESETS["int4"].v, 4, 128)
    assert not get_format(INT8_TOKEN).sealed and get_format(RETIRED["int8-token"][0]) == get_format(INT8_TOKEN)


@pytest.mark.parametrize("head_dim,k_out,v_out", [(64, 16, 48), (128, 32, 96), (256, 64, 192), (96, 16, 64), (32, 16, 16), (24, 16, 16)])
def test_int2_keeps_its_share_of_outliers_at_any_head_dim(head_dim, k_out, v_out):
    """A preset's outlier counts are per block at head_dim 64: fitted to a model they keep their share of a block's
    elements, in multiples of 16 (the kernels' tile), at least 16; a spec string keeps the counts it wrote."""
    fitted, note = fit_format(PRESETS["int2"], head_dim)
    assert (fitted.k.outliers, fitted.v.outliers) == (k_out, v_out)
    assert (note is None) == (head_dim == 64) or "Hadamard" in (note or "") or "alloc" in (note or "")
    spelled = get_format(PRESETS["int2"].spec())
    assert (fit_format(spelled, head_dim)[0] or spelled).v.outliers == 48


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
        None,
        False,
    ),
    ("k=int8:token,v=fp16", dict(dtype="int8", granularity="per_token"), dict(dtype="fp16"), None, False),
    (
        "k=fp8:tensor,v=fp8_e4m3:head,block=64",
        dict(dtype="fp8_e4m3", granularity="per_tensor"),
        dict(dtype="fp8_e4m3", granularity="per_head"),
        64,
        False,
    ),
    (
        "k=int4:bchannel:asym,v=int8:bchannel,block=32",
        dict(dtype="int4", granularity="per_block_channel", symmetric=False),
        dict(dtype="int8", granularity="per_block_channel"),
        32,
        False,
    ),
    ("k=int8:tensor,v=int8:tensor,shared", dict(dtype="int8", granularity="per_tensor"), dict(dtype="int8", granularity="per_tensor"), None, True),
    ("k=int8 : channel : smooth, v=int8:head ", dict(dtype="int8", granularity="per_channel", smooth=True), dict(dtype="int8", granularity="per_head"), None, False),
    ("k=int4:g32:sym,v=int4:g32", dict(dtype="int4", granularity="per_token_group", group_size=32), dict(dtype="int4", granularity="per_token_group", group_size=32), None, False),
    ("k=int8:g16:asym:hadamard,v=fp8:token", dict(dtype="int8", granularity="per_token_group", group_size=16, symmetric=False, hadamard=True),
     dict(dtype="fp8_e4m3", granularity="per_token"), None, False),
]


@pytest.mark.parametrize("spec,k,v,block,shared", INLINE, ids=[i[0].strip() for i in INLINE])
def test_inline_specs(spec, k, v, block, shared):
    fmt = get_format(spec)
    assert fmt.k == TensorFormat(**k) and fmt.v == TensorFormat(**v)
    assert fmt.block_size == block and fmt.shared_kv_scale == shared
    again = get_format(fmt.spec())
    assert _same_format(again, fmt) and again.spec() == fmt.spec()


def test_symmetry_is_the_default_of_a_spec_word():
    assert _same_format(get_format("k=int4:g32,v=int4:g32:sym"), get_format("k=int4:g32:sym,v=int4:g32:sym"))


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
@given(tensor_formats(), tensor_formats(), st.one_of(st.none(), st.integers(1, 4096)), st.booleans())
def test_every_valid_kv_format_round_trips(k, v, block, shared):
    shared = shared and k.granularity == v.granularity == "per_tensor"
    if block is None and (k.is_block_wise or v.is_block_wise):
        block = 64  # block-wise scales exist only in sealed blocks (test_validation_rules)
    fmt = KVFormat(name="x", k=k, v=v, block_size=block, shared_kv_scale=shared)
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
        dict(dtype="int5", granularity="per_token"),
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
    ("int5", ["unknown KV format", "'int5'"]),
    ("k=int5:token,v=int8:token", ["dtype", "'int5'"]),
    ("k=fp8:token:asym,v=fp8:token", ["symmetric only"]),
    ("k=int8:tensor:asym,v=int8:token", ["asymmetric", "dynamic"]),
    ("k=int4:g,v=int8:token", ["unknown word 'g'"]),
    ("k=int4:per_token_group,v=int8:token", ["unknown word 'per_token_group'"]),
    ("k=int8:token:fast,v=int8:token", ["unknown word 'fast'"]),
    ("k=int8:token,v=int8:token,foo=1", ["unknown field 'foo'"]),
    ("k=int8,v=int8:token", ["needs a scale granularity"]),
    ("k=fp16:token,v=fp16", ["fp16", "no scales"]),
    ("k=int4:g1,v=int4:token", ["group_size", "(got 1)"]),
    ("k=int8:token,v=int8:token,block=0", ["block_size", "(got 0)"]),
    ("k=int8:token,v=int8:token,block=many", ["'many'"]),
    ("k=int4:bchannel:asym,v=int8:token", ["bchannel", "sealed blocks", "block="]),
    ("k=int8:token,v=int8:token,shared", ["shared_kv_scale", "per_tensor"]),
    ("k=,v=int8:token", ["empty tensor spec"]),
    ("k=int8:token:tensor,v=int8:token", ["conflicting granularity words", "'token'", "'tensor'"]),
    ("k=int8:g32:token,v=int8:token", ["conflicting granularity words", "'g32'", "'token'"]),
    ("k=int8:token:sym:asym,v=int8:token", ["conflicting symmetry words", "'sym'", "'asym'"]),
    ("k=int4:g64:smooth:smooth,v=int4:token", ["repeated word 'smooth'"]),
    ("k=int8:token,v=int8:token,k=int4:token", ["repeated field", "'k=int8:token'", "'k=int4:token'"]),
    ("k=int8:token,v=int8:token,block=4,block=8", ["repeated field", "'block=4'", "'block=8'"]),
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


@pytest.mark.parametrize("spec,missing", [("k=int8:token", "v="), ("v=int8:token,block=4", "k=")])
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
    assert get_format(INT8_TOKEN).k.bits_per_element(128) == 8 + 16 / 128
    assert get_format(INT8_TOKEN).bits_per_element(128) == 8.125
    # LLaMA-7B: per token, layer and KV head: K 128 + 2 bytes, V 128 + 2 bytes
    assert get_format(INT8_TOKEN).kv_bytes_per_token(32, 32, 128) == 32 * 32 * 2 * (128 + 2)
    assert get_format(INT8_TOKEN).bits_per_element(64) == 8 + 16 / 64
    # the int8 preset: keys one fp16 scale per channel per block of 64 (8 + 16/64 at any head_dim)
    assert PRESETS["int8"].pool_bits_per_element(128) == (8 + 16 / 64 + 8 + 16 / 128) / 2


def test_int4_asym_g64_is_4_5_bits():
    # head_dim 128: two groups, each with an fp16 scale and an fp16 zero: 4 + 2*2*16/128 = 4.5
    fmt = get_format("k=int4:g64:asym:smooth:hadamard,v=int4:g64:asym:hadamard")
    assert fmt.k.bits_per_element(128) == 4.5
    assert fmt.bits_per_element(128) == 4.5
    # per token, layer, head: K 64 code bytes + 2 groups x 4 bytes; V the same
    assert fmt.kv_bytes_per_token(32, 32, 128) == 32 * 32 * 2 * (64 + 8)
    # the int4 preset: keys per channel per block of 64 (fp16 scale + zero per channel per 64 tokens,
    # 4 + 32/64 = 4.5 at any head_dim), values symmetric groups of 32 (4 + 16/32 = 4.5)
    assert PRESETS["int4"].k.bits_per_element(128, 64) == PRESETS["int4"].k.bits_per_element(64, 64) == 4.5
    assert PRESETS["int4"].pool_bits_per_element(128) == 4.5
    assert PRESETS["int4"].pool_bits_per_element(64) == 4.5
    # symmetric g32: 4 + 16/32 = 4.5 as well (one fp16 scale per 32 codes)
    assert get_format("k=int4:g32:sym,v=int4:g32:sym").bits_per_element(128) == 4.5
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


def test_sealed_block_formats_count_the_open_block_per_sequence():
    fmt = PRESETS["int4"]  # sealed blocks of 64 and 4 sink tokens, 4.5 pool bits at head_dim 64
    assert fmt.pool_bits_per_element(64) == 4.5 and fmt.bits_per_element(64) == 4.5  # long-context limit
    # one sequence of 512 tokens: 8 sealed blocks at 4.5 bits plus 68 reserved fp16 rows (open block + sinks)
    assert fmt.bits_per_element(64, 512) == (512 * 4.5 + 68 * 16) / 512 == 6.625
    # 500 tokens: 7 sealed blocks (448 tokens), 52 in the open block, which reserves 64
    assert fmt.bits_per_element(64, 500) == (448 * 4.5 + 68 * 16) / 500
    # a context shorter than a block costs the whole reservation
    assert fmt.bits_per_element(64, 10) == 68 * 16 / 10
    # SmolLM2-135M (30 layers, 3 KV heads, head_dim 64): the open blocks and sink rows of one slot, K and V, fp16
    assert fmt.tail_bytes_per_slot(30, 3, 64) == 2 * 30 * 3 * 68 * 64 * 2
    assert fmt.kv_bytes_per_token(30, 3, 64, 512) == (512 * 2 * 30 * 3 * 36 + 2 * 30 * 3 * 68 * 64 * 2) / 512
    assert get_format("int8").tail_bytes_per_slot(30, 3, 64) == 2 * 30 * 3 * 64 * 64 * 2  # no sink tokens
    # block-wise scales are amortised over the block: bchannel at block 16 costs 4 + 32/16 bits
    assert get_format("k=int4:bchannel:asym,v=int4:bchannel:asym,block=16").pool_bits_per_element(64) == 6.0
    # quantize-on-write formats reserve nothing
    assert get_format(INT8_TOKEN).tail_bytes_per_slot(30, 3, 64) == 0
    assert get_format(INT8_TOKEN).bits_per_element(64, 512) == get_format(INT8_TOKEN).bits_per_element(64)


def test_sink_tokens_spec_round_trip_and_errors():
    fmt = get_format("k=int4:bchannel:asym,v=int4:g32:sym:hadamard,block=64,sink=4")
    assert fmt.sink_tokens == 4 and fmt.tail_rows == 68 and fmt.spec().endswith(",block=64,sink=4")
    assert get_format(fmt.spec()) == fmt.model_copy(update={"name": fmt.spec()})
    assert PRESETS["int4"].sink_tokens == 4 and PRESETS["int8"].sink_tokens == 0
    for bad, why in (("k=int8:token,v=int8:token,sink=2", "needs sealed blocks"),
                     ("k=int8:token,v=int8:token,block=4,sink=4", "needs sealed blocks of more than 4"),
                     ("k=int8:token,v=int8:token,block=64,sink=17", "sink_tokens"),
                     ("k=int8:token,v=int8:token,block=64,sink=2,sink=3", "repeated field")):
        with pytest.raises(TrtkvError, match=why):
            get_format(bad)
    # re-blocked for a small cache, sinks are capped at half a block
    assert PRESETS["int4"].with_block_size(4).sink_tokens == 2 and PRESETS["int4"].with_block_size(16).sink_tokens == 4


def test_with_block_size_names_the_variant():
    f = PRESETS["int8-static"].with_block_size(32)
    assert f.block_size == 32 and f.name == "int8-static@block32" and f.k == PRESETS["int8-static"].k
    assert f.with_block_size(16).name == "int8-static@block16"
    assert PRESETS["int4"].with_block_size(64) is PRESETS["int4"]


# ----------------------------------------------------------------------------- the codec in the DTYPES rows


def _fp8_value(byte: int) -> float:
    """e4m3fn by hand: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal; 0x7F / 0xFF are NaN."""
    s, e, m = byte >> 7, (byte >> 3) & 15, byte & 7
    if e == 15 and m == 7:
        return float("nan")
    mag = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


def _fp8_nearest_byte(x: float) -> int:
    """The e4m3fn byte nearest to x (ties to the even mantissa), by searching every finite byte."""
    assert x != 0  # (which zero is a matter of sign, not of nearness)
    finite = [(b, _fp8_value(b)) for b in range(256) if _fp8_value(b) == _fp8_value(b)]
    best = min(abs(v - x) for _, v in finite)
    (byte,) = [b for b, v in finite if abs(v - x) == best and (b & 1 == 0 or all(abs(w - x) > best for c, w in finite if c != b))]
    return byte


def _naive_stored(name: str, symmetric: bool, q: list[float]) -> list:
    """Storage elements of one row of code values q (floats), element by element."""
    if name == "fp16":
        return [struct.unpack("e", struct.pack("e", v))[0] for v in q]
    if name == "fp8_e4m3":
        return [_fp8_nearest_byte(v) for v in q]
    if name == "int8":
        return [int(v) for v in q]
    if name == "int4":
        off = 8 if symmetric else 0  # int4: two codes per byte, the even channel in the low nibble
        return [(int(q[2 * j]) + off) | ((int(q[2 * j + 1]) + off) << 4) for j in range(len(q) // 2)]
    if name == "int2":
        off = 2 if symmetric else 0  # four codes per byte, channel 4j + i in bits 2i, 2i + 1
        return [sum((int(q[4 * j + i]) + off) << (2 * i) for i in range(4)) for j in range(len(q) // 4)]
    assert name == "int3"  # a 2-bit plane (the low bits, four per byte), then a 1-bit plane (the top bit, eight per byte)
    u = [int(v) + (4 if symmetric else 0) for v in q]
    low = [sum((u[4 * j + i] & 3) << (2 * i) for i in range(4)) for j in range(len(u) // 4)]
    top = [sum((u[8 * j + i] >> 2) << i for i in range(8)) for j in range(len(u) // 8)]
    return low + top


CODEC_CASES = [(n, s) for n in DTYPES for s in (True, False) if not (n in ("fp16", "fp8_e4m3") and not s)]


@pytest.mark.parametrize("name,symmetric", CODEC_CASES)
def test_encode_decode_match_a_naive_loop(name, symmetric):
    tr = DTYPES[name]
    g = torch.Generator().manual_seed(5)
    D = {"int4": 6, "int2": 12, "int3": 24}.get(name, 7)  # the smallest odd multiples of each packing's row
    shape = (3, 5, D)
    if tr.is_int:
        lo, hi = (tr.sym_min, tr.sym_max) if symmetric else (0, tr.asym_max)
        q = torch.randint(int(lo), int(hi) + 1, shape, generator=g).float()
    else:
        q = (torch.randn(shape, generator=g) * (100 if name == "fp8_e4m3" else 1000)).clamp(tr.sym_min, tr.sym_max)
    stored = tr.encode(q, symmetric)
    assert stored.dtype == tr.storage_for(symmetric) and stored.shape == (3, 5, D * tr.bits // (8 * stored.element_size()))
    for row_q, row_s in zip(q.reshape(-1, D).tolist(), stored.reshape(-1, stored.shape[-1])):
        got = row_s.view(torch.uint8).tolist() if name == "fp8_e4m3" else row_s.tolist()
        assert got == _naive_stored(name, symmetric, row_q)
    back = tr.decode(stored, symmetric)
    assert back.dtype == torch.float32 and back.shape == shape
    if tr.is_int:
        assert torch.equal(back, q)  # integer codes round-trip exactly
    else:
        for v, b in zip(back.flatten().tolist(), stored.flatten().tolist()):
            assert v == (_fp8_value(b) if name == "fp8_e4m3" else b)


def test_byte_table_by_hand():
    assert DTYPES["int4"].byte_table(True)[0xA3].tolist() == [3 - 8, 10 - 8]
    assert DTYPES["int4"].byte_table(False)[0xA3].tolist() == [3, 10]
    assert DTYPES["int8"].byte_table(False)[200].tolist() == [200]
    assert DTYPES["int8"].byte_table(True)[200].tolist() == [200 - 256]
    assert DTYPES["fp8_e4m3"].byte_table(True)[0x38].tolist() == [1.0]
    for b in range(256):  # every byte, by hand
        assert DTYPES["int4"].byte_table(True)[b].tolist() == [(b & 15) - 8, (b >> 4) - 8]
        assert DTYPES["int8"].byte_table(True)[b].tolist() == [b - 256 if b > 127 else b]
        v = _fp8_value(b)
        assert DTYPES["fp8_e4m3"].byte_table(True)[b].tolist() == [0.0 if v != v else v]
    assert DTYPES["int4"].byte_table(True).shape == (256, 2) and DTYPES["int8"].byte_table(True).shape == (256, 1)
    with pytest.raises(ValueError):
        DTYPES["fp16"].byte_table(True)


@pytest.mark.parametrize("name", ["int4", "int3", "int2"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_plane_tables_sum_to_the_codes_of_every_byte(name, symmetric):
    """Decoding by table lookups (the ONNX graph's Gathers): per plane, a byte's row holds what it adds to each of
    its channels; summed over planes they are the codes, checked against the naive bit loop for random rows."""
    tr = DTYPES[name]
    lo, hi = (tr.sym_min, tr.sym_max) if symmetric else (0, tr.asym_max)
    D = 40 if name == "int3" else 12
    q = torch.randint(int(lo), int(hi) + 1, (9, D), generator=torch.Generator().manual_seed(3)).float()
    for row in q.tolist():
        stored = _naive_stored(name, symmetric, row)
        got = [0.0] * D
        for table, (byte, width, _) in zip(tr.plane_tables(symmetric), tr.plane_layout(D)):
            per = 8 // width
            for c in range(D):
                got[c] += table[stored[byte + c // per], c % per].item()
        assert got == row
    if name == "int3":
        with pytest.raises(ValueError, match="bit planes"):
            tr.byte_table(symmetric)
    else:
        assert torch.equal(tr.byte_table(symmetric), tr.plane_tables(symmetric)[0])


@pytest.mark.parametrize("name,d,bits", [("int3", 64, 3.5), ("int2", 64, 2.5), ("int2", 128, 2.375), ("int3", 128, 3.5)])
def test_calibration_free_fewbit_layouts_pool_bits(name, d, bits):
    """The calibration-free layouts at block 64: int3 <= 3.5 pool bits, int2 <= 2.5, scales and zero-points included, by
    hand: keys 1 fp16 scale + 1 zero per channel per 64 tokens; int3 values 1 fp16 scale per 32 codes, int2 values an
    fp16 scale + zero per token row."""
    fmt = get_format(CALIBRATION_FREE[name])
    b = DTYPES[name].bits
    k = b + 32 / 64
    v = b + 16 / 32 if name == "int3" else b + 32 / d
    assert fmt.pool_bits_per_element(d) == (k + v) / 2 == bits
    assert fmt.sealed and fmt.block_size == 64 and fmt.sink_tokens == 4 and not fmt.needs_calibration
    assert fmt.k.packed_dim(d) == d * b // 8 and fmt.v.packed_dim(d) == d * b // 8


@pytest.mark.parametrize("name,d,bits", [("int3", 64, 3.5), ("int3", 128, 3.4375), ("int2", 64, 2.5), ("int2", 128, 2.4375)])
def test_fewbit_presets_pool_bits(name, d, bits):
    """The int3 / int2 presets by hand, fitted to the head_dim: keys ``alloc`` bits per element plus an fp16 step and
    minimum per channel per block of 128 (0.25 bits), key outliers 32 bits each; values the codes plus one fp16 scale
    per token row, value outliers (int2: 16 / 48 at head_dim 64, twice as many at 128)."""
    fmt = fit_format(PRESETS[name], d)[0]
    alloc = fmt.k.allocated_bits
    k = alloc + 32 / 128 + fmt.k.outliers * 32 / (128 * d)
    v = DTYPES[name].bits + 16 / d + fmt.v.outliers * 32 / (128 * d)
    assert fmt.pool_bits_per_element(d) == pytest.approx((k + v) / 2) == bits


def test_fewbit_round_trip_through_quantize_block_against_float64():
    """int3 / int2 block-channel keys: the stored codes decode to within half a step of a float64 reference of the
    same asymmetric per-channel quantization, at an odd number of tokens (rows) and a non-power-of-two head_dim."""
    from trtkv.quant import dequantize, quantize_block

    x = torch.randn(2, 3, 13, 24, generator=torch.Generator().manual_seed(7)) * 3
    for name in ("int3", "int2"):
        tf = parse_tensor_spec(f"{name}:bchannel:asym")
        qt = quantize_block(x, tf)
        assert qt.codes.shape == (2, 3, 13, 24 * DTYPES[name].bits // 8) and qt.codes.dtype == torch.uint8
        got = dequantize(qt, tf).double()
        xd = x.double()
        mn, mx = xd.amin(-2, keepdim=True), xd.amax(-2, keepdim=True)
        step = (mx - mn) / DTYPES[name].asym_max
        ref = ((xd - mn) / step).round().clamp(0, DTYPES[name].asym_max) * step + mn
        # fp16 scales / zeros: a code can land one step off at a rounding tie, never more
        assert ((got - ref).abs() <= step * 1.01 + 1e-3).all()
        assert (got - ref).abs().mean() < 0.05 * step.mean()


def test_check_head_dim_names_each_rule():
    with pytest.raises(TrtkvError, match="int4 packs two codes per byte and needs an even head_dim, got 25"):
        parse_tensor_spec("int4:token").check_head_dim(25)
    with pytest.raises(TrtkvError, match="Hadamard rotation needs an even head_dim, got 25"):
        parse_tensor_spec("int8:token:hadamard").check_head_dim(25)
    with pytest.raises(TrtkvError, match="group size 32 does not divide head_dim 48"):
        parse_tensor_spec("int8:g32").check_head_dim(48)
    with pytest.raises(TrtkvError, match=r"int3 packs bit planes \(2, 1\) and needs a head_dim that is a multiple of 8, got 20"):
        parse_tensor_spec("int3:token").check_head_dim(20)
    with pytest.raises(TrtkvError, match="int2 packs 4 codes per byte and needs a head_dim that is a multiple of 4, got 26"):
        parse_tensor_spec("int2:token").check_head_dim(26)
    for spec, d in (("int3:token", 24), ("int2:token", 20), ("int4:token", 26), ("int8:token", 25), ("int8:g5", 25), ("fp8:tensor", 7), ("int4:g16:hadamard", 48), ("fp16", 3)):
        parse_tensor_spec(spec).check_head_dim(d)  # fits: no error


@pytest.mark.parametrize("spec,want", [
    ("int8:token", ("L", 7, 3, 5, 1)),
    ("int4:g16:asym", ("L", 7, 3, 5, 3)),
    ("int4:bchannel:asym", ("L", 7, 3, 48)),
    ("int8:tensor", None),
    ("int8:channel", None),
    ("fp16", None),
])
def test_scale_shape(spec, want):
    assert parse_tensor_spec(spec).scale_shape(("L", 7), 3, 5, 48) == want
