"""OpenAI-compatible endpoints (`trtkv serve --openai-port`) driven by the official `openai` client, against a real
tritonserver: one `trtkv serve` process per module, a tiny random Llama engine with a chat template."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pytriton")
openai = pytest.importorskip("openai")

from trtkv.triton_repo.client import generate  # noqa: E402
from trtkv.triton_repo.server import free_port  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.slow]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`trtkv serve ENGINE --openai-port P` as a user runs it; yields (openai client, triton url, tokenizer)."""
    from conftest import build_tiny_model, build_tiny_tokenizer

    from trtkv.builder.build import build_engine

    root = tmp_path_factory.mktemp("openai")
    build_tiny_model(root / "model", "llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    tok = build_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(root / "model"))
    engine = build_engine(str(root / "model"), kv="int4", out=root / "engine", backend="onnxruntime", block_size=16, max_batch=4, max_seq_len=128)
    ports = [free_port() for _ in range(4)]
    cmd = [sys.executable, "-m", "trtkv.cli", "serve", str(engine), "--repo", str(root / "repo"), "--kv-memory", "0.01", "--max-seqs", "4",
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
           "--openai-port", str(ports[3]), "--served-model-name", MODEL]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = []
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            out.append(line)
            if "Ctrl-C" in line:
                break
        assert any(f"http://127.0.0.1:{ports[3]}/v1" in ln for ln in out), "".join(out) + proc.stderr.read()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[3]}/v1", api_key="none", max_retries=0, timeout=60)
        yield client, f"http://127.0.0.1:{ports[0]}", tok
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_models_lists_the_served_model(served):
    client, _, _ = served
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_is_the_same_engine_output_with_usage(served):
    client, triton, tok = served
    prompt = "The quick brown fox"
    res = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    want = generate(triton, prompt, 12, exclude_input_in_output=True)["text_output"]  # Triton's own endpoint, same engine
    (choice,) = res.choices
    assert choice.text == want
    assert res.usage.prompt_tokens == len(tok.encode(prompt))
    assert res.usage.completion_tokens == 12 and res.usage.total_tokens == res.usage.prompt_tokens + 12
    assert choice.finish_reason == "length"


def test_streamed_completion_concatenates_to_the_plain_one(served):
    client, _, _ = served
    prompt = "def f(x):\n    return"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_uses_the_template_and_streams(served):
    client, triton, tok = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Pack my box"}]
    res = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0)
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|assistant|>")
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == generate(triton, prompt, 8, exclude_input_in_output=True)["text_output"]
    assert res.usage.prompt_tokens == len(tok.encode(prompt))
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == res.choices[0].message.content


def test_seed_reproduces_sampling_and_stop_cuts_it(served):
    client, triton, _ = served
    prompt = "Sphinx of black quartz, judge"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=7)
    full, again = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert full == again and len(set(full)) > 3  # sampled (the random model's greedy text is one repeated token)
    # a stop string that occurs once in the sampled text, not at its start
    stop = next(full[i : i + k] for k in (3, 2) for i in range(1, len(full) - k) if full.count(full[i : i + k]) == 1)
    res = client.completions.create(**kw, stop=[stop])
    want = generate(triton, prompt, 16, temperature=1.0, seed=7, stop_words=[stop], exclude_input_in_output=True)["text_output"]
    assert res.choices[0].text == want and res.choices[0].finish_reason == "stop"
    assert stop not in res.choices[0].text and full.startswith(res.choices[0].text) and len(res.choices[0].text) < len(full)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=[stop], stream=True) if c.choices)
    assert streamed == want  # streamed pieces never include the start of a stop word that completes later


