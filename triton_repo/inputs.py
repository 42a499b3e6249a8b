"""Turn one Triton request's input tensors into a prompt, ``SamplingParams`` and response options.

Pure Python and numpy: the python-backend model passes a ``get(name) -> np.ndarray | None`` and gets
a ``ParsedRequest`` or a ``TrtkvError`` whose message goes back to the client as a 400.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from trtkv.errors import TrtkvError
from trtkv.runtime.sequence import SamplingParams
from trtkv.triton_repo.interface import INPUTS

MAX_TOKENS_LIMIT = 1 << 20


@dataclass
class ParsedRequest:
    prompt: str
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    return_log_probs: bool = False


def _scalar(get: Callable, name: str):
    x = get(name)
    if x is None:
        return None
    x = np.asarray(x)
    if x.size != 1:
        raise TrtkvError(f"input {name!r} must hold one value per request, got shape {list(x.shape)}", "send a single value")
    return x.reshape(-1)[0]


def _text(v) -> str:
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise TrtkvError("text input is not valid UTF-8", "send UTF-8 text") from None
    return str(v)


def _words(get: Callable, name: str) -> list[str]:
    x = get(name)
    if x is None:
        return []
    words = [_text(v) for v in np.asarray(x).reshape(-1)]
    # TensorRT-LLM clients often send one comma-free word per element; empty strings mean "none"
    return [w for w in words if w]


def parse_request(get: Callable[[str], "np.ndarray | None"]) -> ParsedRequest:
    """Validate and convert a request; every problem is one ``TrtkvError`` line for the client."""
    text = _scalar(get, "text_input")
    if text is None:
        raise TrtkvError("missing input 'text_input'", "send the prompt as text_input")
    prompt = _text(text)
    if not prompt:
        raise TrtkvError("text_input is empty", "send a non-empty prompt")
    max_tokens = _scalar(get, "max_tokens")
    if max_tokens is None:
        raise TrtkvError("missing input 'max_tokens'", "send max_tokens (INT32, >= 1)")
    max_tokens = int(max_tokens)
    if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise TrtkvError(f"max_tokens must be between 1 and {MAX_TOKENS_LIMIT}, got {max_tokens}", "ask for one or more new tokens")

    for spec in INPUTS:
        if spec.support == "neutral":
            v = _scalar(get, spec.name)
            if v is not None and v != spec.neutral and not (isinstance(spec.neutral, float) and float(v) == spec.neutral):
                raise TrtkvError(
                    f"{spec.name}={v!r} is not supported by trtkv (only {spec.neutral!r})",
                    f"leave {spec.name} out of the request",
                )

    temperature = _scalar(get, "temperature")
    top_k = _scalar(get, "top_k")
    top_p = _scalar(get, "top_p")
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if v is not None and not math.isfinite(float(v)):
            raise TrtkvError(f"{name} must be a finite number, got {float(v)}", f"send a number ({name} 0 for greedy)" if name == "temperature" else "send a number in (0, 1]")
    if temperature is not None and float(temperature) < 0:
        raise TrtkvError(f"temperature must be >= 0, got {float(temperature)}", "use 0 for greedy decoding")
    top_k = 0 if top_k is None else int(top_k)
    top_p = 1.0 if top_p is None or float(top_p) == 0.0 else float(top_p)
    samples = (temperature is not None and float(temperature) > 0) or top_k > 1 or top_p < 1.0
    temperature = (1.0 if temperature is None else float(temperature)) if samples else 0.0
    seed = _scalar(get, "seed")
    if seed is None:
        seed = _scalar(get, "random_seed")
    min_tokens = _scalar(get, "min_tokens")
    if min_tokens is None:
        min_tokens = _scalar(get, "min_length")
    end_id = _scalar(get, "end_id")
    min_tokens = 0 if min_tokens is None else int(min_tokens)
    if min_tokens > max_tokens:
        raise TrtkvError(f"min_tokens ({min_tokens}) is more than max_tokens ({max_tokens})", "ask for at most max_tokens (min_tokens = max_tokens ignores the end id)")
    if top_k < 0:
        raise TrtkvError(f"top_k must be >= 0, got {top_k}", "use 0 to disable top-k")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=None if seed is None else int(seed) & ((1 << 63) - 1),
        end_id=None if end_id is None else int(end_id),
        min_tokens=min_tokens,
        stop_words=_words(get, "stop_words"),
        bad_words=_words(get, "bad_words"),
    ).validate()

    def flag(name: str) -> bool:
        v = _scalar(get, name)
        return bool(v) if v is not None else False

    return ParsedRequest(
        prompt=prompt,
        params=params,
        stream=flag("stream"),
        exclude_input_in_output=flag("exclude_input_in_output"),
        return_log_probs=flag("return_log_probs"),
    )
