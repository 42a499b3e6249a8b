"""CPU decode throughput of the int3 / int2 presets against the int4 preset, through the torch engine's C kernels.

The int3 / int2 presets (keys before RoPE at per-channel widths, codebook values, int2's outlier lists) against the
int4 preset in the torch engine on CPU (batch 8, ~2048-token contexts); ``--presets`` takes other presets or spec
strings. Builds one torch engine per format with the ``trtkv`` CLI as a user would (``calibrate --kv P`` for the
formats that need calibrated constants, then ``build-engine --backend torch``), then measures each alone in a fresh
process over a random paged cache (``bench/torch_engine.py --worker``), rounds alternating the engines; the median of
``--reps`` runs, ratios against int4 from the same run. ``--torch-ops`` adds the int3 engine through the torch ops.
Results: bench/results/low-bit-decode.md.

    .venv/bin/python bench/low_bit_decode.py [--batch 8] [--context 1920] [--steps 3] [--reps 3] [--torch-ops]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_engine import describe_machine, machine
from report import write_report
from torch_engine import measure

ROOT = Path(__file__).resolve().parents[1]


def build(preset: str, out: Path, samples: int, max_seq_len: int) -> Path:
    """One torch engine of ``preset`` under ``out`` (calibrated first where the preset needs it)."""
    cli = str(Path(sys.executable).parent / "trtkv")
    engine = out / f"engine-{preset}"
    cmd = [cli, "build-engine", "--model", "smollm2-135m", "--backend", "torch", "--kv", preset, "--out", str(engine),
           "--max-seq-len", str(max_seq_len), "--force"]
    from trtkv.formats import get_format

    if get_format(preset).needs_calibration:  # codebooks, smoothing factors, per-channel bits: `trtkv calibrate`
        cal = out / f"calibration-{preset}"
        subprocess.run([cli, "calibrate", "--model", "smollm2-135m", "--kv", preset, "--samples", str(samples), "--out", str(cal)],
                       check=True, capture_output=True, text=True)
        cmd += ["--calibration", str(cal)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="int4,int3,int2", help="the first is the baseline")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1920, help="tokens per sequence (a multiple of 128: whole sealed blocks)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=8, help="calibration windows for the calibrated presets")
    ap.add_argument("--torch-ops", action="store_true", help="also int3 through the torch ops (attention torch)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    presets = args.presets.split(",")
    results: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": str(date.today()), "machine": machine(),
                     "batch": args.batch, "context": args.context, "steps": args.steps, "reps": args.reps, "rows": []}
    tmp = Path(tempfile.mkdtemp(prefix="trtkv-bench-lowbit-"))
    try:
        engines = {p: build(p, tmp, args.samples, args.context + 128) for p in presets}
        runs = [(p, "auto") for p in presets] + ([("int3", "torch")] if args.torch_ops and "int3" in engines else [])
        tok_s: dict = {key: [] for key in runs}
        for _ in range(args.reps):  # rounds alternate the engines: a slow moment of the machine hits each alike
            for key in runs:
                tok_s[key].append(measure(engines[key[0]], args, key[1]))
                print(key, round(tok_s[key][-1], 2), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = statistics.median(tok_s[presets[0], "auto"])
    from trtkv.formats import get_format

    for (preset, attention), xs in tok_s.items():
        med = statistics.median(xs)
        results["rows"].append({"preset": preset, "spec": get_format(preset).spec(), "attention": "C kernels" if attention == "auto" else "torch ops",
                                "tok_s": round(med, 2), "runs": [round(x, 2) for x in xs], f"vs_{presets[0]}": round(med / base, 3)})
    results["total_seconds"] = round(time.perf_counter() - t0, 1)
    stem = Path(args.out) / "low-bit-decode"
    write_report(stem, results, render(results, presets[0]))
    print(render(results, presets[0]))


def render(r: dict, base: str) -> str:
    lines = [
        f"# Decode of the below-4-bit presets against {base}: torch engine, CPU ({r['date']})",
        "",
        f"Command: `{r['command']}`  ",
        f"Machine: {describe_machine(r['machine'])}  ",
        f"SmolLM2-135M, float32, batch {r['batch']}, {r['context']}-token contexts (random sealed pool + open block), {r['steps']} timed "
        f"decode steps after one warm-up; each engine alone in a fresh process, rounds alternating the engines, median of {r['reps']}. "
        f"Total {r['total_seconds']} s.",
        "",
        f"| preset | KV format | attention | tok/s (median) | runs | vs {base} |",
        "|---|---|---|---:|---|---:|",
    ]
    for x in r["rows"]:
        lines.append(f"| {x['preset']} | `{x['spec']}` | {x['attention']} | {x['tok_s']} | {' / '.join(map(str, x['runs']))} | {x[f'vs_{base}']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
