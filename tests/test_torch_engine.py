"""The torch engine (trtkv/runtime/torch_engine.py) against independent engines, driven the way the runtime
drives them (``trtkv.runtime.verify``: block-aligned prefill chunks, batched decode, ``write_new_rows``).

References:
* the ONNX Runtime engine of the same model and format (its own graph, own attention, own dequantization);
* ``TorchReferenceEngine``: the transformers model per sequence over ``gather_paged`` (a DynamicCache);
* the torch engine's own vectorized path vs its kernel path (Triton kernels under ``TRITON_INTERPRET=1``).

Tolerances (float32 compute everywhere, tiny model, 2 layers):
* vs ONNX Runtime: both round this step's rows to fp16 before attending them (the contract), so only summation
  order differs: 1e-4 for every format; the 30-layer SmolLM2: ``REF_TOL`` of
  tests/test_build_engine.py (its reasoning holds here: float32 matmul differences turn into different fp16 /
  code values for a few sealed elements).
* vs TorchReferenceEngine: it attends this step's rows in float32, not fp16, so layer 1's K/V differ by ~2^-11
  relative, which after sealing can flip a code: 2e-3 for fp16 / int8, 1e-2 for int4 (measured on other prompts: 9e-5 / 4e-4 / 2.6e-3).
* kernel path vs torch path: the kernels dequantize in registers and use online softmax (ieee dot products
  under the interpreter): 1e-4.
"""

from __future__ import annotations

import copy

import pytest
import torch

from trtkv.builder.build import build_engine
from trtkv.cache_layout import PagedKVLayout
from trtkv.formats import CALIBRATION_FREE, fit_formats
from trtkv.manifest import load_manifest
from trtkv.models import load_model
from trtkv.runtime.backends import OnnxRuntimeEngine, TorchReferenceEngine
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.torch_engine import TorchEngine
from trtkv.runtime.verify import StaticBatch, greedy_decode

