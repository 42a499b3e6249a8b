"""The OpenAI front's contract (triton_repo/openai_api.py), field by field: for every request field of
``/v1/completions`` and ``/v1/chat/completions``, exactly what reaches Triton (the generate_stream request body: plain
requests are streamed from Triton too) for its default, its edges (the exact bound and one past it) and bad values
(the status, the error type and the ``param`` that names the field; the fields OpenAI defines that trtkv does not
implement are refused unless neutral), and the exact shape of every response (ids, objects, choices, finish_reason,
usage, server-sent chunks, error events, ``[DONE]``) and of every error (bad JSON, a body over the limit, unknown
paths, wrong methods).

No tritonserver: the front runs under uvicorn (``start_openai_server``) in front of ``ScriptedTriton``, an aiohttp
stand-in for Triton's ``/v2/models/ensemble/generate`` and ``generate_stream`` whose answer each test sets. The
served tokenizer is ``CharTokenizer``, one id per character (plus BOS when it adds one), so every usage count is
the prompt's length: the expectations come from OpenAI's API rules and the inputs, never from the front's output.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest

pytest.importorskip("uvicorn")
aiohttp_web = pytest.importorskip("aiohttp.web")

from test_openai_front import FakeTriton  # noqa: E402

from trtkv.triton_repo import openai_api as api  # noqa: E402
from trtkv.triton_repo.openai_api import OpenAIError, Served, start_openai_server  # noqa: E402
from trtkv.triton_repo.server import free_port  # noqa: E402

MODEL = "served-model"
CONTEXT = 64
DEFAULT_BODY = {  # what Triton gets for {"model", "prompt": "hello", "max_tokens": 8} and nothing else
    "text_input": "hello", "max_tokens": 8, "stream": True, "return_log_probs": True, "exclude_input_in_output": True,
    "temperature": 1.0, "top_p": 1.0,
}


class CharTokenizer:
    """One id per character (its code point), BOS (id 1) in front when ``adds_bos``; a chat template that writes
    ``[role]content`` per message, ``[assistant]`` for the generation prompt, and BOS first when ``template_bos``."""

    bos_token = "<s>"
    bos_token_id = 1

    def __init__(self, adds_bos: bool = False, chat: bool = True, template_bos: bool = False):
        self.adds_bos = adds_bos
        self.chat_template = "[role]content" if chat else None
        self.template_bos = template_bos
        self.template_calls: list[tuple[list, dict]] = []

    def __call__(self, text: str, add_special_tokens: bool = True):
        ids = [ord(c) for c in text]
        return {"input_ids": ([self.bos_token_id] if self.adds_bos and add_special_tokens else []) + ids}

    def apply_chat_template(self, messages, **kw):
        self.template_calls.append(([dict(m) for m in messages], kw))
        text = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        if kw.get("add_generation_prompt"):
            text += "[assistant]"
        return (self.bos_token if self.template_bos else "") + text


@dataclass
class Reply:
    """What the stand-in Triton answers: a status and a JSON (or raw text) body for ``generate``; for
    ``generate_stream`` (status 200) the events, each sent as one ``data:`` line."""

    status: int = 200
    json: dict | None = field(default_factory=lambda: {"text_output": "abc", "output_log_probs": [-0.1, -0.2, -0.3]})
    text: str | None = None  # a non-JSON body instead of ``json``
    events: list[dict] = field(default_factory=lambda: [{"text_output": "ab", "output_log_probs": [-0.1, -0.2]},
                                                        {"text_output": "c", "output_log_probs": [-0.3]}])
    prefix: str = "data: "  # server-sent events may omit the space after "data:"
    extra_lines: list[str] = field(default_factory=list)  # other lines of the stream (comments, event names)


class ScriptedTriton(FakeTriton):
    """test_openai_front's stand-in server with a scripted answer: ``calls`` holds (endpoint, body) of every request;
    ``reply`` is the answer."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.reply = Reply()
        super().__init__()

    def _answer(self):
        r = self.reply
        if r.text is not None:
            return aiohttp_web.Response(text=r.text, status=r.status)
        return aiohttp_web.json_response(r.json, status=r.status)

    async def _generate(self, request):
        self.calls.append(("generate", await request.json()))
        return self._answer()

    async def _generate_stream(self, request):
        self.calls.append(("generate_stream", await request.json()))
        if self.reply.status != 200:
            return self._answer()
        resp = aiohttp_web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for line in self.reply.extra_lines:
            await resp.write(f"{line}\n".encode())
        for e in self.reply.events:
            await resp.write(f"{self.reply.prefix}{json.dumps(e)}\n\n".encode())
        await resp.write_eof()
        return resp



