"""The torch engine's prefill on CPU per KV format: prompts in steps across blocks, then the runtime's pool write.

``--prompts`` prompts of ``--tokens`` random token ids go through the torch engine with trtkv's CPU kernels
(``attention="cpu"``: the blocks a step fills before its last token are sealed inside the step for its later queries)
in steps of ``--chunk`` tokens each (default: all of them in one step; the server's scheduler gives 8 prompts 64
tokens each per step at its default 512-token budget: ``--prompts 8 --chunk 64``, whose later steps read the blocks
sealed before them through the kernels' dequant), each step followed by ``PagedKVCache.write_new_rows``, which copies
the rows into the open blocks and stores the full blocks. Two ways of storing them are measured on the same
step output: ``stored`` (the pool stores the codes the step made, ``StepOutput.sealed``: what the runtime does) and
``resealed`` (``sealed=None``: the pool quantizes the same rows again, as every engine without in-step seals does).
Formats and modes alternate ``--reps`` rounds in one process (the first round is a warm-up); the median step, write and
total per format and mode, and each total against the first format's ``stored`` total from the same rounds.
Results: bench/results/prefill.{json,md}.

    .venv/bin/python bench/prefill.py [--model smollm2-135m] [--tokens 512] [--prompts 1] [--chunk TOKENS] [--formats fp16 int4]
                                      [--threads 2] [--reps 6]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_engine import machine
from report import write_report

from trtkv.cache_layout import PagedKVLayout
from trtkv.formats import get_format
from trtkv.models import load_model, model_info
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.step import StepBatch
from trtkv.runtime.torch_engine import TorchEngine

ROOT = Path(__file__).resolve().parents[1]
MODES = ("stored", "resealed")


def prefill(engine: TorchEngine, layout: PagedKVLayout, layers: int, prompts: list[list[int]], chunk: int, mode: str) -> tuple[float, float]:
    """(step seconds, pool write seconds), summed over the steps, of ``prompts`` (one length) in steps of ``chunk``
    tokens each over a fresh cache."""
    cache = PagedKVCache(layout, layers)
    per = layout.num_blocks // len(prompts)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    step = write = 0.0
    for start in range(0, len(prompts[0]), chunk):
        batch = StepBatch.make([p[start : start + chunk] for p in prompts], [start] * len(prompts), tables, list(range(len(prompts))))
        t0 = time.perf_counter()
        out = engine.step(batch, cache)
        t1 = time.perf_counter()
        if mode == "resealed":
            out = dataclasses.replace(out, sealed=None)
        cache.write_new_rows(batch, out)
        step, write = step + t1 - t0, write + time.perf_counter() - t1
    return step, write


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a model trtkv loads (default: the builtin SmolLM2-135M)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per prompt")
    ap.add_argument("--prompts", type=int, default=1, help="prompts prefilled together, one step batch")
    ap.add_argument("--chunk", type=int, help="tokens of each prompt per step (default: all in one step)")
    ap.add_argument("--formats", nargs="+", default=["fp16", "int4"], help="presets or spec strings; the first is the baseline")
    ap.add_argument("--block", type=int, default=64, help="block size of formats that do not name one")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = model_info(args.model)
    engine = TorchEngine(load_model(args.model, device="cpu", dtype="float32").model, attention="cpu", device="cpu")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, info.vocab_size, (args.tokens,), generator=gen).tolist() for _ in range(args.prompts)]
    chunk = args.chunk or args.tokens
    layouts = {}
    for spec in args.formats:
        fmt = get_format(spec)
        bs = fmt.block_size or args.block
        per = -(-args.tokens // bs) + 1
        layouts[spec] = PagedKVLayout(fmt.with_block_size(bs), info.num_kv_heads, info.head_dim, bs, per * args.prompts, args.prompts)
    rounds: dict[tuple[str, str], list[tuple[float, float]]] = {(s, m): [] for s in args.formats for m in MODES}
    for rep in range(args.reps):
        for key in rounds:
            t = prefill(engine, layouts[key[0]], info.num_layers, prompts, chunk, key[1])
            if rep:
                rounds[key].append(t)
    base = rounds[(args.formats[0], "stored")]
    result: dict[str, dict] = {}
    for (spec, mode), ts in rounds.items():
        result.setdefault(spec, {})[mode] = {
            "step_ms": statistics.median(s for s, _ in ts) * 1e3, "write_ms": statistics.median(w for _, w in ts) * 1e3,
            "total_ms": statistics.median(s + w for s, w in ts) * 1e3,
            "vs_first": statistics.median((s + w) / (bs + bw) for (s, w), (bs, bw) in zip(ts, base)),
            "rounds_ms": [[s * 1e3, w * 1e3] for s, w in ts]}
    data = {"command": "python " + " ".join(sys.argv), "machine": machine(), "model": args.model, "tokens": args.tokens,
            "prompts": args.prompts, "chunk": chunk,
            "threads": args.threads, "reps": args.reps, "results": result}
    first = args.formats[0]
    lines = [f"# trtkv torch engine prefill (CPU kernels), {date.today()}", "", f"Command: `{data['command']}`  ",
             f"Machine: {data['machine']}  ",
             f"Model {args.model}, float32; {args.prompts} prompt(s) of {args.tokens} random tokens in steps of {chunk} tokens each "
             f"(steps across blocks), each step followed by the pool write; {args.threads} torch threads; median of {args.reps - 1} "
             "alternated rounds after a warm-up, step and write times summed over the steps. `stored`: the pool stores the codes the "
             "step sealed (the runtime); `resealed`: it quantizes the rows again.", "",
             f"| format | pool write | step ms | write ms | total ms | vs `{first}` stored |", "|---|---|---:|---:|---:|---:|"]
    for spec, modes in result.items():
        for mode, x in modes.items():
            lines.append(f"| `{spec}` | {mode} | {x['step_ms']:.1f} | {x['write_ms']:.1f} | {x['total_ms']:.1f} | {x['vs_first']:.3f} |")
    shape = "" if args.prompts == 1 and chunk == args.tokens else f"-{args.prompts}x{chunk}"
    stem = write_report(Path(args.out) / f"prefill{shape}", data, "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written: {stem}.json, {stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
