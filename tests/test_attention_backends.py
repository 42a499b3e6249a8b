"""The attention backends' contract (trtkv/attention/), one parametrized test over the registry: a backend is tested by
being registered.

* **Decode of sealed blocks**: each backend's ``attend`` -- a decode step and a prefill chunk over a paged cache whose
  blocks it sealed itself -- against float64 attention over the reference codec (``plugins.reference.paged_attention_ref``:
  ``cache_layout.gather_paged``, i.e. ``trtkv.quant.dequantize`` of the same pool bytes), on fresh random rows, for every
  preset and each calibrated storage feature (codebooks, outlier lists, keys before RoPE, per-channel widths, static
  scales, smoothing, Hadamard rotations), at odd sizes where the backend takes them (blocks of 5, head dim 20, 3 KV
  heads with 2 queries each; the Triton kernels take blocks of 16 and head dims of 32 at least).
* **Seal**: each backend's seal stores the reference quantizer's bytes (``trtkv.quant.quantize_block``), sink rows
  included (the Triton seal kernel in place, under the interpreter).
* **Choice**: ``resolve`` (``--attention``): ``auto`` takes the first registered backend without a refusal and says what
  it passed over; a named backend that cannot run is one line naming why; the engine hands its backend to the cache.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import random_widths

from trtkv.artifacts import LayerParams
from trtkv.attention import BACKENDS, CpuKernels, TorchOps, TritonKernels, names, resolve
from trtkv.cache_layout import PagedKVLayout
from trtkv.engine_backends import ATTENTIONS
from trtkv.errors import TrtkvError
from trtkv.formats import CALIBRATION_FREE, fit_formats
from trtkv.plugins.reference import paged_attention_ref
from trtkv.quant import TensorParams
from trtkv.rope import RopeTable
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.step import StepBatch, StepOutput

SPECS = [
    "fp16", "fp8", "int8-static", "int8", "int4", "int3", "int2", CALIBRATION_FREE["int3"], CALIBRATION_FREE["int2"],
    "k=int4:bchannel:asym:nuq,v=int4:g4:sym:out8,block=8,sink=1",  # a key codebook, value outlier lists
    "k=int8:bchannel:asym:prerope:smooth,v=int8:token:asym:smooth,block=8,sink=2",  # keys before RoPE, smoothing
    "k=int8:channel:smooth,v=int8:head,block=8",  # static per-channel keys, per-head values
]
SIZES = [(5, 20), (5, 32), (16, 32)]  # (block size, head dim): the first a backend and the format take
H, G, L = 3, 2, 2  # KV heads, queries per KV head, layers


def _params(fmt, D: int, seed: int) -> list[LayerParams]:
    """Made-up calibration constants of every kind ``fmt`` asks for: smoothing factors, static scales, codebooks, widths."""
    g = torch.Generator().manual_seed(seed)

    def side(tf):
        scale = {"per_tensor": lambda: torch.tensor(0.03), "per_head": lambda: 0.02 + 0.02 * torch.rand(H, generator=g),
                 "per_channel": lambda: 0.02 + 0.02 * torch.rand(H, D, generator=g)}.get(tf.granularity, lambda: None)()
        return TensorParams(scale=scale, smooth=torch.rand(H, D, generator=g) + 0.5 if tf.smooth else None,
                            codebook=torch.sort(torch.randn(H, tf.codebook_levels, generator=g) * 1.5, -1).values if tf.codebook else None,
                            bits=random_widths(tf, H, D, g) if tf.allocated_bits is not None else None)

    return [LayerParams(k=side(fmt.k), v=side(fmt.v)) for _ in range(L)]


def _rope(D: int) -> RopeTable:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=D * H, num_attention_heads=H, head_dim=D, rope_theta=100.0)
    return RopeTable(LlamaRotaryEmbedding(cfg), D)


def _setup(backend_cls, spec: str):
    """(format, block size, head dim) at the first of ``SIZES`` the format fits and the backend takes, or a skip."""
    for bs, D in SIZES:
        fitted, _ = fit_formats([spec], D, optional=True)
        if not fitted:
            continue
        fmt = fitted[0].with_block_size(bs)
        if fmt.sink_tokens >= bs:
            fmt = fmt.model_copy(update={"sink_tokens": bs - 1})
        try:
            fmt.check_layers(L)
            PagedKVLayout(fmt, H, D, bs, 1, 1)
        except (TrtkvError, ValueError):
            continue
        if backend_cls.refusal("cpu", fmt, None, bs, D) is None:
            return fmt, bs, D
    pytest.skip(f"the {backend_cls.name} backend takes {spec} at none of {SIZES}")


def _backend(cls):
    return cls("cpu", seal_kernel=True) if cls is TritonKernels else cls("cpu")


def _filled_cache(backend, fmt, bs: int, D: int, contexts: list[int], seed: int) -> tuple[PagedKVCache, torch.Tensor]:
    """A cache whose sequences hold ``contexts`` tokens of random rows (outlier channels included), written as a step's
    output and sealed through ``backend``; unused pool blocks hold NaN. Returns the cache and the block tables."""
    g = torch.Generator().manual_seed(seed)
    per_seq = max(c // bs for c in contexts) + 1
    B = len(contexts)
    cache = PagedKVCache(PagedKVLayout(fmt, H, D, bs, B * per_seq + 2, B), L, _params(fmt, D, seed), attention=backend)
    for t in cache.tensors.values():
        if t.is_floating_point():
            t.fill_(float("nan"))
    if fmt.needs_rope:
        cache.ropes = [_rope(D)] * L
    tables = [[1 + b * per_seq + j for j in range(per_seq)] for b in range(B)]  # block 0 is nobody's
    T = max(contexts)
    rows = torch.randn(2, L, B, T, H, D, generator=g) * 2
    rows[..., 3] *= 6  # an outlier channel
    batch = StepBatch.make([[0] * c for c in contexts], [0] * B, tables, list(range(B)))
    cache.write_new_rows(batch, StepOutput(None, rows[0].half(), rows[1].half()))
    return cache, torch.tensor(tables)


def _reference(cache: PagedKVCache, layer: int, q, k_new, v_new, tables, ctx, cu, window=None, softcap=None) -> torch.Tensor:
    lay = cache.layout_of(layer)
    pools = [cache.pool(layer, w) for w in "kv"]
    kp, vp = (getattr(cache.params[layer], w) for w in "kv")
    rope = cache.ropes[layer] if cache.ropes else None
    return paged_attention_ref(q, cu, *pools, k_new, v_new, tables, ctx, torch.arange(len(ctx)), lay.tensor_format("k"),
                               lay.tensor_format("v"), kp, vp, 0.35, window=window or 0, softcap=softcap or 0.0, rope=rope)


def _attend(backend, cache, tables, ctx: list[int], new: list[int], seed: int, window: int | None = None,
            softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 1's attention of a step with ``new`` tokens per sequence after ``ctx`` (a layer with ``window`` /
    ``softcap``): the backend's and the reference's, both [total valid rows, Hq, D]."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(ctx), max(new)
    D = cache.layout.head_dim
    batch = StepBatch(torch.zeros(B, T, dtype=torch.long), torch.tensor(ctx), torch.tensor(new), tables, torch.arange(B))
    valid = torch.arange(T)[None, :] < batch.new_lens[:, None]
    q = torch.randn(B, H * G, T, D, generator=g)
    k16, v16 = ((torch.randn(B, H, T, D, generator=g) * 2).half() for _ in range(2))
    st = backend.begin(batch, cache, valid, crossing=False)
    got = backend.attend(st, 1, q, k16, v16, 0.35, window, softcap)[valid]  # [rows, Hq, D]
    cu = None if T == 1 else torch.nn.functional.pad(batch.new_lens.cumsum(0), (1, 0))
    qt, kt, vt = (x.transpose(1, 2)[valid] for x in (q, k16, v16))
    want = _reference(cache, 1, qt, kt.float(), vt.float(), tables, batch.context_lens, cu, window, softcap)
    return got.double(), want.double()


def _cases():
    for cls in BACKENDS:
        marks = [pytest.mark.slow] if cls is TritonKernels else []  # under the Triton interpreter
        for spec in SPECS:
            yield pytest.param(cls, spec, id=f"{cls.name}-{spec}", marks=marks)


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("cls,spec", list(_cases()))
def test_every_backend_attends_over_sealed_blocks_as_the_reference_codec(cls, spec, interpret):
    fmt, bs, D = _setup(cls, spec)
    backend = _backend(cls)
    ctx = [3 * bs + 2, bs, 2 * bs - 1]  # an open block, none, a nearly full one; first blocks sealed with their sinks
    cache, tables = _filled_cache(backend, fmt, bs, D, ctx, seed=len(spec))
    for new in ([1, 1, 1], [bs - 2, min(3, bs), 1]):  # a decode step, then a prefill chunk (each within its block)
        got, want = _attend(backend, cache, tables, ctx, new, seed=sum(new))
        assert torch.isfinite(got).all(), new
        assert (got - want).abs().max().item() < 2e-4 * want.abs().max().item(), (new, (got - want).abs().max().item())


def _layer_cases():
    for cls in BACKENDS:
        for spec in ("fp16", "int4", "int8"):
            # the Triton kernels under the interpreter take seconds a case: int4 in make test, the rest in tier 2
            marks = [pytest.mark.slow] + ([pytest.mark.tier2] if spec != "int4" else []) if cls is TritonKernels else []
            for window, softcap in ((None, 1.5), (7, None), (7, 1.5)):
                yield pytest.param(cls, spec, window, softcap, id=f"{cls.name}-{spec}-window{window}-softcap{softcap}", marks=marks)


@pytest.mark.parametrize("cls,spec,window,softcap", list(_layer_cases()))
def test_every_backend_applies_the_layers_window_and_soft_cap_as_the_reference(cls, spec, window, softcap, interpret):
    """A local layer's sliding window and a soft-capped model's ``cap * tanh(s / cap)`` in a decode step and in a
    prefill chunk, each alone and together, against the float64 reference (a window of 7 reaches into the sealed blocks
    and cuts some; a cap of 1.5 bends most of these scores)."""
    fmt, bs, D = _setup(cls, spec)
    backend = _backend(cls)
    ctx = [3 * bs + 2, bs, 2 * bs - 1]
    cache, tables = _filled_cache(backend, fmt, bs, D, ctx, seed=11)
    for new in ([1, 1, 1], [bs - 2, min(3, bs), 1]):
        got, want = _attend(backend, cache, tables, ctx, new, seed=sum(new), window=window, softcap=softcap)
        plain, _ = _attend(backend, cache, tables, ctx, new, seed=sum(new))
        assert (plain - want).abs().max().item() > 1e-2 * want.abs().max().item(), "the layer's option changes nothing here"
        assert torch.isfinite(got).all(), new
        assert (got - want).abs().max().item() < 2e-4 * want.abs().max().item(), (new, (got - want).abs().max().item())


def _seal_cases():
    for cls in BACKENDS:
        marks = [pytest.mark.slow] if cls is TritonKernels else []
        for spec in ("int8", "int4", "int3", CALIBRATION_FREE["int2"], "k=int4:bchannel:asym:nuq,v=int4:g4:sym:out8,block=8,sink=1"):
            yield pytest.param(cls, spec, id=f"{cls.name}-{spec}", marks=marks)


@pytest.mark.parametrize("cls,spec", list(_seal_cases()))
def test_every_backend_seals_the_reference_bytes(cls, spec, interpret):
    """The backend's seal of full blocks (first blocks with their sink rows) stores the bytes of the reference quantizer."""
    fmt, bs, D = _setup(cls, spec)
    ctx = [2 * bs + 1, bs]
    got, _ = _filled_cache(_backend(cls), fmt, bs, D, ctx, seed=7)
    want, _ = _filled_cache(TorchOps("cpu"), fmt, bs, D, ctx, seed=7)
    for name, t in want.tensors.items():
        assert torch.equal(t.nan_to_num(), got.tensors[name].nan_to_num()), name


