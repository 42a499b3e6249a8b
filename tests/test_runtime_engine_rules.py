"""The offline runtime's request rules (llm_engine.py, engine_loop.py) with a scripted engine: ``ScriptedEngine`` answers
every step with logits that rank the tokens its script names next (10, 9, 8, ... and 0 for the rest), so what the
runtime must do with them is known in advance: greedy takes the script's first choice unless it is banned, then the
next; the log-probability is that of those logits; an end id stops without being appended (unless ignore_eos, or
min_tokens not yet reached, or another end_id); stop token ids stop after being appended; a stop word cuts the text
where it starts and streamed text never shows a stop word's beginning before it is known not to be one; bad words are
never completed; text is the tokenizer's decoding of the new tokens (a partial UTF-8 character held back). The engine
loop: callbacks per step, the last one final; a callback that returns False (or raises) aborts; a draining loop
refuses; a failed step fails every request in flight.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from trtkv.cache_layout import PagedKVLayout
from trtkv.errors import TrtkvError
from trtkv.formats import get_format
from trtkv.runtime.block_manager import CacheBudget
from trtkv.runtime.config import RuntimeConfig
from trtkv.runtime.engine import Engine
from trtkv.runtime.engine_loop import EngineLoop, ShuttingDown
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.llm_engine import LLMEngine, RequestOutput, _find_stop, _stop_prefix_len, bad_word_bans
from trtkv.runtime.sequence import SamplingParams, Sequence
from trtkv.runtime.step import StepOutput

BS = 4
V = 320  # the tiny tokenizer's vocabulary
EOS = 0


class ScriptedEngine(Engine):
    """``script(tokens) -> [first choice, second, ...]`` for the token after ``tokens`` (the sequence so far: the engine
    rebuilds it from each slot's rows). Records every step's batch size."""

    def __init__(self, script, name="torch", all_logits=False):
        self.script = script
        self.name = name
        self.all_logits = all_logits
        self.history: dict[int, list[int]] = {}
        self.batches: list[tuple[int, int]] = []  # (rows, tokens per row)

    def step(self, batch, cache):
        B, T = batch.input_ids.shape
        self.batches.append((B, T))
        logits = torch.zeros(B, T, V) if self.all_logits else torch.zeros(B, V)
        for b in range(B):
            slot, c, n = int(batch.slot_ids[b]), int(batch.context_lens[b]), int(batch.new_lens[b])
            h = self.history.get(slot, [])[:c] + batch.input_ids[b, :n].tolist()
            self.history[slot] = h
            row = torch.zeros(V)
            for rank, tok in enumerate(self.script(h)):
                row[tok] = 10.0 - rank
            if self.all_logits:
                logits[b] = torch.randn(T, V)  # other positions (earlier tokens, padding) are never read
                logits[b, :, 99] = 50.0
                logits[b, n - 1] = row
            else:
                logits[b] = row
        k = torch.zeros(1, B, T, 1, 2, dtype=torch.float16)
        return StepOutput(logits, k, k.clone())


def lp_of(rank: int, n_ranked: int, banned_ranked: int = 0, banned_zero: int = 0) -> float:
    """log-softmax of the token at ``rank`` among logits 10, 9, ... (n_ranked of them) and V - n_ranked zeros, bans removed."""
    vals = [10.0 - r for r in range(n_ranked)]
    z = sum(math.exp(v) for i, v in enumerate(vals) if i >= banned_ranked) + (V - n_ranked - banned_zero)
    return 10.0 - rank - math.log(z)


def make(tokenizer, script, *, max_seqs=4, num_blocks=64, max_batched=64, eos=(EOS,), name="torch", max_batch=4, all_logits=False,
         max_seq_len=256, **cfg) -> LLMEngine:
    fmt = get_format(f"k=fp16,v=fp16,block={BS}")
    manifest = SimpleNamespace(
        limits=SimpleNamespace(max_batch=max_batch, max_seq_len=max_seq_len, block_size=BS, max_new_tokens_per_step=BS, max_num_blocks=10**6,
                               max_num_slots=64),
        model=SimpleNamespace(eos_token_ids=list(eos), vocab_size=V), kv_spec=fmt.name, kv_format=fmt)
    layout = PagedKVLayout(fmt, 1, 2, BS, num_blocks, max_seqs)
    cache = PagedKVCache(layout, 1)
    budget = CacheBudget(0, layout.bytes_per_block(), layout.tail_bytes_per_slot(), BS, max_seqs, num_blocks)
    return LLMEngine(ScriptedEngine(script, name, all_logits), manifest, cache, tokenizer, RuntimeConfig(max_seqs=max_seqs, max_batched_tokens=max_batched, **cfg),
                     budget)


def follow(ids: list[int], after=None):
    """A script that continues with ``ids`` in order (then repeats the last), after any prompt; ``after``: second choices."""

    def script(h):
        return [ids[min(max(len(h) - script.prompt_len, 0), len(ids) - 1)]] + (after or [])

    script.prompt_len = 0
    return script


def run(llm: LLMEngine, prompt, params: SamplingParams, script=None) -> tuple[RequestOutput, list[RequestOutput]]:
    """One request to completion: (the final output, every output in order)."""
    if script is not None:
        script.prompt_len = len(llm.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else len(prompt)
    outs: list[RequestOutput] = []  # copies: generate() gives the final output all the request's token ids afterwards
    final = llm.generate([prompt], params, on_output=lambda o: outs.append(dataclasses.replace(o, new_token_ids=list(o.new_token_ids))))[0]
    return final, outs


PROMPT = [5, 17, 9]


def greedy(n=8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


# ---------------------------------------------------------------- tokens, text, log-probabilities, lengths


def test_greedy_follows_the_script_with_its_log_probabilities_and_text(tokenizer):
    ids = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    s = follow(ids, after=[300, 301])
    final, outs = run(make(tokenizer, s), PROMPT, greedy(len(ids)), s)
    assert final.new_token_ids == ids and final.finished and final.finish_reason == "length"
    assert final.text == "The quick brown fox" and "".join(o.new_text for o in outs) == final.text
    assert [lp for o in outs for lp in o.new_logprobs] == pytest.approx([lp_of(0, 3)] * len(ids), abs=1e-5)
    assert [o.new_token_ids for o in outs] == [[t] for t in ids] and [o.finished for o in outs] == [False] * (len(ids) - 1) + [True]
    assert all(o.num_prompt_tokens == 3 and o.request_id == final.request_id and o.error is None for o in outs)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_exactly_max_tokens_tokens(tokenizer, n):
    s = follow([70, 71, 72, 73, 74, 75, 76])
    final, outs = run(make(tokenizer, s), PROMPT, greedy(n), s)
    assert final.new_token_ids == [70, 71, 72, 73, 74, 75, 76][:n] and final.finish_reason == "length" and len(outs) == n


def test_an_all_logits_engine_is_read_at_each_rows_last_token(tokenizer):
    s = follow([70, 71, 72])
    final, _ = run(make(tokenizer, s, all_logits=True), list(range(1, 11)), greedy(3), s)
    assert final.new_token_ids == [70, 71, 72]
    llm = make(tokenizer, lambda h: [70 + len(h)], all_logits=True)  # rows of 2 and 3 new tokens in one [2, 3] step
    outs = llm.generate([[1, 2], [1, 2, 3]], greedy(2))
    assert [o.new_token_ids for o in outs] == [[72, 73], [73, 74]]


def test_a_text_prompt_is_encoded_by_the_tokenizer(tokenizer):
    llm = make(tokenizer, lambda h: [70])
    seq = llm.make_sequence("The quick", greedy(2))
    assert seq.prompt_ids == tokenizer("The quick")["input_ids"]
    assert llm.make_sequence([3, 4], greedy(2)).prompt_ids == [3, 4]


# ---------------------------------------------------------------- end ids, min_tokens, ignore_eos, stop ids


def test_the_end_id_stops_without_being_emitted(tokenizer):
    s = follow([70, 71, EOS, 72])
    llm = make(tokenizer, s)
    final, outs = run(llm, PROMPT, greedy(8), s)
    assert final.new_token_ids == [70, 71] and final.finish_reason == "stop" and outs[-1].new_token_ids == []
    assert outs[-1].new_logprobs == [] and len([lp for o in outs for lp in o.new_logprobs]) == 2  # the end id has none
    assert llm.stats()["generated_tokens"] == 2 and llm.stats()["finished"] == 1


def test_min_tokens_bans_the_end_id_until_reached(tokenizer):
    s = follow([70, EOS, EOS, EOS], after=[80])
    final, outs = run(make(tokenizer, s), PROMPT, greedy(8, min_tokens=3), s)
    assert final.new_token_ids == [70, 80, 80] and final.finish_reason == "stop"  # banned for outputs 2 and 3, then allowed
    lps = [lp for o in outs for lp in o.new_logprobs]
    assert lps[1] == pytest.approx(lp_of(1, 2, banned_ranked=1), abs=1e-5)  # the ban is in the log-probability too
    final, _ = run(make(tokenizer, s), PROMPT, greedy(8, min_tokens=1), s)
    assert final.new_token_ids == [70]


def test_ignore_eos_and_an_own_end_id(tokenizer):
    s = follow([70, EOS, 71, 72, 73])
    final, _ = run(make(tokenizer, s), PROMPT, greedy(4, ignore_eos=True), s)
    assert final.new_token_ids == [70, EOS, 71, 72] and final.finish_reason == "length" and final.text == tokenizer.decode([70, 71, 72])
    final, _ = run(make(tokenizer, s), PROMPT, greedy(5, end_id=72), s)
    assert final.new_token_ids == [70, EOS, 71] and final.finish_reason == "stop"  # eos is a plain token for this request


def test_without_eos_ids_in_the_manifest_the_tokenizers_is_used(tokenizer):
    llm = make(tokenizer, lambda h: [70], eos=())
    assert llm.eos_ids == [tokenizer.eos_token_id]
    assert make(tokenizer, lambda h: [70], eos=(7, 9)).eos_ids == [7, 9]


def test_stop_token_ids_stop_after_the_token(tokenizer):
    s = follow([70, 71, 72, 73])
    final, _ = run(make(tokenizer, s), PROMPT, greedy(8, stop_token_ids=[72]), s)
    assert final.new_token_ids == [70, 71, 72] and final.finish_reason == "stop"
    final, _ = run(make(tokenizer, s), PROMPT, greedy(3, stop_token_ids=[72]), s)
    assert final.new_token_ids == [70, 71, 72] and final.finish_reason == "length"  # the limit came with it: "length"


# ---------------------------------------------------------------- stop words


def test_a_stop_word_cuts_the_text_where_it_starts(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text, add_special_tokens=False)
    s = follow(ids)
    final, outs = run(make(tokenizer, s), PROMPT, greedy(len(ids), stop_words=["fox", "lazy"]), s)
    assert final.text == "The quick brown " and final.finish_reason == "stop"
    assert "".join(o.new_text for o in outs) == "The quick brown "
    assert final.new_token_ids == ids[: ids.index(269) + 1]  # generation stopped at the token that completed the word


def test_the_earliest_stop_word_wins_and_a_word_over_several_tokens_is_found(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text, add_special_tokens=False)
    s = follow(ids)
    final, _ = run(make(tokenizer, s), PROMPT, greedy(len(ids), stop_words=["the lazy", "s over"]), s)
    assert final.text == "The quick brown fox jump"
    final, _ = run(make(tokenizer, s), PROMPT, greedy(len(ids), stop_words=["k br"]), s)
    assert final.text == "The quic"


def test_streamed_text_holds_back_what_may_become_a_stop_word(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text, add_special_tokens=False)
    s = follow(ids)
    final, outs = run(make(tokenizer, s), PROMPT, greedy(len(ids), stop_words=["brown cow"]), s)
    assert final.text == text and final.finish_reason == "length"  # never matched: the whole text
    pieces = [o.new_text for o in outs]
    assert "".join(pieces) == text
    sent = ""
    for o in outs:
        sent += o.new_text
        if not o.finished:  # nothing sent may end with a beginning of the stop word ("b", "br", "brown ", "brown c"...)
            assert not any(sent.endswith("brown cow"[:k]) for k in range(1, len("brown cow"))), sent
    assert any(o.new_text == "" for o in outs[:-1])


def test_stop_words_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    s = follow(ids)
    final, _ = run(make(tokenizer, s), PROMPT, greedy(len(ids), stop_words=["The"], min_tokens=2), s)
    assert final.text == "The quick brown fox" and final.finish_reason == "length"
    final, _ = run(make(tokenizer, s), PROMPT, greedy(len(ids), stop_words=["The"]), s)
    assert final.text == "" and final.finish_reason == "stop"


def test_stop_helpers():
    assert _stop_prefix_len("abc br", ["brown"]) == 2 and _stop_prefix_len("abc", ["brown"]) == 0
    assert _stop_prefix_len("xab", ["abc", "bcd"]) == 2 and _stop_prefix_len("xb", ["abc", "bcd"]) == 1
    assert _stop_prefix_len("abc", ["abc"]) == 0 and _stop_prefix_len("abcab", ["abc"]) == 2  # proper beginnings only
    assert _stop_prefix_len("", ["a"]) == 0 and _stop_prefix_len("aaa", []) == 0
    assert _find_stop("hello world", ["o"], 6) == 7  # only stops overlapping the new text (from 6): "o" at 4 is old
    assert _find_stop("hello world", ["o", "wor"], 6) == 6  # the earliest
    assert _find_stop("hello world", ["lo w"], 6) == 3  # a word whose last character is new may start before the new text
    assert _find_stop("hello world", ["lo w"], 7) is None
    assert _find_stop("hello world", ["hello", "world"], 0) == 0 and _find_stop("abc", ["x"], 0) is None


# ---------------------------------------------------------------- bad words


def test_a_one_token_bad_word_is_never_sampled(tokenizer):
    fox = tokenizer.encode(" fox", add_special_tokens=False)  # two tokens: " f", "ox"
    s = follow([70, 71, 72, 73], after=[80])
    one = tokenizer.encode("ox", add_special_tokens=False)
    assert len(one) == 1 and len(fox) == 2
    s2 = follow([one[0], 71, one[0], 73], after=[80])
    final, _ = run(make(tokenizer, s2), PROMPT, greedy(4, bad_words=["ox"]), s2)
    assert final.new_token_ids == [80, 71, 80, 73]
    final, _ = run(make(tokenizer, s), PROMPT, greedy(4, bad_token_ids=[71, 73]), s)
    assert final.new_token_ids == [70, 80, 72, 80]


def test_a_multi_token_bad_word_bans_its_last_token_only_after_the_others(tokenizer):
    f, ox = tokenizer.encode(" fox", add_special_tokens=False)
    s = follow([72, ox, f, ox, f, 71], after=[80])
    final, _ = run(make(tokenizer, s), PROMPT, greedy(6, bad_words=["fox"]), s)  # " fox" also banned: the word after a space
    assert final.new_token_ids == [72, ox, f, 80, f, 71]


def test_bad_word_variants_and_bans():
    class Tok:
        def encode(self, w, add_special_tokens):
            return {"fox": [1, 2], " fox": [3, 2], "x": [9], " x": [4, 9], " y": [5]}[w]

    llm = SimpleNamespace(tokenizer=Tok())
    assert LLMEngine.bad_word_sequences(llm, ["fox", "x", " y", "fox"]) == [[1, 2], [3, 2], [9], [4, 9], [5]]
    s = Sequence([7, 1], SamplingParams())
    assert bad_word_bans(s, [[1, 2], [3, 2], [7, 1, 8], [5]]) == [2, 8, 5]
    assert bad_word_bans(Sequence([1], SamplingParams()), [[6, 1, 2]]) == []


# ---------------------------------------------------------------- UTF-8, requests, stats, batching


def test_a_partial_utf8_character_is_held_until_complete(tokenizer):
    a, b = tokenizer.encode("é", add_special_tokens=False)
    s = follow([70, a, b, 71])
    final, outs = run(make(tokenizer, s), PROMPT, greedy(4), s)
    assert [o.new_text for o in outs] == [tokenizer.decode([70]), "", "é", tokenizer.decode([71])]
    assert final.text == tokenizer.decode([70, a, b, 71])
    final, outs = run(make(tokenizer, s), PROMPT, greedy(2), s)
    assert final.text.endswith("\ufffd")  # the last output: whatever is there


def test_requests_refused_at_the_door_are_counted(tokenizer):
    llm = make(tokenizer, lambda h: [70], max_seq_len=16)
    for prompt, params, words in (([], greedy(2), "empty"), ("", greedy(2), "no tokens"), ([V], greedy(2), rf"\[0, {V}\)"),
                                  ([-1], greedy(2), "prompt token ids"), ([1] * 10, greedy(7), "context of 16"), ([1], greedy(0), "max_tokens")):
        with pytest.raises(TrtkvError, match=words):
            llm.make_sequence(prompt, params)
    assert llm.stats()["rejected"] == 6 and not llm.has_work()
    assert llm.make_sequence([V - 1, 0], greedy(14)).prompt_ids == [V - 1, 0]


def test_a_duplicate_request_id_is_refused_and_abort_frees_it(tokenizer):
    llm = make(tokenizer, lambda h: [70])
    llm.add_request(PROMPT, greedy(5), "r1")
    with pytest.raises(TrtkvError, match="'r1' is already running"):
        llm.add_request([1, 2], greedy(5), "r1")
    llm.step()
    assert llm.stats()["running"] == 1 and llm.stats()["blocks_used"] == 0
    assert llm.abort("r1") is True and llm.abort("r1") is False and llm.abort("nobody") is False
    st = llm.stats()
    assert st["aborted"] == 1 and st["running"] == 0 and st["slots_used"] == 0 and not llm.has_work()
    llm.add_request(PROMPT, greedy(2), "r1")  # the id is free again
    while llm.has_work():
        llm.step()
    assert llm.requests == {}  # a finished request is forgotten: its id is free again too
    llm.add_request(PROMPT, greedy(2), "r1")


def test_stats_count_what_happened(tokenizer):
    llm = make(tokenizer, lambda h: [70], max_seqs=3, num_blocks=20)
    llm.generate([[1, 2, 3, 4, 5], [6, 7]], greedy(3))
    st = llm.stats()
    assert st["prompt_tokens"] == 7 and st["generated_tokens"] == 6 and st["finished"] == 2 and st["aborted"] == 0 and st["rejected"] == 0
    assert st["peak_running"] == 2 and st["running"] == 0 and st["waiting"] == 0 and st["steps"] >= 3
    assert (st["blocks_total"], st["slots_total"], st["block_size"]) == (20, 3, BS) and st["slots_used"] == 0
    assert st["blocks_used"] == 0 and st["blocks_free"] + st["blocks_cached"] == 20 and st["prefix_caching"] is True
    assert st["pool_tokens"] == 20 * BS and st["kv_format"] == llm.manifest.kv_spec


def test_prefix_caching_follows_the_config(tokenizer):
    assert make(tokenizer, lambda h: [70]).block_manager.prefix is not None
    llm = make(tokenizer, lambda h: [70], enable_prefix_caching=False)
    assert llm.block_manager.prefix is None and llm.stats()["prefix_caching"] is False and llm.stats()["prefix_hit_rate"] == 0.0


def test_prefix_hits_are_counted_in_the_hit_rate(tokenizer):
    llm = make(tokenizer, lambda h: [70])
    prompt = list(range(1, 10))  # two full blocks of 4 and one token
    llm.generate([prompt], greedy(1))
    llm.generate([prompt], greedy(1))
    st = llm.stats()
    assert st["prefix_hit_tokens"] == 8 and st["prefix_hit_rate"] == pytest.approx(8 / 18)


@pytest.mark.parametrize("name, rows, calls", [("tensorrt", 2, [(2, 2), (2, 2), (1, 2), (2, 1), (2, 1), (1, 1)]), ("torch", 5, [(5, 2), (5, 1)])])
def test_steps_are_split_into_engine_batches_of_max_batch(tokenizer, name, rows, calls):
    """A fixed-shape engine (TensorRT) runs at most its profile's max_batch rows per call; a shape-free one the slots."""
    llm = make(tokenizer, lambda h: [70], max_seqs=5, max_batch=2, name=name)
    assert llm.max_batch == rows
    llm.generate([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]], greedy(2))
    assert llm.engine.batches == calls  # the prefills [B, 2], then the decodes [B, 1]


