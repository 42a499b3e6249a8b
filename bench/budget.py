"""An accuracy budget on the builtin SmolLM2-135M: ``trtkv calibrate --budget``, then the choice measured on held-out text.

1. ``run_calibration(..., budget=--budget, budget_formats=int4,int3,int2)`` on the pydoc calib split (``--samples``
   windows for the statistics, ``--budget-windows`` of them for the search): per layer, K and V, one of the
   candidates (calibration/budget.py);
2. ``run_eval`` of fp16 (baseline), the candidates and the budget's choice on the **eval** split of each
   ``--eval-datasets`` text (``--windows`` x ``--seq-len`` held-out tokens; Shakespeare is unlike the calibration text).

Writes bench/results/budget.{json,md}: the command, the machine, the search (start, predicted, measured on the
calibration windows, formats measured, seconds), the per-layer choice, and per text the pool bits, Δppl, KL, top-1.

    python bench/budget.py [--budget ppl=1%] [--windows 16] [--eval-datasets builtin:pydoc,builtin:shakespeare]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_engine import machine
from report import write_report

ROOT = Path(__file__).resolve().parents[1]
from trtkv.calibration import DEFAULT_BUDGET_FORMATS, DEFAULT_BUDGET_MARGIN, DEFAULT_BUDGET_WINDOWS  # noqa: E402


def render(r: dict) -> str:
    s = r["search"]
    lines = [f"# Accuracy budget `{r['budget']}` on SmolLM2-135M ({r['date']})", "", f"Command: `{r['command']}`  ", f"Machine: {r['machine']}", "",
             "## The search (calibration split)", "",
             f"- candidates {', '.join(s['candidates'])}; {s['formats_measured']} formats measured on {r['budget_windows']} calibration windows "
             f"x {r['seq_len']} tokens " + (f"in {r['calibrate_seconds']:.0f} s (statistics on {r['samples']} windows included)"
                                            if r["calibrate_seconds"] else "(an artifact calibrated by an earlier run of this script)"),
             f"- start ({s['candidates'][0]} everywhere): KL {s['start']['kl']:.5f}, Δppl {s['start']['ppl_delta_pct']:+.3f} %",
             (f"- searched as the least predicted KL within {r['limit']:g} pool bits" if s["kl_target"] is None else
              f"- searched as mean KL <= {s['kl_target']:.5g} (margin {100 * s['margin']:g} %)"),
             f"- chosen: {r['pool_bits']:.3f} pool bits per element; predicted KL {s['predicted']:.5g}; measured KL "
             f"{s['measured']['kl']:.5f}, Δppl {s['measured']['ppl_delta_pct']:+.3f} %",
             f"- K per layer: {' '.join(c['k'].split('@')[0] for c in s['choice'])}",
             f"- V per layer: {' '.join(c['v'].split('@')[0] for c in s['choice'])}", ""]
    for text, rows in r["eval"].items():
        lines += [f"## Held-out: {text}, {r['windows']} windows x {r['seq_len']} tokens (eval split)", "",
                  "| format | pool bits | ppl | Δppl % | KL mean | top-1 % | within the budget |", "|---|---:|---:|---:|---:|---:|---|"]
        for row in rows:
            within = "" if row["format"] != "budget" else ("yes" if row[r["metric_key"]] <= r["limit"] else "**no**")
            lines.append(f"| {row['format']} | {row['pool_bits_per_element']:.3f} | {row['ppl']:.4f} | {row['ppl_delta_pct']:+.3f} | {row['kld_mean']:.5f} | "
                         f"{100 * row['top1_agreement']:.2f} | {within} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", default="ppl=1%")
    ap.add_argument("--budget-formats", default=",".join(DEFAULT_BUDGET_FORMATS))
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--budget-windows", type=int, default=DEFAULT_BUDGET_WINDOWS)
    ap.add_argument("--margin", type=float, default=DEFAULT_BUDGET_MARGIN)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-datasets", default="builtin:pydoc,builtin:shakespeare")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "budget"))
    ap.add_argument("--calibration", help="an artifact this script already calibrated (skips the search; its time is not re-measured)")
    args = ap.parse_args()

    from trtkv.artifacts import load_calibration
    from trtkv.calibration.budget import Budget
    from trtkv.calibration.run import run_calibration
    from trtkv.evaluate import run_eval
    budget = Budget.parse(args.budget, args.margin)
    cands = [f.strip() for f in args.budget_formats.split(",") if f.strip()]
    r = {"date": str(date.today()), "command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "machine": machine(), "budget": str(budget),
         "limit": budget.limit, "metric_key": {"kl": "kld_mean", "ppl": "ppl_delta_pct", "bits": "pool_bits_per_element"}[budget.metric], "samples": args.samples,
         "budget_windows": args.budget_windows, "windows": args.windows, "seq_len": args.seq_len, "eval": {}}
    t0 = time.perf_counter()
    if args.calibration:
        art = Path(args.calibration)
    else:
        art = run_calibration("smollm2-135m", "builtin:pydoc", Path(tempfile.mkdtemp()) / "cal", formats=cands, samples=args.samples, seq_len=args.seq_len,
                              budget=args.budget, budget_formats=cands, budget_windows=args.budget_windows, budget_margin=args.margin,
                              progress=True)
        print(f"calibration: {art}", flush=True)
    r["calibrate_seconds"] = None if args.calibration else time.perf_counter() - t0
    entry = load_calibration(art).recipe.formats["budget"]
    r["search"] = entry.model_extra
    r["pool_bits"] = entry.definition.pool_bits_per_element(64)
    stem = Path(args.out)
    for text in args.eval_datasets.split(","):
        res = run_eval("smollm2-135m", text, cands + ["budget"], calibration=art, windows=args.windows, seq_len=args.seq_len, generate_prompts=0, progress=False)
        r["eval"][text] = [x.model_dump() for x in res]
        write_report(stem, r, render(r))
    print(render(r))


if __name__ == "__main__":
    main()