BLOCK = 4
KERNEL_BLOCK = 16  # the kernels' smallest block size (contract.LIMITS)
FORMATS = ["fp16", "int8", "int4"]
# besides the presets: scales folded into attention with a zero-point (per-token V), symmetric groups of 32, four 2-bit
# fields per byte and the bit-plane int3 (dequantized): the calibration-free 3- / 2-bit layouts
FOLDED = ["k=int8:token:asym,v=int4:token:asym:hadamard", "k=int4:g32:sym,v=int4:g32:sym", CALIBRATION_FREE["int3"], CALIBRATION_FREE["int2"]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from conftest import build_tiny_model

    d = tmp_path_factory.mktemp("tiny") / "tiny-mistral"
    build_tiny_model(d, "mistral", with_tokenizer=True, head_dim=32, hidden_size=96)  # head_dim the kernels take
    return d


@pytest.fixture(scope="module")
def tiny_loaded(tiny_dir):
    return load_model(str(tiny_dir), device="cpu", dtype="float32")


def _run(engine, cache: PagedKVCache, prompts: list[list[int]], decode_steps: int, feed: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [steps + 1, n, V]: after the (batched, block-chunked) prefill, then after each decode step, which
    feeds the greedy token of the previous logits (``feed``'s argmax when given: both engines see the same tokens)."""
    sb = StaticBatch(cache, len(prompts))
    out = [sb.prefill(engine, prompts)]
    for s in range(decode_steps):
        src = out[-1] if feed is None else feed[s]
        out.append(sb.step(engine, {i: [int(src[i].argmax())] for i in range(len(prompts))}))
    return torch.stack(out)


def _prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kv", FORMATS + FOLDED)
def test_tiny_matches_onnxruntime_engine(tmp_path, tiny_dir, tiny_loaded, kv):
    out = build_engine(str(tiny_dir), None, kv, tmp_path / "eng", backend="onnxruntime", block_size=BLOCK, max_seq_len=64,
                       max_batch=4, loaded=tiny_loaded)
    ort = OnnxRuntimeEngine(out)
    m = ort.manifest
    te = TorchEngine(load_model(str(tiny_dir), device="cpu", dtype="float32").model, m)
    prompts = _prompts(m.model.vocab_size, (13, 5, 9, 1))  # different lengths in one batch, prefill crossing blocks
    got, want = (_run(e, PagedKVCache.for_engine(m, out, num_blocks=40, num_slots=4), prompts, 7) for e in (te, ort))
    assert (got - want).abs().max().item() < 1e-4
    # the rows handed to the runtime are the same too: the caches after the run hold the same sealed bytes
    caches = [PagedKVCache.for_engine(m, out, num_blocks=40, num_slots=4) for _ in range(2)]
    toks = [greedy_decode(e, c, prompts, 10) for e, c in zip((te, ort), caches)]
    assert torch.equal(toks[0], toks[1])
    for name, t in caches[0].tensors.items():
        if t.dtype == torch.float16:
            assert (t.float() - caches[1].tensors[name].float()).abs().max().item() < 1e-3, name
        else:
            assert (t.int() - caches[1].tensors[name].int()).abs().le(1).float().mean().item() > 0.999, name


@pytest.mark.parametrize("kv", FORMATS)
def test_tiny_matches_per_sequence_reference(tiny_dir, kv):
    """The batched engine vs TorchReferenceEngine (per-sequence DynamicCache over gather_paged), with sinks sealed."""
    [fmt], _ = fit_formats([kv], 32)
    fmt = fmt.with_block_size(BLOCK)
    lay = PagedKVLayout(fmt, 2, 32, BLOCK, 48, 3)
    prompts = _prompts(320, (14, 6, 3), seed=1)
    te = TorchEngine(load_model(str(tiny_dir), device="cpu", dtype="float32").model)
    ref = TorchReferenceEngine(load_model(str(tiny_dir), device="cpu", dtype="float32").model)
    got, want = (_run(e, PagedKVCache(lay, 2), prompts, 6) for e in (te, ref))
    assert (got - want).abs().max().item() < (1e-2 if kv == "int4" else 2e-3)


@pytest.mark.parametrize("kv", ["k=int8:token:asym,v=int4:g8:asym", "k=int8:token:sym,v=int8:g16:asym"])
def test_folded_values_with_a_zero_point_per_group_match_the_per_sequence_reference(tiny_dir, kv):
    """Values folded into the probabilities with several channel groups per token, each with its own zero-point
    (4 and 2 groups at head_dim 32): each group's shift lands on its own channels. Sinks sealed, blocks of 4."""
    from trtkv.attention.torch_ops import folds_value_scales

    [fmt], _ = fit_formats([kv], 32)
    fmt = fmt.with_block_size(BLOCK)
    assert folds_value_scales(fmt.v) and fmt.v.groups(32) > 1 and not fmt.v.symmetric
    lay = PagedKVLayout(fmt, 2, 32, BLOCK, 48, 3)
    prompts = _prompts(320, (14, 6, 3), seed=3)
    te = TorchEngine(load_model(str(tiny_dir), device="cpu", dtype="float32").model)
    ref = TorchReferenceEngine(load_model(str(tiny_dir), device="cpu", dtype="float32").model)
    got, want = (_run(e, PagedKVCache(lay, 2), prompts, 6) for e in (te, ref))
    assert (got - want).abs().max().item() < 1e-2


def test_stale_pool_and_tail_rows_never_leak(tiny_dir):
    """Blocks no table lists and tail rows past a context may hold NaN: the logits stay finite and unchanged."""
    [fmt], _ = fit_formats(["int4"], 32)
    lay = PagedKVLayout(fmt.with_block_size(BLOCK), 2, 32, BLOCK, 24, 2)
    te = TorchEngine(load_model(str(tiny_dir), device="cpu", dtype="float32").model)
    prompts = _prompts(320, (9, 2), seed=2)
    clean = _run(te, PagedKVCache(lay, 2), prompts, 3)
    dirty = PagedKVCache(lay, 2)
    for t in dirty.tensors.values():
        if t.is_floating_point():
            t.fill_(float("nan"))
    got = _run(te, dirty, prompts, 3)
    assert torch.isfinite(got).all() and torch.equal(got, clean)


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["int4", CALIBRATION_FREE["int3"], CALIBRATION_FREE["int2"]])
def test_kernel_path_under_interpreter_equals_torch_path(tiny_dir, monkeypatch, kv):
    """attention="kernels" (the CUDA path: Triton decode / prefill kernels) run on CPU under TRITON_INTERPRET=1,
    end to end on the 2-layer model with the int4 / int3 / int2 presets (sinks, Hadamard V, per-block-channel K),
    vs the torch path."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    [fmt], _ = fit_formats([kv], 32)
    lay = PagedKVLayout(fmt.with_block_size(KERNEL_BLOCK), 2, 32, KERNEL_BLOCK, 12, 3)
    prompts = _prompts(320, (37, 17, 5), seed=3)  # prefill chunks crossing two blocks, a first block sealed with sinks
    model = load_model(str(tiny_dir), device="cpu", dtype="float32").model
    kern = TorchEngine(model, attention="kernels")
    got = _run(kern, PagedKVCache(lay, 2), prompts, 3)
    tor = TorchEngine(copy.deepcopy(model), attention="torch")
    want = _run(tor, PagedKVCache(lay, 2), prompts, 3)
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("attention", ["torch", pytest.param("kernels", marks=pytest.mark.slow)])
def test_decode_at_graph_shapes_equals_unpadded(tiny_dir, monkeypatch, attention):
    """What a CUDA graph replays (``cuda_graphs=True``; on CPU run eagerly): decode batches padded to power-of-two
    rows and table columns (padding rows at context 0 in slot 0, -1 columns) give the real rows' logits and K/V rows."""
    if attention == "kernels":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    block = KERNEL_BLOCK if attention == "kernels" else BLOCK
    [fmt], _ = fit_formats(["int4"], 32)
    lay = PagedKVLayout(fmt.with_block_size(block), 2, 32, block, 20, 3)
    model = load_model(str(tiny_dir), device="cpu", dtype="float32").model
    plain = TorchEngine(model, attention=attention, cuda_graphs=False)
    padded = TorchEngine(copy.deepcopy(model), attention=attention, cuda_graphs=True)
    seen = []
    real_graph_shape = padded.graph_shape
    padded.graph_shape = lambda b: seen.append(real_graph_shape(b)) or seen[-1]
    prompts = _prompts(320, (2 * block + 3, block + 1, 5), seed=5)  # 3 rows -> 4; 3 / 2 / 1 table columns -> 4
    want, got = (_run(e, PagedKVCache(lay, 2), prompts, 2 if attention == "kernels" else 4) for e in (plain, padded))
    assert seen and all(r == 4 and c >= 3 for r, c in seen)
    assert (got - want).abs().max().item() < 1e-5


def test_auto_attention_takes_the_torch_ops_where_the_kernels_stop(tmp_path, tiny_dir, tiny_loaded):
    """On CUDA ``auto`` picks the kernels only for what they implement: an engine with a searched (mse) seal, or one
    with blocks of 4 (the kernels start at 16), gets the torch ops, and its note says why; int4 / int3 / int2 engines
    with blocks of 16 the kernels."""
    from trtkv.attention import resolve

    def manifest(kv, block):
        d = build_engine(str(tiny_dir), None, kv, tmp_path / f"{kv}-{block}", backend="torch", block_size=block, max_seq_len=64, loaded=tiny_loaded)
        return load_manifest(d)

    for kv in ("int4", *CALIBRATION_FREE.values()):
        assert resolve("auto", "cuda", manifest(kv, KERNEL_BLOCK)).name == "kernels", kv
    mse = resolve("auto", "cuda", manifest("k=int3:bchannel:asym:mse,v=int3:g32:sym:hadamard,block=16", KERNEL_BLOCK))
    assert mse.name == "torch" and "mse" in mse.note
    small = resolve("auto", "cuda", manifest("int4", BLOCK))
    assert small.name == "torch" and "block size" in small.note


@pytest.mark.parametrize("attention", ["torch", "kernels"])
def test_steps_parse_no_format_string(tiny_dir, monkeypatch, attention):
    """The hot path carries TensorFormat objects: after the engine and cache exist, prefill and decode steps (the kernel
    path's ops and the device seal included; on CPU they run the torch references) never make or parse a spec string."""
    import trtkv.formats
    import trtkv.plugins.contract.attrs
    from trtkv.formats import TensorFormat

    [fmt], _ = fit_formats(["int4"], 32)  # sinks, Hadamard, per-block-channel K, groups of V
    lay = PagedKVLayout(fmt.with_block_size(KERNEL_BLOCK), 2, 32, KERNEL_BLOCK, 12, 3)
    from trtkv.attention.triton import TritonKernels

    # the kernel path with its seal kernel (the CUDA seal, here under the interpreter)
    te = TorchEngine(load_model(str(tiny_dir), device="cpu", dtype="float32").model,
                     attention=TritonKernels(seal_kernel=True) if attention == "kernels" else attention)
    cache = PagedKVCache(lay, 2)
    calls = []
    real_parse, real_short = trtkv.formats.parse_tensor_spec, TensorFormat.short

    def parse(text):
        calls.append(text)
        return real_parse(text)

    def short(self):
        calls.append(self)
        return real_short(self)

    for mod in (trtkv.formats, trtkv.plugins.contract.attrs):
        monkeypatch.setattr(mod, "parse_tensor_spec", parse)
    monkeypatch.setattr(TensorFormat, "short", short)
    _run(te, cache, _prompts(320, (19, 5), seed=6), 13)  # seals a first block (sinks) and a second one
    assert int(cache.tensors["k_data"].view(torch.uint8).any()) and calls == []


# --------------------------------------------------------------------------- the real model (SmolLM2-135M)


@pytest.fixture(scope="module")
def real_engines(builtin_model, tmp_path_factory):
    """ONNX Runtime engines of the real model, built on first use (the first tier uses int4 only)."""
    root = tmp_path_factory.mktemp("real-torch")
    built: dict = {}

    def get(kv: str):
        if kv not in built:
            built[kv] = build_engine("smollm2-135m", None, kv, root / kv, backend="onnxruntime", max_batch=4, max_seq_len=512,
                                     loaded=builtin_model)
        return built[kv]

    return get


class _SameCache:
    """Runs the torch engine and the ONNX Runtime engine on the same cache and batch; returns ONNX Runtime's output
    (the runtime writes ORT's rows) and keeps the largest differences of logits and new rows."""

    def __init__(self, torch_engine, ort_engine):
        self.te, self.ort = torch_engine, ort_engine
        self.logits = self.rows = 0.0

    def step(self, batch, cache):
        a, b = self.te.step(batch, cache), self.ort.step(batch, cache)
        valid = torch.arange(batch.num_tokens)[None, :] < batch.new_lens[:, None]
        self.logits = max(self.logits, (a.logits - b.logits).abs().max().item())
        for x, y in ((a.new_k, b.new_k), (a.new_v, b.new_v)):
            self.rows = max(self.rows, (x.float() - y.float())[:, valid].abs().max().item())
        return b


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("kv", [pytest.param(kv, marks=[] if kv == "int4" else pytest.mark.tier2) for kv in FORMATS])
def test_real_model_matches_onnxruntime_engine(builtin_model, real_engines, kv):
    """On the same cache the engines agree to float32 summation order (SAME_CACHE_TOL of test_build_engine, meant
    for exactly this: only the arithmetic of the step differs). Run independently (each sealing its own rows, same
    tokens fed), sealed codes differ where last-bit differences cross a rounding boundary (REF_TOL's reasoning):
    the greedy token may differ only where the top-2 gap is smaller than the two logits' difference there."""
    from test_build_engine import SAME_CACHE_TOL

    out = real_engines(kv)
    ort = OnnxRuntimeEngine(out)
    m = ort.manifest
    te = TorchEngine(copy.deepcopy(builtin_model.model), m)
    text = builtin_model.tokenizer('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' * 3).input_ids
    prompts = [text[:150], text[:70], text[:20]]  # 2 sealed blocks + open rows, 1 block + rows, open only
    both = _SameCache(te, ort)
    _run(both, PagedKVCache.for_engine(m, out, num_blocks=16, num_slots=3), prompts, 12)
    print(f"{kv}: same cache: max |logit diff| {both.logits:.2e}, max |new row diff| {both.rows:.2e}")
    # rows: fp16 values of |x| up to ~30; measured 1.56e-2 = one fp16 step at |x| in [16, 32) (float32 sums rounding
    # the other way), logits 3.9e-3 for every format; own caches: int4 7.5e-2, int8 3.2e-2, fp16 1.1e-2, no token differing
    assert both.logits < SAME_CACHE_TOL and both.rows < 2e-2, (both.logits, both.rows)
    want = _run(ort, PagedKVCache.for_engine(m, out, num_blocks=16, num_slots=3), prompts, 12)
    got = _run(te, PagedKVCache.for_engine(m, out, num_blocks=16, num_slots=3), prompts, 12, feed=want)  # same tokens
    differ = (got.argmax(-1) != want.argmax(-1)).nonzero().tolist()
    print(f"{kv}: own caches: max |logit diff| {(got - want).abs().max().item():.2e}, greedy tokens differing {differ}")
    for s, b in differ:
        top2 = want[s, b].topk(2).values
        assert float(top2[0] - top2[1]) < 2 * (got[s, b] - want[s, b]).abs().max().item(), (kv, s, b)
    assert len(differ) <= 2, differ