def test_prefill_and_decode_run_as_separate_calls(tokenizer):
    llm = make(tokenizer, lambda h: [70], max_seqs=2)
    llm.add_request([1], greedy(3))
    llm.step()
    llm.add_request([1, 2, 3], greedy(3))
    llm.engine.batches.clear()
    llm.step()  # one prefill (3 tokens) and one decode
    assert sorted(llm.engine.batches) == [(1, 1), (1, 3)]


# ---------------------------------------------------------------- the engine loop


def wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


@pytest.fixture
def loop_of(tokenizer):
    loops = []

    def make_loop(script=lambda h: [70], on_step=None, **kw):
        loop = EngineLoop(make(tokenizer, script, **kw), on_step=on_step, idle_wait=0.005)
        loops.append(loop)
        return loop

    yield make_loop
    for loop in loops:
        loop.stop()


def test_an_idle_loop_waits_instead_of_spinning(loop_of):
    calls = []
    loop_of(on_step=calls.append)
    time.sleep(0.3)
    assert len(calls) < 100  # idle_wait 5 ms: at most ~60 wake-ups, not a busy loop


def test_a_loop_calls_back_per_step_and_the_last_is_final(loop_of):
    stats = []
    loop = loop_of(on_step=stats.append)
    got, done = [], threading.Event()

    def cb(o):
        got.append(o)
        if o.finished:
            done.set()

    seq = loop.submit([1, 2, 3], greedy(3), "a", cb)
    assert isinstance(seq, Sequence) and seq.request_id == "a"
    assert done.wait(10)
    assert [o.new_token_ids for o in got] == [[70], [70], [70]] and [o.finished for o in got] == [False, False, True]
    wait(lambda: loop.in_flight == 0)
    assert stats and stats[-1]["finished"] == 1


