"""OpenAI-compatible endpoints in front of the served trtkv model (`trtkv serve --openai-port N`).

``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` (the tokenizer's chat template), streaming as
server-sent events, ``usage`` counts, ``stop``, ``seed``, ``max_tokens`` / ``max_completion_tokens``,
``temperature``, ``top_p``, ``n=1``. It is a translation layer, not a second engine: every request goes to the
running tritonserver's trtkv model (``ensemble``) (its ``generate`` / ``generate_stream`` endpoints), so both interfaces share one KV
pool, one scheduler and one set of metrics. Errors come back in OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``) with its status codes: 400 for a bad request (the model's
own 400s included), 404 for an unknown model, 503 when Triton cannot be reached.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from trtkv.triton_repo.repository import LLM_MODEL


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Common(BaseModel):
    """Fields both endpoints take; unknown fields are accepted and ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = 1
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(default=None, ge=0)
    stream: bool = False
    stream_options: Optional[dict] = None
    logprobs: Any = None
    # vLLM's extensions, which benchmark clients send to get exactly max_tokens tokens (aiperf / genai-perf
    # `--extra-inputs ignore_eos:true`): end id and stop words are suppressed until min_tokens new tokens
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False


class CompletionRequest(_Common):
    prompt: Union[str, list[str]]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict], None] = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)


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


def _check(req: _Common, served: Served, max_tokens: int | None) -> list[str]:
    if req.model != served.name:
        raise OpenAIError(404, f"The model '{req.model}' does not exist; this server serves '{served.name}'", param="model", code="model_not_found")
    if req.n != 1:
        raise OpenAIError(400, f"n={req.n} is not supported: trtkv returns one choice per request (n=1)", param="n")
    if req.logprobs not in (None, False, 0):
        raise OpenAIError(400, "logprobs are not supported by this server", param="logprobs")
    if max_tokens is None:
        raise OpenAIError(400, "max_tokens is required (the completion length limit)", param="max_tokens")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > 4:
        raise OpenAIError(400, f"stop takes at most 4 sequences, got {len(stops)}", param="stop")
    if req.min_tokens > max_tokens:
        raise OpenAIError(400, f"min_tokens ({req.min_tokens}) is more than max_tokens ({max_tokens})", param="min_tokens")
    if req.ignore_eos and any(stops):
        raise OpenAIError(400, "ignore_eos together with stop is not supported (ignore_eos also suppresses stop strings)", param="ignore_eos")
    return [s for s in stops if s]


def _triton_body(prompt: str, req: _Common, max_tokens: int, stops: list[str]) -> dict:
    body: dict = {"text_input": prompt, "max_tokens": max_tokens, "stream": req.stream, "return_log_probs": True,
                  "exclude_input_in_output": True, "temperature": req.temperature, "top_p": req.top_p}
    if stops:
        body["stop_words"] = stops
    if req.seed is not None:
        body["seed"] = req.seed
    min_tokens = max_tokens if req.ignore_eos else req.min_tokens  # the runtime has no separate ignore_eos input
    if min_tokens:
        body["min_tokens"] = min_tokens
    return body


async def _generate(served: Served, body: dict) -> AsyncIterator[tuple[str, int]]:
    """(new text, new tokens) per response of the trtkv model (generate_stream when streaming, else one from generate);
    Triton's errors become OpenAIErrors."""
    import aiohttp

    streaming = body["stream"]  # a plain request asks Triton for the whole text at once (generate)
    url = f"{served.triton_url}/v2/models/{LLM_MODEL}/{'generate_stream' if streaming else 'generate'}"
    try:
        # no read limit: a request queued behind a full server waits for its first token as long as Triton holds it
        # (a 600 s limit here cut 13 of 64 queued requests of the binding load into 503s); the connect is bounded
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=None)) as session:
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    raise OpenAIError(400 if resp.status == 400 else 502, _triton_message(await resp.text()),
                                      kind="invalid_request_error" if resp.status == 400 else "server_error")
                if not streaming:
                    event = await resp.json(content_type=None)
                    yield event.get("text_output", ""), len(_flat(event.get("output_log_probs", [])))
                    return
                async for raw in resp.content:
                    line = raw.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        raise OpenAIError(400, _triton_message(event["error"]))
                    yield event.get("text_output", ""), len(_flat(event.get("output_log_probs", [])))
    except aiohttp.ClientConnectionError as exc:
        raise OpenAIError(503, f"the Triton server at {served.triton_url} cannot be reached: {exc}", kind="server_error") from None


def _flat(x) -> list:
    return [v for item in x for v in _flat(item)] if isinstance(x, list) else [x]


def _triton_message(text: str) -> str:
    try:
        return json.loads(text).get("error", text)
    except (json.JSONDecodeError, AttributeError):
        return text


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _finish(completion_tokens: int, max_tokens: int) -> str:
    return "length" if completion_tokens >= max_tokens else "stop"


def chat_prompt(served: Served, req: ChatRequest) -> str:
    messages = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]: text parts only
            if any(p.get("type") != "text" for p in content):
                raise OpenAIError(400, "only text content parts are supported", param="messages")
            content = "".join(p.get("text", "") for p in content)
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


def create_app(served: Served):
    """The FastAPI application; ``serve_openai`` runs it with uvicorn."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="trtkv OpenAI-compatible API", docs_url=None, redoc_url=None)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"] if p != "body") or None
        return JSONResponse(OpenAIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param).body(), status_code=400)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0, "owned_by": "trtkv"}]}

    async def run(prompt: str, req: _Common, max_tokens: int | None, chat: bool):
        stops = _check(req, served, max_tokens)
        prompt_tokens = served.count(prompt)
        if prompt_tokens + max_tokens > served.max_seq_len:
            raise OpenAIError(400, f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the engine's "
                                   f"{served.max_seq_len}-token context", param="max_tokens", code="context_length_exceeded")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        stream = _generate(served, _triton_body(prompt, req, max_tokens, stops))
        if not req.stream:
            text, n = "", 0
            async for piece, tokens in stream:
                text, n = text + piece, n + tokens
            choice = {"index": 0, "finish_reason": _finish(n, max_tokens), "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                                 "model": served.name, "choices": [choice], "usage": _usage(prompt_tokens, n)})
        first = await anext(stream, None)  # a bad request fails here, before any event is sent: a plain 400
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": piece} if piece else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
            body = {"id": rid, "object": obj, "created": created, "model": served.name, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        async def events():
            n = 0
            if chat:
                yield chunk(None, None, role=True)
            pieces = stream if first is None else _prepend(first, stream)
            async for piece, tokens in pieces:
                n += tokens
                if piece:
                    yield chunk(piece, None)
            yield chunk(None, _finish(n, max_tokens))
            if include_usage:
                yield f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': served.name, 'choices': [], 'usage': _usage(prompt_tokens, n)})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        prompt = req.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise OpenAIError(400, f"a list of {len(prompt)} prompts is not supported: send one prompt per request", param="prompt")
            prompt = prompt[0]
        if req.echo:
            raise OpenAIError(400, "echo is not supported", param="echo")
        return await run(prompt, req, req.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest):
        return await run(chat_prompt(served, req), req, req.max_completion_tokens or req.max_tokens, chat=True)

    return app


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
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not server.started:
        from trtkv.errors import TrtkvError

        raise TrtkvError(f"the OpenAI-compatible server did not start on {host}:{port}", "choose a free --openai-port")
    return server
