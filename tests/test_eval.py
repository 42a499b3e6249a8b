"""Eval metrics against naive float64 computations, the evaluation loop on tiny models, and run_eval on the real model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from trtkv.errors import TrtkvError
from trtkv.evaluate import (
    EvalResult,
    evaluate_formats,
    kl_divergence,
    perplexity,
    prefix_match,
    render_table,
    run_eval,
    token_nll,
    top1_agreement,
    write_json,
)
from trtkv.formats import get_format

INT8_TOKEN = "k=int8:token,v=int8:token"  # every token quantized on write: the eval cache's other semantics


def _naive(ref: torch.Tensor, cur: torch.Tensor, targets: torch.Tensor):
    """Per-position KL(p_ref || p), NLL and top-1 agreement with explicit float64 loops over softmax."""
    kl, nll, agree = [], [], []
    for r, c, t in zip(ref.double().reshape(-1, ref.shape[-1]), cur.double().reshape(-1, cur.shape[-1]), targets.reshape(-1)):
        p = torch.exp(r - r.max()) / torch.exp(r - r.max()).sum()
        q = torch.exp(c - c.max()) / torch.exp(c - c.max()).sum()
        kl.append(sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p.tolist(), q.tolist()) if pi > 0))
        nll.append(-math.log(q[t].item()))
        agree.append(float(int(r.argmax()) == int(c.argmax())))
    return (torch.tensor(kl, dtype=torch.float64), torch.tensor(nll, dtype=torch.float64), torch.tensor(agree, dtype=torch.float64))


def test_metrics_match_naive_float64():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 5, 37, generator=g) * 3
    cur = ref + torch.randn(3, 5, 37, generator=g) * 0.7
    targets = torch.randint(0, 37, (3, 5), generator=g)
    kl, nll, agree = _naive(ref, cur, targets)
    torch.testing.assert_close(kl_divergence(ref, cur).reshape(-1).double(), kl, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(token_nll(cur, targets).reshape(-1).double(), nll, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(top1_agreement(ref, cur).reshape(-1).double(), agree)
    assert 0.0 < agree.mean() < 1.0  # the test data exercises both outcomes
    assert perplexity(token_nll(cur, targets)) == pytest.approx(math.exp(nll.mean().item()), rel=1e-6)
    # identical distributions: zero divergence, full agreement
    assert kl_divergence(ref, ref).abs().max() < 1e-6
    assert top1_agreement(ref, ref).min() == 1.0


def test_prefix_match():
    ref = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]])
    out = torch.tensor([[1, 2, 9, 4], [1, 2, 3, 4], [0, 6, 7, 8]])
    assert prefix_match(ref, out).tolist() == [2, 4, 0]


def test_evaluate_formats_tiny(tiny_model):
    _, model = tiny_model("mistral")
    windows = torch.randint(0, 320, (3, 24), generator=torch.Generator().manual_seed(0))
    res = evaluate_formats(
        model, windows, [INT8_TOKEN, "k=int4:g12:asym,v=int4:g12:asym"], batch_size=2, generate_prompts=2, generate_tokens=6
    )
    assert [r.format for r in res] == ["fp16", INT8_TOKEN, "k=int4:g12:asym,v=int4:g12:asym"]
    base, i8, i4 = res
    assert base.ppl_delta_pct == 0.0 and base.kld_mean == 0.0 and base.top1_agreement == 1.0
    assert base.generation_match == 1.0
    assert base.tokens == 3 * 23 and base.windows == 3 and base.seq_len == 24
    assert 0 < i8.kld_mean < i4.kld_mean
    assert abs(i8.ppl_delta_pct) < abs(i4.ppl_delta_pct)
    assert i4.bits_per_element == pytest.approx(4 + 32 / 12)
    assert i8.kv_bytes_per_token == pytest.approx(get_format(INT8_TOKEN).kv_bytes_per_token(2, 2, 24))
    assert i8.tail_bytes_per_slot == 0 and i8.pool_bits_per_element == i8.bits_per_element
    for r in res:
        assert 0.0 <= r.generation_match <= r.generation_match_all <= 1.0  # a matching prefix is a subset of matches
    table = render_table(res)
    assert table.row_count == 3


def test_sealed_blocks_beat_quantize_on_write_and_count_the_open_block(tiny_model):
    _, model = tiny_model("qwen2")
    windows = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(1))
    res = evaluate_formats(
        model, windows, ["k=int4:token:asym,v=int4:token:asym", "k=int4:token:asym,v=int4:token:asym,block=8"],
        generate_prompts=0,
    )
    _, plain, sealed = res
    assert sealed.kld_mean < plain.kld_mean  # each query's own block unquantized helps
    assert sealed.pool_bits_per_element == plain.pool_bits_per_element == plain.bits_per_element
    # 20 tokens: 2 sealed blocks of 8 in the pool plus one reserved fp16 block of 8 tokens
    assert sealed.bits_per_element == pytest.approx((16 * sealed.pool_bits_per_element + 8 * 16) / 20)
    assert sealed.tail_bytes_per_slot == 2 * 2 * 2 * 8 * 24 * 2  # K+V, 2 layers, 2 KV heads, 8 tokens, head_dim 24, fp16
    assert sealed.generation_match is None


def test_run_eval_needs_calibration_before_loading(monkeypatch):
    import trtkv.models

    def boom(*a, **k):  # pragma: no cover - must not be reached
        raise AssertionError("model loaded before the calibration check")

    monkeypatch.setattr(trtkv.models, "load_model", boom)
    with pytest.raises(TrtkvError, match="--calibration"):
        run_eval("smollm2-135m", "builtin:pydoc", ["fp16", "int8-static"])
    with pytest.raises(TrtkvError, match="unknown KV format"):
        run_eval("smollm2-135m", "builtin:pydoc", ["int5"])


def test_write_json(tmp_path):
    r = EvalResult(
        format="int8", spec="k=int8:token:sym,v=int8:token:sym", bits_per_element=8.25, pool_bits_per_element=8.25,
        kv_bytes_per_token=100.0, ppl=10.0, ppl_delta_pct=0.1, kld_mean=1e-4, top1_agreement=0.99,
    )
    path = write_json([r], tmp_path / "out" / "r.json", meta={"command": "x"})
    data = json.loads(path.read_text())
    assert data["meta"]["command"] == "x" and data["results"][0]["format"] == "int8"
    assert EvalResult.model_validate(data["results"][0]) == r


@pytest.mark.model
def test_run_eval_real_model_small(builtin_model, monkeypatch):
    import trtkv.models

    monkeypatch.setattr(trtkv.models, "load_model", lambda *a, **k: builtin_model)  # reuse the session's model
    res = run_eval(
        "smollm2-135m", "builtin:pydoc", [INT8_TOKEN, "k=int4:g32:sym,v=int4:g32:sym"], windows=2, seq_len=128, device="cpu", dtype="float32",
        generate_prompts=1, generate_tokens=8, progress=False,
    )
    base, i8, i4 = res
    assert base.format == "fp16" and base.ppl_delta_pct == 0.0 and base.kld_mean == 0.0
    assert 1.0 < base.ppl < 1000.0
    assert abs(i8.ppl_delta_pct) < 1.0 and i8.kld_mean < 0.01 and i8.top1_agreement > 0.95
    assert i4.kld_mean > i8.kld_mean and i4.ppl > i8.ppl
    assert i8.bits_per_element == pytest.approx(8.25)
    assert i8.kv_bytes_per_token == pytest.approx(2 * 30 * 3 * 64 * 8.25 / 8)
    assert base.windows == 2 and base.tokens == 2 * 127


@pytest.mark.slow
def test_run_eval_with_calibration_artifact(tiny_model, tmp_path):
    """End to end on a tiny saved model: calibrate a smoothed int4 format, then eval it from the artifact."""
    from trtkv.calibration.run import run_calibration

    model_dir, _ = tiny_model("mistral", with_tokenizer=True, head_dim=64)
    spec = "k=int4:g32:sym:smooth:hadamard,v=int4:g32:asym:hadamard"
    art = run_calibration(str(model_dir), "builtin:pydoc", tmp_path / "calib", formats=[spec, "fp8"], samples=2, seq_len=32,
                          device="cpu", dtype="float32", progress=False)
    with pytest.raises(TrtkvError, match="calibrat"):
        run_eval(str(model_dir), "builtin:pydoc", [spec], windows=2, seq_len=32, device="cpu", progress=False)
    res = run_eval(str(model_dir), "builtin:pydoc", ["int8", spec, "fp8"], calibration=art, windows=2, seq_len=32,
                   device="cpu", dtype="float32", generate_prompts=1, generate_tokens=3, progress=False)
    assert [r.format for r in res] == ["fp16", "int8", spec, "fp8"]
    assert all(math.isfinite(r.ppl) and r.kld_mean >= 0 for r in res)
    assert res[2].kld_mean > res[1].kld_mean
