"""The runtime under faults, over the torch reference engine and a tiny random model: no server.

Preemption is exact for every preset format (the preempted sequence's cache is swapped to host
memory and back, runtime/swap.py), bad words are matched as token sequences, and the checks the
mutation run found missing.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trtkv.errors import TrtkvError
from trtkv.formats import PRESETS
from trtkv.plugins.contract.capabilities import TORCH_OPS
from trtkv.runtime.block_manager import CacheBudget
from trtkv.runtime.llm_engine import LLMEngine, RuntimeConfig
from trtkv.runtime.sequence import SamplingParams

BS = 4
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40], [50, 51, 52, 53, 54]]

# the presets the torch engine serves (the capability table's torch row: every preset)
SERVED_PRESETS = [n for n, f in PRESETS.items() if not (TORCH_OPS.lacks(f.k) or TORCH_OPS.lacks(f.v))]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(small_llama):
    return small_llama


def make_llm(model, tokenizer, fmt_name="fp16", *, num_blocks=256, num_slots=4, max_batched_tokens=64, max_seq_len=256, **config) -> LLMEngine:
    """An LLMEngine over the torch reference engine; static formats get a fixed scale, smoothing formats unit factors,
    codebook formats their dtype's uniform levels, alloc formats random widths; presets fitted to the model's head_dim."""
    from conftest import random_widths

    from trtkv.artifacts import LayerParams
    from trtkv.cache_layout import PagedKVLayout
    from trtkv.formats import fit_formats
    from trtkv.quant import TensorParams
    from trtkv.runtime.backends import TorchReferenceEngine
    from trtkv.runtime.kv_pool import PagedKVCache

    cfg = model.config
    H, D = cfg.num_key_value_heads, cfg.head_dim
    fmt = fit_formats([fmt_name], D)[0][0].with_block_size(BS)
    manifest = SimpleNamespace(
        limits=SimpleNamespace(max_batch=num_slots, max_seq_len=max_seq_len, block_size=BS, max_new_tokens_per_step=BS, max_num_blocks=10**6, max_num_slots=64),
        model=SimpleNamespace(eos_token_ids=[0], vocab_size=cfg.vocab_size),
        kv_spec=fmt.name,
        kv_format=fmt,
    )

    def params(t):
        levels = (torch.arange(t.codebook_levels) - t.codebook_levels // 2).float().expand(H, -1).clone() if t.codebook else None
        bits = random_widths(t, H, D, torch.Generator().manual_seed(0)) if t.allocated_bits is not None else None
        return TensorParams(scale=None if t.is_dynamic else torch.tensor(0.05), smooth=torch.ones(H, D), codebook=levels, bits=bits)

    layout = PagedKVLayout(fmt, H, D, BS, num_blocks, num_slots)
    cache = PagedKVCache(layout, cfg.num_hidden_layers, [LayerParams(params(fmt.k), params(fmt.v)) for _ in range(cfg.num_hidden_layers)])
    budget = CacheBudget(0, layout.bytes_per_block(), layout.tail_bytes_per_slot(), BS, num_slots, num_blocks)
    config = RuntimeConfig(max_seqs=num_slots, max_batched_tokens=max_batched_tokens, **config)
    return LLMEngine(TorchReferenceEngine(model), manifest, cache, tokenizer, config, budget)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


# ---------------------------------------------------------------- 4. preemption never changes an output


@pytest.mark.parametrize("fmt", SERVED_PRESETS)
def test_preemption_never_changes_an_output(model, tokenizer, fmt):
    """Tokens *and* log-probabilities bit-equal to the same batch in a pool large enough to never preempt.
    Recomputing a preempted sequence (the old policy) changes log-probabilities in every format here and
    int4 codes on real models; swapping its blocks out and back does not."""
    want = make_llm(model, tokenizer, fmt, num_blocks=64).generate(PROMPTS, greedy(12))
    small = make_llm(model, tokenizer, fmt, num_blocks=7)  # 4 x ceil(22/4) blocks wanted, 7 exist
    got = small.generate(PROMPTS, greedy(12))
    assert small.scheduler.num_preemptions > 0, "the pool was not small enough to preempt"
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    assert [o.new_logprobs for o in got] == [o.new_logprobs for o in want]
    assert small.block_manager.num_free_blocks == 7 and small.block_manager.num_free_slots == 4
    assert not small.scheduler.swapper.saved, "host copies left behind"


def test_aborting_a_swapped_out_sequence_drops_its_host_copy(model, tokenizer):
    llm = make_llm(model, tokenizer, "int4", num_blocks=7)
    seqs = [llm.add_request(p, greedy(12)) for p in PROMPTS]
    for _ in range(40):
        llm.step()
        swapped = [s for s in seqs if s in llm.scheduler.swapper]
        if swapped:
            break
    assert swapped, "nothing was preempted"
    assert llm.abort(swapped[0].request_id)
    assert swapped[0] not in llm.scheduler.swapper
    while llm.has_work():
        llm.step()
    assert llm.block_manager.num_free_blocks == 7 and not llm.scheduler.swapper.saved


# ---------------------------------------------------------------- 5. bad words are token sequences


def test_bad_word_with_leading_space_does_not_ban_the_bare_space(model, tokenizer):
    from trtkv.runtime.llm_engine import bad_word_bans
    from trtkv.runtime.sequence import Sequence

    llm = make_llm(model, tokenizer)
    space, *rest = tokenizer.encode(" zzq", add_special_tokens=False)  # [" ", "z", "z", "q"] in the tiny BPE
    assert tokenizer.decode([space]) == " " and len(rest) == 3
    seqs = llm.bad_word_sequences([" zzq"])
    assert seqs == [[space, *rest]]
    seq = llm.add_request([5, 6, 7], SamplingParams(max_tokens=4, bad_words=[" zzq"]))
    req = llm.requests[seq.request_id]
    assert space not in req.banned and bad_word_bans(seq, req.bad_seqs) == []
    # the word's last token is banned exactly when the tokens before it were just generated
    assert bad_word_bans(Sequence([5, space, rest[0], rest[1]], SamplingParams()), seqs) == [rest[2]]
    assert bad_word_bans(Sequence([5, space, rest[0]], SamplingParams()), seqs) == []
    assert bad_word_bans(Sequence([space, rest[0], rest[1], 5], SamplingParams()), seqs) == []


def test_single_token_bad_word_is_never_generated(model, tokenizer):
    free = make_llm(model, tokenizer).generate([PROMPTS[0]], greedy(16))[0].new_token_ids
    token = next(t for t in free if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t])  # a whole-token word
    word = tokenizer.decode([token])
    assert [token] in make_llm(model, tokenizer).bad_word_sequences([word])
    out = make_llm(model, tokenizer).generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, bad_words=[word]))[0]
    assert token not in out.new_token_ids


# ---------------------------------------------------------------- stop words and min_tokens (mutation survivors)


def _steps(model, tokenizer, n: int = 16) -> list[str]:
    texts: list[str] = []
    make_llm(model, tokenizer).generate([PROMPTS[2]], greedy(n), on_output=lambda o: texts.append(o.new_text))
    return texts


def test_early_stop_word_with_min_tokens_still_yields_min_tokens(model, tokenizer):
    texts = _steps(model, tokenizer)
    stop = next(t for t in texts if t.strip())  # appears in the first steps
    p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_words=[stop], min_tokens=6)
    out = make_llm(model, tokenizer).generate([PROMPTS[2]], p)[0]
    assert len(out.new_token_ids) >= 6
    early = make_llm(model, tokenizer).generate([PROMPTS[2]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_words=[stop]))[0]
    assert len(early.new_token_ids) < 6 and early.finish_reason == "stop"  # without min_tokens it does stop early


def test_stop_word_split_across_two_steps_stops_and_is_cut(model, tokenizer):
    texts = _steps(model, tokenizer)
    full = "".join(texts)
    for i in range(len(texts) - 1):
        if texts[i] and texts[i + 1]:
            at = len("".join(texts[: i + 1]))
            stop = full[at - 1 : at + 1]  # last character of step i, first of step i + 1
            if full.find(stop) == at - 1:
                break
    else:
        pytest.skip("no two consecutive steps with text")
    p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_words=[stop])
    out = make_llm(model, tokenizer).generate([PROMPTS[2]], p)[0]
    assert out.finish_reason == "stop" and out.text == full[: at - 1], (stop, out.text, full)
    assert len(out.new_token_ids) <= i + 2


def test_multi_token_bad_word_leaves_its_first_token_free(model, tokenizer):
    """A two-token bad word whose first token the free output uses but never completes: the output is unchanged
    (banning the word's first token, the old rule, changes it)."""
    llm = make_llm(model, tokenizer)
    free = llm.generate([PROMPTS[0]], greedy(16))[0].new_token_ids
    history = PROMPTS[0] + free

    def occurs(ids):
        return any(history[i : i + len(ids)] == ids for i in range(len(history)))

    word = None
    for first in dict.fromkeys(free):
        for last in range(tokenizer.vocab_size):
            text = tokenizer.decode([first, last])
            seqs = llm.bad_word_sequences([text])
            if [first, last] in seqs and all(len(s) > 1 and not occurs(s) for s in seqs):
                word = text
                break
        if word:
            break
    assert word, "no usable two-token word"
    out = make_llm(model, tokenizer).generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, bad_words=[word]))[0]
    assert out.new_token_ids == free, word


