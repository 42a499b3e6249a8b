"""Per-layer K / V bits under an accuracy budget: ``trtkv calibrate --budget kl=0.01 --budget-formats int4,int3,int2``
(or under a size budget, ``--budget bits=2.5``: the least-KL mix of the candidates within that many pool bits).

Layers and K / V are not equally sensitive to quantization, so a cache that gives each (layer, side) the fewest bits
its error allows beats one format everywhere. The search, on the calibration split (never the eval split):

1. **Candidates.** Formats that seal blocks the same way (same block size and sink tokens), ordered by pool bits; a
   (layer, side) takes one of their tensor formats for its side. The widest candidate everywhere is the start, and
   must fit the budget.
2. **Sensitivity.** For every layer, side and narrower candidate: the cost (KL or Δppl against the unquantized
   model) of the start with only that (layer, side) narrowed, minus the start's cost -- measured, with the real
   quantized cache (``trtkv.kv_cache``), on ``windows`` calibration windows; once per way of storing the side (a
   candidate that stores it as an earlier one does, with equal constants, has that one's cost).
3. **Choice.** Greedy by cost per bit saved: the next narrower step of some (layer, side) -- to the candidates whose
   tensor format for that side stores the most bits below its current one, the cheapest measured of them if several
   (steps of one (layer, side) in order) -- while the predicted cost (start + the chosen steps' costs, taken as additive; a step that measured
   cheaper than the one before it counts 0, not less: that is the windows' noise) stays within the search's target.
   A ``bits=B`` budget takes the same steps in the same order until the mean pool bits are at most B, whatever they
   cost: the accuracy is then what is measured, not what is bounded.
4. **Check.** The chosen per-layer format is measured on *other* calibration windows than the search's (when the
   split has them: ``trtkv calibrate --samples`` at least twice ``--budget-windows``), so that a choice fitted to the
   search's windows shows it; when the measured cost is over the target, a bisection keeps the longest prefix of the
   greedy's steps that measures within it. The report gives the choice, the
   predicted and the measured cost; ``trtkv eval`` measures it on held-out windows like any other format.
5. **Token age.** A candidate with ``recent=R:FORMAT`` (e.g. ``int2,recent=3:int4``) is a whole-cache alternative, not
   a per-layer step (its ring of recent blocks is one per sequence slot): it is measured on the check's windows and
   takes the choice's place when it is better -- within a KL / Δppl budget, fewer bits at a measured cost within the
   target; within a ``bits`` budget, less measured KL within those bits. Its bits are counted at the calibration
   windows' length (``sealed_bits_per_element``: the pool plus its ring over that many tokens), the length its KL is
   measured at, so a long-context choice is made by calibrating with that ``--seq-len``.

**What is searched: mean KL, below the budget by a margin** (``Budget.kl_target``). One (layer, side) narrowed moves
the perplexity of a few windows by less than their noise, often downwards, so a search summing measured Δppl adds up
"free" steps that are not free on other text. KL has no sign to exploit, and it is what Δppl estimates: for text the
model predicts, the expected change of log-perplexity *is* the mean KL, so a Δppl budget of p % is searched as KL ≤
ln(1 + p/100). And held-out text costs more than the calibration windows (for SmolLM2 up to 19 % more KL than the
check's windows, and on text unlike the calibration text up to 16 % more Δppl than that KL predicts), so the search
aims ``margin`` (``trtkv.calibration.DEFAULT_BUDGET_MARGIN``, docs/calibration.md) below.

The result is a per-layer ``KVFormat`` (``KVFormat.layers``) saved in the recipe under ``--budget-name`` (default
``budget``), with the per-layer calibrated constants of the candidates it took.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import torch

from trtkv.artifacts import LayerParams
from trtkv.calibration import DEFAULT_BUDGET_MARGIN
from trtkv.errors import TrtkvError
from trtkv.evaluate import kl_divergence, model_logits, token_nll
from trtkv.formats import KVFormat, LayerStorage
from trtkv.quant import TensorParams

BUDGET_HELP = ("give the budget as kl=NATS (mean KL vs the unquantized model, e.g. kl=0.01), ppl=PERCENT (e.g. ppl=1%) or "
               "bits=POOL_BITS (the least-KL mix within that many pool bits per element, e.g. bits=2.5)")
SIDES = ("k", "v")


@dataclass(frozen=True)
class Budget:
    """The most a KV cache may cost: mean KL (nats) or perplexity increase (%) against the unquantized model -- the search
    aims ``margin`` (a fraction) below it -- or pool bits per element (``bits``: exact, no margin)."""

    metric: Literal["kl", "ppl", "bits"]
    limit: float
    margin: float = DEFAULT_BUDGET_MARGIN

    def __post_init__(self):
        if not 0 <= self.margin < 1:
            raise TrtkvError(f"invalid budget margin {self.margin:g}: it is a fraction of the budget", "give --budget-margin in [0, 1), e.g. 0.6")

    @property
    def kl_target(self) -> float:
        """The mean KL the search and the check must stay within (module docstring: KL for either metric, less the margin);
        a ``bits`` budget bounds no KL (inf)."""
        if self.metric == "bits":
            return math.inf
        kl = self.limit if self.metric == "kl" else math.log1p(self.limit / 100)
        return kl * (1 - self.margin)

    @classmethod
    def parse(cls, text: str, margin: float = DEFAULT_BUDGET_MARGIN) -> "Budget":
        key, _, value = text.partition("=")
        key, value = key.strip().lower(), value.strip().rstrip("%")
        try:
            limit = float(value)
        except ValueError:
            raise TrtkvError(f"invalid accuracy budget {text!r}", BUDGET_HELP) from None
        if key not in ("kl", "ppl", "bits") or not limit > 0 or not math.isfinite(limit):
            raise TrtkvError(f"invalid accuracy budget {text!r}", BUDGET_HELP)
        return cls(key, limit, margin)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"{self.metric}={self.limit:g}" + ("%" if self.metric == "ppl" else "")


@dataclass(frozen=True)
class Score:
    kl: float  # mean KL(unquantized || quantized) per predicted position, nats
    ppl_delta_pct: float


class Scorer:
    """KL and Δppl of a KV format on fixed windows, the unquantized logits computed once."""

    def __init__(self, model, windows: torch.Tensor, batch_size: int = 4):
        self.model = model
        self.batches = [windows[i : i + batch_size] for i in range(0, windows.shape[0], batch_size)]
        with torch.inference_mode():
            self.refs = [torch.log_softmax(model_logits(model, ids, "fp16")[:, :-1].float(), -1) for ids in self.batches]
        nll = torch.cat([-r.gather(-1, ids[:, 1:, None]).squeeze(-1).flatten() for r, ids in zip(self.refs, self.batches)])
        self.base_nll = nll.double().mean().item()
        self.calls = 0

    def __call__(self, fmt: KVFormat, params: list[LayerParams] | None) -> Score:
        self.calls += 1
        kl, nll, n = 0.0, 0.0, 0
        with torch.inference_mode():
            for ref, ids in zip(self.refs, self.batches):
                logits = model_logits(self.model, ids, fmt, params)[:, :-1]
                kl += kl_divergence(ref, logits).double().sum().item()
                nll += token_nll(logits, ids[:, 1:]).double().sum().item()
                n += ids[:, 1:].numel()
        return Score(kl / n, 100.0 * (math.exp(nll / n - self.base_nll) - 1.0))


@dataclass
class BudgetChoice:
    """What the search chose, and why."""

    budget: Budget
    candidates: list[str]
    fmt: KVFormat
    params: list[LayerParams]
    levels: list[dict[str, int]]  # per layer: {"k": candidate index, "v": candidate index}
    start: Score  # the widest candidate everywhere
    predicted: float  # mean KL, against budget.kl_target
    measured: Score
    start_bits: float = 0.0  # pool bits per element of the start
    sensitivity: dict[str, list[list[float]]] = field(default_factory=dict)  # side -> [layer][candidate] cost over the start
    scored: int = 0  # formats measured by the search
    token_age: list["Alternative"] = field(default_factory=list)  # whole-cache candidates measured against the per-layer mix
    chosen: str = "per-layer"  # "per-layer" (``levels``) or the token-age candidate that took its place (``fmt``)
    context_len: int | None = None  # tokens the token-age candidates' bits are counted over (the windows' length)
    mix: tuple[float, Score] | None = None  # a token-age choice: the per-layer mix's bits and measured cost it beat

    def bits(self, head_dim: int) -> float:
        """Bits per element of the chosen format: pool bits, plus a token-age choice's ring over ``context_len`` tokens."""
        return self.fmt.sealed_bits_per_element(head_dim, self.context_len)

    def recipe_fields(self) -> dict:
        """What recipe.json keeps of the search (FormatCalibration extra fields)."""
        names = self.candidates
        return {
            "budget": str(self.budget),
            "margin": self.budget.margin,
            "kl_target": self.budget.kl_target if self.budget.metric != "bits" else None,  # bits: no KL bound
            "candidates": names,
            "choice": [{"layer": i, "k": names[lv["k"]], "v": names[lv["v"]]} for i, lv in enumerate(self.levels)],
            "start": {"kl": self.start.kl, "ppl_delta_pct": self.start.ppl_delta_pct},
            "predicted": self.predicted,
            "start_bits": self.start_bits,
            "measured": {"kl": self.measured.kl, "ppl_delta_pct": self.measured.ppl_delta_pct},
            "sensitivity": self.sensitivity,
            "formats_measured": self.scored,
            "chosen": self.chosen,
            "mix_measured": None if self.mix is None else {"bits": self.mix[0], "kl": self.mix[1].kl, "ppl_delta_pct": self.mix[1].ppl_delta_pct},
            "token_age": [{"format": a.name, "bits": a.bits, "kl": a.score.kl, "ppl_delta_pct": a.score.ppl_delta_pct} for a in self.token_age],
            "context_len": self.context_len,
        }