def test_a_callback_returning_false_or_raising_aborts_its_request(loop_of):
    loop = loop_of()
    calls = {"a": 0, "b": 0}

    def stop_a(o):
        calls["a"] += 1
        return False

    def boom_b(o):
        calls["b"] += 1
        raise RuntimeError("client gone")

    loop.submit([1, 2], greedy(50), "a", stop_a)
    loop.submit([3, 4], greedy(50), "b", boom_b)
    wait(lambda: loop.in_flight == 0 and not loop.engine.has_work())
    assert calls == {"a": 1, "b": 1} and loop.engine.stats()["aborted"] == 2 and loop.engine.stats()["generated_tokens"] == 2


def test_a_bad_request_fails_in_the_callers_thread(loop_of):
    loop = loop_of()
    with pytest.raises(TrtkvError, match="max_tokens"):
        loop.submit([1], greedy(0), "x", lambda o: None)
    assert loop.in_flight == 0


def test_a_duplicate_id_gets_an_error_output(loop_of):
    loop = loop_of()
    first, second = [], []
    loop.submit([1], greedy(40), "same", first.append)
    loop.submit([1], greedy(40), "same", second.append)
    wait(lambda: second)
    assert second[0].finished and second[0].finish_reason == "error" and "already running" in second[0].error
    wait(lambda: first and first[-1].finished)