def test_streamed_pieces_never_show_a_stop_word_that_completes_later(model, tokenizer):
    """Streaming: the pieces a client receives concatenate to the final text, even when a stop word starts in an
    earlier step than the one that completes it (that step's text is held back, not sent and taken back)."""
    sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    steps: list[str] = []
    full = make_llm(model, tokenizer).generate([PROMPTS[2]], sampled, on_output=lambda o: steps.append(o.new_text))[0].text
    starts = [len("".join(steps[:i])) for i in range(len(steps))]
    # a stop word that begins inside one step's text and ends in a later one, and occurs once
    stop = next(full[a + len(steps[i]) - 1 : a + len(steps[i]) + 1] for i, a in enumerate(starts)
                if steps[i] and a + len(steps[i]) < len(full) and full.count(full[a + len(steps[i]) - 1 : a + len(steps[i]) + 1]) == 1)
    pieces: list[str] = []
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True, stop_words=[stop])
    out = make_llm(model, tokenizer).generate([PROMPTS[2]], p, on_output=lambda o: pieces.append(o.new_text))[0]
    assert out.finish_reason == "stop" and out.text == full[: full.index(stop)]
    assert "".join(pieces) == out.text  # nothing streamed had to be taken back


def test_an_end_id_outside_the_vocabulary_is_refused_and_the_last_id_accepted(model, tokenizer):
    """end_id names a token the sampler can produce: outside [0, vocab) it could never end the request, so it is a
    request error (the server's 400), counted rejected; the last id and 0 are accepted."""
    llm = make_llm(model, tokenizer)
    vocab = model.config.vocab_size
    for bad in (vocab, vocab + 7, -1):
        with pytest.raises(TrtkvError, match=rf"end_id {bad} is not a token id of this model \(0 \.\.\. {vocab - 1}\)"):
            llm.make_sequence([1, 2], SamplingParams(max_tokens=2, end_id=bad))
    assert llm.stats_counters["rejected"] == 3
    for good in (0, vocab - 1):
        assert llm.make_sequence([1, 2], SamplingParams(max_tokens=2, end_id=good)).params.end_id == good
