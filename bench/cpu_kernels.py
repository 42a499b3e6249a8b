"""trtkv's CPU decode attention kernel (plugins/cpu_attention.c) per KV format: the time of one layer's decode call.

A pool of random codes / scales per format (throughput does not depend on the values), every sequence holding
``--context`` sealed tokens, one decode call per measurement (``decode_model_space``: what the torch engine runs per
layer and step) at each of ``--threads`` (the engine passes its step's torch threads; the kernel splits the
sequences and heads over them); formats and thread counts alternated ``--reps`` times in one process and the best of
``--iters`` calls kept per round, the median over rounds reported, with each format's time against the first format's
and against its own time at the first thread count, from the same rounds.
Results: bench/results/cpu-kernels[-threads-1-2].{json,md}.

    .venv/bin/python bench/cpu_kernels.py [--batch 8] [--context 2048] [--formats fp16 int8 int4] [--threads 1 2] [--reps 5] [--iters 40]
"""

from __future__ import annotations

import argparse
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
from trtkv.calibration.channel_bits import allocate
from trtkv.formats import get_format
from trtkv.plugins import cpu_attention as ca
from trtkv.quant import TensorParams

ROOT = Path(__file__).resolve().parents[1]
HEADS, HEAD_DIM, QUERIES, BLOCK = 3, 64, 3, 64  # SmolLM2-135M: 3 KV heads of 64 channels, 3 query heads each


