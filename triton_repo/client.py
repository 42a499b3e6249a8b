"""A small HTTP client for the generated repository's ``generate`` and ``generate_stream`` endpoints (stdlib only).

    for piece in stream_generate("http://127.0.0.1:8000", "def fib(n):", max_tokens=32):
        print(piece.text, end="", flush=True)

Any Triton client works against the same repository (tritonclient, curl, perf_analyzer, genai-perf);
this one is what ``trtkv generate --url`` and ``bench/serve.py`` use.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Iterator

from trtkv.errors import TrtkvError

MODEL = "ensemble"


@dataclass
class Piece:
    text: str
    t: float  # monotonic arrival time
    raw: dict = field(default_factory=dict)


class GenerateError(TrtkvError):
    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"server answered {status}: {message}")


def request_body(prompt: str, max_tokens: int, **params) -> dict:
    body = {"text_input": prompt, "max_tokens": int(max_tokens)}
    body.update({k: v for k, v in params.items() if v is not None})
    return body


def _conn(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    u = urllib.parse.urlparse(url if "://" in url else f"http://{url}")
    if u.scheme != "http":
        raise TrtkvError(f"unsupported URL scheme in {url!r}", "use http://HOST:PORT")
    return http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 8000, timeout=timeout), u.path.rstrip("/")


def _post(url: str, path: str, body: dict, timeout: float):
    conn, prefix = _conn(url, timeout)
    try:
        conn.request("POST", prefix + path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        return conn, conn.getresponse()
    except (ConnectionError, OSError) as exc:
        conn.close()
        raise TrtkvError(f"cannot reach {url}: {exc}", "start the server with `trtkv serve ENGINE_DIR` or check --url") from None


def _error_text(payload: bytes) -> str:
    try:
        return json.loads(payload).get("error", payload.decode(errors="replace"))
    except (ValueError, AttributeError):
        return payload.decode(errors="replace")


def wait_ready(url: str, timeout: float) -> None:
    """Poll ``/v2/health/ready`` until the server answers 200 (e.g. right after ``trtkv serve ... &``)."""
    deadline = time.monotonic() + timeout
    while True:
        conn, prefix = _conn(url, 5)
        try:
            conn.request("GET", prefix + "/v2/health/ready")
            if conn.getresponse().status == 200:
                return
        except (ConnectionError, OSError):
            pass
        finally:
            conn.close()
        if time.monotonic() > deadline:
            raise TrtkvError(f"{url} was not ready within {timeout:.0f} s", "start it with `trtkv serve ENGINE_DIR` and check its log")
        time.sleep(0.5)


def generate(url: str, prompt: str, max_tokens: int = 64, *, model: str = MODEL, timeout: float = 300.0, **params) -> dict:
    """One non-streaming request; returns the JSON response (``text_output`` holds the text)."""
    conn, resp = _post(url, f"/v2/models/{model}/generate", request_body(prompt, max_tokens, **params), timeout)
    try:
        payload = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise GenerateError(resp.status, _error_text(payload))
    data = json.loads(payload)
    if "error" in data:
        raise GenerateError(resp.status, data["error"])
    return data


def stream_generate(url: str, prompt: str, max_tokens: int = 64, *, model: str = MODEL, timeout: float = 300.0, **params) -> Iterator[Piece]:
    """Server-sent events from ``generate_stream`` (``stream: true``): one ``Piece`` per response."""
    body = request_body(prompt, max_tokens, stream=True, **params)
    conn, resp = _post(url, f"/v2/models/{model}/generate_stream", body, timeout)
    try:
        if resp.status != 200:
            raise GenerateError(resp.status, _error_text(resp.read()))
        while True:
            line = resp.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = json.loads(line[5:])
            if "error" in data:
                raise GenerateError(400, data["error"])
            yield Piece(data.get("text_output", ""), time.monotonic(), data)
    finally:
        conn.close()
