"""Serving benchmark: fp16 / int8 / int4 engines through the running Triton server, same KV memory budget.

For each engine: write the repository, start tritonserver on loopback, then

1. **admission** -- offer ``--admission-requests`` concurrent streaming requests whose prompt fills one
   pool block (``--admission-prompt`` tokens, < 2 blocks with the output) and read the server's
   ``trtkv_peak_running_sequences`` metric: the most sequences the pool held at once;
2. **throughput** -- at each ``--concurrency`` level, that many client streams each send
   ``--requests-per-stream`` requests back to back (prompt ``--prompt`` tokens, exactly ``--max-tokens``
   new tokens: ``min_length`` = ``max_tokens``), measuring output tokens/s over the level's wall time,
   time to first token and inter-token latency (between streamed responses) percentiles.

``--instances 1 2`` runs every engine once per instance count (python-model instances in one server, the same total
``--kv-memory`` split among them); ``--admission-requests 0`` skips the admission part. The first row is the baseline
of the ratios (fp16 when it is there). Results go to ``--out`` (JSON + Markdown, with the command, the machine and its
load average before and after each level).

    python bench/serve.py --engine fp16=trtkv-out/engines/fp16 --engine int8=... --engine int4=... --kv-memory 0.17
    python bench/serve.py --engine int4=DIR --instances 1 2 --admission-requests 0 --concurrency 8 --requests-per-stream 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

from trtkv.runtime.config import RuntimeConfig
from trtkv.triton_repo.client import stream_generate
from trtkv.triton_repo.repository import RepoOptions, write_repository
from trtkv.triton_repo.server import TritonServer, free_port

TEXT = (
    "The paged key-value cache keeps every sequence's keys and values in fixed-size blocks. A block table maps "
    "token positions to blocks, so sequences of any length share one pool without fragmentation. Quantizing the "
    "sealed blocks to eight or four bits lets the same memory hold two to three and a half times as many tokens. "
)


def prompt_of(tokenizer, n: int, salt: int) -> str:
    ids = tokenizer.encode(f"[{salt}] " + TEXT * (1 + n // 40), add_special_tokens=False)[:n]
    return tokenizer.decode(ids)


def machine() -> dict:
    """CPU model, cores, Python, and the load average when the benchmark starts (other jobs on a shared machine)."""
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "python": platform.python_version(),
            "load_avg_start": [round(x, 2) for x in os.getloadavg()]}
    try:
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return info


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def one_request(url: str, prompt: str, max_tokens: int, rec: list, **params) -> None:
    t0 = time.monotonic()
    times = []
    for piece in stream_generate(url, prompt, max_tokens, min_length=max_tokens, **params):
        times.append(piece.t)
    rec.append({"t0": t0, "times": times, "tokens": max_tokens})


def run_level(url: str, prompts: list[str], concurrency: int, per_stream: int, max_tokens: int) -> dict:
    recs: list[dict] = []
    errors: list[str] = []

    def stream(i: int) -> None:
        for r in range(per_stream):
            try:
                one_request(url, prompts[(i * per_stream + r) % len(prompts)], max_tokens, recs)
            except Exception as exc:
                errors.append(str(exc))

    load0 = os.getloadavg()
    t0 = time.monotonic()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    ttft = [r["times"][0] - r["t0"] for r in recs if r["times"]]
    itl = [b - a for r in recs for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(r["tokens"] for r in recs)
    return {
        "concurrency": concurrency,
        "requests": len(recs),
        "errors": errors[:3],
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_ms": {f"p{q}": 1000 * pct(ttft, q) for q in (50, 90, 99)},
        "itl_ms": {f"p{q}": 1000 * pct(itl, q) for q in (50, 90, 99)},
        "load_avg_before": [round(x, 2) for x in load0],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }


def bench_engine(name: str, engine_dir: Path, args, workdir: Path, instances: int = 1) -> dict:
    from transformers import AutoTokenizer

    from trtkv.manifest import load_manifest

    m = load_manifest(engine_dir)
    tok = AutoTokenizer.from_pretrained(str(engine_dir / "tokenizer"), local_files_only=True)
    runtime = RuntimeConfig(kv_memory_gib=args.kv_memory, max_seqs=args.max_seqs, max_batched_tokens=args.max_batched_tokens)
    opts = RepoOptions(runtime=runtime, instance_kind="cpu", instances=instances)
    repo = write_repository(engine_dir, workdir / f"repo-{name}", opts, force=True)
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_file=workdir / f"server-{name}.log")
    out = {"engine": str(engine_dir), "kv_spec": m.kv_spec, "block_size": m.limits.block_size, "model": m.model.name, "instances": instances,
           "admission": None}
    with server:
        url = server.http_url
        run_level(url, [prompt_of(tok, 16, -1 - i) for i in range(instances)], instances, 1, 4)  # warm-up, one request per instance
        blocks = server.metric_values("trtkv_kv_blocks")
        out["pool_blocks"] = int(sum(blocks))
        out["bytes_per_block"] = m.bytes_per_block
        # 1. admission
        prompts = [prompt_of(tok, args.admission_prompt, i) for i in range(args.admission_requests)]
        t0 = time.monotonic()
        level = run_level(url, prompts, args.admission_requests, 1, args.admission_max_tokens) if prompts else None
        if level is not None:
            server.wait_for_metric("trtkv_requests_total", 1 + level["requests"], state="finished")  # warm-up + admission pushed
            out["admission"] = {
                "offered": args.admission_requests,
                "prompt_tokens": args.admission_prompt,
                "max_tokens": args.admission_max_tokens,
                "completed": level["requests"],
                "errors": level["errors"],
                "seconds": time.monotonic() - t0,
                "max_running": int(sum(server.metric_values("trtkv_peak_running_sequences"))),  # summed over instances
                "preemptions": int(sum(server.metric_values("trtkv_preemptions_total"))),
            }
            print(f"[{name}] admission: {out['admission']}", flush=True)
        # 2. throughput
        prompts = [prompt_of(tok, args.prompt, 1000 + i) for i in range(64)]
        out["levels"] = []
        for c in args.concurrency:
            level = run_level(url, prompts, c, args.requests_per_stream, args.max_tokens)
            out["levels"].append(level)
            print(f"[{name}] c={c}: {level['tokens_per_s']:.1f} tok/s, ttft p50 {level['ttft_ms']['p50']:.0f} ms, itl p50 {level['itl_ms']['p50']:.0f} ms", flush=True)
        out["success_requests_metric"] = server.metric_values("nv_inference_request_success")
        out["finished_per_instance"] = [int(v) for v in server.metric_values("trtkv_requests_total", state="finished")]  # how Triton spread them
    return out


def render(results: dict) -> str:
    rows = results["engines"]
    base_name = "fp16" if "fp16" in rows else next(iter(rows))
    base = rows[base_name]
    lines = [
        f"# Serving benchmark ({results['machine']['cpu']}, {results['machine']['cores']} cores, no GPU)",
        "",
        f"Command: `{results['command']}`  ",
        f"Date: {results['date']}; KV budget {results['kv_memory_gib']} GiB for every row (split among a server's instances); "
        f"{results['max_seqs']} sequence slots per instance; load average at the start {results['machine'].get('load_avg_start')}.",
        "",
        f"| engine | instances | KV format | pool blocks | max running seqs | vs {base_name} | "
        + " | ".join(f"tok/s @{c}" for c in results["concurrency"])
        + " | TTFT p50/p90 ms @max | ITL p50/p90 ms @max | load avg before / after @max | requests finished per instance |",
        "|---|---|---|---|---|---|" + "---|" * len(results["concurrency"]) + "---|---|---|---|",
    ]
    for name, r in rows.items():
        adm = r["admission"]["max_running"] if r.get("admission") else None
        base_adm = base["admission"]["max_running"] if base.get("admission") else None
        ratio = f"{adm / base_adm:.2f}x" if adm and base_adm else "-"
        tps = []
        for lv in r["levels"]:
            s = f"{lv['tokens_per_s']:.1f}"
            if name != base_name:
                b = next(x for x in base["levels"] if x["concurrency"] == lv["concurrency"])
                s += f" ({lv['tokens_per_s'] / b['tokens_per_s']:.0%})"
            tps.append(s)
        last = r["levels"][-1]
        load = f"{last['load_avg_before'][0]} / {last['load_avg_after'][0]}" if "load_avg_after" in last else "-"
        lines.append(
            f"| {name} | {r.get('instances', 1)} | `{r['kv_spec']}` | {r['pool_blocks']} | {adm if adm is not None else '-'} | {ratio} | " + " | ".join(tps)
            + f" | {last['ttft_ms']['p50']:.0f} / {last['ttft_ms']['p90']:.0f} | {last['itl_ms']['p50']:.0f} / {last['itl_ms']['p90']:.0f} | {load} | "
            + f"{' + '.join(str(n) for n in r.get('finished_per_instance', [])) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="append", required=True, help="NAME=ENGINE_DIR (repeatable; fp16 is the baseline)")
    ap.add_argument("--kv-memory", type=float, default=0.17, help="KV budget in GiB, the same for every engine")
    ap.add_argument("--max-seqs", type=int, default=96)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--instances", type=int, nargs="+", default=[1],
                    help="python-model instances (engines) per server, one server per value; --kv-memory is split among them")
    ap.add_argument("--admission-requests", type=int, default=100)
    ap.add_argument("--admission-prompt", type=int, default=80)
    ap.add_argument("--admission-max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("bench/results/serve"))
    args = ap.parse_args()
    engines = dict(e.split("=", 1) for e in args.engine)
    results = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "kv_memory_gib": args.kv_memory,
        "max_seqs": args.max_seqs,
        "concurrency": args.concurrency,
        "engines": {},
    }
    with tempfile.TemporaryDirectory(prefix="trtkv-bench-") as tmp:
        for name, d in engines.items():
            for n in args.instances:
                key = name if len(args.instances) == 1 else f"{name} x{n}"
                t0 = time.monotonic()
                results["engines"][key] = bench_engine(key.replace(" ", "-"), Path(d), args, Path(tmp), instances=n)
                results["engines"][key]["seconds"] = time.monotonic() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    md = render(results)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
