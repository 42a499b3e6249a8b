"""How much throughput can KV capacity alone buy on this machine? The ceiling under the binding load of
``bench/vs_vllm.py --binding``.

The binding load (``bench/vs_vllm.py --binding``: N requests of P prompt tokens and G new tokens) costs every server
the same prefill work; what capacity changes is how many sequences decode together (vLLM's 1 GiB float32 cache holds 14
of them, trtkv's int4 pool all 64). So with one engine's own speeds, the least time the load can take when at most B
sequences decode together is

    T(B) = N * P / prefill_tok_s  +  N * G / decode_tok_s(B, context P + G / 2)

and T(small) / T(large) is the most that admitting ``large`` instead of ``small`` sequences can raise completed requests
per minute, whatever the scheduler does. Each speed is measured in a fresh process holding one torch engine (as it is
served): decode through ``bench/torch_engine.py``'s ``measure`` over a random-filled paged pool, prefill through
``bench/prefill.py``, both on the same machine in the same run. Results: bench/results/capacity-ceiling.{json,md}.

    .venv/bin/python bench/capacity_ceiling.py [--format int4] [--batches 14,64] [--requests 64] [--prompt 1536] [--new 256]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_engine import machine
from report import write_report
from torch_engine import measure

BENCH = Path(__file__).resolve().parent


def prefill_tok_s(model: str, fmt: str, tokens: int, reps: int, out: Path) -> float:
    """Prefill tokens/s of one ``tokens``-long prompt in one step plus its pool write (``bench/prefill.py``)."""
    subprocess.run([sys.executable, str(BENCH / "prefill.py"), "--model", model, "--tokens", str(tokens), "--formats", fmt,
                    "--reps", str(reps), "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    data = json.loads(next(out.glob("prefill*.json")).read_text())
    return tokens / (data["results"][fmt]["stored"]["total_ms"] / 1e3)


def render(r: dict) -> str:
    lo, hi = r["batches"][0], r["batches"][-1]
    lines = [f"# Capacity ceiling of the binding load on this machine ({r['date']})", "",
             f"Command: `{r['command']}`  ", f"Machine: {r['machine']}", "",
             f"Load: {r['requests']} requests x {r['prompt']} prompt tokens + {r['new']} new tokens; engine: torch, "
             f"`{r['format']}` KV, float32 `{r['model']}`. Prefill {r['prefill_tok_s']:.1f} tok/s "
             f"(one {r['prompt']}-token prompt per step); decode at context {r['context']}:", "",
             "| sequences decoding together | decode tok/s | tok/s per sequence | least time for the load, s | completed / min at most |",
             "|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        lines.append(f"| {row['batch']} | {row['decode_tok_s']:.1f} | {row['decode_tok_s'] / row['batch']:.2f} | "
                     f"{row['least_seconds']:.0f} | {row['completed_per_min']:.1f} |")
    lines += ["", f"Admitting {hi} sequences instead of {lo} can raise completed requests per minute by at most "
              f"**{r['ceiling']:.2f}x** on this machine (prefill alone takes {r['prefill_seconds']:.0f} s of the load)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model trtkv loads (default: the builtin SmolLM2-135M)")
    ap.add_argument("--format", default="int4", help="the KV format of the engine measured")
    ap.add_argument("--batches", default="14,64", help="sequences decoding together, smallest first")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1536)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="prefill rounds (the first is a warm-up)")
    ap.add_argument("--out", default=str(BENCH / "results"))
    args = ap.parse_args()

    from trtkv.builder.build import build_engine
    from trtkv.formats import DEFAULT_BLOCK_SIZE, get_format

    batches = [int(b) for b in args.batches.split(",")]
    block = get_format(args.format).block_size or DEFAULT_BLOCK_SIZE
    context = max(block, (args.prompt + args.new // 2) // block * block)  # decode_tps needs a whole number of blocks
    r = {"command": "python " + " ".join(sys.argv), "date": str(date.today()), "machine": machine(), "model": args.model, "format": args.format,
         "requests": args.requests, "prompt": args.prompt, "new": args.new, "context": context, "batches": batches, "rows": []}
    tmp = Path(tempfile.mkdtemp(prefix="trtkv-bench-ceiling-"))
    try:
        engine = build_engine(args.model, None, args.format, tmp / "engine", backend="torch", max_batch=max(batches),
                              max_seq_len=context + block)
        r["prefill_tok_s"] = prefill_tok_s(args.model, args.format, args.prompt, args.reps, tmp)
        r["prefill_seconds"] = args.requests * args.prompt / r["prefill_tok_s"]
        for b in batches:
            tps = measure(engine, argparse.Namespace(batch=b, context=context, steps=args.steps))
            least = r["prefill_seconds"] + args.requests * args.new / tps
            r["rows"].append({"batch": b, "decode_tok_s": tps, "least_seconds": least, "completed_per_min": args.requests / least * 60})
            print(r["rows"][-1], flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    r["ceiling"] = r["rows"][-1]["completed_per_min"] / r["rows"][0]["completed_per_min"]
    write_report(Path(args.out) / "capacity-ceiling", r, render(r))
    print(render(r))


if __name__ == "__main__":
    main()
