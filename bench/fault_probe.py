"""Serve under faults, one command: the operator's round of probes against `trtkv serve`, held / defect per item.

Starts `trtkv serve ENGINE --openai-port` on free loopback ports (several times: the faults that end a server get their
own) and probes it with real clients (http.client, requests, tritonclient gRPC):

1. **SIGTERM past the grace**: streams on OpenAI completions and chat, Triton ``generate_stream`` and a gRPC stream,
   plain OpenAI and Triton requests, ``--grace 2``, SIGTERM after 4 s: every stream ends with an error event (OpenAI:
   its error shape and ``[DONE]``), every plain request with an error status, serve exits 4.
2. **Disconnects** of streaming and plain requests on every endpoint: the request is aborted (``cancelled``) and its
   blocks freed within 2 decode steps of the client leaving (the step time measured on the same server first).
3. **Clean drain with idle keep-alive connections** (a ``requests.Session`` on Triton and on the OpenAI front): serve
   exits 0 and says "drained".
4. **Fuzz**: ``FUZZ`` (OpenAI and Triton HTTP) and ``GRPC_FUZZ``: every bad request a 4xx naming the problem, no 5xx
   of ours (Triton 2.51's own JSON parser answers 500 for values it cannot convert: reported as its limit).
5. **Large body**: a 5 MB body is a 413, and another client's ``GET /v1/models`` and SSE stream gain < 1 s meanwhile.
6. **Operational**: counters typed ``counter`` (``_total``), ``/health`` and ``/v1/models/{id}``, port 9000 listening
   when serve prints "ready".
7. **Squeezed pool**: a pool of 12 blocks, 8 concurrent requests: they queue (and are preempted when the pool runs
   out), every one finishes; with ``--deterministic`` each with the text and log-probabilities it gets alone; a request
   larger than the pool is a 400.
8. **Prefix cache**: 16 greedy requests sharing a 1,000-token prefix, one at a time on fresh servers with the cache on
   and off, and 16 at once vs alone: equal texts and bit-equal log-probabilities. Held means 16/16 and bit-equal: in
   both modes for the cache, with ``--deterministic`` for batching (the default mode's batching is reported as its
   documented limit).

    .venv/bin/python bench/fault_probe.py --engine trtkv-out/engine-int4 [--skip prefix] [--out bench/results/fault-probe]

Writes ``OUT-<date>.md`` (command, machine, date, the table) and prints the table.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORY = "Once upon a time, in a small village by the sea,"
LONG = 400  # new tokens of a request the probe cuts short (SmolLM2 on 2 cores: ~20 s)


# ---------------------------------------------------------------- the fuzz list (tests/test_serve_faults.py runs it too)


@dataclass(frozen=True)
class Case:
    """One malformed request: ``target`` "openai" or "triton", a method and path, the raw body. ``limit`` names a
    documented answer that is not a 4xx (Triton 2.51's own behaviour, not the model's)."""

    name: str
    target: str
    path: str
    body: bytes | None
    method: str = "POST"
    limit: str | None = None


def _j(obj) -> bytes:
    return json.dumps(obj).encode()


def fuzz_cases(model: str) -> list[Case]:
    """The malformed requests, for the served model name ``model``."""
    cmp, chat, gen, gs = "/v1/completions", "/v1/chat/completions", "/v2/models/ensemble/generate", "/v2/models/ensemble/generate_stream"
    ok = {"model": model, "prompt": "hello", "max_tokens": 3}
    okc = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    deep = b"[" * 100_000 + b"]" * 100_000
    parser = "Triton 2.51's JSON parser answers 500 for a value it cannot convert (docs/serving.md)"
    out = [
        Case("lone surrogate in prompt", "openai", cmp, b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 3}' % model.encode()),
        Case("lone surrogate in chat content", "openai", chat, b'{"model": "%s", "messages": [{"role": "user", "content": "\\udc80"}], "max_tokens": 3}' % model.encode()),
        Case("lone surrogate in a text part", "openai", chat,
             b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}], "max_tokens": 3}' % model.encode()),
        Case("lone surrogate in stop", "openai", cmp, b'{"model": "%s", "prompt": "a", "stop": ["\\ud800"], "max_tokens": 3}' % model.encode()),
        Case("seed 2^64", "openai", cmp, _j({**ok, "seed": 2**64})),
        Case("seed -1", "openai", cmp, _j({**ok, "seed": -1})),
        Case("seed 1e30", "openai", cmp, _j({**ok, "seed": 1e30})),
        Case("max_tokens 1e30", "openai", cmp, _j({**ok, "max_tokens": 10**30})),
        Case("max_tokens 0", "openai", cmp, _j({**ok, "max_tokens": 0})),
        Case("max_tokens string", "openai", cmp, _j({**ok, "max_tokens": "three"})),
        Case("max_tokens over the context", "openai", cmp, _j({**ok, "max_tokens": 10**6})),
        Case("temperature NaN", "openai", cmp, b'{"model": "%s", "prompt": "a", "max_tokens": 3, "temperature": NaN}' % model.encode()),
        Case("temperature Infinity", "openai", cmp, b'{"model": "%s", "prompt": "a", "max_tokens": 3, "temperature": Infinity}' % model.encode()),
        Case("top_p 0", "openai", cmp, _j({**ok, "top_p": 0})),
        Case("invalid UTF-8 body", "openai", cmp, b'{"model": "%s", "prompt": "\xff\xfe", "max_tokens": 3}' % model.encode()),
        Case("nesting 100,000 deep", "openai", cmp, deep),
        Case("not JSON", "openai", cmp, b"prompt=hello"),
        Case("empty body", "openai", cmp, b""),
        Case("a JSON array", "openai", cmp, b"[1, 2]"),
        Case("prompt of token ids", "openai", cmp, _j({**ok, "prompt": [1, 2, 3]})),
        Case("two prompts", "openai", cmp, _j({**ok, "prompt": ["a", "b"]})),
        Case("n 2", "openai", cmp, _j({**ok, "n": 2})),
        Case("best_of 3", "openai", cmp, _j({**ok, "best_of": 3})),
        Case("logprobs 0", "openai", cmp, _j({**ok, "logprobs": 0})),
        Case("echo", "openai", cmp, _j({**ok, "echo": True})),
        Case("presence_penalty 0.5", "openai", cmp, _j({**ok, "presence_penalty": 0.5})),
        Case("frequency_penalty 1", "openai", cmp, _j({**ok, "frequency_penalty": 1})),
        Case("logit_bias", "openai", cmp, _j({**ok, "logit_bias": {"17": -100}})),
        Case("response_format json", "openai", chat, _j({**okc, "response_format": {"type": "json_object"}})),
        Case("tools", "openai", chat, _j({**okc, "tools": [{"type": "function", "function": {"name": "f"}}]})),
        Case("top_logprobs", "openai", chat, _j({**okc, "top_logprobs": 3})),
        Case("include_usage maybe", "openai", cmp, _j({**ok, "stream": True, "stream_options": {"include_usage": "maybe"}})),
        Case("stream maybe", "openai", cmp, _j({**ok, "stream": "maybe"})),
        Case("min_tokens > max_tokens", "openai", cmp, _j({**ok, "min_tokens": 9})),
        Case("unknown model", "openai", cmp, _j({**ok, "model": "gpt-4o"})),
        Case("no messages", "openai", chat, _j({**okc, "messages": []})),
        Case("unknown role", "openai", chat, _j({**okc, "messages": [{"role": "bot", "content": "x"}]})),
        Case("image part", "openai", chat, _j({**okc, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})),
        Case("GET completions", "openai", cmp, None, method="GET"),
        Case("DELETE models", "openai", "/v1/models", None, method="DELETE"),
        Case("unknown path", "openai", "/v1/engines", None, method="GET"),
        Case("unknown model id", "openai", "/v1/models/gpt-4o", None, method="GET"),
        Case("triton: lone surrogate", "triton", gen, b'{"text_input": "a\\ud800b", "max_tokens": 3}', limit=parser),
        Case("triton: invalid UTF-8", "triton", gen, b'{"text_input": "\xff\xfe", "max_tokens": 3}'),
        Case("triton: temperature NaN", "triton", gen, b'{"text_input": "a", "max_tokens": 3, "temperature": NaN}'),
        Case("triton: seed 2^64", "triton", gen, _j({"text_input": "a", "max_tokens": 3, "seed": 2**64}), limit=parser),
        Case("triton: max_tokens string", "triton", gen, _j({"text_input": "a", "max_tokens": "x"}), limit=parser),
        Case("triton: max_tokens 0", "triton", gen, _j({"text_input": "a", "max_tokens": 0})),
        Case("triton: no text_input", "triton", gen, _j({"max_tokens": 3})),
        Case("triton: empty text_input", "triton", gen, _j({"text_input": "", "max_tokens": 3})),
        Case("triton: unknown input", "triton", gen, _j({"text_input": "a", "max_tokens": 3, "ignore_eos": True})),
        Case("triton: min_tokens > max_tokens", "triton", gen, _j({"text_input": "a", "max_tokens": 3, "min_tokens": 9})),
        Case("triton: end_id outside the vocabulary", "triton", gen, _j({"text_input": "a", "max_tokens": 3, "end_id": 10**8})),
        Case("triton: top_k -1", "triton", gen, _j({"text_input": "a", "max_tokens": 3, "top_k": -1})),
        Case("triton: presence_penalty 0.5", "triton", gen, _j({"text_input": "a", "max_tokens": 3, "presence_penalty": 0.5})),
        Case("triton: stream true on generate", "triton", gen, _j({"text_input": "a", "max_tokens": 3, "stream": True}),
             limit="Triton 2.51's generate takes one response; the model cannot see the endpoint (docs/serving.md)"),
        Case("triton: prompt over the context", "triton", gen, _j({"text_input": "a", "max_tokens": 10**6})),
        Case("triton: not JSON", "triton", gen, b"text_input=a", limit=parser),
        Case("triton stream: lone surrogate", "triton", gs, b'{"text_input": "a\\ud800", "max_tokens": 3}', limit=parser),
        Case("triton stream: temperature NaN", "triton", gs, b'{"text_input": "a", "max_tokens": 3, "temperature": NaN}'),
        Case("triton stream: min_tokens > max_tokens", "triton", gs, _j({"text_input": "a", "max_tokens": 3, "min_tokens": 9})),
    ]
    return out


def send_case(case: Case, openai_port: int, http_port: int, timeout: float = 60) -> tuple[int, str]:
    port = openai_port if case.target == "openai" else http_port
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if case.body is not None else {}
        conn.request(case.method, case.path, body=case.body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def judge_case(case: Case, status: int, text: str) -> tuple[str, str]:
    """("held" | "limit" | "defect", why) for one answer: a 4xx of ours naming the problem; the OpenAI front always in
    OpenAI's error shape; a documented limit where the case names one."""
    error = None
    try:
        body = json.loads(text.split("data:", 1)[-1]) if text.lstrip().startswith("data:") else json.loads(text)
        error = body.get("error") if isinstance(body, dict) else None
    except json.JSONDecodeError:
        pass
    if case.target == "openai" and not (isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)):
        return "defect", f"{status}, not OpenAI's error shape: {text[:120]}"
    if 400 <= status < 500 and error:
        return "held", f"{status}: {str(error)[:100]}"
    if case.limit and (status >= 500 or status == 200) and error:
        return "limit", f"{status}: {case.limit}"
    return "defect", f"{status}: {text[:120]}"


