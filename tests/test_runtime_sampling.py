"""Sampling (trtkv/runtime/sampler.py) and the request parameters (sequence.py) against a naive float64 reference on
fresh random logits: the sampler's documented rule is temperature scaling, then top-k (the k most likely, ties to the
earlier index), then top-p (the smallest most-likely-first set whose mass reaches p, of what top-k kept), then the
exponential race ``argmax p_i / E_i`` with ``E ~ Exp(1)`` drawn from the request's own generator (so the reference
draws the same E from a generator seeded alike and must pick the same token); greedy rows take the argmax; banned ids
are never taken; the log-probability is that of the unfiltered softmax at the temperature, bans applied.
"""

from __future__ import annotations

import math

import pytest
import torch

from trtkv.errors import TrtkvError
from trtkv.runtime.sampler import Sampler, filter_top_k_top_p, make_generator
from trtkv.runtime.sequence import SamplingParams, Sequence, SequenceStatus


def ref_filter(probs: list[float], top_k: int, top_p: float) -> list[float]:
    """The documented filter, one token at a time in float64."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))  # most likely first, ties: the earlier index
    kept = order[:top_k] if top_k > 0 else order
    if top_p < 1.0:
        total = sum(probs[i] for i in kept)
        out, mass = [], 0.0
        for i in kept:
            if mass >= top_p * total:  # the mass of more likely tokens reached p already
                break
            out.append(i)
            mass += probs[i]
        kept = out
    z = sum(probs[i] for i in kept)
    return [probs[i] / z if i in kept else 0.0 for i in range(len(probs))]


def ref_softmax(x: list[float]) -> list[float]:
    m = max(x)
    e = [math.exp(v - m) if v != -math.inf else 0.0 for v in x]
    s = sum(e)
    return [v / s for v in e]


def ref_sample(logits: torch.Tensor, p: SamplingParams, seed: int, banned: list[int]) -> tuple[int, float]:
    x = [float(v) for v in logits.double()]
    for b in banned:
        x[b] = -math.inf
    if p.temperature == 0 or p.top_k == 1:
        tok = max(range(len(x)), key=lambda i: (x[i], -i))  # the first maximum
        return tok, math.log(ref_softmax(x)[tok])
    scaled = [v / p.temperature for v in x]
    probs = ref_softmax(scaled)
    filt = ref_filter(probs, p.top_k, p.top_p) if (p.top_k > 0 or p.top_p < 1.0) else probs
    race = torch.empty(len(x), dtype=torch.float32).exponential_(generator=torch.Generator().manual_seed(seed)).double().tolist()
    tok = max(range(len(x)), key=lambda i: filt[i] / race[i])
    return tok, math.log(probs[tok])


CASES = [  # (temperature, top_k, top_p)
    (0.0, 0, 1.0), (0.0, 5, 0.5), (1.0, 1, 1.0), (0.7, 1, 0.3),
    (1.0, 0, 1.0), (0.5, 0, 1.0), (1.7, 0, 1.0),
    (1.0, 3, 1.0), (0.8, 2, 1.0), (1.3, 17, 1.0), (1.0, 1000, 1.0),
    (1.0, 0, 0.5), (0.6, 0, 0.9), (1.2, 0, 0.05), (1.0, 0, 0.999),
    (1.0, 5, 0.7), (0.9, 4, 0.2), (2.0, 50, 0.95),
]


@pytest.mark.parametrize("temperature, top_k, top_p", CASES)
def test_each_row_takes_the_reference_token_and_log_probability(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(hash((temperature, top_k, top_p)) & 0xFFFF)
    V = 37
    for trial in range(12):
        logits = torch.randn(3, V, generator=g) * 3
        seeds = [int(torch.randint(0, 2**31, (1,), generator=g)) for _ in range(3)]
        banned = [[int(i) for i in torch.randperm(V, generator=g)[: trial % 4]] for _ in range(3)]
        params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p) for _ in range(3)]
        tokens, logprobs = Sampler()(logits, params, [make_generator(s) for s in seeds], banned)
        for row in range(3):
            want_tok, want_lp = ref_sample(logits[row], params[row], seeds[row], banned[row])
            assert tokens[row] == want_tok, (row, trial)
            assert logprobs[row] == pytest.approx(want_lp, abs=2e-5), (row, trial)
            assert tokens[row] not in banned[row]


def test_rows_of_one_batch_keep_their_own_parameters_and_bans():
    g = torch.Generator().manual_seed(11)
    V = 23
    logits = torch.randn(4, V, generator=g) * 2
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.5, top_p=0.6),
              SamplingParams(temperature=0)]
    top = int(logits[3].argmax())
    banned = [[], [0, 1], [], [top]]
    seeds = [1, 2, 3, 4]
    tokens, logprobs = Sampler()(logits, params, [make_generator(s) for s in seeds], banned)
    for row in range(4):
        assert (tokens[row], pytest.approx(logprobs[row], abs=2e-5)) == ref_sample(logits[row], params[row], seeds[row], banned[row])
    assert tokens[0] == int(logits[0].argmax()) and tokens[3] != top  # a ban on row 3 only


def test_the_callers_logits_are_not_changed():
    logits = torch.randn(2, 9)
    before = logits.clone()
    Sampler()(logits, [SamplingParams(temperature=0), SamplingParams(temperature=1.0)], [make_generator(1), make_generator(2)], [[0, 1], [2]])
    assert torch.equal(logits, before)


def test_no_bans_given_means_none():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    for banned in (None, [], [[]]):
        assert Sampler()(logits, [SamplingParams(temperature=0)], [make_generator(0)], banned)[0] == [1]


def test_greedy_takes_the_first_maximum_and_its_log_probability():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0]])
    tokens, lps = Sampler()(logits, [SamplingParams(temperature=0)], [make_generator(0)])
    assert tokens == [1] and lps[0] == pytest.approx(3 - math.log(math.exp(1) + 2 * math.exp(3) + math.exp(-2)), abs=1e-6)
    tokens, lps = Sampler()(logits, [SamplingParams(temperature=0)], [make_generator(0)], [[1]])  # banned: the next maximum
    assert tokens == [2] and lps[0] == pytest.approx(3 - math.log(math.exp(1) + math.exp(3) + math.exp(-2)), abs=1e-6)


def test_sampled_tokens_follow_the_filtered_distribution():
    """3000 draws of one row: the frequencies are the reference's filtered probabilities (within 5 sigma)."""
    logits = torch.log(torch.tensor([0.30, 0.25, 0.20, 0.15, 0.06, 0.04]))
    for temperature, top_k, top_p in ((1.0, 3, 1.0), (0.5, 0, 0.9)):
        p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        g = make_generator(5)
        n = 3000
        counts = [0] * 6
        sampler = Sampler()
        for _ in range(n // 50):
            toks, _ = sampler(logits.expand(50, 6), [p] * 50, [g] * 50)
            for t in toks:
                counts[t] += 1
        want = ref_filter(ref_softmax([float(v) / temperature for v in logits]), top_k, top_p)
        for i in range(6):
            sigma = math.sqrt(n * want[i] * (1 - want[i])) + 1e-9
            assert abs(counts[i] - n * want[i]) <= 5 * sigma + 1, (temperature, top_k, top_p, i, counts, want)


def test_a_seed_gives_the_same_tokens_and_no_seed_fresh_ones():
    logits = torch.zeros(1, 1000)
    p = [SamplingParams(temperature=1.0)]
    a = Sampler()(logits, p, [make_generator(42)])[0]
    g1, g2 = make_generator(42), make_generator(42)
    seq1 = [Sampler()(logits, p, [g1])[0][0] for _ in range(8)]
    seq2 = [Sampler()(logits, p, [g2])[0][0] for _ in range(8)]
    assert seq1 == seq2 and seq1[0] == a[0] and len(set(seq1)) > 1
    unseeded = {tuple(Sampler()(logits, p, [make_generator(None)])[0]) for _ in range(6)}
    assert len(unseeded) > 1
    assert torch.equal(torch.rand(5, generator=make_generator(7)), torch.rand(5, generator=torch.Generator().manual_seed(7)))
    assert torch.equal(torch.rand(5, generator=make_generator(0)), torch.rand(5, generator=torch.Generator().manual_seed(0)))  # 0 is a seed


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (1, 1.0), (2, 1.0), (5, 1.0), (0, 0.3), (0, 0.75), (3, 0.5), (7, 0.99), (100, 0.1)])
def test_filter_matches_the_reference_on_random_probabilities(top_k, top_p):
    g = torch.Generator().manual_seed(top_k * 1000 + int(top_p * 100))
    for _ in range(20):
        probs = torch.softmax(torch.randn(13, generator=g, dtype=torch.float64) * 2, -1)
        got = filter_top_k_top_p(probs, top_k, top_p)
        want = ref_filter(probs.tolist(), top_k, top_p)
        assert got.tolist() == pytest.approx(want, abs=1e-12)


