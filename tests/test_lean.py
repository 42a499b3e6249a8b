"""The lean Llama-family forward (trtkv/runtime/lean.py) and the CPU step threads.

* the lean forward gives transformers' own forward, through the same paged attention, on tiny random models of every
  lean family (Llama, Mistral with a window, Qwen2 with Q/K/V biases and sliding layers, Qwen3 with per-head Q/K
  norms), prefill chunks and decode steps, fp16 and int4 caches; the model's own forward is unchanged after the weights
  became views of the fused tensors, and nothing is stored twice;
* the families it does not run (Gemma 2 / 3, Phi-3) get a reason and run transformers' modules;
* ``RuntimeConfig.step_threads``: every core, ``cpu_threads`` when given; the runtime sets them for every step of a
  CPU torch engine.
"""

from __future__ import annotations

import copy

import pytest
import torch

from trtkv.cache_layout import PagedKVLayout
from trtkv.formats import fit_formats
from trtkv.models import model_info
from trtkv.runtime.config import RuntimeConfig
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.lean import LeanDecoder
from trtkv.runtime.torch_engine import TorchEngine
from trtkv.runtime.verify import StaticBatch

LEAN = {
    "llama": dict(),
    "mistral": dict(sliding_window=6),
    "qwen2": dict(sliding_window=6, use_sliding_window=True, max_window_layers=1, num_hidden_layers=3),
    "qwen3": dict(head_dim=32),
}


def _run(engine, cache, prompts, new_tokens):
    sb = StaticBatch(cache, len(prompts))
    steps = [sb.prefill(engine, prompts)]
    for _ in range(new_tokens):
        nxt = steps[-1].argmax(-1)
        steps.append(sb.step(engine, {i: [int(nxt[i])] for i in range(len(prompts))}))
    return torch.stack(steps, 1)


@pytest.mark.parametrize("arch", sorted(LEAN))
@pytest.mark.parametrize("kv", ["fp16", "int4"])
def test_lean_forward_gives_the_transformers_logits(tiny_model, arch, kv):
    d, model = tiny_model(arch, **LEAN[arch])
    if arch == "qwen2":  # Qwen2's Q/K/V biases: random, not the zeros a fresh model starts with
        with torch.no_grad():
            for layer in model.model.layers:
                for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    lin.bias.normal_(0, 0.5)
    info = model_info(str(d))
    [fmt], _ = fit_formats([kv], info.head_dim)
    prompts = [list(range(3, 30)), list(range(40, 51))]
    out = {}
    for lean in (False, True):
        m = copy.deepcopy(model)
        engine = TorchEngine(m, attention="torch", device="cpu", lean=lean)
        assert (engine.lean is not None) == lean
        lay = PagedKVLayout(fmt.with_block_size(4), info.num_kv_heads, info.head_dim, 4, 40, 2)
        out[lean] = _run(engine, PagedKVCache(lay, info.num_layers), prompts, 8)
    torch.testing.assert_close(out[True], out[False], rtol=1e-4, atol=1e-4)


def test_fused_weights_are_stored_once_and_the_model_forward_is_unchanged(tiny_model):
    _, model = tiny_model("qwen3", head_dim=32)
    ids = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        before = model(ids).logits
    lean = LeanDecoder(model, attention=None)
    layer, att = lean.layers[0], model.model.layers[0].self_attn
    for lin in (att.q_proj, att.k_proj, att.v_proj):
        assert lin.weight.untyped_storage().data_ptr() == layer.qkv.untyped_storage().data_ptr()  # a view, no copy
    assert layer.qkv.shape == (model.config.hidden_size, (4 + 2 + 2) * 32)  # [in, out]: transposed
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_other_families_run_transformers_modules(tiny_models, arch):
    _, model = tiny_models(arch)
    reason = LeanDecoder.reason(model)
    assert reason and type(model).__name__ in reason
    assert TorchEngine(copy.deepcopy(model), attention="torch", device="cpu").lean is None


def test_a_non_silu_mlp_is_refused(tiny_model):
    _, model = tiny_model("llama", hidden_act="gelu")
    assert "gelu" in LeanDecoder.reason(model)


def test_step_threads():
    assert [RuntimeConfig().step_threads(n) for n in (1, 2, 16)] == [1, 2, 16]
    assert RuntimeConfig(cpu_threads=3).step_threads(2) == 3 == RuntimeConfig(cpu_threads=3).step_threads(16)


@pytest.mark.parametrize("cpu_threads, want", [(None, 3), (2, 2)])
def test_the_runtime_sets_the_threads_of_every_step(small_llama, tokenizer, monkeypatch, cpu_threads, want):
    """Every step of a CPU torch engine, prefill and decode, runs with ``step_threads`` (recorded inside the step), though
    something else in the process set torch's threads in between."""
    from test_runtime_faults import make_llm

    from trtkv.runtime.sequence import SamplingParams

    llm = make_llm(small_llama, tokenizer, "int8", max_batched_tokens=96, num_blocks=64)
    llm.config = llm.config.replace(cpu_threads=cpu_threads)
    seen = []
    step = llm.engine.step

    def recording(batch, cache):
        seen.append((int(batch.new_lens.sum()), torch.get_num_threads()))
        torch.set_num_threads(1)  # another user of torch's pool in the process: the next step sets its threads again
        return step(batch, cache)

    monkeypatch.setattr(llm.engine, "step", recording)
    assert llm.cores is not None
    llm.cores = 3  # as on a 3-core machine
    n = torch.get_num_threads()
    try:
        llm.generate([list(range(5, 18))], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    finally:
        torch.set_num_threads(n)
    assert {tokens > 1 for tokens, _ in seen} == {True, False}, seen  # prefill and decode steps
    assert all(threads == want for _, threads in seen), seen


def test_the_engine_line_says_how_it_runs(small_llama, tokenizer):
    from test_runtime_faults import make_llm

    llm = make_llm(small_llama, tokenizer, "int8")
    llm.cores = 4
    line = llm.describe_engine()
    assert line.startswith("torch engine on cpu") and "threads 4" in line
    assert "steps across blocks" not in line  # the reference engine takes one block per step
    llm.config = llm.config.replace(cpu_threads=2)
    assert "threads 2" in llm.describe_engine()
