"""The deterministic (batch-invariant) mode against the default mode, offline, in one run: exactness and its cost.

For each mode (``RuntimeConfig.deterministic`` off, then on), fresh ``LLMEngine``s on the same engine directory run
``--requests`` greedy prompts that share a ``--prefix``-token prefix, ``--max-tokens`` new tokens each:

* **alone, cache off** / **alone, cache on**: one request at a time (with the cache, the first computes the prefix,
  the others hit it);
* **together**: all at once, cache off (continuous batching): its output tokens/s is the throughput compared.

Reported per mode: texts equal and bit-equal log-probabilities of cache on vs off and together vs alone, the largest
log-probability difference, and the throughput; the cost is deterministic / default of the same run. ``--repeat N``
then runs the "together" workload N more times per mode, alternating the modes (default, deterministic, default, ...)
so that a shared machine's changing load falls on both alike, and reports each run and the ratio of the medians;
``--cost-only`` skips the exactness runs.

    .venv/bin/python bench/deterministic.py --engine trtkv-out/engine-int4 [--requests 16 --prefix 1000 --max-tokens 32] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def run(engine_dir: Path, prompts: list[str], max_tokens: int, together: bool, **config) -> tuple[list[tuple[str, list[float]]], float]:
    """(text, log-probabilities) per prompt and the output tokens/s of a fresh engine with ``config``."""
    from trtkv.runtime.config import RuntimeConfig
    from trtkv.runtime.llm_engine import LLMEngine
    from trtkv.runtime.sequence import SamplingParams

    llm = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(kv_memory_gib=1.0, **config))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, min_tokens=max_tokens)
    lps: dict[str, list[float]] = {}

    def keep(o):
        lps.setdefault(o.request_id, []).extend(o.new_logprobs)

    t0 = time.monotonic()
    outs = llm.generate(prompts, params, on_output=keep) if together else [llm.generate([p], params, on_output=keep)[0] for p in prompts]
    took = time.monotonic() - t0
    return [(o.text, lps[o.request_id]) for o in outs], len(prompts) * max_tokens / took


def compare(a, b) -> tuple[int, int, float]:
    texts = sum(x[0] == y[0] for x, y in zip(a, b))
    bits = sum(x[1] == y[1] for x, y in zip(a, b))
    diff = max((abs(u - v) for x, y in zip(a, b) for u, v in zip(x[1], y[1])), default=0.0)
    return texts, bits, diff


def main() -> None:
    from fault_probe import prefix_prompts
    from serve import machine
    from transformers import AutoTokenizer

    from trtkv.manifest import load_manifest

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, default=ROOT / "trtkv-out" / "engine-int4")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=0, help="alternating throughput runs per mode after the exactness runs")
    ap.add_argument("--cost-only", action="store_true", help="only the alternating throughput runs")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "deterministic")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(str(args.engine / "tokenizer"), local_files_only=True)
    prompts = prefix_prompts(tok, args.requests, args.prefix)
    info = machine()
    rows, tput = [], {}
    for det in () if args.cost_only else (False, True):
        name = "deterministic" if det else "default"
        off, _ = run(args.engine, prompts, args.max_tokens, False, enable_prefix_caching=False, deterministic=det)
        on, _ = run(args.engine, prompts, args.max_tokens, False, enable_prefix_caching=True, deterministic=det)
        both, tput[name] = run(args.engine, prompts, args.max_tokens, True, enable_prefix_caching=False, deterministic=det)
        for what, (a, b) in (("cache on vs off, alone", (on, off)), (f"{args.requests} together vs alone, cache off", (both, off))):
            texts, bits, diff = compare(a, b)
            rows.append(f"| {name} | {what} | {texts}/{args.requests} | {bits}/{args.requests} | {diff:.3g} |")
            print(rows[-1], flush=True)
        print(f"{name}: {tput[name]:.1f} tok/s together", flush=True)
    runs: dict[str, list[float]] = {"default": [], "deterministic": []}
    for _ in range(args.repeat):
        for det in (False, True):
            name = "deterministic" if det else "default"
            runs[name].append(run(args.engine, prompts, args.max_tokens, True, enable_prefix_caching=False, deterministic=det)[1])
            print(f"{name}: {runs[name][-1]:.2f} tok/s together", flush=True)
    med = {k: sorted(v)[len(v) // 2] for k, v in runs.items() if v}
    m = load_manifest(args.engine)
    date = datetime.now(timezone.utc)
    md = (f"# Deterministic (batch-invariant) mode vs the default mode\n\n"
          f"Command: `python bench/deterministic.py {' '.join(sys.argv[1:])}`  \n"
          f"Engine: `{args.engine}` ({m.model.name}, {m.kv_spec}, {m.backend} engine on CPU)  \n"
          f"Machine: {info['cpu']}, {info['cores']} cores, load average at start {info['load_avg_start']}  \n"
          f"Date: {date:%Y-%m-%d %H:%M} UTC\n\n"
          f"{args.requests} greedy prompts sharing a {args.prefix}-token prefix, {args.max_tokens} new tokens each (offline `LLMEngine`, "
          "a fresh engine per run).\n\n"
          + ("| mode | comparison | texts equal | log-probabilities bit-equal | largest difference |\n|---|---|---:|---:|---:|\n" + "\n".join(rows) + "\n\n"
             f"| mode | output tok/s, {args.requests} together (cache off) | vs default |\n|---|---:|---:|\n"
             f"| default | {tput['default']:.2f} | 1.00 |\n| deterministic | {tput['deterministic']:.2f} | {tput['deterministic'] / tput['default']:.2f} |\n"
             if tput else "")
          + (f"\nAlternating runs (default, deterministic, ...), output tok/s of {args.requests} together over the whole run (their prefill "
             "included), cache off:\n\n| mode | runs | median | vs default |\n|---|---|---:|---:|\n"
             + "\n".join(f"| {k} | {', '.join(f'{x:.2f}' for x in runs[k])} | {med[k]:.2f} | {med[k] / med['default']:.2f} |" for k in med) + "\n"
             if med else ""))
    out = args.out.with_suffix(".md")
    out.write_text(md)
    print(md + f"\nwritten to {out}")


if __name__ == "__main__":
    main()