@dataclass
class Front:
    url: str
    triton: ScriptedTriton
    served: Served

    def post(self, path: str, body: dict) -> tuple[int, dict | list[str], tuple[str, dict] | None]:
        """POST; (status, JSON response or the server-sent lines of an event stream, the call Triton got or None)."""
        before = len(self.triton.calls)
        req = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                status, ctype, raw = r.status, r.headers.get("Content-Type", ""), r.read()
        except urllib.error.HTTPError as e:
            status, ctype, raw = e.code, e.headers.get("Content-Type", ""), e.read()
        got = [ln.strip() for ln in raw.decode().split("\n") if ln.strip()] if ctype.startswith("text/event-stream") else json.loads(raw)
        return status, got, self.triton.calls[-1] if len(self.triton.calls) > before else None

    def complete(self, **kw):
        return self.post("/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 8, **kw})

    def chat(self, **kw):
        return self.post("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **kw})


@pytest.fixture(scope="module")
def front_server():
    triton = ScriptedTriton()
    served = Served(MODEL, CharTokenizer(), CONTEXT, f"http://127.0.0.1:{triton.port}")
    port = free_port()
    server = start_openai_server(served, "127.0.0.1", port)
    try:
        yield Front(f"http://127.0.0.1:{port}/v1", triton, served)
    finally:
        server.should_exit = True
        triton.stop()


@pytest.fixture
def front(front_server, monkeypatch):
    """The module's front with the default reply and a fresh tokenizer; changes to ``served`` are undone after the test."""
    front_server.triton.reply = Reply()
    monkeypatch.setattr(front_server.served, "tokenizer", CharTokenizer())
    monkeypatch.setattr(front_server.served, "max_seq_len", CONTEXT)
    monkeypatch.setattr(front_server.served, "triton_url", front_server.served.triton_url)
    return front_server


def assert_refused(code, data, call, status: int, param: str | None, *, words: str = "", kind: str = "invalid_request_error"):
    """An OpenAI error: the status, {"error": {message, type, param, code}} naming ``param``, and nothing sent to Triton."""
    assert code == status, data
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}, data
    got = data["error"]["param"]
    # "field.*": a union-typed field, whose pydantic location also names the member tried (prompt.str)
    assert (got or "").startswith(param[:-1]) if param and param.endswith(".*") else got == param, data
    assert data["error"]["type"] == kind, data
    assert words.lower() in data["error"]["message"].lower(), data
    assert call is None, call


# ---------------------------------------------------------------- request body: defaults and every field


def test_a_minimal_completion_sends_exactly_the_default_body(front):
    code, data, call = front.complete()
    assert code == 200, data
    assert call == ("generate_stream", DEFAULT_BODY)


@pytest.mark.parametrize("field, value, sent", [
    ("temperature", 0, {"temperature": 0.0}),
    ("temperature", 0.7, {"temperature": 0.7}),
    ("temperature", 2, {"temperature": 2.0}),
    ("top_p", 1, {"top_p": 1.0}),
    ("top_p", 0.01, {"top_p": 0.01}),
    ("top_p", 0.5, {"top_p": 0.5}),
    ("max_tokens", 1, {"max_tokens": 1}),
    ("max_tokens", 20, {"max_tokens": 20}),
    ("n", 1, {}),
    ("seed", 0, {"seed": 0}),
    ("seed", 12345, {"seed": 12345}),
    ("stop", "END", {"stop_words": ["END"]}),
    ("stop", ["a", "b"], {"stop_words": ["a", "b"]}),
    ("stop", ["b", "a", "d", "c"], {"stop_words": ["b", "a", "d", "c"]}),
    ("stop", "", {}),
    ("stop", [], {}),
    ("stop", None, {}),
    ("stop", ["", "x", ""], {"stop_words": ["x"]}),
    ("min_tokens", 0, {}),
    ("min_tokens", 1, {"min_tokens": 1}),
    ("min_tokens", 8, {"min_tokens": 8}),
    ("ignore_eos", True, {"min_tokens": 8}),
    ("ignore_eos", False, {}),
    ("logprobs", None, {}),
    ("logprobs", False, {}),
    ("echo", False, {}),
    ("seed", 2**64 - 1, {"seed": 2**64 - 1}),  # the model's seed input is UINT64
    ("top_k", 0, {}),  # vLLM's extension: 0 and -1 are off
    ("top_k", -1, {}),
    ("top_k", 1, {"top_k": 1}),
    ("top_k", 40, {"top_k": 40}),
    ("presence_penalty", 0, {}),  # fields trtkv does not implement: accepted at their neutral value only
    ("presence_penalty", None, {}),
    ("frequency_penalty", None, {}),
    ("repetition_penalty", 1.0, {}),
    ("logit_bias", {}, {}),
    ("logit_bias", None, {}),
    ("response_format", {"type": "text"}, {}),
    ("best_of", 1, {}),
    ("suffix", "", {}),
    ("stream_options", {"include_usage": True}, {}),  # a plain request: the option has nothing to change
    ("user", "someone", {}),  # unknown fields are accepted and not forwarded
    ("frequency_penalty", 0.0, {}),
    ("suffix", None, {}),
    ("prompt", ["one prompt"], {"text_input": "one prompt"}),
    ("prompt", "x", {"text_input": "x"}),
])
def test_each_field_reaches_triton_as_its_engine_input(front, field, value, sent):
    code, data, call = front.complete(**{field: value})
    assert code == 200, data
    assert call == ("generate_stream", {**DEFAULT_BODY, **sent})


def test_ignore_eos_sends_max_tokens_as_min_tokens_whatever_min_tokens_says(front):
    _, _, (_, body) = front.complete(max_tokens=5, min_tokens=2, ignore_eos=True)
    assert body["min_tokens"] == 5 == body["max_tokens"]
    _, _, (_, body) = front.complete(max_tokens=5, min_tokens=2, ignore_eos=False)
    assert body["min_tokens"] == 2
    code, _, (_, body) = front.complete(max_tokens=5, ignore_eos=True, stop="")  # an empty stop is no stop
    assert code == 200 and body["min_tokens"] == 5 and "stop_words" not in body


def test_combined_fields_all_reach_triton(front):
    code, _, call = front.complete(prompt="abc", max_tokens=12, temperature=0.3, top_p=0.9, seed=7, stop=["x", "y"], min_tokens=4)
    assert code == 200
    assert call == ("generate_stream", {"text_input": "abc", "max_tokens": 12, "stream": True, "return_log_probs": True,
                                 "exclude_input_in_output": True, "temperature": 0.3, "top_p": 0.9, "stop_words": ["x", "y"],
                                 "seed": 7, "min_tokens": 4})


def test_plain_and_streaming_requests_both_ask_generate_stream(front):
    """A plain request is streamed from Triton too: its closed connection is what tells the model that the client left
    (Triton 2.51's plain generate does not read its connection until the one response)."""
    code, lines, call = front.complete(stream=True)
    assert code == 200 and lines[-1] == "data: [DONE]"
    assert call == ("generate_stream", DEFAULT_BODY)
    code, data, call = front.complete(stream=False)
    assert code == 200 and data["choices"][0]["text"] == "abc"
    assert call == ("generate_stream", DEFAULT_BODY)


# ---------------------------------------------------------------- refusals: status, type, param, nothing sent


@pytest.mark.parametrize("field, value, param, words", [
    ("temperature", -0.01, "temperature", "temperature"),
    ("temperature", 2.01, "temperature", "temperature"),
    ("temperature", "hot", "temperature", "temperature"),
    ("top_p", 0, "top_p", "top_p"),
    ("top_p", -0.5, "top_p", "top_p"),
    ("top_p", 1.01, "top_p", "top_p"),
    ("max_tokens", 0, "max_tokens", "max_tokens"),
    ("max_tokens", -3, "max_tokens", "max_tokens"),
    ("max_tokens", None, "max_tokens", "max_tokens is required"),
    ("n", 0, "n", "n=0"),
    ("n", 2, "n", "n=2"),
    ("seed", -1, "seed", "seed"),
    ("min_tokens", -1, "min_tokens", "min_tokens"),
    ("min_tokens", 9, "min_tokens", "min_tokens (9) is more than max_tokens (8)"),
    ("stop", ["a", "b", "c", "d", "e"], "stop", "at most 4 sequences, got 5"),
    ("stop", ["", "", "", "", ""], "stop", "got 5"),
    ("logprobs", True, "logprobs", "logprobs"),
    ("logprobs", 1, "logprobs", "logprobs"),
    ("logprobs", 5, "logprobs", "logprobs"),
    ("echo", True, "echo", "echo"),
    ("prompt", [], "prompt", "a list of 0 prompts"),
    ("prompt", ["a", "b"], "prompt", "a list of 2 prompts"),
    ("prompt", 5, "prompt.*", "prompt"),
    ("stream", "maybe", "stream", "stream"),
    ("stream", "true", "stream", "stream"),
    ("seed", 2**64, "seed", "seed"),
    ("seed", 10**30, "seed", "seed"),
    ("temperature", float("nan"), "temperature", "temperature"),
    ("top_p", float("inf"), "top_p", "top_p"),
    ("logprobs", 0, "logprobs", "logprobs=0"),
    ("presence_penalty", 0.5, "presence_penalty", "presence_penalty=0.5"),
    ("presence_penalty", 2.5, "presence_penalty", "presence_penalty"),
    ("frequency_penalty", -1, "frequency_penalty", "frequency_penalty=-1"),
    ("repetition_penalty", 1.2, "repetition_penalty", "repetition_penalty=1.2"),
    ("logit_bias", {"50256": -100}, "logit_bias", "logit_bias"),
    ("logit_bias", {"1": "x"}, "logit_bias.1", "logit_bias"),
    ("response_format", {"type": "json_object"}, "response_format", "structured output"),
    ("best_of", 2, "best_of", "best_of=2"),
    ("best_of", 0, "best_of", "best_of"),
    ("suffix", "after", "suffix", "suffix"),
    ("top_k", -2, "top_k", "top_k"),
    ("ignore_eos", "yes", "ignore_eos", "ignore_eos"),
    ("stream_options", {"include_usage": "maybe"}, "stream_options.include_usage", "include_usage"),
    ("stream_options", {"include_usage": 1}, "stream_options.include_usage", "include_usage"),
    ("stream_options", {"usage": True}, "stream_options.usage", "usage"),
    ("stream_options", {"continuous_usage_stats": True}, "stream_options.continuous_usage_stats", "continuous_usage_stats"),
    ("prompt", "bad \ud800 text", "prompt", "not valid Unicode"),
    ("stop", ["ok", "\udfff"], "stop", "not valid Unicode"),
])
def test_each_bad_value_is_a_400_naming_its_field(front, field, value, param, words):
    code, data, call = front.complete(**{field: value})
    assert_refused(code, data, call, 400, param, words=words)


def test_a_validation_error_message_starts_with_the_field(front):
    """FastAPI's validation errors become OpenAI's 400 (not 422) whose message is "<field>: <pydantic message>"."""
    code, data, _ = front.complete(top_p=0)
    assert code == 400 and data["error"]["message"].startswith("top_p: ") and data["error"]["code"] is None
    code, data, _ = front.post("/completions", {"model": MODEL, "max_tokens": 3})
    assert code == 400 and data["error"]["param"] == "prompt" and data["error"]["message"].startswith("prompt: ")


def test_a_missing_model_is_a_400_naming_it_and_an_unknown_one_a_404(front):
    code, data, call = front.post("/completions", {"prompt": "x", "max_tokens": 3})
    assert_refused(code, data, call, 400, "model", words="model")
    code, data, call = front.complete(model="gpt-4o")
    assert_refused(code, data, call, 404, "model", words="gpt-4o")
    assert data["error"]["code"] == "model_not_found" and MODEL in data["error"]["message"]
    code, data, call = front.complete(model="gpt-4o", n=2)  # the model is checked first
    assert code == 404


@pytest.mark.parametrize("name", ["SERVED-MODEL", "served-model ", "default", "", "served"])
def test_only_the_served_models_exact_name_is_served(front, name):
    code, data, call = front.complete(model=name)
    assert_refused(code, data, call, 404, "model")


def test_ignore_eos_with_a_stop_string_is_refused(front):
    for stop in ("END", ["", "x"]):
        code, data, call = front.complete(ignore_eos=True, stop=stop)
        assert_refused(code, data, call, 400, "ignore_eos", words="ignore_eos")


@pytest.mark.parametrize("n_stops", [0, 1, 3, 4])
def test_up_to_four_stops_are_sent_in_order(front, n_stops):
    stops = [f"s{i}" for i in range(n_stops)]
    code, _, (_, body) = front.complete(stop=stops)
    assert code == 200 and body.get("stop_words", []) == stops


# ---------------------------------------------------------------- the context limit


@pytest.mark.parametrize("adds_bos", [False, True])
def test_prompt_plus_max_tokens_may_fill_the_context_exactly(front, monkeypatch, adds_bos):
    """Prompt tokens are counted as the runtime encodes the prompt (BOS included when the tokenizer adds it)."""
    monkeypatch.setattr(front.served, "tokenizer", CharTokenizer(adds_bos=adds_bos))
    n = len("hello") + adds_bos
    code, data, call = front.complete(max_tokens=CONTEXT - n)
    assert code == 200 and call[1]["max_tokens"] == CONTEXT - n
    assert data["usage"]["prompt_tokens"] == n
    code, data, call = front.complete(max_tokens=CONTEXT - n + 1)
    assert_refused(code, data, call, 400, "max_tokens", words=f"prompt ({n} tokens) + max_tokens ({CONTEXT - n + 1})")
    assert data["error"]["code"] == "context_length_exceeded" and str(CONTEXT) in data["error"]["message"]


def test_the_context_check_uses_the_chat_max_completion_tokens(front):
    n = len("[user]hi[assistant]")
    code, _, call = front.chat(max_completion_tokens=CONTEXT - n, max_tokens=1)
    assert code == 200 and call[1]["max_tokens"] == CONTEXT - n
    code, data, call = front.chat(max_completion_tokens=CONTEXT - n + 1, max_tokens=1)
    assert_refused(code, data, call, 400, "max_tokens", words="context")


# ---------------------------------------------------------------- responses (plain)


def test_a_completion_response_has_openais_shape_and_counts(front):
    t0 = int(time.time())
    code, data, _ = front.complete(prompt="hello there", max_tokens=8)
    assert code == 200
    assert set(data) == {"id", "object", "created", "model", "choices", "usage"}
    assert data["id"].startswith("cmpl-") and len(data["id"]) > len("cmpl-") + 8
    assert data["object"] == "text_completion" and data["model"] == MODEL
    assert t0 - 1 <= data["created"] <= int(time.time()) + 1
    assert data["choices"] == [{"index": 0, "finish_reason": "stop", "logprobs": None, "text": "abc"}]
    assert data["usage"] == {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    _, again, _ = front.complete()
    assert again["id"] != data["id"]


@pytest.mark.parametrize("max_tokens, reason", [(2, "length"), (3, "length"), (4, "stop")])
def test_finish_reason_is_length_when_max_tokens_tokens_came(front, max_tokens, reason):
    """The stand-in returns 3 tokens: "length" at max_tokens 3 (and below: the count is what Triton reports), else "stop"."""
    code, data, _ = front.complete(max_tokens=max_tokens)
    assert code == 200 and data["choices"][0]["finish_reason"] == reason and data["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("logprobs, tokens", [([], 0), ([-1.0], 1), ([[-1.0, -2.0]], 2), ([[[-1.0], [-2.0, -3.0]]], 3)])
def test_completion_tokens_count_every_log_probability_however_nested(front, logprobs, tokens):
    """Triton's output_log_probs is [1, 1, n] (or flatter): completion tokens are its elements."""
    front.triton.reply = Reply(events=[{"text_output": "xy", "output_log_probs": logprobs}])
    code, data, _ = front.complete(prompt="p", max_tokens=8)
    assert code == 200 and data["usage"] == {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": 1 + tokens}
    assert data["choices"][0]["text"] == "xy"


def test_a_reply_without_text_or_log_probs_is_an_empty_completion(front):
    front.triton.reply = Reply(events=[{}])
    code, data, _ = front.complete(max_tokens=2)
    assert code == 200 and data["choices"][0]["text"] == "" and data["usage"]["completion_tokens"] == 0
    assert data["choices"][0]["finish_reason"] == "stop"


def test_a_chat_response_has_openais_shape(front):
    code, data, call = front.chat(max_tokens=3)
    assert code == 200
    assert set(data) == {"id", "object", "created", "model", "choices", "usage"}
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion" and data["model"] == MODEL
    assert data["choices"] == [{"index": 0, "finish_reason": "length", "logprobs": None, "message": {"role": "assistant", "content": "abc"}}]
    n = len("[user]hi[assistant]")
    assert data["usage"] == {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3}
    assert call == ("generate_stream", {**DEFAULT_BODY, "text_input": "[user]hi[assistant]", "max_tokens": 3})


def test_models_lists_the_served_model(front):
    with urllib.request.urlopen(f"{front.url}/models", timeout=30) as r:
        assert json.loads(r.read()) == {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "trtkv"}]}


# ---------------------------------------------------------------- chat requests


@pytest.mark.parametrize("role, rendered", [("system", "system"), ("user", "user"), ("assistant", "assistant"), ("developer", "system"),
                                            ("tool", "tool")])
def test_each_role_reaches_the_chat_template(front, role, rendered):
    code, _, call = front.chat(messages=[{"role": role, "content": "c1"}, {"role": "user", "content": "q"}])
    assert code == 200
    assert call[1]["text_input"] == f"[{rendered}]c1[user]q[assistant]"
    messages, kw = front.served.tokenizer.template_calls[-1]
    assert messages == [{"role": rendered, "content": "c1"}, {"role": "user", "content": "q"}]
    assert kw == {"tokenize": False, "add_generation_prompt": True}


@pytest.mark.parametrize("content, text", [
    (None, ""),
    ("", ""),
    ([], ""),
    ([{"type": "text", "text": "a"}], "a"),
    ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "ab"),
    ([{"type": "text"}, {"type": "text", "text": "b"}], "b"),
])
def test_message_content_becomes_text(front, content, text):
    code, _, call = front.chat(messages=[{"role": "user", "content": content}])
    assert code == 200 and call[1]["text_input"] == f"[user]{text}[assistant]"


@pytest.mark.parametrize("parts", [
    [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
    [{"type": "text", "text": "a"}, {"type": "input_audio", "input_audio": {}}],
    [{"text": "no type"}],
])
def test_a_non_text_content_part_is_refused(front, parts):
    code, data, call = front.chat(messages=[{"role": "user", "content": parts}])
    assert_refused(code, data, call, 400, "messages", words="text content")


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}, {"content": "no role"}]}, "messages.1.role"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"n": 3}, "n"),
    ({"temperature": 3}, "temperature"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"messages": [{"role": "user", "content": "lone \udc80"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages.1.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0.content"),
])
def test_bad_chat_requests_are_400s_naming_the_field(front, body, param):
    code, data, call = front.chat(**body)
    assert_refused(code, data, call, 400, param)


@pytest.mark.parametrize("body", [{"tools": []}, {"tool_choice": "none"}, {"tool_choice": "auto"}, {"top_logprobs": 0},
                                  {"logprobs": False}, {"response_format": {"type": "text"}}, {"functions": []}])
def test_neutral_chat_fields_are_accepted_and_change_nothing(front, body):
    code, _, call = front.chat(**body)
    assert code == 200 and call == ("generate_stream", {**DEFAULT_BODY, "text_input": "[user]hi[assistant]"})


def test_max_completion_tokens_wins_and_max_tokens_is_the_fallback(front):
    assert front.chat(max_completion_tokens=5, max_tokens=9)[2][1]["max_tokens"] == 5
    assert front.chat(max_tokens=9)[2][1]["max_tokens"] == 9
    assert front.chat(max_completion_tokens=4, max_tokens=None)[2][1]["max_tokens"] == 4
    code, data, call = front.chat(max_tokens=None)
    assert_refused(code, data, call, 400, "max_tokens", words="required")


def test_every_sampling_field_of_a_chat_request_reaches_triton(front):
    code, _, call = front.chat(max_tokens=6, temperature=0.25, top_p=0.75, seed=3, stop=["q"], min_tokens=2)
    assert code == 200
    assert call == ("generate_stream", {**DEFAULT_BODY, "text_input": "[user]hi[assistant]", "max_tokens": 6, "temperature": 0.25,
                                 "top_p": 0.75, "seed": 3, "stop_words": ["q"], "min_tokens": 2})
    _, _, call = front.chat(max_tokens=6, ignore_eos=True)
    assert call[1]["min_tokens"] == 6


def test_a_model_without_a_chat_template_refuses_chat(front, monkeypatch):
    monkeypatch.setattr(front.served, "tokenizer", CharTokenizer(chat=False))
    code, data, call = front.chat()
    assert_refused(code, data, call, 400, "messages", words="/v1/completions")
    assert front.complete()[0] == 200


@pytest.mark.parametrize("adds_bos, template_bos, prefix", [(True, True, ""), (False, True, "<s>"), (True, False, ""), (False, False, "")])
def test_the_templates_bos_is_dropped_only_when_the_tokenizer_adds_one(front, monkeypatch, adds_bos, template_bos, prefix):
    """The runtime encodes the prompt with tokenizer(prompt): a template's BOS plus the tokenizer's would be two."""
    monkeypatch.setattr(front.served, "tokenizer", CharTokenizer(adds_bos=adds_bos, template_bos=template_bos))
    code, data, call = front.chat()
    assert code == 200 and call[1]["text_input"] == prefix + "[user]hi[assistant]"
    assert data["usage"]["prompt_tokens"] == len(prefix + "[user]hi[assistant]") + adds_bos


# ---------------------------------------------------------------- streaming


def events_of(lines: list[str]) -> list[dict]:
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    assert all(ln.startswith("data: ") for ln in lines)
    return [json.loads(ln[len("data: "):]) for ln in lines[:-1]]


def test_a_streamed_completion_sends_one_chunk_per_text_then_the_finish(front):
    code, lines, _ = front.complete(stream=True, max_tokens=8)
    assert code == 200
    chunks = events_of(lines)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    for c in chunks:
        assert set(c) == {"id", "object", "created", "model", "choices"}  # no usage key without include_usage
        assert c["object"] == "text_completion" and c["model"] == MODEL
    assert [c["choices"] for c in chunks] == [
        [{"index": 0, "text": "ab", "finish_reason": None, "logprobs": None}],
        [{"index": 0, "text": "c", "finish_reason": None, "logprobs": None}],
        [{"index": 0, "text": "", "finish_reason": "stop", "logprobs": None}],
    ]


def test_stream_usage_comes_last_when_asked_for(front):
    _, lines, _ = front.complete(prompt="four", stream=True, max_tokens=3, stream_options={"include_usage": True})
    *chunks, usage = events_of(lines)
    assert all(c["usage"] is None for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert usage["id"] == chunks[0]["id"] and usage["object"] == "text_completion" and usage["model"] == MODEL
    for options in ({"include_usage": False}, {}, None):
        _, lines, _ = front.complete(stream=True, stream_options=options)
        assert all("usage" not in c for c in events_of(lines))


def test_a_token_step_without_text_counts_but_sends_no_chunk(front):
    """A step whose text is held back (a partial character) carries tokens and no text: no empty chunk, counted in usage."""
    front.triton.reply = Reply(events=[{"text_output": "", "output_log_probs": [-0.5]}, {"text_output": "é", "output_log_probs": [[-0.1]]},
                                       {"output_log_probs": []}])
    _, lines, _ = front.complete(stream=True, max_tokens=2, stream_options={"include_usage": True})
    *chunks, usage = events_of(lines)
    assert [c["choices"][0]["text"] for c in chunks] == ["é", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and usage["usage"]["completion_tokens"] == 2


def test_a_streamed_chat_starts_with_the_role_and_ends_with_an_empty_delta(front):
    code, lines, call = front.chat(stream=True, max_tokens=3, stream_options={"include_usage": True})
    assert code == 200 and call[0] == "generate_stream"
    *chunks, usage = events_of(lines)
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    assert [c["choices"] for c in chunks] == [
        [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}],
        [{"index": 0, "delta": {"content": "ab"}, "finish_reason": None, "logprobs": None}],
        [{"index": 0, "delta": {"content": "c"}, "finish_reason": None, "logprobs": None}],
        [{"index": 0, "delta": {}, "finish_reason": "length", "logprobs": None}],
    ]
    n = len("[user]hi[assistant]")
    assert usage["object"] == "chat.completion.chunk" and usage["usage"] == {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3}


def test_event_lines_without_a_space_and_other_lines_are_read_as_sse(front):
    front.triton.reply = Reply(prefix="data:", extra_lines=[": a comment", "event: message"])
    _, lines, _ = front.complete(stream=True, stream_options={"include_usage": True})
    *chunks, usage = events_of(lines)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc" and usage["usage"]["completion_tokens"] == 3


def test_a_stream_with_no_events_still_finishes(front):
    front.triton.reply = Reply(events=[])
    _, lines, _ = front.complete(stream=True, stream_options={"include_usage": True})
    *chunks, usage = events_of(lines)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == ["stop"] and usage["usage"]["completion_tokens"] == 0


# ---------------------------------------------------------------- Triton's errors


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_model_refuses_is_a_400_with_its_message(front, stream):
    front.triton.reply = Reply(status=400, json={"error": "top_k must be >= 0"}, events=[])
    code, data, call = front.complete(stream=stream)
    assert call is not None and code == 400
    assert data == {"error": {"message": "top_k must be >= 0", "type": "invalid_request_error", "param": None, "code": None}}


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("message, status, kind", [
    ("the server is shutting down: the request did not finish within the grace period", 503, "server_error"),
    ("engine step failed: RuntimeError: boom", 502, "server_error"),
    ("a refusal of the model", 400, "invalid_request_error"),
])
def test_an_error_after_the_first_chunk_ends_the_stream_with_an_error_event_and_done(front, chat, message, status, kind):
    """Never a silent cut: a stream that fails after it started ends with an error event in OpenAI's shape, then
    [DONE]; a plain request that fails the same way is an error response of the same status."""
    front.triton.reply = Reply(events=[{"text_output": "ab", "output_log_probs": [-0.1, -0.2]}, {"error": message}])
    code, lines, _ = (front.chat if chat else front.complete)(stream=True)
    assert code == 200 and lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    *chunks, error = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert error == {"error": {"message": message, "type": kind, "param": None, "code": None}}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert "".join((c["choices"][0].get("delta", {}).get("content") or "") if chat else c["choices"][0]["text"] for c in chunks) == "ab"
    code, data, _ = (front.chat if chat else front.complete)()
    assert code == status and data == {"error": {"message": message, "type": kind, "param": None, "code": None}}


def test_an_error_event_in_a_stream_is_a_400_before_any_chunk(front):
    front.triton.reply = Reply(events=[{"error": "bad stop word"}, {"text_output": "never"}])
    code, data, call = front.complete(stream=True)
    assert call is not None
    assert code == 400 and data["error"]["message"] == "bad stop word" and data["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("status", [404, 500, 503])
@pytest.mark.parametrize("stream", [False, True])
def test_any_other_triton_status_is_a_502_server_error(front, status, stream):
    front.triton.reply = Reply(status=status, json={"error": "internal error: boom"})
    code, data, _ = front.complete(stream=stream)
    assert code == 502 and data["error"]["type"] == "server_error" and data["error"]["message"] == "internal error: boom"


@pytest.mark.parametrize("message", ["internal error: boom", "top_k must be >= 0", "plain words", ""])
@pytest.mark.parametrize("status, want, kind", [(400, 400, "invalid_request_error"), (404, 502, "server_error"), (500, 502, "server_error"),
                                                (503, 502, "server_error")])
def test_tritons_http_status_alone_decides_refusal_or_fault_whatever_its_message(front, message, status, want, kind):
    """An answer with a status is read by its status (400: the model refused it; any other: a fault of the server),
    never by what its message looks like; only an error event inside a stream (no status) is read by its message."""
    front.triton.reply = Reply(status=status, json={"error": message})
    for stream in (False, True):
        code, data, _ = front.complete(stream=stream)
        assert (code, data["error"]["type"], data["error"]["message"]) == (want, kind, message), (status, message, stream)


@pytest.mark.parametrize("body", ['data: {"error": "bad value"}\n\n', 'data:{"error": "bad value"}', '{"error": "bad value"}'])
def test_a_server_sent_error_body_gives_its_message_without_the_framing(front, body):
    """Triton answers a refused generate_stream request with its error as one server-sent event: the OpenAI error
    carries the message, not the "data:" framing."""
    front.triton.reply = Reply(status=400, text=body, events=[])
    for stream in (False, True):
        code, data, _ = front.complete(stream=stream)
        assert code == 400 and data["error"]["message"] == "bad value"


def test_a_non_json_error_body_is_passed_on_as_text(front):
    front.triton.reply = Reply(status=400, text="plain words")
    code, data, _ = front.complete()
    assert code == 400 and data["error"]["message"] == "plain words"


def test_an_unreachable_triton_is_a_503_naming_it(front, monkeypatch):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setattr(front.served, "triton_url", url)
    for stream in (False, True):
        code, data, _ = front.complete(stream=stream)
        assert code == 503 and data["error"]["type"] == "server_error" and url in data["error"]["message"]


def test_a_queued_request_has_no_read_limit(front, monkeypatch):
    """The front waits for Triton's first byte as long as Triton keeps the connection: a request queued behind a full
    server (minutes at a binding load) is never cut into a 503 by a read timeout of the front's own."""
    import aiohttp

    seen = []
    real = aiohttp.ClientSession

    def session(*a, **kw):
        seen.append(kw.get("timeout"))
        return real(*a, **kw)

    monkeypatch.setattr(aiohttp, "ClientSession", session)
    for stream in (False, True):
        code, _, _ = front.complete(stream=stream)
        assert code == 200
    assert len(seen) == 2 and all(t is not None and t.total is None and t.sock_read is None and t.sock_connect for t in seen)


# ---------------------------------------------------------------- the helpers, directly


def test_triton_message_takes_the_error_field_of_json_else_the_text():
    assert api._triton_message('{"error": "x is bad"}') == "x is bad"
    assert api._triton_message('{"other": 1}') == '{"other": 1}'
    assert api._triton_message("not json") == "not json"
    assert api._triton_message("[1, 2]") == "[1, 2]"


def test_flat_and_usage_and_finish():
    assert api._flat([]) == [] and api._flat(-1.5) == [-1.5] and api._flat([[[1], [2, 3]], 4]) == [1, 2, 3, 4]
    assert api._usage(7, 5) == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    assert [api._finish(n, 4) for n in (0, 3, 4, 5)] == ["stop", "stop", "length", "length"]


def test_openai_error_body():
    e = OpenAIError(418, "short and stout", param="pot", code="teapot")
    assert e.status == 418 and str(e) == "short and stout"
    assert e.body() == {"error": {"message": "short and stout", "type": "invalid_request_error", "param": "pot", "code": "teapot"}}
    assert OpenAIError(503, "down", kind="server_error").body()["error"] == {"message": "down", "type": "server_error", "param": None, "code": None}


def test_served_counts_tokens_with_its_tokenizer():
    assert Served("m", CharTokenizer(), 10, "u").count("abcd") == 4
    assert Served("m", CharTokenizer(adds_bos=True), 10, "u").count("abcd") == 5


def test_load_served_reads_the_engine_directorys_tokenizer_and_limits(tmp_path, tokenizer):
    from types import SimpleNamespace

    from trtkv.manifest import TOKENIZER_DIR

    tokenizer.save_pretrained(tmp_path / TOKENIZER_DIR)
    manifest = SimpleNamespace(model=SimpleNamespace(name="tiny-model"), limits=SimpleNamespace(max_seq_len=77))
    s = api.load_served(tmp_path, manifest, "http://t:1")
    assert (s.name, s.max_seq_len, s.triton_url) == ("tiny-model", 77, "http://t:1")
    assert s.count("hello") == len(tokenizer("hello")["input_ids"])
    assert api.load_served(tmp_path, manifest, "http://t:1", name="alias").name == "alias"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_port_in_use_is_a_clear_error():
    import socket

    from trtkv.errors import TrtkvError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(TrtkvError, match=f"did not start on 127.0.0.1:{port}"):
            start_openai_server(Served(MODEL, CharTokenizer(), CONTEXT, "http://127.0.0.1:1"), "127.0.0.1", port)


# ---------------------------------------------------------------- what is not a request: bodies, paths, methods


def raw(front, path: str, data: bytes | None, method: str = "POST", headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"{front.url.removesuffix('/v1')}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_openai_error(code, data, status: int, words: str = ""):
    assert code == status, data
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}, data
    assert words.lower() in data["error"]["message"].lower(), data


@pytest.mark.parametrize("body, words", [
    (b'{"model": "served-model", "prompt": "\xff\xfe", "max_tokens": 3}', "UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nested"),
    (b'{"model": "served-model", "prompt": "x", "max_tokens": 3', "not valid JSON"),
    (b"not json at all", "not valid JSON"),
    (b"", "body"),
    (b'"a string"', "dictionary"),
])
def test_a_body_that_is_not_a_json_object_is_a_400_in_openais_shape(front, body, words):
    before = len(front.triton.calls)
    code, data = raw(front, "/v1/completions", body)
    assert_openai_error(code, data, 400, words)
    assert len(front.triton.calls) == before


def test_a_body_over_the_limit_is_a_413_and_nothing_is_tokenized(front):
    """The limit is max(1 MiB, 64 bytes per context token); the 413 comes after the body was read (a client still
    sending would otherwise see a reset connection), naming the limit."""
    limit = api.max_body_bytes(CONTEXT)
    assert limit == api.MIN_BODY_LIMIT == 1 << 20 and api.max_body_bytes(65536) == 65536 * 64
    before = len(front.triton.calls)
    over = json.dumps({"model": MODEL, "prompt": "x" * limit, "max_tokens": 3}).encode()
    code, data = raw(front, "/v1/completions", over)
    assert_openai_error(code, data, 413, f"limit of {limit:,} bytes")
    assert data["error"]["code"] == "request_too_large" and len(front.triton.calls) == before
    just = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 3, "pad": "y" * (limit - 100)}).encode()
    assert len(just) <= limit
    code, data = raw(front, "/v1/completions", just)
    assert code == 200, data


def test_a_chunked_body_over_the_limit_is_a_413(front):
    """Without a Content-Length (chunked transfer) the limit is counted as the body arrives."""
    import http.client

    host, port = front.url.removeprefix("http://").split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": MODEL, "prompt": "x" * (api.max_body_bytes(CONTEXT) + 10), "max_tokens": 3}).encode()
    conn.request("POST", "/v1/completions", body=iter([body[i:i + 65536] for i in range(0, len(body), 65536)]),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    r = conn.getresponse()
    assert_openai_error(r.status, json.loads(r.read()), 413, "limit")


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/completions", 405), ("PUT", "/v1/chat/completions", 405), ("POST", "/v1/models", 405),
    ("GET", "/v1/nothing", 404), ("POST", "/v2/models/ensemble/generate", 404),
])
def test_a_wrong_path_or_method_is_an_error_in_openais_shape(front, method, path, status):
    code, data = raw(front, path, b"{}" if method != "GET" else None, method=method)
    assert_openai_error(code, data, status)


