"""The second mutation run's survivors (issue 25, bench/results/mutations-2026-12-02.md): each test fails on the
mutant named in its docstring and passes on the real code. Expectations come from the documented rule and the
inputs (hand-computed), not from the code under test."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trtkv.errors import TrtkvError
from trtkv.formats import get_format
from trtkv.runtime.block_manager import BlockManager, CacheBudget
from trtkv.runtime.sampler import filter_top_k_top_p
from trtkv.runtime.scheduler import Scheduler
from trtkv.runtime.sequence import SamplingParams, Sequence, SequenceStatus

BS = 4


def seq(n_prompt: int, max_tokens: int = 8, first: int = 1) -> Sequence:
    return Sequence(list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens))


# ---------------------------------------------------------------- runtime: scheduler, block manager, sampler, params


def test_a_preempted_sequence_goes_back_to_the_front_of_the_queue():
    """R3 (scheduler.preempt appends to the back): the scheduler's policy says a preempted sequence goes back to the
    *front* of the queue, ahead of requests that were already waiting."""
    sched = Scheduler(BlockManager(16, 4, BS), max_num_seqs=1)
    a, b, c = seq(3), seq(3), seq(3)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [ch.seq for ch in out.prefill + out.decode] == [a]  # one slot: a runs, b and c wait
    sched.postprocess(out)
    sched.preempt(a)
    assert list(sched.waiting) == [a, b, c] and a.status == SequenceStatus.WAITING


def test_nothing_is_admitted_in_a_step_that_preempted():
    """R6 (admission also in a step that preempted): a step that had to preempt admits nobody (the scheduler's policy,
    point 3). With prefix caching a sequence whose prompt is cached needs few blocks, so right after a preemption it
    would fit: two equal 13-token prompts and a 4-token one in a pool of 5 blocks of 4, 6 tokens a step (a case a
    random search over small pools found; without prefix caching the victim, first in the queue, never fits)."""
    from trtkv.runtime.prefix_cache import PrefixCache

    sched = Scheduler(BlockManager(5, 3, BS, PrefixCache(BS, "salt")), max_num_seqs=3, max_num_batched_tokens=6)
    prompts, max_tokens = [list(range(1, 14)), list(range(1, 14)), [1, 2, 3, 4]], [4, 7, 3]
    seqs = [Sequence(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, max_tokens)]
    for s in seqs:
        sched.add(s)
    preempting_steps = 0
    for _ in range(300):
        if not sched.has_work():
            break
        running_before = list(sched.running)
        out = sched.schedule()
        if out.preempted:
            preempting_steps += 1
            scheduled = [c.seq for c in out.prefill + out.decode]
            assert all(s in running_before for s in scheduled), "a step that preempted admitted a waiting sequence"
            assert all(v in sched.waiting and v not in sched.running for v in out.preempted)
        sampled = [c.seq for c in out.decode + out.prefill if c.samples]
        sched.postprocess(out)
        for s in sampled:
            s.append_token(7)
            if len(s.output_ids) >= s.params.max_tokens:
                sched.finish(s, "length")
    assert not sched.has_work() and preempting_steps > 0
    assert [len(s.output_ids) for s in seqs] == max_tokens


def test_a_budget_that_leaves_no_pool_block_is_refused():
    """R9 (``num_blocks < 0``): slots of 100 bytes and blocks of 1000: 2 slots + 1 block need 1200 bytes; 1199 bytes
    hold the slots and no block, which must be refused (a pool with no block can seal nothing)."""
    ok = CacheBudget.plan(1200, bytes_per_block=1000, bytes_per_slot=100, block_size=BS, num_slots=2)
    assert ok.num_blocks == 1
    with pytest.raises(TrtkvError, match="does not hold 2 sequence slots"):
        CacheBudget.plan(1199, bytes_per_block=1000, bytes_per_slot=100, block_size=BS, num_slots=2)


def test_top_p_keeps_the_smallest_set_that_reaches_it_exactly():
    """R14 (``mass_before <= top_p``): probabilities 0.5, 0.25, 0.25 (exact in binary): the smallest set with mass
    >= 0.5 is the first token alone; with top_p 0.75 it is the first two."""
    probs = torch.tensor([0.25, 0.5, 0.25])
    assert filter_top_k_top_p(probs, 0, 0.5).tolist() == [0.0, 1.0, 0.0]
    assert filter_top_k_top_p(probs, 0, 0.75).tolist() == pytest.approx([1 / 3, 2 / 3, 0.0])


def test_sampling_params_refuse_top_p_zero():
    """R21 (``0 <= top_p``): top_p must be in (0, 1]: 0 keeps no token (inputs.py maps a client's 0 to 1.0 before)."""
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(TrtkvError, match="top_p must be in"):
            SamplingParams(top_p=bad).validate()
    for good in (1e-6, 0.5, 1.0):
        assert SamplingParams(top_p=good).validate().top_p == good


def test_a_prompt_token_id_equal_to_the_vocab_size_is_refused(small_llama, tokenizer):
    """R19 (``0 <= t <= vocab``): ids must be in [0, vocab_size); vocab_size itself is one past the last row."""
    from test_runtime_faults import make_llm

    llm = make_llm(small_llama, tokenizer)
    vocab = small_llama.config.vocab_size
    with pytest.raises(TrtkvError, match=r"prompt token ids must be in \[0, %d\)" % vocab):
        llm.make_sequence([1, vocab], SamplingParams(max_tokens=2))
    assert llm.make_sequence([1, vocab - 1], SamplingParams(max_tokens=2)).prompt_ids == [1, vocab - 1]


# ---------------------------------------------------------------- Triton model: request parsing


def _get(**inputs):
    """A request's inputs as the python model hands them to parse_request: arrays with the batch dimension."""

    def get(name):
        v = inputs.get(name)
        if v is None:
            return None
        return v if isinstance(v, np.ndarray) else np.array([[v]], dtype=object if isinstance(v, (str, bytes)) else None)

    return get


def test_an_empty_input_tensor_is_a_400_naming_it():
    """T1 (``x.size > 1``): an input with no value (shape [1, 0]) is refused as a bad request naming the input, not an
    IndexError (an internal error)."""
    from trtkv.triton_repo.inputs import parse_request

    with pytest.raises(TrtkvError, match="'max_tokens' must hold one value per request, got shape \\[1, 0\\]"):
        parse_request(_get(text_input="x", max_tokens=np.zeros((1, 0), dtype=np.int32)))
    with pytest.raises(TrtkvError, match="'temperature' must hold one value"):
        parse_request(_get(text_input="x", max_tokens=2, temperature=np.zeros((1, 0), dtype=np.float32)))


def test_end_id_reaches_the_sampling_params():
    """T4 (end_id not copied): the end_id input is the request's end-of-sequence id."""
    from trtkv.triton_repo.inputs import parse_request

    assert parse_request(_get(text_input="x", max_tokens=2, end_id=np.int32(17))).params.end_id == 17
    assert parse_request(_get(text_input="x", max_tokens=2)).params.end_id is None


def test_temperature_zero_is_greedy_not_refused():
    """T6 (``temperature <= 0`` refused): 0 is greedy decoding (the interface's doc), only a negative one is refused."""
    from trtkv.triton_repo.inputs import parse_request

    p = parse_request(_get(text_input="x", max_tokens=2, temperature=np.float32(0.0))).params
    assert p.greedy and p.temperature == 0.0
    with pytest.raises(TrtkvError, match="temperature must be >= 0"):
        parse_request(_get(text_input="x", max_tokens=2, temperature=np.float32(-0.5)))


# ---------------------------------------------------------------- Triton model: the repository


def test_a_rebuilt_engine_rewrites_the_repository(tmp_path):
    """T13 (the reuse stamp without the manifest's mtime): a repository is reused only while its engine is unchanged;
    a rebuilt engine (a newer manifest.json) gets the repository written again."""
    import os

    from trtkv.triton_repo.repository import RepoOptions, write_repository

    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "manifest.json").write_text("{}")
    opts = RepoOptions(instance_kind="cpu")
    repo = write_repository(eng, tmp_path / "repo", opts)
    marker = repo / "ensemble" / "1" / "left-by-the-first-write"
    marker.write_text("x")
    write_repository(eng, repo, opts)
    assert marker.exists()  # nothing changed: reused as it is
    st = (eng / "manifest.json").stat()
    os.utime(eng / "manifest.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the engine was rebuilt
    write_repository(eng, repo, opts)
    assert not marker.exists() and (repo / "ensemble" / "config.pbtxt").is_file()


def test_a_rewrite_replaces_the_old_model_folder_also_with_a_copied_engine(tmp_path):
    """T14 (a rewrite keeps the old ``ensemble`` folder): changed options rewrite the repository from scratch, so a
    copied engine is copied again (not refused as an existing folder) and nothing of the old folder stays."""
    from trtkv.triton_repo.repository import RepoOptions, write_repository

    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "manifest.json").write_text("{}")
    repo = write_repository(eng, tmp_path / "repo", RepoOptions(instance_kind="cpu", copy_engine=True))
    stale = repo / "ensemble" / "stale.txt"
    stale.write_text("x")
    write_repository(eng, repo, RepoOptions(instance_kind="cpu", copy_engine=True, max_batch_size=8))
    assert (repo / "ensemble" / "1" / "engine" / "manifest.json").is_file() and not stale.exists()
    assert "max_batch_size: 8" in (repo / "ensemble" / "config.pbtxt").read_text()


