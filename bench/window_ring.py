"""What the window ring gives a Gemma-3-shaped model: bytes per sequence, sequences per budget, decode speed.

The sliding layers of a cache with a window ring (``trtkv.cache_layout.WindowRing``, the torch engine's runtime
default) keep only the sealed blocks their window still reads; ``--keep-window-blocks`` keeps every block (what the
ONNX / TensorRT step networks need). Same model, same formats, same run:

* **bytes**: one sequence of ``--contexts`` tokens, as the runtime's budget counts it (``plan_budget``: pool blocks of
  the layers that keep blocks + per-slot open blocks and rings), and how many such sequences ``--budget-gib`` admits;
* **decode tokens/s** of the torch engine (CPU, torch attention) at batch ``--batch``: each configuration alone in a
  fresh process, alternated, median of ``--reps``, over a cache filled with random codes (throughput does not depend
  on the values; ``bench/build_engine.fill_random``);
* **agreement**: greedy logits of a real prefill + decode past the window, ring vs kept (max |diff|).

The model is a random Gemma 3 text model with Gemma 3 1B's attention shape (4 query heads, 1 KV head of 256, window
512, five local layers per global one) at 12 layers, hidden 512, vocabulary 2048 (the head does not change what the
cache costs). Plus the planner's numbers for Gemma 3 27B at 32k (``trtkv.plan``, the same ring arithmetic).
Results: bench/results/window-ring.{json,md}.

    .venv/bin/python bench/window_ring.py [--contexts 2048,8192] [--batch 4] [--steps 3] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_engine import decode_tps, fill_random, machine
from report import write_report

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(num_hidden_layers=12, hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
             sliding_window=512, vocab_size=2048, max_position_embeddings=32768, query_pre_attn_scalar=256)
BLOCK = 64


def make_model(directory: Path) -> None:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    Gemma3ForCausalLM(Gemma3TextConfig(**SHAPE)).save_pretrained(str(directory))


def _setup(model_dir: str, kv: str, ring: bool, slots: int, blocks: int):
    from trtkv.cache_layout import PagedKVLayout, WindowRing
    from trtkv.formats import fit_formats
    from trtkv.models import load_model
    from trtkv.runtime.kv_pool import PagedKVCache
    from trtkv.runtime.torch_engine import TorchEngine

    loaded = load_model(model_dir, device="cpu", dtype="float32")
    info = loaded.info
    [fmt], _ = fit_formats([kv], info.head_dim)
    lay = PagedKVLayout(fmt.with_block_size(BLOCK) if fmt.block_size is None else fmt, info.num_kv_heads, info.head_dim, BLOCK, blocks, slots)
    cache = PagedKVCache(lay, info.num_layers, ring=WindowRing.of(info, BLOCK) if ring else None)
    return TorchEngine(loaded.model, attention="torch", device="cpu"), cache, info


def worker(model_dir: str, kv: str, ring: bool, batch: int, ctx: int, steps: int) -> None:
    engine, cache, info = _setup(model_dir, kv, ring, batch, batch * (ctx // BLOCK + 1))
    fill_random(cache)
    print(json.dumps({"tok_s": decode_tps(engine, cache, batch, ctx, steps, info.vocab_size)}), flush=True)


def measure(model_dir: Path, kv: str, ring: bool, args, ctx: int) -> float:
    cmd = [sys.executable, __file__, "--worker", str(model_dir), "--kv", kv, "--batch", str(args.batch), "--context", str(ctx),
           "--steps", str(args.steps)] + (["--ring"] if ring else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["tok_s"]


def sequence_bytes(info, kv: str, ring: bool, ctx: int) -> int:
    """One sequence of ``ctx`` tokens as the runtime's budget counts it: its sealed blocks (of the layers that keep
    blocks) + its slot (open blocks, and the ring with one)."""
    from trtkv.cache_layout import PagedKVLayout, WindowRing
    from trtkv.formats import fit_formats

    [fmt], _ = fit_formats([kv], info.head_dim)
    lay = PagedKVLayout(fmt.with_block_size(BLOCK) if fmt.block_size is None else fmt, info.num_kv_heads, info.head_dim, BLOCK, 1, 1)
    L = info.num_layers
    r = WindowRing.of(info, BLOCK) if ring else None
    keeping = L - (len(r.layers) if r else 0)
    return (ctx // BLOCK) * lay.bytes_per_block() * keeping + lay.tail_bytes_per_slot() * L + (r.bytes_per_slot(lay) if r else 0)


def agreement(model_dir: str, kv: str) -> float:
    """Max |logit diff|, ring vs kept, over a 700-token prefill and 16 greedy steps, two sequences of different lengths."""
    from trtkv.runtime.verify import StaticBatch

    outs = []
    for ring in (False, True):
        engine, cache, _ = _setup(model_dir, kv, ring, 2, 40)
        sb = StaticBatch(cache, 2)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in (700, 590)]
        steps = [sb.prefill(engine, prompts)]
        for _ in range(16):
            nxt = steps[-1].argmax(-1)
            steps.append(sb.step(engine, {i: [int(nxt[i])] for i in range(2)}))
        outs.append(torch.stack(steps, 1))
    return (outs[0] - outs[1]).abs().max().item()


def planner_rows() -> list[dict]:
    """Gemma 3 27B (62 layers, 16 KV heads x 128, window 1024, 5 local : 1 global) at 32k, as `trtkv plan` counts it."""
    from trtkv.formats import PRESETS
    from trtkv.models import FULL_ATTENTION, SLIDING_ATTENTION
    from trtkv.plan import GIB, ModelShape, plan

    types = tuple(FULL_ATTENTION if (i + 1) % 6 == 0 else SLIDING_ATTENTION for i in range(62))
    shape = ModelShape("gemma-3-27b", 62, 16, 128, 0, types, 1024)
    plain = ModelShape("gemma-3-27b (every layer global)", 62, 16, 128)
    rows = []
    for s in (plain, shape):
        _, got = plan(s, [PRESETS["fp16"], PRESETS["int4"]], context_len=32768, gpu_bytes=141 * GIB)
        rows += [{"shape": s.name, "format": r.format, "kib_per_token": r.kv_bytes_per_token / 1024, "window_saving": r.window_saving} for r in got]
    return rows


def render(r: dict) -> str:
    lines = [f"# Window ring: a Gemma-3-shaped model ({r['date']})", "", f"Command: `{r['command']}`  ", f"Machine: {r['machine']}", "",
             f"Model: random Gemma 3 text, {r['shape']}; blocks of {BLOCK}; ring of {r['ring_blocks']} blocks per slot per sliding layer.", "",
             "## Bytes per sequence and sequences per budget (the runtime's own accounting)", "",
             f"| format | context | kept: MiB/seq | ring: MiB/seq | kept / ring | sequences in {r['budget_gib']} GiB, kept -> ring |", "|---|---:|---:|---:|---:|---|"]
    for row in r["bytes"]:
        lines.append(f"| {row['kv']} | {row['context']} | {row['kept'] / 2**20:.2f} | {row['ring'] / 2**20:.2f} | {row['kept'] / row['ring']:.2f}x | "
                     f"{row['seqs_kept']} -> {row['seqs_ring']} |")
    lines += ["", f"## Decode tokens/s, torch engine on CPU, batch {r['batch']} (median of {r['reps']}, each alone in a fresh process, alternated)", "",
              "| format | context | kept | ring | ring / kept |", "|---|---:|---:|---:|---:|"]
    for row in r["decode"]:
        lines.append(f"| {row['kv']} | {row['context']} | {row['kept']:.2f} | {row['ring']:.2f} | {row['ring'] / row['kept']:.2f}x |")
    lines += ["", "## Agreement (prefill 700 / 590 tokens + 16 greedy steps, ring vs kept)", "", "| format | max abs logit diff |", "|---|---:|"]
    lines += [f"| {kv} | {d:.2e} |" for kv, d in r["agreement"].items()]
    lines += ["", "## Gemma 3 27B at 32k context (`trtkv plan`, the same ring arithmetic)", "", "| shape | format | KiB/token | vs all-global |", "|---|---|---:|---:|"]
    lines += [f"| {p['shape']} | {p['format']} | {p['kib_per_token']:.1f} | {p['window_saving']:.2f}x |" for p in r["planner"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--kv", default="int4")
    ap.add_argument("--ring", action="store_true")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--formats", default="fp16,int4")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-gib", type=float, default=1.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "window-ring"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.kv, args.ring, args.batch, args.context, args.steps)
        return
    from trtkv.models import model_info

    tmp = Path(tempfile.mkdtemp()) / "gemma3-shaped"
    make_model(tmp)
    info = model_info(str(tmp))
    from trtkv.cache_layout import window_ring_blocks

    shape = ", ".join(f"{k} {v}" for k, v in SHAPE.items())
    r = {"date": str(date.today()), "command": " ".join(["python", *sys.argv]), "machine": machine(), "shape": shape, "batch": args.batch,
         "reps": args.reps, "budget_gib": args.budget_gib, "ring_blocks": window_ring_blocks(SHAPE["sliding_window"], BLOCK),
         "bytes": [], "decode": [], "agreement": {}, "planner": planner_rows()}
    contexts = [int(c) for c in args.contexts.split(",")]
    formats = args.formats.split(",")
    for kv in formats:
        for ctx in contexts:
            kept, ring = sequence_bytes(info, kv, False, ctx), sequence_bytes(info, kv, True, ctx)
            budget = int(args.budget_gib * 2**30)
            r["bytes"].append({"kv": kv, "context": ctx, "kept": kept, "ring": ring, "seqs_kept": budget // kept, "seqs_ring": budget // ring})
    stem = Path(args.out)
    write_report(stem, r, render(r))
    for kv in formats:
        r["agreement"][kv] = agreement(str(tmp), kv)
    write_report(stem, r, render(r))
    for kv in formats:
        for ctx in contexts:
            got = {False: [], True: []}
            for rep in range(args.reps):
                for ring in ((False, True) if rep % 2 == 0 else (True, False)):
                    got[ring].append(measure(tmp, kv, ring, args, ctx))
            r["decode"].append({"kv": kv, "context": ctx, "kept": statistics.median(got[False]), "ring": statistics.median(got[True])})
            write_report(stem, r, render(r))
    print(render(r))


if __name__ == "__main__":
    main()
