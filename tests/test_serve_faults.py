"""Serving under faults, against a real tritonserver (nvidia-pytriton's 2.51, python backend, CPU) and the real
OpenAI front (uvicorn), with real clients (http.client, requests, tritonclient gRPC).

One tiny random-weight int4 engine and one shared server (with the OpenAI front in this process) for the faults that
leave it serving (disconnects, cancels, bad input: bench/fault_probe.py's fuzz list, a body over the limit); the faults
that end a server (stub kill, SIGTERM) start their own `trtkv serve`. Every loop is bounded in count and time; traffic
only to 127.0.0.1.
"""

from __future__ import annotations

import http.client
import json
import queue
import time
from pathlib import Path

import pytest

pytest.importorskip("pytriton")
pytest.importorskip("tritonclient")

from trtkv.runtime.config import RuntimeConfig
from trtkv.triton_repo.client import generate
from trtkv.triton_repo.repository import RepoOptions, write_repository
from trtkv.triton_repo.server import TritonServer, free_port, metric_values

pytestmark = [pytest.mark.server]

PROMPT = "Once upon a time, in a small village,"
# max_tokens of a request the tests cut short or drain. The tiny test model generates 400 tokens in well under a
# second, which let requests finish before a disconnect or a drain was noticed under CI's load (no cancel counted,
# a drain with nothing in flight): 2000 tokens last seconds. The engine's context is 2048.
LONG = 2000
SERVE_MAX_SEQS = 4  # the slots of `Serve`'s server
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
OPENAI_MODEL = "tiny-faults"
SIGTERM_PLAIN = 6  # plain requests beside one stream at SIGTERM: 7 for 4 slots, so 3 wait (Triton 2.51 serves 8 HTTP requests at once)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    from conftest import build_tiny_model, build_tiny_tokenizer

    from trtkv.builder.build import build_engine
    from trtkv.models import load_model

    root = tmp_path_factory.mktemp("faults")
    build_tiny_model(root / "model", "llama", with_tokenizer=True, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     max_position_embeddings=2048)  # fmt: skip
    tok = build_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE  # the OpenAI front's chat endpoint renders it
    tok.save_pretrained(str(root / "model"))
    loaded = load_model(str(root / "model"), device="cpu", dtype="float32")
    return build_engine(str(root / "model"), kv="int4", out=root / "engine-int4", backend="onnxruntime", block_size=16, max_batch=8, max_seq_len=2048, loaded=loaded)


def start(engine: Path, tmp: Path, **runtime) -> TritonServer:
    """A server on ``engine``: ``runtime`` are RuntimeConfig fields."""
    repo = write_repository(engine, tmp / "repo", RepoOptions(runtime=RuntimeConfig(**runtime), instance_kind="cpu"), force=True)
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_file=tmp / "tritonserver.log")
    return server.start(timeout=120)


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    s = start(engine, tmp_path_factory.mktemp("shared"), kv_memory_gib=0.01, max_seqs=8)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def front(engine, server):
    """The OpenAI front (uvicorn, in this process) on the shared server; its port."""
    from trtkv.manifest import load_manifest
    from trtkv.triton_repo.openai_api import load_served, start_openai_server, stop_openai_server

    port = free_port()
    s = start_openai_server(load_served(engine, load_manifest(engine), server.http_url, OPENAI_MODEL), "127.0.0.1", port)
    try:
        yield port
    finally:
        stop_openai_server(s, 10)