# ---------------------------------------------------------------- OpenAI front (a stand-in Triton: test_openai_front.py)

from test_openai_front import complete, front  # noqa: E402,F401  (the module's fixture: a stand-in Triton + the front)


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("top_p", 0.0), ("n", 0)])
def test_out_of_range_fields_are_refused_by_the_front(front, field, value):  # noqa: F811
    """O1 (max_tokens ge=0), O2 (top_p ge=0), O3 (``n > 1``): OpenAI's ranges are max_tokens >= 1, 0 < top_p <= 1,
    n == 1 here: each is a 400 naming the field, and nothing reaches Triton."""
    code, data, body = complete(front, **{field: value})
    assert code == 400 and data["error"]["param"] == field and body is None


def test_logprobs_false_and_min_tokens_equal_to_max_tokens_are_accepted(front):  # noqa: F811
    """O4 (``logprobs is not None`` refused), O5 (``min_tokens >= max_tokens`` refused): logprobs false (what OpenAI's
    clients send) asks for nothing; min_tokens == max_tokens is the most it may be (ignore_eos sends just that)."""
    code, data, _ = complete(front, logprobs=False)
    assert code == 200 and data["choices"][0]["text"] == "abc"
    code, _, body = complete(front, max_tokens=8, min_tokens=8)
    assert code == 200 and body["min_tokens"] == 8 == body["max_tokens"]
    code, data, _ = complete(front, max_tokens=8, min_tokens=9)
    assert code == 400 and data["error"]["param"] == "min_tokens"