def test_filter_ties_keep_the_earlier_index_and_top_p_keeps_the_token_that_reaches_it():
    probs = torch.tensor([0.2, 0.4, 0.2, 0.2], dtype=torch.float64)
    assert filter_top_k_top_p(probs, 2, 1.0).tolist() == pytest.approx([1 / 3, 2 / 3, 0, 0])
    assert filter_top_k_top_p(probs, 3, 1.0).tolist() == pytest.approx([0.25, 0.5, 0.25, 0])
    assert filter_top_k_top_p(probs, 0, 0.4).tolist() == pytest.approx([0, 1, 0, 0])  # 0.4 reached by the first token
    assert filter_top_k_top_p(probs, 0, 0.41).tolist() == pytest.approx([1 / 3, 2 / 3, 0, 0])
    assert filter_top_k_top_p(probs, 0, 0.6).tolist() == pytest.approx([1 / 3, 2 / 3, 0, 0])
    assert filter_top_k_top_p(probs, 0, 0.61).tolist() == pytest.approx([0.25, 0.5, 0.25, 0])
    # p is of the mass top-k kept (0.6): 0.4 reaches 0.66 * 0.6, not 0.7 * 0.6
    assert filter_top_k_top_p(probs, 2, 0.66).tolist() == pytest.approx([0, 1, 0, 0])
    assert filter_top_k_top_p(probs, 2, 0.7).tolist() == pytest.approx([1 / 3, 2 / 3, 0, 0])
    assert filter_top_k_top_p(probs, 0, 1.0).tolist() == pytest.approx(probs.tolist())
    exact = torch.tensor([0.125, 0.5, 0.125, 0.25])  # binary fractions: the cumulative masses are exact
    assert filter_top_k_top_p(exact, 0, 0.5).tolist() == [0.0, 1.0, 0.0, 0.0]  # 0.5 reached by the first: the next is out
    assert filter_top_k_top_p(exact, 0, 0.75).tolist() == pytest.approx([0, 2 / 3, 0, 1 / 3])
    assert filter_top_k_top_p(exact, 0, 0.875).tolist() == pytest.approx([1 / 7, 4 / 7, 0, 2 / 7])  # the earlier of the tied 0.125s
    assert filter_top_k_top_p(exact, 2, 0.5).tolist() == [0.0, 1.0, 0.0, 0.0]  # p of the kept 0.75: 0.375, reached by 0.5
    assert filter_top_k_top_p(exact, 2, 0.7).tolist() == pytest.approx([0, 2 / 3, 0, 1 / 3])  # 0.525: not reached by 0.5


