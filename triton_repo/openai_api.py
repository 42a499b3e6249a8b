"""OpenAI-compatible endpoints in front of the served trtkv model (`trtkv serve --openai-port N`).

``/v1/models`` (and ``/v1/models/{id}``), ``/v1/completions``, ``/v1/chat/completions`` (the tokenizer's chat
template) and ``/health``; streaming as server-sent events, ``usage`` counts, ``stop``, ``seed``, ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``n=1``. It is a translation layer, not a second engine: every
request goes to the running tritonserver's trtkv model (``ensemble``) through its ``generate_stream`` endpoint, so
both interfaces share one KV pool, one scheduler and one set of metrics. A plain (non-streaming) request is streamed
from Triton too and answered whole: Triton 2.51's plain ``generate`` endpoint does not read its connection until the
model's one response, so a request whose client left would run to its end; a stream's closed connection is seen at
the next token, and the front closes its stream to Triton as soon as its own client leaves.

Errors come back in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) with its status codes: 400
for a bad request (the model's own refusals included) naming the field in ``param``, 404 for an unknown model or
path, 405 for a wrong method, 413 for a body over ``max_body_bytes``, 503 when Triton cannot be reached or the
server is shutting down. A stream that fails after its first chunk ends with an error event in the same shape and
``data: [DONE]``. Tokenization runs in a worker thread, so a large prompt does not hold up other clients.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool
from starlette.requests import Request  # the endpoints' annotation, resolved in this module's namespace

from trtkv.triton_repo.repository import LLM_MODEL

SEED_MAX = 2**64 - 1  # the model's seed input is UINT64 (TensorRT-LLM's)
MIN_BODY_LIMIT = 1 << 20  # bytes; a request body larger than max_body_bytes(context) is refused with a 413
BODY_BYTES_PER_TOKEN = 64  # a generous bound on the bytes of JSON one prompt token takes (long tokens, escapes, chat framing)
DRAIN_LIMIT = 64 << 20  # an oversized body is read (and dropped) up to this much before the 413, so the client sees it


def max_body_bytes(context: int) -> int:
    """The largest request body the front reads: ``MIN_BODY_LIMIT``, or 64 bytes per token of the engine's context."""
    return max(MIN_BODY_LIMIT, context * BODY_BYTES_PER_TOKEN)


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's; only false (usage comes once, at the end)