def test_the_engine_is_asked_for_the_new_text_only(front):  # noqa: F811
    """O6 (exclude_input_in_output False): an OpenAI completion is the new text; Triton's generate returns prompt + new
    text unless exclude_input_in_output is set (interface.py), so the front must set it, streaming or not."""
    _, _, body = complete(front)
    assert body["exclude_input_in_output"] is True
    _, triton = front
    _stream_lines(front, {"prompt": "hello", "max_tokens": 8})
    assert triton.bodies[-1]["stream"] is True and triton.bodies[-1]["exclude_input_in_output"] is True


def _stream_lines(fr, body: dict) -> list[str]:
    """POST a streaming /v1/completions; the server-sent lines."""
    import json
    import urllib.request

    from test_openai_front import MODEL

    url, _ = fr
    req = urllib.request.Request(f"{url}/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": MODEL, "stream": True, **body}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        return [ln.decode().strip() for ln in r if ln.strip()]


def test_finish_reason_is_length_when_exactly_max_tokens_came(front):  # noqa: F811
    """O7 (``completion_tokens > max_tokens``): the stand-in returns 3 tokens; with max_tokens 3 the completion ran to
    its limit ("length"), with 8 it stopped early ("stop"); usage counts the 3."""
    code, data, _ = complete(front, max_tokens=3)
    assert code == 200 and data["choices"][0]["finish_reason"] == "length" and data["usage"]["completion_tokens"] == 3
    code, data, _ = complete(front, max_tokens=8)
    assert code == 200 and data["choices"][0]["finish_reason"] == "stop"


