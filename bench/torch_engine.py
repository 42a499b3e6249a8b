"""CPU decode throughput of the torch engine vs the ONNX Runtime engine on the builtin SmolLM2-135M.

For each KV format (fp16 / int8 / int4): one ONNX Runtime engine (``build-engine --backend onnxruntime``) and one
torch engine (``--backend torch``: vectorized torch attention, float32), each measured alone in a fresh process
(as it is served) over the same paged cache, filled with random codes / scales (``bench/build_engine.fill_random``: throughput does not depend on the values), so that a
2048-token context needs no prefill. Decode tokens/s over ``--steps`` steps after one warm-up, both engines in
the same run on the same machine; ratios: torch / onnxruntime, and each engine's int8 / int4 vs its own fp16.
Results: bench/results/torch-engine.{json,md}.

    .venv/bin/python bench/torch_engine.py [--batch 8] [--context 2048] [--steps 3] [--reps 3] [--formats fp16,int8,int4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_engine import decode_tps, fill_random, machine
from report import write_report

ROOT = Path(__file__).resolve().parents[1]


def worker(engine_dir: str, batch: int, ctx: int, steps: int, attention: str = "auto") -> None:
    """One engine alone in this process (as it is served): print its decode tokens/s as JSON."""
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from trtkv.manifest import load_manifest
    from trtkv.runtime.backends import open_engine
    from trtkv.runtime.kv_pool import PagedKVCache

    m = load_manifest(engine_dir)
    engine = open_engine(engine_dir, manifest=m, **({"attention": attention} if m.backend == "torch" else {}))
    cache = PagedKVCache.for_engine(m, engine_dir, num_blocks=batch * (ctx // m.limits.block_size + 1), num_slots=batch)
    fill_random(cache)
    print(json.dumps({"tok_s": decode_tps(engine, cache, batch, ctx, steps, m.model.vocab_size)}), flush=True)


def measure(engine_dir: Path, args, attention: str = "auto") -> float:
    """Decode tokens/s of ``engine_dir`` alone in a fresh process (``--worker``), with the torch engine's ``attention``."""
    cmd = [sys.executable, __file__, "--worker", str(engine_dir), "--batch", str(args.batch), "--context", str(args.context),
           "--steps", str(args.steps), "--attention", attention]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout  # its stderr shows a failure
    return json.loads(out.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="fp16,int8,int4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="alternated torch / ONNX Runtime measurements per format (median)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--attention", default="auto", help="the torch engine's attention in a --worker run (auto / cpu / torch)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.batch, args.context, args.steps, args.attention)

    from trtkv.builder.build import build_engine
    from trtkv.models import load_model

    t0 = time.perf_counter()
    lm = load_model("smollm2-135m", device="cpu", dtype="float32")
    b, ctx = args.batch, args.context
    results: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": str(date.today()), "machine": machine(),
                     "batch": b, "context": ctx, "steps": args.steps, "reps": args.reps, "decode": []}
    engines = ("torch", "onnxruntime")
    tmp = Path(tempfile.mkdtemp(prefix="trtkv-bench-torch-"))
    try:
        dirs = {(kv, e): build_engine("smollm2-135m", None, kv, tmp / f"{e}-{kv}", backend=e, max_batch=b, max_seq_len=ctx + 64, loaded=lm)
                for kv in args.formats.split(",") for e in engines}
        del lm
        # Each measurement is a fresh process holding one engine, as serving does: two engines' thread pools in one
        # process steal each other's 2 cores. Rounds alternate formats and engines; the median is reported.
        runs: dict = {key: [] for key in dirs}
        for _ in range(args.reps):
            for key, d in dirs.items():
                runs[key].append(measure(d, args))
                print(key, round(runs[key][-1], 2), flush=True)
        for kv in args.formats.split(","):
            row = {"format": kv}
            for e in engines:
                row[f"{e}_tok_s"] = round(statistics.median(runs[kv, e]), 2)
                row[f"{e}_runs"] = [round(x, 2) for x in runs[kv, e]]
            row["torch_vs_onnxruntime"] = round(row["torch_tok_s"] / row["onnxruntime_tok_s"], 3)
            results["decode"].append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fp16 = next((r for r in results["decode"] if r["format"] == "fp16"), None)
    if fp16:
        for r in results["decode"]:
            r["torch_vs_own_fp16"] = round(r["torch_tok_s"] / fp16["torch_tok_s"], 3)
            r["onnxruntime_vs_own_fp16"] = round(r["onnxruntime_tok_s"] / fp16["onnxruntime_tok_s"], 3)
    results["total_seconds"] = round(time.perf_counter() - t0, 1)
    write_report(Path(args.out) / "torch-engine", results, render(results))
    print(render(results))


def render(r: dict) -> str:
    lines = [
        f"# Torch engine vs ONNX Runtime engine: CPU decode, SmolLM2-135M ({r['date']})",
        "",
        f"Command: `{r['command']}`  ",
        f"Machine: {r['machine']}  ",
        f"Batch {r['batch']}, context {r['context']} tokens (random sealed pool + open block), {r['steps']} timed decode steps after one warm-up, "
        f"median of {r.get('reps', 1)} alternated runs per engine; "
        f"each engine alone in a fresh process (as served), on the same random cache, in the same run; float32 compute. Total {r['total_seconds']} s.",
        "",
        "| format | torch engine tok/s | ONNX Runtime tok/s | torch / ORT | torch vs its fp16 | ORT vs its fp16 |",
        "|---|---|---|---|---|---|",
    ]
    for x in r["decode"]:
        lines.append(f"| {x['format']} | {x['torch_tok_s']} | {x['onnxruntime_tok_s']} | {x['torch_vs_onnxruntime']} | "
                     f"{x.get('torch_vs_own_fp16', '')} | {x.get('onnxruntime_vs_own_fp16', '')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
