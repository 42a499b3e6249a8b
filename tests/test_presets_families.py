"""Every preset on every model family: ``trtkv calibrate`` -> eval -> generation through the torch engine, on a tiny
random model of each family (Gemma 3 with a local and a global layer, whose RoPE bases differ), and the float64
reference of keys stored before RoPE on a model with two RoPE bases.

References: the eval cache (``trtkv.kv_cache``: the engine's sealed-block semantics in transformers) gives the tokens the
torch engine must generate; the unquantized model bounds the eval's logits; for keys stored before RoPE, float64 RoPE
computed from the config's bases (not transformers' rotary module) bounds what a sealed key reads back as.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_TEXT

from trtkv.artifacts import LayerParams
from trtkv.cache_layout import PagedKVLayout, gather_paged
from trtkv.formats import PRESETS, fit_formats, get_format
from trtkv.kv_cache import QuantizedKVCache
from trtkv.models import load_model
from trtkv.rope import RopeTable
from trtkv.runtime.kv_pool import PagedKVCache

# conftest arch -> config overrides: every family trtkv supports; Gemma 2 / 3 with sliding layers, Gemma 3 with one local
# and one global layer (two RoPE bases in two layers)
FAMILY_MODELS = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "gemma2": dict(sliding_window=8),
    "gemma3": dict(sliding_window=8, sliding_window_pattern=2),
    "phi3": {},
}
BLOCK = 16  # the engine's and the eval's sealed blocks: a 20-token prompt and 12 new tokens seal two
GEMMA3_TWO_BASES = dict(FAMILY_MODELS["gemma3"], head_dim=32)


@pytest.fixture(scope="module", autouse=True)
def _tiny_matmuls(one_thread):
    """Tiny models: one thread each (conftest's ``one_thread``)."""


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TINY_TEXT * 60)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(FAMILY_MODELS))
def test_every_preset_calibrates_evaluates_and_generates(arch, tiny_models, text, tmp_path):
    """One calibration of every preset (``--method max``, 2 windows of 128 tokens: whole blocks of the int3 / int2
    presets' 128 to fit per-channel bits on); then per preset, at blocks of 16: the eval cache's logits stay near the unquantized model's
    (fp16 exactly), and the torch engine built from the calibration (its C kernels) generates the eval cache's greedy
    tokens, sealing blocks as it goes."""
    from trtkv.artifacts import load_calibration
    from trtkv.builder.build import build_engine
    from trtkv.calibration.run import run_calibration
    from trtkv.evaluate import greedy_generate, model_logits
    from trtkv.manifest import load_manifest
    from trtkv.runtime.torch_engine import TorchEngine
    from trtkv.runtime.verify import greedy_decode

    d, _ = tiny_models(arch, with_tokenizer=True, **FAMILY_MODELS[arch])
    loaded = load_model(str(d), device="cpu", dtype="float32")
    model, info = loaded.model, loaded.info
    if arch == "gemma3":  # the case this test is for: layers that rotate by different bases
        assert len(set(RopeTable.per_layer(model))) == 2
    cal = run_calibration(str(d), str(text), tmp_path / "cal", formats=list(PRESETS), method="max", samples=2, seq_len=128, progress=False,
                          loaded=loaded)
    art = load_calibration(cal)
    ids = torch.randint(0, info.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = model(ids).logits
    errors = {}
    for name in PRESETS:
        [fmt], _ = fit_formats([name], info.head_dim)
        params = art.params_for(fmt, info)
        with torch.inference_mode():
            got = model_logits(model, ids, fmt.with_block_size(BLOCK) if fmt.sealed else fmt, params)
        assert torch.isfinite(got).all(), name
        errors[name] = (got - ref).abs().max().item()
        out = build_engine(str(d), str(cal), name, tmp_path / f"engine-{name}", backend="torch", block_size=BLOCK, max_seq_len=64,
                           max_batch=2, loaded=loaded)
        m = load_manifest(out)
        cache = PagedKVCache.for_engine(m, out, num_blocks=8, num_slots=2)
        with torch.inference_mode():
            want = greedy_generate(model, ids, m.kv_format, cache.params, new_tokens=12)
        assert torch.equal(greedy_decode(TorchEngine(model, m), cache, ids.tolist(), 12), want), name
    assert errors["fp16"] == 0.0 and errors["int8"] < errors["int2"] < 1.0, errors


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["torch", "kernels"])
def test_gemma3_engine_paths_read_each_layers_rope_base(tiny_models, monkeypatch, attention):
    """The torch engine's other attentions on a model with two RoPE bases and a calibration-shaped int3 preset: the
    torch ops, and the Triton kernels (under the interpreter), give the C kernels' logits over prefill and decode steps
    that read sealed pre-RoPE keys of both layers (test_torch_engine's kernel-vs-torch tolerance, 1e-4)."""
    from conftest import random_kv_params

    from trtkv.runtime.torch_engine import TorchEngine
    from trtkv.runtime.verify import StaticBatch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    d, _ = tiny_models("gemma3", with_tokenizer=True, **GEMMA3_TWO_BASES)
    model = load_model(str(d), device="cpu", dtype="float32").model
    [fmt], _ = fit_formats(["int3"], 32)
    fmt = fmt.with_block_size(BLOCK)
    H = model.config.num_key_value_heads
    params = random_kv_params(fmt, H, 32, 2, seed=3)
    prompts = [list(range(3, 40)), list(range(50, 61))]

    def run(engine):
        cache = PagedKVCache(PagedKVLayout(fmt, H, 32, BLOCK, 8, 2), 2, params)
        sb = StaticBatch(cache, len(prompts))
        steps = [sb.prefill(engine, prompts)]
        for _ in range(3):
            nxt = steps[-1].argmax(-1)
            steps.append(sb.step(engine, {i: [int(nxt[i])] for i in range(len(prompts))}))
        return torch.stack(steps, 1)

    want = run(TorchEngine(model, attention="cpu", device="cpu"))
    got = run(TorchEngine(model, attention=attention, device="cpu"))
    assert (got - want).abs().max().item() < 1e-4