def grpc_fuzz() -> list[tuple[str, dict]]:
    """Typed (gRPC) bad inputs: name -> {input: (value, Triton dtype)} on top of a valid request."""
    import numpy as np

    return [
        ("grpc: temperature NaN", {"temperature": (np.float32("nan"), "FP32")}),
        ("grpc: top_p inf", {"top_p": (np.float32("inf"), "FP32")}),
        ("grpc: min_tokens > max_tokens", {"min_tokens": (9, "INT32")}),
        ("grpc: end_id outside the vocabulary", {"end_id": (10**8, "INT32")}),
        ("grpc: max_tokens 0", {"max_tokens": (0, "INT32")}),
        ("grpc: temperature as FP64", {"temperature": (0.5, "FP64")}),
        ("grpc: unknown input", {"lora_task_id": (3, "INT32")}),
    ]


def send_grpc(port: int, extra: dict, timeout: float = 60) -> str | None:
    """The error a gRPC stream request with ``extra`` inputs gets (None: it succeeded)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    np_of = {"BYTES": object, "INT32": np.int32, "FP32": np.float32, "FP64": np.float64, "BOOL": bool, "UINT64": np.uint64}
    values = {"text_input": (b"hello", "BYTES"), "max_tokens": (3, "INT32"), "stream": (False, "BOOL"), **extra}
    inputs = []
    for name, (v, dtype) in values.items():
        t = grpcclient.InferInput(name, [1, 1], dtype)
        t.set_data_from_numpy(np.array([[v]], dtype=np_of[dtype]))
        inputs.append(t)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("ensemble", inputs)
        _, error = results.get(timeout=timeout)
    finally:
        client.stop_stream()
        client.close()
    return None if error is None else str(error)


# ---------------------------------------------------------------- a `trtkv serve` process


class Serve:
    """``trtkv serve`` on free ports with ``--openai-port``; stdout / stderr collected; ``listening_at_ready`` says
    whether every port accepted a connection at the moment "ready" was printed."""

    def __init__(self, engine: Path, workdir: Path, *args: str, name: str = "serve"):
        from trtkv.triton_repo.server import free_port

        self.http_port, self.grpc_port, self.metrics_port, self.openai_port = (free_port() for _ in range(4))
        self.workdir = workdir / name
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "trtkv.cli", "serve", str(engine), "--repo", str(self.workdir / "repo"),
               "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port), "--metrics-port", str(self.metrics_port),
               "--openai-port", str(self.openai_port), *args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self.listening_at_ready: dict[str, bool] | None = None
        threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True).start()

    def _read(self, stream, sink):
        for line in stream:
            if sink is self.out and "ready" in line and self.listening_at_ready is None:
                self.listening_at_ready = {n: _listening(p) for n, p in (("http", self.http_port), ("grpc", self.grpc_port),
                                                                          ("metrics", self.metrics_port), ("openai", self.openai_port))}
            sink.append(line)

    def wait_ready(self, timeout: float = 600) -> "Serve":
        deadline = time.monotonic() + timeout
        while not any("Ctrl-C" in line for line in self.out):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start: {''.join(self.out + self.err)[-2000:]}")
            time.sleep(0.1)
        return self

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def metric(self, name: str, **labels) -> float:
        from trtkv.triton_repo.server import metric_values

        return sum(metric_values(self.metrics_url, name, **labels))

    def idle(self) -> bool:
        return (self.metric("trtkv_sequences", state="running") == 0 and self.metric("trtkv_sequences", state="waiting") == 0
                and self.metric("trtkv_kv_blocks", state="used") == 0)

    def wait_idle(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not self.idle():
            if time.monotonic() > deadline:
                raise RuntimeError("the server never went idle")
            time.sleep(0.05)

    def stop(self, sig=signal.SIGTERM, timeout: float = 120) -> tuple[int | None, float]:
        """Signal serve and wait: (exit code, seconds it took)."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
            self.kill()
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        from trtkv.triton_repo.server import child_pids

        if self.proc.poll() is None:
            for pid in child_pids(self.proc.pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            self.proc.kill()
            self.proc.wait(30)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@dataclass
class Result:
    item: str
    check: str
    outcome: str  # held | defect | limit
    detail: str = ""


@dataclass
class Probe:
    engine: Path
    workdir: Path
    model: str = "smollm2-135m"
    results: list[Result] = field(default_factory=list)

    def add(self, item: str, check: str, outcome: str, detail: str = "") -> None:
        self.results.append(Result(item, check, outcome, detail))
        print(f"  {outcome:6s}  {item}: {check} -- {detail}", flush=True)


# ---------------------------------------------------------------- requests the probes send


def openai_request(port: int, chat: bool, model: str, stream: bool, max_tokens: int = LONG, prompt: str = STORY, **extra) -> http.client.HTTPResponse:
    """Send an OpenAI request and return the response (the connection open; its ``.conn`` attribute closes it)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream, "ignore_eos": True, **extra}
    body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    if not stream:
        return _Pending(conn)
    resp = conn.getresponse()
    resp.conn = conn
    return resp


class _Pending:
    """A plain request sent, its response not read yet."""

    def __init__(self, conn):
        self.conn = conn

    def read_all(self) -> tuple[int, str]:
        r = self.conn.getresponse()
        return r.status, r.read().decode(errors="replace")


def triton_request(port: int, stream: bool, max_tokens: int = LONG, prompt: str = STORY, **extra):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"text_input": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "stream": stream, **extra}
    conn.request("POST", f"/v2/models/ensemble/{'generate_stream' if stream else 'generate'}", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    if not stream:
        return _Pending(conn)
    resp = conn.getresponse()
    resp.conn = conn
    return resp


def sse_events(resp, n: int | None = None) -> list[str]:
    """The data lines of a server-sent event stream: ``n`` of them, or all until the stream ends."""
    got = []
    while n is None or len(got) < n:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data:"):
            got.append(line[5:].strip().decode(errors="replace"))
    return got


def read_rest(resp) -> tuple[str, list[str]]:
    """("end" | "cut" | "timeout", data lines) for the rest of a stream."""
    try:
        data = resp.read()
    except http.client.IncompleteRead as exc:
        return "cut", [ln[5:].strip().decode(errors="replace") for ln in exc.partial.splitlines() if ln.startswith(b"data:")]
    except (TimeoutError, OSError):
        return "timeout", []
    return "end", [ln[5:].strip().decode(errors="replace") for ln in data.splitlines() if ln.startswith(b"data:")]


class GrpcStream:
    """A gRPC stream request (tritonclient) whose responses land in a queue; ``cancel`` cancels it as a client does."""

    def __init__(self, port: int, max_tokens: int = LONG):
        import numpy as np
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        self.results: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))
        inputs = []
        for name, v, dtype, npd in (("text_input", STORY.encode(), "BYTES", object), ("max_tokens", max_tokens, "INT32", np.int32),
                                    ("min_tokens", max_tokens, "INT32", np.int32), ("stream", True, "BOOL", bool)):
            t = grpcclient.InferInput(name, [1, 1], dtype)
            t.set_data_from_numpy(np.array([[v]], dtype=npd))
            inputs.append(t)
        self.client.async_stream_infer("ensemble", inputs)

    def next(self, timeout: float = 120):
        return self.results.get(timeout=timeout)

    def cancel(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()

    def close(self) -> None:
        try:
            self.client.stop_stream()
        finally:
            self.client.close()


# ---------------------------------------------------------------- the probes


def decode_step_s(s: Serve) -> float:
    """Median time between streamed tokens of one request alone (the decode step time of this server)."""
    resp = triton_request(s.http_port, stream=True, max_tokens=48)
    times = []
    while True:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data:"):
            times.append(time.monotonic())
    resp.conn.close()
    gaps = sorted(b - a for a, b in zip(times[8:], times[9:]))
    return gaps[len(gaps) // 2]


def probe_disconnects(p: Probe, s: Serve) -> None:
    step = decode_step_s(s)
    p.add("disconnect", "decode step time (one request alone)", "held", f"{step * 1000:.0f} ms")
    cases = [("OpenAI completions, stream", lambda: openai_request(s.openai_port, False, p.model, True)),
             ("OpenAI completions, plain", lambda: openai_request(s.openai_port, False, p.model, False)),
             ("OpenAI chat, stream", lambda: openai_request(s.openai_port, True, p.model, True)),
             ("OpenAI chat, plain", lambda: openai_request(s.openai_port, True, p.model, False)),
             ("Triton generate_stream", lambda: triton_request(s.http_port, True)),
             ("gRPC stream, cancel", lambda: GrpcStream(s.grpc_port)),
             ("Triton generate (plain)", lambda: triton_request(s.http_port, False))]
    for name, start in cases:
        s.wait_idle()
        cancelled = s.metric("trtkv_requests_total", state="cancelled")
        finished = s.metric("trtkv_requests_total", state="finished")
        req = start()
        deadline = time.monotonic() + 120
        while s.metric("trtkv_sequences", state="running") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(1.0)  # a few tokens in
        t_close = time.monotonic()
        if isinstance(req, GrpcStream):
            req.cancel()
        else:
            req.conn.sock.close()
            req.conn.close()
        t_idle = None
        while time.monotonic() - t_close < 120:
            if s.idle():
                t_idle = time.monotonic()
                break
            time.sleep(0.02)
        was_cancelled = s.metric("trtkv_requests_total", state="cancelled") > cancelled
        ran_to_end = s.metric("trtkv_requests_total", state="finished") > finished
        after = (t_idle - t_close) if t_idle else float("inf")
        steps = after / step
        detail = f"idle {after:.2f} s = {steps:.1f} steps after the client left; {'cancelled' if was_cancelled else 'finished' if ran_to_end else '?'}"
        if name == "Triton generate (plain)" and ran_to_end and not was_cancelled:
            p.add("disconnect", name, "limit", detail + " (Triton 2.51's plain generate reads its connection only at the response: docs/serving.md)")
        else:
            p.add("disconnect", name, "held" if was_cancelled and after <= 2 * step + 0.2 else "defect", detail)


def probe_fuzz(p: Probe, s: Serve) -> None:
    counts = {"held": 0, "limit": 0, "defect": 0}
    for case in fuzz_cases(p.model):
        status, text = send_case(case, s.openai_port, s.http_port)
        outcome, why = judge_case(case, status, text)
        counts[outcome] += 1
        if outcome != "held":
            p.add("fuzz", case.name, outcome, why)
    for name, extra in grpc_fuzz():
        error = send_grpc(s.grpc_port, extra)
        ok = error is not None and "internal error" not in error.lower()
        counts["held" if ok else "defect"] += 1
        if not ok:
            p.add("fuzz", name, "defect", str(error)[:150])
    alive = send_case(Case("alive", "openai", "/v1/completions", _j({"model": p.model, "prompt": "hi", "max_tokens": 2})), s.openai_port, s.http_port)[0]
    n = sum(counts.values())
    p.add("fuzz", f"{n} malformed requests (OpenAI, Triton HTTP, gRPC)", "held" if not counts["defect"] and alive == 200 else "defect",
          f"{counts['held']} 4xx naming the problem, {counts['limit']} documented Triton limits, {counts['defect']} defects; serving after: {alive == 200}")


def _timed_get(port: int, path: str) -> float:
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    conn.getresponse().read()
    conn.close()
    return time.monotonic() - t0


def probe_large_body(p: Probe, s: Serve) -> None:
    def others(during: threading.Event | None) -> tuple[float, float]:
        """Most GET /v1/models latency and most gap between SSE chunks of a short stream, while ``during`` is unset."""
        lat = []
        resp = openai_request(s.openai_port, False, p.model, True, max_tokens=60)
        times: list[float] = []

        def read():  # each chunk's arrival, while the GETs run
            while resp.readline():
                times.append(time.monotonic())

        reader = threading.Thread(target=read)
        reader.start()
        stop = time.monotonic() + 6
        while not lat or (time.monotonic() < stop and (during is None or not during.is_set())):
            lat.append(_timed_get(s.openai_port, "/v1/models"))
            time.sleep(0.05)
        reader.join(120)
        resp.conn.close()
        return max(lat), max((b - a for a, b in zip(times, times[1:])), default=0.0)

    base_lat, base_gap = others(None)
    for size, want in ((5_000_000, 413), (900_000, 400)):
        done = threading.Event()
        answer = {}

        def big(size=size, answer=answer, done=done):
            body = json.dumps({"model": p.model, "prompt": "word " * (size // 5), "max_tokens": 3}).encode()
            conn = http.client.HTTPConnection("127.0.0.1", s.openai_port, timeout=120)
            t0 = time.monotonic()
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            answer.update(status=r.status, text=r.read().decode()[:200], s=time.monotonic() - t0)
            done.set()

        th = threading.Thread(target=big)
        th.start()
        lat, gap = others(done)
        th.join(120)
        added = max(lat - base_lat, gap - base_gap)
        ok = answer.get("status") == want and added < 1.0
        p.add("large body", f"{size / 1e6:g} MB prompt -> {want}; other clients meanwhile", "held" if ok else "defect",
              f"{answer.get('status')} in {answer.get('s', float('nan')):.2f} s; GET /v1/models max {lat * 1000:.0f} ms (alone {base_lat * 1000:.0f}), "
              f"SSE gap max {gap * 1000:.0f} ms (alone {base_gap * 1000:.0f}): +{max(added, 0):.2f} s")


def probe_operational(p: Probe, s: Serve) -> None:
    import urllib.request

    text = urllib.request.urlopen(s.metrics_url, timeout=10).read().decode()
    types = {ln.split()[2]: ln.split()[3] for ln in text.splitlines() if ln.startswith("# TYPE trtkv_")}
    counters = ("trtkv_requests_total", "trtkv_preemptions_total", "trtkv_generated_tokens_total")
    ok = all(types.get(c) == "counter" for c in counters) and not any(n.startswith(("trtkv_requests", "trtkv_preemptions", "trtkv_generated"))
                                                                      and t != "counter" for n, t in types.items())
    p.add("operational", "counters typed counter, named _total", "held" if ok else "defect",
          ", ".join(f"{c}: {types.get(c)}" for c in counters))
    health = _status(s.openai_port, "/health")
    card = _status(s.openai_port, f"/v1/models/{p.model}")
    p.add("operational", "OpenAI /health and /v1/models/{id}", "held" if health == card == 200 else "defect", f"{health}, {card}")
    lis = s.listening_at_ready or {}
    p.add("operational", "every port listens when serve prints ready", "held" if lis and all(lis.values()) else "defect", str(lis))


def _status(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    r = conn.getresponse()
    r.read()
    conn.close()
    return r.status


def probe_sigterm_past_grace(p: Probe) -> None:
    s = Serve(p.engine, p.workdir, "--grace", "2", name="sigterm").wait_ready()
    try:
        streams = {"OpenAI completions stream": openai_request(s.openai_port, False, p.model, True),
                   "OpenAI chat stream": openai_request(s.openai_port, True, p.model, True),
                   "Triton generate_stream": triton_request(s.http_port, True)}
        for r in streams.values():
            sse_events(r, 2)
        grpc = GrpcStream(s.grpc_port)
        grpc.next()
        plain = {"OpenAI completions plain": openai_request(s.openai_port, False, p.model, False),
                 "Triton generate plain": triton_request(s.http_port, False)}
        time.sleep(4)
        s.proc.send_signal(signal.SIGTERM)
        for name, r in streams.items():
            how, rest = read_rest(r)
            last = rest[-2:] if rest else []
            if name.startswith("OpenAI"):
                ok = how == "end" and len(last) == 2 and last[1] == "[DONE]" and '"error"' in last[0] and '"type"' in last[0]
            else:
                ok = how == "end" and bool(last) and '"error"' in last[-1]
            p.add("SIGTERM past the grace", name, "held" if ok else "defect", f"{how}; last events {[x[:90] for x in last]}")
        errors = []
        while True:
            try:
                result, error = grpc.next(timeout=30)
            except queue.Empty:
                break
            if error is not None:
                errors.append(str(error))
                break
        grpc.close()
        p.add("SIGTERM past the grace", "gRPC stream", "held" if errors and "shutting down" in errors[0] else "defect", errors[0][:120] if errors else "no error")
        for name, r in plain.items():
            try:
                status, text = r.read_all()
            except OSError as exc:
                status, text = None, repr(exc)
            p.add("SIGTERM past the grace", name, "held" if status and status >= 400 and "shutting down" in text else "defect", f"{status}: {text[:100]}")
        rc, took = s.stop(timeout=120)
        p.add("SIGTERM past the grace", "serve's exit code", "held" if rc == 4 else "defect", f"{rc} after {took:.1f} s: {''.join(s.out[-1:]).strip()}")
    finally:
        s.kill()


def probe_clean_drain(p: Probe) -> None:
    import requests

    s = Serve(p.engine, p.workdir, "--grace", "10", name="drain").wait_ready()
    try:
        sessions = [requests.Session(), requests.Session()]
        r1 = sessions[0].post(f"http://127.0.0.1:{s.http_port}/v2/models/ensemble/generate", json={"text_input": "hi", "max_tokens": 4}, timeout=60)
        r2 = sessions[1].post(f"http://127.0.0.1:{s.openai_port}/v1/completions", json={"model": p.model, "prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r1.status_code == r2.status_code == 200, (r1.text, r2.text)
        rc, took = s.stop(timeout=120)  # the two sessions' connections stay open, idle
        said = "".join(s.out[-1:]).strip()
        p.add("clean drain", "SIGTERM with idle keep-alive connections (Triton and OpenAI)", "held" if rc == 0 and "drained" in said and "cut" not in said else "defect",
              f"exit {rc} after {took:.1f} s: {said}")
        for x in sessions:
            x.close()
    finally:
        s.kill()


def probe_squeezed_pool(p: Probe, deterministic: bool) -> None:
    """8 concurrent requests in a pool of 12 blocks and 4 slots: every one finishes (queued, preempted when the pool runs
    out), with the text it gets alone; bit-equal log-probabilities promised with ``--deterministic`` only (the default
    mode's batched steps are not batch-invariant: docs/serving.md); a request larger than the pool is a 400."""
    from trtkv.manifest import load_manifest

    m = load_manifest(p.engine)
    gib = (4 * m.tail_bytes_per_slot + 12.5 * m.bytes_per_block) / 1024**3
    flags = ("--deterministic",) if deterministic else ()
    s = Serve(p.engine, p.workdir, "--kv-memory", f"{gib:.6f}", "--max-seqs", "4", "--no-prefix-cache", *flags,
              name=f"squeezed{'-det' if deterministic else ''}").wait_ready()
    try:
        blocks = s.metric("trtkv_kv_blocks", state="free")
        prompts = [f"{STORY} Chapter {i}:" for i in range(8)]
        out: dict[int, tuple] = {}

        def one(i):
            r = triton_request(s.http_port, False, max_tokens=200, prompt=prompts[i], return_log_probs=True, exclude_input_in_output=True)
            out[i] = r.read_all()

        ths = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(1800)
        pre = s.metric("trtkv_preemptions_total")
        texts = bits = 0
        for i in range(8):
            alone = json.loads(triton_request(s.http_port, False, max_tokens=200, prompt=prompts[i], return_log_probs=True,
                                              exclude_input_in_output=True).read_all()[1])
            got = json.loads(out[i][1]) if out.get(i, (None,))[0] == 200 else {}
            texts += got.get("text_output") == alone["text_output"]
            bits += got.get("output_log_probs") == alone["output_log_probs"]
        big = triton_request(s.http_port, False, max_tokens=int(blocks + 2) * 64).read_all()
        done = sum(st == 200 for st, _ in out.values())
        ok = done == 8 and big[0] == 400 and (texts == bits == 8 if deterministic else True)
        outcome = "held" if ok else "defect"
        if ok and not deterministic and texts + bits < 16:
            outcome = "limit"  # finished and refused as promised; batched steps are not bit-equal to alone by default
        p.add("squeezed pool", f"{int(blocks)} blocks, 8 concurrent requests of 200 tokens{' (--deterministic)' if deterministic else ''}", outcome,
              f"{done}/8 finished, {int(pre)} preemptions, {texts}/8 texts and {bits}/8 log-probabilities equal to alone; "
              f"larger than the pool: {big[0]}")
        s.stop()
    finally:
        s.kill()


def prefix_prompts(tokenizer, n: int, prefix_tokens: int) -> list[str]:
    text = ("The support assistant answers briefly and precisely, quotes the documentation where it helps and never invents a "
            "setting. The cache keeps every sequence's keys and values in fixed-size blocks; quantized blocks hold more tokens. ")
    ids = tokenizer.encode(text * (1 + prefix_tokens // 30), add_special_tokens=False)[:prefix_tokens]
    prefix = tokenizer.decode(ids)
    return [f"{prefix}\nQuestion {i}: how many tokens does block {i * 7 % 13} hold?\nAnswer:" for i in range(n)]


def _greedy(port: int, prompt: str, max_tokens: int) -> dict:
    r = triton_request(port, False, max_tokens=max_tokens, prompt=prompt, return_log_probs=True, exclude_input_in_output=True, temperature=0.0)
    status, text = r.read_all()
    if status != 200:
        raise RuntimeError(text)
    return json.loads(text)


def prefix_runs(p: Probe, prompts: list[str], max_tokens: int, *args: str) -> dict[str, list[dict]]:
    """The greedy outputs of ``prompts`` on fresh servers: one at a time with the cache on and off, and all at once (no cache)."""
    got = {}
    for mode, flags in (("cache on", ()), ("cache off", ("--no-prefix-cache",))):
        s = Serve(p.engine, p.workdir, *flags, *args, name=f"prefix-{mode.replace(' ', '-')}").wait_ready()
        try:
            got[f"{mode}, alone"] = [_greedy(s.http_port, q, max_tokens) for q in prompts]
            if mode == "cache off":
                res: dict[int, dict] = {}
                ths = [threading.Thread(target=lambda i=i, res=res, port=s.http_port: res.__setitem__(i, _greedy(port, prompts[i], max_tokens)))
                       for i in range(len(prompts))]
                for t in ths:
                    t.start()
                for t in ths:
                    t.join(1800)
                got["cache off, together"] = [res[i] for i in range(len(prompts))]
            s.stop()
        finally:
            s.kill()
    return got


def compare(a: list[dict], b: list[dict]) -> tuple[int, int, float]:
    """(equal texts, bit-equal log-probabilities, the largest log-probability difference) of two runs."""
    texts = sum(x["text_output"] == y["text_output"] for x, y in zip(a, b))
    bits = sum(x["output_log_probs"] == y["output_log_probs"] for x, y in zip(a, b))
    diff = 0.0
    for x, y in zip(a, b):
        for u, v in zip(_flat(x["output_log_probs"]), _flat(y["output_log_probs"])):
            diff = max(diff, abs(u - v))
    return texts, bits, diff


def _flat(x) -> list:
    return [v for item in x for v in _flat(item)] if isinstance(x, list) else [x]


def probe_prefix(p: Probe, deterministic: bool, n: int, prefix_tokens: int, max_tokens: int) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(p.engine / "tokenizer"), local_files_only=True)
    prompts = prefix_prompts(tok, n, prefix_tokens)
    mode = "--deterministic" if deterministic else "default mode"
    t0 = time.monotonic()
    got = prefix_runs(p, prompts, max_tokens, *(("--deterministic",) if deterministic else ()))
    for name, (a, b) in (("cache on vs off (alone)", ("cache on, alone", "cache off, alone")),
                         (f"{n} concurrent vs alone (no cache)", ("cache off, together", "cache off, alone"))):
        texts, bits, diff = compare(got[a], got[b])
        held = texts == n and bits == n
        promised = deterministic or name.startswith("cache")  # the default mode promises a hit changes no bit, not batching
        outcome = "held" if held else ("defect" if promised else "limit")
        p.add(f"prefix cache, {mode}", name, outcome, f"{texts}/{n} texts equal, {bits}/{n} bit-equal log-probabilities, largest difference {diff:.3g}")
    print(f"  (prefix runs took {time.monotonic() - t0:.0f} s)")


# ---------------------------------------------------------------- main


PARTS = ("sigterm", "disconnect", "drain", "fuzz", "body", "operational", "squeezed", "prefix")


def main() -> None:
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from serve import machine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, default=ROOT / "trtkv-out" / "engine-int4")
    ap.add_argument("--skip", default="", help=f"comma-separated parts to skip: {', '.join(PARTS)}")
    ap.add_argument("--prefix-requests", type=int, default=16)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--prefix-max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fault-probe")
    args = ap.parse_args()
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    from trtkv.manifest import load_manifest

    model = load_manifest(args.engine).model.name
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="trtkv-fault-probe-") as tmp:
        p = Probe(args.engine, Path(tmp), model)
        if "sigterm" not in skip:
            probe_sigterm_past_grace(p)
        if "drain" not in skip:
            probe_clean_drain(p)
        if not {"disconnect", "fuzz", "body", "operational"} <= skip:
            s = Serve(p.engine, p.workdir, "--grace", "2", name="main").wait_ready()
            try:
                if "operational" not in skip:
                    probe_operational(p, s)
                if "disconnect" not in skip:
                    probe_disconnects(p, s)
                if "fuzz" not in skip:
                    probe_fuzz(p, s)
                if "body" not in skip:
                    probe_large_body(p, s)
                s.stop()
            finally:
                s.kill()
        if "squeezed" not in skip:
            for det in (False, True):
                probe_squeezed_pool(p, det)
        if "prefix" not in skip:
            for det in (False, True):
                probe_prefix(p, det, args.prefix_requests, args.prefix_tokens, args.prefix_max_tokens)
    took = time.monotonic() - t0
    info = machine()
    date = datetime.now(timezone.utc)
    rows = "\n".join(f"| {r.item} | {r.check} | **{r.outcome}** | {r.detail.replace('|', '/')} |" for r in p.results)
    n = {k: sum(r.outcome == k for r in p.results) for k in ("held", "limit", "defect")}
    md = (f"# Fault probe: `trtkv serve` under faults\n\n"
          f"Command: `python bench/fault_probe.py {' '.join(sys.argv[1:])}`  \n"
          f"Engine: `{args.engine}` ({model}, {load_manifest(args.engine).kv_spec})  \n"
          f"Machine: {info['cpu']}, {info['cores']} cores, load average at start {info['load_avg_start']}  \n"
          f"Date: {date:%Y-%m-%d %H:%M} UTC, {took / 60:.1f} min\n\n"
          f"**{n['held']} held, {n['limit']} documented limits, {n['defect']} defects.** Held: the outcome docs/serving.md promises; "
          "limit: what Triton 2.51 itself does, documented there; defect: neither.\n\n"
          "| item | check | outcome | measured |\n|---|---|---|---|\n" + rows + "\n")
    print("\n" + md)
    out = args.out.with_suffix(".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    print(f"written to {out}")
    raise SystemExit(1 if n["defect"] else 0)


if __name__ == "__main__":
    main()
