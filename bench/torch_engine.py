"""CPU decode throughput of the torch engine vs the ONNX Runtime engine on the builtin SmolLM2-135M.

For each KV format (fp16 / int8 / int4): one ONNX Runtime engine (``build-engine --backend onnxruntime``) and the
torch engine (``TorchEngine``, vectorized torch attention, float32) over the SAME paged cache, filled with
random codes / scales (``bench/build_engine.fill_random``: throughput does not depend on the values), so that a
2048-token context needs no prefill. Decode tokens/s over ``--steps`` steps after one warm-up, both engines in
the same run on the same machine; ratios: torch / onnxruntime, and each engine's int8 / int4 vs its own fp16.
Results: bench/results/torch-engine-<date>.{json,md}.

    .venv/bin/python bench/torch_engine.py [--batch 8] [--context 2048] [--steps 3] [--formats fp16,int8,int4]
"""

from __future__ import annotations

import argparse
import os
import shutil
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="fp16,int8,int4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    from trtkv.builder.build import build_engine
    from trtkv.models import load_model
    from trtkv.runtime.backends import OnnxRuntimeEngine
    from trtkv.runtime.kv_pool import PagedKVCache
    from trtkv.runtime.torch_engine import TorchEngine

    t0 = time.perf_counter()
    lm = load_model("smollm2-135m", device="cpu", dtype="float32")
    b, ctx = args.batch, args.context
    results: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": str(date.today()), "machine": machine(),
                     "batch": b, "context": ctx, "steps": args.steps, "decode": []}
    tmp = Path(tempfile.mkdtemp(prefix="trtkv-bench-torch-"))
    try:
        for kv in args.formats.split(","):
            d = build_engine("smollm2-135m", None, kv, tmp / kv, backend="onnxruntime", max_batch=b, max_seq_len=ctx + 64, loaded=lm)
            ort = OnnxRuntimeEngine(d, spinning=False)  # idle ORT threads must not spin while torch runs
            cache = PagedKVCache.for_engine(ort.manifest, d, num_blocks=b * (ctx // ort.manifest.limits.block_size + 1), num_slots=b)
            fill_random(cache)
            row = {"format": kv}
            te = TorchEngine(lm.model, ort.manifest)  # first, so that nothing of ONNX Runtime's thread pool is busy
            row["torch_tok_s"] = round(decode_tps(te, cache, b, ctx, args.steps, lm.info.vocab_size), 2)
            row["onnxruntime_tok_s"] = round(decode_tps(ort, cache, b, ctx, args.steps, lm.info.vocab_size), 2)
            row["torch_vs_onnxruntime"] = round(row["torch_tok_s"] / row["onnxruntime_tok_s"], 3)
            results["decode"].append(row)
            print(row, flush=True)
            del cache, ort
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fp16 = next((r for r in results["decode"] if r["format"] == "fp16"), None)
    if fp16:
        for r in results["decode"]:
            r["torch_vs_own_fp16"] = round(r["torch_tok_s"] / fp16["torch_tok_s"], 3)
            r["onnxruntime_vs_own_fp16"] = round(r["onnxruntime_tok_s"] / fp16["onnxruntime_tok_s"], 3)
    results["total_seconds"] = round(time.perf_counter() - t0, 1)
    write_report(Path(args.out) / f"torch-engine-{results['date']}", results, render(results))
    print(render(results))


def render(r: dict) -> str:
    lines = [
        f"# Torch engine vs ONNX Runtime engine: CPU decode, SmolLM2-135M ({r['date']})",
        "",
        f"Command: `{r['command']}`  ",
        f"Machine: {r['machine']}  ",
        f"Batch {r['batch']}, context {r['context']} tokens (random sealed pool + open block), {r['steps']} timed decode steps after one warm-up; "
        f"both engines on the same cache in the same run; float32 compute. Total {r['total_seconds']} s.",
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
