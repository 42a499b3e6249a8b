"""Prefix caching through the server: requests sharing a long system prompt, with and without the cache, same run.

For each engine (``--engine NAME=DIR``) and each mode (prefix cache on, then off -- what ``trtkv serve`` and
``trtkv serve --no-prefix-cache`` write: the same repository but for ``enable_prefix_caching``), a fresh
tritonserver on loopback, then

1. **warm-up**: one request with the system prompt (``--prefix`` tokens) and one question, 1 new token: the steady
   state of a server whose system prompt an earlier request already sent (without the cache it leaves nothing);
2. **burst**: ``--requests`` streaming requests (``generate_stream``), each the system prompt + its own question,
   sent at once from as many client threads, greedy, exactly ``--max-tokens`` new tokens each
   (``min_tokens`` = ``max_tokens``).

Measured on the burst, from the client: TTFT (first streamed response - request sent), output tokens/s over the
burst's wall time; from the server's metrics: prefix-cache hit tokens and prompt tokens; and whether the greedy
texts with and without the cache are the same. Ratios are cache / no-cache of the same run.
Results: ``--out``.{json,md}, with the command, the machine and its load average.

    .venv/bin/python bench/prefix_cache_served.py --engine int4=DIR --engine fp16=DIR [--requests 32 --prefix 1024 --max-tokens 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefix_cache import workload_args
from report import write_report
from serve import machine, pct

from trtkv.runtime.config import RuntimeConfig
from trtkv.triton_repo.client import stream_generate
from trtkv.triton_repo.repository import RepoOptions, write_repository
from trtkv.triton_repo.server import TritonServer, free_port

TEXT = (
    "You are the support assistant of a company that sells paged key-value caches. Answer briefly and "
    "precisely, quote the documentation where it helps, and never invent a setting that does not exist. "
    "The cache keeps every sequence's keys and values in fixed-size blocks; quantized blocks hold more tokens. "
)


def system_prompt(tokenizer, n: int) -> str:
    ids = tokenizer.encode(TEXT * (1 + n // 30), add_special_tokens=False)
    return tokenizer.decode(ids[:n])


def question(i: int) -> str:
    return f"\nQuestion {i}: how many tokens does block number {i * 7 % 13} hold?\nAnswer:"


def burst(url: str, prompts: list[str], max_tokens: int) -> dict:
    """All prompts at once, one client thread each; TTFT and texts per request, tokens/s over the wall time."""
    recs: list[dict | None] = [None] * len(prompts)
    errors: list[str] = []
    go = threading.Event()

    def one(i: int) -> None:
        go.wait()
        t0 = time.monotonic()
        try:
            pieces = list(stream_generate(url, prompts[i], max_tokens, timeout=3600, min_tokens=max_tokens, temperature=0.0))
        except Exception as exc:  # reported in the results
            errors.append(f"{type(exc).__name__}: {exc}")
            return
        recs[i] = {"ttft": pieces[0].t - t0, "text": "".join(p.text for p in pieces), "responses": len(pieces), "end": pieces[-1].t}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    go.set()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    done = [r for r in recs if r is not None]
    ttft = [r["ttft"] for r in done]
    return {
        "requests": len(prompts),
        "completed": len(done),
        "errors": errors[:3],
        "wall_s": wall,
        "output_tokens": max_tokens * len(done),
        "output_tok_s": max_tokens * len(done) / wall,
        "request_per_s": len(done) / wall,
        "ttft_s": {f"p{q}": pct(ttft, q) for q in (50, 90, 99)},
        "texts": [r["text"] if r else None for r in recs],
    }


def run_mode(name: str, engine_dir: Path, prefix_caching: bool, args, workdir: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(engine_dir / "tokenizer"), local_files_only=True)
    system = system_prompt(tok, args.prefix)
    runtime = RuntimeConfig(kv_memory_gib=args.kv_memory, max_seqs=args.requests, max_batched_tokens=args.max_batched_tokens,
                            enable_prefix_caching=prefix_caching)
    opts = RepoOptions(runtime=runtime, instance_kind="cpu")
    mode = "on" if prefix_caching else "off"
    repo = write_repository(engine_dir, workdir / f"repo-{name}-{mode}", opts, force=True)
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_file=workdir / f"server-{name}-{mode}.log")
    with server:
        url = server.http_url
        list(stream_generate(url, system + question(10_000), 1, temperature=0.0))  # warm-up: the system prompt once
        server.wait_for_metric("trtkv_requests_total", 1, state="finished")
        hit0 = sum(server.metric_values("trtkv_prefix_cache_hit_tokens_total"))
        load0 = os.getloadavg()
        res = burst(url, [system + question(i) for i in range(args.requests)], args.max_tokens)
        server.wait_for_metric("trtkv_requests_total", 1 + res["completed"], state="finished")
        res["load_avg"] = [round(x, 2) for x in os.getloadavg()]
        res["load_avg_before"] = [round(x, 2) for x in load0]
        hit = sum(server.metric_values("trtkv_prefix_cache_hit_tokens_total")) - hit0
        prompt_tokens = sum(len(tok.encode(system + question(i))) for i in range(args.requests))
        blocks = dict(zip(("used", "free", "cached"), (0, 0, 0)))
        for state in blocks:
            blocks[state] = int(sum(server.metric_values("trtkv_kv_blocks", state=state)))
        res.update(prefix_caching=prefix_caching, prompt_tokens=prompt_tokens, hit_tokens=int(hit), hit_rate=hit / prompt_tokens,
                   blocks_after=blocks, peak_running=int(max(server.metric_values("trtkv_peak_running_sequences"))),
                   preemptions=int(max(server.metric_values("trtkv_preemptions_total"))))
    print(f"[{name} cache {mode}] TTFT p50 {res['ttft_s']['p50']:.2f} s, {res['output_tok_s']:.2f} tok/s, wall {res['wall_s']:.1f} s, "
          f"hit rate {res['hit_rate']:.1%}, load {res['load_avg']}", flush=True)
    return res


def render(data: dict) -> str:
    a = data["args"]
    lines = [
        f"# Prefix caching through the server ({data['machine']['cpu']}, {data['machine']['cores']} cores, no GPU)",
        "",
        f"Command: `{data['command']}`  ",
        f"Date: {data['date']}; {a['requests']} concurrent streaming requests sharing a {a['prefix']}-token system prompt, "
        f"{a['max_tokens']} new tokens each (greedy, min_tokens = max_tokens), {a['max_batched_tokens']} tokens per step, "
        f"KV budget {a['kv_memory']} GiB; a fresh tritonserver per row.",
        "",
        "| engine | prefix cache | hit rate | TTFT p50 / p99 s | TTFT p50 vs no-cache | output tok/s | vs no-cache | req/s | wall s | completed | same texts | load avg (1/5/15 min) after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in data["engines"].items():
        off, on = r.get("off"), r.get("on")
        for m in (on, off):
            if m is None:
                continue
            vs_t = f"{m['ttft_s']['p50'] / off['ttft_s']['p50']:.3f}x" if off else "-"
            vs_s = f"{m['output_tok_s'] / off['output_tok_s']:.2f}x" if off else "-"
            same = "-" if not (on and off) else ("yes" if on["texts"] == off["texts"] else "NO")
            lines.append(
                f"| {name} | {'on' if m['prefix_caching'] else 'off'} | {m['hit_rate']:.1%} | {m['ttft_s']['p50']:.2f} / {m['ttft_s']['p99']:.2f} | "
                f"{vs_t} | {m['output_tok_s']:.2f} | {vs_s} | {m['request_per_s']:.3f} | {m['wall_s']:.1f} | {m['completed']}/{m['requests']} | "
                f"{same} | {' / '.join(str(x) for x in m['load_avg'])} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(ap)
    ap.add_argument("--out", type=Path, default=Path("bench/results/prefix-cache-served"))
    args = ap.parse_args()
    data = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "engines": {},
    }
    stem = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="trtkv-bench-") as tmp:
        for spec in args.engine:
            name, path = spec.split("=", 1)
            data["engines"][name] = {}
            for caching in (True, False):
                data["engines"][name]["on" if caching else "off"] = run_mode(name, Path(path), caching, args, Path(tmp))
                write_report(stem, data, render(data))  # a cut run keeps what it measured
    print(render(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
