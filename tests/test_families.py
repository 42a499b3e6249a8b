"""The model families users run today: Qwen3, Gemma 2, Gemma 3 (text), Phi-3, Mistral / Qwen2 with a sliding window.

Each family is a tiny random transformers model. The reference is always transformers' own forward (float32):
* eval: the fp16-format cache (``trtkv.kv_cache``) gives the model's own logits at every position, inside and beyond
  the sliding window, in one chunked prefill and in decode steps; the window really matters (the same weights with
  every layer global give other logits past the window); int8 / int4 run, finite and close;
* calibrate: runs (pre-RoPE keys through k_norm / qkv_proj), the report has a row per layer type;
* GGUF: a file written with the ``gguf`` package from the tiny model loads to the same logits and the same record;
* build-engine (ONNX Runtime, native attention): every family vs transformers (with K/V rounded to fp16 as the
  engine's cache holds them); sliding windows under plugin attention are refused before any weights load;
* plan: per-layer-type bytes from the record;
* refusals: an unsupported architecture names the supported ones; layers that differ in KV geometry are refused.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import FAMILIES, TINY_TEXT, WINDOW
from transformers.cache_utils import DynamicCache

from trtkv.errors import TrtkvError
from trtkv.evaluate import _forward, model_logits
from trtkv.families import architectures
from trtkv.formats import PRESETS, fit_formats
from trtkv.kv_cache import QuantizedKVCache
from trtkv.models import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    load_model,
    model_info,
)
from trtkv.plan import GIB, ModelShape, layer_type_bytes, plan
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.torch_engine import TorchEngine

LAYER_TYPES = {
    "qwen3": (FULL_ATTENTION,) * 2,
    "gemma2": (SLIDING_ATTENTION, FULL_ATTENTION),
    "gemma3": (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,),
    "phi3": (FULL_ATTENTION,) * 2,
    "mistral-sw": (SLIDING_ATTENTION,) * 2,
    "qwen2-sw": (FULL_ATTENTION, SLIDING_ATTENTION),
}
STEP_NETWORK = ("qwen3", "gemma2", "gemma3", "phi3", "mistral-sw", "qwen2-sw")
GGUF = {"qwen3": "QWEN3", "phi3": "PHI3", "gemma2": "GEMMA2", "gemma3": "GEMMA3"}  # families the GGUF loader knows


def _ids(n: int, length: int, vocab: int = 320, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


def _logits_without_window(model, ids):
    """The same model (layer types, RoPE bases) with a window longer than ``ids``: what a cache that ignored the window
    would give. transformers builds the sliding mask from ``config.sliding_window`` at every forward."""
    window = model.config.sliding_window
    model.config.sliding_window = 4096
    try:
        return model(ids).logits
    finally:
        model.config.sliding_window = window


# --------------------------------------------------------------------------- record + eval


@pytest.mark.parametrize("name", list(FAMILIES))
def test_eval_cache_gives_the_models_own_logits(family, name):
    d, model = family(name)
    info = model_info(str(d))
    assert info.architecture in architectures()
    assert info.layer_types == LAYER_TYPES[name]
    assert info.sliding_window == (WINDOW if SLIDING_ATTENTION in LAYER_TYPES[name] else None)
    ids = _ids(2, 80)  # > the window, and > the int8 / int4 presets' blocks of 64 (a sealed block is read)
    with torch.inference_mode():
        ref = model(ids).logits
        got = model_logits(model, ids, "fp16")
        assert (got - ref).abs().max().item() == 0.0
        # decode: one token at a time through the cache, positions inside and beyond the window
        cache = QuantizedKVCache("fp16", info.num_layers)
        steps = torch.cat([_forward(model, ids[:, t : t + 1], cache) for t in range(2 * WINDOW)], dim=1)
        assert (steps - ref[:, : 2 * WINDOW]).abs().max().item() < 1e-5
        if info.has_sliding_layers:  # the window matters: ignoring it changes the logits past the window, not before
            glob = _logits_without_window(model, ids)
            assert (glob[:, :WINDOW] - ref[:, :WINDOW]).abs().max().item() < 1e-5
            assert (glob[:, WINDOW + 2 :] - ref[:, WINDOW + 2 :]).abs().max().item() > 1e-3
        for kv, bound in (("int8", 0.05), ("int4", 0.25)):
            [fmt], _ = fit_formats([kv], info.head_dim)
            q = model_logits(model, ids, fmt)
            assert torch.isfinite(q).all()
            diff = (q - ref).abs().max().item()
            assert 0 < diff < bound, (kv, diff)


def test_presets_fit_head_dim_256_as_written_but_int2s_outlier_counts():
    """Gemma 3's head_dim 256: every preset fits as written, but int2, whose outlier lists keep their share of a block."""
    names = [n for n in PRESETS if n != "int2"]
    fmts, notes = fit_formats(names, 256)
    assert notes == [] and [f.name for f in fmts] == names and all(f is PRESETS[n] for f, n in zip(fmts, names))
    [int2], notes = fit_formats(["int2"], 256)
    assert notes == ["int2 at head_dim 256: K out16->out64, V out48->out192"] and int2.v.outliers == 192


