"""How the runtime is put together (llm_engine.py's plan_budget / resolve_kv_budget / window_ring / prefix_salt /
describe_cache / layer_type_bytes, kv_pool.py's pool groups and engine limits, engine.py's feeds, backends.open_engine,
verify.py's static driver), each against hand-computed expectations: the budget split of a fixed-shape engine clamped
to its profile, the slots the engine's batch limit allows, GiB -> bytes, the GPU's memory less the reserve, one pool group per distinct
layer storage, uint8 pools fed as int8 only where the graph declares int8, the backend ``auto`` picks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trtkv.artifacts import LayerParams
from trtkv.cache_layout import PagedKVLayout
from trtkv.errors import TrtkvError
from trtkv.formats import get_format
from trtkv.runtime import backends, llm_engine
from trtkv.runtime.block_manager import GIB, CacheBudget
from trtkv.runtime.config import RuntimeConfig
from trtkv.runtime.engine import Engine
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.step import StepOutput
from trtkv.runtime.verify import StaticBatch, greedy_decode


def manifest(fmt="int8", *, max_batch=4, max_num_slots=6, max_num_blocks=50, block_size=16, bytes_per_block=1000, per_slot=300,
             max_blocks_per_seq=8, sliding_window=None, layer_types=()):
    f = get_format(fmt).with_block_size(block_size)
    model = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=8, sliding_window=sliding_window, layer_types=layer_types,
                            eos_token_ids=[0], vocab_size=50)
    model.is_sliding = lambda i: bool(layer_types) and layer_types[i] == "sliding_attention"
    m = SimpleNamespace(
        limits=SimpleNamespace(max_batch=max_batch, max_num_slots=max_num_slots, max_num_blocks=max_num_blocks, block_size=block_size,
                               max_blocks_per_seq=max_blocks_per_seq, max_seq_len=128, max_new_tokens_per_step=block_size),
        bytes_per_block=bytes_per_block, tail_bytes_per_slot=per_slot, model=model, kv_format=f, kv_spec=f.name)
    m.layout = lambda nb, ns: PagedKVLayout(f, 1, 8, block_size, nb, ns)
    return m


@pytest.mark.parametrize("backend, max_seqs, slots, blocks", [
    ("onnxruntime", 3, 3, (GIB // 4 - 3 * 300) // 1000),  # shape-free: the configured slots, every block the budget holds
    ("torch", 3, 3, (GIB // 4 - 3 * 300) // 1000),
    ("torch", None, 4, (GIB // 4 - 4 * 300) // 1000),  # unset: the engine's max_batch
    ("onnxruntime", 10, 4, (GIB // 4 - 4 * 300) // 1000),  # the engine's max_batch caps --max-seqs on every backend
    ("tensorrt", 10, 4, 50),  # a plan: also blocks up to its profile
    ("tensorrt", 2, 2, 50),
])
def test_plan_budget(backend, max_seqs, slots, blocks):
    cfg = RuntimeConfig(kv_memory_gib=0.25, max_seqs=max_seqs, free_window_blocks=False)
    b = llm_engine.plan_budget(manifest(), cfg, torch.device("cpu"), backend)
    assert (b.budget_bytes, b.bytes_per_block, b.bytes_per_slot, b.block_size, b.num_slots, b.num_blocks) == (GIB // 4, 1000, 300, 16, slots, blocks)


def test_plan_budget_keeps_a_small_budget_below_the_profile():
    cfg = RuntimeConfig(kv_memory_gib=30_000 / GIB, max_seqs=2)
    b = llm_engine.plan_budget(manifest(max_num_blocks=50), cfg, torch.device("cpu"), "tensorrt")
    assert b.num_blocks == (30_000 - 2 * 300) // 1000 == 29


def test_plan_budget_with_a_window_ring_pays_ring_blocks_per_slot():
    m = manifest("fp16", block_size=4, sliding_window=6, layer_types=("sliding_attention", "full_attention"))
    ring = llm_engine.window_ring(m, RuntimeConfig(), "torch")
    assert ring is not None and ring.layers == (0,) and ring.window == 6
    lay = m.layout(1, 1)
    b = llm_engine.plan_budget(m, RuntimeConfig(kv_memory_gib=0.001, max_seqs=2), torch.device("cpu"), "torch")
    assert b.bytes_per_block == lay.block_bytes([1]) and b.bytes_per_slot == 300 + ring.ring_blocks * lay.block_bytes([0])
    assert llm_engine.window_ring(m, RuntimeConfig(free_window_blocks=False), "torch") is None
    assert llm_engine.window_ring(m, RuntimeConfig(), "onnxruntime") is None
    assert llm_engine.window_ring(manifest(), RuntimeConfig(), "torch") is None  # no sliding layer


def test_resolve_kv_budget(monkeypatch):
    assert llm_engine.resolve_kv_budget(RuntimeConfig(kv_memory_gib=0.5), torch.device("cpu")) == GIB // 2
    assert llm_engine.resolve_kv_budget(RuntimeConfig(), torch.device("cpu")) == int(RuntimeConfig.CPU_KV_MEMORY_GIB * GIB)
    assert llm_engine.resolve_kv_budget(RuntimeConfig(kv_memory_gib=2.0), torch.device("cuda", 1)) == 2 * GIB
    import trtkv.gpu

    seen = []
    monkeypatch.setattr(trtkv.gpu, "device_memory", lambda index: seen.append(index) or (20 * GIB, 80 * GIB))
    # on a GPU without --kv-memory: what the reserve (a fraction of the total) leaves of the free memory
    assert llm_engine.resolve_kv_budget(RuntimeConfig(reserve=0.125), torch.device("cuda", 1)) == 10 * GIB and seen == [1]
    assert llm_engine.resolve_kv_budget(RuntimeConfig(), "cuda") == 12 * GIB and seen == [1, 0]
    with pytest.raises(TrtkvError, match="--reserve 0.25 leave no GPU memory") as info:
        llm_engine.resolve_kv_budget(RuntimeConfig(reserve=0.25), "cuda")
    assert "--kv-memory" in info.value.fix


@pytest.mark.parametrize("weights_gib, total_gib, reserve", [(15, 80, 0.1), (16, 141, 0.05), (1, 24, 0.0), (70, 80, 0.1)])
def test_plan_and_serve_size_the_kv_cache_by_one_rule(monkeypatch, weights_gib, total_gib, reserve):
    """`trtkv plan`'s KV budget for a GPU is what `serve` allocates on it once the weights are loaded, for the same
    --reserve; and both default to the same reserve."""
    import trtkv.gpu
    from trtkv.plan import ModelShape, plan

    total, weights = total_gib * GIB, weights_gib * GIB
    monkeypatch.setattr(trtkv.gpu, "device_memory", lambda index: (total - weights, total))
    served = lambda: llm_engine.resolve_kv_budget(RuntimeConfig(reserve=reserve), "cuda")
    shape = ModelShape("m", 32, 8, 128, weights)
    if total * (1 - reserve) <= weights:  # nothing left: both refuse
        with pytest.raises(TrtkvError):
            plan(shape, [get_format("fp16")], context_len=4096, gpu_bytes=total, reserve_fraction=reserve)
        with pytest.raises(TrtkvError):
            served()
        return
    budget, _ = plan(shape, [get_format("fp16")], context_len=4096, gpu_bytes=total, reserve_fraction=reserve)
    assert budget == served() == pytest.approx(total * (1 - reserve) - weights, abs=1)


def test_plan_and_serve_default_to_one_reserve():
    import inspect

    from trtkv.cli import plan as plan_cmd
    from trtkv.gpu import DEFAULT_RESERVE
    from trtkv.plan import plan

    assert RuntimeConfig().reserve == DEFAULT_RESERVE
    assert inspect.signature(plan_cmd).parameters["reserve"].default == DEFAULT_RESERVE
    assert inspect.signature(plan).parameters["reserve_fraction"].default == DEFAULT_RESERVE


@pytest.mark.parametrize("max_seqs, max_batch, slots, warned", [(None, 16, 16, False), (4, 16, 4, False), (16, 16, 16, False),
                                                                  (64, 16, 16, True), (2, 1, 1, True)])
def test_the_engines_batch_limit_caps_max_seqs_with_a_warning(max_seqs, max_batch, slots, warned):
    got, warning = RuntimeConfig(max_seqs=max_seqs).slots(max_batch)
    assert got == slots and (warning is not None) == warned
    if warned:
        assert f"--max-seqs {max_seqs}" in warning and f"--max-batch {max_batch}" in warning and "\n" not in warning


def test_prefix_salt_names_the_engine_format_block_and_manifest():
    m = manifest()
    m.model_dump_json = lambda: '{"model": "m"}'
    salt = llm_engine.prefix_salt(m, "onnxruntime")
    assert salt == f"onnxruntime|{m.kv_format.model_dump_json()}|16|" + '{"model": "m"}'
    other = manifest(block_size=8)
    other.model_dump_json = m.model_dump_json
    assert llm_engine.prefix_salt(other, "onnxruntime") != salt
    assert llm_engine.prefix_salt(m, "torch") != salt
    del m.model_dump_json
    assert llm_engine.prefix_salt(m, "torch").endswith(repr(m.model))


def small_llm(tokenizer, fmt="fp16", layer_types=("full_attention", "sliding_attention"), ring=None, **cfg):
    f = get_format(f"k={fmt},v={fmt},block=4" if ":" in fmt or fmt == "fp16" else fmt)
    m = manifest(block_size=4, layer_types=layer_types)
    m.kv_format, m.kv_spec = f, f.name
    layout = PagedKVLayout(f, 1, 8, 4, 10, 3)
    cache = PagedKVCache(layout, 2, ring=ring)
    budget = CacheBudget(GIB, layout.bytes_per_block(), layout.tail_bytes_per_slot(), 4, 3, 10)

    class E(Engine):
        name = "torch"

        def step(self, batch, cache):
            B, T = batch.input_ids.shape
            logits = torch.zeros(B, 50)
            logits[:, 7] = 5.0
            return StepOutput(logits, torch.zeros(2, B, T, 1, 8, dtype=torch.float16), torch.zeros(2, B, T, 1, 8, dtype=torch.float16))

    return llm_engine.LLMEngine(E(), m, cache, tokenizer, RuntimeConfig(max_seqs=3, **cfg), budget)


def test_layer_type_bytes_and_describe_cache(tokenizer):
    llm = small_llm(tokenizer)
    lay = llm.cache.layout
    assert llm.layer_type_bytes() == {"kv_bytes_used_full_attention": 0, "kv_bytes_used_sliding_attention": 0}
    llm.add_request(list(range(1, 10)), __import__("trtkv.runtime.sequence", fromlist=["x"]).SamplingParams(max_tokens=3, temperature=0))
    for _ in range(3):
        llm.step()  # 9 tokens in chunks of 4, 4, 1: 2 sealed blocks and one slot
    per_layer = 2 * lay.bytes_per_block() + lay.tail_bytes_per_slot()
    assert llm.layer_type_bytes() == {"kv_bytes_used_full_attention": per_layer, "kv_bytes_used_sliding_attention": per_layer}
    st = llm.stats()
    assert st["kv_bytes_used_full_attention"] == per_layer and st["blocks_used"] == 2 and st["slots_used"] == 1
    assert llm.describe_cache() == llm.budget.describe()
    llm2 = small_llm(tokenizer, layer_types=())
    assert set(llm2.layer_type_bytes()) == {"kv_bytes_used_full_attention", "kv_bytes_used_sliding_attention"}


def test_a_ringed_sliding_layer_counts_only_the_blocks_its_window_still_reads(tokenizer):
    """Window 6, blocks of 4, 13 tokens cached (3 sealed blocks): the next query at 13 reads keys above 13 - 6 = 7, so
    of the sealed blocks only block 2 (tokens 8-11); the global layer holds all 3 in the pool."""
    from trtkv.cache_layout import WindowRing
    from trtkv.runtime.sequence import SamplingParams

    llm = small_llm(tokenizer, layer_types=("sliding_attention", "full_attention"), ring=WindowRing((0,), 6, 4))
    assert not llm.prefix_caching and llm.block_manager.prefix is None
    llm.add_request(list(range(1, 14)), SamplingParams(max_tokens=3, temperature=0))
    for _ in range(4):
        llm.step()
    lay = llm.cache.layout
    assert llm.scheduler.running[0].num_cached == 13 and llm.block_manager.num_used_blocks == 3
    assert llm.layer_type_bytes() == {"kv_bytes_used_sliding_attention": 1 * lay.bytes_per_block() + lay.tail_bytes_per_slot(),
                                      "kv_bytes_used_full_attention": 3 * lay.bytes_per_block() + lay.tail_bytes_per_slot()}
    assert "sliding layers (1 of 2, window 6) keep a ring of" in llm.describe_cache() and "prefix caching off" in llm.describe_cache()


# ---------------------------------------------------------------- the cache's pool groups and the engines' feeds


def test_a_per_layer_format_keeps_one_pool_group_per_distinct_storage():
    f = get_format("k=int8:token,v=int8:token,block=4,layers=int8:token/int8:token|int4:token:sym/int8:token|int8:token/int8:token")
    cache = PagedKVCache(PagedKVLayout(f, 1, 8, 4, 5, 2), 3)
    assert cache.is_grouped and cache.layout_of(1).fmt.k.dtype == "int4" and cache.layout_of(2).fmt.k.dtype == "int8"
    assert cache.tensors["k_data@g0"].shape[0] == 2 and cache.tensors["k_data@g1"].shape[0] == 1 and "k_data" not in cache.tensors
    assert cache.tensors["k_data@g1"].dtype == torch.uint8 and cache.tensors["k_data@g0"].dtype == torch.int8
    cache.pool(2, "k").data.fill_(3)
    assert cache.tensors["k_data@g0"][1].unique().tolist() == [3] and cache.tensors["k_data@g0"][0].unique().tolist() == [0]
    assert cache.pool(1, "v").tail.data_ptr() == cache.tensors["v_tail"][1].data_ptr()
    with pytest.raises(TrtkvError, match="storage for 3 layers but the model has 2"):
        PagedKVCache(PagedKVLayout(f, 1, 8, 4, 5, 2), 2)


def test_a_plain_cache_stacks_every_layer_and_seal_target_is_the_block():
    cache = PagedKVCache(PagedKVLayout(get_format("int8").with_block_size(4), 1, 8, 4, 5, 2), 3, [LayerParams() for _ in range(3)])
    assert not cache.is_grouped and cache.tensors["k_data"].shape[:2] == (3, 5) and cache.seal_target(1, 0, 4, 7) == 4
    assert not cache.is_ringed(0)
    with pytest.raises(TrtkvError, match="2 layer params for 3 layers"):
        PagedKVCache(cache.layout, 3, [LayerParams(), LayerParams()])


def test_for_engine_refuses_a_pool_beyond_a_plans_profile(tmp_path):
    m = manifest(max_num_blocks=5, max_num_slots=2)
    m.backend = "tensorrt"
    with pytest.raises(TrtkvError, match="6 blocks / 2 slots exceed the engine's limits \\(5 / 2\\)"):
        PagedKVCache.for_engine(m, tmp_path, 6, 2)
    with pytest.raises(TrtkvError, match="exceed"):
        PagedKVCache.for_engine(m, tmp_path, 5, 3, backend="tensorrt")
    with pytest.raises(TrtkvError, match="kv_params.safetensors is missing|is missing"):  # shape-free: no limit, then the constants
        PagedKVCache.for_engine(m, tmp_path, 6, 3, backend="onnxruntime")


class Feeder(Engine):
    name = "feeder"

    def step(self, batch, cache):
        raise NotImplementedError


def test_feeds_view_uint8_pools_as_int8_unless_declared_uint8():
    cache = PagedKVCache(PagedKVLayout(get_format("k=int4:token:sym,v=int8:token:asym,block=8"), 1, 8, 8, 3, 2), 1)
    from trtkv.runtime.step import StepBatch

    batch = StepBatch.make([[1]], [0], [[]], [0])
    e = Feeder()
    feeds = e.feeds(batch, cache)
    assert feeds["k_data"].dtype == torch.int8 and feeds["k_data"].data_ptr() == cache.tensors["k_data"].data_ptr()
    assert feeds["k_tail"].dtype == torch.float16 and feeds["input_ids"] is batch.input_ids and feeds["slot_ids"] is batch.slot_ids
    assert set(feeds) == {"input_ids", "context_lens", "new_lens", "block_tables", "slot_ids", *cache.tensors}
    e.manifest = SimpleNamespace(inputs=[SimpleNamespace(name="k_data", dtype="uint8")])
    assert e.feeds(batch, cache)["k_data"].dtype == torch.uint8 and e.feeds(batch, cache)["v_data"].dtype == torch.int8
    grouped = PagedKVCache(PagedKVLayout(get_format("k=int8:token,v=int8:token,block=8,layers=int8:token/int8:token|int4:token:sym/int8:token"),
                                         1, 8, 8, 3, 2), 2)
    with pytest.raises(TrtkvError, match="use the torch engine"):
        e.feeds(batch, grouped)


@pytest.mark.parametrize("manifest_backend, plans, cuda, want", [
    ("torch", [], False, "torch"), ("torch", ["p"], True, "torch"), ("onnxruntime", [], True, "onnxruntime"),
    ("onnxruntime", ["p"], False, "onnxruntime"), ("tensorrt", ["p"], True, "tensorrt"), ("tensorrt-rtx", ["p"], True, "tensorrt"),
])
def test_open_engine_auto_picks_the_backend(monkeypatch, manifest_backend, plans, cuda, want):
    import trtkv.runtime.torch_engine as te

    got = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(te.TorchEngine, "from_engine_dir", classmethod(lambda cls, d, manifest=None, **kw: got.append(("torch", kw)) or "T"))
    monkeypatch.setattr(backends, "OnnxRuntimeEngine", lambda d, manifest=None, **kw: got.append(("onnxruntime", kw)) or "O")
    monkeypatch.setattr(backends, "TensorRTEngine", lambda d, manifest=None, **kw: got.append(("tensorrt", kw)) or "R")
    m = SimpleNamespace(backend=manifest_backend, plans=plans)
    backends.open_engine("dir", "auto", manifest=m, threads=2)
    assert got == [(want, {"threads": 2})]
    got.clear()
    backends.open_engine("dir", "onnxruntime", manifest=m)
    backends.open_engine("dir", "torch", manifest=m)
    backends.open_engine("dir", "tensorrt-rtx", manifest=m)
    assert [g[0] for g in got] == ["onnxruntime", "torch", "tensorrt"]
    with pytest.raises(TrtkvError, match="unknown engine backend 'vllm'") as info:
        backends.open_engine("dir", "vllm", manifest=m)
    assert "onnxruntime" in info.value.fix and "torch" in info.value.fix


# ---------------------------------------------------------------- the static driver


class Echo:
    """Next token = (last token + 1) % 50, the rows name their token (k[..., 0]); checks what the cache holds per step."""

    def __init__(self, cache):
        self.cache = cache
        self.calls = []

    def step(self, batch, cache):
        batch.validate(cache.block_size)
        B, T = batch.input_ids.shape
        self.calls.append((batch.context_lens.tolist(), batch.new_lens.tolist(), batch.slot_ids.tolist()))
        logits = torch.zeros(B, 50)
        k = torch.zeros(1, B, T, 1, 8, dtype=torch.float16)
        for b in range(B):
            n = int(batch.new_lens[b])
            logits[b, (int(batch.input_ids[b, n - 1]) + 1) % 50] = 1.0
            k[0, b, :n, 0, 0] = batch.input_ids[b, :n].half()
        return StepOutput(logits, k, k.clone())


def test_greedy_decode_prefills_in_block_chunks_then_decodes():
    cache = PagedKVCache(PagedKVLayout(get_format("k=fp16,v=fp16,block=4"), 1, 8, 4, 12, 2), 1)
    e = Echo(cache)
    out = greedy_decode(e, cache, [[1, 2, 3, 4, 5, 6], [10, 11, 12]], 5)
    assert out.tolist() == [[7, 8, 9, 10, 11], [13, 14, 15, 16, 17]]
    assert e.calls[:2] == [([0, 0], [4, 3], [0, 1]), ([4], [2], [0])]  # prefill: block-aligned chunks, sequence i in slot i
    assert e.calls[2:] == [([6, 3], [1, 1], [0, 1]), ([7, 4], [1, 1], [0, 1]), ([8, 5], [1, 1], [0, 1]), ([9, 6], [1, 1], [0, 1])]
    # sequence 0's first block was sealed into the first free pool block with its tokens
    assert cache.tensors["k_data"][0, 0, 0, :, 0].tolist() == [1, 2, 3, 4]
    sb = StaticBatch(cache, 1)
    assert sb.free == list(range(12)) and sb.tables == [[]] and sb.lens == [0]
