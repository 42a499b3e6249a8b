"""The OpenAI front (triton_repo/openai_api.py) against a stand-in Triton: what reaches the engine's server, and how
its refusals come back. Fast tier: no tritonserver; tests/test_openai.py drives the same front on the real one.

The stand-in answers ``/v2/models/<model>/generate`` (and ``generate_stream``) like the trtkv model: a fixed text of
3 tokens, or, for the prompt ``REFUSED``, what Triton gives a request the model refuses (INVALID_ARG: HTTP 400, or an
error event when streaming), or for ``BROKEN`` a 500.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest

pytest.importorskip("uvicorn")
aiohttp_web = pytest.importorskip("aiohttp.web")

from trtkv.triton_repo.openai_api import Served, start_openai_server  # noqa: E402
from trtkv.triton_repo.repository import LLM_MODEL  # noqa: E402
from trtkv.triton_repo.server import free_port  # noqa: E402

MODEL = "tiny"


class FakeTriton:
    """An aiohttp server in its own thread and loop; ``bodies`` holds every generate request's JSON body."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(30)

    async def _generate(self, request):
        body = await request.json()
        self.bodies.append(body)
        if body["text_input"] == "REFUSED":
            return aiohttp_web.json_response({"error": "text_input is refused by the model"}, status=400)
        if body["text_input"] == "BROKEN":
            return aiohttp_web.json_response({"error": "internal error: boom"}, status=500)
        return aiohttp_web.json_response({"text_output": "abc", "output_log_probs": [-0.1, -0.2, -0.3]})

    async def _generate_stream(self, request):
        body = await request.json()
        self.bodies.append(body)
        if body["text_input"] == "BROKEN":
            return aiohttp_web.json_response({"error": "internal error: boom"}, status=500)
        # a refused streaming request: Triton's generate_stream sends the model's error as an event
        events = ([{"error": "text_input is refused by the model"}] if body["text_input"] == "REFUSED" else
                  [{"text_output": "ab", "output_log_probs": [-0.1, -0.2]}, {"text_output": "c", "output_log_probs": [-0.3]}])
        resp = aiohttp_web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for e in events:
            await resp.write(f"data: {json.dumps(e)}\n\n".encode())
        await resp.write_eof()
        return resp

    def _run(self):
        asyncio.set_event_loop(self.loop)
        app = aiohttp_web.Application()
        app.router.add_post(f"/v2/models/{LLM_MODEL}/generate", self._generate)
        app.router.add_post(f"/v2/models/{LLM_MODEL}/generate_stream", self._generate_stream)
        app.router.add_get("/v2/health/ready", lambda request: aiohttp_web.Response(status=200))
        self.runner = aiohttp_web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(aiohttp_web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def front(tokenizer):
    triton = FakeTriton()
    port = free_port()
    server = start_openai_server(Served(MODEL, tokenizer, 128, f"http://127.0.0.1:{triton.port}"), "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}/v1", triton
    finally:
        server.should_exit = True
        triton.stop()


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def complete(front, **kw) -> tuple[int, dict, dict | None]:
    """POST /v1/completions; returns (status, response, the body the stand-in Triton got or None)."""
    url, triton = front
    before = len(triton.bodies)
    code, data = post(f"{url}/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 8, **kw})
    return code, data, triton.bodies[-1] if len(triton.bodies) > before else None


@pytest.mark.parametrize("n", [1, 2, 4])
def test_up_to_four_stop_strings_reach_the_engine(front, n):
    stops = [f"s{i}" for i in range(n)]
    code, data, body = complete(front, stop=stops)
    assert code == 200 and data["choices"][0]["text"] == "abc"
    assert body["stop_words"] == stops


def test_a_fifth_stop_string_is_refused_before_the_engine(front):
    code, data, body = complete(front, stop=[f"s{i}" for i in range(5)])
    assert code == 400 and data["error"]["param"] == "stop" and "at most 4" in data["error"]["message"]
    assert body is None  # refused by the front: nothing reached Triton


def test_ignore_eos_reaches_the_engine_as_min_tokens_equal_to_max_tokens(front):
    _, _, body = complete(front, max_tokens=11, ignore_eos=True)
    assert body["min_tokens"] == 11 == body["max_tokens"]
    _, _, body = complete(front, max_tokens=11, min_tokens=3)
    assert body["min_tokens"] == 3
    _, _, body = complete(front, max_tokens=11)
    assert body.get("min_tokens", 0) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_model_refuses_is_a_400_and_a_server_fault_a_502(front, stream):
    """The front's checks pass; Triton answers 400 (the model refused it: INVALID_ARG) -> an invalid_request_error 400
    with the model's message; a 500 (a fault) -> 502."""
    code, data, body = complete(front, prompt="REFUSED", stream=stream)
    assert body is not None and body["text_input"] == "REFUSED"
    assert code == 400 and data["error"]["type"] == "invalid_request_error"
    assert "refused by the model" in data["error"]["message"]
    code, data, _ = complete(front, prompt="BROKEN", stream=stream)
    assert code == 502 and data["error"]["type"] == "server_error"


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("top_p", 0.0), ("n", 0)])
def test_out_of_range_fields_are_refused_by_the_front(front, field, value):
    """OpenAI's ranges are max_tokens >= 1, 0 < top_p <= 1,
    n == 1 here: each is a 400 naming the field, and nothing reaches Triton."""
    code, data, body = complete(front, **{field: value})
    assert code == 400 and data["error"]["param"] == field and body is None


def test_logprobs_false_and_min_tokens_equal_to_max_tokens_are_accepted(front):
    """Logprobs false (what OpenAI's
    clients send) asks for nothing; min_tokens == max_tokens is the most it may be (ignore_eos sends just that)."""
    code, data, _ = complete(front, logprobs=False)
    assert code == 200 and data["choices"][0]["text"] == "abc"
    code, _, body = complete(front, max_tokens=8, min_tokens=8)
    assert code == 200 and body["min_tokens"] == 8 == body["max_tokens"]
    code, data, _ = complete(front, max_tokens=8, min_tokens=9)
    assert code == 400 and data["error"]["param"] == "min_tokens"


def test_the_engine_is_asked_for_the_new_text_only(front):
    """An OpenAI completion is the new text; Triton's generate returns prompt + new
    text unless exclude_input_in_output is set (interface.py), so the front must set it, streaming or not."""
    _, _, body = complete(front)
    assert body["exclude_input_in_output"] is True
    _, triton = front
    _stream_lines(front, {"prompt": "hello", "max_tokens": 8})
    assert triton.bodies[-1]["stream"] is True and triton.bodies[-1]["exclude_input_in_output"] is True


def _stream_lines(fr, body: dict) -> list[str]:
    """POST a streaming /v1/completions; the server-sent lines."""
    import json
    import urllib.request

    url, _ = fr
    req = urllib.request.Request(f"{url}/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": MODEL, "stream": True, **body}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        return [ln.decode().strip() for ln in r if ln.strip()]


def test_finish_reason_is_length_when_exactly_max_tokens_came(front):
    """The stand-in returns 3 tokens; with max_tokens 3 the completion ran to
    its limit ("length"), with 8 it stopped early ("stop"); usage counts the 3."""
    code, data, _ = complete(front, max_tokens=3)
    assert code == 200 and data["choices"][0]["finish_reason"] == "length" and data["usage"]["completion_tokens"] == 3
    code, data, _ = complete(front, max_tokens=8)
    assert code == 200 and data["choices"][0]["finish_reason"] == "stop"


def test_prompt_plus_max_tokens_equal_to_the_context_fits(front, tokenizer):
    """The stand-in serves a 128-token context; a prompt of n tokens may ask for
    128 - n new tokens, not one more."""
    n = len(tokenizer("hello")["input_ids"])
    code, _, body = complete(front, max_tokens=128 - n)
    assert code == 200 and body["max_tokens"] == 128 - n
    code, data, body = complete(front, max_tokens=129 - n)
    assert code == 400 and data["error"]["code"] == "context_length_exceeded" and body is None


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_front():
    """The front over the stand-in Triton with a tokenizer that has a chat template (it prints each role)."""
    from conftest import build_tiny_tokenizer
    tok = build_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    triton = FakeTriton()
    port = free_port()
    server = start_openai_server(Served(MODEL, tok, 128, f"http://127.0.0.1:{triton.port}"), "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}/v1", triton
    finally:
        server.should_exit = True
        triton.stop()


def _chat(chat_front, **kw):
    url, triton = chat_front
    before = len(triton.bodies)
    code, data = post(f"{url}/chat/completions", {"model": MODEL, **kw})
    return code, data, triton.bodies[-1] if len(triton.bodies) > before else None


def test_the_developer_role_is_rendered_as_system(chat_front):
    """OpenAI's "developer" messages are the system prompt for a chat template."""
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    code, data, body = _chat(chat_front, messages=msgs, max_tokens=4)
    assert code == 200 and data["choices"][0]["message"]["content"] == "abc"
    assert body["text_input"] == "<|system|>Be brief.\n<|user|>hi\n<|assistant|>"


def test_max_completion_tokens_wins_over_max_tokens(chat_front):
    """Max_completion_tokens is the chat endpoint's current name and takes precedence over
    the deprecated max_tokens when both are sent."""
    msgs = [{"role": "user", "content": "hi"}]
    _, _, body = _chat(chat_front, messages=msgs, max_completion_tokens=5, max_tokens=9)
    assert body["max_tokens"] == 5
    _, _, body = _chat(chat_front, messages=msgs, max_tokens=9)
    assert body["max_tokens"] == 9


def test_an_empty_prompt_list_is_a_400_naming_the_prompt(front):
    """A list prompt must hold exactly one prompt; [] is a bad request, not a server fault."""
    for prompts in ([], ["a", "b"]):
        code, data, body = complete(front, prompt=prompts)
        assert code == 400 and data["error"]["param"] == "prompt" and body is None


def test_a_field_out_of_its_range_is_400_and_an_unknown_model_404(front):
    """OpenAI answers a field out of range with
    400 naming it and an unknown model with 404 model_not_found."""
    code, data, body = complete(front, temperature=-1)
    assert code == 400 and data["error"]["param"] == "temperature" and body is None
    code, data, body = complete(front, model="gpt-4")
    assert code == 404 and data["error"]["code"] == "model_not_found" and data["error"]["param"] == "model" and body is None


def test_streamed_chunks_carry_usage_null_until_the_usage_chunk(front):
    """With stream_options.include_usage every chunk has "usage": null and one last chunk,
    with no choices, carries the counts (OpenAI's stream format); the stand-in streams 2 + 1 tokens."""
    import json

    lines = _stream_lines(front, {"prompt": "hello", "max_tokens": 8, "stream_options": {"include_usage": True}})
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[5:]) for ln in lines[:-1]]
    *chunks, last = events
    assert chunks and all("usage" in c and c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc" and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3


def test_temperature_above_two_is_refused(front):
    """OpenAI's temperature is in [0, 2]; 2 is accepted, 2.5 is a 400 naming it."""
    code, _, body = complete(front, temperature=2.0)
    assert code == 200 and body["temperature"] == 2.0
    code, data, body = complete(front, temperature=2.5)
    assert code == 400 and data["error"]["param"] == "temperature" and body is None


def test_top_p_reaches_the_engine(front):
    """The request's top_p is what Triton gets."""
    _, _, body = complete(front, top_p=0.25)
    assert body["top_p"] == 0.25


def test_a_non_text_content_part_is_a_400(chat_front):
    """Only text content parts are supported; an image part is a 400 naming
    messages, and text parts are joined."""
    parts = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    code, data, body = _chat(chat_front, messages=[{"role": "user", "content": parts}], max_tokens=4)
    assert code == 400 and data["error"]["param"] == "messages" and body is None
    code, _, body = _chat(chat_front, messages=[{"role": "user", "content": parts[:1] * 2}], max_tokens=4)
    assert code == 200 and body["text_input"] == "<|user|>hihi\n<|assistant|>"


def test_echo_is_refused(front):
    """The front does not echo the prompt; echo=true is a 400 naming it, not a reply without it."""
    code, data, body = complete(front, echo=True)
    assert code == 400 and data["error"]["param"] == "echo" and body is None
    code, _, _ = complete(front, echo=False)
    assert code == 200
