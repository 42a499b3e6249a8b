"""Against a real tritonserver (nvidia-pytriton's 2.51, python backend, CPU) on loopback, ephemeral ports.

Tiny random-weight Llama engines (fp16, int8, int4) built by ``build_engine``; every server is stopped in
a ``finally``. The real-SmolLM2 token-for-token check is marked ``model``.
"""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("pytriton")
pytest.importorskip("tritonclient")

from trtkv.runtime.config import RuntimeConfig
from trtkv.triton_repo.client import GenerateError, generate, stream_generate
from trtkv.triton_repo.repository import RepoOptions, write_repository
from trtkv.triton_repo.server import TritonServer, free_port

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPTS = ["The quick brown fox", "def f(x):\n    return", "Pack my box with", "Sphinx of black quartz, judge", "0123456789 {}[]"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from conftest import build_tiny_model

    from trtkv.builder.build import build_engine
    from trtkv.models import load_model

    root = tmp_path_factory.mktemp("serve")
    build_tiny_model(root / "model", "llama", with_tokenizer=True, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    loaded = load_model(str(root / "model"), device="cpu", dtype="float32")
    out = {}
    for kv in ("fp16", "int8", "int4"):
        out[kv] = build_engine(str(root / "model"), kv=kv, out=root / f"engine-{kv}", backend="onnxruntime", block_size=16, max_batch=8, max_seq_len=256, loaded=loaded)
    return out


def start(engine: Path, tmp: Path, instances: int = 1, **runtime) -> TritonServer:
    """A server on ``engine``: ``runtime`` are RuntimeConfig fields."""
    repo = write_repository(engine, tmp / f"repo-{engine.name}", RepoOptions(runtime=RuntimeConfig(**runtime), instance_kind="cpu", instances=instances), force=True)
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_file=tmp / f"{engine.name}.log")
    return server.start(timeout=120)


@pytest.fixture(scope="module")
def int4_server(engines, tmp_path_factory):
    server = start(engines["int4"], tmp_path_factory.mktemp("int4"), kv_memory_gib=0.01, max_seqs=16)
    try:
        yield server
    finally:
        server.stop()


def offline(engine: Path, prompts, max_tokens: int, kv_memory_gib: float = 0.01, max_seqs: int = 16, **kw) -> list[str]:
    from trtkv.runtime.llm_engine import LLMEngine, RuntimeConfig
    from trtkv.runtime.sequence import SamplingParams

    llm = LLMEngine.from_engine_dir(engine, RuntimeConfig(kv_memory_gib=kv_memory_gib, max_seqs=max_seqs))
    return [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, **kw))]


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_generate_and_generate_stream_answer_with_text(int4_server):
    url = int4_server.http_url
    data = generate(url, PROMPTS[0], 12)
    assert data["model_name"] == "ensemble" and data["text_output"].startswith(PROMPTS[0]) and len(data["text_output"]) > len(PROMPTS[0])
    excl = generate(url, PROMPTS[0], 12, exclude_input_in_output=True)["text_output"]
    assert data["text_output"] == PROMPTS[0] + excl
    pieces = list(stream_generate(url, PROMPTS[0], 12))
    assert len(pieces) >= 2 and "".join(p.text for p in pieces) == excl


@pytest.mark.parametrize("kv", ["fp16", "int8", "int4"])
def test_server_greedy_is_the_offline_runtime_token_for_token(engines, int4_server, tmp_path, kv):
    want = offline(engines[kv], PROMPTS, 24, ignore_eos=True)
    server = int4_server if kv == "int4" else start(engines[kv], tmp_path, kv_memory_gib=0.01, max_seqs=16)
    try:
        got = [generate(server.http_url, p, 24, min_length=24, exclude_input_in_output=True)["text_output"] for p in PROMPTS]
        streamed = ["".join(x.text for x in stream_generate(server.http_url, p, 24, min_length=24)) for p in PROMPTS[:2]]
    finally:
        if server is not int4_server:
            server.stop()
    assert got == want
    assert streamed == want[:2]


