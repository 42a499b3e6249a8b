"""Screen (issue 27): a ``--budget bits=B`` search that widens from the narrowest candidate instead of narrowing from
the widest, measured before building it.

``calibration.budget.choose_layer_bits`` measures each (layer, side)'s sensitivity with every *other* layer at the
widest candidate (int4), then narrows until the mean pool bits fit. At ``bits=2.5`` nearly every side ends at int2, so
those sensitivities are taken far from the point the choice lands on. This screen measures instead what widening one
(layer, side) from the narrowest candidate *gains* (KL with everything else at int2), then spends the bits the budget
leaves on the steps of the largest gain per bit (any wider candidate of that side; each (layer, side) may widen again
later), and runs ``trtkv calibrate``'s own code with that search in its place (in this process only). Evaluate the
result like any calibration (``trtkv eval --calibration OUT --kv budget ...``). Result (2026-12-06,
bench/results/budget-bits2.5-widen-2026-12-06.md): worse than narrowing from int4 in all four held-out figures (KL
+10 to +18 %) -- not built.

    python bench/screen_budget_widen.py OUT --budget bits=2.5 --samples 4 --budget-windows 4 \\
        --budget-formats int4-b128,int3-nuq,bench/results/budget-candidates/int3-kout64.json,int2-nuq,bench/results/budget-candidates/int2-kout128.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]


def widen_layer_bits(score, candidates, params, budget, *, num_layers, head_dim, name="budget", on_progress=None, check=None):
    """``choose_layer_bits``' signature and result, for a bits budget, searched from the narrowest candidate up."""
    from trtkv.calibration.budget import SIDES, BudgetChoice, check_candidates, per_layer_format, per_layer_params
    from trtkv.errors import TrtkvError

    if budget.metric != "bits":
        raise TrtkvError("the widening screen takes a bits budget only", "pass --budget bits=B")
    check = check or score
    cands = check_candidates(candidates)
    names = [c.name for c in cands]
    bits = [{s: getattr(c, s).bits_per_element(head_dim, c.block_size) for s in SIDES} for c in cands]
    narrowest = {s: min(range(len(cands)), key=lambda j: (bits[j][s], -j)) for s in SIDES}  # ties: the later candidate

    def run(levels, fn=score):
        return fn(per_layer_format(name, cands, levels), per_layer_params(cands, params, levels))

    start_levels = [dict(narrowest) for _ in range(num_layers)]
    start = run(start_levels)
    cost = {s: [[0.0] * len(cands) for _ in range(num_layers)] for s in SIDES}  # KL over the start (negative: a gain)
    wider = {s: [j for j in range(len(cands)) if bits[j][s] > bits[narrowest[s]][s] + 1e-12] for s in SIDES}
    total, done = num_layers * sum(len(w) for w in wider.values()), 0
    for layer in range(num_layers):
        for s in SIDES:
            for j in wider[s]:
                levels = [dict(lv) for lv in start_levels]
                levels[layer][s] = j
                cost[s][layer][j] = run(levels).kl - start.kl
                done += 1
                if on_progress is not None:
                    on_progress(done, total)
                print(f"  widen {done}/{total}: layer {layer} {s} -> {names[j]}: {cost[s][layer][j]:+.5f}", flush=True)
    levels = [dict(lv) for lv in start_levels]
    spent = sum(bits[lv[s]][s] for lv in levels for s in SIDES)
    room = budget.limit * len(SIDES) * num_layers + 1e-9
    predicted = start.kl
    while True:
        best = None
        for layer in range(num_layers):
            for s in SIDES:
                cur = levels[layer][s]
                for j in wider[s]:
                    more = bits[j][s] - bits[cur][s]
                    gain = cost[s][layer][cur] - cost[s][layer][j]
                    if more <= 1e-12 or gain <= 0 or spent + more > room:
                        continue
                    key = (-gain / more, layer, s, j)
                    if best is None or key < best:
                        best = key
        if best is None:
            break
        _, layer, s, j = best
        spent += bits[j][s] - bits[levels[layer][s]][s]
        predicted += cost[s][layer][j] - cost[s][layer][levels[layer][s]]
        levels[layer][s] = j
    measured = run(levels, check)
    return BudgetChoice(budget, names, per_layer_format(name, cands, levels), per_layer_params(cands, params, levels), levels, start,
                        predicted, measured, sum(bits[narrowest[s]][s] for s in SIDES) / len(SIDES), cost,
                        getattr(score, "calls", 0) + (getattr(check, "calls", 0) if check is not score else 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dataset", default="builtin:pydoc")
    ap.add_argument("--budget", default="bits=2.5")
    ap.add_argument("--budget-formats", required=True)
    ap.add_argument("--budget-windows", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    a = ap.parse_args()
    import trtkv.calibration.run as run_mod

    run_mod.choose_layer_bits = widen_layer_bits
    fmts = a.budget_formats.split(",")
    run_mod.run_calibration(a.model, a.dataset, a.out, formats=fmts, samples=a.samples, seq_len=a.seq_len, budget=a.budget,
                            budget_formats=fmts, budget_windows=a.budget_windows, progress=False)


if __name__ == "__main__":
    main()
