"""LLMEngine end to end over the torch reference engine and a tiny random model (no builder, no server)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trtkv.errors import TrtkvError
from trtkv.formats import get_format
from trtkv.runtime.block_manager import CacheBudget
from trtkv.runtime.llm_engine import LLMEngine, RuntimeConfig
from trtkv.runtime.sequence import SamplingParams

BS = 4


def make_llm(model, fmt_name="fp16", *, num_blocks=256, num_slots=8, max_batch=8, max_batched_tokens=64):
    from conftest import build_tiny_tokenizer

    from trtkv.runtime.backends import TorchReferenceEngine
    from trtkv.runtime.kv_pool import PagedKVCache

    fmt = get_format(fmt_name).with_block_size(BS)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    manifest = SimpleNamespace(
        limits=SimpleNamespace(max_batch=max_batch, max_seq_len=256, block_size=BS, max_new_tokens_per_step=BS, max_num_blocks=10**6, max_num_slots=64),
        model=SimpleNamespace(eos_token_ids=[0], vocab_size=cfg.vocab_size),
        kv_spec=fmt.spec() if hasattr(fmt, "spec") else fmt.name,
        kv_format=fmt,
    )
    from trtkv.cache_layout import PagedKVLayout

    layout = PagedKVLayout(fmt, cfg.num_key_value_heads, head_dim, BS, num_blocks, num_slots)
    cache = PagedKVCache(layout, cfg.num_hidden_layers)
    budget = CacheBudget(0, layout.bytes_per_block(), layout.tail_bytes_per_slot(), BS, num_slots, num_blocks)
    tok = build_tiny_tokenizer()
    config = RuntimeConfig(max_seqs=num_slots, max_batched_tokens=max_batched_tokens)
    return LLMEngine(TorchReferenceEngine(model), manifest, cache, tok, config, budget)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40], [50, 51, 52, 53, 54]]


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama")[1]


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("fmt", ["fp16", "k=int8:token,v=int8:token"])
def test_batched_and_preempted_greedy_equals_one_at_a_time(model, fmt):
    alone = [make_llm(model, fmt).generate([p], greedy(9))[0].new_token_ids for p in PROMPTS]
    assert all(len(a) == 9 for a in alone)
    llm = make_llm(model, fmt, num_blocks=7, num_slots=4)  # 4 x ceil(19/4) blocks wanted, 7 exist: preemption
    outs = llm.generate(PROMPTS, greedy(9))
    assert [o.new_token_ids for o in outs] == alone
    assert llm.scheduler.num_preemptions > 0
    assert llm.block_manager.num_free_blocks == 7 and llm.block_manager.num_free_slots == 4


def test_fp16_runtime_matches_the_model_greedy(model):
    """The runtime over an fp16 paged cache generates what the plain transformers model generates."""
    prompt = torch.tensor([PROMPTS[2]])
    ref = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[0, prompt.shape[1] :].tolist()
    out = make_llm(model).generate([PROMPTS[2]], greedy(8))[0]
    assert out.new_token_ids == ref


def test_seeded_sampling_reproducible_across_batches(model):
    p = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    a = make_llm(model).generate([PROMPTS[0]], p)[0].new_token_ids
    mixed = make_llm(model).generate([PROMPTS[1], PROMPTS[0], PROMPTS[3]], [SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True), p, greedy(3)])
    assert mixed[1].new_token_ids == a


def test_end_id_min_tokens_and_stop_words(model):
    llm = make_llm(model)
    first = llm.generate([PROMPTS[0]], greedy(5))[0].new_token_ids
    # the first greedy token as end id: stops at once with nothing emitted ...
    out = make_llm(model).generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0, end_id=first[0]))[0]
    assert out.finish_reason == "stop" and out.new_token_ids == []
    # ... unless min_tokens forbids it
    out = make_llm(model).generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0, end_id=first[0], min_tokens=2))[0]
    assert len(out.new_token_ids) >= 2 and out.new_token_ids[0] != first[0]
    # a stop word taken from the greedy text ends generation and is cut from the text
    full = make_llm(model).generate([PROMPTS[0]], greedy(8))[0]
    if len(full.text.strip()) >= 2:
        word = full.text.strip()[:2]
        out = make_llm(model).generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, stop_words=[word], ignore_eos=True))[0]
        assert out.finish_reason == "stop" and word not in out.text
    out = make_llm(model).generate([PROMPTS[0]], greedy(3))[0]
    assert out.finish_reason == "length" and len(out.new_token_ids) == 3


def test_request_larger_than_pool_is_rejected_others_still_run(model):
    llm = make_llm(model, num_blocks=4)
    with pytest.raises(TrtkvError, match="whole pool has 4"):
        llm.add_request(PROMPTS[2], greedy(40))
    assert llm.generate([PROMPTS[1]], greedy(3))[0].finish_reason == "length"


def test_abort_frees_blocks(model):
    llm = make_llm(model, num_blocks=16)
    llm.add_request(PROMPTS[2], greedy(20), request_id="a")
    for _ in range(4):
        llm.step()
    assert llm.block_manager.num_used_blocks > 0
    assert llm.abort("a")
    assert llm.block_manager.num_used_blocks == 0 and not llm.has_work()
