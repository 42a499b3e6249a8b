"""The third (fresh) mutation run's survivors (issue 25, bench/results/mutations-2026-12-02.md, "Round 3"): each test
fails on the mutant named in its docstring and passes on the real code. Expectations come from the documented rule and
the inputs (hand-computed), not from the code under test."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from test_mutations_round2 import _get  # a request's inputs as the python model hands them over

from trtkv.errors import TrtkvError
from trtkv.formats import get_format
from trtkv.runtime.sequence import SamplingParams

BS = 4


def _cache(fmt: str = "int8-token", num_layers: int = 1, num_blocks: int = 8, num_slots: int = 2, params=None):
    from trtkv.cache_layout import PagedKVLayout
    from trtkv.runtime.kv_pool import PagedKVCache

    return PagedKVCache(PagedKVLayout(get_format(fmt), 1, 8, BS, num_blocks, num_slots), num_layers, params)


# ---------------------------------------------------------------- runtime


def test_bad_tokens_stay_banned_while_min_tokens_bans_the_end_ids(small_llama, tokenizer):
    """R3-5 (under min_tokens the end ids *replace* the bans): bad_token_ids are never sampled, also while
    min_tokens suppresses the end ids (both bans hold at once)."""
    from test_runtime_faults import make_llm

    prompt = [5, 17, 9, 33, 2, 41]
    free = make_llm(small_llama, tokenizer).generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    first = free.new_token_ids[0]
    assert first != 0  # the stand-in manifest's end id
    out = make_llm(small_llama, tokenizer).generate([prompt], SamplingParams(max_tokens=3, temperature=0, min_tokens=3, bad_token_ids=[first]))[0]
    assert first not in out.new_token_ids and len(out.new_token_ids) == 3


def test_each_layer_is_sealed_with_its_own_static_scale():
    """R3-6 (the reference seal takes layer 0's constants for every layer): a static format's codes of layer i are
    x / scale_i; read back with layer i's scale they are within half a step of x. Layer 0's scale is 50x finer,
    so layer 1 sealed with it would clamp at 127 codes and read back 127 * 0.5, far from x."""
    from trtkv.artifacts import LayerParams
    from trtkv.cache_layout import gather_paged
    from trtkv.quant import TensorParams

    scales = (0.01, 0.5)
    params = [LayerParams(k=TensorParams(scale=torch.tensor(s)), v=TensorParams(scale=torch.tensor(s))) for s in scales]
    cache = _cache("k=int8:tensor,v=int8:tensor", num_layers=2, params=params)
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


# ---------------------------------------------------------------- Triton model


def test_empty_strings_in_the_word_lists_mean_none():
    """T3-2 (empty strings kept as words): TensorRT-LLM clients pad stop_words / bad_words with empty strings, which
    mean "no word" (inputs.py); an empty stop word would match at once."""
    from trtkv.triton_repo.inputs import parse_request

    words = np.array([[b"", b"END", b""]], dtype=object)
    r = parse_request(_get(text_input="x", max_tokens=3, stop_words=words, bad_words=np.array([[b""]], dtype=object)))
    assert r.params.stop_words == ["END"] and r.params.bad_words == []


def test_top_p_below_one_alone_makes_the_request_sample():
    """T3-3 (top_p not counted): interface.py: "a request samples when it gives temperature > 0, top_k > 1 or
    0 < top_p < 1"; with top_p 0.5 alone it samples at temperature 1."""
    from trtkv.triton_repo.inputs import parse_request

    r = parse_request(_get(text_input="x", max_tokens=3, top_p=np.float32(0.5)))
    assert not r.params.greedy and r.params.temperature == 1.0 and r.params.top_p == 0.5
    r = parse_request(_get(text_input="x", max_tokens=3, top_p=np.float32(1.0)))
    assert r.params.greedy


def test_log_probs_are_returned_only_when_asked_for(monkeypatch):
    """T3-6 (log-probabilities returned without return_log_probs): interface.py: cum_log_probs is "0 unless
    return_log_probs", output_log_probs "empty unless return_log_probs"."""
    import importlib

    stub = types.ModuleType("triton_python_backend_utils")
    stub.Tensor = lambda name, array: (name, array)
    stub.InferenceResponse = lambda output_tensors: dict(output_tensors)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    monkeypatch.delitem(sys.modules, "trtkv.triton_repo.python_model", raising=False)
    pm = importlib.import_module("trtkv.triton_repo.python_model")
    monkeypatch.delitem(sys.modules, "trtkv.triton_repo.python_model")
    off = pm._response("ab", [-0.5, -0.25], False)
    assert off["cum_log_probs"].tolist() == [[0.0]] and off["output_log_probs"].shape == (1, 1, 0)
    on = pm._response("ab", [-0.5, -0.25], True)
    assert on["cum_log_probs"].tolist() == [[-0.75]] and on["output_log_probs"].tolist() == [[[-0.5, -0.25]]]
    assert on["text_output"].tolist() == [[b"ab"]]


# ---------------------------------------------------------------- OpenAI front (a stand-in Triton: test_openai_front.py)

from test_mutations_round2 import _chat, chat_front  # noqa: E402,F401  (a front whose tokenizer has a chat template)
from test_openai_front import complete, front  # noqa: E402,F401


def test_temperature_above_two_is_refused(front):  # noqa: F811
    """O3-1 (no upper bound): OpenAI's temperature is in [0, 2]; 2 is accepted, 2.5 is a 400 naming it."""
    code, _, body = complete(front, temperature=2.0)
    assert code == 200 and body["temperature"] == 2.0
    code, data, body = complete(front, temperature=2.5)
    assert code == 400 and data["error"]["param"] == "temperature" and body is None


def test_top_p_reaches_the_engine(front):  # noqa: F811
    """O3-2 (top_p not forwarded): the request's top_p is what Triton gets."""
    _, _, body = complete(front, top_p=0.25)
    assert body["top_p"] == 0.25


def test_a_non_text_content_part_is_a_400(chat_front):  # noqa: F811
    """O3-4 (image parts dropped silently): only text content parts are supported; an image part is a 400 naming
    messages, and text parts are joined."""
    parts = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    code, data, body = _chat(chat_front, messages=[{"role": "user", "content": parts}], max_tokens=4)
    assert code == 400 and data["error"]["param"] == "messages" and body is None
    code, _, body = _chat(chat_front, messages=[{"role": "user", "content": parts[:1] * 2}], max_tokens=4)
    assert code == 200 and body["text_input"] == "<|user|>hihi\n<|assistant|>"


def test_echo_is_refused(front):  # noqa: F811
    """O3-6 (echo ignored): the front does not echo the prompt; echo=true is a 400 naming it, not a reply without it."""
    code, data, body = complete(front, echo=True)
    assert code == 400 and data["error"]["param"] == "echo" and body is None
    code, _, _ = complete(front, echo=False)
    assert code == 200


# ---------------------------------------------------------------- calibration budget


def test_an_infinite_budget_is_refused():
    """B3-2 (isfinite dropped): a budget is a finite positive KL or Δppl."""
    from trtkv.calibration.budget import Budget

    for bad in ("kl=inf", "ppl=inf%", "kl=nan"):
        with pytest.raises(TrtkvError, match="invalid accuracy budget"):
            Budget.parse(bad)


def test_a_shared_scale_candidate_is_refused():
    """B3-4 (shared_kv_scale not checked): a budget candidate must be a plain format; a shared K/V scale is not
    (even one that seals blocks like the others)."""
    from trtkv.calibration.budget import check_candidates

    shared = get_format("k=int8:tensor,v=int8:tensor,shared,block=16")
    plain = get_format("k=int4:token:sym,v=int4:token:sym,block=16")
    with pytest.raises(TrtkvError, match="shared-scale"):
        check_candidates([shared, plain])


# ---------------------------------------------------------------- formats


def test_a_spec_with_mse_round_trips():
    """F3-2 (short() drops mse): spec() is the inverse of the parser, mse included."""
    fmt = get_format("k=int4:bchannel:asym:hadamard:mse,v=int4:g8:sym,block=16")
    assert fmt.k.mse and get_format(fmt.spec()) == fmt.model_copy(update={"name": fmt.spec()})


def test_a_format_with_one_quantized_side_is_quantized():
    """F3-5 (``all`` for ``any``): a format that stores K in fp16 and V in int8 is a quantized format."""
    assert get_format("k=fp16,v=int8:token").is_quantized
    assert not get_format("k=fp16,v=fp16").is_quantized