def test_a_draining_loop_refuses_new_requests_and_drain_waits(loop_of):
    loop = loop_of()
    got = []
    loop.submit([1], greedy(5), "a", got.append)
    loop.stop_admitting()
    with pytest.raises(ShuttingDown, match="shutting down"):
        loop.submit([1], greedy(5), "b", got.append)
    assert loop.drain(10) == 0 and got[-1].finished and got[-1].finish_reason == "length"


def test_fail_in_flight_and_stop_fail_requests_with_a_message(loop_of):
    gate = threading.Event()

    def slow(h):
        gate.wait(10)
        return [70]

    loop = loop_of(script=slow)
    got = []
    loop.submit([1], greedy(50), "a", got.append)
    wait(lambda: loop.in_flight == 1)
    assert loop.drain(0.05) == 1  # still running after the grace period
    gate.set()
    loop.stop()
    assert got[-1].finished and got[-1].error == "the server is shutting down" and got[-1].finish_reason == "internal"
    assert not loop.alive


def test_fail_in_flight_counts_and_fails_each(tokenizer):
    loop = EngineLoop(make(tokenizer, lambda h: [70]), idle_wait=0.005)
    try:
        loop.stop()
        got = []
        loop.engine.add_request([1], greedy(5), "a")
        loop._callbacks["a"] = got.append
        assert loop.fail_in_flight("bye") == 1 and got[-1].error == "bye" and got[-1].finished
        assert loop.in_flight == 0 and not loop.engine.has_work()
    finally:
        loop.stop()


def test_a_failing_engine_step_fails_every_request(loop_of):
    def broken(h):
        raise ValueError("bad kernel")

    loop = loop_of(script=broken)
    got = []
    loop.submit([1], greedy(5), "a", got.append)
    loop.submit([2], greedy(5), "b", got.append)
    wait(lambda: len(got) == 2)
    assert {o.request_id for o in got} == {"a", "b"}
    assert all(o.finished and o.error == "engine step failed: ValueError: bad kernel" for o in got)
    wait(lambda: not loop.engine.has_work())
    assert loop.alive  # the loop survives a failed step
