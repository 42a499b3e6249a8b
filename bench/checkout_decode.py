"""Torch-engine decode tokens/s of this checkout against another (a baseline: main, the last release), same engines,
same run, alternating.

The engines are built once (``bench/backend_parity.py``'s ``engine_for``: SmolLM2-135M, the ``trtkv`` CLI, int3 / int2
calibrated); each measurement is one fresh process of a checkout's own ``bench/torch_engine.py --worker`` (its Python,
its code) over a random-filled paged cache, batch 8 at ``--context`` tokens, the checkouts alternating within each of
``--reps`` rounds; the median per checkout and their ratio. Cases: ``preset:attention`` (``auto`` is the C kernels on
CPU). Results: bench/results/checkout-decode.md.

    .venv/bin/python bench/checkout_decode.py --baseline /work/main [--cases int4:auto,int3:auto,int4:torch] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backend_parity import engine_for
from build_engine import describe_machine, machine
from report import write_report

ROOT = Path(__file__).resolve().parents[1]
CASES = "fp16:auto,int8:auto,int4:auto,int3:auto,int2:auto,int4:torch,int3:torch"


def tok_s(checkout: Path, engine: Path, attention: str, args) -> float:
    python = checkout / ".venv" / "bin" / "python"
    cmd = [str(python), str(checkout / "bench" / "torch_engine.py"), "--worker", str(engine), "--batch", str(args.batch), "--context",
           str(args.context), "--steps", str(args.steps), "--attention", attention]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, cwd=checkout).stdout
    return json.loads(out.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="the other checkout (its .venv and bench/torch_engine.py)")
    ap.add_argument("--engines", default=str(ROOT / "trtkv-out" / "backend-parity"))
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1920, help="a multiple of 128: whole sealed blocks for every preset")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    here, base = ROOT, Path(args.baseline).resolve()
    t0 = time.perf_counter()
    data = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": str(date.today()), "machine": machine(), "cases": {}}
    rows = []
    for case in args.cases.split(","):
        preset, attention = case.split(":")
        engine = engine_for(preset, Path(args.engines), args.samples)
        got = {"this": [], "baseline": []}
        for r in range(args.reps):  # alternating, the first of each round switching sides
            order = [("this", here), ("baseline", base)] if r % 2 == 0 else [("baseline", base), ("this", here)]
            for name, checkout in order:
                got[name].append(tok_s(checkout, engine, attention, args))
        med = {k: statistics.median(v) for k, v in got.items()}
        data["cases"][case] = got
        rows.append(f"| {preset} | {attention} | {med['baseline']:.2f} | {med['this']:.2f} | {med['this'] / med['baseline']:.3f} | "
                    f"{min(got['this']) / max(got['baseline']):.2f}–{max(got['this']) / min(got['baseline']):.2f} |")
        print(rows[-1], flush=True)
        md = [f"# Torch-engine decode: this checkout vs {base} (SmolLM2-135M, CPU)", "",
              f"`{data['command']}` — {describe_machine(data['machine'])}, {data['date']}, {time.perf_counter() - t0:.0f} s so far. Batch {args.batch} x "
              f"{args.context} tokens, {args.steps} decode steps after a warm-up, each run a fresh process of the checkout's own "
              f"`bench/torch_engine.py --worker`, the checkouts alternating, median of {args.reps}.", "",
              "| preset | attention | baseline tok/s | this tok/s | this / baseline | range of ratios |", "|---|---|---|---|---|---|", *rows, ""]
        write_report(Path(args.out) / "checkout-decode", data, "\n".join(md))


if __name__ == "__main__":
    main()
