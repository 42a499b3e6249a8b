"""Benchmark of trtkv build-engine on the builtin SmolLM2-135M.

* build time and engine size per backend (ONNX Runtime engines for fp16 / int8 / int4; a TensorRT-RTX SM89 plan);
* ONNX Runtime CPU decode throughput (tokens/s) for fp16, int8 and int4 pools at batch 1 and 8, contexts 512
  and 2048, side by side with the torch reference path (``TorchReferenceEngine``: transformers reading the same
  paged cache through ``gather_paged``) in the same run;
* pool bytes per token against fp16 (targets: int4 >= 3.5x smaller, int8 >= 1.9x).

The pools are filled with random codes / scales (throughput does not depend on the values) so that a 2048-token
context needs no 2048-token prefill. Results: bench/results/build-engine.{json,md}.

    .venv/bin/python bench/build_engine.py [--steps 3] [--no-rtx] [--formats fp16,int8,int4]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
from report import write_report  # bench/ is the script's folder: the first entry of sys.path

ROOT = Path(__file__).resolve().parents[1]


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def fill_random(cache, seed: int = 0) -> None:
    """Random codes, scales and rows in every cache tensor (throughput does not depend on the values); outlier lists get
    positions inside their block."""
    g = torch.Generator().manual_seed(seed)
    for name, t in cache.tensors.items():
        if "outlier_index" in name:
            t.copy_(torch.randint(0, cache.block_size * cache.layout.head_dim, t.shape, generator=g).to(t.dtype))
        elif t.dtype in (torch.int8, torch.uint8):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.int32).to(torch.uint8))
        elif name.endswith("scale"):
            t.copy_((torch.rand(t.shape, generator=g) * 0.02 + 0.001).half())
        else:
            t.copy_((torch.randn(t.shape, generator=g) * 0.5).half())


def decode_tps(engine, cache, batch: int, ctx: int, steps: int, vocab: int) -> float:
    """Tokens/s of ``steps`` decode steps (after one warm-up) for ``batch`` sequences at context ``ctx``."""
    from trtkv.runtime.step import StepBatch

    bs = cache.block_size
    nblocks = ctx // bs + 1
    tables = [[b * nblocks + i for i in range(nblocks)] for b in range(batch)]
    times = []
    for s in range(steps + 1):
        c = ctx + s  # one more token each step; the batch stays within the open block (ctx % bs == 0, steps < bs)
        sb = StepBatch.make([[int(torch.randint(0, vocab, ()))] for _ in range(batch)], [c] * batch, tables, list(range(batch)))
        t0 = time.perf_counter()
        engine.step(sb, cache)
        if s:
            times.append(time.perf_counter() - t0)
    return batch * len(times) / sum(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="fp16,int8,int4")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-rtx", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    from rich.console import Console

    from trtkv.builder.build import build_engine
    from trtkv.formats import get_format
    from trtkv.models import load_model
    from trtkv.runtime.backends import OnnxRuntimeEngine, TorchReferenceEngine
    from trtkv.runtime.kv_pool import PagedKVCache

    console = Console()
    formats = args.formats.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    t0 = time.perf_counter()
    lm = load_model("smollm2-135m", device="cpu", dtype="float32")
    info = lm.info
    tmp = Path(tempfile.mkdtemp(prefix="trtkv-bench-"))
    results: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": str(date.today()), "machine": machine(), "builds": {}, "decode": [], "bytes_per_token": {}}
    try:
        engines = {}
        for kv in formats:
            t = time.perf_counter()
            d = build_engine("smollm2-135m", None, kv, tmp / kv, backend="onnxruntime", max_batch=max(batches), max_seq_len=max(contexts) + 64, loaded=lm)
            engines[kv] = d
            from trtkv.manifest import load_manifest

            m = load_manifest(d)
            results["builds"][f"onnxruntime/{kv}"] = {"seconds": round(time.perf_counter() - t, 1), "stage_seconds": m.build["stage_seconds"], "engine_bytes": dir_bytes(d)}
            fp16_bytes = get_format("fp16").kv_bytes_per_token(info.num_layers, info.num_kv_heads, info.head_dim)
            results["bytes_per_token"][kv] = {"pool": m.bytes_per_token, "vs_fp16": round(fp16_bytes / m.bytes_per_token, 3),
                                              "tail_bytes_per_slot": m.tail_bytes_per_slot}
            console.print(f"built {kv}: {results['builds'][f'onnxruntime/{kv}']}")
        if not args.no_rtx:
            t = time.perf_counter()
            d = build_engine("smollm2-135m", None, "int4", tmp / "rtx", backend="tensorrt-rtx", compute_capabilities=[89], max_batch=8, max_seq_len=2048, loaded=lm)
            from trtkv.manifest import load_manifest

            m = load_manifest(d)
            results["builds"]["tensorrt-rtx/int4/SM89"] = {
                "seconds": round(time.perf_counter() - t, 1), "stage_seconds": m.build["stage_seconds"], "engine_bytes": dir_bytes(d),
                "plan_bytes": m.plans[0].bytes, "plan_build_seconds": m.plans[0].build_seconds}
            console.print(f"built tensorrt-rtx: {results['builds']['tensorrt-rtx/int4/SM89']}")
            shutil.rmtree(d, ignore_errors=True)
        ref = TorchReferenceEngine(lm.model)
        for kv in formats:
            eng = OnnxRuntimeEngine(engines[kv], spinning=False)  # idle ORT threads must not spin while torch runs
            for ctx in contexts:
                for b in batches:
                    nblocks = b * (ctx // eng.manifest.limits.block_size + 1)
                    cache = PagedKVCache.for_engine(eng.manifest, engines[kv], num_blocks=nblocks, num_slots=b)
                    fill_random(cache)
                    row = {"format": kv, "batch": b, "context": ctx}
                    if not args.no_torch:  # first, so that nothing of ONNX Runtime's thread pool is busy
                        with torch.inference_mode():
                            row["torch_reference_tok_s"] = round(decode_tps(ref, cache, b, ctx, args.steps, info.vocab_size), 2)
                    row["onnxruntime_tok_s"] = round(decode_tps(eng, cache, b, ctx, args.steps, info.vocab_size), 2)
                    results["decode"].append(row)
                    console.print(row)
                    del cache
            del eng
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["total_seconds"] = round(time.perf_counter() - t0, 1)
    write_report(Path(args.out) / "build-engine", results, render(results))
    console.print(render(results))


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    import onnxruntime

    return {"cpu": cpu, "cores": os.cpu_count(), "load_avg_1min_at_start": load, "python": platform.python_version(), "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
            "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()}


def describe_machine(m: dict | str) -> str:
    """``machine()``'s dict as a report line: CPU, cores, load at the start, versions, commit (a string as it is)."""
    if isinstance(m, str):
        return m
    load = m.get("load_avg_1min_at_start")
    return ", ".join(x for x in (m.get("cpu"), f"{m.get('cores')} cores", None if load is None else f"load average {load:.1f} at the start",
                                 f"Python {m.get('python')}", f"torch {m.get('torch')}", f"onnxruntime {m.get('onnxruntime')}",
                                 f"commit {m.get('git')}") if x)


