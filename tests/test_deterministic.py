"""Exactness of the torch engine on CPU (the C kernels; steps across blocks in the default mode) on a tiny model.

* Both modes: a prefix-cache hit gives bit-equal greedy outputs and log-probabilities to recomputing the prefix, for
  prompt tails of every length (prefill attention per query block in position order, prefill calls padded to 16 rows,
  a prompt's one-token rest computed as a prefill call).
* The deterministic (batch-invariant) mode (``RuntimeConfig.deterministic``, ``serve --deterministic``): the same alone
  and batched with others, and under preemption; each sequence's chunks are engine calls of their own, every prefill
  chunk a whole block from a block boundary or a prompt's rest.

bench/deterministic.py measures the same on SmolLM2 and what the deterministic mode costs."""

from __future__ import annotations

import pytest
import torch

from trtkv.runtime.llm_engine import LLMEngine, RuntimeConfig
from trtkv.runtime.sequence import SamplingParams

BLOCK = 16
PREFIX = 96  # tokens the prompts share: more than a step of 64 tokens, so the default mode steps across blocks
pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from conftest import build_tiny_model

    from trtkv.builder.build import build_engine
    from trtkv.models import load_model

    root = tmp_path_factory.mktemp("deterministic")
    build_tiny_model(root / "model", "llama", with_tokenizer=True, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    loaded = load_model(str(root / "model"), device="cpu", dtype="float32")
    return build_engine(str(root / "model"), kv="int4", out=root / "engine", backend="torch", block_size=BLOCK, max_batch=8, max_seq_len=256, loaded=loaded)


TAILS = (1, 2, 3, 5, 9, 30)  # tokens after the shared prefix: a hit leaves 2 ... 34 tokens to compute


def prompts(llm: LLMEngine, n: int = 6) -> list[list[int]]:
    """``n`` prompts sharing a ``PREFIX``-token prefix (6 whole blocks), then ``TAILS`` tokens of their own."""
    g = torch.Generator().manual_seed(3)
    vocab = llm.manifest.model.vocab_size
    prefix = torch.randint(3, vocab, (PREFIX,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (TAILS[i % len(TAILS)],), generator=g).tolist() for i in range(n)]


def run(engine, together: bool, n: int = 6, max_tokens: int = 12, **config) -> list[tuple[list[int], list[float]]]:
    llm = LLMEngine.from_engine_dir(engine, RuntimeConfig(kv_memory_gib=0.01, max_seqs=8, max_batched_tokens=64, **config))
    ps = prompts(llm, n)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    lps: dict[str, list[float]] = {}
    calls: list[list[tuple[int, int]]] = []
    step = llm.engine.step

    def spy(batch, cache):  # each engine call's (start, length) rows
        calls.append(list(zip(batch.context_lens.tolist(), batch.new_lens.tolist())))
        return step(batch, cache)

    llm.engine.step = spy
    keep = lambda o: lps.setdefault(o.request_id, []).extend(o.new_logprobs)
    outs = llm.generate(ps, params, on_output=keep) if together else [llm.generate([p], params, on_output=keep)[0] for p in ps]
    run.calls = calls
    return [(o.new_token_ids, lps[o.request_id]) for o in outs]


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_prefix_hit_is_bit_equal_to_recomputing_the_prefix(engine, deterministic):
    """One request at a time, cache on vs off: the default mode prefills the prefix in steps across blocks (64 tokens
    here) and a hit computes the rest from a block boundary -- still the same bits, whatever the tail's length."""
    off = run(engine, False, enable_prefix_caching=False, deterministic=deterministic)
    on = run(engine, False, enable_prefix_caching=True, deterministic=deterministic)
    assert on == off


def test_deterministic_outputs_are_bit_equal_with_and_without_the_cache_alone_and_batched(engine):
    alone_off = run(engine, False, enable_prefix_caching=False, deterministic=True)
    calls = run.calls
    assert all(len(c) == 1 for c in calls), "one chunk per engine call"
    assert all(start % BLOCK == 0 or length == 1 for c in calls for start, length in c), "prefill chunks start at block boundaries"
    assert all(length <= BLOCK for c in calls for _, length in c)
    alone_on = run(engine, False, enable_prefix_caching=True, deterministic=True)
    together = run(engine, True, enable_prefix_caching=False, deterministic=True)
    together_on = run(engine, True, enable_prefix_caching=True, deterministic=True)
    assert alone_on == alone_off  # token ids and log-probabilities, bit for bit
    assert together == alone_off
    assert together_on == alone_off


def test_deterministic_outputs_survive_preemption_in_a_squeezed_pool(engine):
    """Six requests of 7-11 blocks each in a pool of 20: two run, grow, and one is preempted (swapped) and resumed; the
    outputs are bit-equal to each request alone."""
    from trtkv.manifest import load_manifest

    m = load_manifest(engine)
    gib = (8 * m.tail_bytes_per_slot + 20.5 * m.bytes_per_block) / 1024**3
    alone = run(engine, False, enable_prefix_caching=False, deterministic=True, max_tokens=60)
    llm = LLMEngine.from_engine_dir(engine, RuntimeConfig(kv_memory_gib=gib, max_seqs=8, max_batched_tokens=64, enable_prefix_caching=False, deterministic=True))
    ps = prompts(llm)
    lps: dict[str, list[float]] = {}
    outs = llm.generate(ps, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), on_output=lambda o: lps.setdefault(o.request_id, []).extend(o.new_logprobs))
    assert llm.scheduler.num_preemptions >= 1, "the pool was not small enough to preempt"
    assert [(o.new_token_ids, lps[o.request_id]) for o in outs] == alone


def test_the_default_mode_batches_and_takes_steps_across_blocks(engine):
    """What the deterministic mode gives up: the default mode runs several sequences per engine call and prefill
    chunks over several blocks (its outputs match the deterministic mode's texts here; bits may differ)."""
    run(engine, True, enable_prefix_caching=False, deterministic=False)
    assert any(len(c) > 1 for c in run.calls)
    run(engine, False, n=1, enable_prefix_caching=False, deterministic=False)
    assert any(length > BLOCK for c in run.calls for _, length in c)
