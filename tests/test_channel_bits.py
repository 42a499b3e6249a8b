"""``allocB`` formats -- each channel's code width allocated at calibration (calibration/channel_bits.py).

Every rule is checked against an independent reference (a naive loop, float64) on fresh random inputs of odd sizes.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from conftest import random_widths

from trtkv.errors import TrtkvError
from trtkv.formats import OUTLIER_BITS, SCALE_BITS, channel_offsets, get_format, pack_channel_codes, parse_tensor_spec, unpack_channel_codes
from trtkv.quant import TensorParams, dequantize, quantize_block

H, BS, D = 3, 7, 24  # odd heads and block; head_dim 24: alloc2 rows are 6 bytes


def _tf(spec: str):
    return get_format(f"k={spec},v=fp16,block={BS}").k


def _widths(tf, heads=H, dim=D, seed=0):
    return random_widths(tf, heads, dim, torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- the format


def test_spec_word_round_trips_and_counts_its_bytes_by_hand():
    tf = parse_tensor_spec("int8:bchannel:asym:prerope:alloc2.375:out32")
    assert tf.allocated_bits == 2.375 and tf.short() == "int8:bchannel:asym:prerope:alloc2.375:out32"
    assert parse_tensor_spec(tf.short()) == tf
    assert tf.channel_widths == tuple(range(9)) and parse_tensor_spec("int4:bchannel:asym:alloc3").channel_widths == (0, 1, 2, 3, 4)
    # a block of 128 x head_dim 64: 19-byte rows, an fp16 step and minimum per channel, 32 outliers of 32 bits
    assert tf.packed_dim(64) == 19
    hand = (128 * 19 * 8 + 64 * 2 * SCALE_BITS + 32 * OUTLIER_BITS) / (128 * 64)
    assert tf.bits_per_element(64, 128) == pytest.approx(hand) == 2.75
    assert get_format("int2").pool_bits_per_element(64) == pytest.approx((2.5625 + 2.4375) / 2)
    assert get_format("int3").pool_bits_per_element(64) == pytest.approx(3.5)
    assert get_format("int2").needs_calibration and get_format("int3").k.pre_rope


@pytest.mark.parametrize("spec,match", [
    ("int8:bchannel:sym:alloc2", "asymmetric block-channel"),
    ("int8:token:asym:alloc2", "asymmetric block-channel"),
    ("int8:bchannel:asym:hadamard:alloc2", "no nuq, mse or hadamard"),
    ("int4:bchannel:asym:mse:alloc2", "no nuq, mse or hadamard"),
    ("int4:bchannel:asym:alloc5", "widest code"),
    ("fp8:bchannel:sym:alloc2", "int codes"),
    ("int8:bchannel:asym:alloc2:alloc3", "repeated|conflicting"),
])
def test_bad_alloc_specs_are_one_line_errors(spec, match):
    with pytest.raises(TrtkvError) as e:
        get_format(f"k={spec},v=fp16,block=8")
    assert re.search(match, str(e.value)) and "\n" not in str(e.value)


def test_rows_that_are_not_whole_bytes_are_refused_with_a_fitting_suggestion():
    tf = _tf("int8:bchannel:asym:alloc2.3")
    with pytest.raises(TrtkvError, match="not whole bytes") as e:
        tf.check_head_dim(64)
    assert "\n" not in str(e.value) and "alloc2.25" in str(e.value)
    tf.check_head_dim(80)  # 2.3 x 80 = 184 bits: whole bytes


@pytest.mark.parametrize("seed", range(4))
def test_rows_pack_codes_in_channel_order_like_a_naive_bit_loop(seed):
    g = torch.Generator().manual_seed(seed)
    dim = int(torch.randint(3, 40, (1,), generator=g))
    w = torch.randint(0, 9, (H, dim), generator=g)
    row_bytes = (int(w.sum(-1).max()) + 7) // 8 + seed % 2  # a spare byte in some rows
    codes = (torch.rand(2, H, 5, dim, generator=g) * 2.0 ** w.unsqueeze(-2)).floor().to(torch.uint8)
    rows = pack_channel_codes(codes, w.unsqueeze(-2), row_bytes)
    for h in range(H):
        bits, at = [0] * (row_bytes * 8), 0
        for c in range(dim):  # each code right after the one before
            for k in range(int(w[h, c])):
                bits[at + k] = (int(codes[1, h, 3, c]) >> k) & 1
            assert int(channel_offsets(w[h])[c]) == (at if w[h, c] else 0)
            at += int(w[h, c])
        assert rows[1, h, 3].tolist() == [sum(bits[8 * i + j] << j for j in range(8)) for i in range(row_bytes)]
    assert torch.equal(unpack_channel_codes(rows, w.unsqueeze(-2)), codes)


# --------------------------------------------------------------------------- the seal


def _naive_block(x: torch.Tensor, widths: torch.Tensor, outliers: int) -> torch.Tensor:
    """One block and head ``x`` [bs, D] float64 through the alloc seal, written as loops: the ``outliers`` elements
    farthest from their channel's mean in units of the channel's 2^width kept exactly (fp16; ties: lower position), then
    per channel fp16 minimum and step over the rest (a 0-width channel: its fp16 mean), codes rounded half to even."""
    bs, dim = x.shape
    mean = x.mean(0)
    score = [(abs(float(x[t, c] - mean[c])) / 2.0 ** int(widths[c]), t * dim + c) for t in range(bs) for c in range(dim)]
    kept = {pos for _, pos in sorted(score, key=lambda s: (-s[0], s[1]))[:outliers]}
    out = torch.empty_like(x)
    for c in range(dim):
        bulk = [float(x[t, c]) for t in range(bs) if t * dim + c not in kept]
        f16 = lambda v: float(torch.tensor(v, dtype=torch.float64).half())
        top = 2 ** int(widths[c]) - 1
        if not bulk:
            zero, step = 0.0, 0.0
        elif top == 0:
            zero, step = f16(sum(bulk) / len(bulk)), 0.0
        else:
            zero, step = f16(min(bulk)), f16((max(bulk) - min(bulk)) / top)
        for t in range(bs):
            if t * dim + c in kept:
                out[t, c] = f16(float(x[t, c]))
            else:
                q = min(max(round((float(x[t, c]) - zero) / step), 0), top) if step > 0 else 0
                out[t, c] = q * step + zero
    return out


@pytest.mark.parametrize("spec", ["int8:bchannel:asym:alloc2:out3", "int4:bchannel:asym:alloc3", "int8:bchannel:asym:alloc3:out1"])
def test_sealed_blocks_match_a_float64_loop(spec):
    tf = _tf(spec)
    widths = _widths(tf, seed=len(spec))
    x = torch.randn(2, H, BS, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * torch.rand(D, dtype=torch.float64) * 3
    p = TensorParams(bits=widths)
    qt = quantize_block(x, tf, p)
    assert qt.codes.shape == (2, H, BS, tf.packed_dim(D)) and qt.codes.dtype == torch.uint8
    got = dequantize(qt, tf, p, head_axis=-3, dtype=torch.float64)
    for b, h in itertools.product(range(2), range(H)):
        want = _naive_block(x[b, h], widths[h], tf.outliers)
        torch.testing.assert_close(got[b, h], want, rtol=0, atol=1e-6)
    # widths matter: the same block with every channel at the mean of the row's bits reads differently
    even = TensorParams(bits=torch.full((H, D), float(int(tf.allocated_bits))))
    assert not torch.allclose(dequantize(quantize_block(x, tf, even), tf, even, head_axis=-3, dtype=torch.float64), got)


def test_the_seal_reads_the_head_axis_it_is_given():
    """The eval cache seals [B, H, blocks, bs, D] (heads at -4): each head reads its own widths."""
    tf = _tf("int8:bchannel:asym:alloc2:out2")
    widths = _widths(tf, seed=3)
    x = torch.randn(2, H, 3, BS, D, generator=torch.Generator().manual_seed(6))
    p = TensorParams(bits=widths)
    got = dequantize(quantize_block(x, tf, p, head_axis=-4), tf, p, head_axis=-4)
    want = dequantize(quantize_block(x.transpose(1, 2), tf, p), tf, p, head_axis=-3).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_missing_or_unfitting_widths_are_one_line_errors():
    tf = _tf("int8:bchannel:asym:alloc2")
    x = torch.randn(H, BS, D)
    for params, match in ((None, "none were given"), (TensorParams(bits=torch.full((H, D), 3.0)), "do not fit"),
                          (TensorParams(bits=torch.full((H + 1, D), 1.0)), "KV heads"),
                          (TensorParams(bits=torch.full((H, D), 1.5)), "whole bits")):
        with pytest.raises(TrtkvError, match=match) as e:
            quantize_block(x, tf, params)
        assert "\n" not in str(e.value)
    quantize_block(x, tf, TensorParams(bits=torch.full((H, D), 2.0)))  # the control: exactly the row's bits


# --------------------------------------------------------------------------- calibration


def _brute_force(errors: torch.Tensor, widths: tuple[int, ...], budget: int) -> float:
    best = float("inf")
    for combo in itertools.product(range(len(widths)), repeat=errors.shape[0]):
        if sum(widths[i] for i in combo) <= budget:
            best = min(best, sum(float(errors[c, i]) for c, i in enumerate(combo)))
    return best


@pytest.mark.parametrize("seed", range(5))
def test_allocation_of_convex_errors_is_the_brute_force_optimum(seed):
    """Errors that fall with every bit and ever more slowly (``var * 4^-b`` with noise): greedy by error saved per bit
    is optimal; it spends within the budget and leaves no upgrade that would fit."""
    from trtkv.calibration.channel_bits import allocate

    g = torch.Generator().manual_seed(seed)
    widths = tuple(range(6))
    var = torch.rand(2, 5, generator=g, dtype=torch.float64) * 10 ** torch.rand(2, 5, generator=g, dtype=torch.float64) * 2
    errors = var.unsqueeze(-1) * 0.25 ** torch.arange(6, dtype=torch.float64) * (1 + 0.1 * torch.rand(2, 5, 6, generator=g, dtype=torch.float64))
    errors = torch.cummin(errors, -1).values
    budget = int(torch.randint(3, 15, (1,), generator=g))
    got = allocate(errors, widths, budget)
    for h in range(2):
        assert int(got[h].sum()) <= budget
        mine = float(errors[h].gather(-1, got[h].unsqueeze(-1)).sum())
        assert mine == pytest.approx(_brute_force(errors[h], widths, budget), rel=1e-9)


def test_allocation_jumps_a_width_that_does_not_pay_on_its_own():
    """A non-convex channel (1 bit saves nothing, 2 bits save most) gets 2 bits: the step over 1 is looked at too."""
    from trtkv.calibration.channel_bits import allocate

    errors = torch.tensor([[[10.0, 10.0, 1.0], [3.0, 2.0, 1.5]]])
    assert allocate(errors, (0, 1, 2), 2).tolist() == [[2, 0]]
    assert allocate(errors, (0, 1, 2), 1).tolist() == [[0, 1]]  # only one bit: the channel where one bit saves something


def test_channel_errors_and_key_weights_match_a_float64_loop():
    from trtkv.calibration.channel_bits import channel_errors, key_weights

    tf = _tf("int8:bchannel:asym:prerope:alloc2")
    g = torch.Generator().manual_seed(9)
    blocks = torch.randn(4, H, BS, D, generator=g, dtype=torch.float64) * torch.rand(D, generator=g, dtype=torch.float64)
    moment = torch.randn(H, D, D, generator=g, dtype=torch.float64)
    moment = moment @ moment.transpose(-1, -2)
    w = key_weights(moment, tf, None)
    diag = moment.diagonal(dim1=-2, dim2=-1)
    half = D // 2
    for h, c in itertools.product(range(H), range(D)):
        pair = (diag[h, c % half] + diag[h, c % half + half]) / 2
        assert float(w[h, c]) == pytest.approx(float(pair / diag.mean()), rel=1e-5)
    err = channel_errors(blocks.float(), tf, w)
    for wi, width in enumerate(tf.channel_widths[:4]):
        full = torch.full((D,), width)
        for h in range(H):
            want = sum(((_naive_block(blocks[b, h], full, 0) - blocks[b, h]) ** 2).mean(0) for b in range(4)) / 4 * w[h].double()
            torch.testing.assert_close(err[h, :, wi].double(), want, rtol=1e-4, atol=1e-7)


def test_calibrate_allocates_every_layers_bits_and_they_travel_in_the_artifact(tiny_models, tmp_path):
    """``trtkv calibrate --kv <alloc format>`` on a real (tiny) model: every layer's widths [KV heads, head_dim] spend
    the row's bits exactly, channels the queries read more get no fewer bits on the whole, and the artifact gives them
    back; the eval cache then reads the format through them."""
    from trtkv.artifacts import load_calibration
    from trtkv.calibration.run import run_calibration
    from trtkv.evaluate import model_logits
    from trtkv.models import load_model, model_info

    d, _ = tiny_models("llama", with_tokenizer=True, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       num_hidden_layers=2)
    from transformers import AutoModelForCausalLM

    spread = AutoModelForCausalLM.from_pretrained(str(d))  # key channels of very different ranges, as real models have
    with torch.no_grad():
        for layer in spread.model.layers:
            layer.self_attn.k_proj.weight.mul_(10 ** torch.linspace(-1.5, 1.0, 64).roll(7).unsqueeze(-1))
    spread.save_pretrained(str(d))
    spec = "k=int8:bchannel:asym:prerope:alloc2:out2,v=int4:g8:sym,block=8,sink=1"
    art = run_calibration(str(d), "builtin:pydoc", tmp_path / "cal", formats=[spec], samples=2, seq_len=64, device="cpu",
                          dtype="float32", progress=False)
    cal = load_calibration(art)
    [params] = cal.params.values()
    fmt = get_format(spec)
    for lp in params:
        assert lp.k.bits.shape == (2, 32) and lp.v.bits is None
        assert lp.k.bits.sum(-1).tolist() == [64.0, 64.0]  # 2 bits x 32 channels, spent to the bit
        assert set(lp.k.bits.flatten().tolist()) <= set(map(float, fmt.k.channel_widths)) and len(set(lp.k.bits.flatten().tolist())) > 1
    info = model_info(str(d))
    model = load_model(str(d), device="cpu", dtype="float32").model
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(3))
    loaded = cal.params_for(fmt, info)
    with torch.inference_mode():
        got, fp = model_logits(model, ids, fmt, loaded), model_logits(model, ids, get_format("fp16"))
        for lp in loaded:
            lp.k.bits = torch.full_like(lp.k.bits, 2.0)
        even = model_logits(model, ids, fmt, loaded)
    assert (got - fp).abs().max() > 1e-4 and (got - even).abs().max() > 1e-4  # the cache is quantized, by these widths


def test_calibrating_an_alloc_format_without_whole_windows_or_queries_says_how_to_fix_it():
    from trtkv.artifacts import LayerParams
    from trtkv.calibration.channel_bits import allocate_channel_bits

    fmt = get_format(f"k=int8:bchannel:asym:alloc2,v=fp16,block={BS}")
    with pytest.raises(TrtkvError, match="whole calibration windows") as e:
        allocate_channel_bits({}, fmt, [LayerParams()], None)
    assert "\n" not in str(e.value)
    windows = {"k": torch.randn(1, 1, 2 * BS, H, D)}
    with pytest.raises(TrtkvError, match="query moments"):
        allocate_channel_bits(windows, fmt, [LayerParams()], None)
    pre = get_format(f"k=int8:bchannel:asym:prerope:alloc2,v=fp16,block={BS}")
    with pytest.raises(TrtkvError, match="no RoPE table"):
        allocate_channel_bits(windows, pre, [LayerParams()], torch.eye(D).expand(1, H, D, D))
    params = [LayerParams()]
    allocate_channel_bits(windows, fmt, params, torch.eye(D).expand(1, H, D, D))  # the control
    assert params[0].k.bits.sum(-1).tolist() == [2.0 * D] * H


# --------------------------------------------------------------------------- the paths


def test_the_paged_layout_counts_alloc_rows_by_hand():
    from trtkv.cache_layout import PagedKVLayout

    fmt = get_format("int2")
    lay = PagedKVLayout(fmt, 3, 64, 128, num_blocks=10, num_slots=2)
    assert lay.data_shape("k")[-1] == 18 and lay.scale_shape("k")[-1] == 64
    k_bits = 128 * 18 * 8 + 64 * 32 + 16 * 32  # 2.25 x 64 code bits per row, step and minimum per channel, 16 outliers
    v_bits = 128 * 64 * 2 + 128 * 16 + 48 * 32  # int2 codes, one fp16 scale per token, 48 outliers
    assert lay.bytes_per_block() == 3 * (k_bits + v_bits) // 8


def test_the_suggested_alloc_bits_fit():
    for dim, bits in ((24, 2.5), (64, 2.3), (40, 3.1)):
        tf = _tf(f"int8:bchannel:asym:alloc{bits}")
        with pytest.raises(TrtkvError) as e:
            tf.check_head_dim(dim)
        fixed = re.search(r"e\.g\. alloc([\d.]+)", str(e.value)).group(1)
        _tf(f"int8:bchannel:asym:alloc{fixed}").check_head_dim(dim)  # the suggestion is whole bytes


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_eval_forward_equals_paged_step_by_step_decode_with_alloc_keys(tiny_model, arch):
    """Keys sealed at their channels' widths (before RoPE, with outliers) read the same through the eval cache as through
    the reference paged cache (pools, block tables, open blocks) decoding token by token."""
    from conftest import random_kv_params
    from test_kv_cache import PagedReferenceCache

    from trtkv.evaluate import _forward, model_logits
    from trtkv.rope import RopeTable

    _, model = tiny_model(arch)
    n_layers, kvh, hd = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    fmt = get_format("k=int8:bchannel:asym:prerope:alloc2:out2,v=int3:g8:sym:hadamard,block=4,sink=1")
    params = random_kv_params(fmt, kvh, hd, n_layers, seed=29)
    ids = torch.randint(0, 320, (2, 14), generator=torch.Generator().manual_seed(23))
    with torch.inference_mode():
        teacher = model_logits(model, ids, fmt, params)
        paged = PagedReferenceCache(fmt, n_layers, kvh, hd, batch=2, params=params, rope=RopeTable.per_layer(model))
        steps = torch.cat([_forward(model, ids[:, i : i + 1], paged) for i in range(14)], 1)
        for lp in params:
            lp.k.bits = torch.full_like(lp.k.bits, 2.0)
        even = model_logits(model, ids, fmt, params)
    torch.testing.assert_close(steps, teacher, rtol=0, atol=1e-4)
    assert (teacher - even).abs().max() > 5e-4  # the widths really change what is read


@pytest.mark.parametrize("spec", ["k=int8:bchannel:asym:prerope:alloc2:out3,v=int2:token:sym:hadamard:nuq,block=4",
                                  "k=int8:bchannel:asym:alloc2,v=int4:bchannel:asym:alloc3,block=4,sink=1"])
@pytest.mark.parametrize("attention", ["torch", "cpu"])
def test_the_torch_engine_serves_alloc_formats_like_the_eval_cache(tiny_models, spec, attention):
    """The torch engine -- its torch ops, and its C kernels (codes read at each channel's offset and width; folded into
    the query and the probabilities where the keys are not before RoPE) -- with the runtime pool sealing by the
    reference quantizer, serves an alloc format (prefill over several sealed blocks, then decodes) with the eval
    cache's teacher-forced logits."""
    from test_codebooks_outliers import _serve_like_the_eval_cache

    _serve_like_the_eval_cache(tiny_models("llama", num_hidden_layers=2), spec, attention, block=4)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["k=int8:bchannel:asym:prerope:alloc2:out16,v=int2:token:sym:hadamard:nuq:out16,block=16,sink=1",
                                  "k=int8:bchannel:asym:alloc2,v=int4:bchannel:asym:alloc3,block=16"])
