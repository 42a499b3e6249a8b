"""The accuracy-budget search (calibration/budget.py) against references written from its documented rules, on small
random inputs: ``Budget`` parsing and targets; candidate checks; the per-layer format and constants of a choice; the
search (``choose_layer_bits``) against a reimplementation of the documented greedy (cost per bit saved, steps of one
(layer, side) in order, negative step costs counted 0, stop when no step fits the target) and, where that greedy is
provably optimal (equal bit savings, convex costs), against a brute-force enumeration of every assignment; the check
and its bisection against a linear scan for the longest prefix within the target; the Scorer's KL and Δppl against
float64 sums over stand-in logits; the report and the recipe fields.

Scores are synthetic and additive: a (layer, side) at candidate level j costs ``c[layer][side][j]``, so what the search
measures and what the best choice is are known without a model.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from trtkv.artifacts import LayerParams
from trtkv.calibration import DEFAULT_BUDGET_MARGIN
from trtkv.calibration import budget as B
from trtkv.calibration.budget import Budget, BudgetChoice, Score, check_candidates, choose_layer_bits, per_layer_format, per_layer_params, render_choice
from trtkv.errors import TrtkvError
from trtkv.formats import get_format
from trtkv.quant import TensorParams

HD = 32


def fmt(spec: str):
    return get_format(spec)


# ---------------------------------------------------------------- Budget


@pytest.mark.parametrize("text, metric, limit", [
    ("kl=0.01", "kl", 0.01), ("KL = 0.02", "kl", 0.02), ("kl=1e-9", "kl", 1e-9), ("ppl=1%", "ppl", 1.0), ("ppl=2.5", "ppl", 2.5),
    (" Ppl = 0.5 % ", "ppl", 0.5), ("kl=3", "kl", 3.0),
])
def test_a_budget_parses(text, metric, limit):
    b = Budget.parse(text)
    assert (b.metric, b.limit, b.margin) == (metric, limit, DEFAULT_BUDGET_MARGIN)
    assert Budget.parse(text, margin=0.1).margin == 0.1


@pytest.mark.parametrize("text", ["kl", "kl=", "kl=abc", "kl=0", "kl=-0.5", "ppl=0%", "ppl=-1%", "kl=inf", "kl=nan", "ppl=inf%",
                                  "top1=0.1", "=0.1", "kl:0.1", "ppl=1%%x"])
def test_a_bad_budget_is_refused(text):
    with pytest.raises(TrtkvError, match="invalid accuracy budget") as info:
        Budget.parse(text)
    assert repr(text) in str(info.value) and "kl=" in info.value.fix


def test_the_margin_is_a_fraction_below_one():
    assert 0 < DEFAULT_BUDGET_MARGIN < 1
    for ok in (0.0, 0.5, 0.999):
        assert Budget("kl", 1.0, ok).margin == ok
    for bad in (1.0, 1.5, -0.01):
        with pytest.raises(TrtkvError, match="invalid budget margin"):
            Budget("kl", 1.0, bad)


@pytest.mark.parametrize("metric, limit, margin, target", [
    ("kl", 0.01, 0.0, 0.01), ("kl", 0.01, 0.25, 0.0075), ("kl", 0.3, 0.5, 0.15),
    ("ppl", 1.0, 0.0, math.log(1.01)), ("ppl", 5.0, 0.2, math.log(1.05) * 0.8), ("ppl", 100.0, 0.0, math.log(2.0)),
])
def test_the_target_is_kl_less_the_margin(metric, limit, margin, target):
    assert Budget(metric, limit, margin).kl_target == pytest.approx(target, rel=1e-12)


def test_a_budget_prints_as_it_is_written():
    assert str(Budget("kl", 0.01)) == "kl=0.01" and str(Budget("ppl", 1.5)) == "ppl=1.5%" and str(Budget.parse("ppl=2%")) == "ppl=2%"


# ---------------------------------------------------------------- candidates, the per-layer format and constants


INT = {b: fmt(f"k=int{b}:token:sym,v=int{b}:token:sym") for b in (8, 4, 3, 2)}  # equal savings per step (1 bit, bar 8->4)


def test_candidates_are_ordered_widest_first():
    got = check_candidates([INT[3], INT[8], INT[2], INT[4]])
    assert [c.name for c in got] == [INT[8].name, INT[4].name, INT[3].name, INT[2].name]
    mixed = [fmt("k=int4:g8:sym,v=int8:token"), fmt("k=int8:token,v=int8:token"), fmt("k=int2:token:asym,v=int4:token:sym")]
    bits = [c.pool_bits_per_element(64) for c in mixed]
    assert [c.name for c in check_candidates(mixed)] == [mixed[i].name for i in sorted(range(3), key=lambda i: -bits[i])]


@pytest.mark.parametrize("cands, words", [
    ([], "at least two"),
    (["k=int4:token:sym,v=int4:token:sym"], "at least two"),
    (["k=int8:tensor,v=int8:tensor,shared", "k=int4:token:sym,v=int4:token:sym"], "shared-scale"),
    (["k=int4:token:sym,v=int4:token:sym", "k=int8:token,v=int8:token,layers=int8:token/int8:token"], "per-layer"),
    (["k=int4:token:sym,v=int4:token:sym,block=16", "k=int3:token:sym,v=int3:token:sym,block=32"], "seal blocks differently"),
    (["k=int4:token:sym,v=int4:token:sym,block=16,sink=2", "k=int3:token:sym,v=int3:token:sym,block=16"], "seal blocks differently"),
    (["k=int4:token:sym,v=int4:token:sym", "k=int3:token:sym,v=int3:token:sym,block=16"], "seal blocks differently"),
])
def test_candidates_that_cannot_be_mixed_are_refused(cands, words):
    with pytest.raises(TrtkvError, match=words):
        check_candidates([fmt(c) for c in cands])


def test_the_sealing_mismatch_names_both_candidates():
    a, b = fmt("k=int4:token:sym,v=int4:token:sym,block=16,sink=2"), fmt("k=int3:token:sym,v=int3:token:sym,block=16,sink=3")
    with pytest.raises(TrtkvError) as info:
        check_candidates([a, b])
    assert f"{a.name} (block 16, sink 2)" in str(info.value) and f"{b.name} (block 16, sink 3)" in str(info.value)


def test_the_per_layer_format_takes_each_sides_storage_from_its_candidate():
    cands = [fmt("k=int4:bchannel:asym,v=int4:g8:sym,block=16,sink=2"), fmt("k=int3:bchannel:asym,v=int3:g8:sym,block=16,sink=2"),
             fmt("k=int2:bchannel:asym,v=int2:token:asym,block=16,sink=2")]
    levels = [{"k": 2, "v": 0}, {"k": 0, "v": 1}, {"k": 1, "v": 2}]
    f = per_layer_format("mine", cands, levels)
    assert f.name == "mine" and f.block_size == 16 and f.sink_tokens == 2 and f.num_layers == 3
    assert [(f.layer(i).k, f.layer(i).v) for i in range(3)] == [(cands[2].k, cands[0].v), (cands[0].k, cands[1].v), (cands[1].k, cands[2].v)]
    assert (f.k, f.v) == (cands[2].k, cands[0].v)
    assert all(c.name in f.description for c in cands)
    assert [f.layer(i).sink_tokens for i in range(3)] == [2, 2, 2]


def test_each_layers_constants_come_from_the_candidate_each_side_took():
    cands = [INT[8], INT[4], INT[3]]

    def consts(c):
        return [LayerParams(k=TensorParams(scale=torch.tensor(100.0 * c + i), smooth=torch.full((2,), float(c))),
                            v=TensorParams(scale=torch.tensor(-100.0 * c - i), clip=torch.tensor(0.5 + c)))
                for i in range(3)]

    params = {cands[0].name: consts(0), cands[1].name: consts(1), cands[2].name: None}
    levels = [{"k": 1, "v": 0}, {"k": 0, "v": 1}, {"k": 2, "v": 1}]
    got = per_layer_params(cands, params, levels)
    assert [float(lp.k.scale) for lp in got[:2]] == [100.0, 1.0] and [float(lp.v.scale) for lp in got] == [-0.0, -101.0, -102.0]
    assert got[0].k.smooth.tolist() == [1.0, 1.0] and got[0].v.clip.item() == 0.5 and got[1].v.clip.item() == 1.5
    assert got[2].k == TensorParams()  # the candidate has no constants
    assert got[0].k.scale is not params[cands[1].name][0].k.scale and torch.equal(got[0].k.scale, params[cands[1].name][0].k.scale)


# ---------------------------------------------------------------- the search vs references


class Additive:
    """Score of a per-layer format: ``start`` + the sum over (layer, side) of ``cost[layer][side][level]`` (level read off
    the format); ``extra(levels)`` adds what the check's windows see on top. Counts its calls."""

    def __init__(self, cands, cost, start=0.001, extra=None):
        self.cands, self.cost, self.start, self.extra = cands, cost, start, extra
        self.calls = 0
        self.seen = []

    def levels(self, f):
        return [{s: [getattr(c, s) for c in self.cands].index(getattr(f.layer(i), s)) for s in ("k", "v")} for i in range(f.num_layers)]

    def __call__(self, f, params):
        self.calls += 1
        lv = self.levels(f)
        self.seen.append(lv)
        kl = self.start + sum(self.cost[i][s][lv[i][s]] for i in range(len(lv)) for s in ("k", "v"))
        if self.extra is not None:
            kl += self.extra(lv)
        return Score(kl, 100 * kl)


