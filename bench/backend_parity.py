"""Greedy texts of the torch engine on SmolLM2-135M through each CPU attention backend, and against a baseline checkout.

For each preset (fp16, int8, int4, int3, int2; int3 / int2 calibrated first with ``trtkv calibrate --dataset
builtin:pydoc``) one torch engine is built with the ``trtkv`` CLI, then every prompt is generated greedily with
``trtkv generate --engine E --attention torch`` and ``--attention cpu`` (one process per text, as a user runs it). With
``--baseline TRTKV`` (the ``trtkv`` command of another checkout, e.g. main's) the same prompts run through it too:
its default attention (``auto``: the C kernels on CPU) and, with ``TRTKV_CPU_KERNELS=0``, the torch ops (a checkout
whose CLI has no ``--attention`` option). The table says whether the texts are identical. Results:
bench/results/backend-parity.md.

    .venv/bin/python bench/backend_parity.py [--engines DIR] [--baseline /work/main/.venv/bin/trtkv] [-n 48]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_engine import describe_machine, machine
from report import write_report

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("fp16", "int8", "int4", "int3", "int2")
PROMPTS = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The history of the printing press begins in")


def cli() -> str:
    return str(Path(sys.executable).parent / "trtkv")


def engine_for(preset: str, out: Path, samples: int) -> Path:
    """The torch engine of ``preset`` under ``out`` (built once; calibrated first where the preset needs it)."""
    from trtkv.formats import get_format

    engine = out / f"engine-{preset}"
    if (engine / "manifest.json").is_file():
        return engine
    cmd = [cli(), "build-engine", "--model", "smollm2-135m", "--backend", "torch", "--kv", preset, "--out", str(engine), "--force"]
    if get_format(preset).needs_calibration:
        cal = out / f"calibration-{preset}"
        if not (cal / "recipe.json").is_file():
            subprocess.run([cli(), "calibrate", "--model", "smollm2-135m", "--dataset", "builtin:pydoc", "--kv", preset, "--samples",
                            str(samples), "--out", str(cal)], check=True, capture_output=True, text=True)
        cmd += ["--calibration", str(cal)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return engine


def generate(trtkv: str, engine: Path, prompt: str, n: int, attention: str | None, env: dict | None = None) -> str:
    """One greedy text (``trtkv generate --no-stream``'s stdout: the prompt and its continuation)."""
    cmd = [trtkv, "generate", prompt, "--engine", str(engine), "-n", str(n), "--no-stream"] + (["--attention", attention] if attention else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:2])} ... failed: {proc.stderr.strip()[-400:]}")
    return proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default=str(ROOT / "trtkv-out" / "backend-parity"), help="where the engines are built (kept)")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--baseline", help="the trtkv command of a baseline checkout (its default attention and TRTKV_CPU_KERNELS=0)")
    ap.add_argument("-n", "--max-tokens", type=int, default=48)
    ap.add_argument("--samples", type=int, default=16, help="calibration windows for int3 / int2")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    out = Path(args.engines)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs = {"torch": (cli(), "torch", None), "cpu": (cli(), "cpu", None)}
    if args.baseline:
        runs |= {"baseline auto": (args.baseline, None, None), "baseline torch ops": (args.baseline, None, {"TRTKV_CPU_KERNELS": "0"})}
    rows, data = [], {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": str(date.today()), "machine": machine(), "texts": {}}
    for preset in args.presets.split(","):
        engine = engine_for(preset, out, args.samples)
        for i, prompt in enumerate(PROMPTS):
            texts = {name: generate(trtkv, engine, prompt, args.max_tokens, att, env) for name, (trtkv, att, env) in runs.items()}
            data["texts"][f"{preset}/{i}"] = texts
            same = all(t == texts["torch"] for t in texts.values())
            rows.append(f"| {preset} | {i + 1} | {' | '.join('same' if t == texts['torch'] else 'DIFFERS' for t in texts.values())} | "
                        f"{'yes' if same else 'no'} |")
            print(rows[-1], flush=True)
    md = ["# Greedy texts per attention backend (SmolLM2-135M, torch engine, CPU)", "",
          f"`{data['command']}` — {describe_machine(data['machine'])}, {data['date']}, {time.perf_counter() - t0:.0f} s. Each text: one "
          f"`trtkv generate --engine E -n {args.max_tokens} --no-stream` process; compared with `--attention torch`'s text.", "",
          "| preset | prompt | " + " | ".join(runs) + " | all identical |", "|---" * (len(runs) + 3) + "|", *rows, ""]
    write_report(Path(args.out) / "backend-parity", data, "\n".join(md))


if __name__ == "__main__":
    main()
