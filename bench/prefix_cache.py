"""Prefix-caching benchmark: requests sharing a long system prompt, with and without the cache, same run.

For each engine (``--engine NAME=DIR``; ONNX Runtime engines of the builtin SmolLM2 on CPU), two
``LLMEngine``s in turn, identical but for ``RuntimeConfig.enable_prefix_caching``:

1. **warm-up**: one request with the system prompt (``--prefix`` tokens) and one question, 1 new token
   -- the steady state of a server whose system prompt some earlier request already sent (without the
   cache it leaves nothing behind);
2. **burst**: ``--requests`` requests, each the system prompt + its own question, added at once and run to
   completion (continuous batching, ``--max-batched-tokens`` per step); exactly ``--max-tokens`` new
   tokens each (greedy, ``ignore_eos``).

Measured on the burst: TTFT per request (its first token's time - its arrival, ``Sequence`` timestamps),
output tokens/s over the burst's wall time, the prefix-cache hit rate; and whether the greedy outputs
with and without the cache are the same. Ratios are cache / no-cache of the same run.
Results go to ``--out``.{json,md} with the command and the machine.

    .venv/bin/python bench/prefix_cache.py --engine int4=DIR --engine fp16=DIR [--requests 32 --prefix 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from trtkv.runtime.llm_engine import LLMEngine, RuntimeConfig
from trtkv.runtime.sequence import SamplingParams

TEXT = (
    "You are the support assistant of a company that sells paged key-value caches. Answer briefly and "
    "precisely, quote the documentation where it helps, and never invent a setting that does not exist. "
    "The cache keeps every sequence's keys and values in fixed-size blocks; quantized blocks hold more tokens. "
)


def system_prompt(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT * (1 + n // 30), add_special_tokens=False)
    assert len(ids) >= n
    return ids[:n]


def question(tokenizer, i: int) -> list[int]:
    return tokenizer.encode(f"\nQuestion {i}: how many tokens does block number {i * 7 % 13} hold?\nAnswer:", add_special_tokens=False)


def run_mode(engine_dir: Path, prefix_caching: bool, args) -> dict:
    llm = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(
        kv_memory_gib=args.kv_memory, max_seqs=args.requests, max_batched_tokens=args.max_batched_tokens, enable_prefix_caching=prefix_caching))
    tok = llm.tokenizer
    system = system_prompt(tok, args.prefix)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate([system + question(tok, 10_000)], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    before = llm.stats()
    t0 = time.monotonic()
    seqs = [llm.add_request(system + question(tok, i), params) for i in range(args.requests)]
    outs: dict[str, list[int]] = {s.request_id: [] for s in seqs}
    while llm.has_work():
        for o in llm.step():
            outs[o.request_id] += o.new_token_ids
    wall = time.monotonic() - t0
    after = llm.stats()
    ttft = [s.first_token_time - s.arrival_time for s in seqs]
    prompt_tokens = sum(len(s.prompt_ids) for s in seqs)
    hit = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    return {
        "prefix_caching": prefix_caching,
        "kv_format": after["kv_format"],
        "wall_s": wall,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p90_s": sorted(ttft)[int(0.9 * (len(ttft) - 1))],
        "output_tok_s": sum(len(v) for v in outs.values()) / wall,
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit,
        "hit_rate": hit / prompt_tokens,
        "blocks_cached_after": after["blocks_cached"],
        "blocks_evicted": after["blocks_evicted"],
        "bytes_per_block": after["bytes_per_block"],
        "pool_blocks": after["blocks_total"],
        "outputs": [outs[s.request_id] for s in seqs],
    }


def render(results: dict, args, command: str) -> str:
    lines = [
        f"# Prefix-caching benchmark ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, no GPU)",
        "",
        f"Command: `{command}`  ",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {args.requests} requests sharing a {args.prefix}-token system prompt, "
        f"{args.max_tokens} new tokens each, {args.max_batched_tokens} tokens per step, KV budget {args.kv_memory} GiB.",
        "",
        "| engine | KV format | prefix cache | hit rate | TTFT p50 / p90 s | TTFT p50 vs no-cache | output tok/s | vs no-cache | wall s | same outputs | bytes / cached block |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        off, on = r["off"], r["on"]
        same = on["outputs"] == off["outputs"]
        for m in (off, on):
            lines.append(
                f"| {name} | `{m['kv_format']}` | {'on' if m['prefix_caching'] else 'off'} | {m['hit_rate']:.1%} | "
                f"{m['ttft_p50_s']:.2f} / {m['ttft_p90_s']:.2f} | {m['ttft_p50_s'] / off['ttft_p50_s']:.3f}x | {m['output_tok_s']:.1f} | "
                f"{m['output_tok_s'] / off['output_tok_s']:.2f}x | {m['wall_s']:.1f} | {'yes' if same else 'NO'} | {m['bytes_per_block']:,} |"
            )
    return "\n".join(lines) + "\n"


def workload_args(ap: argparse.ArgumentParser) -> None:
    """The shared-prefix workload's options, the same offline (here) and through the server (prefix_cache_served.py)."""
    ap.add_argument("--engine", action="append", required=True, help="NAME=ENGINE_DIR (repeatable)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=1024, help="tokens of the shared system prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=RuntimeConfig().max_batched_tokens)
    ap.add_argument("--kv-memory", type=float, default=1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(ap)
    ap.add_argument("--out", type=Path, default=Path("bench/results/prefix-cache"))
    args = ap.parse_args()
    command = "python " + " ".join(sys.argv)
    results = {}
    for spec in args.engine:
        name, path = spec.split("=", 1)
        results[name] = {"off": run_mode(Path(path), False, args), "on": run_mode(Path(path), True, args)}
        r = results[name]
        print(f"{name}: TTFT p50 {r['off']['ttft_p50_s']:.2f}s -> {r['on']['ttft_p50_s']:.2f}s, "
              f"tok/s {r['off']['output_tok_s']:.1f} -> {r['on']['output_tok_s']:.1f}, hit rate {r['on']['hit_rate']:.1%}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    md = render(results, args, command)
    Path(f"{args.out}.md").write_text(md)
    Path(f"{args.out}.json").write_text(json.dumps(
        {"command": command, "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
         "args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