def ref_next(bits, cost_of, j):
    """Where a (layer, side) at candidate ``j`` steps to (module docstring, 3.): the most bits below ``bits[j]``, the
    cheapest of those; None at the fewest."""
    fewer = [b for b in bits if b < bits[j]]
    if not fewer:
        return None
    return min((cost_of[n], n) for n, b in enumerate(bits) if b == max(fewer))[1]


def ref_greedy(cands, cost, start, target, L):
    """The documented greedy (module docstring, 3.), written plainly."""
    bits = {s: [getattr(c, s).bits_per_element(HD, c.block_size) for c in cands] for s in "kv"}
    lv = [{"k": 0, "v": 0} for _ in range(L)]
    predicted, steps = start, []
    while True:
        options = []
        for i in range(L):
            for s in "kv":
                j = lv[i][s]
                n = ref_next(bits[s], cost[i][s], j)
                if n is None:
                    continue
                step = max(0.0, (cost[i][s][n] - cost[i][s][0]) - (cost[i][s][j] - cost[i][s][0]))
                if predicted + step <= target:
                    options.append((step / (bits[s][j] - bits[s][n]), i, s, step, n))
        if not options:
            return lv, predicted, steps
        _, i, s, step, n = min(options)
        lv[i][s] = n
        predicted += step
        steps.append((i, s, step))