class _Common(BaseModel):
    """Fields both endpoints take. Unknown fields are accepted and ignored, as OpenAI-compatible servers do; fields
    OpenAI defines that trtkv does not implement are declared and refused unless neutral (``NEUTRAL``)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = 1
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(default=None, ge=0, le=SEED_MAX)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Any = None
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[dict[str, Any]] = None
    # vLLM's extensions, which benchmark clients send to get exactly max_tokens tokens (aiperf / genai-perf
    # `--extra-inputs ignore_eos:true`): end id and stop words are suppressed until min_tokens new tokens
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: StrictBool = False
    top_k: Optional[int] = Field(default=None, ge=-1)  # vLLM's: -1 or 0 off; else the model's top_k input
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0)


class CompletionRequest(_Common):
    prompt: Union[str, list[str]]
    echo: StrictBool = False
    best_of: Optional[int] = Field(default=None, ge=1)
    suffix: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict], None] = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Union[str, dict[str, Any], None] = None


# OpenAI / vLLM fields trtkv does not implement: the values that change nothing are accepted, any other is a 400 naming
# the field (never silently ignored). Penalties are also refused by the model's own inputs (interface.py).
NEUTRAL: dict[str, tuple] = {
    "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "best_of": (None, 1),
    "echo": (False,),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),  # "auto" without tools changes nothing
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
}
WHY_NOT = {
    "logprobs": "per-token log-probabilities are not returned by this server (Triton's return_log_probs has them)",
    "top_logprobs": "per-token log-probabilities are not returned by this server",
    "response_format": "structured output (JSON mode, JSON schema) is not supported",
    "tools": "tool calling is not supported", "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported", "function_call": "function calling is not supported",
    "best_of": "trtkv returns one completion per request (best_of=1)",
    "echo": "echo is not supported", "suffix": "suffix (insertion) is not supported",
    "logit_bias": "logit_bias is not supported",
}


@dataclass
class Served:
    """What the front needs about the served model: its name, tokenizer (usage counts, chat template) and limits."""

    name: str
    tokenizer: Any
    max_seq_len: int
    triton_url: str  # e.g. http://127.0.0.1:8000

    def count(self, text: str) -> int:
        """Prompt tokens exactly as the runtime encodes a prompt (``LLMEngine.add_request``)."""
        return len(self.tokenizer(text)["input_ids"])


def _check_neutral(req: _Common) -> None:
    for name, accepted in NEUTRAL.items():
        if name not in type(req).model_fields:
            continue
        value = getattr(req, name)
        if not any(_same(value, a) for a in accepted):
            shown = ", ".join("null" if a is None else json.dumps(a) for a in accepted)
            reason = WHY_NOT.get(name, f"{name} is not supported by trtkv")
            raise OpenAIError(400, f"{name}={json.dumps(value)}: {reason}; send {shown} or leave it out", param=name)


def _same(value, neutral) -> bool:
    """``value`` is the neutral value: equal and of the same kind (0 is not false, 0.0 is 0)."""
    if neutral is None or isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and value == neutral
    return type(value) is type(neutral) and value == neutral


def _check_text(name: str, text: str) -> None:
    """A string that cannot be UTF-8 (a lone surrogate such as "\\ud800" from a JSON escape) is a 400 naming it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise OpenAIError(400, f"{name} is not valid Unicode text: {exc.reason} at position {exc.start} "
                               "(a lone surrogate escape such as \\ud800); send UTF-8 text", param=name) from None


def _check(req: _Common, served: Served, max_tokens: int | None) -> list[str]:
    if req.model != served.name:
        raise OpenAIError(404, f"The model '{req.model}' does not exist; this server serves '{served.name}'", param="model", code="model_not_found")
    if req.n != 1:
        raise OpenAIError(400, f"n={req.n} is not supported: trtkv returns one choice per request (n=1)", param="n")
    _check_neutral(req)
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise OpenAIError(400, "stream_options.continuous_usage_stats is not supported: usage comes once, at the end (include_usage)",
                          param="stream_options.continuous_usage_stats")
    if max_tokens is None:
        raise OpenAIError(400, "max_tokens is required (the completion length limit)", param="max_tokens")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > 4:
        raise OpenAIError(400, f"stop takes at most 4 sequences, got {len(stops)}", param="stop")
    for s in stops:
        _check_text("stop", s)
    if req.min_tokens > max_tokens:
        raise OpenAIError(400, f"min_tokens ({req.min_tokens}) is more than max_tokens ({max_tokens})", param="min_tokens")
    if req.ignore_eos and any(stops):
        raise OpenAIError(400, "ignore_eos together with stop is not supported (ignore_eos also suppresses stop strings)", param="ignore_eos")
    return [s for s in stops if s]


def _triton_body(prompt: str, req: _Common, max_tokens: int, stops: list[str]) -> dict:
    """The generate_stream request of the trtkv model (always streamed: see the module docstring)."""
    body: dict = {"text_input": prompt, "max_tokens": max_tokens, "stream": True, "return_log_probs": True,
                  "exclude_input_in_output": True, "temperature": req.temperature, "top_p": req.top_p}
    if stops:
        body["stop_words"] = stops
    if req.seed is not None:
        body["seed"] = req.seed
    if req.top_k is not None and req.top_k > 0:
        body["top_k"] = req.top_k
    min_tokens = max_tokens if req.ignore_eos else req.min_tokens  # the runtime has no separate ignore_eos input
    if min_tokens:
        body["min_tokens"] = min_tokens
    return body