def test_a_model_is_retrieved_by_its_id_and_an_unknown_id_is_a_404(front):
    code, data = raw(front, f"/v1/models/{MODEL}", None, method="GET")
    assert code == 200 and data == {"id": MODEL, "object": "model", "created": 0, "owned_by": "trtkv"}
    code, data = raw(front, "/v1/models/gpt-4o", None, method="GET")
    assert_openai_error(code, data, 404, "gpt-4o")
    assert data["error"]["code"] == "model_not_found"


def test_health_is_200_when_triton_is_ready_and_503_when_it_cannot_be_reached(front, monkeypatch):
    code, _ = raw(front, "/health", None, method="GET")
    assert code == 200
    monkeypatch.setattr(front.served, "triton_url", f"http://127.0.0.1:{free_port()}")
    code, data = raw(front, "/health", None, method="GET")
    assert_openai_error(code, data, 503, "not ready")


@pytest.mark.parametrize("ctype", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_json_body_is_read_as_json_whatever_its_content_type(front, ctype):
    """`curl -d '{...}'` sends form encoding: the body is still the request."""
    import http.client

    host, port = front.url.removeprefix("http://").split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.putrequest("POST", "/v1/completions")
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 8}).encode()
    if ctype:
        conn.putheader("Content-Type", ctype)
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["choices"][0]["text"] == "abc"
    assert front.triton.calls[-1] == ("generate_stream", DEFAULT_BODY)
