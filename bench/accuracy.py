"""Accuracy table of the KV presets and the INT4 variants tried while choosing the ``int4`` preset.

Calibrates once on the dataset's calib split (``trtkv.calibration``: K/V statistics, then
``choose_params`` per row with that row's method and smoothing exponent), then evaluates every row
on the same held-out eval windows with ``trtkv.evaluate.evaluate_formats`` (really quantized cache,
unquantized baseline computed once per batch). Writes ``bench/results/accuracy-<rows>-<text>-<windows>x<seq-len>.md`` and
``.json`` with the command, the machine and the library versions.

    python bench/accuracy.py --rows presets                   # presets, 64 windows x 512 tokens
    python bench/accuracy.py --rows grid --windows 16         # block size x key layout
    python bench/accuracy.py --rows presets --eval-dataset builtin:shakespeare   # text unlike the calib corpus
    python bench/accuracy.py --rows int4,int8 --seq-len 2048 --windows 8        # long windows
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trtkv.evaluate import evaluate_formats, render_table, results_to_dict
from trtkv.formats import CALIBRATION_FREE, PRESETS, KVFormat, get_format

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_report

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Row:
    name: str
    spec: str  # preset name or inline spec
    method: str = "mse"  # calibration method for the row's params
    alpha: float = 0.5  # smoothing exponent (formats with smooth)
    note: str = ""
    codebook_per_head: bool = True  # nuq rows: one codebook per KV head (False: one per layer)
    codebook_weight_keys: bool = True  # nuq rows: key errors weighted by the queries' second moments

    def fmt(self) -> KVFormat:
        f = get_format(self.spec)
        return f if f.name == self.name else f.model_copy(update={"name": self.name})


K_TOKEN = "int4:token:asym:smooth:hadamard"  # best per-token key recipe without sealed blocks
K_CHANNEL = "int4:bchannel:asym"  # per channel over each sealed block (KIVI's key layout)
V_BEST = "int4:token:asym:hadamard"

ROWS: list[Row] = [
    # presets
    Row("int8", "int8", method="max", note="preset: keys per channel per sealed block of 64, values per token (no calibration)"),
    Row("int8-token", "k=int8:token,v=int8:token", method="max", note="per token, every token quantized on write"),
    Row("int8-static", "int8-static", note="preset (calibrated, shared K/V scale)"),
    Row("fp8", "fp8", note="preset (calibrated per-tensor scales)"),
    Row("int4", "int4", note="preset: keys rotated, per channel per sealed block of 64; values rotated, symmetric groups of 32; 4 sink tokens fp16"),
    Row("int4-token", "k=int4:token:asym:smooth:hadamard,v=int4:token:asym:hadamard", note="per token, keys smoothed+rotated, quantized on write"),
    Row("int4-g32", "k=int4:g32:sym,v=int4:g32:sym", method="max", note="symmetric groups of 32, no transforms (no calibration)"),
    # sealed blocks: block size x key layout (pool bits 4.5 at head_dim 64 for every row but block 16/32 bchannel)
    *[Row(f"int4-kch-b{b}", f"k={K_CHANNEL},v={V_BEST},block={b}", note=f"keys per channel per block, block {b}") for b in (16, 32, 64, 128)],
    *[Row(f"int4-ktok-b{b}", f"k={K_TOKEN},v={V_BEST},block={b}", note=f"keys per token smoothed+rotated, block {b}") for b in (16, 32, 64, 128)],
    Row("int4-kch-b64-vplain", f"k={K_CHANNEL},v=int4:token:asym,block=64", note="values not rotated"),
    Row("int4-kch-b64-vg32", f"k={K_CHANNEL},v=int4:g32:sym:hadamard,block=64", note="values symmetric groups of 32, rotated"),
    Row("int4-kch-b64-vch", f"k={K_CHANNEL},v=int4:bchannel:asym,block=64", note="values per channel per block too"),
    *[Row(f"int4-kch-b64-vg32-sink{n}", f"k={K_CHANNEL},v=int4:g32:sym:hadamard,block=64" + (f",sink={n}" if n else ""),
          note=f"first {n} tokens kept fp16 (attention sinks)" if n else "no sink tokens") for n in (0, 1, 4, 16)],
    Row("int4-kch-b32-vg32-sink4", f"k={K_CHANNEL},v=int4:g32:sym:hadamard,block=32,sink=4", note="block 32, 4 sink tokens"),
    Row("int3", "int3", note="preset: keys before RoPE, per-channel bits (3.5 on average) per sealed block of 128; values rotated, per token "
        "through a codebook; 4 sink tokens fp16"),
    Row("int2", "int2", note="preset: keys before RoPE, per-channel bits (2.25 on average) + 16 outliers per block of 128; values rotated, "
        "per token through a codebook + 48 outliers; 4 sink tokens fp16"),
    Row("int3-free", CALIBRATION_FREE["int3"], note="calibration-free: keys rotated, per channel per sealed block of 64; values rotated, "
        "symmetric groups of 32; 4 sink tokens fp16"),
    Row("int2-free", CALIBRATION_FREE["int2"], note="calibration-free: keys rotated, per channel per sealed block of 64; values rotated, "
        "asymmetric per token; 4 sink tokens fp16"),
    # keys per channel per block, not rotated
    Row("int3-kplain", "k=int3:bchannel:asym,v=int3:g32:sym:hadamard,block=64,sink=4", note="3-bit keys not rotated"),
    Row("int2-kplain", "k=int2:bchannel:asym,v=int2:token:asym:hadamard,block=64,sink=4", note="2-bit keys not rotated"),
    # below 4 bits: 3-bit rows <= 3.5 pool bits, 2-bit rows <= 2.5 at head_dim 64
    # which side costs the accuracy: one of K / V at the low bit width, the other at the int4 preset's recipe
    Row("int3-konly", "k=int3:bchannel:asym,v=int4:g32:sym:hadamard,block=64,sink=4", note="K int3, V int4 (K's share of the error; 4.0 bits)"),
    Row("int3-vonly", "k=int4:bchannel:asym,v=int3:g32:sym:hadamard,block=64,sink=4", note="K int4, V int3 (V's share of the error; 4.0 bits)"),
    Row("int2-konly", "k=int2:bchannel:asym,v=int4:g32:sym:hadamard,block=64,sink=4", note="K int2, V int4 (K's share; 3.5 bits)"),
    Row("int2-vonly", "k=int4:bchannel:asym,v=int2:token:asym:hadamard,block=64,sink=4", note="K int4, V int2 (V's share; 3.5 bits)"),
    Row("int3-vtok", "k=int3:bchannel:asym,v=int3:token:asym:hadamard,block=64,sink=4", note="values asymmetric per token"),
    Row("int3-vg64", "k=int3:bchannel:asym,v=int3:g64:sym:hadamard,block=64,sink=4", note="values symmetric groups of 64 (3.375 bits)"),
    Row("int3-vnohad", "k=int3:bchannel:asym,v=int3:g32:sym,block=64,sink=4", note="values not rotated"),
    Row("int3-sink0", "k=int3:bchannel:asym,v=int3:g32:sym:hadamard,block=64", note="no sink tokens"),
    Row("int3-b128", "k=int3:bchannel:asym,v=int3:g32:sym:hadamard,block=128,sink=4", note="block 128 (3.375 bits)"),
    Row("int2-vg32", "k=int2:bchannel:asym,v=int2:g32:sym:hadamard,block=64,sink=4", note="values symmetric groups of 32"),
    Row("int2-vnohad", "k=int2:bchannel:asym,v=int2:token:asym,block=64,sink=4", note="values not rotated"),
    Row("int2-khad", "k=int2:bchannel:asym:hadamard,v=int2:token:asym:hadamard,block=64,sink=4", note="keys rotated too"),
    Row("int3-khad", "k=int3:bchannel:asym:hadamard,v=int3:g32:sym:hadamard,block=64,sink=4", note="int3 preset, keys rotated too"),
    Row("int4-khad", "k=int4:bchannel:asym:hadamard,v=int4:g32:sym:hadamard,block=64,sink=4", note="int4 preset, keys rotated too"),
    Row("int4-ksmhad", "k=int4:bchannel:asym:smooth:hadamard,v=int4:g32:sym:hadamard,block=64,sink=4", note="keys smoothed (absmax ** 0.5) then rotated"),
    Row("int4-kqsmhad", "k=int4:bchannel:asym:qsmooth:hadamard,v=int4:g32:sym:hadamard,block=64,sink=4",
        note="keys smoothed (sqrt(rms_K / rms_Q)) then rotated"),
    Row("int3-ksmhad", "k=int3:bchannel:asym:smooth:hadamard,v=int3:g32:sym:hadamard,block=64,sink=4", note="keys smoothed (absmax ** 0.5) then rotated"),
    Row("int3-kqsmhad", "k=int3:bchannel:asym:qsmooth:hadamard,v=int3:g32:sym:hadamard,block=64,sink=4",
        note="keys smoothed (sqrt(rms_K / rms_Q)) then rotated"),
    Row("int2-ksmhad", "k=int2:bchannel:asym:smooth:hadamard,v=int2:token:asym:hadamard,block=64,sink=4", note="keys smoothed (absmax ** 0.5) then rotated"),
    Row("int2-kqsmhad", "k=int2:bchannel:asym:qsmooth:hadamard,v=int2:token:asym:hadamard,block=64,sink=4",
        note="keys smoothed (sqrt(rms_K / rms_Q)) then rotated"),
    Row("int2-sink0", "k=int2:bchannel:asym,v=int2:token:asym:hadamard,block=64", note="no sink tokens"),
    Row("int2-sink16", "k=int2:bchannel:asym,v=int2:token:asym:hadamard,block=64,sink=16", note="16 sink tokens"),
    Row("int2-b128", "k=int2:bchannel:asym,v=int2:token:asym:hadamard,block=128,sink=4", note="block 128 (2.375 bits)"),
    Row("int2-b32", "k=int2:bchannel:asym,v=int2:token:asym:hadamard,block=32,sink=4", note="block 32 (2.75 bits: over budget)"),
    # keys' block-channel ranges searched for the least squared error when a block is sealed (same bytes)
    Row("int4-kmse", "k=int4:bchannel:asym:mse,v=int4:g32:sym:hadamard,block=64,sink=4", note="int4 preset, key ranges MSE-searched per block-channel"),
    Row("int3-kmse", "k=int3:bchannel:asym:mse,v=int3:g32:sym:hadamard,block=64,sink=4", note="int3 preset, key ranges MSE-searched per block-channel"),
    Row("int2-kmse", "k=int2:bchannel:asym:mse,v=int2:token:asym:hadamard,block=64,sink=4", note="int2 preset, key ranges MSE-searched per block-channel"),
    Row("int8-b16", "k=int8:token,v=int8:token,block=16", method="max", note="int8 per token, block 16"),
    Row("int8-kch-b64", "k=int8:bchannel,v=int8:token,block=64", method="max", note="int8 keys per channel per block"),
]
GROUPS = {
    "presets": [r.name for r in ROWS if r.note.startswith("preset")],
    "grid": [r.name for r in ROWS if "-b" in r.name],
    "fewbits": [r.name for r in ROWS if r.name.startswith(("int3", "int2")) and "mse" not in r.name],
    "fewbits-diag": ["int3-free", "int2-free", "int3-konly", "int3-vonly", "int2-konly", "int2-vonly", "int3-vtok", "int3-b128", "int2-vg32", "int2-khad"],
    "mse": [r.name for r in ROWS if "mse" in r.name],
    "all": [r.name for r in ROWS],
}


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return {
        "uname": " ".join(platform.uname()),
        "cpu": cpu,
        "cpu_count": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=RESULTS.parent.parent).stdout.strip()
    except OSError:
        return ""


def calibrate(loaded, rows: list[Row], args) -> tuple[dict[str, list], int]:
    """Per-row calibrated params (rows whose format needs calibration or has dynamic scales to clip),
    and the number of calibration windows behind them."""
    from trtkv.calibration.run import wants_params
    from trtkv.calibration.scales import choose_params
    from trtkv.calibration.stats import KVStats, collect_stats
    from trtkv.data import token_windows, window_count

    need = [r for r in rows if wants_params(r.fmt(), r.method)]
    if not need:
        return {}, 0
    cache = Path(args.stats_cache) if args.stats_cache else None
    if cache is not None and cache.is_file():
        stats = KVStats.load(str(cache))
    else:
        n = min(window_count(loaded.tokenizer, args.dataset, seq_len=args.seq_len, split="calib"), args.calib_windows)
        windows = token_windows(loaded.tokenizer, args.dataset, seq_len=args.seq_len, samples=n, seed=args.seed, split="calib")
        print(f"calibration statistics on {n} x {args.seq_len} calib tokens", file=sys.stderr, flush=True)
        stats = collect_stats(loaded, windows, batch_size=args.batch_size, progress=False, seed=args.seed)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            stats.save(str(cache))
    rope = None
    if any(r.fmt().needs_rope for r in need):  # per-channel bits of keys stored before RoPE: each layer's RoPE table
        from trtkv.rope import RopeTable

        rope = RopeTable.per_layer(loaded.model)
    params = {r.name: choose_params(stats, r.fmt(), r.method, smooth_alpha=r.alpha, codebook_per_head=r.codebook_per_head,
                                    codebook_weight_keys=r.codebook_weight_keys, rope=rope) for r in need}
    return params, stats.count // args.seq_len


def to_markdown(data: dict, rows: dict[str, Row]) -> str:
    from trtkv.calibration.run import wants_params

    meta = data["meta"]
    lines = [
        f"# KV cache accuracy — {meta['date']}",
        "",
        f"Model `{meta['model']}`, dataset `{meta['dataset']}`: **{meta['windows']} eval-split windows x {meta['seq_len']} tokens** "
        f"({meta['tokens']:,} predicted positions); calibration on the calib split ({meta['calib_windows']} windows). "
        f"Evaluated on `{meta.get('eval_dataset', meta['dataset'])}` (eval split). "
        "Every format runs through the really-quantized transformers cache (`trtkv.kv_cache`): sealed-block formats "
        "see their own block in fp16 and older blocks quantized, exactly the paged engine's semantics; others are "
        "quantized on write; "
        "the fp16 baseline is computed once per batch. KL = mean KL(p_fp16 || p_format) in nats; "
        f"generation match = share of {meta['generate_tokens']} greedy tokens before the first divergence from fp16, "
        f"over {meta['generate_prompts']} prompts. Pool bits per element include scales / zero-points; bits@ctx is the mean "
        f"for one sequence of {meta['seq_len']} tokens with the fp16 open block of sealed formats counted in full.",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']['cpu']} ({meta['machine']['cpu_count']} threads), `{meta['machine']['uname']}`  ",
        f"torch {meta['machine']['torch']}, transformers {meta['machine']['transformers']}, trtkv commit {meta['commit']}, "
        f"wall time {meta['seconds']:.0f} s",
        "",
        "| format | spec | calib | pool bits | bits@ctx | ppl | Δppl % | KL mean | KL p99 | top-1 % | gen match % | note |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in data["results"]:
        row = rows.get(r["format"])
        if row is None or r["format"] == "fp16" or not row.fmt().is_quantized:
            calib = "-"
        elif not wants_params(row.fmt(), row.method):
            calib = "none"
        else:
            calib = row.method + (f", α={row.alpha:g}" if row.fmt().k.smooth or row.fmt().v.smooth else "")
        bits = f"{r['pool_bits_per_element']:.4g} | {r['bits_per_element']:.4g}"
        gm = "-" if r["generation_match"] is None else f"{100 * r['generation_match']:.1f}"
        lines.append(
            f"| {r['format']} | `{r['spec']}` | {calib} | {bits} | {r['ppl']:.4f} | "
            f"{r['ppl_delta_pct']:+.3f} | {r['kld_mean']:.5f} | {r['kld_p99']:.4f} | {100 * r['top1_agreement']:.2f} | {gm} | "
            f"{'' if row is None else row.note} |"
        )
    return "\n".join(lines) + "\n"


def default_stem(args) -> str:
    """A stable name per measurement (a rerun replaces it; git keeps the old one): what ran, on which text, how many windows."""
    text = (args.eval_dataset or args.dataset).removeprefix("builtin:").replace("/", "_")
    return f"accuracy-{args.rows if args.rows in GROUPS else 'rows'}-{text}-{args.windows}x{args.seq_len}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dataset", default="builtin:pydoc")
    p.add_argument("--eval-dataset", default=None, help="evaluate on this dataset's eval split (default: --dataset)")
    p.add_argument("--rows", default="all", help="all | presets | grid | comma-separated row names")
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-windows", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--generate-prompts", type=int, default=8)
    p.add_argument("--generate-tokens", type=int, default=32)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--stats-cache", default=None, help="reuse / write the calibration statistics here")
    p.add_argument("--out", default=None, help="output stem (default bench/results/accuracy-<rows>-<text>-<windows>x<seq-len>)")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--render", default=None, metavar="JSON", help="only rewrite the .md next to a results .json")
    args = p.parse_args(argv)
    if args.render:
        path = Path(args.render)
        data = json.loads(path.read_text())
        path.with_suffix(".md").write_text(to_markdown(data, {r.name: r for r in ROWS}))
        return 0

    from trtkv.data import token_windows
    from trtkv.models import load_model

    names = GROUPS.get(args.rows) or [n.strip() for n in args.rows.split(",") if n.strip()]
    by_name = {r.name: r for r in ROWS}
    unknown = [n for n in names if n not in by_name and n not in PRESETS]
    if unknown:
        p.error(f"unknown rows {unknown}; known: {', '.join(by_name)}")
    rows = [by_name.get(n) or Row(n, n) for n in names]

    t0 = time.time()
    loaded = load_model(args.model, args.device, args.dtype)
    params, calib_windows = calibrate(loaded, rows, args)
    windows = token_windows(loaded.tokenizer, args.eval_dataset or args.dataset, seq_len=args.seq_len, samples=args.windows, seed=args.seed, split="eval")
    info = loaded.info
    results = evaluate_formats(
        loaded.model,
        windows,
        [r.fmt() for r in rows],
        lambda f: params.get(f.name),
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        batch_size=args.batch_size,
        generate_prompts=args.generate_prompts,
        generate_tokens=args.generate_tokens,
        progress=sys.stderr.isatty(),
        on_batch=lambda done, total: print(f"  {done}/{total} windows, {time.time() - t0:.0f} s", file=sys.stderr, flush=True),
    )
    seconds = time.time() - t0
    from rich.console import Console

    Console(width=160).print(render_table(results))
    date = dt.date.today().isoformat()
    meta = {
        "date": date,
        "command": "python bench/accuracy.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "model": args.model,
        "dataset": args.dataset,
        "eval_dataset": args.eval_dataset or args.dataset,
        "windows": int(windows.shape[0]),
        "seq_len": args.seq_len,
        "tokens": results[0].tokens,
        "calib_windows": calib_windows,
        "generate_prompts": args.generate_prompts,
        "generate_tokens": args.generate_tokens,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).replace("torch.", ""),
        "machine": machine(),
        "commit": git_commit(),
        "seconds": round(seconds, 1),
        "rows": {r.name: {"spec": r.fmt().spec(), "method": r.method, "alpha": r.alpha, "note": r.note,
                          "codebook_per_head": r.codebook_per_head, "codebook_weight_keys": r.codebook_weight_keys} for r in rows},
    }
    data = results_to_dict(results, meta)
    if not args.no_write:
        stem = write_report(Path(args.out) if args.out else RESULTS / default_stem(args), data, to_markdown(data, {r.name: r for r in rows}))
        print(f"wrote {stem}.md and .json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
