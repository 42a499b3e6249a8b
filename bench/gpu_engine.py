"""Prepared GPU run of the torch engine. NOT YET RUN ON A GPU: only ``--dry-run`` has run (CPU, tiny
shapes, Triton kernels under ``TRITON_INTERPRET=1``; tests/test_gpu_engine_dry_run.py).

Sections (the report, JSON + md, is rewritten after every section, so a cut run keeps what finished):

1. ``capacity``: at one KV budget (``--budget-gib``, default 100 GiB) and the Llama-3-8B shape (32 layers,
   32 q / 8 KV heads, head_dim 128), how many sequences fp16 / int8 / int4 admit at 4k and 32k tokens
   (pool blocks + each sequence's fp16 open blocks; byte counts from ``PagedKVLayout``).
2. ``decode``: end-to-end decode through ``TorchEngine`` (transformers Llama, random bf16 weights, the paged
   attention of the Triton kernels) for each format at the fp16 maximum batch and at the format's own maximum
   (4k context; 32k too when time is left). Caches hold synthetic sealed blocks written by the seal kernel
   (``torch.ops.trtkv.seal_blocks`` from random rows), not prefilled through the model. Per step: tokens/s, and
   the time split into weights (step minus attention), attention (the L paged-decode kernel calls of one step,
   timed alone on the same inputs) and seal (one open block per sequence sealed, every layer, K and V).
3. ``smollm2``: the real SmolLM2-135M weights: greedy tokens of the torch engine on the GPU (float32, kernels)
   equal the CPU engine's (float32, vectorized torch attention) for fp16 / int8 / int4, except at near-ties.
   ``--dry-run``: the tiny random model instead, kernels under the interpreter vs the torch path.

Decode steps replay CUDA graphs (``TorchEngine(cuda_graphs=True)``, one per padded batch shape); each decode point
also times the eager step and records the largest logit difference between the two (the dry run pads, eagerly). Fits 9 minutes on an H200 by design (``--time-limit``, default
480 s: sections past the limit are skipped and say so). APIs: torch >= 2.11, triton >= 3.6, transformers >= 5.17.

    python bench/gpu_engine.py [--out bench/results] [--budget-gib 100] [--time-limit 480]
    TRITON_INTERPRET=1 python bench/gpu_engine.py --dry-run --out /tmp/gpu-dry
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trtkv.attention import TritonKernels
from trtkv.cache_layout import PagedKVLayout
from trtkv.formats import fit_formats
from trtkv.models import load_model
from trtkv.plugins import ops  # registers torch.ops.trtkv.*
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.step import StepBatch
from trtkv.runtime.torch_engine import TorchEngine
from trtkv.runtime.verify import StaticBatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_report

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3

FULL = dict(layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=14336, vocab=128256, block=64,
            contexts=(4096, 32768), max_positions=131072)
DRY = dict(layers=2, heads=4, kv_heads=2, head_dim=32, hidden=128, intermediate=256, vocab=512, block=16,
           contexts=(48,), max_positions=1024)  # the dry run checks the code path: one context is enough
FORMATS = ("fp16", "int8", "int4")


class Report:
    def __init__(self, out: Path, args, shape: dict):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.data = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "date": str(date.today()), "dry_run": args.dry_run,
            "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
            "versions": {"torch": torch.__version__, "triton": _version("triton"), "transformers": _version("transformers")},
            "shape": shape, "budget_gib": args.budget_gib, "sections": {}, "skipped": [],
        }
        self.stem = out / ("gpu-engine-dry-run" if args.dry_run else "gpu-engine")

    def section(self, name: str, value) -> None:
        self.data["sections"][name] = value
        self.write()

    def write(self) -> None:
        write_report(self.stem, self.data, render(self.data))


def _version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def layouts(shape: dict, num_blocks: int = 1, num_slots: int = 1) -> dict:

    fmts, _ = fit_formats(list(FORMATS), shape["head_dim"])
    return {kv: PagedKVLayout(f.with_block_size(shape["block"]), shape["kv_heads"], shape["head_dim"], shape["block"], num_blocks, num_slots)
            for kv, f in zip(FORMATS, fmts)}


def admitted(layout, layers: int, budget: int, context: int) -> int:
    """Sequences of ``context`` tokens a budget holds: each needs its sealed blocks and its slot's open blocks."""
    per_seq = (context // layout.block_size) * layout.bytes_per_block() * layers + layout.tail_bytes_per_slot() * layers
    return budget // per_seq


def capacity(shape: dict, budget: int) -> dict:
    out = {}
    for kv, lay in layouts(shape).items():
        out[kv] = {"bytes_per_token": lay.bytes_per_block() * shape["layers"] / lay.block_size,
                   "tail_bytes_per_slot": lay.tail_bytes_per_slot() * shape["layers"],
                   **{f"seqs_at_{c}": admitted(lay, shape["layers"], budget, c) for c in shape["contexts"]}}
    return out


def random_llama(shape: dict, device, dtype):

    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                      head_dim=shape["head_dim"], max_position_embeddings=shape["max_positions"], tie_word_embeddings=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    return model


def synthetic_cache(layout, layers: int, batch: int, context: int, device):
    """A cache whose sequences ``0 … batch-1`` each hold ``context`` tokens: sealed blocks written by the seal
    kernel from random rows (chunks of up to 4096 blocks share their rows: values do not change the timing),
    open blocks and sink rows random fp16. Returns (cache, block_tables [batch, blocks_per_seq + 1])."""

    bs = layout.block_size
    per_seq = context // bs + 1  # sealed blocks + the one the open block seals into
    cache = PagedKVCache(layout, layers, device=device)
    cache.tensors["k_tail"].normal_(0, 0.5)
    cache.tensors["v_tail"].normal_(0, 0.5)
    n = layout.num_blocks
    chunk = min(n, 4096)
    rows = torch.randn(chunk, layout.num_kv_heads, bs, layout.head_dim, device=device, dtype=torch.float16)
    for start in range(0, n, chunk):
        blocks = torch.arange(start, min(n, start + chunk), device=device)
        for layer in range(layers):
            for which in ("k", "v"):
                pool = cache.pool(layer, which)
                torch.ops.trtkv.seal_blocks(rows[: len(blocks)], blocks, pool.data, pool.scale, pool.zero, layout.tensor_format(which).short())
    tables = torch.arange(batch * per_seq, device=device).view(batch, per_seq)
    return cache, tables


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, reps: int) -> float:
    fn()  # warm-up (compiles on first use)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / reps


