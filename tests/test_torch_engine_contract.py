"""The torch engine's attention over the paged cache (trtkv/runtime/torch_engine.py, torch-ops path on CPU) against
``TorchReferenceEngine`` (transformers over ``gather_paged``), on what the preset tests leave out: calibrated smoothing
factors unlike 1 (folded into the query for keys, undone on the output for values), static per-channel / per-head
scales, zero-points on folded keys and values, sink rows, several value groups; and a cache whose unused pool blocks,
scales and stale open-block rows hold NaN, which no valid output may read.

The tiny random model attends almost uniformly (its logits barely move with attention), so its attention weights are
sharpened (``sharp``): then a 1 % change of the attention scores moves the logits 2-100x more than the engines differ
(measured: engine vs reference 0.003-0.014 on logits up to 5, 0.07 for int4 per-token keys, whose codes flip with the
reference's float32 rows; a 1 % score change 0.03-3.8).
"""

from __future__ import annotations

import copy

import pytest
import torch

from trtkv.artifacts import LayerParams
from trtkv.attention.torch_ops import folds_key_scales, folds_value_scales
from trtkv.cache_layout import PagedKVLayout
from trtkv.formats import get_format
from trtkv.quant import TensorParams
from trtkv.runtime.backends import TorchReferenceEngine
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.torch_engine import TorchEngine
from trtkv.runtime.verify import StaticBatch

BS = 4


def params_for(fmt, H: int, D: int, layers: int, seed: int) -> list[LayerParams]:
    """Smoothing factors in [0.5, 2] and static scales of the right shape, different per layer and side."""
    g = torch.Generator().manual_seed(seed)

    def side(t):
        smooth = (torch.rand(H, D, generator=g) * 1.5 + 0.5) if t.smooth else None
        scale = None
        if t.granularity == "per_tensor":
            scale = torch.tensor(0.02 + 0.01 * torch.rand(1, generator=g).item())
        elif t.granularity == "per_head":
            scale = 0.02 + 0.01 * torch.rand(H, generator=g)
        elif t.granularity == "per_channel":
            scale = 0.02 + 0.01 * torch.rand(H, D, generator=g)
        return TensorParams(scale=scale, smooth=smooth)

    return [LayerParams(k=side(fmt.k), v=side(fmt.v)) for _ in range(layers)]


def garbage(cache: PagedKVCache, seed: int) -> None:
    """NaN in every float entry and random bytes in every code: what other owners leave in blocks and slots."""
    g = torch.Generator().manual_seed(seed)
    for t in cache.tensors.values():
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        else:
            t.copy_(torch.randint(0, 256, t.shape, generator=g).to(torch.uint8).view(t.dtype) if t.element_size() == 1 else t)


def run(engine, cache, prompts, steps):
    sb = StaticBatch(cache, len(prompts))
    out = [sb.prefill(engine, prompts)]
    for _ in range(steps):
        out.append(sb.step(engine, {i: [int(out[-1][i].argmax())] for i in range(len(prompts))}))
    return torch.stack(out)


SPECS = [  # (spec, absolute tolerance on the logits)
    # keys folded (per channel per block, a zero-point, smoothing), values folded (per token, a zero-point, smoothing), sinks
    ("k=int8:bchannel:asym:smooth,v=int8:token:asym:smooth,block=4,sink=2", 0.015),
    # keys dequantized (per token, rotated and smoothed), values folded in groups of 8
    ("k=int4:token:asym:smooth:hadamard,v=int4:g8:sym,block=4", 0.1),
    # static per-channel keys with smoothing, static per-head values, a sink
    ("k=int8:channel:smooth,v=int8:head:smooth,block=4,sink=1", 0.015),
    # several value groups with zero-points, symmetric keys folded with their code offset
    ("k=int4:bchannel:sym,v=int8:g16:asym,block=4,sink=1", 0.04),
]


@pytest.fixture(scope="module")
def sharp(small_llama):
    m = copy.deepcopy(small_llama)
    with torch.no_grad():
        for layer in m.model.layers:
            a = layer.self_attn
            a.q_proj.weight.mul_(6.0), a.k_proj.weight.mul_(6.0), a.v_proj.weight.mul_(3.0), a.o_proj.weight.mul_(3.0)
        m.lm_head.weight.mul_(5.0)
    return m


@pytest.mark.parametrize("spec, tol", SPECS)
def test_torch_engine_equals_the_per_sequence_reference(sharp, spec, tol):
    fmt = get_format(spec)
    cfg = sharp.config
    H, D, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    params = params_for(fmt, H, D, L, seed=len(spec))
    prompts = [[(7 * i + 3) % 300 + 1 for i in range(n)] for n in (11, 6, 2)]  # the last: stale NaN rows in its first open block
    outs = []
    for engine in (TorchEngine(copy.deepcopy(sharp), attention="torch"), TorchReferenceEngine(copy.deepcopy(sharp))):
        cache = PagedKVCache(PagedKVLayout(fmt, H, D, BS, 24, 3), L, params)
        garbage(cache, seed=1)
        outs.append(run(engine, cache, prompts, 5))
    got, want = outs
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() < tol and want.abs().max().item() > 1.0


def test_the_specs_take_the_folded_and_the_dequantized_paths():
    kinds = [(folds_key_scales(get_format(s).k), folds_value_scales(get_format(s).v)) for s, _ in SPECS]
    assert kinds == [(True, True), (False, True), (False, False), (True, True)]


def test_the_model_stays_its_owners_after_engine_steps(small_llama):
    """The engine switches the model to trtkv's paged attention during its steps only: the same model object, called
    by its owner afterwards, runs transformers' own attention and gives the logits it gave before the engine existed."""
    model = copy.deepcopy(small_llama)
    ids = torch.tensor([[5, 9, 2, 7, 3]])
    with torch.no_grad():
        before = model(ids).logits
    cfg = model.config
    fmt = get_format("fp16").with_block_size(BS)
    cache = PagedKVCache(PagedKVLayout(fmt, cfg.num_key_value_heads, cfg.head_dim, BS, 8, 2), cfg.num_hidden_layers)
    run(TorchEngine(model, attention="torch"), cache, [[5, 9, 2]], 2)
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before)