# ----------------------------------------------------------------------------- choosing a backend


def test_the_registry_is_what_the_cli_offers():
    assert ("auto", *names()) == ATTENTIONS
    assert [type(b) for b in map(lambda c: _backend(c), BACKENDS)] == BACKENDS


def test_auto_takes_the_first_backend_without_a_refusal(monkeypatch):
    fmt = fit_formats(["int4"], 64)[0][0]
    assert resolve("auto", "cuda", kv_format=fmt).name == "kernels"
    mse = fit_formats(["k=int4:bchannel:asym:mse,v=int4:g32:sym,block=64"], 64)[0][0]
    chosen = resolve("auto", "cuda", kv_format=mse)
    assert chosen.name == "torch" and "kernels: " in chosen.note and "mse" in chosen.note
    assert resolve("auto", "cpu", kv_format=fmt).name == "cpu"  # the Triton kernels only under the interpreter on CPU
    monkeypatch.setattr(CpuKernels, "unavailable", classmethod(lambda cls: "trtkv's CPU attention kernels are unavailable: no cc"))
    chosen = resolve("auto", "cpu", kv_format=fmt)
    assert chosen.name == "torch" and "cpu: trtkv's CPU attention kernels are unavailable: no cc" in chosen.note


@pytest.mark.parametrize("name,device,words", [
    ("cpu", "cuda", "--attention cpu: it runs on cpu only, not on cuda"),
    ("sdpa", "cpu", "unknown attention backend 'sdpa'"),
    ("kernels", "cpu", "--attention kernels: KV format"),  # a searched seal the kernels do not take
])
def test_a_backend_that_cannot_run_says_why_in_one_line(name, device, words):
    mse = fit_formats(["k=int4:bchannel:asym:mse,v=int4:g32:sym,block=64"], 64)[0][0]
    with pytest.raises(TrtkvError, match=re.escape(words)) as e:
        resolve(name, device, kv_format=mse)
    assert "\n" not in str(e.value) and e.value.fix


def test_the_engine_hands_its_backend_to_the_cache(small_llama):
    from trtkv.runtime.torch_engine import TorchEngine
    from trtkv.runtime.verify import StaticBatch

    fmt = fit_formats(["int4"], small_llama.config.head_dim)[0][0].with_block_size(4)
    cache = PagedKVCache(PagedKVLayout(fmt, small_llama.config.num_key_value_heads, small_llama.config.head_dim, 4, 8, 1),
                         small_llama.config.num_hidden_layers)
    assert cache.sealer.name == "cpu"  # auto's choice on the cache's device, until an engine steps it
    engine = TorchEngine(small_llama, attention="torch", device="cpu")
    StaticBatch(cache, 1).prefill(engine, [[5, 6, 7, 8, 9]])
    assert cache.sealer is engine.attention_backend
