"""One request's state in the runtime: its tokens, how many of them are cached, its blocks and slot.

A sequence's tokens are ``prompt_ids + output_ids``. ``num_cached`` of them have K/V rows in the
cache: the first ``num_cached // block_size`` in sealed pool blocks (``block_table``), the rest in the
open block of ``slot``. Tokens past ``num_cached`` are *pending*: the next steps feed them to the
engine — many during prefill, exactly one (the last sampled token) during decode. A step whose chunk
reaches the last token yields logits, and a new token is sampled.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from trtkv.errors import TrtkvError


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SamplingParams:
    """Per-request generation parameters (TensorRT-LLM's names where they exist).

    ``temperature == 0`` or ``top_k == 1`` is greedy. ``top_k == 0`` and ``top_p == 1`` disable the
    filters. ``seed`` makes sampling reproducible per request, whatever else shares the batch.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    end_id: int | None = None  # None: the tokenizer's end-of-sequence id
    min_tokens: int = 0  # end_id and stop words are suppressed until this many tokens exist
    stop_words: list[str] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    bad_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> "SamplingParams":
        if self.max_tokens < 1:
            raise TrtkvError(f"max_tokens must be at least 1, got {self.max_tokens}", "ask for one or more new tokens")
        if self.temperature < 0:
            raise TrtkvError(f"temperature must be >= 0, got {self.temperature}", "use 0 for greedy decoding")
        if self.top_k < 0:
            raise TrtkvError(f"top_k must be >= 0, got {self.top_k}", "use 0 to disable top-k")
        if not 0 < self.top_p <= 1:
            raise TrtkvError(f"top_p must be in (0, 1], got {self.top_p}", "use 1.0 to disable top-p")
        if self.min_tokens < 0:
            raise TrtkvError(f"min_tokens must be >= 0, got {self.min_tokens}", "use 0 to allow stopping at once")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


_ids = itertools.count()


class Sequence:
    """A request inside the runtime (see the module docstring for the token bookkeeping)."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None):
        if not prompt_ids:
            raise TrtkvError("the prompt is empty", "send at least one token of text")
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_cached = 0
        self.block_table: list[int] = []
        self.slot: int | None = None
        self.block_keys: list[bytes] = []  # prefix-cache keys of its full blocks (runtime/prefix_cache.py)
        self.block_full_steps = False  # every step into its open block so far took the most tokens it could
        self.finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
        self.num_preemptions = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None

    # -- tokens
    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_cached

    @property
    def in_prefill(self) -> bool:
        return self.num_pending > 1

    def token(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        return [self.token(i) for i in range(start, end)]

    def append_token(self, token: int, logprob: float = 0.0) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_ids.append(token)
        self.logprobs.append(logprob)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.value}, tokens={self.num_tokens}, cached={self.num_cached}, "
            f"blocks={self.block_table}, slot={self.slot})"
        )
