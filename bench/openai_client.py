"""The OpenAI-compatible endpoints under a benchmark client: NVIDIA's aiperf (genai-perf's successor) against `trtkv serve --openai-port`.

perf_analyzer / genai-perf need libcudart and do not run on a machine without CUDA; aiperf is pure Python. Its pins
(pyzmq~=26.4, rich~=14.1, numpy>=2 in its resolution, ~140 packages) do not belong in trtkv's environment, so it lives
in its own virtual environment and is called as a command: ``make aiperf`` creates ``~/.cache/trtkv/aiperf-venv``; or point
``$TRTKV_AIPERF`` at an ``aiperf`` executable (``find_aiperf``).

The benchmark starts the server as a user does (``trtkv serve ENGINE --openai-port P``, a subprocess), then runs
``aiperf profile`` in its OpenAI chat mode (``--endpoint-type chat --streaming``; ``--endpoint completions`` for
``/v1/completions``) once per ``--concurrency`` level: synthetic prompts of exactly ``--isl`` tokens, exactly
``--osl`` new tokens (``max_completion_tokens`` + ``ignore_eos``, which trtkv's front accepts as vLLM does), token
counts from the server's ``usage`` (``--use-server-token-count``). Read from aiperf's own export
(``profile_export_aiperf.json``): request throughput, output tokens/s, TTFT and inter-token latency percentiles,
errors, output lengths. Baseline in the same run, on the same server: the same load (concurrency, requests, prompt
tokens as the server counted aiperf's templated prompts, exactly ``--osl`` new tokens) through Triton's own
``generate_stream`` with ``bench/serve.py``'s client (``--no-baseline`` skips it): the difference is what the OpenAI
layer and aiperf cost. Results: ``--out``.{json,md} with both commands, the machine and its load average.

    .venv/bin/python bench/openai_client.py --engine trtkv-out/engine-int4 [--concurrency 1 4 --requests 16 --isl 128 --osl 32]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AIPERF_VERSION = "0.13.0"  # what `make aiperf` installs and the results were measured with
# `make aiperf`'s environment: per user, like the Triton kernel cache and the GGUF conversion (~/.cache/trtkv), so a
# fresh clone on a machine that has it installs nothing
AIPERF_VENV = Path(os.environ.get("TRTKV_CACHE", Path.home() / ".cache" / "trtkv")) / "aiperf-venv"


def find_aiperf() -> str | None:
    """The aiperf executable: ``$TRTKV_AIPERF``, else ``make aiperf``'s ``~/.cache/trtkv/aiperf-venv``, else ``aiperf`` on PATH."""
    env = os.environ.get("TRTKV_AIPERF")
    if env:
        return env if Path(env).is_file() else None
    local = AIPERF_VENV / "bin" / "aiperf"
    return str(local) if local.is_file() else shutil.which("aiperf")


def aiperf_command(aiperf: str, url: str, model: str, tokenizer: Path, artifact_dir: Path, *, endpoint: str = "chat", requests: int = 8,
                   concurrency: int = 2, isl: int = 32, osl: int = 16, seed: int = 1) -> list[str]:
    """``aiperf profile`` against the OpenAI-compatible base ``url`` (``http://HOST:PORT``): exactly ``isl`` prompt and ``osl`` new tokens."""
    return [aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", endpoint, "--streaming",
            "--tokenizer", str(Path(tokenizer).resolve()),  # absolute: a local directory to aiperf, never a hub name
            "--synthetic-input-tokens-mean", str(isl), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(osl), "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
            "--concurrency", str(concurrency), "--request-count", str(requests), "--random-seed", str(seed),
            "--use-server-token-count", "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry",
            "--artifact-dir", str(artifact_dir), "--export-level", "records"]  # fmt: skip