def test_gemma2_loads_with_eager_attention(family):
    d, _ = family("gemma2")
    loaded = load_model(str(d), device="cpu", dtype="float32")  # sdpa asked, eager given (soft-capping)
    assert loaded.model.config._attn_implementation == "eager"
    assert loaded.info == model_info(str(d))


def test_gemma3_record_has_a_rope_base_per_layer_type(family):
    info = model_info(str(family("gemma3")[0]))
    assert info.rope_thetas == {SLIDING_ATTENTION: 10000.0, FULL_ATTENTION: 1000000.0}
    assert info.rope_theta == 1000000.0 and info.layer_rope_theta(0) == 10000.0 and info.layer_rope_theta(5) == 1000000.0
    assert info.layer_groups() == {SLIDING_ATTENTION: [0, 1, 2, 3, 4], FULL_ATTENTION: [5]}


# --------------------------------------------------------------------------- calibrate


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3", "phi3"])  # k_norm (Qwen3's too) and qkv_proj hooks; layer types
def test_calibrate_runs_and_reports_layer_types(family, name, tmp_path):
    from trtkv.artifacts import load_calibration
    from trtkv.calibration.run import run_calibration

    d, _ = family(name)
    text = tmp_path / "text.txt"
    text.write_text(TINY_TEXT * 40)
    loaded = load_model(str(d), device="cpu", dtype="float32")
    out = run_calibration(str(d), str(text), tmp_path / "cal", formats=["int8-static"], samples=2, seq_len=32,
                          progress=False, loaded=loaded)
    cal = load_calibration(out)
    assert cal.recipe.model.layer_types == LAYER_TYPES[name]
    report = (out / "report.md").read_text()
    assert ("### By layer type" in report) == (name == "gemma3")
    if name == "gemma3":
        assert "| sliding_attention | 0, 1, 2, 3, 4 |" in report and "| full_attention | 5 |" in report
    params = cal.params_for(PRESETS["int8-static"], loaded.info)
    with torch.inference_mode():
        ids = _ids(1, 40)
        q = model_logits(loaded.model, ids, "int8-static", params)
        assert torch.isfinite(q).all() and (q - loaded.model(ids).logits).abs().max().item() < 0.25


# --------------------------------------------------------------------------- GGUF