def test_sixteen_concurrent_streams_mixed_parameters(int4_server):
    url = int4_server.http_url
    rng = random.Random(0)
    jobs = []
    for i in range(16):
        params = {"seed": 1000 + i}
        if i % 3 == 1:
            params.update(temperature=0.9, top_k=20)
        elif i % 3 == 2:
            params.update(temperature=0.7, top_p=0.8)
        jobs.append((f"{PROMPTS[i % len(PROMPTS)]} #{i}", rng.randint(4, 40), params))
    results: dict[int, list] = {}
    errors: list[str] = []

    def run(i):
        prompt, n, params = jobs[i]
        try:
            results[i] = [p.raw for p in stream_generate(url, prompt, n, min_length=n, **params)]
        except Exception as exc:
            errors.append(f"{i}: {exc}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and sorted(results) == list(range(16))
    # none mixed up: each stream, replayed alone with the same seed, gives the same text
    for i in (0, 4, 7, 11):
        prompt, n, params = jobs[i]
        alone = "".join(p.text for p in stream_generate(url, prompt, n, min_length=n, **params))
        assert "".join(r["text_output"] for r in results[i]) == alone


@pytest.mark.parametrize(
    "body,status,match",
    [
        ({"max_tokens": 4}, 400, "text_input"),
        ({"text_input": "hi", "max_tokens": -3}, 400, "max_tokens must be between"),
        ({"text_input": "hi " * 400, "max_tokens": 4}, 400, "exceeds the engine's context of 256"),
        ({"text_input": "hi", "max_tokens": 4, "beam_width": 3}, 400, "beam_width"),
    ],
)
def test_malformed_requests_get_400_and_server_keeps_serving(int4_server, body, status, match):
    code, data = post(int4_server.http_url, "/v2/models/ensemble/generate", body)
    assert code == status and match in data.get("error", ""), (code, data)
    assert generate(int4_server.http_url, "still", 3)["text_output"].startswith("still")


def test_wrong_dtype_is_refused(int4_server):
    """gRPC stream (the typed API): an error naming the input and the expected type. The HTTP generate
    endpoint's JSON parser (Triton's own) answers a wrongly typed value with 500 and a message; either
    way the server keeps serving."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    url = f"127.0.0.1:{int4_server.grpc_port}"
    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[b"hi"]], dtype=object))
        bad = grpcclient.InferInput("max_tokens", [1, 1], "FP32")
        bad.set_data_from_numpy(np.array([[4.0]], dtype=np.float32))
        client.async_stream_infer("ensemble", [text, bad])
        _, error = results.get(timeout=30)
        assert error is not None and "max_tokens" in str(error) and "INT32" in str(error)
    finally:
        client.stop_stream()
        client.close()
    code, data = post(int4_server.http_url, "/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": "many"})
    assert code in (400, 500) and "parse" in data.get("error", "")
    assert generate(int4_server.http_url, "still", 3)["text_output"].startswith("still")


def test_metrics_show_requests_and_pool(int4_server):
    generate(int4_server.http_url, PROMPTS[1], 20)
    assert int4_server.wait_for_metric("nv_inference_request_success", 1, model="ensemble") >= 1
    assert int4_server.wait_for_metric("trtkv_requests_total", 1, state="finished") >= 1
    text = urllib.request.urlopen(int4_server.metrics_url, timeout=10).read().decode()
    for family in ("trtkv_kv_blocks", "trtkv_kv_slots", "trtkv_sequences", "trtkv_kv_pool_info", "trtkv_peak_running_sequences"):
        assert f"{family}{{" in text, family
    assert 'kv_format="int4@block16"' in text
    used = [ln for ln in text.splitlines() if ln.startswith("trtkv_kv_blocks{") and 'state="free"' in ln]
    assert float(used[0].split()[-1]) > 0


def test_prefix_cache_hits_through_the_server_change_no_output(engines, int4_server):
    """Prompts sharing a 3-block prefix (blocks of 16), sent one after another: the server (prefix cache on by
    default) answers token for token what the offline runtime answers without the cache, and its metrics
    count the reused tokens and the cached blocks."""
    from trtkv.runtime.llm_engine import LLMEngine, RuntimeConfig
    from trtkv.runtime.sequence import SamplingParams

    shared = "You are a terse assistant. Answer in one line, never apologize, and cite nothing at all. " * 2
    prompts = [shared + q for q in ("Why is the sky blue?", "What is 2+2?", "Name a prime.")]
    llm = LLMEngine.from_engine_dir(engines["int4"], RuntimeConfig(kv_memory_gib=0.01, max_seqs=16, enable_prefix_caching=False))
    assert len(llm.tokenizer.encode(shared)) >= 48
    want = [llm.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].text for p in prompts]
    got = [generate(int4_server.http_url, p, 12, min_length=12, exclude_input_in_output=True)["text_output"] for p in prompts]
    assert got == want
    assert int4_server.wait_for_metric("trtkv_prefix_cache_hit_tokens_total", 2 * 48) >= 2 * 48
    text = urllib.request.urlopen(int4_server.metrics_url, timeout=10).read().decode()
    for family in ("trtkv_prefix_cache_hit_rate", "trtkv_prefix_cache_evicted_blocks_total"):
        assert f"{family}{{" in text, family
    cached = [ln for ln in text.splitlines() if ln.startswith("trtkv_kv_blocks{") and 'state="cached"' in ln]
    assert float(cached[0].split()[-1]) >= 3


def test_small_pool_queues_and_preempts_and_rejects_oversized(engines, tmp_path):
    # 60 KiB of KV: 4 slots (8 KiB each) and 6 int8 blocks of 16 tokens (4.25 KiB), while 12 requests want ~3 each
    server = start(engines["int8"], tmp_path, kv_memory_gib=60 / 1024**2, max_seqs=4)
    try:
        url = server.http_url
        code, data = post(url, "/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 250})
        assert code == 400 and "whole pool has" in data["error"]
        done: dict[int, str] = {}
        errors: list[str] = []

        def run(i):
            try:
                done[i] = generate(url, PROMPTS[i % 5], 36, min_length=36, exclude_input_in_output=True)["text_output"]
            except GenerateError as exc:
                errors.append(str(exc))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not errors and len(done) == 12 and all(done.values())
        # the model pushes its counters once the engine drains; wait for that push, then read them
        assert server.wait_for_metric("trtkv_requests_total", 12, state="finished") >= 12
        assert server.metric_values("trtkv_requests_total", state="rejected") == [1.0]
        peak = max(server.metric_values("trtkv_peak_running_sequences"))
        preempt = max(server.metric_values("trtkv_preemptions_total"))
        assert 1 < peak <= 4 and preempt >= 1
    finally:
        server.stop()


def test_serve_cli_errors_are_one_line_exit_2(engines, tmp_path):
    import socket
    import subprocess
    import sys

    trtkv = [sys.executable, "-m", "trtkv.cli"]
    broken = tmp_path / "broken"
    broken.mkdir()
    r = subprocess.run([*trtkv, "serve", str(broken)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not an engine directory" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            [*trtkv, "serve", str(engines["int4"]), "--repo", str(tmp_path / "repo"), "--http-port", str(port)], capture_output=True, text=True, timeout=60
        )
    assert r.returncode == 2 and f"port {port}" in r.stderr and "in use" in r.stderr


@pytest.mark.model
def test_smollm2_int4_server_greedy_is_offline_token_for_token(builtin_model, tmp_path):
    """The real SmolLM2-135M, int4 engine (the format furthest from fp16): server == offline runtime."""
    from trtkv.builder.build import build_engine

    engine = build_engine("smollm2-135m", kv="int4", out=tmp_path / "engine-smollm2-int4", backend="onnxruntime", max_batch=8, max_seq_len=512, loaded=builtin_model)
    prompts = ["def fibonacci(n):", "The capital of France is"]
    want = offline(engine, prompts, 16, kv_memory_gib=0.05, max_seqs=4, ignore_eos=True)
    assert all(w.strip() for w in want)
    server = start(engine, tmp_path, kv_memory_gib=0.05, max_seqs=4)
    try:
        got = [generate(server.http_url, p, 16, min_length=16, exclude_input_in_output=True)["text_output"] for p in prompts]
    finally:
        server.stop()
    assert got == want


def test_serve_cli_starts_prints_endpoints_and_stops_on_sigterm(engines, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    ports = [str(free_port()) for _ in range(3)]
    cmd = [sys.executable, "-m", "trtkv.cli", "serve", str(engines["fp16"]), "--repo", str(tmp_path / "repo"), "--kv-memory", "0.01",
           "--max-seqs", "4", "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C" in line:
                break
        out = "".join(lines)
        assert "ready" in out and f"http://127.0.0.1:{ports[0]}" in out and "curl" in out and "blocks" in out, out
        assert generate(f"http://127.0.0.1:{ports[0]}", "hello", 4)["text_output"].startswith("hello")
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "stopped" in rest
        assert not any(p.isdigit() and _listening(int(p)) for p in ports)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_two_instances_each_run_an_engine_with_half_the_budget(engines, tmp_path):
    """--instances 2: Triton routes requests to two python-model instances, each with its own engine and half the
    KV budget (its own pool, its own metric series); outputs are the offline runtime's."""
    want = offline(engines["int4"], PROMPTS, 12, kv_memory_gib=0.01, ignore_eos=True)
    server = start(engines["int4"], tmp_path, kv_memory_gib=0.02, max_seqs=8, instances=2)
    try:
        got: dict[int, str] = {}

        def run(i):
            got[i] = generate(server.http_url, PROMPTS[i % len(PROMPTS)], 12, min_length=12, exclude_input_in_output=True)["text_output"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2 * len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [got[i] for i in range(2 * len(PROMPTS))] == want * 2
        server.wait_for_metric("trtkv_requests_total", 1, state="finished")
        budgets = server.metric_values("trtkv_kv_pool_info", field="budget_bytes")
        assert len(budgets) == 2 and budgets[0] == budgets[1] == pytest.approx(0.01 * 1024**3, rel=1e-6)
    finally:
        server.stop()