@pytest.mark.parametrize(
    "kwargs, status, param",
    [
        ({"n": 2}, 400, "n"),
        ({"model": "gpt-4"}, 404, "model"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 1000}, 400, "max_tokens"),  # beyond the engine's 128-token context
        ({"temperature": -1}, 400, "temperature"),
    ],
)
def test_errors_have_openai_shape_and_status(served, kwargs, status, param):
    client, _, _ = served
    args = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(**args)
    assert exc.value.status_code == status
    err = exc.value.body if isinstance(exc.value.body, dict) else {}
    err = err.get("error", err)
    assert err.get("param") == param and err.get("message") and err.get("type")
    # the server keeps serving
    assert client.completions.create(model=MODEL, prompt="hello", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_a_request_the_model_refuses_after_the_fronts_checks_is_a_400(served):
    """An empty prompt passes the front's checks (0 prompt tokens fit the context); the trtkv model refuses it
    (INVALID_ARG): the client gets a 400 with the model's reason, not a 502, plain or streamed."""
    client, _, _ = served
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as exc:
            res = client.completions.create(model=MODEL, prompt="", max_tokens=4, stream=stream)
            list(res) if stream else None
        assert exc.value.status_code == 400 and "text_input is empty" in str(exc.value), stream


def test_min_tokens_and_ignore_eos_give_exactly_max_tokens(served):
    """vLLM's extensions that benchmark clients send (`--extra-inputs ignore_eos:true`): the stop word that cuts the
    sampled text is suppressed until min_tokens; ignore_eos means min_tokens = max_tokens."""
    client, _, _ = served
    kw = dict(model=MODEL, prompt="Sphinx of black quartz, judge", max_tokens=16, temperature=1.0, seed=7)
    full = client.completions.create(**kw).choices[0].text
    # a stop string that occurs once, in the first half of the sampled text
    stop = next(full[i : i + k] for k in (3, 2) for i in range(1, len(full) // 2) if full.count(full[i : i + k]) == 1)
    cut = client.completions.create(**kw, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < 16
    held = client.completions.create(**kw, stop=[stop], extra_body={"min_tokens": 16})
    assert held.choices[0].finish_reason == "length" and held.usage.completion_tokens == 16 and stop in held.choices[0].text
    res = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert res.choices[0].finish_reason == "length" and res.usage.completion_tokens == 16
    for extra, param in (({"min_tokens": 17}, "min_tokens"), ({"ignore_eos": True}, "ignore_eos")):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(**kw, stop=[stop] if "ignore_eos" in extra else None, extra_body=extra)
        assert exc.value.body.get("param", exc.value.body.get("error", {}).get("param")) == param


def test_aiperf_openai_chat_mode_gets_every_token_it_asked_for(served, tmp_path):
    """A benchmark client's OpenAI mode: NVIDIA's aiperf (genai-perf's successor; `make aiperf`) in chat streaming mode,
    8 requests at concurrency 2, exactly 32 prompt and 16 new tokens each, judged from aiperf's own export files."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from openai_client import aiperf_command, find_aiperf, read_aiperf, run_aiperf

    aiperf = find_aiperf()
    if aiperf is None:
        pytest.skip("aiperf is not installed: `make aiperf` creates ~/.cache/trtkv/aiperf-venv (its pins conflict with trtkv's), or set TRTKV_AIPERF")
    client, _, tok = served
    tok.save_pretrained(str(tmp_path / "tokenizer"))
    url = str(client.base_url).rstrip("/").removesuffix("/v1")
    cmd = aiperf_command(aiperf, url, MODEL, tmp_path / "tokenizer", tmp_path / "aiperf", endpoint="chat", requests=8, concurrency=2, isl=32, osl=16)
    proc = run_aiperf(cmd, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = read_aiperf(tmp_path / "aiperf")
    s = res["summary"]
    assert s["request_count"]["avg"] == 8 and s["request_error_rate"]["avg"] == 0 and not s.get("error_summary")
    assert s["output_sequence_length"]["min"] == s["output_sequence_length"]["max"] == 16 and s["osl_mismatch_count"]["avg"] == 0
    assert s["time_to_first_token"]["count"] == 8 and s["inter_token_latency"]["count"] == 8 and s["request_throughput"]["avg"] > 0
    assert len(res["records"]) == 8
    for rec in res["records"]:
        sent = res["inputs"][rec["metadata"]["conversation_id"]]
        (message,) = sent["messages"]
        assert sent["max_completion_tokens"] == 16 and sent["stream"] is True
        assert len(tok.encode(message["content"], add_special_tokens=False)) == 32  # what aiperf was asked to send
        prompt = tok.apply_chat_template(sent["messages"], tokenize=False, add_generation_prompt=True)
        m = rec["metrics"]
        assert m["input_sequence_length"]["value"] == len(tok.encode(prompt))  # the server's usage: the templated prompt
        assert m["output_sequence_length"]["value"] == m["usage_completion_tokens"]["value"] == 16
        assert len(m["inter_chunk_latency"]["value"]) >= 1  # streamed in more than one chunk