def decode_point(model, layout, shape: dict, batch: int, context: int, device, reps: int) -> dict:

    L, bs = shape["layers"], layout.block_size
    cache, tables = synthetic_cache(layout, L, batch, context, device)
    engine = TorchEngine(model, attention="kernels", cuda_graphs=True)  # on CPU (dry run): the padded steps, eagerly
    eager = TorchEngine(model, attention="kernels", cuda_graphs=False)
    ctx = torch.full((batch,), context, dtype=torch.long, device=device)
    batch_in = StepBatch(
        input_ids=torch.randint(0, shape["vocab"], (batch, 1), device=device), context_lens=ctx,
        new_lens=torch.ones(batch, dtype=torch.long, device=device), block_tables=tables,
        slot_ids=torch.arange(batch, device=device))
    last = {}  # each path's last output: the graph / eager comparison costs no extra step
    eager_s = _timed(lambda: last.__setitem__("eager", eager.step(batch_in, cache)), device, reps)
    step_s = _timed(lambda: last.__setitem__("graph", engine.step(batch_in, cache)), device, reps)  # warm-up captures the graph
    graph_diff = (last["graph"].logits - last["eager"].logits).abs().max().item()
    q = torch.randn(batch, shape["heads"], shape["head_dim"], device=device, dtype=model.dtype)
    kn = torch.randn(batch, shape["kv_heads"], shape["head_dim"], device=device, dtype=torch.float16)

    def attention():
        for layer in range(L):
            ops.decode_attention(q, layout, cache.pool(layer, "k"), cache.pool(layer, "v"), kn, kn, tables, ctx, batch_in.slot_ids)

    attn_s = _timed(attention, device, reps)
    blocks = tables[:, -1]

    def seal():
        for b in range(batch):
            cache.seal(b, int(blocks[b]), 1)

    cache.seal_through(TritonKernels(device, seal_kernel=True))  # the seal kernel (on CPU, the dry run: under the interpreter)
    seal_s = _timed(seal, device, 1)
    return {"batch": batch, "context": context, "step_ms": round(step_s * 1e3, 3), "tokens_per_s": round(batch / step_s, 1),
            "eager_step_ms": round(eager_s * 1e3, 3), "cuda_graphs": engine.cuda_graphs and device.type == "cuda",
            "graph_vs_eager_max_logit_diff": graph_diff,
            "attention_ms": round(attn_s * 1e3, 3), "weights_ms": round(max(step_s - attn_s, 0.0) * 1e3, 3),
            "seal_all_sequences_ms": round(seal_s * 1e3, 3), "seal_ms_per_step_amortized": round(seal_s * 1e3 / bs, 3)}


