"""Per-layer KV storage (``KVFormat.layers``) and the accuracy budget that chooses it (calibration/budget.py).

* the format: spec round trip, byte counts = the sum of its layers' (a naive loop), refusals;
* the paged cache keeps one pool group per distinct storage; the torch engine over it gives the eval cache's logits
  for the same per-layer format (an independent path), and not a uniform format's;
* the search: on a synthetic separable cost it finds the fewest bits a brute force finds; a non-additive cost makes
  it undo steps until the measured cost fits; a budget below the widest candidate is refused;
* end to end on a tiny model: calibrate --budget -> the recipe's format -> eval on held-out windows within the
  budget -> build-engine --backend torch -> generate; the ONNX backend refuses it.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from trtkv.cache_layout import PagedKVLayout
from trtkv.calibration.budget import Budget, Score, choose_layer_bits, per_layer_format
from trtkv.errors import TrtkvError
from trtkv.formats import CALIBRATION_FREE, KVFormat, fit_formats, get_format

HEAD_DIM = 32
# candidates that need no calibration and seal blocks of 64 alike: the budget machinery's tests (the int3 / int2 presets
# need calibrated bits and codebooks and seal 128: test_calibrate_searches_the_int4_int3_int2_presets_at_one_block)
PLAIN = ["int4", CALIBRATION_FREE["int3"], CALIBRATION_FREE["int2"]]


@pytest.fixture(scope="module")
def presets():
    fmts, _ = fit_formats(PLAIN, HEAD_DIM)
    return [f.with_block_size(16) for f in fmts]


def _mixed(presets, picks):
    """Per-layer format: layer i takes K from presets[picks[i][0]] and V from presets[picks[i][1]]."""
    return per_layer_format("mix", presets, [{"k": k, "v": v} for k, v in picks])


def test_per_layer_format_round_trips_and_sums_its_layers(presets):
    picks = [(0, 2), (1, 1), (2, 0), (0, 0), (2, 2)]
    f = _mixed(presets, picks)
    assert get_format(f.spec()).layers == f.layers and f.num_layers == 5
    assert get_format(f.spec()).name.endswith(",sink=4,layers=<5 layers>")  # a name people can read
    assert [f.layer(i).k for i in range(5)] == [presets[k].k for k, _ in picks]
    assert [f.layer(i).v for i in range(5)] == [presets[v].v for _, v in picks]
    naive = sum((presets[k].k.bits_per_element(HEAD_DIM, 16) + presets[v].v.bits_per_element(HEAD_DIM, 16)) / 2 for k, v in picks) / 5
    assert f.pool_bits_per_element(HEAD_DIM) == pytest.approx(naive)
    lay = PagedKVLayout(f, 2, HEAD_DIM, 16, 1, 1)
    assert lay.block_bytes(range(5)) == sum(PagedKVLayout(f.layer(i), 2, HEAD_DIM, 16, 1, 1).bytes_per_block() for i in range(5))
    assert f.kv_bytes_per_token(5, 2, HEAD_DIM) == pytest.approx(lay.block_bytes(range(5)) / 16)
    with pytest.raises(ValueError, match="use layout.layer"):
        lay.tensor_format("k")
    with pytest.raises(TrtkvError, match="storage for 5 layers but the model has 4") as e:
        f.check_layers(4)
    assert "--budget" in e.value.fix
    from trtkv.plan import GIB, ModelShape, plan

    _, [row] = plan(ModelShape("m", 5, 2, HEAD_DIM), [f], context_len=128, gpu_bytes=GIB)
    assert row.pool_bits_per_element == pytest.approx(naive)
    with pytest.raises(TrtkvError, match="storage for 5 layers but the model has 4"):
        plan(ModelShape("m", 4, 2, HEAD_DIM), [f], context_len=128, gpu_bytes=GIB)
    with pytest.raises(TrtkvError, match="k / v must be its layer 0's"):
        get_format(f.spec().replace(f"k={presets[0].k.short()}", f"k={presets[1].k.short()}", 1))


def test_each_layer_of_a_per_layer_format_keeps_its_sink_tokens(presets):
    """``KVFormat.layer(i)`` is layer i's storage with the whole format's blocks and sink rows (an eval cache, a layout,
    the torch engine read its sinks from it)."""
    f = _mixed(presets, [(0, 2), (1, 1), (2, 0)])
    assert f.sink_tokens == 4 and f.block_size == 16
    for i, lay in enumerate(f.layer_formats()):
        assert (lay.sink_tokens, lay.block_size, lay.tail_rows) == (4, 16, 20), i
        assert PagedKVLayout(lay, 2, HEAD_DIM, 16, 3, 1).tail_shape() == PagedKVLayout(presets[0], 2, HEAD_DIM, 16, 3, 1).tail_shape()
    assert PagedKVLayout(f, 2, HEAD_DIM, 16, 3, 1).layer(1).sink_tokens == 4


def test_paged_cache_and_torch_engine_follow_each_layers_storage(tiny_models, presets):
    from trtkv.evaluate import model_logits
    from trtkv.models import load_model
    from trtkv.runtime.kv_pool import PagedKVCache
    from trtkv.runtime.torch_engine import TorchEngine
    from trtkv.runtime.verify import StaticBatch

    d, _ = tiny_models("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, num_hidden_layers=3)
    f = _mixed(presets, [(0, 2), (1, 1), (0, 2)])
    cache = PagedKVCache(PagedKVLayout(f, 2, HEAD_DIM, 16, 12, 1), 3)
    # one pool group per distinct storage: layers 0 and 2 share one, layer 1 has its own
    assert cache.tensors["k_data@g0"].shape[0] == 2 and cache.tensors["k_data@g1"].shape[0] == 1
    assert cache.tensors["k_data@g1"].shape[-1] == cache.layout_of(1).packed_dim("k") != cache.layout_of(0).packed_dim("k")
    model = load_model(str(d), device="cpu", dtype="float32").model
    sb = StaticBatch(cache, 1)
    ids = torch.randint(0, 300, (1, 53), generator=torch.Generator().manual_seed(0))
    engine = TorchEngine(model, attention="torch", device="cpu")
    got = torch.stack([sb.step(engine, {0: [int(t)]}) for t in ids[0]], 1)
    fresh = load_model(str(d), device="cpu", dtype="float32").model
    # decode steps vs the eval cache's block prefill: last-bit differences in the rows flip a few int2 / int3 codes
    # (measured 1.7e-3); a uniform format instead of the per-layer one is off by ~0.1
    assert (got - model_logits(fresh, ids, f)).abs().max().item() < 5e-3
    for uniform in presets[:2]:  # the per-layer storage really applies
        assert (got - model_logits(fresh, ids, uniform)).abs().max().item() > 3e-2


BITS = {"k": [4.5, 3.5, 2.5], "v": [4.5, 3.5, 2.5]}  # the presets' pool bits at head_dim 64


def _synthetic(presets, weights, interaction=0.0):
    """A cost per (layer, side) narrowing, convex in the level (0, w, 3w), summed; ``interaction`` adds a penalty
    for every pair of narrowed (layer, side)s, which the additive prediction does not see."""

    def score(fmt: KVFormat, params):
        score.calls += 1
        total, narrowed = 0.0, 0
        for i in range(fmt.num_layers):
            lay = fmt.layer(i)
            for s, w in zip("kv", weights[i]):
                lev = [getattr(p, s) for p in presets].index(getattr(lay, s))
                total += (0.0, w, 3 * w)[lev]
                narrowed += lev > 0
        total += interaction * narrowed * (narrowed - 1) / 2
        return Score(total, 100 * total)

    score.calls = 0
    return score


def test_budget_search_finds_the_fewest_bits_of_a_brute_force(presets):
    weights = [(0.004, 0.001), (0.0005, 0.002), (0.003, 0.0002)]
    score = _synthetic(presets, weights)
    for limit in (0.001, 0.004, 0.012, 0.03):
        choice = choose_layer_bits(score, presets, {}, Budget("kl", limit, margin=0), num_layers=3, head_dim=64)
        assert choice.measured.kl <= limit and choice.predicted == pytest.approx(choice.measured.kl)
        best = min(sum(BITS["k"][a] + BITS["v"][b] for a, b in zip(lv[::2], lv[1::2]))
                   for lv in itertools.product(range(3), repeat=6)
                   if sum((0, w, 3 * w)[x] for x, w in zip(lv, [w for pair in weights for w in pair])) <= limit + 1e-12)
        got = sum(BITS["k"][lv["k"]] + BITS["v"][lv["v"]] for lv in choice.levels)
        assert got == pytest.approx(best), limit
    assert choice.sensitivity["k"][0] == pytest.approx([0.0, 0.004, 0.012])


def test_budget_search_undoes_steps_until_the_measured_cost_fits(presets):
    weights = [(0.001, 0.001)] * 4
    search = _synthetic(presets, weights)  # the search's windows: additive
    score = _synthetic(presets, weights, interaction=0.0004)  # the check's windows: the additive prediction underestimates
    choice = choose_layer_bits(search, presets, {}, Budget("kl", 0.006, margin=0), num_layers=4, head_dim=64, check=score)
    assert choice.measured.kl <= 0.006 < 0.0004 * 28  # the interactions of all steps the prediction allowed would not fit
    assert choice.measured.kl > choice.predicted  # it was measured, not predicted
    assert search.calls == 1 + 4 * 2 * 2 and score.calls >= 2  # the check measured the choice, then at least one undo
    assert choice.scored == search.calls + score.calls
    # the longest prefix of the greedy's 6 steps that fits: n steps measure 0.001 n + 0.0004 n (n - 1) / 2, so 3 (0.0042)
    assert sum(lv["k"] + lv["v"] for lv in choice.levels) == 3 and choice.measured.kl == pytest.approx(0.0042)
    assert choice.predicted == pytest.approx(0.003)  # the kept steps' additive prediction


def test_budget_check_falls_back_to_the_start_when_no_step_fits(presets):
    weights = [(0.001, 0.001)] * 4
    search = _synthetic(presets, weights)
    score = _synthetic(presets, weights, interaction=0.0)

    def harsh(fmt, params):  # the check's windows: any narrowing costs more than the whole target
        got = score(fmt, params)
        return Score(got.kl + (0.1 if got.kl > 0 else 0.0), got.ppl_delta_pct)

    choice = choose_layer_bits(search, presets, {}, Budget("kl", 0.006, margin=0), num_layers=4, head_dim=64, check=harsh)
    assert all(lv == {"k": 0, "v": 0} for lv in choice.levels)  # the start, measured on the check's windows
    assert choice.measured.kl == 0.0 and choice.predicted == 0.0


def _table(presets, table, base=0.001):
    """A cost given per (layer, side, level) (``table[layer][side][level]``, level 0 = costs nothing), summed over the
    layers and sides, plus ``base`` (the start's cost)."""

    def score(fmt: KVFormat, params):
        score.calls += 1
        total = base
        for i in range(fmt.num_layers):
            lay = fmt.layer(i)
            for s in "kv":
                total += table[i][s][[getattr(p, s) for p in presets].index(getattr(lay, s))]
        return Score(total, 100 * total)

    score.calls = 0
    return score


def test_budget_counts_a_narrowing_that_measured_cheaper_as_free(presets):
    """A step whose measured cost is below the previous level's (noise of the windows) is predicted at 0, never less:
    the next step of that (layer, side) is then predicted from the cheaper level, so it does not fit (hand-computed:
    the clamped greedy takes K 0->1 (0), V 0->1 (0.002); K 1->2 predicts 0.004 more, over 0.0055)."""
    table = [{"k": [0.0, -0.003, 0.001], "v": [0.0, 0.002, 0.006]}]
    choice = choose_layer_bits(_table(presets, table), presets, {}, Budget("kl", 0.0055, margin=0), num_layers=1, head_dim=64)
    assert choice.levels == [{"k": 1, "v": 1}]
    assert choice.predicted == pytest.approx(0.001 + 0.0 + 0.002) and choice.predicted >= choice.start.kl


def test_budget_ranks_steps_by_cost_per_bit_saved(presets):
    """int8 -> int4 saves 3 bits of K (9 -> 6 at head_dim 64, blocks of 16), int4 -> int3 one: layer 0's first step
    (0.002 for 3 bits) beats layer 1's second (0.001 for 1 bit), and only one of them fits (start 0.001, budget
    0.0035) after layer 1's free first step. Ranked by cost alone, layer 1's second step would be taken instead (one bit saved instead of three)."""
    int8 = get_format(fit_formats(["int8"], HEAD_DIM)[0][0].with_block_size(16).spec() + ",sink=4")  # the presets' sinks
    cands = [int8, presets[0], presets[1]]
    assert [c.k.bits_per_element(64, 16) for c in cands] == [9.0, 6.0, 5.0]
    big = {"v": [0.0, 1.0, 2.0]}
    table = [{"k": [0.0, 0.002, 1.0], **big}, {"k": [0.0, 0.0, 0.001], **big}]
    choice = choose_layer_bits(_table(cands, table), cands, {}, Budget("kl", 0.0035, margin=0), num_layers=2, head_dim=64)
    assert [lv["k"] for lv in choice.levels] == [1, 1] and all(lv["v"] == 0 for lv in choice.levels)
    assert choice.measured.kl == pytest.approx(0.001 + 0.002)


def test_budget_greedy_keeps_a_running_total_and_skips_a_step_that_does_not_fit(presets):
    """The greedy adds each step to the running prediction: after steps W (layer 1 K 0->1, free) and X (layer 0 K 0->1,
    0.002) the next by cost per bit (layer 0 V, 0.004) does not fit in 0.004 but the one after it (layer 1 K 1->2,
    0.0015 for one bit) does. Steps judged each alone would all be taken, measure 0.0075 and be cut back to W, X."""
    int8 = get_format(fit_formats(["int8"], HEAD_DIM)[0][0].with_block_size(16).spec() + ",sink=4")  # the presets' sinks
    cands = [int8, presets[0], presets[1]]
    table = [{"k": [0.0, 0.002, 1.0], "v": [0.0, 0.004, 1.0]}, {"k": [0.0, 0.0, 0.0015], "v": [0.0, 1.0, 2.0]}]
    score = _table(cands, table, base=0.0)
    choice = choose_layer_bits(score, cands, {}, Budget("kl", 0.004, margin=0), num_layers=2, head_dim=64)
    assert choice.levels == [{"k": 1, "v": 0}, {"k": 2, "v": 0}]
    assert choice.predicted == pytest.approx(0.0035) == choice.measured.kl
    assert score.calls == 1 + 2 * 2 * 2 + 1  # start, sensitivities, one check: the additive prediction needs no cut


def test_budget_refusals(presets):
    with pytest.raises(TrtkvError, match="below what int4@block16 costs in every layer"):
        choose_layer_bits(lambda f, p: Score(0.01, 1.0), presets, {}, Budget("kl", 0.001), num_layers=1, head_dim=64)
    with pytest.raises(TrtkvError, match="lower --budget-margin"):  # within the budget, not within its margin
        choose_layer_bits(lambda f, p: Score(0.009, 0.9), presets, {}, Budget("kl", 0.01, margin=0.25), num_layers=1, head_dim=64)
    with pytest.raises(TrtkvError, match="seal blocks differently"):
        choose_layer_bits(lambda f, p: Score(0, 0), [presets[0], get_format("int3")], {}, Budget("kl", 1), num_layers=1, head_dim=64)
    for bad in ("kl", "kl=-1", "ppl=abc", "loss=1", "kl=nan"):
        with pytest.raises(TrtkvError, match="invalid accuracy budget"):
            Budget.parse(bad)
    for margin in (-0.1, 1.0, 2):
        with pytest.raises(TrtkvError, match="invalid budget margin"):
            Budget.parse("kl=0.01", margin)
    assert Budget.parse("ppl=1.5%") == Budget("ppl", 1.5) and str(Budget.parse("kl=0.01")) == "kl=0.01"


def test_budget_searches_mean_kl_below_the_budget_by_its_margin(presets):
    """A Δppl budget of p % is searched as KL <= ln(1 + p/100), less the margin; the windows' Δppl, which one narrowing
    moves by noise in either direction, does not steer the search."""
    assert Budget("kl", 0.01, 0.25).kl_target == pytest.approx(0.0075)
    assert Budget("ppl", 1.0, 0.0).kl_target == pytest.approx(math.log(1.01))
    assert Budget("ppl", 2.0, 0.5).kl_target == pytest.approx(0.5 * math.log(1.02))
    weights = [(0.002, 0.001), (0.001, 0.003), (0.0015, 0.0005)]
    kl_score = _synthetic(presets, weights)

    def noisy(fmt, params):  # the same KL, a Δppl that reads every narrowing as a gain
        got = kl_score(fmt, params)
        return Score(got.kl, -100 * got.kl)

    for budget in (Budget("ppl", 1.0, 0.25), Budget("kl", 0.01, 0.25), Budget("kl", 0.01, 0.0)):
        choice = choose_layer_bits(noisy, presets, {}, budget, num_layers=3, head_dim=64)
        same = choose_layer_bits(_synthetic(presets, weights), presets, {}, Budget("kl", budget.kl_target, margin=0), num_layers=3, head_dim=64)
        assert choice.levels == same.levels and choice.measured.kl <= budget.kl_target
    tight, loose = (choose_layer_bits(kl_score, presets, {}, Budget("kl", 0.01, m), num_layers=3, head_dim=64) for m in (0.5, 0.0))
    assert tight.fmt.pool_bits_per_element(64) > loose.fmt.pool_bits_per_element(64)  # the margin costs bits
    assert choose_layer_bits(kl_score, presets, {}, Budget("kl", 0.01, 0.25), num_layers=3, head_dim=64).recipe_fields()["kl_target"] == pytest.approx(0.0075)


@pytest.mark.slow
def test_calibrate_budget_eval_build_and_generate(tiny_models, tmp_path):
    from trtkv.artifacts import load_calibration
    from trtkv.builder.build import build_engine
    from trtkv.calibration.run import run_calibration
    from trtkv.evaluate import run_eval
    from trtkv.runtime.llm_engine import LLMEngine, RuntimeConfig
    from trtkv.runtime.sequence import SamplingParams

    d, _ = tiny_models("llama", with_tokenizer=True, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                       num_hidden_layers=3)
    budget = 0.003
    art = run_calibration(str(d), "builtin:pydoc", tmp_path / "cal", formats=["int8"], samples=2, seq_len=128, device="cpu", dtype="float32",
                          progress=False, budget=f"kl={budget}", budget_formats=PLAIN, budget_windows=2)
    cal = load_calibration(art)
    entry = cal.recipe.formats["budget"]
    fmt = entry.definition
    assert fmt.is_per_layer and fmt.num_layers == 3 and entry.method == "budget"
    extra = entry.model_extra
    assert extra["measured"]["kl"] <= budget and len(extra["choice"]) == 3 and extra["formats_measured"] >= 1 + 3 * 2 * 2
    assert "## Accuracy budget `kl=0.003`" in (art / "report.md").read_text()
    res = {r.format: r for r in run_eval(str(d), "builtin:pydoc", ["int4", "budget"], calibration=art, windows=2, seq_len=128, device="cpu",
                                         dtype="float32", generate_prompts=0, progress=False)}
    assert res["budget"].pool_bits_per_element < res["int4"].pool_bits_per_element
    assert math.isfinite(res["budget"].kld_mean) and res["budget"].kld_mean <= 2 * budget  # held-out windows (KL on 2 x 127 positions)
    with pytest.raises(TrtkvError, match="only the torch engine reads") as e:
        build_engine(str(d), art, "budget", tmp_path / "ort", backend="onnxruntime", block_size=64, max_batch=2, max_seq_len=128)
    assert "--backend torch" in e.value.fix
    eng = build_engine(str(d), art, "budget", tmp_path / "eng", backend="torch", block_size=64, max_batch=2, max_seq_len=256)
    llm = LLMEngine.from_engine_dir(eng, RuntimeConfig(kv_memory_gib=0.01, max_seqs=2))
    assert llm.manifest.kv_format.layers == fmt.layers
    assert llm.budget.bytes_per_block == llm.cache.layout.block_bytes(range(3)) == llm.manifest.bytes_per_block
    out = llm.generate(["def fib(n):"], SamplingParams(max_tokens=70, temperature=0, ignore_eos=True))  # seals a block past 64 tokens
    assert len(out[0].new_token_ids) == 70


def test_calibrate_with_a_bits_budget_saves_the_mix_within_those_bits(tiny_models, tmp_path):
    """``--budget bits=B`` end to end: the saved per-layer format is within B pool bits and narrower than the start, the
    recipe keeps no KL target (the bits are the bound) and the report says what was searched."""
    from trtkv.artifacts import load_calibration
    from trtkv.calibration.run import run_calibration

    d, _ = tiny_models("llama", with_tokenizer=True, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                       num_hidden_layers=3)
    art = run_calibration(str(d), "builtin:pydoc", tmp_path / "cal", formats=["int8"], samples=2, seq_len=128, device="cpu", dtype="float32",
                          progress=False, budget="bits=3.2", budget_formats=PLAIN, budget_windows=2)
    entry = load_calibration(art).recipe.formats["budget"]
    bits = entry.definition.pool_bits_per_element(HEAD_DIM)
    assert 2.5 <= bits <= 3.2 and entry.model_extra["kl_target"] is None and entry.model_extra["budget"] == "bits=3.2"
    assert entry.model_extra["start_bits"] > 3.2 and math.isfinite(entry.model_extra["measured"]["kl"])
    assert "least predicted KL within 3.2 pool bits" in (art / "report.md").read_text()


@pytest.mark.slow
def test_calibrate_weighs_a_token_age_candidate_against_the_mix_and_saves_the_better(tiny_models, tmp_path):
    """A ``recent=`` candidate among ``--budget-formats``: measured whole on the check's windows, its bits counted over the
    calibration windows' length, recorded in the recipe and the report, and saved as ``budget`` exactly when it is the
    better choice under the budget (fewer bits within a KL budget); the saved format loads with its constants."""
    from trtkv.artifacts import load_calibration
    from trtkv.calibration.run import run_calibration
    from trtkv.models import model_info

    d, _ = tiny_models("llama", with_tokenizer=True, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                       num_hidden_layers=2)
    aged = get_format(CALIBRATION_FREE["int2"] + ",recent=1:int4")
    art = run_calibration(str(d), "builtin:pydoc", tmp_path / "cal", formats=["int8"], samples=4, seq_len=256, device="cpu", dtype="float32",
                          progress=False, budget="kl=10", budget_formats=["int4", CALIBRATION_FREE["int2"], aged.spec()], budget_windows=2)
    cal = load_calibration(art)
    entry = cal.recipe.formats["budget"]
    (alt,) = entry.model_extra["token_age"]
    assert alt["bits"] == pytest.approx(aged.sealed_bits_per_element(HEAD_DIM, 256)) and math.isfinite(alt["kl"])
    assert entry.model_extra["context_len"] == 256
    # a loose KL budget: the mix narrows every side to int2 (the fewest bits), which the token-age candidate, int2 plus its ring,
    # cannot beat on bits: the mix is kept, and the candidate reported beside it
    assert entry.model_extra["chosen"] == "per-layer" and not entry.definition.token_aged
    assert entry.definition.pool_bits_per_element(HEAD_DIM) < alt["bits"]
    assert f"token-age candidate `{CALIBRATION_FREE['int2']},recent=1:" in (art / "report.md").read_text()
    # against int4 / int3 at 512 tokens, the candidate (int2 + a ring of 64 rows: 3.31 bits) has fewer bits than any mix
    # (int3 everywhere: 3.5) and is within the loose budget: it is saved as `budget`, and loads with its constants
    fmts = ["int4", CALIBRATION_FREE["int3"], aged.spec()]
    won = load_calibration(run_calibration(str(d), "builtin:pydoc", tmp_path / "won", formats=["int8"], samples=4, seq_len=512, device="cpu",
                                           dtype="float32", progress=False, budget="kl=10", budget_formats=fmts, budget_windows=2))
    got = won.recipe.formats["budget"]
    (alt,) = got.model_extra["token_age"]
    assert alt["bits"] == pytest.approx(aged.sealed_bits_per_element(HEAD_DIM, 512)) and alt["bits"] < got.model_extra["mix_measured"]["bits"]
    assert got.model_extra["chosen"] != "per-layer" and got.definition.token_aged and got.definition.recent_blocks == 1
    assert got.model_extra["measured"]["kl"] == alt["kl"] and got.definition.spec().startswith(CALIBRATION_FREE["int2"] + ",recent=1:")
    assert len(won.params_for("budget", model_info(str(d)))) == 2


@pytest.mark.slow
def test_calibrate_searches_the_int4_int3_int2_presets_at_one_block(tiny_models, tmp_path):
    """The default ``--budget-formats`` (int4, int3, int2) seal blocks of 64 / 128 / 128: the search brings int4 to the
    others' 128 (``int4@block128``, with a note), calibrates every candidate beside the asked format, and the saved mix
    stores every side as one of them within the bits asked for, each side's constants (per-channel bits, codebooks)
    going along."""
    from trtkv.artifacts import load_calibration
    from trtkv.calibration import DEFAULT_BUDGET_FORMATS
    from trtkv.calibration.run import run_calibration
    from trtkv.formats import PRESETS

    d, _ = tiny_models("llama", with_tokenizer=True, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                       num_hidden_layers=2)
    assert DEFAULT_BUDGET_FORMATS == ("int4", "int3", "int2")
    art = run_calibration(str(d), "builtin:pydoc", tmp_path / "cal", formats=["int8"], samples=2, seq_len=288, device="cpu", dtype="float32",
                          progress=False, budget="bits=3.0", budget_windows=1)
    loaded = load_calibration(art)
    recipe = loaded.recipe
    extra = recipe.formats["budget"].model_extra
    assert extra["candidates"] == ["int4@block128", "int3", "int2"]  # widest first
    members = [recipe.formats[n].definition for n in extra["candidates"]]  # every candidate calibrated beside the asked format
    assert {(f.block_size, f.sink_tokens) for f in members} == {(128, 4)} and members[0].k == PRESETS["int4"].k
    mix = recipe.formats["budget"].definition
    assert mix.pool_bits_per_element(HEAD_DIM) <= 3.0 and mix.block_size == 128
    for layer in mix.layers:
        assert any(layer.k == f.k for f in members) and any(layer.v == f.v for f in members)
    from trtkv.models import model_info
    from trtkv.quant import widths_of

    for layer, lp in zip(mix.layers, loaded.params_for("budget", model_info(str(d)))):  # each side's constants go along
        for tf, p in ((layer.k, lp.k), (layer.v, lp.v)):
            assert (widths_of(tf, p) is not None) == (tf.allocated_bits is not None)  # a one-line error when missing


def test_budget_candidates_are_brought_to_one_block_and_sink_and_retired_sets_are_refused(tiny_models, tmp_path):
    """``align_candidates``: the largest block size and the most sink tokens among the candidates, each changed
    candidate renamed and noted; candidates that already agree are left as they are. A retired set name (``alloc``,
    ``nuq``) is a one-line error naming the presets that replace it, before the model loads."""
    from trtkv.calibration.budget import align_candidates
    from trtkv.calibration.run import run_calibration
    from trtkv.formats import PRESETS

    got, notes = align_candidates([PRESETS["int4"], PRESETS["int3"], PRESETS["int2"]])
    assert [f.name for f in got] == ["int4@block128", "int3", "int2"] and got[1] is PRESETS["int3"]
    assert (got[0].block_size, got[0].sink_tokens, got[0].k, got[0].v) == (128, 4, PRESETS["int4"].k, PRESETS["int4"].v)
    assert len(notes) == 1 and "int4 searched as int4@block128" in notes[0]
    plain = [get_format(s) for s in PLAIN]
    assert align_candidates(plain) == (plain, [])
    mixed, notes = align_candidates([PRESETS["int8"], plain[0]])  # int8: blocks of 64, no sink tokens
    assert (mixed[0].name, mixed[0].block_size, mixed[0].sink_tokens) == ("int8@sink4", 64, 4) and mixed[1] is plain[0]
    d, _ = tiny_models("llama", with_tokenizer=True, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM)
    for name in ("alloc", "nuq"):
        with pytest.raises(TrtkvError, match=f"'{name}' was retired") as e:
            run_calibration(str(d), "builtin:pydoc", tmp_path / name, budget="bits=3", budget_formats=[name], progress=False)
        assert "'int4,int3,int2'" in e.value.fix and "\n" not in str(e.value) and not (tmp_path / name).exists()