async def _generate(served: Served, body: dict) -> AsyncIterator[tuple[str, int]]:
    """(new text, new tokens) per response of the trtkv model's generate_stream; Triton's errors become OpenAIErrors."""
    import aiohttp

    url = f"{served.triton_url}/v2/models/{LLM_MODEL}/generate_stream"
    try:
        # no read limit: a request queued behind a full server waits for its first token as long as Triton holds it
        # (a 600 s limit here cut 13 of 64 queued requests of the binding load into 503s); the connect is bounded
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=None)) as session:
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    message = _triton_message(await resp.text())
                    raise _model_error(message, resp.status)
                async for raw in resp.content:
                    line = raw.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        raise _model_error(_triton_message(event["error"]), None)
                    yield event.get("text_output", ""), len(_flat(event.get("output_log_probs", [])))
    except aiohttp.ClientConnectionError as exc:
        raise OpenAIError(503, f"the Triton server at {served.triton_url} cannot be reached: {exc}", kind="server_error") from None
    except aiohttp.ClientPayloadError as exc:
        raise OpenAIError(503, f"the Triton server at {served.triton_url} broke off the response: {exc}", kind="server_error") from None


SERVER_SIDE = ("the server is shutting down", "engine step failed", "internal error")  # the model's own failures (python_model.py)


def _model_error(message: str, status: int | None) -> OpenAIError:
    """Triton's answer as an OpenAIError: the model's refusals (HTTP 400, or an error event in a stream) are 400s;
    a shutdown is a 503 (retry elsewhere); any other failure of the server is a 502."""
    if "shutting down" in message:
        return OpenAIError(503, message, kind="server_error")
    if status == 400 or (status is None and not any(message.startswith(p) for p in SERVER_SIDE)):
        return OpenAIError(400, message)
    return OpenAIError(502, message, kind="server_error")


def _flat(x) -> list:
    return [v for item in x for v in _flat(item)] if isinstance(x, list) else [x]


def _triton_message(text) -> str:
    """The error message of a Triton answer: the ``error`` field of its JSON body or of its first server-sent event
    (``data: {"error": ...}``), else the text as it is."""
    if not isinstance(text, str):
        return str(text)
    body = text.strip()
    if body.startswith("data:"):
        body = body[5:].split("\n", 1)[0].strip()
    try:
        got = json.loads(body)
    except json.JSONDecodeError:
        return text
    return str(got["error"]) if isinstance(got, dict) and "error" in got else text


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _finish(completion_tokens: int, max_tokens: int) -> str:
    return "length" if completion_tokens >= max_tokens else "stop"


def chat_prompt(served: Served, req: ChatRequest) -> str:
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]: text parts only
            if any(p.get("type") != "text" for p in content):
                raise OpenAIError(400, "only text content parts are supported", param="messages")
            if any(not isinstance(p.get("text", ""), str) for p in content):
                raise OpenAIError(400, "a text content part's text must be a string", param=f"messages.{i}.content")
            content = "".join(p.get("text", "") for p in content)
        _check_text(f"messages.{i}.content", content or "")
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    if not getattr(served.tokenizer, "chat_template", None):
        raise OpenAIError(400, f"the model '{served.name}' has no chat template; use /v1/completions", param="messages")
    text = served.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return _without_template_bos(served.tokenizer, text)


def _without_template_bos(tokenizer, text: str) -> str:
    """The rendered chat without the BOS its template writes when the tokenizer adds BOS itself.

    The runtime encodes every prompt as ``tokenizer(prompt)`` (``LLMEngine.make_sequence``), so the chat's ids
    are then those of ``apply_chat_template(..., add_generation_prompt=True)``, with one BOS, not two.
    """
    from trtkv.data import adds_bos

    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos) and adds_bos(tokenizer):
        return text[len(bos):]
    return text