def random_costs(rng, L, n, convex=False):
    out = []
    for _ in range(L):
        layer = {}
        for s in "kv":
            if convex:
                inc = sorted(rng.uniform(0.0, 0.01) for _ in range(n - 1))
            else:
                inc = [rng.uniform(-0.003, 0.01) for _ in range(n - 1)]  # negative: a narrower level that measured cheaper
            layer[s] = [0.0] + list(itertools.accumulate(inc))
        out.append(layer)
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("names", [(8, 4, 3, 2), (4, 3, 2)])
def test_the_search_is_the_documented_greedy(seed, names):
    rng = random.Random(seed * 10 + len(names))
    cands = [INT[b] for b in names]
    L = rng.choice([1, 2, 3])
    cost = random_costs(rng, L, len(cands))
    target = rng.uniform(0.005, 0.03)
    score = Additive(cands, cost)
    progress = []
    choice = choose_layer_bits(score, cands, {}, Budget("kl", target, margin=0), num_layers=L, head_dim=HD,
                               on_progress=lambda d, t: progress.append((d, t)))
    want_lv, want_pred, _ = ref_greedy(cands, cost, 0.001, target, L)
    assert choice.levels == want_lv and choice.predicted == pytest.approx(want_pred, abs=1e-12)
    assert choice.measured.kl == pytest.approx(0.001 + sum(cost[i][s][want_lv[i][s]] for i in range(L) for s in "kv"), abs=1e-12)
    assert choice.candidates == [c.name for c in cands] and choice.start == Score(0.001, 0.1)
    assert set(choice.sensitivity) == {"k", "v"}
    for s in "kv":  # each (layer, side, level) measured alone, less the start
        assert [[round(x, 12) for x in row] for row in choice.sensitivity[s]] == [[round(cost[i][s][j], 12) for j in range(len(cands))] for i in range(L)]
    total = L * 2 * (len(cands) - 1)
    assert progress == [(d, total) for d in range(1, total + 1)]
    assert choice.scored == score.calls == 1 + total + 1  # the start, each narrowed (layer, side, level), the check
    assert choice.start_bits == cands[0].pool_bits_per_element(HD)
    assert [{s: [getattr(c, s) for c in cands].index(getattr(choice.fmt.layer(i), s)) for s in "kv"} for i in range(L)] == want_lv
    assert len(choice.params) == L