def _write_gguf(model, tokenizer, path, arch_name: str, add_bos: bool | None = None) -> None:
    """A GGUF of ``model`` the way llama.cpp's converter lays it out (Gemma: norms stored as 1 + w), with a byte-level BPE tokenizer."""
    import gguf

    cfg = model.config
    key = gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch_name)]
    w = gguf.GGUFWriter(str(path), key)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters.get(FULL_ATTENTION, cfg.rope_parameters)["rope_theta"]))
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t == "<eos>" else 1 for t in tokens])  # 3: control
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_eos_token_id(vocab["<eos>"])
    w.add_bos_token_id(vocab["<eos>"])
    w.add_pad_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch_name), cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        x = t.detach().float().numpy()
        if key.startswith("gemma") and "norm.weight" in gname:
            x = x + 1
        w.add_tensor(gname, np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# transformers' GGUF loader maps no query_pre_attn_scalar or soft-capping fields: a Gemma GGUF gets the config defaults,
# so the round trip uses Gemma models that have them (docs/models-and-data.md)
GGUF_UNMAPPED = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")


@pytest.mark.parametrize("name", list(GGUF))
def test_gguf_round_trip(tiny_models, name, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("TRTKV_CACHE", str(tmp_path / "cache"))
    arch, kw = FAMILIES[name]
    d, model = tiny_models(arch, with_tokenizer=True, **{k: v for k, v in kw.items() if k not in GGUF_UNMAPPED})
    path = tmp_path / f"{name}.gguf"
    _write_gguf(model, AutoTokenizer.from_pretrained(str(d)), path, GGUF[name])
    info = model_info(str(path))
    loaded = load_model(str(path), device="cpu", dtype="float32")
    assert loaded.info == info and info.layer_types == LAYER_TYPES[name]
    assert info.sliding_window == model_info(str(d)).sliding_window and info.rope_thetas == model_info(str(d)).rope_thetas
    ids = _ids(1, 40)
    with torch.inference_mode():
        ref = model(ids).logits
        assert (loaded.model(ids).logits - ref).abs().max().item() < 1e-5
        assert (model_logits(loaded.model, ids, "fp16") - ref).abs().max().item() < 1e-5


def test_gguf_whose_head_dim_the_loader_cannot_read_is_refused(tiny_models, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    import trtkv.models

    monkeypatch.setenv("TRTKV_CACHE", str(tmp_path / "cache"))
    d, model = tiny_models("qwen3", with_tokenizer=True, head_dim=24)  # transformers would build Qwen3 with 128
    path = tmp_path / "qwen3-24.gguf"
    _write_gguf(model, AutoTokenizer.from_pretrained(str(d)), path, "QWEN3")

    def boom(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(trtkv.models, "_convert_gguf", boom)
    with pytest.raises(TrtkvError, match="has head_dim 24 .*would build the model with head_dim 128") as e:
        load_model(str(path), device="cpu")
    assert "Hugging Face directory" in e.value.fix


# --------------------------------------------------------------------------- build-engine


class _Fp16Cache(DynamicCache):
    """transformers' own cache holding K (after RoPE) and V rounded to fp16: what the engine's fp16 open block holds."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(key_states.half().float(), value_states.half().float(), layer_idx, *args, **kwargs)


@pytest.mark.parametrize("name,kv", [(n, "fp16") for n in STEP_NETWORK] + [("gemma2", "int4"), ("mistral-sw", "int4")])
def test_engine_logits_match_transformers(family, name, kv, tmp_path):
    from trtkv.builder.build import build_engine
    from trtkv.runtime.backends import OnnxRuntimeEngine
    from trtkv.runtime.verify import StaticBatch

    d, model = family(name)
    loaded = load_model(str(d), device="cpu", dtype="float32")
    out = build_engine(str(d), None, kv, tmp_path / "eng", backend="onnxruntime", block_size=4, max_seq_len=64, max_batch=2, loaded=loaded)
    eng = OnnxRuntimeEngine(out)
    m = eng.manifest
    assert m.model.layer_types == LAYER_TYPES[name]
    ids = _ids(2, 20)  # > the window of 8: local layers must drop old keys
    cache = PagedKVCache.for_engine(m, out, num_blocks=16, num_slots=2)
    sb = StaticBatch(cache, 2)
    got = torch.stack([sb.step(eng, {i: [int(ids[i, t])] for i in range(2)}) for t in range(ids.shape[1])], 1)
    with torch.inference_mode():
        hf = model(ids).logits
        if kv == "fp16":  # transformers with K/V rounded to fp16 as the engine stores them (measured 1.1e-4 ... 2.9e-4)
            ref = model(ids, cache=_Fp16Cache(config=model.config), use_cache=True).logits
            # vs plain float32 K/V: 1.4e-4 ... 1.7e-4; Gemma 3's norm of the attention output amplifies fp16 rounding: 1.3e-3
            assert (got - hf).abs().max().item() < 3e-3
        else:  # the same sealed int4 cache in transformers (trtkv.kv_cache)
            ref = model_logits(model, ids, m.kv_format, cache.params)
            assert (got - hf).abs().max().item() < 0.15
    assert (got - ref).abs().max().item() < 5e-4
    # the torch engine (transformers' own layers, paged attention with the window / soft-cap each layer passes) on the
    # same steps: both engines round this step's rows to fp16, so only summation order differs
    torch_engine = TorchEngine(load_model(str(d), device="cpu", dtype="float32").model, m)
    sb = StaticBatch(PagedKVCache.for_engine(m, out, num_blocks=16, num_slots=2), 2)
    got_torch = torch.stack([sb.step(torch_engine, {i: [int(ids[i, t])] for i in range(2)}) for t in range(ids.shape[1])], 1)
    assert (got_torch - got).abs().max().item() < (5e-4 if name == "gemma3" else 1e-4)  # Gemma 3's output norm amplifies: 2.6e-4
    assert (got_torch - ref).abs().max().item() < 5e-4
    if kv == "int4":  # the runtime's prefill chunks + greedy decode past the window (blocks sealed mid-decode) give the reference's tokens
        from trtkv.evaluate import greedy_generate
        from trtkv.runtime.verify import greedy_decode

        with torch.inference_mode():
            want = greedy_generate(model, ids[:, :7], m.kv_format, PagedKVCache.for_engine(m, out, num_blocks=1, num_slots=1).params, new_tokens=16)
        for e in (eng, torch_engine):
            cache = PagedKVCache.for_engine(m, out, num_blocks=16, num_slots=2)
            assert torch.equal(greedy_decode(e, cache, ids[:, :7].tolist(), 16), want)


def test_sliding_window_needs_native_attention(family, tmp_path):
    from trtkv.builder.build import build_engine

    with pytest.raises(TrtkvError, match="sliding-window layers .* plugin attention has no window start") as e:
        build_engine(str(family("mistral-sw")[0]), None, "int4", tmp_path / "eng", backend="onnxruntime", attention="plugin", block_size=16)
    assert "--attention native" in e.value.fix


@pytest.mark.slow
@pytest.mark.parametrize("name,window", [("gemma2", WINDOW), ("mistral-sw", 20)])
def test_torch_engine_kernels_take_windows_and_soft_capping(tiny_models, monkeypatch, name, window):
    """The kernels implement sliding windows and soft-capping: their refusal names neither (``auto`` takes the
    kernels for such models on CUDA), and ``attention="kernels"`` (the Triton kernels, here under the interpreter)
    gives the torch ops' logits on Gemma 2 (window 8, smaller than a block; attention and final soft-caps) and
    Mistral (window 20: block-unaligned, every layer sliding), int4 with sink rows, two sequences past several window
    lengths, over a cache keeping every block and over a window ring that wraps (the kernels read it through the
    logical block table). Tolerance: test_torch_engine's kernel-vs-torch 1e-4."""
    from trtkv.attention.triton import TritonKernels
    from trtkv.cache_layout import PagedKVLayout, WindowRing
    from trtkv.runtime.verify import StaticBatch

    arch, kw = FAMILIES[name]
    d, _ = tiny_models(arch, with_tokenizer=True, **{**kw, "head_dim": 32, "sliding_window": window})  # head_dim the kernels take
    info = model_info(str(d))
    model = load_model(str(d), device="cpu", dtype="float32").model
    assert TritonKernels.refusal("cuda", model=info) is None and info.sliding_window == window
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    [fmt], _ = fit_formats(["int4"], 32)
    bs = 16  # the kernels' smallest block
    prompts = [list(range(3, 48)), list(range(50, 63))]  # 45 and 13 tokens, then 4 decode steps: up to 49

    def run(engine, ring):
        lay = PagedKVLayout(fmt.with_block_size(bs), info.num_kv_heads, 32, bs, 8, 2)
        cache = PagedKVCache(lay, info.num_layers, ring=WindowRing.of(info, bs) if ring else None)
        assert (cache.ring is not None) == ring
        assert not ring or (45 + 4) // bs > cache.ring.ring_blocks  # the ring wraps: blocks before the window are gone
        sb = StaticBatch(cache, len(prompts))
        steps = [sb.prefill(engine, prompts)]
        for _ in range(4):
            nxt = steps[-1].argmax(-1)
            steps.append(sb.step(engine, {i: [int(nxt[i])] for i in range(len(prompts))}))
        return torch.stack(steps, 1)

    kern = TorchEngine(model, attention="kernels", device="cpu")
    tor = TorchEngine(model, attention="torch", device="cpu")
    for ring in (True, False):
        want, got = run(tor, ring), run(kern, ring)
        assert (got - want).abs().max().item() < 1e-4, ring


# --------------------------------------------------------------------------- plan


def test_plan_counts_sliding_layers_by_their_window():
    # Gemma-3-like: 48 layers, five local (window 512) per global one, 8 KV heads of 256, at 32k context
    types = ((SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)) * 8
    shape = ModelShape("gemma3-like", 48, 8, 256, 0, types, 512)
    fp16, int4 = PRESETS["fp16"], PRESETS["int4"]
    ctx = 32768
    local, glob = layer_type_bytes(shape, fp16, ctx)
    # a local layer keeps the blocks of 64 that still hold a position >= ctx - 511: 8 blocks = 512 tokens, + its open block
    assert (local.layers, local.tokens_held, glob.layers, glob.tokens_held) == (40, 512, 8, ctx)
    row = 2 * 8 * 256 * 2  # K + V bytes of one token in one layer, fp16
    assert local.bytes_per_sequence == 40 * (512 + 64) * row and glob.bytes_per_sequence == 8 * ctx * row
    _, [r16, r4] = plan(shape, [fp16, int4], context_len=ctx, gpu_bytes=141 * GIB)
    all_global = 48 * ctx * row
    assert r16.window_saving == pytest.approx(all_global / (40 * 576 * row + 8 * ctx * row)) and 5.4 < r16.window_saving < 5.6
    assert 18 < all_global / (r4.kv_bytes_per_token * ctx) < 20  # int4 on top of the window: ~19x less than plain fp16
    # a model without local layers is planned as before
    _, [plain] = plan(ModelShape("m", 48, 8, 256), [fp16], context_len=ctx, gpu_bytes=141 * GIB)
    assert plain.kv_bytes_per_token == 48 * row and plain.window_saving == 1.0


def test_plan_reads_layer_types_from_the_model(family):
    info = model_info(str(family("gemma3")[0]))
    shape = ModelShape.from_info(info)
    assert shape.layer_counts() == {SLIDING_ATTENTION: 5, FULL_ATTENTION: 1} and shape.sliding_window == WINDOW
    local, _ = layer_type_bytes(shape, PRESETS["int8"], 200)  # blocks of 64: positions >= 193 sit in block 3 (192..255)
    assert local.tokens_held == 8  # 200 % 64 = 8 open-block tokens, no sealed block left in the window


# --------------------------------------------------------------------------- refusals


def _config_dir(tmp_path, **cfg):
    d = tmp_path / "m"
    d.mkdir()
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=320)
    (d / "config.json").write_text(json.dumps({**base, **cfg}))
    return d


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "Gemma3ForConditionalGeneration", "Qwen3MoeForCausalLM"])
def test_unsupported_architecture_is_refused_naming_the_supported(tmp_path, arch):
    d = _config_dir(tmp_path, architectures=[arch])
    with pytest.raises(TrtkvError, match=f"architecture {arch} is not supported") as e:
        model_info(str(d))  # config only: no weights exist
    assert all(a in e.value.fix for a in architectures())


@pytest.mark.parametrize("cfg,what", [
    (dict(num_key_value_heads=[2, 1]), "layers differ in num_key_value_heads"),
    (dict(head_dim=16, global_head_dim=32), "global_head_dim=32"),
])
def test_layers_differing_in_kv_geometry_are_refused(tmp_path, cfg, what):
    d = _config_dir(tmp_path, architectures=["Qwen3ForCausalLM"], **cfg)
    with pytest.raises(TrtkvError, match=what) as e:
        model_info(str(d))
    assert "same KV heads and head_dim" in e.value.fix


def test_unknown_layer_type_is_refused(tmp_path):
    d = _config_dir(tmp_path, architectures=["Qwen2ForCausalLM"], layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(TrtkvError, match="chunked_attention.*cannot be held"):
        model_info(str(d))