class RequestBody:
    """ASGI middleware for request bodies. Every POST body is read as JSON whatever its Content-Type (``curl -d`` sends
    form encoding; OpenAI's API takes JSON only). A body over ``limit`` bytes gets a 413 in OpenAI's shape before
    anything parses it; the body is read and dropped first (up to ``DRAIN_LIMIT``): a client still sending would
    otherwise see a reset connection instead of the answer."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope.get("method") == "POST":
            headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(int(declared), receive, send)
            return
        if declared is not None:  # the server reads no more than the declared length
            return await self.app(scope, receive, send)
        # chunked: read the body here, up to the limit, and hand it on whole
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                await self._refuse(size, receive, send, more=more)
                return
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, size: int, receive, send, more: bool = True) -> None:
        drained = 0
        while more and drained < DRAIN_LIMIT:
            message = await receive()
            if message["type"] != "http.request":
                break
            drained += len(message.get("body", b""))
            more = message.get("more_body", False)
        err = OpenAIError(413, f"the request body ({size:,} bytes or more) is over this server's limit of {self.limit:,} bytes "
                               "(a prompt that long would not fit the engine's context); send a shorter prompt",
                          code="request_too_large")
        payload = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def create_app(served: Served):
    """The FastAPI application; ``serve_openai`` runs it with uvicorn."""
    import aiohttp
    from anyio import to_thread
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="trtkv OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestBody, limit=max_body_bytes(served.max_seq_len))

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        if err.get("type") == "json_invalid":
            return JSONResponse(OpenAIError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}").body(), status_code=400)
        param = ".".join(str(p) for p in err["loc"] if p != "body") or None
        message = f"{param}: {err['msg']}" if param else f"the request body: {err['msg']} (send a JSON object)"
        return JSONResponse(OpenAIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(ClientGone)
    async def _client_gone(_request: Request, _exc: ClientGone):
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, exc: HTTPException):
        messages = {404: "no such endpoint: this server serves /v1/completions, /v1/chat/completions, /v1/models and /health",
                    405: "method not allowed on this endpoint (the generation endpoints take POST, /v1/models GET)",
                    400: "the request body could not be read as JSON text (invalid UTF-8, or nested too deeply); send UTF-8 JSON"}
        message = messages.get(exc.status_code, str(exc.detail))
        return JSONResponse(OpenAIError(exc.status_code, message, code=None).body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception):
        return JSONResponse(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error").body(), status_code=500)

    def model_card() -> dict:
        return {"id": served.name, "object": "model", "created": 0, "owned_by": "trtkv"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != served.name:
            raise OpenAIError(404, f"The model '{model_id}' does not exist; this server serves '{served.name}'", param="model", code="model_not_found")
        return model_card()

    @app.get("/health")
    async def health():
        """200 when the Triton server behind the front is ready (its /v2/health/ready), else 503."""
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                async with session.get(f"{served.triton_url}/v2/health/ready") as resp:
                    ready = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ready = False
        if not ready:
            raise OpenAIError(503, f"the Triton server at {served.triton_url} is not ready", kind="server_error")
        return Response(status_code=200)

    async def run(prompt: str, req: _Common, max_tokens: int | None, chat: bool, request: Request):
        stops = _check(req, served, max_tokens)
        _check_text("prompt", prompt)
        prompt_tokens = await to_thread.run_sync(served.count, prompt)  # a long prompt does not hold up the event loop
        if prompt_tokens + max_tokens > served.max_seq_len:
            raise OpenAIError(400, f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the engine's "
                                   f"{served.max_seq_len}-token context", param="max_tokens", code="context_length_exceeded")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        stream = _generate(served, _triton_body(prompt, req, max_tokens, stops))
        if not req.stream:
            text, n = await _whole(stream, request)
            choice = {"index": 0, "finish_reason": _finish(n, max_tokens), "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                                 "model": served.name, "choices": [choice], "usage": _usage(prompt_tokens, n)})
        first = await anext(stream, None)  # a bad request fails here, before any event is sent: a plain 400
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(body: dict) -> str:
            return f"data: {json.dumps(body)}\n\n"

        def chunk(piece: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": piece} if piece else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
            body = {"id": rid, "object": obj, "created": created, "model": served.name, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return event(body)

        async def events():
            n = 0
            if chat:
                yield chunk(None, None, role=True)
            pieces = stream if first is None else _prepend(first, stream)
            try:
                async for piece, tokens in pieces:
                    n += tokens
                    if piece:
                        yield chunk(piece, None)
            except OpenAIError as exc:  # after the first chunk: the stream ends with an error event, never a silent cut
                yield event(exc.body())
                yield "data: [DONE]\n\n"
                return
            except Exception as exc:  # whatever broke, the client gets an error event and the end
                yield event(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error").body())
                yield "data: [DONE]\n\n"
                return
            yield chunk(None, _finish(n, max_tokens))
            if include_usage:
                yield event({"id": rid, "object": obj, "created": created, "model": served.name, "choices": [], "usage": _usage(prompt_tokens, n)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompt = req.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise OpenAIError(400, f"a list of {len(prompt)} prompts is not supported: send one prompt per request", param="prompt")
            prompt = prompt[0]
        return await run(prompt, req, req.max_tokens, chat=False, request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        prompt = await to_thread.run_sync(chat_prompt, served, req)
        return await run(prompt, req, req.max_completion_tokens or req.max_tokens, chat=True, request=request)

    return app


async def _whole(stream: AsyncIterator[tuple[str, int]], request) -> tuple[str, int]:
    """The whole text and token count of a plain request, or -- when its client leaves first -- the Triton stream is
    closed (the model aborts the request at its next step) and ``ClientGone`` raised."""

    async def collect() -> tuple[str, int]:
        text, n = "", 0
        async for piece, tokens in stream:
            text, n = text + piece, n + tokens
        return text, n

    async def client_gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            if not task.done():
                task.cancel()
    if not work.done() or work.cancelled():
        await asyncio.gather(work, return_exceptions=True)  # the stream to Triton is closed before we return
        raise ClientGone()
    return work.result()


class ClientGone(Exception):
    """The client of a plain request disconnected before its answer; nothing is sent."""


async def _prepend(first, rest: AsyncIterator):
    yield first
    async for item in rest:
        yield item


def load_served(engine_dir: Path, manifest, triton_url: str, name: str | None = None) -> Served:
    """The served model as the front sees it, from the engine directory ``serve`` already loaded (``manifest``)."""
    from transformers import AutoTokenizer

    from trtkv.manifest import TOKENIZER_DIR

    m = manifest
    tok = AutoTokenizer.from_pretrained(str(Path(engine_dir) / TOKENIZER_DIR), local_files_only=True)
    return Served(name=name or m.model.name, tokenizer=tok, max_seq_len=m.limits.max_seq_len, triton_url=triton_url)


def start_openai_server(served: Served, host: str, port: int):
    """Run the API with uvicorn in a daemon thread; returns the ``uvicorn.Server`` (``should_exit = True`` stops it)."""
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(served), host=host, port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="trtkv-openai", daemon=True)
    thread.start()
    server.trtkv_thread = thread  # stop_openai_server joins it
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not server.started:
        from trtkv.errors import TrtkvError

        raise TrtkvError(f"the OpenAI-compatible server did not start on {host}:{port}", "choose a free --openai-port")
    return server


def stop_openai_server(server, timeout: float) -> bool:
    """Stop the front: no new connections, idle ones closed, the responses in flight (their last events) finished,
    for up to ``timeout`` s. True when it stopped in time."""
    server.should_exit = True
    thread = getattr(server, "trtkv_thread", None)
    if thread is not None:
        thread.join(timeout)
        return not thread.is_alive()
    return True