@pytest.mark.parametrize("seed", range(8))
def test_with_equal_savings_and_convex_costs_the_search_is_optimal(seed):
    """Every step saves one bit and a (layer, side)'s steps cost more and more: the most steps within the target is
    then what the greedy finds; brute force over every assignment says how many that is."""
    rng = random.Random(100 + seed)
    cands = [INT[4], INT[3], INT[2]]
    L = rng.choice([1, 2, 3])
    cost = random_costs(rng, L, 3, convex=True)
    target = 0.001 + rng.uniform(0.0, 0.02)
    choice = choose_layer_bits(Additive(cands, cost), cands, {}, Budget("kl", target, margin=0), num_layers=L, head_dim=HD)
    best = max(sum(a) for a in itertools.product(range(3), repeat=2 * L)
               if 0.001 + sum(cost[i // 2]["kv"[i % 2]][a[i]] for i in range(2 * L)) <= target)
    assert sum(lv["k"] + lv["v"] for lv in choice.levels) == best


@pytest.mark.parametrize("seed", range(6))
def test_no_further_step_fits_and_the_prediction_is_within_the_target(seed):
    rng = random.Random(200 + seed)
    cands = [INT[8], INT[4], INT[2]]
    L = 3
    cost = random_costs(rng, L, 3)
    target = rng.uniform(0.002, 0.02)
    choice = choose_layer_bits(Additive(cands, cost), cands, {}, Budget("kl", target, margin=0), num_layers=L, head_dim=HD)
    assert choice.predicted <= target
    for i in range(L):
        for s in "kv":
            j = choice.levels[i][s]
            if j + 1 < 3:
                step = max(0.0, cost[i][s][j + 1] - cost[i][s][j])
                assert choice.predicted + step > target, (i, s)


def test_cost_per_bit_saved_ranks_the_steps():
    """K's only step costs 0.003 and saves 4 bits (int8 -> int4: 0.00075 a bit); V's costs 0.002 and saves 1 bit
    (int4 -> int3 on a V that starts at int4). With room for one step, the cheaper per bit wins though it costs more."""
    cands = [fmt("k=int8:token,v=int4:token:sym"), fmt("k=int4:token:sym,v=int3:token:sym")]
    cost = [{"k": [0.0, 0.003], "v": [0.0, 0.002]}]
    choice = choose_layer_bits(Additive(cands, cost, start=0.0), cands, {}, Budget("kl", 0.0035, margin=0), num_layers=1, head_dim=HD)
    assert choice.levels == [{"k": 1, "v": 0}] and choice.predicted == pytest.approx(0.003)


def test_a_step_measured_cheaper_than_the_one_before_costs_nothing_not_less():
    """V: level 1 costs +0.002, level 2 only +0.0005 (noise): V's second step is predicted free (0), not -0.0015, so it
    cannot pay for K's 0.003 step within a target of 0.0045 (0.002 + 0.003 > 0.0045)."""
    cands = [INT[4], INT[3], INT[2]]
    cost = [{"k": [0.0, 0.003, 1.0], "v": [0.0, 0.002, 0.0005]}]
    choice = choose_layer_bits(Additive(cands, cost, start=0.0), cands, {}, Budget("kl", 0.0045, margin=0), num_layers=1, head_dim=HD)
    assert choice.levels == [{"k": 0, "v": 2}] and choice.predicted == pytest.approx(0.002)


def test_the_running_total_not_each_step_alone_must_fit():
    cands = [INT[4], INT[3]]
    cost = [{"k": [0.0, 0.004], "v": [0.0, 0.004]}, {"k": [0.0, 0.004], "v": [0.0, 0.004]}]
    choice = choose_layer_bits(Additive(cands, cost, start=0.0), cands, {}, Budget("kl", 0.009, margin=0), num_layers=2, head_dim=HD)
    assert sum(lv["k"] + lv["v"] for lv in choice.levels) == 2 and choice.predicted == pytest.approx(0.008)
    assert choice.levels == [{"k": 1, "v": 1}, {"k": 0, "v": 0}]  # equal costs: the lower layer, K first


def test_the_margin_lowers_what_is_searched():
    cands = [INT[4], INT[3]]
    cost = [{"k": [0.0, 0.006], "v": [0.0, 0.1]}]
    loose = choose_layer_bits(Additive(cands, cost, start=0.0), cands, {}, Budget("kl", 0.008, margin=0), num_layers=1, head_dim=HD)
    tight = choose_layer_bits(Additive(cands, cost, start=0.0), cands, {}, Budget("kl", 0.008, margin=0.5), num_layers=1, head_dim=HD)
    assert loose.levels == [{"k": 1, "v": 0}] and tight.levels == [{"k": 0, "v": 0}]
    ppl = choose_layer_bits(Additive(cands, cost, start=0.0), cands, {}, Budget("ppl", 0.7, margin=0), num_layers=1, head_dim=HD)
    assert ppl.levels == [{"k": 1, "v": 0}]  # ln(1.007) = 0.00698 >= 0.006
    ppl = choose_layer_bits(Additive(cands, cost, start=0.0), cands, {}, Budget("ppl", 0.6, margin=0), num_layers=1, head_dim=HD)
    assert ppl.levels == [{"k": 0, "v": 0}]  # ln(1.006) = 0.00598 < 0.006


def test_a_start_over_the_target_is_refused_and_exactly_at_it_fits():
    cands = [INT[4], INT[3]]
    cost = [{"k": [0.0, 0.0], "v": [0.0, 0.0]}]
    with pytest.raises(TrtkvError, match=r"below what .* costs in every layer") as info:
        choose_layer_bits(Additive(cands, cost, start=0.02), cands, {}, Budget("kl", 0.03, margin=0.5), num_layers=1, head_dim=HD)
    assert "0.015" in str(info.value) and "--budget-margin" in info.value.fix
    choice = choose_layer_bits(Additive(cands, cost, start=0.25), cands, {}, Budget("kl", 0.25, margin=0), num_layers=1, head_dim=HD)
    assert choice.levels == [{"k": 1, "v": 1}]


@pytest.mark.parametrize("seed", range(8))
def test_the_check_keeps_the_longest_prefix_of_steps_that_measures_within_the_target(seed):
    """The check's windows see each step cost ``extra`` more than the search predicted (monotone in the steps taken):
    the kept prefix is the longest one within the target (a linear scan here), measured by the check."""
    rng = random.Random(300 + seed)
    cands = [INT[4], INT[3], INT[2]]
    L = 2
    cost = random_costs(rng, L, 3, convex=True)
    target = rng.uniform(0.005, 0.02)
    penalty = rng.uniform(0.0005, 0.004)
    search = Additive(cands, cost)
    check = Additive(cands, cost, extra=lambda lv: penalty * sum(x["k"] + x["v"] for x in lv))
    choice = choose_layer_bits(search, cands, {}, Budget("kl", target, margin=0), num_layers=L, head_dim=HD, check=check)
    _, _, steps = ref_greedy(cands, cost, 0.001, target, L)

    def after(n):
        lv = [{"k": 0, "v": 0} for _ in range(L)]
        for i, s, _ in steps[:n]:
            lv[i][s] += 1
        return lv

    def measured(n):
        lv = after(n)
        return 0.001 + sum(cost[i][s][lv[i][s]] for i in range(L) for s in "kv") + penalty * n

    keep = max(n for n in range(len(steps) + 1) if measured(n) <= target or n == 0)
    assert choice.levels == after(keep)
    assert choice.measured.kl == pytest.approx(measured(keep), abs=1e-12)
    assert choice.predicted == pytest.approx(0.001 + sum(st for _, _, st in steps[:keep]), abs=1e-12)
    assert choice.scored == search.calls + check.calls and search.calls == 1 + L * 2 * 2
    assert all(lv in [after(n) for n in range(len(steps) + 1)] for lv in check.seen)  # the check measures only prefixes


def test_a_prefix_that_measures_exactly_the_target_is_kept():
    """Every step predicted free; the check measures 0.25 a step up to 2 steps and 10 beyond (binary fractions, exact):
    the longest prefix within the target 0.5 is 2 steps, at exactly 0.5."""
    cands = [INT[4], INT[3]]
    cost = [{"k": [0.0, 0.0], "v": [0.0, 0.0]}, {"k": [0.0, 0.0], "v": [0.0, 0.0]}]
    check = Additive(cands, cost, start=0.0, extra=lambda lv: (lambda n: 0.25 * n if n <= 2 else 10.0)(sum(x["k"] + x["v"] for x in lv)))
    choice = choose_layer_bits(Additive(cands, cost, start=0.0), cands, {}, Budget("kl", 0.5, margin=0), num_layers=2, head_dim=HD, check=check)
    assert sum(lv["k"] + lv["v"] for lv in choice.levels) == 2 and choice.measured.kl == 0.5
    assert choice.levels == [{"k": 1, "v": 1}, {"k": 0, "v": 0}]  # the greedy's first two steps (equal costs: layer 0, K then V)


def test_when_the_whole_choice_fits_the_check_measures_once():
    cands = [INT[4], INT[3]]
    cost = [{"k": [0.0, 0.001], "v": [0.0, 0.001]}]
    check = Additive(cands, cost)
    choice = choose_layer_bits(Additive(cands, cost), cands, {}, Budget("kl", 0.01, margin=0), num_layers=1, head_dim=HD, check=check)
    assert check.calls == 1 and choice.levels == [{"k": 1, "v": 1}]


def test_nothing_fits_on_the_checks_windows_keeps_the_start():
    cands = [INT[4], INT[3]]
    cost = [{"k": [0.0, 0.001], "v": [0.0, 0.001]}]
    check = Additive(cands, cost, extra=lambda lv: 1.0 if any(x["k"] or x["v"] for x in lv) else 0.0)
    choice = choose_layer_bits(Additive(cands, cost), cands, {}, Budget("kl", 0.01, margin=0), num_layers=1, head_dim=HD, check=check)
    assert choice.levels == [{"k": 0, "v": 0}] and choice.measured.kl == pytest.approx(0.001) and choice.predicted == pytest.approx(0.001)


def test_the_choice_carries_the_constants_of_its_levels():
    cands = [INT[4], INT[3]]
    params = {c.name: [LayerParams(k=TensorParams(scale=torch.tensor(float(10 * j + i))), v=TensorParams(scale=torch.tensor(-float(10 * j + i))))
                       for i in range(2)] for j, c in enumerate(cands)}
    cost = [{"k": [0.0, 0.001], "v": [0.0, 0.5]}, {"k": [0.0, 0.5], "v": [0.0, 0.001]}]
    seen = []

    def score(f, p):
        seen.append([(float(lp.k.scale), float(lp.v.scale)) for lp in p])
        return Additive(cands, cost)(f, p)

    choice = choose_layer_bits(score, cands, params, Budget("kl", 0.01, margin=0), num_layers=2, head_dim=HD)
    assert choice.levels == [{"k": 1, "v": 0}, {"k": 0, "v": 1}]
    assert [(float(lp.k.scale), float(lp.v.scale)) for lp in choice.params] == [(10.0, -0.0), (1.0, -11.0)]
    assert seen[0] == [(0.0, -0.0), (1.0, -1.0)]  # the start: every side at candidate 0's constants


# ---------------------------------------------------------------- the Scorer


def test_the_scorer_measures_mean_kl_and_ppl_change_over_every_window(monkeypatch):
    g = torch.Generator().manual_seed(3)
    Vv, S = 11, 6
    base = torch.randn(Vv, Vv, generator=g)
    noise = torch.randn(Vv, Vv, generator=g) * 0.3
    calls = []

    def fake_logits(model, ids, f, params=None):
        name = f if isinstance(f, str) else f.name
        calls.append((name, tuple(ids.shape)))
        return base[ids] + (0 if name == "fp16" else noise[ids])

    monkeypatch.setattr(B, "model_logits", fake_logits)
    windows = torch.randint(0, Vv, (7, S), generator=g)
    scorer = B.Scorer(None, windows, batch_size=3)
    assert calls == [("fp16", (3, S)), ("fp16", (3, S)), ("fp16", (1, S))]
    got = scorer(INT[4], None)
    assert scorer.calls == 1 and [c[1] for c in calls[3:]] == [(3, S), (3, S), (1, S)]
    kl = nll_q = nll_p = 0.0
    n = 0
    for w in windows.tolist():
        for t in range(S - 1):
            p = torch.log_softmax(base[w[t]].double(), -1)
            q = torch.log_softmax((base[w[t]] + noise[w[t]]).double(), -1)
            kl += float((p.exp() * (p - q)).sum())
            nll_p -= float(p[w[t + 1]])
            nll_q -= float(q[w[t + 1]])
            n += 1
    assert scorer.base_nll == pytest.approx(nll_p / n, rel=1e-5)
    assert got.kl == pytest.approx(kl / n, rel=1e-4)
    assert got.ppl_delta_pct == pytest.approx(100 * (math.exp((nll_q - nll_p) / n) - 1), rel=1e-3, abs=1e-4)
    assert scorer(get_format("fp16"), None).kl == pytest.approx(0.0, abs=1e-7) and scorer.calls == 2


# ---------------------------------------------------------------- the report


def test_the_report_and_the_recipe_name_each_layers_choice_and_the_costs():
    cands = [INT[4], INT[3], INT[2]]
    names = [c.name for c in cands]
    levels = [{"k": 2, "v": 0}, {"k": 1, "v": 1}]
    sens = {"k": [[0.0, 0.0012, 0.0345], [0.0, -0.0001, 0.02]], "v": [[0.0, 0.5, 0.75], [0.0, 0.001, 0.002]]}
    choice = BudgetChoice(Budget("ppl", 1.0, 0.25), names, per_layer_format("budget", cands, levels), [], levels, Score(0.0011, 0.12),
                          0.0042, Score(0.0051, 0.53), 4.5, sens, 13)
    text = render_choice(choice, HD)
    rows = [ln for ln in text.splitlines() if ln.startswith("| 0 |") or ln.startswith("| 1 |")]
    assert rows == [f"| 0 | {names[2]} | {names[0]} | {names[1]} +0.0012, {names[2]} +0.0345 | {names[1]} +0.5, {names[2]} +0.75 |",
                    f"| 1 | {names[1]} | {names[1]} | {names[1]} -0.0001, {names[2]} +0.02 | {names[1]} +0.001, {names[2]} +0.002 |"]
    assert text.startswith("## Accuracy budget `ppl=1%` -> format `budget`")
    assert "start (" + names[0] + " everywhere): KL 0.00110, Δppl +0.120 %" in text
    assert f"searched as mean KL <= {Budget('ppl', 1.0, 0.25).kl_target:.5g} (ln(1 + 1 %) less a 25 % margin" in text
    assert "measured KL 0.00510, Δppl +0.530 %" in text and "predicted KL 0.0042" in text and "(13 formats measured)" in text
    assert "start 4.500)" in text and f"`{choice.fmt.spec()}`" in text
    assert f"(the budget less a {100 * DEFAULT_BUDGET_MARGIN:g} % margin" in render_choice(BudgetChoice(Budget("kl", 0.01), names, choice.fmt, [], levels, Score(0, 0), 0,
                                                                           Score(0, 0), 4.5, sens, 1), HD)
    rf = choice.recipe_fields()
    assert rf == {"budget": "ppl=1%", "margin": 0.25, "kl_target": Budget("ppl", 1.0, 0.25).kl_target, "candidates": names,
                  "choice": [{"layer": 0, "k": names[2], "v": names[0]}, {"layer": 1, "k": names[1], "v": names[1]}],
                  "start": {"kl": 0.0011, "ppl_delta_pct": 0.12}, "predicted": 0.0042, "start_bits": 4.5,
                  "measured": {"kl": 0.0051, "ppl_delta_pct": 0.53}, "sensitivity": sens, "formats_measured": 13,
                  "chosen": "per-layer", "mix_measured": None, "token_age": [], "context_len": None}


# ---------------------------------------------------------------- a size budget (bits=B)


def test_a_bits_budget_parses_and_bounds_no_kl():
    b = Budget.parse(" Bits = 2.5 ")
    assert (b.metric, b.limit, str(b)) == ("bits", 2.5, "bits=2.5") and b.kl_target == math.inf
    for bad in ("bits=0", "bits=-1", "bits=inf", "bits="):
        with pytest.raises(TrtkvError, match="invalid accuracy budget") as info:
            Budget.parse(bad)
        assert "bits=" in info.value.fix


def ref_bits_greedy(cands, cost, limit, L):
    """The documented greedy for bits=B, written plainly: the cheapest step per bit saved (negative step costs counted
    0), until the mean pool bits of the (layer, side) storages are at most B."""
    bits = {s: [getattr(c, s).bits_per_element(HD, c.block_size) for c in cands] for s in "kv"}
    lv = [{"k": 0, "v": 0} for _ in range(L)]
    while sum(bits[s][lv[i][s]] for i in range(L) for s in "kv") / (2 * L) > limit + 1e-9:
        options = []
        for i in range(L):
            for s in "kv":
                j = lv[i][s]
                n = ref_next(bits[s], cost[i][s], j)
                if n is not None:
                    options.append((max(0.0, cost[i][s][n] - cost[i][s][j]) / (bits[s][j] - bits[s][n]), i, s, n))
        _, i, s, n = min(options)
        lv[i][s] = n
    return lv


# candidates whose sides repeat along their order (by total bits): B keeps A's values, D keeps C's values -- the
# shape of int3-nuq beside a twin with fewer key outliers; B's and C's keys store as many bits two ways (the cheaper wins)
SHARED = [fmt("k=int4:token:sym,v=int4:token:sym"), fmt("k=int3:token:sym,v=int4:token:sym"),
          fmt("k=int3:token:sym:hadamard,v=int2:token:sym"), fmt("k=int2:token:sym,v=int2:token:sym")]


def shared_costs(rng, cands, L):
    """Random costs per (layer, side, candidate), equal where two candidates store a side alike (the score cannot
    tell them apart), and 0 at the start."""
    out = []
    for _ in range(L):
        layer = {}
        for s in "kv":
            sides = [getattr(c, s) for c in cands]
            by_side = {}
            layer[s] = [0.0 if j == 0 or sides[j] == sides[0] else by_side.setdefault(sides.index(sides[j]), rng.uniform(-0.003, 0.01))
                        for j in range(len(cands))]
        out.append(layer)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_side_that_repeats_along_the_candidates_still_narrows(seed):
    """Stepping to "the next candidate" saved nothing where a side repeats (B's values are A's) and stopped that side
    for good: a bits=B budget then ended over B (2.875 for bits=2.5 with int3-nuq and a twin among five candidates)."""
    rng = random.Random(500 + seed)
    L = rng.choice([1, 2, 3])
    cost = shared_costs(rng, SHARED, L)
    narrowest = SHARED[-1].pool_bits_per_element(HD)
    choice = choose_layer_bits(Additive(SHARED, cost), SHARED, {}, Budget("bits", narrowest), num_layers=L, head_dim=HD)
    assert choice.fmt.pool_bits_per_element(HD) <= narrowest + 1e-9
    assert all(choice.fmt.layer(i).k == SHARED[-1].k and choice.fmt.layer(i).v == SHARED[-1].v for i in range(L))
    limit = rng.uniform(narrowest, SHARED[0].pool_bits_per_element(HD))
    choice = choose_layer_bits(Additive(SHARED, cost), SHARED, {}, Budget("bits", limit), num_layers=L, head_dim=HD)
    want = ref_bits_greedy(SHARED, cost, limit, L)
    assert [{s: getattr(choice.fmt.layer(i), s) for s in "kv"} for i in range(L)] == [{s: getattr(SHARED[want[i][s]], s) for s in "kv"} for i in range(L)]
    assert choice.fmt.pool_bits_per_element(HD) <= limit + 1e-9
    target = rng.uniform(0.005, 0.03)
    score = Additive(SHARED, cost)
    choice = choose_layer_bits(score, SHARED, {}, Budget("kl", target, margin=0), num_layers=L, head_dim=HD)
    want, want_pred, _ = ref_greedy(SHARED, cost, 0.001, target, L)
    # each side measured once per way of storing it: K 3 narrower (B, C, D), V 1 (B stores A's values, D stores C's)
    assert score.calls == 1 + L * (3 + 1) + 1 and len(score.seen[1:-1]) == len({str(lv) for lv in score.seen[1:-1]})
    assert [{s: getattr(choice.fmt.layer(i), s) for s in "kv"} for i in range(L)] == [{s: getattr(SHARED[want[i][s]], s) for s in "kv"} for i in range(L)]
    assert choice.predicted == pytest.approx(want_pred, abs=1e-12)


def test_a_side_stored_alike_is_measured_once_unless_its_constants_differ():
    """B stores A's values and D stores C's: with equal constants (here equal tensors, not the same objects) their V
    costs are A's (0) and C's, unmeasured; where D's V scales differ from C's, D's V is measured."""
    L = 2
    names = [c.name for c in SHARED]
    v_scale = {n: [torch.full((2,), 1.0 + i) for i in range(L)] for n in names}
    v_scale[names[1]] = [t.clone() for t in v_scale[names[0]]]
    v_scale[names[3]] = [t.clone() for t in v_scale[names[2]]]
    params = {n: [LayerParams(v=TensorParams(scale=v_scale[n][i])) for i in range(L)] for n in names}
    cost = [{"k": [0.0, 0.001, 0.002, 0.003], "v": [0.0, 0.0, 0.004, 0.004]} for _ in range(L)]
    score = Additive(SHARED, cost)
    choice = choose_layer_bits(score, SHARED, params, Budget("kl", 0.001, margin=0), num_layers=L, head_dim=HD)
    assert score.calls == 1 + L * (3 + 1) + 1
    assert [choice.sensitivity["v"][i] for i in range(L)] == [[0.0, 0.0, 0.004, 0.004]] * L
    params[names[3]][1].v.scale = torch.full((2,), 9.0)  # layer 1: D's values now carry other constants than C's
    score = Additive(SHARED, cost)
    choose_layer_bits(score, SHARED, params, Budget("kl", 0.001, margin=0), num_layers=L, head_dim=HD)
    assert score.calls == 1 + L * (3 + 1) + 1 + 1
    # layer 1's V measured for C and again for D (Additive reads a storage as its first candidate's index: C's, 2)
    assert sum(lv == [{"k": 0, "v": 0}, {"k": 0, "v": 2}] for lv in score.seen) == 2


@pytest.mark.parametrize("seed", range(6))
def test_a_bits_budget_takes_the_greedy_steps_until_the_bits_fit(seed):
    rng = random.Random(300 + seed)
    cands = [INT[8], INT[4], INT[3], INT[2]]
    L = rng.choice([1, 2, 3])
    cost = random_costs(rng, L, len(cands))
    narrowest, widest = cands[-1].pool_bits_per_element(HD), cands[0].pool_bits_per_element(HD)
    limit = rng.uniform(narrowest, widest)
    score = Additive(cands, cost)
    choice = choose_layer_bits(score, cands, {}, Budget("bits", limit), num_layers=L, head_dim=HD)
    assert choice.levels == ref_bits_greedy(cands, cost, limit, L)
    assert choice.fmt.pool_bits_per_element(HD) <= limit + 1e-9
    # not one step more than needed: the last step taken is what brought the bits within the limit
    assert choice.scored == score.calls == 1 + L * 2 * (len(cands) - 1) + 1  # no bisection: bits are exact
    text, rf = render_choice(choice, HD), choice.recipe_fields()
    assert f"least predicted KL within {limit:g} pool bits" in text and rf["kl_target"] is None and rf["budget"] == f"bits={limit:g}"


@pytest.mark.parametrize("seed", range(8))
def test_a_bits_budget_with_equal_savings_and_convex_costs_is_the_cheapest_assignment(seed):
    """Every step saves one bit and a (layer, side)'s steps cost more and more: the fewest steps that fit B bits taken
    cheapest first is the least total cost a brute force over every assignment within B finds."""
    rng = random.Random(400 + seed)
    cands = [INT[4], INT[3], INT[2]]
    L = rng.choice([1, 2, 3])
    cost = random_costs(rng, L, 3, convex=True)
    bits = [c.pool_bits_per_element(HD) for c in cands]
    limit = rng.uniform(bits[-1], bits[0] - 0.01)
    choice = choose_layer_bits(Additive(cands, cost, start=0.0), cands, {}, Budget("bits", limit), num_layers=L, head_dim=HD)
    fits = [a for a in itertools.product(range(3), repeat=2 * L) if sum(bits[j] for j in a) / (2 * L) <= limit + 1e-9]
    best = min(sum(cost[i // 2]["kv"[i % 2]][a[i]] for i in range(2 * L)) for a in fits)
    assert choice.measured.kl == pytest.approx(best, abs=1e-12)


def test_a_bits_budget_below_the_narrowest_candidate_is_one_line():
    cands = [INT[4], INT[2]]
    with pytest.raises(TrtkvError, match="below .*the narrowest candidate") as info:
        choose_layer_bits(Additive(cands, random_costs(random.Random(1), 1, 2)), cands, {}, Budget("bits", 1.0), num_layers=1, head_dim=HD)
    assert "\n" not in str(info.value) and "--budget-formats" in info.value.fix


def test_a_bits_budget_keeps_its_choice_whatever_the_check_measures():
    cands = [INT[4], INT[3], INT[2]]
    cost = random_costs(random.Random(5), 2, 3, convex=True)
    check = Additive(cands, cost, extra=lambda lv: 10.0)  # far over any accuracy target: a kl budget would bisect
    choice = choose_layer_bits(Additive(cands, cost), cands, {}, Budget("bits", 3.0), num_layers=2, head_dim=HD, check=check)
    assert choice.fmt.pool_bits_per_element(HD) <= 3.0 and check.calls == 1 and choice.measured.kl > 10.0


@pytest.fixture(scope="module")
def candidates():
    """int4 and the calibration-free 3- / 2-bit layouts at head_dim 32, blocks of 16."""
    from trtkv.formats import CALIBRATION_FREE, fit_formats

    fmts, _ = fit_formats(["int4", *CALIBRATION_FREE.values()], 32)
    return [f.with_block_size(16) for f in fmts]


def test_a_zero_budget_is_refused():
    """A budget is a positive KL or Δppl; 0 allows nothing and is an invalid budget."""
    from trtkv.calibration.budget import Budget

    for bad in ("kl=0", "ppl=0%", "kl=-0.0"):
        with pytest.raises(TrtkvError, match="invalid accuracy budget"):
            Budget.parse(bad)
    assert Budget.parse("kl=1e-9").limit == 1e-9


def test_candidates_need_two_formats_that_seal_alike():
    """A search chooses between at least two candidates,
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
    """The widest candidate must cost at most the target; exactly the target fits
    (0.25 is exact in binary). Every narrowing measuring free, the search ends at the narrowest everywhere."""
    from trtkv.calibration.budget import Budget, Score, choose_layer_bits

    choice = choose_layer_bits(lambda f, p: Score(0.25, 1.0), candidates, {}, Budget("kl", 0.25, margin=0), num_layers=2, head_dim=32)
    assert choice.start.kl == 0.25 and all(lv == {"k": 2, "v": 2} for lv in choice.levels)


def test_the_check_keeps_a_prefix_that_measures_exactly_the_target(candidates):
    """The search predicts every step free; the check's windows measure 0.25 per
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
    """The constants of layer i, side s
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
    """The report's row of layer i names the candidate its K took, then its V's."""
    from trtkv.calibration.budget import Budget, BudgetChoice, Score, per_layer_format, render_choice

    levels = [{"k": 0, "v": 2}, {"k": 1, "v": 0}]
    names = [c.name for c in candidates]
    zero = [[0.0, 0.1, 0.2], [0.0, 0.3, 0.4]]
    choice = BudgetChoice(Budget("kl", 0.01), names, per_layer_format("budget", candidates, levels), [], levels, Score(0.001, 0.1),
                          0.002, Score(0.002, 0.2), 4.5, {"k": zero, "v": zero}, 9)
    rows = [ln for ln in render_choice(choice, 32).splitlines() if ln.startswith(("| 0 |", "| 1 |"))]
    assert rows[0].startswith(f"| 0 | {names[0]} | {names[2]} |") and rows[1].startswith(f"| 1 | {names[1]} | {names[0]} |")


def test_an_infinite_budget_is_refused():
    """A budget is a finite positive KL or Δppl."""
    from trtkv.calibration.budget import Budget

    for bad in ("kl=inf", "ppl=inf%", "kl=nan"):
        with pytest.raises(TrtkvError, match="invalid accuracy budget"):
            Budget.parse(bad)


def test_a_shared_scale_candidate_is_refused():
    """A budget candidate must be a plain format; a shared K/V scale is not
    (even one that seals blocks like the others)."""
    from trtkv.calibration.budget import check_candidates

    shared = get_format("k=int8:tensor,v=int8:tensor,shared,block=16")
    plain = get_format("k=int4:token:sym,v=int4:token:sym,block=16")
    with pytest.raises(TrtkvError, match="shared-scale"):
        check_candidates([shared, plain])