@pytest.mark.parametrize("n", [17, 40, 300])
def test_ties_keep_the_earliest_indices_in_a_long_row(n):
    """Equal probabilities: top-k and top-p keep the first indices (a stable sort; torch's default sort is not stable
    from 17 elements on)."""
    probs = torch.full((n,), 1.0 / n)
    assert filter_top_k_top_p(probs, 3, 1.0).nonzero().flatten().tolist() == [0, 1, 2]
    assert filter_top_k_top_p(probs, 0, 2.5 / n).nonzero().flatten().tolist() == [0, 1, 2]


# ---------------------------------------------------------------- SamplingParams and Sequence


def test_sampling_params_defaults():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.end_id, p.min_tokens, p.ignore_eos) == (64, 1.0, 0, 1.0, None, None, 0, False)
    assert p.stop_words == [] and p.bad_words == [] and p.stop_token_ids == [] and p.bad_token_ids == []
    assert SamplingParams().stop_words is not SamplingParams().stop_words
    assert not p.greedy


@pytest.mark.parametrize("kw, greedy", [({"temperature": 0}, True), ({"top_k": 1}, True), ({"temperature": 0.01}, False),
                                        ({"top_k": 2}, False), ({"top_k": 0}, False), ({"top_p": 0.1}, False)])
def test_greedy_is_temperature_zero_or_top_k_one(kw, greedy):
    assert SamplingParams(**kw).greedy is greedy