def rope_table(positions: int, base: float = 100000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotate-half RoPE table (cos, sin) [positions, HEAD_DIM] with SmolLM2's base, for keys stored before RoPE."""
    inv_freq = base ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat([angles, angles], -1)
    return emb.cos(), emb.sin()


def allocated_widths(tf, g: torch.Generator) -> torch.Tensor:
    """Code widths [HEADS, HEAD_DIM] of an ``allocB`` format as calibration gives them: the greedy allocation over
    channels whose ranges spread like a model's (log-normal), each bit quartering a channel's error."""
    spread = torch.exp(torch.randn(HEADS, HEAD_DIM, 1, generator=g))
    errors = spread * 4.0 ** -torch.tensor(tf.channel_widths, dtype=torch.float32)
    return allocate(errors, tf.channel_widths, tf.row_code_bits(HEAD_DIM)).float()


def decode_call(spec: str, batch: int, context: int, seed: int):
    """A ready decode call of ``spec`` over random pools: a zero-argument function."""
    g = torch.Generator().manual_seed(seed)
    fmt = get_format(spec)
    block = fmt.block_size or BLOCK  # a format's own sealed blocks (the int3 / int2 presets: 128)
    fmt = fmt.with_block_size(block)
    nb = context // block
    lay = PagedKVLayout(fmt, HEADS, HEAD_DIM, block, batch * nb, batch)
    pools, codecs = [], []
    for which in "kv":
        tf = lay.tensor_format(which)
        params = TensorParams(smooth=torch.rand(HEADS, HEAD_DIM, generator=g) + 0.5 if tf.smooth else None,  # nuq: random levels
                              codebook=torch.sort(torch.randn(tf.codebook_levels, generator=g), -1).values if tf.codebook else None,
                              bits=allocated_widths(tf, g) if tf.allocated_bits is not None else None)
        pool = lay.allocate(which)
        if pool.outlier_index is not None:  # outN: positions inside the block, fp16 values
            pool.outlier_index.copy_(torch.randint(0, block * HEAD_DIM, pool.outlier_index.shape, generator=g).to(pool.outlier_index.dtype))
        for t in (pool.data, pool.scale, pool.zero, pool.tail, pool.outlier_value):
            if t is None:
                continue
            if t.dtype == torch.uint8 or t.dtype == torch.int8:
                t.copy_(torch.randint(0, 256, t.shape, generator=g).to(torch.uint8).view(t.dtype))
            else:
                t.copy_(torch.rand(t.shape, generator=g) * 0.1)
        pools.append(pool)
        codecs.append(ca.RowCodec.of(tf, params, HEADS, HEAD_DIM, block))
    tables = torch.arange(batch * nb).view(batch, nb)
    ctx = torch.full((batch,), context)
    rope = rope_table(context + 1) if fmt.k.pre_rope else None  # keys stored before RoPE read it
    step = ca.DecodeStep(tables, torch.full((batch,), nb), nb, torch.arange(batch), torch.zeros(batch), ctx, torch.zeros(batch), ctx,
                         rope=rope)
    q = torch.randn(batch, HEADS, QUERIES, HEAD_DIM, generator=g)
    nk, nv = torch.randn(batch, HEADS, HEAD_DIM, generator=g), torch.randn(batch, HEADS, HEAD_DIM, generator=g)
    return lambda: ca.decode_model_space(codecs[0], codecs[1], pools[0], pools[1], step, q, nk, nv, 0.125, None, None, lay.sink_tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=["fp16", "int8", "int4"], help="presets or spec strings; the first is the baseline")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--threads", type=int, nargs="+", default=[1], help="threads of each decode call; the first is the baseline")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    if (why := ca.unavailable()) is not None:
        raise SystemExit(f"trtkv's CPU kernels cannot run here: {why}")
    specs, threads = args.formats, args.threads
    calls = {s: decode_call(s, args.batch, args.context, seed=i) for i, s in enumerate(specs)}
    rounds: dict[tuple[str, int], list[float]] = {(s, t): [] for t in threads for s in specs}
    for _ in range(args.reps):
        for s, t in rounds:
            torch.set_num_threads(t)
            f = calls[s]
            f()
            best = float("inf")
            for _ in range(args.iters):
                t0 = time.perf_counter()
                f()
                best = min(best, time.perf_counter() - t0)
            rounds[(s, t)].append(best)
    rows = args.batch * HEADS * args.context
    ratio = lambda key, base: statistics.median(a / b for a, b in zip(rounds[key], rounds[base]))
    result: dict[str, dict] = {}
    for s in specs:
        per = {}
        for t in threads:
            ms = statistics.median(rounds[(s, t)]) * 1e3
            per[str(t)] = {"ms_per_layer": ms, "ns_per_row_head": ms * 1e6 / rows, "vs_first": ratio((s, t), (specs[0], t)),
                           "speedup": ratio((s, threads[0]), (s, t)), "rounds_ms": [x * 1e3 for x in rounds[(s, t)]]}
        result[s] = {**per[str(threads[0])], "threads": per}
    data = {"command": "python " + " ".join(sys.argv), "machine": machine(), "batch": args.batch, "context": args.context, "threads": threads,
            "heads": HEADS, "head_dim": HEAD_DIM, "queries_per_head": QUERIES, "block": BLOCK, "results": result}
    lines = [f"# trtkv CPU decode kernel, {date.today()}", "", f"Command: `{data['command']}`  ",
             f"Machine: {data['machine']}  ",
             f"One layer's decode call (`decode_model_space`), batch {args.batch}, {args.context} sealed tokens per sequence, "
             f"{HEADS} KV heads x {HEAD_DIM} channels, {QUERIES} queries per KV head, block {BLOCK} (a format with its own: that one, 128 for the -nuq presets); median of "
             f"{args.reps} alternated rounds (every format at every thread count) of the best of {args.iters} calls.", "",
             f"| format | threads | ms per layer | ns per (row, head) | vs {specs[0]} | speedup vs {threads[0]} thread(s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for s, r in result.items():
        for t, x in r["threads"].items():
            lines.append(f"| `{s}` | {t} | {x['ms_per_layer']:.2f} | {x['ns_per_row_head']:.0f} | {x['vs_first']:.2f} | {x['speedup']:.2f} |")
    stem = write_report(Path(args.out) / f"cpu-kernels{'' if threads == [1] else '-threads-' + '-'.join(map(str, threads))}",
                        data, "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written: {stem}.json, {stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
