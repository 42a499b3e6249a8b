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