@pytest.mark.parametrize("kw, ok", [
    ({"max_tokens": 1}, True), ({"max_tokens": 0}, False), ({"max_tokens": -1}, False),
    ({"temperature": 0.0}, True), ({"temperature": -1e-9}, False),
    ({"top_k": 0}, True), ({"top_k": -1}, False),
    ({"top_p": 1.0}, True), ({"top_p": 1e-9}, True), ({"top_p": 0.0}, False), ({"top_p": 1.0000001}, False), ({"top_p": -0.5}, False),
    ({"min_tokens": 0}, True), ({"min_tokens": 100}, True), ({"min_tokens": -1}, False),
])
def test_validate_bounds(kw, ok):
    p = SamplingParams(**kw)
    if ok:
        assert p.validate() is p
    else:
        name = next(iter(kw))
        with pytest.raises(TrtkvError, match=name):
            p.validate()


def test_a_sequences_token_bookkeeping():
    s = Sequence([5, 6, 7], SamplingParams(max_tokens=4))
    t = Sequence([1], SamplingParams(), request_id="mine")
    assert t.seq_id > s.seq_id and s.request_id == str(s.seq_id) and t.request_id == "mine"
    assert (s.num_tokens, s.num_cached, s.num_pending, s.in_prefill) == (3, 0, 3, True)
    assert s.status == SequenceStatus.WAITING and not s.is_finished and s.slot is None and s.block_table == []
    assert s.first_token_time is None and s.finish_reason is None and s.num_preemptions == 0
    s.num_cached = 2
    assert s.num_pending == 1 and not s.in_prefill
    s.append_token(9, -0.5)
    first = s.first_token_time
    s.append_token(8)
    assert s.first_token_time == first is not None
    assert s.output_ids == [9, 8] and s.logprobs == [-0.5, 0.0] and s.num_tokens == 5 and s.num_pending == 3 and s.in_prefill
    assert [s.token(i) for i in range(5)] == [5, 6, 7, 9, 8] and s.tokens(1, 4) == [6, 7, 9] and s.tokens(2, 2) == []
    s.status = SequenceStatus.FINISHED
    assert s.is_finished
    with pytest.raises(TrtkvError, match="empty"):
        Sequence([], SamplingParams())


def test_top_p_keeps_the_smallest_set_that_reaches_it_exactly():
    """Probabilities 0.5, 0.25, 0.25 (exact in binary): the smallest set with mass
    >= 0.5 is the first token alone; with top_p 0.75 it is the first two."""
    probs = torch.tensor([0.25, 0.5, 0.25])
    assert filter_top_k_top_p(probs, 0, 0.5).tolist() == [0.0, 1.0, 0.0]
    assert filter_top_k_top_p(probs, 0, 0.75).tolist() == pytest.approx([1 / 3, 2 / 3, 0.0])


def test_sampling_params_refuse_top_p_zero():
    """Top_p must be in (0, 1]: 0 keeps no token (inputs.py maps a client's 0 to 1.0 before)."""
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(TrtkvError, match="top_p must be in"):
            SamplingParams(top_p=bad).validate()
    for good in (1e-6, 0.5, 1.0):
        assert SamplingParams(top_p=good).validate().top_p == good


def test_a_prompt_token_id_equal_to_the_vocab_size_is_refused(small_llama, tokenizer):
    """Ids must be in [0, vocab_size); vocab_size itself is one past the last row."""
    from test_runtime_faults import make_llm

    llm = make_llm(small_llama, tokenizer)
    vocab = small_llama.config.vocab_size
    with pytest.raises(TrtkvError, match=r"prompt token ids must be in \[0, %d\)" % vocab):
        llm.make_sequence([1, vocab], SamplingParams(max_tokens=2))
    assert llm.make_sequence([1, vocab - 1], SamplingParams(max_tokens=2)).prompt_ids == [1, vocab - 1]


def test_bad_tokens_stay_banned_while_min_tokens_bans_the_end_ids(small_llama, tokenizer):
    """Bad_token_ids are never sampled, also while
    min_tokens suppresses the end ids (both bans hold at once)."""
    from test_runtime_faults import make_llm

    prompt = [5, 17, 9, 33, 2, 41]
    free = make_llm(small_llama, tokenizer).generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    first = free.new_token_ids[0]
    assert first != 0  # the stand-in manifest's end id
    out = make_llm(small_llama, tokenizer).generate([prompt], SamplingParams(max_tokens=3, temperature=0, min_tokens=3, bad_token_ids=[first]))[0]
    assert first not in out.new_token_ids and len(out.new_token_ids) == 3