def _rope64(theta: float, positions: torch.Tensor, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(cos, sin)`` [n, D] of RoPE with base ``theta`` (rotate-half layout: the angles twice)."""
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = positions.double()[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def _rotate64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos - rot * sin if inverse else x * cos + rot * sin


class _NoRotation:
    """A RoPE table of angle 0 everywhere: reading a pre-RoPE store with it gives the stored frame itself."""

    def cos_sin(self, positions):
        n = positions.numel()
        return torch.ones(n, 32), torch.zeros(n, 32)

    def rows(self, start, n, device=None):
        return self.cos_sin(torch.arange(n))


def test_a_sealed_pre_rope_key_reads_back_rotated_by_its_own_layers_base(tiny_models):
    """On a Gemma-3-like model (a local layer with RoPE base 10^4, a global one with 10^6): each layer's RoPE table is
    float64 RoPE of its own base; keys after RoPE, sealed before RoPE into int8 blocks -- the paged cache (the pool's
    reference seal) and the eval cache -- are stored within one quantization step of the float64 pre-RoPE keys of their
    own layer's base, and read back within a step of themselves. A cache that rotated every layer by one table fails
    the first (and a read by the other layer's table misses by far more than a step)."""
    d, model = tiny_models("gemma3", **GEMMA3_TWO_BASES)
    cfg = model.config
    thetas = [cfg.rope_parameters[t]["rope_theta"] for t in cfg.layer_types]
    assert thetas[0] != thetas[1]
    ropes = RopeTable.per_layer(model)
    D, H, n = 32, 1, 3 * BLOCK
    pos = torch.arange(n)
    for table, theta in zip(ropes, thetas):
        cos, sin = table.cos_sin(pos)
        cos64, sin64 = _rope64(theta, pos, D)
        assert (cos.double() - cos64).abs().max() < 1e-5 and (sin.double() - sin64).abs().max() < 1e-5

    fmt = get_format(f"k=int8:bchannel:asym:prerope,v=fp16,block={BLOCK}")
    g = torch.Generator().manual_seed(11)
    pre = torch.randn(2, H, n, D, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3.0, D, dtype=torch.float64)  # per layer
    post = torch.stack([_rotate64(pre[i], *_rope64(thetas[i], pos, D)) for i in range(2)])  # what attention hands the cache
    step = (pre.amax(-2, keepdim=True) - pre.amin(-2, keepdim=True)).amax() / 255  # the widest channel's int8 step
    tol = 1.5 * step + 1e-2  # + the fp16 rounding of the open block the seal quantizes

    cache = PagedKVCache(PagedKVLayout(fmt, H, D, BLOCK, 4, 1), 2, [LayerParams(), LayerParams()])
    cache.use_model_rope(model)
    table = torch.arange(n // BLOCK)
    for b in range(n // BLOCK):  # the open block filled with post-RoPE rows, then sealed
        cache.tensors["k_tail"][:, 0, :, :BLOCK] = post[:, :, b * BLOCK : (b + 1) * BLOCK].half()
        cache.seal(0, b, b)
    eval_cache = QuantizedKVCache(fmt, 2, [LayerParams(), LayerParams()], ropes)
    for layer in range(2):
        for b in range(n // BLOCK):  # block by block, as a prefill chunked at block boundaries writes them
            eval_cache.layers[layer].k_store.append(post[layer][None, :, b * BLOCK : (b + 1) * BLOCK].float())
    sealed = n - BLOCK  # the eval cache seals a block when the next one arrives: the last stays open
    for layer in range(2):
        def read(rope, layer=layer):
            return gather_paged(cache.layout_of(layer), "k", cache.pool(layer, "k"), table, n, rope=rope).transpose(0, 1).double()

        assert (read(_NoRotation()) - pre[layer]).abs().max() < tol, layer  # sealed in the layer's own pre-RoPE frame
        assert (read(cache.rope_for(layer, fmt.k)) - post[layer]).abs().max() < tol, layer
        assert (read(ropes[1 - layer]) - post[layer]).abs().max() > 10 * step, layer
        store = eval_cache.layers[layer].k_store
        assert (store.read()[0, :, :sealed].double() - post[layer][:, :sealed]).abs().max() < tol, layer
        store.rope = _NoRotation()  # the stored codes decoded afresh without RoPE (a read returns the rows it kept)
        assert (store._decode(store.quantized)[0, :, :sealed].double() - pre[layer][:, :sealed]).abs().max() < tol, layer
