"""Edges mutation testing found unchecked: each test fails on the mutant named in its docstring."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trtkv.errors import TrtkvError
from trtkv.runtime.block_manager import BlockManager
from trtkv.runtime.sampler import Sampler, make_generator
from trtkv.runtime.scheduler import Scheduler
from trtkv.runtime.sequence import SamplingParams, Sequence

BS = 4


def seq(n_prompt: int, max_tokens: int = 8, **kw) -> Sequence:
    return Sequence(list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, **kw))


def run_to_end(sched: Scheduler, max_steps: int = 200) -> dict[int, list[int]]:
    """Pretend engine: every sampling chunk appends token 7; returns the tokens each sequence produced."""
    produced: dict[int, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_work():
            return produced
        out = sched.schedule()
        sampled = [c.seq for c in out.decode + out.prefill if c.samples]
        sched.postprocess(out)
        for s in sampled:
            s.append_token(7)
            produced.setdefault(s.seq_id, []).append(7)
            if len(s.output_ids) >= s.params.max_tokens:
                sched.finish(s, "length")
    pytest.fail("the scheduler did not finish")


# ---------------------------------------------------------------- scheduler and block manager


def test_aborting_a_waiting_request_removes_it_and_it_never_runs():
    """Mutant: Scheduler.abort without ``self.waiting.remove(seq)``."""
    sched = Scheduler(BlockManager(16, 1, BS))
    first, second = seq(3), seq(3)
    sched.add(first)
    sched.add(second)
    sched.schedule()  # one slot: `first` runs, `second` waits
    assert second in sched.waiting
    sched.abort(second)
    assert second not in sched.waiting
    produced = run_to_end(sched)
    assert second.seq_id not in produced and len(produced[first.seq_id]) == 8


def test_prompt_plus_max_tokens_equal_to_the_context_is_accepted():
    """Mutant: ``total >= self.max_model_len`` in Scheduler.check."""
    sched = Scheduler(BlockManager(64, 2, BS), max_model_len=32)
    sched.check(seq(24, max_tokens=8))  # exactly 32
    with pytest.raises(TrtkvError, match="exceeds the engine's context of 32"):
        sched.check(seq(25, max_tokens=8))


def test_prompt_plus_max_tokens_a_multiple_of_the_block_size_fits_and_runs():
    """Mutant: BlockManager.max_blocks without its ``- 1`` (the last sampled token is never cached)."""
    sched = Scheduler(BlockManager(2, 1, BS))  # 2 blocks
    s = seq(4, max_tokens=8)  # 12 tokens = 3 blocks, but only 11 are ever cached: 2 sealed blocks
    assert sched.bm.max_blocks(s) == 2
    sched.add(s)
    produced = run_to_end(sched)
    assert len(produced[s.seq_id]) == 8 and sched.bm.num_free_blocks == 2


# ---------------------------------------------------------------- sampler


def test_sampled_logprob_is_log_softmax_at_the_temperature():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    p = SamplingParams(max_tokens=1, temperature=0.5, seed=3)
    (tok,), (lp,) = Sampler()(logits, [p], [make_generator(3)])
    assert lp == pytest.approx(float(torch.log_softmax(logits[0] / 0.5, -1)[tok]), abs=1e-6)
    assert lp != pytest.approx(float(torch.log_softmax(logits[0], -1)[tok]), abs=1e-3)


def test_seed_zero_is_reproducible():
    """Mutant: ``seed or random`` (0 would mean "no seed")."""
    logits = torch.zeros(1, 1000)  # uniform: the token is decided by the generator alone
    p = SamplingParams(max_tokens=1, temperature=1.0, seed=0)
    draws = [[Sampler()(logits, [p], [g])[0][0] for _ in range(8)] for g in (make_generator(0), make_generator(0))]
    assert draws[0] == draws[1]


# ---------------------------------------------------------------- inputs (the Triton request parser)


def _get(values: dict):
    return lambda name: None if name not in values else np.asarray(values[name])


def parse(**values):
    from trtkv.triton_repo.inputs import parse_request

    return parse_request(_get({"text_input": [b"hi"], "max_tokens": [4], **values}))


def test_top_p_zero_means_disabled():
    p = parse(top_p=[0.0]).params
    assert p.top_p == 1.0 and p.greedy


def test_bad_words_and_stop_words_are_parsed_separately_and_empty_words_dropped():
    p = parse(bad_words=[b"foo", b"", b" bar"], stop_words=[b"\n\n", b""]).params
    assert p.bad_words == ["foo", " bar"]
    assert p.stop_words == ["\n\n"]
    assert parse(stop_words=[b"x"]).params.bad_words == [] and parse(bad_words=[b"y"]).params.stop_words == []