def render(r: dict) -> str:
    lines = [f"# build-engine benchmark ({r['date']})", "", f"Command: `{r['command']}`  ", f"Machine: {describe_machine(r['machine'])}", "", "## Builds", "",
             "| engine | seconds | stages | size |", "|---|---|---|---|"]
    for k, v in r["builds"].items():
        size = f"{v['engine_bytes'] / 2**20:.1f} MiB" + (f" (plan {v['plan_bytes'] / 2**20:.1f} MiB, built in {v['plan_build_seconds']} s)" if "plan_bytes" in v else "")
        lines.append(f"| {k} | {v['seconds']} | {v['stage_seconds']} | {size} |")
    lines += ["", "## Pool bytes per token (K+V, 30 layers, scales included)", "", "| format | bytes/token | smaller than fp16 | fp16 open blocks per slot |", "|---|---|---|---|"]
    for k, v in r["bytes_per_token"].items():
        lines.append(f"| {k} | {v['pool']:.0f} | {v['vs_fp16']}x | {v['tail_bytes_per_slot']:,} B |")
    lines += ["", "## Decode throughput, ONNX Runtime CPU vs the torch reference path (tokens/s)", "", "| format | batch | context | onnxruntime | torch reference |", "|---|---|---|---|---|"]
    for row in r["decode"]:
        lines.append(f"| {row['format']} | {row['batch']} | {row['context']} | {row['onnxruntime_tok_s']} | {row.get('torch_reference_tok_s', '—')} |")
    lines += ["", f"Total: {r['total_seconds']} s.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