def run_aiperf(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run it without HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE (the Makefile exports the first): aiperf 0.13's offline mode
    looks a tokenizer up in the hub cache even when it is a local directory, and fails. Online, an absolute path is
    loaded from disk without any hub request (aiperf.common.tokenizer.resolve_alias)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def read_aiperf(artifact_dir: Path) -> dict:
    """aiperf's own results: ``summary`` (profile_export_aiperf.json), ``records`` (one per request, profile_export.jsonl)
    and ``inputs`` (the payload it sent, by session id, inputs.json)."""
    artifact_dir = Path(artifact_dir)
    summary = json.loads((artifact_dir / "profile_export_aiperf.json").read_text())
    records = [json.loads(line) for line in (artifact_dir / "profile_export.jsonl").read_text().splitlines() if line.strip()]
    inputs = {s["session_id"]: s["payloads"][0] for s in json.loads((artifact_dir / "inputs.json").read_text())["data"]}
    return {"summary": summary, "records": records, "inputs": inputs}


def summarize(res: dict) -> dict:
    """The numbers a results table needs from ``read_aiperf``'s output."""
    s = res["summary"]

    def stat(name: str, *keys: str) -> dict:
        return {k: s.get(name, {}).get(k) for k in keys}

    return {
        "requests": s["request_count"]["avg"],
        "completed": s.get("completed_request_count", {}).get("avg"),
        "error_rate_pct": s.get("request_error_rate", {}).get("avg"),
        "errors": s.get("error_summary"),
        "duration_s": s["benchmark_duration"]["avg"],
        "request_per_s": s["request_throughput"]["avg"],
        "output_tok_s": s["output_token_throughput"]["avg"],
        "ttft_ms": stat("time_to_first_token", "p50", "p90", "p99", "avg"),
        "itl_ms": stat("inter_token_latency", "p50", "p90", "p99", "avg"),
        "request_latency_ms": stat("request_latency", "p50", "p99"),
        "osl": stat("output_sequence_length", "min", "max"),
        "isl": stat("input_sequence_length", "min", "max"),
        "osl_mismatch_count": s.get("osl_mismatch_count", {}).get("avg"),
    }


class Serve:
    """``trtkv serve ENGINE --openai-port P`` as a subprocess; ``url`` is the OpenAI base (``http://127.0.0.1:P``)."""

    def __init__(self, engine: Path, workdir: Path, *, model: str, kv_memory: float, max_seqs: int):
        from trtkv.triton_repo.server import free_port

        ports = [free_port() for _ in range(4)]
        self.cmd = [sys.executable, "-m", "trtkv.cli", "serve", str(engine), "--repo", str(workdir / "repo"), "--kv-memory", str(kv_memory),
                    "--max-seqs", str(max_seqs), "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
                    "--openai-port", str(ports[3]), "--served-model-name", model]  # fmt: skip
        self.url = f"http://127.0.0.1:{ports[3]}"
        self.triton_url = f"http://127.0.0.1:{ports[0]}"
        self.banner: list[str] = []
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Serve":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.banner.append(line.rstrip())
            if "Ctrl-C" in line:
                return self
        self.__exit__()
        raise RuntimeError("trtkv serve did not start:\n" + "\n".join(self.banner))

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # drains, stops tritonserver, removes its /dev/shm regions
            try:
                self.proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
        self.proc = None


def args_osl(data: dict) -> str:
    return f"{data['args']['osl']}-{data['args']['osl']}"


def render(data: dict) -> str:
    a = data["args"]
    lines = [
        f"# OpenAI-compatible endpoints under aiperf ({data['machine']['cpu']}, {data['machine']['cores']} cores, no GPU)",
        "",
        f"Command: `{data['command']}`  ",
        f"Date: {data['date']}; engine `{a['engine']}` (`{data['kv_spec']}`), KV budget {a['kv_memory']} GiB, {a['max_seqs']} sequence slots; "
        f"aiperf {data['aiperf_version']}, `/v1/{'chat/completions' if a['endpoint'] == 'chat' else 'completions'}` streaming, "
        f"{a['isl']} prompt tokens (synthetic), {a['osl']} new tokens (`ignore_eos`), token counts from the server's `usage`.",
        "",
        "| concurrency | requests ok / sent | req/s | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | latency p50 ms "
        "| output tokens min-max | prompt tokens | load avg (1/5/15 min) after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in data["levels"]:
        s = lv["result"]
        ok = s["requests"] * (1 - (s["error_rate_pct"] or 0) / 100)
        lines.append(
            f"| {lv['concurrency']} | {ok:.0f} / {s['requests']:.0f} | {s['request_per_s']:.3f} | {s['output_tok_s']:.2f} | "
            f"{s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p99']:.0f} | {s['itl_ms']['p50']:.0f} / {s['itl_ms']['p99']:.0f} | "
            f"{s['request_latency_ms']['p50']:.0f} | {s['osl']['min']:.0f}-{s['osl']['max']:.0f} | {s['isl']['min']:.0f}-{s['isl']['max']:.0f} | "
            f"{' / '.join(str(x) for x in lv['load_avg'])} |"
        )
        b = lv.get("baseline_triton")
        if b:
            lines.append(
                f"| {lv['concurrency']} (baseline: Triton `generate_stream`, bench/serve.py client) | {b['requests']} / {b['requests'] + len(b['errors'])} | "
                f"{b['request_per_s']:.3f} | {b['tokens_per_s']:.2f} | {b['ttft_ms']['p50']:.0f} / {b['ttft_ms']['p99']:.0f} | "
                f"{b['itl_ms']['p50']:.0f} / {b['itl_ms']['p99']:.0f} | - | {args_osl(data)} | {s['isl']['min']:.0f} (text) | {' / '.join(str(x) for x in b['load_avg'])} |"
            )
    lines += ["", "aiperf command (first level): `" + " ".join(data["levels"][0]["aiperf_command"]) + "`" if data["levels"] else ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from report import write_report
    from serve import machine, prompt_of, run_level
    from transformers import AutoTokenizer

    from trtkv.manifest import load_manifest

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--isl", type=int, default=128, help="prompt tokens (synthetic, exact)")
    ap.add_argument("--osl", type=int, default=32, help="new tokens per request (exact: ignore_eos)")
    ap.add_argument("--kv-memory", type=float, default=0.5)
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--model-name", default="smollm2")
    ap.add_argument("--no-baseline", action="store_true", help="skip the same load through Triton's generate_stream")
    ap.add_argument("--out", type=Path, default=Path("bench/results/openai-aiperf"))
    args = ap.parse_args()
    aiperf = find_aiperf()
    if aiperf is None:
        print("aiperf not found: run `make aiperf` (creates ~/.cache/trtkv/aiperf-venv) or set TRTKV_AIPERF=/path/to/aiperf", file=sys.stderr)
        return 2
    data = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "aiperf": aiperf,
        "aiperf_version": subprocess.run([aiperf, "--version"], capture_output=True, text=True).stdout.strip() or AIPERF_VERSION,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "kv_spec": load_manifest(args.engine).kv_spec,
        "levels": [],
    }
    stem = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="trtkv-aiperf-") as tmp, Serve(args.engine, Path(tmp), model=args.model_name,
                                                                             kv_memory=args.kv_memory, max_seqs=args.max_seqs) as server:
        data["serve_banner"] = server.banner
        for c in args.concurrency:
            art = Path(tmp) / f"aiperf-c{c}"
            cmd = aiperf_command(aiperf, server.url, args.model_name, args.engine / "tokenizer", art, endpoint=args.endpoint,
                                 requests=args.requests, concurrency=c, isl=args.isl, osl=args.osl)
            proc = run_aiperf(cmd, timeout=1800)
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"aiperf failed at concurrency {c} (exit {proc.returncode})")
            res = summarize(read_aiperf(art))
            level = {"concurrency": c, "aiperf_command": [Path(cmd[0]).name] + cmd[1:], "result": res, "load_avg": [round(x, 2) for x in os.getloadavg()]}
            print(f"c={c}: {res['request_per_s']:.3f} req/s, {res['output_tok_s']:.2f} tok/s, TTFT p50 {res['ttft_ms']['p50']:.0f} ms, "
                  f"ITL p50 {res['itl_ms']['p50']:.0f} ms, errors {res['error_rate_pct']}%", flush=True)
            if not args.no_baseline:
                tok = AutoTokenizer.from_pretrained(str(args.engine / "tokenizer"), local_files_only=True)
                prompts = [prompt_of(tok, int(res["isl"]["min"]), 2000 + i) for i in range(args.requests)]
                t0 = time.monotonic()
                base = run_level(server.triton_url, prompts, c, max(1, args.requests // c), args.osl)
                base["request_per_s"] = base["requests"] / (time.monotonic() - t0)
                base["load_avg"] = [round(x, 2) for x in os.getloadavg()]
                level["baseline_triton"] = base
                print(f"c={c} baseline (Triton generate_stream): {base['request_per_s']:.3f} req/s, {base['tokens_per_s']:.2f} tok/s, "
                      f"TTFT p50 {base['ttft_ms']['p50']:.0f} ms, ITL p50 {base['itl_ms']['p50']:.0f} ms", flush=True)
            data["levels"].append(level)
            write_report(stem, data, render(data))
    print(render(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