def decode_section(shape: dict, budget: int, device, deadline: float, reps: int, report: Report) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_llama(shape, device, dtype)
    cap = report.data["sections"]["capacity"]
    points = []
    for context in shape["contexts"]:
        fp16_max = cap["fp16"][f"seqs_at_{context}"]
        for kv in layouts(shape):
            own_max = cap[kv][f"seqs_at_{context}"]
            for label, batch in (("fp16_max", fp16_max), ("own_max", own_max)):
                if batch < 1 or (label == "own_max" and kv == "fp16"):
                    continue
                if time.monotonic() > deadline:
                    report.data["skipped"].append(f"decode {kv} {label} batch {batch} at {context}: time limit")
                    report.write()
                    continue
                lay = layouts(shape, num_blocks=batch * (context // shape["block"] + 1), num_slots=batch)[kv]
                row = {"format": kv, "batch_is": label, **decode_point(model, lay, shape, batch, context, device, reps)}
                points.append(row)
                print(row, flush=True)
                report.section("decode", points)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    report.section("decode", points)
    del model


def smollm2_section(shape: dict, device, dry: bool, report: Report) -> None:
    """Greedy tokens of the engine on ``device`` (kernels) vs the CPU engine (torch attention), per format."""

    if dry:  # the interpreter runs 30 layers far too slowly: the tiny random Llama stands in
        def load(dev):
            torch.manual_seed(0)
            return random_llama(shape, dev, torch.float32)
        block, vocab = shape["block"], shape["vocab"]
        prompts = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 20, 5)]
        new_tokens = 4
    else:
        def load(dev):
            return load_model("smollm2-135m", device=str(dev), dtype="float32").model
        tok = load_model("smollm2-135m", device="cpu", dtype="float32").tokenizer
        text = "def fibonacci(n):\n    '''Return the n-th Fibonacci number.'''\n    if n < 2:\n        return n\n"
        prompts = [tok(text * 3).input_ids[:n] for n in (150, 70, 20)]
        block, new_tokens = 64, 32
    cpu_model, dev_model = load(torch.device("cpu")), load(device)
    cfg = cpu_model.config
    H, D, L = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads, cfg.num_hidden_layers
    fmts, _ = fit_formats(list(FORMATS), D)
    cpu_engine = TorchEngine(cpu_model, attention="torch")
    dev_engine = TorchEngine(dev_model, attention="kernels")
    out = {}
    for kv, f in zip(FORMATS, fmts):
        runs = []
        for engine, dev in ((cpu_engine, torch.device("cpu")), (dev_engine, device)):
            lay = PagedKVLayout(f.with_block_size(block), H, D, block, 16, len(prompts))
            cache = PagedKVCache(lay, L, device=dev)
            sb = StaticBatch(cache, len(prompts))
            logits = [sb.prefill(engine, prompts).float().cpu()]
            feed = runs[0]["logits"] if runs else None  # the device engine gets the CPU engine's tokens
            for s in range(new_tokens - 1):
                src = logits[-1] if feed is None else feed[s]
                logits.append(sb.step(engine, {i: [int(src[i].argmax())] for i in range(len(prompts))}).float().cpu())
            runs.append({"logits": torch.stack(logits)})
        a, b = runs[0]["logits"], runs[1]["logits"]
        differ = (a.argmax(-1) != b.argmax(-1)).nonzero().tolist()
        gaps = [float(a[s, i].topk(2).values.diff().abs()) for s, i in differ]
        out[kv] = {"max_abs_logit_diff": float((a - b).abs().max()), "tokens": int(a.shape[0] * a.shape[1]),
                   "tokens_differ": len(differ), "top2_gap_where_differ": [round(g, 4) for g in gaps],
                   "equal_except_near_ties": all(g < 0.15 for g in gaps)}
        print(kv, out[kv], flush=True)
        report.section("smollm2" if not dry else "tiny_kernels_vs_cpu", out)