def fault_probe():
    """bench/fault_probe.py, whose fuzz list and request helpers these tests share."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import fault_probe

    return fault_probe


def metric(server: TritonServer, name: str, **labels) -> float:
    return max(server.metric_values(name, **labels), default=float("nan"))


def wait_idle(server: TritonServer, timeout: float = 10.0) -> float:
    """Seconds until no sequence runs or waits and no pool block is used (pytest.fail after ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if (
            metric(server, "trtkv_sequences", state="running") == 0
            and metric(server, "trtkv_sequences", state="waiting") == 0
            and metric(server, "trtkv_kv_blocks", state="used") == 0
        ):
            return time.monotonic() - t0
        time.sleep(0.05)
    pytest.fail(f"the runtime still holds sequences / blocks {timeout} s later")


def post(server: TritonServer, path: str, body: dict, timeout: float = 60) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def _stream(port: int, body: dict, events: int, timeout: float):
    """Start ``generate_stream`` on ``ensemble`` at ``port`` and read ``events`` SSE events: (connection, response, events)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v2/models/ensemble/generate_stream", body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    got: list[dict] = []
    while len(got) < events:
        line = resp.readline()
        assert line, f"stream ended after {len(got)} events"
        if line.startswith(b"data:"):
            got.append(json.loads(line[5:]))
    return conn, resp, got


def open_stream(server: TritonServer, body: dict, events: int, timeout: float = 30) -> tuple[http.client.HTTPConnection, list[dict]]:
    """Start ``generate_stream`` on ``ensemble`` and read ``events`` SSE events; the connection stays open."""
    conn, _, got = _stream(server.http_port, body, events, timeout)
    return conn, got


def generated_tokens(server: TritonServer) -> float:
    return metric(server, "trtkv_generated_tokens_total")


def cancelled(server: TritonServer) -> float:
    return metric(server, "trtkv_requests_total", state="cancelled")


def assert_aborted_within_a_few_steps(server: TritonServer, cancelled_before: float, tokens_before: float, seen: int) -> None:
    """The runtime counted the request cancelled, holds no sequence or block, and stopped soon after ``seen`` tokens.
    "Soon" is counted in tokens: well before the request's end (half of it). Under CI's load (two test workers beside
    the server) noticing a closed socket took ~500 tokens of the tiny test model once, and a 10 s wait flaked."""
    got = server.wait_for_metric("trtkv_requests_total", cancelled_before + 1, timeout=60, state="cancelled")
    assert got >= cancelled_before + 1, "the runtime never aborted the request"
    wait_idle(server)
    produced = generated_tokens(server) - tokens_before
    assert produced < seen + LONG / 2, f"{produced} of {LONG} tokens generated after the client left at {seen}"


# ---------------------------------------------------------------- 1. disconnect and cancel through `ensemble`


def test_http_disconnect_through_ensemble_aborts_and_frees_blocks(server):
    wait_idle(server)
    before, n_cancelled = generated_tokens(server), cancelled(server)
    conn, events = open_stream(server, {"text_input": PROMPT, "max_tokens": LONG, "min_tokens": LONG}, events=3)
    assert all("error" not in e for e in events)
    conn.sock.close()  # the client goes away mid-stream (curl -m 1)
    conn.close()
    assert_aborted_within_a_few_steps(server, n_cancelled, before, seen=3)
    assert generate(server.http_url, "still", 3)["text_output"].startswith("still")


def test_grpc_cancel_through_ensemble_aborts_and_frees_blocks(server):
    import numpy as np
    import tritonclient.grpc as grpcclient

    wait_idle(server)
    before, n_cancelled = generated_tokens(server), cancelled(server)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))

    def inp(name, value, dtype, np_dtype):
        t = grpcclient.InferInput(name, [1, 1], dtype)
        t.set_data_from_numpy(np.array([[value]], dtype=np_dtype))
        return t

    try:
        inputs = [
            inp("text_input", PROMPT.encode(), "BYTES", object),
            inp("max_tokens", LONG, "INT32", np.int32),
            inp("min_tokens", LONG, "INT32", np.int32),
            inp("stream", True, "BOOL", bool),
        ]
        client.async_stream_infer("ensemble", inputs)
        for _ in range(3):
            _, error = results.get(timeout=30)
            assert error is None, error
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    assert_aborted_within_a_few_steps(server, n_cancelled, before, seen=3)


# ---------------------------------------------------------------- disconnects of the OpenAI front and of plain requests


def wait_running(server: TritonServer, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while metric(server, "trtkv_sequences", state="running") < 1:
        assert time.monotonic() < deadline, "the request never reached the model"
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_request_whose_client_leaves_is_aborted_and_frees_blocks(server, front, chat, stream):
    """A client of the OpenAI front that leaves -- mid-stream, or while it waits for a plain answer -- has its request
    aborted (counted cancelled, its blocks freed) well before its end: the front closes its stream to Triton, whose
    closed connection the model sees at its next step."""
    fp = fault_probe()
    wait_idle(server)
    before, n_cancelled = generated_tokens(server), cancelled(server)
    resp = fp.openai_request(front, chat, OPENAI_MODEL, stream, max_tokens=LONG - 200, prompt=PROMPT)  # + the chat template: in the context
    if stream:
        assert len(fp.sse_events(resp, 3)) == 3
    wait_running(server)
    seen = generated_tokens(server) - before
    resp.conn.sock.close()
    resp.conn.close()
    assert_aborted_within_a_few_steps(server, n_cancelled, before, seen=int(seen) + 3)


@pytest.mark.slow
def test_a_plain_triton_generate_whose_client_leaves_runs_to_its_end(server):
    """Triton 2.51's plain generate endpoint does not read a request's connection until the model's one response
    (docs/serving.md): the model cannot see that the client left, and the request runs to max_tokens. Pinned so that
    the docs change when a Triton version does tell (then this test fails)."""
    fp = fault_probe()
    wait_idle(server)
    finished, n_cancelled = metric(server, "trtkv_requests_total", state="finished"), cancelled(server)
    req = fp.triton_request(server.http_port, False, max_tokens=300, prompt=PROMPT)
    wait_running(server)
    req.conn.sock.close()
    req.conn.close()
    assert server.wait_for_metric("trtkv_requests_total", finished + 1, timeout=120, state="finished") >= finished + 1
    assert cancelled(server) == n_cancelled
    wait_idle(server)


# ---------------------------------------------------------------- bad input: the fuzz list, bodies over the limit


@pytest.mark.slow
def test_every_malformed_request_is_a_4xx_naming_it_or_a_documented_triton_limit(server, front):
    """bench/fault_probe.py's fuzz list on the OpenAI front and Triton's HTTP endpoints, and its typed gRPC list: a 4xx
    with an error body (OpenAI's shape on the front) for each, never a 5xx of ours; the server keeps serving."""
    fp = fault_probe()
    bad = []
    for case in fp.fuzz_cases(OPENAI_MODEL):
        status, text = fp.send_case(case, front, server.http_port)
        outcome, why = fp.judge_case(case, status, text)
        if outcome == "defect":
            bad.append((case.name, why))
    for name, extra in fp.grpc_fuzz():
        error = fp.send_grpc(server.grpc_port, extra)
        if error is None or "internal error" in error.lower():
            bad.append((name, error or "accepted"))
    assert not bad, bad
    status, text = fp.send_case(fp.Case("ok", "openai", "/v1/completions", fp._j({"model": OPENAI_MODEL, "prompt": "hi", "max_tokens": 2})),
                                front, server.http_port)
    assert status == 200, text


@pytest.mark.parametrize("case", ["triton: lone surrogate", "triton: seed 2^64", "triton: stream true on generate"])
def test_the_documented_triton_limits_are_what_triton_answers(server, front, case):
    """The fuzz cases marked as Triton 2.51's own answers get exactly that (a 500 from its JSON parser, a 200 with the
    one-response error): if a later Triton answers a 4xx, the limit and its doc line go."""
    fp = fault_probe()
    (c,) = [c for c in fp.fuzz_cases(OPENAI_MODEL) if c.name == case]
    status, text = fp.send_case(c, front, server.http_port)
    assert fp.judge_case(c, status, text)[0] == "limit", (status, text)


@pytest.mark.slow
def test_a_body_over_the_limit_is_a_413_and_other_clients_are_served_meanwhile(server, front):
    """A 5 MB prompt is refused with a 413 before it is parsed or tokenized; a GET /v1/models sent while it uploads is
    answered."""
    import threading

    fp = fault_probe()
    answer = {}

    def big():
        conn = http.client.HTTPConnection("127.0.0.1", front, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps({"model": OPENAI_MODEL, "prompt": "word " * 1_000_000, "max_tokens": 3}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        answer.update(status=r.status, body=json.loads(r.read()))

    t = threading.Thread(target=big)
    t.start()
    assert fp._status(front, "/v1/models") == 200
    t.join(120)
    assert answer["status"] == 413 and answer["body"]["error"]["code"] == "request_too_large", answer


def test_counters_are_typed_counter_and_named_total(server):
    import urllib.request

    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    types = {ln.split()[2]: ln.split()[3] for ln in text.splitlines() if ln.startswith("# TYPE trtkv_")}
    for name in ("trtkv_requests_total", "trtkv_preemptions_total", "trtkv_generated_tokens_total", "trtkv_prefix_cache_hit_tokens_total",
                 "trtkv_prefix_cache_evicted_blocks_total"):
        assert types.get(name) == "counter", (name, types)
    assert types.get("trtkv_kv_blocks") == "gauge" and types.get("trtkv_sequences") == "gauge"


# ---------------------------------------------------------------- 3. missing required inputs


@pytest.mark.parametrize(
    "body,missing",
    [
        ({"max_tokens": 8, "temperature": 0.5}, "text_input"),
        ({"text_input": "hi", "temperature": 0.5}, "max_tokens"),
        ({"max_tokens": 8, "stream": True}, "text_input"),
    ],
)
def test_http_missing_required_input_is_400_naming_it(server, body, missing):
    status, text = post(server, "/v2/models/ensemble/generate", body)
    assert status == 400 and missing in text, (status, text)


@pytest.mark.parametrize("given,missing", [(("max_tokens", "stream"), "text_input"), (("text_input", "stream"), "max_tokens")])
def test_grpc_missing_required_input_is_invalid_argument_naming_it(server, given, missing):
    import numpy as np
    import tritonclient.grpc as grpcclient

    values = {"text_input": (b"hi", "BYTES", object), "max_tokens": (8, "INT32", np.int32), "stream": (True, "BOOL", bool)}
    inputs = []
    for name in given:
        v, dtype, np_dtype = values[name]
        t = grpcclient.InferInput(name, [1, 1], dtype)
        t.set_data_from_numpy(np.array([[v]], dtype=np_dtype))
        inputs.append(t)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
        result, error = results.get(timeout=30)
    finally:
        client.stop_stream()
        client.close()
    assert error is not None, f"an empty OK: {result.get_response() if result else None}"
    assert missing in str(error) and ("INVALID_ARG" in str(error) or "StatusCode.INVALID_ARGUMENT" in str(error) or "[400]" in str(error) or "missing" in str(error)), str(error)


# ---------------------------------------------------------------- 7. smaller ones


@pytest.mark.parametrize("extra", [{"foo": 1}, {"ignore_eos": True}, {"lora_task_id": 3}])
def test_http_undeclared_input_is_400_naming_it_and_counted_rejected(server, extra):
    rejected = metric(server, "trtkv_requests_total", state="rejected")
    status, text = post(server, "/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 3, **extra})
    (name,) = extra
    assert status == 400 and name in text and "unknown input" in text, (status, text)
    assert server.wait_for_metric("trtkv_requests_total", rejected + 1, timeout=5, state="rejected") >= rejected + 1
    assert generate(server.http_url, "still", 3)["text_output"].startswith("still")


def test_stream_sends_one_response_per_token_even_while_text_is_held_back(server):
    """A step whose token ends in a partial UTF-8 character has ids but no text yet: it still gets a response."""
    conn, events = open_stream(server, {"text_input": PROMPT, "max_tokens": 60, "min_tokens": 60}, events=60)
    try:
        assert any(e["text_output"] == "" for e in events), "no held-back text in this stream: the test proves nothing"
    finally:
        conn.close()
    assert len(events) == 60


def test_error_hints_keep_square_brackets(capsys):
    import typer

    from trtkv.cli_options import handle_errors
    from trtkv.errors import TrtkvError

    @handle_errors
    def fail():
        raise TrtkvError("no tritonserver found", "install the serve extra (pip install 'trtkv[serve]')")

    with pytest.raises(typer.Exit):
        fail()
    assert "pip install 'trtkv[serve]'" in capsys.readouterr().err


def test_a_hand_corrupted_runtime_config_fails_the_load_with_one_line_naming_file_and_field(engine, tmp_path):
    """The python model validates runtime_config.json where tritonserver runs it: the server does not come up,
    and its log has one line naming the file and the field (tests/test_runtime_config.py covers the cases)."""
    from trtkv.errors import TrtkvError
    from trtkv.triton_repo.repository import RUNTIME_CONFIG

    repo = write_repository(engine, tmp_path / "repo", RepoOptions(instance_kind="cpu"), force=True)
    path = repo / "ensemble" / "1" / RUNTIME_CONFIG
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_seqs": 0}))
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_file=tmp_path / "tritonserver.log")
    try:
        with pytest.raises(TrtkvError, match="while loading"):
            server.start(timeout=120)
    finally:
        server.stop(0)
    want = f"trtkv: {path}: max_seqs (--max-seqs) = 0: "
    assert any(want in line for line in (tmp_path / "tritonserver.log").read_text().splitlines())


# ---------------------------------------------------------------- 4. preemption through the server


@pytest.mark.slow
def test_small_pool_preemption_changes_no_output(engine, tmp_path):
    """4 slots and 5 int4 blocks of 16 tokens for 8 concurrent 40-token greedy streams (3 sealed blocks each: any two
    running together overflow the pool, however the requests' arrivals interleave): the runtime preempts, and every
    output (text and log-probabilities) equals the same request served alone."""
    import threading

    from trtkv.manifest import load_manifest

    m = load_manifest(engine)
    budget = (4 * m.tail_bytes_per_slot + 5.5 * m.bytes_per_block) / 1024**3
    # the prompts share a prefix: without the prefix cache every request needs its own blocks, and the pool preempts
    s = start(engine, tmp_path, kv_memory_gib=budget, max_seqs=4, enable_prefix_caching=False)
    try:
        prompts = [f"{PROMPT} #{i}" for i in range(8)]
        body = {"max_tokens": 40, "min_tokens": 40, "return_log_probs": True, "exclude_input_in_output": True}
        together: dict[int, dict] = {}
        errors: list[str] = []

        def run(i):
            status, text = post(s, "/v2/models/ensemble/generate", {"text_input": prompts[i], **body}, timeout=120)
            (together.__setitem__(i, json.loads(text)) if status == 200 else errors.append(text))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        assert not errors and len(together) == 8, errors
        # the loop pushes its counters after the step that answered the last request: wait for that push
        assert s.wait_for_metric("trtkv_preemptions_total", 1, timeout=10) >= 1, "the pool was not small enough to preempt"
        for i, p in enumerate(prompts):
            status, text = post(s, "/v2/models/ensemble/generate", {"text_input": p, **body})
            alone = json.loads(text)
            assert status == 200 and together[i]["text_output"] == alone["text_output"], i
            assert together[i]["output_log_probs"] == alone["output_log_probs"], i
    finally:
        s.stop()


# ---------------------------------------------------------------- `trtkv serve` as a process: stub kill and SIGTERM


class Serve:
    """``trtkv serve`` in a subprocess on free ports; stdout and stderr collected by reader threads."""

    def __init__(self, engine: Path, tmp: Path, *args: str):
        import subprocess
        import sys
        import threading

        self.ports = [free_port() for _ in range(4)]
        cmd = [sys.executable, "-m", "trtkv.cli", "serve", str(engine), "--repo", str(tmp / "repo"), "--kv-memory", "0.01", "--max-seqs", str(SERVE_MAX_SEQS),
               "--http-port", str(self.ports[0]), "--grpc-port", str(self.ports[1]), "--metrics-port", str(self.ports[2]),
               "--openai-port", str(self.ports[3]), "--served-model-name", OPENAI_MODEL, *args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda st=stream, sk=sink: [sk.append(line) for line in st], daemon=True).start()
        self.http_port, self.openai_port = self.ports[0], self.ports[3]

    def wait_for(self, text: str, timeout: float = 300) -> None:
        """Until ``text`` is printed. Generous by default: a server start under CI's load on a slow 2-core machine once
        took over 120 s (the other worker's kernel test ran 8x its usual time beside it); a start is not what is tested."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.out + self.err):
            assert self.proc.poll() is None or time.monotonic() < deadline, f"serve exited: {''.join(self.out + self.err)}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s: {''.join(self.out + self.err)}"
            time.sleep(0.1)

    def tritonserver_pid(self) -> int:
        from trtkv.triton_repo.server import child_pids

        (pid,) = child_pids(self.proc.pid)
        return pid

    def stub_pid(self) -> int:
        from trtkv.triton_repo.server import STUB_NAME, _cmdline, child_pids

        (pid,) = [p for p in child_pids(self.tritonserver_pid()) if STUB_NAME in _cmdline(p)]
        return pid

    def shm_prefix(self) -> str:
        from trtkv.triton_repo.server import _cmdline

        return _cmdline(self.tritonserver_pid()).split("shm-region-prefix-name=", 1)[1].split()[0]

    def wait_in_loop(self, n: int, timeout: float = 60) -> None:
        """Until ``n`` requests run or wait in the model's loop (its pushed gauges)."""
        url = f"http://127.0.0.1:{self.ports[2]}/metrics"
        deadline = time.monotonic() + timeout
        while True:
            held = sum(sum(metric_values(url, "trtkv_sequences", state=state)) for state in ("running", "waiting"))
            if held >= n:
                return
            assert time.monotonic() < deadline, f"only {held} of {n} requests reached the model in {timeout} s"
            time.sleep(0.05)

    def wait_for_log(self, text: str, timeout: float = 30) -> None:
        """Until tritonserver's log (the path serve printed) has a line with ``text``."""
        (path,) = [Path(line.split()[-1]) for line in self.out if line.strip().startswith("log ")]
        deadline = time.monotonic() + timeout
        while not (path.is_file() and text in path.read_text(errors="replace")):
            assert time.monotonic() < deadline, f"no {text!r} in {path} within {timeout} s"
            time.sleep(0.05)

    def ready(self) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=2)
            conn.request("GET", "/v2/health/ready")
            return conn.getresponse().status == 200
        except OSError:
            return False

    def close(self) -> None:
        """Kill serve and, first, the tritonserver it started (its own session: it would outlive serve)."""
        import os
        import signal

        from trtkv.triton_repo.server import _cmdline, child_pids

        if self.proc.poll() is None:
            for pid in child_pids(self.proc.pid):
                prefix = _cmdline(pid).split("shm-region-prefix-name=", 1)[-1].split()[0] if "shm-region-prefix-name=" in _cmdline(pid) else None
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
                for region in Path("/dev/shm").glob(f"{prefix}*") if prefix else ():
                    region.unlink(missing_ok=True)
            self.proc.kill()
            self.proc.wait(30)


def open_stream_resp(port: int, body: dict, events: int, timeout: float = 20):
    """``generate_stream`` on ``ensemble`` at ``port``; the response after ``events`` SSE events have been read."""
    _, resp, got = _stream(port, body, events, timeout)
    return resp, got


def rest_of_stream(resp) -> tuple[str, list[dict]]:
    """Read a stream to its end: ("end", events) when the server ended it properly (HTTP's last chunk),
    ("error", events) when the last event is an error, ("cut", events) when the connection broke
    mid-stream (curl: "transfer closed with outstanding read data"), ("hang", []) after the socket timeout."""

    def parse(data: bytes) -> list[dict]:
        return [json.loads(line[5:]) for line in data.splitlines() if line.startswith(b"data:")]

    try:
        events = parse(resp.read())
    except http.client.IncompleteRead as exc:
        return "cut", parse(exc.partial)
    except TimeoutError:
        return "hang", []
    return ("error" if events and "error" in events[-1] else "end"), events


@pytest.mark.slow
def test_killed_model_process_fails_readiness_errors_clients_restarts_then_exits_3(engine, tmp_path):
    import os
    import signal

    s = Serve(engine, tmp_path, "--restarts", "1")
    try:
        s.wait_for("Ctrl-C")
        stub = s.stub_pid()  # found before the stream opens: on a loaded machine the search outlasted the 400 tokens
        resp, _ = open_stream_resp(s.http_port, {"text_input": PROMPT, "max_tokens": LONG, "min_tokens": LONG}, events=3)
        os.kill(stub, signal.SIGKILL)
        t0 = time.monotonic()
        how, rest = rest_of_stream(resp)
        assert how in ("cut", "error") and time.monotonic() - t0 < 10, (how, len(rest), rest[-2:], time.monotonic() - t0)  # an error, not a stream left hanging
        deadline = time.monotonic() + 5
        while s.ready() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not s.ready(), "a dead model still reports ready"
        s.wait_for("ready again", timeout=120)
        assert any("died" in line for line in s.err) and any("restarting" in line for line in s.err)
        assert generate(f"http://127.0.0.1:{s.http_port}", "again", 3)["text_output"].startswith("again")
        os.kill(s.stub_pid(), signal.SIGKILL)  # no restarts left
        assert s.proc.wait(60) == 3
        assert any("no restarts left" in line for line in s.err)
    finally:
        s.close()


@pytest.mark.slow
@pytest.mark.parametrize("grace", ["300", "0"])  # 300: long enough that CI's load never ends the drain early
def test_sigterm_drains_or_fails_in_flight_requests_and_leaves_nothing_behind(engine, tmp_path, grace):
    """SIGTERM with streams (Triton generate_stream, OpenAI completions and chat) and plain requests in flight (more
    than --max-seqs: some wait): within --grace all finish and a request sent while draining is refused, and serve exits
    0 although idle keep-alive connections (a requests.Session on Triton and on the OpenAI front) stay open; with
    --grace 0 every one gets an explicit error -- an OpenAI stream an error event in OpenAI's shape, then [DONE] -- and
    serve exits 4. Never a silent cut; the shared memory is removed; every port listened when serve printed "ready".
    The signal goes out only once every request is in the model's loop, and the requests outnumber the slots, so the
    drain lasts at least one whole round of generation: on the tiny test model one round can end before a drain
    starts, which once let the requests finish before the late one was sent."""
    import signal
    import threading

    import requests

    fp = fault_probe()
    s = Serve(engine, tmp_path, "--grace", grace)
    try:
        s.wait_for("ready")
        assert fp._listening(s.openai_port) and fp._listening(s.http_port), "serve said ready before every port listened"
        s.wait_for("Ctrl-C")
        prefix = s.shm_prefix()
        assert list(Path("/dev/shm").glob(prefix + "*")), "no shared memory to check"
        assert all(p.stat().st_mode & 0o077 == 0 for p in Path("/dev/shm").glob(prefix + "*")), "shared memory readable by others"
        sessions = [requests.Session(), requests.Session()]  # used once, then left open and idle
        assert sessions[0].post(f"http://127.0.0.1:{s.http_port}/v2/models/ensemble/generate", json={"text_input": "hi", "max_tokens": 2}, timeout=60).ok
        assert sessions[1].post(f"http://127.0.0.1:{s.openai_port}/v1/models/{OPENAI_MODEL}", timeout=60).status_code == 405
        body = {"text_input": PROMPT, "max_tokens": LONG, "min_tokens": LONG}
        # the plain requests are half as long: the stream alone keeps the drain going past the late request, and the
        # waiting ones run in the stream's second half instead of a second whole round
        plain_body = {**body, "max_tokens": LONG // 2, "min_tokens": LONG // 2}
        n_plain = SIGTERM_PLAIN - 2  # two OpenAI streams take their places (Triton 2.51 serves 8 HTTP requests at once)
        plain: list[tuple] = []

        def send_plain():
            try:
                plain.append(post(s, "/v2/models/ensemble/generate", plain_body, timeout=600))  # the waiting ones wait for the streams
            except OSError as exc:  # a cut connection: recorded so that the assertion below names it
                plain.append((None, f"{type(exc).__name__}: {exc}"))

        resp, first = open_stream_resp(s.http_port, body, events=3)  # first: running before the plain ones queue
        openai_streams = [fp.openai_request(s.openai_port, chat, OPENAI_MODEL, True, max_tokens=LONG - 200, prompt=PROMPT) for chat in (False, True)]
        for r in openai_streams:  # each has its first chunk: running
            assert len(fp.sse_events(r, 1)) == 1
        threads = [threading.Thread(target=send_plain) for _ in range(n_plain)]
        for t in threads:
            t.start()
        s.wait_in_loop(n_plain + 3)
        stub = s.stub_pid()
        s.proc.send_signal(signal.SIGTERM)
        if grace != "0":  # while draining new requests are refused (UNAVAILABLE; Triton 2.51's HTTP generate answers it with 400)
            s.wait_for_log("shutdown: draining")  # the model took the drain: it admits nothing new from here
            late = post(s, "/v2/models/ensemble/generate", {"text_input": "late", "max_tokens": 3})
            assert late[0] in (400, 503) and "shutting down" in late[1], late
        how, rest = rest_of_stream(resp)
        openai_ends = [fp.read_rest(r) for r in openai_streams]
        for t in threads:
            t.join(120)
        rc = s.proc.wait(90)
        assert len(plain) == n_plain, plain
        for end, lines in openai_ends:
            assert end == "end" and lines[-1] == "[DONE]", (end, lines[-2:])  # never a cut
        if grace == "0":  # requests that ended before the drain began are whole; every other one is an explicit error
            ended = [how == "end" and len(first) + len(rest) == LONG] + [st == 200 and "text_output" in text for st, text in plain]
            failed = [how == "error" and "shutting down" in rest[-1]["error"]] + [bool(st) and st >= 400 and "shutting down" in text for st, text in plain]
            assert all(e or f for e, f in zip(ended, failed)), ((how, rest[-1:]), [(st, text[-300:]) for st, text in plain])
            assert sum(failed) >= n_plain + 1 - SERVE_MAX_SEQS, (failed, "the requests waiting for a slot at SIGTERM must fail")
            for _, lines in openai_ends:  # an error event in OpenAI's shape, then [DONE]
                error = json.loads(lines[-2])["error"]
                assert error["type"] == "server_error" and "shutting down" in error["message"] and set(error) == {"message", "type", "param", "code"}
            assert rc == 4 and any("failed" in line for line in s.out), (rc, s.out)
        else:
            assert how == "end" and len(first) + len(rest) == LONG, (how, len(first) + len(rest))
            assert all(st == 200 and "text_output" in text for st, text in plain), plain
            for _, lines in openai_ends:  # the last chunk has the finish reason
                assert json.loads(lines[-2])["choices"][0]["finish_reason"] == "length", lines[-2:]
            assert rc == 0 and any("drained, every request in flight finished" in line for line in s.out), (rc, s.out, s.err)
            assert not any("cut" in line for line in s.out), s.out
        for x in sessions:
            x.close()
        assert not list(Path("/dev/shm").glob(prefix + "*")), "shared memory left behind"
        from trtkv.triton_repo.server import _proc_state

        assert _proc_state(stub) in (None, "Z", "X"), "the model process outlived tritonserver"
    finally:
        s.close()