@dataclass(frozen=True)
class Alternative:
    """A token-age candidate as measured against the per-layer mix: bits at the windows' length, cost on the check's windows."""

    name: str
    bits: float
    score: Score


def align_candidates(candidates: Sequence[KVFormat]) -> tuple[list[KVFormat], list[str]]:
    """The candidates sealing blocks alike, so that any layer may take any candidate's K or V: each brought to the
    largest block size and the most sink tokens among them (``KVFormat.with_block_size``), with a one-line note per
    candidate changed. The largest block, not the smallest: the narrow candidates are the ones whose recipes were measured
    at their own blocks (the int3 / int2 presets, 128), and the int4 layout at 128 costs 0.125 bits less than at 64 for
    about the same error (the int4 preset searches as int4@block128). Per-layer and shared-scale formats are left as
    they are (``check_candidates`` refuses them), and so are token-age ones (whole-cache alternatives, module docstring)."""
    plain = [c for c in candidates if not (c.is_per_layer or c.shared_kv_scale or c.token_aged)]
    if not plain:
        return list(candidates), []
    block = max((c.block_size or 0 for c in plain), default=0) or None
    sink = max(c.sink_tokens for c in plain)
    out, notes = [], []
    for c in candidates:
        if c in plain and (c.block_size, c.sink_tokens) != (block, sink):
            fitted = c.with_block_size(block) if block else c
            if block and fitted.sink_tokens != min(sink, block // 2):
                fitted = fitted.model_copy(update={"sink_tokens": min(sink, block // 2), "name": f"{fitted.name}@sink{min(sink, block // 2)}"})
            notes.append(f"budget candidate {c.name} searched as {fitted.name} (block {fitted.block_size}, sink {fitted.sink_tokens}): "
                         "the candidates must seal blocks alike")
            c = fitted
        out.append(c)
    return out, notes


def check_candidates(candidates: Sequence[KVFormat]) -> list[KVFormat]:
    """The per-layer candidates ordered widest first, then the token-age ones as given; refused unless at least two are
    per-layer candidates -- plain (not per-layer, shared-scale or token-age) formats that seal blocks alike (block size,
    sink tokens)."""
    aged = [c for c in candidates if c.token_aged]
    candidates = [c for c in candidates if not c.token_aged]
    if len(candidates) < 2:
        raise TrtkvError(f"--budget needs at least two --budget-formats without recent= to choose between per layer (got "
                         f"{len(candidates)}{f' and {len(aged)} with recent=' if aged else ''})", "e.g. --budget-formats int4,int3,int2,int2,recent=3:int4")
    first = candidates[0]
    for c in candidates:
        if c.is_per_layer or c.shared_kv_scale:
            raise TrtkvError(f"budget candidate {c.name} is a per-layer or shared-scale format", "give plain formats, e.g. int4,int3,int2")
        if (c.block_size, c.sink_tokens) != (first.block_size, first.sink_tokens):
            raise TrtkvError(
                f"budget candidates {first.name} (block {first.block_size}, sink {first.sink_tokens}) and {c.name} (block {c.block_size}, "
                f"sink {c.sink_tokens}) seal blocks differently", "give candidates with the same block= and sink= (e.g. the int4, int3, int2 presets)")
    return sorted(candidates, key=lambda c: -c.pool_bits_per_element(64)) + aged


def per_layer_format(name: str, candidates: Sequence[KVFormat], levels: Sequence[dict[str, int]]) -> KVFormat:
    """The per-layer format of ``levels`` (per layer, a candidate index for K and one for V)."""
    layers = tuple(LayerStorage(k=candidates[lv["k"]].k, v=candidates[lv["v"]].v) for lv in levels)
    base = candidates[0]
    return KVFormat(name=name, k=layers[0].k, v=layers[0].v, block_size=base.block_size, sink_tokens=base.sink_tokens, layers=layers,
                    description=f"per-layer K / V storage chosen under an accuracy budget from {', '.join(c.name for c in candidates)}")


def per_layer_params(candidates: Sequence[KVFormat], params: dict[str, list[LayerParams] | None], levels: Sequence[dict[str, int]]) -> list[LayerParams]:
    """Each layer's constants from the candidate each of its sides took (none where that candidate has none)."""
    out = []
    for i, lv in enumerate(levels):
        side = {}
        for s in SIDES:
            got = params.get(candidates[lv[s]].name)
            tp = getattr(got[i], s) if got else TensorParams()  # copied: the artifact stores each format's tensors apart
            side[s] = tp.map(torch.Tensor.clone)
        out.append(LayerParams(k=side["k"], v=side["v"]))
    return out


def _stores_alike(candidates: Sequence[KVFormat], params: dict[str, list[LayerParams] | None], layer: int, side: str, a: int, b: int) -> bool:
    """Whether candidates ``a`` and ``b`` store ``layer``'s ``side`` the same way with equal constants: the per-layer
    format and constants of a choice take nothing else of a candidate for that side (``per_layer_format``,
    ``per_layer_params``)."""
    if getattr(candidates[a], side) != getattr(candidates[b], side):
        return False
    pa, pb = (params.get(candidates[j].name) for j in (a, b))
    ta = getattr(pa[layer], side).tensors() if pa else {}
    tb = getattr(pb[layer], side).tensors() if pb else {}
    return ta.keys() == tb.keys() and all(torch.equal(ta[n], tb[n]) for n in ta)


def choose_layer_bits(
    score: Callable[[KVFormat, list[LayerParams]], Score],
    candidates: Sequence[KVFormat],
    params: dict[str, list[LayerParams] | None],
    budget: Budget,
    *,
    num_layers: int,
    head_dim: int,
    name: str = "budget",
    on_progress: Callable[[int, int], None] | None = None,
    check: Callable[[KVFormat, list[LayerParams]], Score] | None = None,
    context_len: int | None = None,
) -> BudgetChoice:
    """The per-layer format with the fewest bits whose measured cost stays within ``budget`` -- or, for a ``bits`` budget,
    the least predicted cost within that many pool bits (module docstring): ``score`` measures the start and the
    sensitivities, ``check`` (default ``score``; other windows than the search's, so that the choice is not fitted to
    the windows it is checked on) the choice and the token-age candidates, whose bits are counted over ``context_len``
    tokens (the windows' length; required with them)."""
    check = check or score
    ordered = check_candidates(candidates)
    cands = [c for c in ordered if not c.token_aged]
    aged = [c for c in ordered if c.token_aged]
    if aged and context_len is None:
        raise ValueError("token-age budget candidates need context_len: the tokens their ring of recent blocks is counted over")
    names = [c.name for c in cands]
    target = budget.kl_target  # what is searched: mean KL (module docstring)

    def fmt_of(levels):
        return per_layer_format(name, cands, levels)

    def run(levels) -> Score:
        return score(fmt_of(levels), per_layer_params(cands, params, levels))

    bits = [{s: getattr(c, s).bits_per_element(head_dim, c.block_size) for s in SIDES} for c in cands]
    by_bits = budget.metric == "bits"
    if by_bits and (narrowest := cands[-1].pool_bits_per_element(head_dim)) > budget.limit + 1e-9:
        raise TrtkvError(f"the budget {budget} is below {names[-1]}, the narrowest candidate ({narrowest:g} pool bits at head_dim {head_dim})",
                         "raise the budget or add a narrower candidate to --budget-formats")
    start_levels = [{"k": 0, "v": 0} for _ in range(num_layers)]
    start = run(start_levels)
    if start.kl > target:
        raise TrtkvError(
            f"the budget {budget} (searched as KL <= {target:.4g}) is below what {names[0]} costs in every layer (KL {start.kl:.4g} on the "
            "calibration windows)", f"raise the budget or lower --budget-margin, or add a wider candidate to --budget-formats (e.g. int8,{','.join(names)})")
    # 2. sensitivity: one (layer, side) narrowed at a time
    total = num_layers * len(SIDES) * (len(cands) - 1)
    cost = {s: [[0.0] * len(cands) for _ in range(num_layers)] for s in SIDES}
    done = 0
    for layer in range(num_layers):
        for s in SIDES:
            for lev in range(1, len(cands)):
                # a side stored as an earlier candidate stores it, with the same constants, is that format again: its
                # cost is known (the start's side: 0). Twins such as a format and the same format with other key
                # outliers share their values, and the search then measures a quarter fewer formats.
                alike = next((j for j in range(lev) if _stores_alike(cands, params, layer, s, j, lev)), None)
                if alike is not None:
                    cost[s][layer][lev] = cost[s][layer][alike]
                else:
                    levels = [dict(lv) for lv in start_levels]
                    levels[layer][s] = lev
                    cost[s][layer][lev] = run(levels).kl - start.kl
                done += 1
                if on_progress is not None:
                    on_progress(done, total)
    # 3. greedy by cost per bit saved, each (layer, side) one step at a time
    levels = [dict(lv) for lv in start_levels]
    predicted = start.kl
    steps: list[tuple[int, str, int, float]] = []  # (layer, side, the candidate it took, predicted cost of the step)

    def mean_bits() -> float:
        return sum(bits[lv[s]][s] for lv in levels for s in SIDES) / (len(SIDES) * num_layers)

    def next_level(layer: int, s: str, cur: int) -> int | None:
        """The (layer, side)'s next step: of the candidates whose ``s`` stores fewer bits than ``cur``'s, those of the
        most bits, and of them the one that measured cheapest. Candidates are ordered by their total bits, so along
        them one side may repeat (a format and a twin with fewer key outliers share their values) or even widen:
        "the next candidate" would save nothing there and stop that side for good."""
        narrower = [j for j in range(len(cands)) if bits[j][s] < bits[cur][s] - 1e-12]
        if not narrower:
            return None
        width = max(bits[j][s] for j in narrower)
        return min((j for j in narrower if bits[j][s] == width), key=lambda j: (cost[s][layer][j], j))

    while not (by_bits and mean_bits() <= budget.limit + 1e-9):
        best = None
        for layer in range(num_layers):
            for s in SIDES:
                cur = levels[layer][s]
                nxt = next_level(layer, s, cur)
                if nxt is None:
                    continue
                # a narrower level that measured cheaper is noise of the windows, not a gain: it costs 0, never less
                extra = max(cost[s][layer][nxt] - cost[s][layer][cur], 0.0)
                saved = bits[cur][s] - bits[nxt][s]
                if predicted + extra <= target:
                    key = (extra / saved, layer, s)
                    if best is None or key < best[0]:
                        best = (key, nxt, extra)
        if best is None:
            break
        (_, layer, s), nxt, extra = best
        levels[layer][s] = nxt
        predicted += extra
        steps.append((layer, s, nxt, extra))
    # 4. measure; over the target, bisect for the longest prefix of the steps (in the greedy's order) that measures
    # within it: the start is taken to fit (it did on the search's windows)
    def after(n: int) -> list[dict[str, int]]:
        out = [dict(lv) for lv in start_levels]
        for layer, s, level, _ in steps[:n]:
            out[layer][s] = level
        return out

    def checked(n: int) -> Score:
        lv = after(n)
        return check(fmt_of(lv), per_layer_params(cands, params, lv))

    kept, measured = len(steps), checked(len(steps))
    if measured.kl > target:
        fits, over, best = 0, len(steps), None  # prefix `fits` is within the target (measured: best), `over` is not
        while over - fits > 1:
            mid = (fits + over) // 2
            got = checked(mid)
            if got.kl <= target:
                fits, best = mid, got
            else:
                over = mid
        kept, measured = fits, best if best is not None else checked(fits)
    levels = after(kept)
    predicted = start.kl + sum(extra for *_, extra in steps[:kept])
    choice = BudgetChoice(budget, names, fmt_of(levels), per_layer_params(cands, params, levels), levels, start, predicted, measured,
                          cands[0].pool_bits_per_element(head_dim), {s: cost[s] for s in SIDES}, context_len=context_len)
    # 5. token age: whole-cache alternatives to the per-layer mix, measured on the check's windows
    for c in aged:
        got = params.get(c.name) or [LayerParams() for _ in range(num_layers)]
        alt = Alternative(c.name, c.sealed_bits_per_element(head_dim, context_len), check(c, got))
        choice.token_age.append(alt)
        if _better(alt.bits, alt.score, choice.bits(head_dim), choice.measured, budget):
            choice.mix = choice.mix or (choice.bits(head_dim), choice.measured)
            choice.fmt = c.model_copy(update={"name": name, "description": f"{c.name}: chosen under an accuracy budget over the per-layer "
                                              f"mix of {', '.join(names)} (trtkv calibrate --budget)"})
            choice.params, choice.measured, choice.chosen = [LayerParams(k=lp.k.map(torch.Tensor.clone), v=lp.v.map(torch.Tensor.clone)) for lp in got], alt.score, c.name
    choice.scored = getattr(score, "calls", 0) + (getattr(check, "calls", 0) if check is not score else 0)
    return choice


def _better(bits: float, score: Score, than_bits: float, than: Score, budget: Budget) -> bool:
    """Whether a format of ``bits`` measuring ``score`` is the better choice under ``budget`` than one of ``than_bits``
    measuring ``than``: within a ``bits`` budget, less KL (ties: fewer bits); within a KL / Δppl budget, a cost within
    the target and fewer bits (ties: less KL)."""
    if budget.metric == "bits":
        return bits <= budget.limit + 1e-9 and (score.kl, bits) < (than.kl, than_bits)
    return score.kl <= budget.kl_target and (bits, score.kl) < (than_bits, than.kl)


def render_choice(choice: BudgetChoice, head_dim: int) -> str:
    """The report's section: the budget, predicted and measured cost, bits, and the choice per layer."""
    m = choice.measured
    c = choice.fmt
    names = choice.candidates
    lines = [
        f"## Accuracy budget `{choice.budget}` -> format `{c.name}`",
        "",
        f"- candidates (widest first): {', '.join(f'`{n}`' for n in names)}; start ({names[0]} everywhere): KL {choice.start.kl:.5f}, "
        f"Δppl {choice.start.ppl_delta_pct:+.3f} %",
        (f"- searched as the least predicted KL within {choice.budget.limit:g} pool bits per element" if choice.budget.metric == "bits" else
         f"- searched as mean KL <= {choice.budget.kl_target:.5g} (" + ("the budget" if choice.budget.metric == "kl" else
         f"ln(1 + {choice.budget.limit:g} %)") + f" less a {100 * choice.budget.margin:g} % margin for held-out text)"),
        (f"- chosen: {c.pool_bits_per_element(head_dim):.3f} pool bits per element (start {choice.start_bits:.3f}); "
         f"predicted KL {choice.predicted:.5g}, **measured KL {m.kl:.5f}, Δppl {m.ppl_delta_pct:+.3f} %** "
         f"on the check's calibration windows ({choice.scored} formats measured)") if choice.mix is None else
        (f"- chosen: token age, `{choice.chosen}`: {choice.bits(head_dim):.3f} bits per element over {choice.context_len} tokens (pool and "
         f"ring of recent blocks), **measured KL {m.kl:.5f}, Δppl {m.ppl_delta_pct:+.3f} %** on the check's calibration windows, in "
         f"place of the per-layer mix below ({choice.mix[0]:.3f} pool bits, measured KL {choice.mix[1].kl:.5f}, Δppl "
         f"{choice.mix[1].ppl_delta_pct:+.3f} %; {choice.scored} formats measured)"),
        *(f"- token-age candidate `{a.name}`: {a.bits:.3f} bits per element over {choice.context_len} tokens, measured KL {a.score.kl:.5f}, "
          f"Δppl {a.score.ppl_delta_pct:+.3f} %" for a in choice.token_age),
        f"- spec: `{c.spec()}`",
        "",
        "The per-layer search" + (" (not chosen):" if choice.mix is not None else ":"),
        "",
        "| layer | K | V | K cost if narrowed (per candidate) | V cost if narrowed |",
        "|---:|---|---|---|---|",
    ]
    for i, lv in enumerate(choice.levels):
        ks = ", ".join(f"{names[j]} {choice.sensitivity['k'][i][j]:+.4g}" for j in range(1, len(names)))
        vs = ", ".join(f"{names[j]} {choice.sensitivity['v'][i][j]:+.4g}" for j in range(1, len(names)))
        lines.append(f"| {i} | {names[lv['k']]} | {names[lv['v']]} | {ks} | {vs} |")
    return "\n".join(lines) + "\n"