def render(d: dict) -> str:
    s = d["sections"]
    lines = [f"# Torch engine on the GPU{' (DRY RUN: CPU, tiny shapes, Triton interpreter)' if d['dry_run'] else ''} ({d['date']})", "",
             f"Command: `{d['command']}`  ", f"Machine: {d['machine']}  ", f"Versions: {d['versions']}  ",
             f"Shape: {d['shape']}; KV budget {d['budget_gib']} GiB. Decode: CUDA graphs (eager step time beside it).", ""]
    if "capacity" in s:
        ctxs = [k for k in next(iter(s["capacity"].values())) if k.startswith("seqs_at_")]
        lines += ["## Capacity", "", "| format | B/token | " + " | ".join(ctxs) + " |", "|---" * (2 + len(ctxs)) + "|"]
        lines += [f"| {kv} | {v['bytes_per_token']:.0f} | " + " | ".join(str(v[c]) for c in ctxs) + " |" for kv, v in s["capacity"].items()]
        lines.append("")
    if "decode" in s:
        lines += ["## Decode", "",
                  "| format | batch | context | tok/s | step ms | eager step ms | graph vs eager logits | weights ms | attention ms | seal ms (all seqs) |",
                  "|---" * 10 + "|"]
        lines += [f"| {r['format']} | {r['batch']} ({r['batch_is']}) | {r['context']} | {r['tokens_per_s']} | {r['step_ms']} | {r['eager_step_ms']} | "
                  f"{r['graph_vs_eager_max_logit_diff']:.2g} | {r['weights_ms']} | "
                  f"{r['attention_ms']} | {r['seal_all_sequences_ms']} |" for r in s["decode"]]
        lines.append("")
    for key in ("smollm2", "tiny_kernels_vs_cpu"):
        if key in s:
            lines += [f"## {key}: device engine vs CPU engine", "", "| format | max logit diff | tokens differing / total | equal except near-ties |", "|---|---|---|---|"]
            lines += [f"| {kv} | {v['max_abs_logit_diff']} | {v['tokens_differ']} / {v['tokens']} | {v['equal_except_near_ties']} |" for kv, v in s[key].items()]
            lines.append("")
    if d["skipped"]:
        lines += ["## Skipped", ""] + [f"* {x}" for x in d["skipped"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, kernels under TRITON_INTERPRET=1")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--budget-gib", type=float, default=None, help="KV budget (default 100 GiB; dry run 0.0001 GiB)")
    ap.add_argument("--time-limit", type=float, default=480.0, help="seconds; sections past it are skipped")
    ap.add_argument("--reps", type=int, default=None, help="timed steps per point (default 5; dry run 1)")
    args = ap.parse_args()
    t0 = time.monotonic()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # the custom ops read it at call time
        device, shape = torch.device("cpu"), DRY
        args.budget_gib = args.budget_gib or 0.0001
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --dry-run on CPU")
        device, shape = torch.device("cuda"), FULL
        args.budget_gib = args.budget_gib or 100.0
    reps = args.reps or (1 if args.dry_run else 5)

    report = Report(Path(args.out), args, shape)
    budget = int(args.budget_gib * GIB)
    report.section("capacity", capacity(shape, budget))
    deadline = t0 + args.time_limit
    decode_section(shape, budget, device, deadline - 120 if not args.dry_run else deadline, reps, report)  # keep 2 min for SmolLM2
    if time.monotonic() < deadline:
        try:
            smollm2_section(shape, device, args.dry_run, report)
        except Exception as exc:
            report.data["skipped"].append(f"smollm2: {type(exc).__name__}: {exc}")
            if args.dry_run:
                raise
    else:
        report.data["skipped"].append("smollm2: time limit")
    report.data["total_seconds"] = round(time.monotonic() - t0, 1)
    report.data["complete"] = True
    report.write()
    print(render(report.data))


if __name__ == "__main__":
    main()