def test_prompt_plus_max_tokens_equal_to_the_context_fits(front, tokenizer):  # noqa: F811
    """O8 (``>=`` the context refused): the stand-in serves a 128-token context; a prompt of n tokens may ask for
    128 - n new tokens, not one more."""
    n = len(tokenizer("hello")["input_ids"])
    code, _, body = complete(front, max_tokens=128 - n)
    assert code == 200 and body["max_tokens"] == 128 - n
    code, data, body = complete(front, max_tokens=129 - n)
    assert code == 400 and data["error"]["code"] == "context_length_exceeded" and body is None


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_front():
    """The front over the stand-in Triton with a tokenizer that has a chat template (it prints each role)."""
    from conftest import build_tiny_tokenizer
    from test_openai_front import MODEL, FakeTriton

    from trtkv.triton_repo.openai_api import Served, start_openai_server
    from trtkv.triton_repo.server import free_port

    tok = build_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    triton = FakeTriton()
    port = free_port()
    server = start_openai_server(Served(MODEL, tok, 128, f"http://127.0.0.1:{triton.port}"), "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}/v1", triton
    finally:
        server.should_exit = True
        triton.stop()


def _chat(chat_front, **kw):
    from test_openai_front import MODEL, post

    url, triton = chat_front
    before = len(triton.bodies)
    code, data = post(f"{url}/chat/completions", {"model": MODEL, **kw})
    return code, data, triton.bodies[-1] if len(triton.bodies) > before else None


def test_the_developer_role_is_rendered_as_system(chat_front):
    """O9 (the role passed as it is): OpenAI's "developer" messages are the system prompt for a chat template."""
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    code, data, body = _chat(chat_front, messages=msgs, max_tokens=4)
    assert code == 200 and data["choices"][0]["message"]["content"] == "abc"
    assert body["text_input"] == "<|system|>Be brief.\n<|user|>hi\n<|assistant|>"


def test_max_completion_tokens_wins_over_max_tokens(chat_front):
    """O10 (max_tokens first): max_completion_tokens is the chat endpoint's current name and takes precedence over
    the deprecated max_tokens when both are sent."""
    msgs = [{"role": "user", "content": "hi"}]
    _, _, body = _chat(chat_front, messages=msgs, max_completion_tokens=5, max_tokens=9)
    assert body["max_tokens"] == 5
    _, _, body = _chat(chat_front, messages=msgs, max_tokens=9)
    assert body["max_tokens"] == 9


def test_an_empty_prompt_list_is_a_400_naming_the_prompt(front):  # noqa: F811
    """O11 (``len(prompt) > 1``): a list prompt must hold exactly one prompt; [] is a bad request, not a server fault."""
    for prompts in ([], ["a", "b"]):
        code, data, body = complete(front, prompt=prompts)
        assert code == 400 and data["error"]["param"] == "prompt" and body is None


def test_a_field_out_of_its_range_is_400_and_an_unknown_model_404(front):  # noqa: F811
    """O12 (validation errors 422, FastAPI's default), O13 (unknown model 400): OpenAI answers a field out of range with
    400 naming it and an unknown model with 404 model_not_found."""
    code, data, body = complete(front, temperature=-1)
    assert code == 400 and data["error"]["param"] == "temperature" and body is None
    code, data, body = complete(front, model="gpt-4")
    assert code == 404 and data["error"]["code"] == "model_not_found" and data["error"]["param"] == "model" and body is None


def test_streamed_chunks_carry_usage_null_until_the_usage_chunk(front):  # noqa: F811
    """O15 (no ``usage: null``): with stream_options.include_usage every chunk has "usage": null and one last chunk,
    with no choices, carries the counts (OpenAI's stream format); the stand-in streams 2 + 1 tokens."""
    import json

    lines = _stream_lines(front, {"prompt": "hello", "max_tokens": 8, "stream_options": {"include_usage": True}})
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[5:]) for ln in lines[:-1]]
    *chunks, last = events
    assert chunks and all("usage" in c and c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc" and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------- calibration budget


@pytest.fixture(scope="module")
def candidates():
    from trtkv.formats import fit_formats

    fmts, _ = fit_formats(["int4", "int3", "int2"], 32)
    return [f.with_block_size(16) for f in fmts]


def test_a_zero_budget_is_refused():
    """B3 (``limit < 0``): a budget is a positive KL or Δppl; 0 allows nothing and is an invalid budget."""
    from trtkv.calibration.budget import Budget

    for bad in ("kl=0", "ppl=0%", "kl=-0.0"):
        with pytest.raises(TrtkvError, match="invalid accuracy budget"):
            Budget.parse(bad)
    assert Budget.parse("kl=1e-9").limit == 1e-9


def test_candidates_need_two_formats_that_seal_alike():
    """B6 (one candidate accepted), B7 (sink tokens not compared): a search chooses between at least two candidates,
    and all of them seal blocks alike: the same block size *and* sink tokens."""
    from trtkv.calibration.budget import check_candidates

    a = get_format("k=int4:token:sym,v=int4:token:sym,block=16,sink=4")
    b = get_format("k=int3:token:sym,v=int3:token:sym,block=16,sink=4")
    assert [c.name for c in check_candidates([b, a])] == [a.name, b.name]  # widest first
    with pytest.raises(TrtkvError, match="at least two"):
        check_candidates([a])
    b2 = get_format("k=int3:token:sym,v=int3:token:sym,block=16,sink=2")
    with pytest.raises(TrtkvError, match="seal blocks differently"):
        check_candidates([a, b2])


def test_a_start_exactly_at_the_target_fits(candidates):
    """B8 (``start.kl >= target`` refused): the widest candidate must cost at most the target; exactly the target fits
    (0.25 is exact in binary). Every narrowing measuring free, the search ends at the narrowest everywhere."""
    from trtkv.calibration.budget import Budget, Score, choose_layer_bits

    choice = choose_layer_bits(lambda f, p: Score(0.25, 1.0), candidates, {}, Budget("kl", 0.25, margin=0), num_layers=2, head_dim=32)
    assert choice.start.kl == 0.25 and all(lv == {"k": 2, "v": 2} for lv in choice.levels)


def test_the_check_keeps_a_prefix_that_measures_exactly_the_target(candidates):
    """B10 (bisection ``got.kl < target``): the search predicts every step free; the check's windows measure 0.25 per
    step up to 2 steps and far more beyond: the longest prefix within the target 0.5 is 2 steps (0.5 exactly)."""
    from trtkv.calibration.budget import Budget, Score, choose_layer_bits

    def check(fmt, params):
        steps = sum([c.k for c in candidates].index(fmt.layer(i).k) + [c.v for c in candidates].index(fmt.layer(i).v)
                    for i in range(fmt.num_layers))
        return Score(0.25 * steps if steps <= 2 else 10.0, 0.0)

    choice = choose_layer_bits(lambda f, p: Score(0.0, 0.0), candidates, {}, Budget("kl", 0.5, margin=0), num_layers=2, head_dim=32,
                               check=check)
    assert sum(lv["k"] + lv["v"] for lv in choice.levels) == 2 and choice.measured.kl == 0.5


def test_each_layer_and_side_gets_its_own_candidates_constants(candidates):
    """B12 (layer 0's constants everywhere), B13 (V's constants from K's candidate): the constants of layer i, side s
    come from layer i of the candidate that (i, s) took. Candidate c's layer i has K scale 10c + i, V scale 100 + 10c + i."""
    from trtkv.artifacts import LayerParams
    from trtkv.calibration.budget import per_layer_params
    from trtkv.quant import TensorParams

    def consts(c):
        return [LayerParams(k=TensorParams(scale=torch.tensor(10.0 * c + i)), v=TensorParams(scale=torch.tensor(100.0 + 10 * c + i)))
                for i in range(3)]

    params = {f.name: consts(c) for c, f in enumerate(candidates)}
    levels = [{"k": 0, "v": 2}, {"k": 1, "v": 0}, {"k": 2, "v": 1}]
    got = per_layer_params(candidates, params, levels)
    assert [float(lp.k.scale) for lp in got] == [0.0, 11.0, 22.0]
    assert [float(lp.v.scale) for lp in got] == [120.0, 101.0, 112.0]
    assert got[0].k.scale is not params[candidates[0].name][0].k.scale  # a copy: the artifact stores each format apart


def test_the_report_table_names_each_sides_choice(candidates):
    """B15 (K's choice in the V column): the report's row of layer i names the candidate its K took, then its V's."""
    from trtkv.calibration.budget import Budget, BudgetChoice, Score, per_layer_format, render_choice

    levels = [{"k": 0, "v": 2}, {"k": 1, "v": 0}]
    names = [c.name for c in candidates]
    zero = [[0.0, 0.1, 0.2], [0.0, 0.3, 0.4]]
    choice = BudgetChoice(Budget("kl", 0.01), names, per_layer_format("budget", candidates, levels), [], levels, Score(0.001, 0.1),
                          0.002, Score(0.002, 0.2), 4.5, {"k": zero, "v": zero}, 9)
    rows = [ln for ln in render_choice(choice, 32).splitlines() if ln.startswith(("| 0 |", "| 1 |"))]
    assert rows[0].startswith(f"| 0 | {names[0]} | {names[2]} |") and rows[1].startswith(f"| 1 | {names[1]} | {names[0]} |")


# ---------------------------------------------------------------- formats


def test_fit_format_may_take_the_whole_head_dim_as_the_group():
    """F13 (divisors below ``min(g, head_dim)`` only): a group size that does not divide head_dim becomes the largest
    divisor of head_dim up to it -- head_dim itself when the group is larger (g64 -> g32 at 32, g80 -> g48 at 48)."""
    from trtkv.formats import fit_format

    for g, d in ((64, 32), (80, 48)):
        fmt, note = fit_format(get_format(f"k=int4:g{g}:sym,v=int8:g{g}:sym"), d)
        assert (fmt.k.group_size, fmt.v.group_size) == (d, d) and f"K g{g}->g{d}" in note and f"V g{g}->g{d}" in note
    fmt, note = fit_format(get_format("k=int4:g64:sym,v=int4:g64:sym"), 96)  # 64 does not divide 96: 48 does
    assert fmt.k.group_size == 48


def test_a_per_layer_formats_k_and_v_must_be_its_layer_0s():
    """F14 (only k compared): a per-layer format's k / v are layer 0's; a spec whose v differs is refused."""
    ok = get_format("k=int4:token:sym,v=int8:token,layers=int4:token:sym/int8:token|int8:token/int8:token")
    assert ok.layer(0).v == ok.v and ok.num_layers == 2
    for spec in ("k=int4:token:sym,v=int4:token:sym,layers=int4:token:sym/int8:token|int8:token/int8:token",
                 "k=int8:token,v=int8:token,layers=int4:token:sym/int8:token|int8:token/int8:token"):
        with pytest.raises(TrtkvError, match="must be its layer 0's"):
            get_format(spec)