def test_the_triton_kernels_serve_alloc_formats_like_the_eval_cache(tiny_models, spec, monkeypatch):
    """The same through the Triton kernels (the CUDA path, here under the interpreter): decode and prefill read each
    channel's code at its offset and width (``kernels._channel_codes``), keys and values alike, and the pool seals
    with the Triton seal kernel (``kernels._seal_channels``: outliers in units of levels, codes packed by one-hot
    products)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from test_codebooks_outliers import _serve_like_the_eval_cache

    _serve_like_the_eval_cache(tiny_models("llama", num_hidden_layers=2, head_dim=32, hidden_size=96), spec, "kernels",
                               block=16, seal_kernels=True, blocks=3, decode_steps=3)


def test_the_recipe_counts_each_layers_channels_at_each_width():
    from trtkv.artifacts import LayerParams
    from trtkv.calibration.run import layer_choices

    widths = torch.tensor([[0.0, 2, 2, 8], [1, 1, 0, 2]])
    [choice] = layer_choices([LayerParams(k=TensorParams(bits=widths))], {})
    assert choice.k_channels_at_bits == [2, 2, 3, 0, 0, 0, 0, 0, 1] and choice.v_channels_at_bits is None


def test_presets_fit_a_head_dim_their_bits_do_not_fill_with_fewer_bits_never_more():
    from trtkv.formats import fit_formats

    [fmt], notes = fit_formats(["int2"], 24)  # 2.25 x 24 = 54 bits: 48 are whole bytes
    assert fmt.k.allocated_bits == 2.0 and "alloc2.25->alloc2" in notes[0]
    [fmt], notes = fit_formats(["int2"], 64)
    assert fmt.k.allocated_bits == 2.25 and not notes
    with pytest.raises(TrtkvError, match="whole bytes"):  # a spec the user wrote out is not changed
        fit_formats(["k=int8:bchannel:asym:alloc2.25,v=fp16,block=8"], 24)


def test_widths_the_format_does_not_allow_are_refused_even_when_the_row_has_room():
    tf = _tf("int4:bchannel:asym:alloc3")  # widths 0..4
    w = torch.zeros(H, D)
    w[:, 0] = 5.0  # 5 bits fit the row's 72 but exceed the widest code
    with pytest.raises(TrtkvError, match="do not fit") as e:
        quantize_block(torch.randn(H, BS, D), tf, TensorParams(bits=w))
    assert "\n" not in str(e.value)
    w[:, 0] = 4.0  # the control
    quantize_block(torch.randn(H, BS, D), tf, TensorParams(bits=w))


def test_a_preset_whose_bits_round_to_no_byte_cannot_fit():
    from trtkv.formats import fit_format

    fmt = get_format(f"k=int8:bchannel:asym:alloc0.25,v=fp16,block={BS}")
    fitted, why = fit_format(fmt, 24)  # 0.25 x 24 = 6 bits: no whole byte
    assert fitted is None and "less than a byte" in why
    assert fit_format(fmt, 32)[0] is fmt  # the control: 8 bits, as written
