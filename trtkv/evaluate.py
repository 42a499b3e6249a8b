"""``trtkv eval``: how much a KV format changes the model, measured against the unquantized model.

All formats run on the same held-out windows (the dataset's ``eval`` split — never the calibration
split) through ``trtkv.kv_cache.QuantizedKVCache``, which really stores the cache in the format and
dequantizes on read (write-then-read, see that module). The unquantized baseline runs through the
same code path with ``fp16`` storage (identical to plain transformers), once per batch, and its
logits are reused for every format.

Metrics, over every predicted position (``seq_len - 1`` per window):

* ``ppl``: exp(mean negative log-likelihood of the next token); ``ppl_delta_pct`` = 100 (ppl / ppl_fp16 - 1).
* ``kld_mean``: mean KL(p_fp16 || p_format) of the next-token distributions, in nats; ``kld_p99`` / ``kld_p999`` its
  99th / 99.9th percentile over positions (llama.cpp's perplexity tool reports the latter).
* error by position: ``kld_by_position`` ({bucket start: mean KL}), ``kld_p999_by_position`` and ``top1_by_position``
  over position buckets 0, 512, 1024, 2048, ... (``position_buckets``; position t predicts token t + 1 with t + 1
  tokens of context), so a long ``seq_len`` shows how the error grows with context.
* ``top1_agreement``: share of positions whose argmax equals the baseline's argmax.
* ``generation_match``: greedy decoding from ``generate_prompts`` prompts (the first 64 tokens of
  eval windows), ``generate_tokens`` new tokens each; the share of generated tokens *before the first
  divergence* from the baseline's output (1.0: identical continuations). After a divergence the two
  runs condition on different text, so later matches are not meaningful; the position-wise share over
  all positions is reported too (``generation_match_all``).
* ``bits_per_element`` / ``kv_bytes_per_token``: from the format definition at the measured context
  length (``seq_len``), scales, zero-points and the fp16 open block of sealed-block formats included;
  ``pool_bits_per_element`` is the pool alone (the long-context limit); ``tail_bytes_per_slot`` the
  fixed fp16 open-block cost of one sequence slot.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from trtkv.cache_layout import block_chunks
from trtkv.errors import TrtkvError
from trtkv.formats import KVFormat, calibration_needed, get_format
from trtkv.kv_cache import QuantizedKVCache

BASELINE = "fp16"
PROMPT_TOKENS = 64


class EvalResult(BaseModel):
    """One KV format's accuracy against the unquantized model (the perplexity task)."""

    format: str
    task: str = "ppl"
    spec: str
    bits_per_element: float  # mean at seq_len, the open block included
    pool_bits_per_element: float  # sealed blocks only: the long-context limit
    kv_bytes_per_token: float
    tail_bytes_per_slot: int = 0
    ppl: float
    ppl_delta_pct: float
    kld_mean: float
    kld_p99: float = 0.0  # 99th percentile of the per-position KL (tail of the damage)
    kld_p999: float = 0.0  # 99.9th percentile
    kld_by_position: dict[int, float] = {}  # position bucket start -> mean KL over the bucket
    kld_p999_by_position: dict[int, float] = {}  # position bucket start -> 99.9th-percentile KL over the bucket
    top1_by_position: dict[int, float] = {}  # position bucket start -> top-1 agreement over the bucket
    top1_agreement: float
    generation_match: float | None = None  # share of generated tokens before the first divergence
    generation_match_all: float | None = None  # position-wise share over all generated tokens
    windows: int = 0
    seq_len: int = 0
    tokens: int = 0  # predicted positions
    seconds: float = 0.0


# --------------------------------------------------------------------------- metrics


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of ``targets`` [...] under ``logits`` [..., V] (float32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p) per position [...], in nats, from logits [..., V]."""
    ref = torch.log_softmax(ref_logits.float(), dim=-1)
    cur = torch.log_softmax(logits.float(), dim=-1)
    return (ref.exp() * (ref - cur)).sum(-1).clamp_min(0.0)


def top1_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """1.0 where the argmax of ``logits`` equals the reference argmax, per position."""
    return (ref_logits.argmax(-1) == logits.argmax(-1)).float()


def perplexity(nll: torch.Tensor) -> float:
    return math.exp(nll.double().mean().item())


def prefix_match(ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Per row [n]: number of leading tokens of ``out`` [n, T] equal to ``ref`` [n, T]."""
    same = (ref == out).int()
    return same.cumprod(-1).sum(-1)


def quantile(x: torch.Tensor, q: float) -> float:
    """The ``q`` quantile of all of ``x`` (linear interpolation, as numpy's default), in float64; 0.0 for no values."""
    return torch.quantile(x.double().flatten(), q).item() if x.numel() else 0.0


POSITION_BUCKET = 512  # the first bucket's length; each later bucket doubles


def position_buckets(positions: int) -> list[int]:
    """Starts of the position buckets over ``positions`` predicted positions: 0, 512, 1024, 2048, ... (each bucket runs
    to the next start), so contexts of 512, 1k, 2k, 4k, 8k each have their own bucket."""
    starts, s = [0], POSITION_BUCKET
    while s < positions:
        starts.append(s)
        s *= 2
    return starts


def by_position(values: torch.Tensor, reduce: Callable[[torch.Tensor], float]) -> dict[int, float]:
    """``reduce`` of ``values`` [windows, positions] over each position bucket (``position_buckets``): {bucket start: value}."""
    starts = position_buckets(values.shape[-1])
    ends = starts[1:] + [values.shape[-1]]
    return {a: reduce(values[..., a:b]) for a, b in zip(starts, ends)}


METRIC_ROWS = 1024  # positions whose log-softmaxes are computed at once: bounds the metrics' memory at long contexts


class PositionScores:
    """One format's metrics per window and scored position [windows, positions]: NLL of the true next token, KL from the
    fp16 baseline, agreement with the baseline's top-1 and whether the top-1 is the true next token."""

    def __init__(self, windows: int, positions: int):
        self.nll, self.kld, self.agree, self.correct = (torch.zeros(windows, positions) for _ in range(4))

    def add(self, row: int, cols: slice, ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Score windows ``row ..`` at the scored positions ``cols``: logits [B, c, V] against the baseline's, targets [B, c]."""
        for b in range(logits.shape[0]):
            for a in range(0, logits.shape[1], METRIC_ROWS):
                r, q, t = (x[b, a : a + METRIC_ROWS] for x in (ref_logits, logits, targets))
                at = (row + b, slice(cols.start + a, cols.start + a + q.shape[0]))
                self.nll[at] = token_nll(q, t).cpu()
                self.kld[at] = kl_divergence(r, q).cpu()
                self.agree[at] = top1_agreement(r, q).cpu()
                self.correct[at] = (q.argmax(-1) == t).float().cpu()


@dataclass
class _Acc:
    """Per-position metrics of one format, gathered over batches."""

    nll: list[torch.Tensor]
    kld: list[torch.Tensor]
    top1: list[torch.Tensor]

    @classmethod
    def empty(cls) -> "_Acc":
        return cls([], [], [])

    def add(self, ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        for r, q, t in zip(ref_logits, logits, targets):  # one window at a time keeps memory bounded
            self.nll.append(token_nll(q, t).cpu())
            self.kld.append(kl_divergence(r, q).cpu())
            self.top1.append(top1_agreement(r, q).cpu())

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.cat(self.nll), torch.cat(self.kld), torch.cat(self.top1)


# --------------------------------------------------------------------------- running the model


def _forward(model, input_ids: torch.Tensor, cache, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of ``model`` on ``input_ids`` with ``cache`` (``cache=`` on transformers 5, else ``past_key_values=``); only at
    the chunk's positions ``keep`` (a 1-D index, possibly empty) when given."""
    import inspect

    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    extra = {} if keep is None else {"logits_to_keep": keep}
    return model(input_ids=input_ids, use_cache=True, **{key: cache}, **extra).logits


def _num_layers(model) -> int:
    return model.config.get_text_config(decoder=True).num_hidden_layers


ParamsFor = Callable[[KVFormat], Any]  # format -> list[LayerParams] | None


def _prefill(model, input_ids: torch.Tensor, cache, block_size: int | None, start: int = 0) -> torch.Tensor:
    """Logits of a prefill, chunked at sealed-block boundaries (one chunk without sealed blocks)."""
    outs = [_forward(model, input_ids[:, a - start : b - start], cache) for a, b in block_chunks(start, input_ids.shape[1], block_size)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def make_cache(model, fmt: KVFormat, params=None, num_layers: int | None = None) -> QuantizedKVCache:
    """The really-quantized cache of ``fmt`` for ``model`` (each layer's RoPE table when the format stores keys before
    RoPE)."""
    from trtkv.rope import RopeTable

    return QuantizedKVCache(fmt, num_layers or _num_layers(model), params, RopeTable.per_layer(model) if fmt.needs_rope else None)


def model_logits(model, input_ids: torch.Tensor, fmt: KVFormat | str, params=None) -> torch.Tensor:
    """Logits [B, S, V] for ``input_ids`` [B, S] with the KV cache stored in ``fmt``.

    One prefill, split at block boundaries for sealed-block formats so that every query sees its own
    block unquantized and older blocks sealed — what the paged engine computes, token for token.
    """
    fmt = get_format(fmt)
    cache = make_cache(model, fmt, params)
    return _prefill(model, input_ids, cache, fmt.block_size)


def kept_logits(model, input_ids: torch.Tensor, fmt: KVFormat, params, positions: torch.Tensor,
                advance: Callable[[int], None] | None = None):
    """Yield ``(cols, logits)`` chunk by chunk of a prefill of ``input_ids`` [B, S] with the cache in ``fmt``: the logits
    [B, c, V] at the scored ``positions`` (sorted) inside the chunk, ``cols`` the slice of ``positions`` they are.

    The chunks are ``model_logits``'s (block boundaries; ``PREFILL_CHUNK`` tokens for a format without sealed blocks, whose
    cache is the same whatever the chunks), so the numbers are the same; only the scored positions go through the
    vocabulary projection, so a long window never holds its full logits. ``advance(tokens)`` after each chunk.
    """
    cache = make_cache(model, fmt, params)
    positions = positions.to(input_ids.device)
    for a, b in block_chunks(0, input_ids.shape[1], fmt.block_size or PREFILL_CHUNK):
        lo, hi = (int(torch.searchsorted(positions, x)) for x in (a, b))
        logits = _forward(model, input_ids[:, a:b], cache, positions[lo:hi] - a)
        if advance is not None:
            advance(input_ids.shape[0] * (b - a))
        if hi > lo:
            yield slice(lo, hi), logits


PREFILL_CHUNK = 1024  # a format without sealed blocks is prefilled in chunks of this many tokens: attention reads [chunk x context]
MAX_BATCH_TOKENS = 8192  # windows in one batch hold at most this many tokens: the fp16 logits a batch keeps stay bounded


def batch_windows(batch_size: int, seq_len: int) -> int:
    """Windows per batch: ``batch_size``, fewer for long windows (at most ``MAX_BATCH_TOKENS`` tokens, at least one window)."""
    return max(1, min(batch_size, MAX_BATCH_TOKENS // max(1, seq_len)))


def score_windows(model, windows: torch.Tensor, positions: torch.Tensor, fmts: Sequence[KVFormat], params: dict,
                  *, batch_size: int = 4, advance: Callable[[int], None] | None = None,
                  on_batch: Callable[[int, int], None] | None = None, seconds: dict[str, float] | None = None) -> dict[str, PositionScores]:
    """Every format's ``PositionScores`` at the scored ``positions`` [P] (each predicts the token after it) of ``windows``
    [n, S], against ``fmts[0]`` (the fp16 baseline) on the same batch; ``params[name]``: a format's calibrated params.
    ``advance(tokens)`` after each chunk of a prefill, ``on_batch(done, total)`` after each batch of windows (all
    formats); ``seconds`` gathers each format's time."""
    n = windows.shape[0]
    positions = positions.to(windows.device)
    targets = windows[:, positions + 1]
    scores = {f.name: PositionScores(n, positions.numel()) for f in fmts}
    seconds = seconds if seconds is not None else {}
    batch = batch_windows(batch_size, windows.shape[1])
    with torch.inference_mode():
        for row in range(0, n, batch):
            ids, t = windows[row : row + batch], targets[row : row + batch]
            t0 = time.perf_counter()
            ref = None  # the baseline's logits at every scored position, filled chunk by chunk (no second copy from a cat)
            for cols, x in kept_logits(model, ids, fmts[0], params.get(fmts[0].name), positions, advance):
                ref = x.new_empty(x.shape[0], positions.numel(), x.shape[-1]) if ref is None else ref
                ref[:, cols] = x
            seconds[fmts[0].name] = seconds.get(fmts[0].name, 0.0) + time.perf_counter() - t0
            scores[fmts[0].name].add(row, slice(0, positions.numel()), ref, ref, t)
            for f in fmts[1:]:
                t0 = time.perf_counter()
                for cols, logits in kept_logits(model, ids, f, params.get(f.name), positions, advance):
                    scores[f.name].add(row, cols, ref[:, cols], logits, t[:, cols])
                seconds[f.name] = seconds.get(f.name, 0.0) + time.perf_counter() - t0
            del ref
            if on_batch is not None:
                on_batch(min(row + batch, n), n)
    return scores


def greedy_generate(model, prompts: torch.Tensor, fmt: KVFormat | str, params=None, *, new_tokens: int) -> torch.Tensor:
    """Greedy continuation [n, new_tokens] of ``prompts`` [n, P] with the KV cache stored in ``fmt``."""
    fmt = get_format(fmt)
    cache = make_cache(model, fmt, params)
    logits = _prefill(model, prompts, cache, fmt.block_size)
    out = []
    for _ in range(new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        if len(out) == new_tokens:
            break
        logits = _forward(model, nxt, cache)
    return torch.cat(out, dim=1)


def evaluate_formats(
    model,
    windows: torch.Tensor,
    formats: Sequence[KVFormat | str],
    params_for: ParamsFor | None = None,
    *,
    num_layers: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    batch_size: int = 4,
    generate_prompts: int = 4,
    generate_tokens: int = 32,
    progress: bool = False,
    on_batch: Callable[[int, int], None] | None = None,
    streamer: Any = None,
) -> list[EvalResult]:
    """Evaluate ``formats`` on token ``windows`` [n, S] against the unquantized baseline (always first in the output).

    ``params_for(fmt)`` returns the per-layer calibrated params of a format (or None); ``on_batch(done, total)``
    is called after each batch of windows (all formats). ``streamer`` (a ``trtkv.streaming.LayerStreamer`` of
    ``model``'s skeleton): the layers are streamed, every window of every format through layer i before layer i+1
    loads, with the same cache semantics and the same numbers; the generation check needs the resident model and
    is skipped.
    """
    cfg = model.config.get_text_config(decoder=True)
    num_layers = num_layers or cfg.num_hidden_layers
    num_kv_heads = num_kv_heads or cfg.num_key_value_heads
    head_dim = head_dim or getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    fmts = [get_format(f) for f in formats]
    fmts = [get_format(BASELINE)] + [f for f in fmts if f.name != BASELINE]
    params = {f.name: (params_for(f) if params_for is not None and f.is_quantized else None) for f in fmts}
    device = next(model.parameters()).device
    windows = windows.to(device)
    n, seq_len = windows.shape
    if seq_len < 2:
        raise TrtkvError(f"windows need at least 2 tokens, got {seq_len}", "pass a larger --seq-len")

    seconds = {f.name: 0.0 for f in fmts}
    positions = torch.arange(seq_len - 1, device=device)  # every position predicts the next token
    bar = _progress(progress and streamer is None, total=n * seq_len * len(fmts))
    if streamer is None:
        scores = score_windows(model, windows, positions, fmts, params, batch_size=batch_size, seconds=seconds,
                               advance=bar.advance, on_batch=on_batch)
    else:
        scores = _streamed_scores(model, streamer, windows, fmts, params, batch_size, seconds, progress)
        generate_prompts = 0
    with torch.inference_mode():
        gen = _generation_check(model, windows, fmts, params, generate_prompts, generate_tokens)
    bar.close()

    base_ppl = perplexity(scores[fmts[0].name].nll)
    results = []
    for f in fmts:
        sc = scores[f.name]
        ppl = perplexity(sc.nll)
        g = gen.get(f.name, (None, None))
        results.append(
            EvalResult(
                format=f.name,
                spec=f.spec(),
                bits_per_element=f.bits_per_element(head_dim, seq_len),
                pool_bits_per_element=f.pool_bits_per_element(head_dim),
                kv_bytes_per_token=f.kv_bytes_per_token(num_layers, num_kv_heads, head_dim, seq_len),
                tail_bytes_per_slot=f.tail_bytes_per_slot(num_layers, num_kv_heads, head_dim),
                ppl=ppl,
                ppl_delta_pct=100.0 * (ppl / base_ppl - 1.0),
                kld_mean=sc.kld.double().mean().item(),
                kld_p99=quantile(sc.kld, 0.99),
                kld_p999=quantile(sc.kld, 0.999),
                kld_by_position=by_position(sc.kld, lambda x: x.double().mean().item()),
                kld_p999_by_position=by_position(sc.kld, lambda x: quantile(x, 0.999)),
                top1_by_position=by_position(sc.agree, lambda x: x.double().mean().item()),
                top1_agreement=sc.agree.double().mean().item(),
                generation_match=g[0],
                generation_match_all=g[1],
                windows=n,
                seq_len=seq_len,
                tokens=sc.nll.numel(),
                seconds=round(seconds[f.name], 2),
            )
        )
    return results


def _mean(x: torch.Tensor) -> float:
    return x.double().mean().item() if x.numel() else 0.0


def _common(f: KVFormat, task: str, context: int, items: int, head_dim: int, sc, cols: slice, seconds: float) -> dict:
    return dict(format=f.name, spec=f.spec(), task=task, context=context, windows=items, pool_bits_per_element=f.pool_bits_per_element(head_dim),
                bits_per_element=f.bits_per_element(head_dim, context), fp16_agreement=_mean(sc.agree[:, cols]),
                kld_mean=_mean(sc.kld[:, cols]), seconds=round(seconds, 2))


def evaluate_tasks(model, sets: Sequence, fmts: Sequence[KVFormat], params: dict, *, head_dim: int, batch_size: int = 4,
                   progress: bool = False) -> list:
    """The long-context tasks (``trtkv.long_context``'s ``RecallSet`` / ``PasskeySet``): every format (``fmts[0]`` the fp16
    baseline) on each set's items, one ``RecallResult`` / ``PasskeyResult`` per format and context, format by format and
    contexts ascending within a task. ``params[name]``: a format's calibrated per-layer params (or None)."""
    from trtkv.long_context import LONG_TASKS, PasskeyResult, RecallResult, RecallSet

    device = next(model.parameters()).device
    bar = _progress(progress, total=sum(s.ids.numel() for s in sets) * len(fmts))
    rows: dict[tuple[str, str, int], Any] = {}
    try:
        for s in sets:
            task = "recall" if isinstance(s, RecallSet) else "passkey"
            bar.describe(f"{task} at {s.context} tokens")
            seconds: dict[str, float] = {}
            scores = score_windows(model, s.ids.to(device), s.positions(), fmts, params, batch_size=batch_size, advance=bar.advance,
                                   seconds=seconds)
            base = scores[fmts[0].name]
            for f in fmts:
                sc, n = scores[f.name], s.ids.shape[0]
                if isinstance(s, RecallSet):
                    first, second = slice(0, s.passage_tokens - 1), slice(s.passage_tokens - 1, None)
                    rows[task, f.name, s.context] = RecallResult(
                        **_common(f, task, s.context, n, head_dim, sc, second, seconds[f.name]), distance=s.distance,
                        passage_tokens=s.passage_tokens, recall_top1=_mean(sc.correct[:, second]),
                        fp16_recall_top1=_mean(base.correct[:, second]), second_copy_ppl=math.exp(_mean(sc.nll[:, second])),
                        first_copy_ppl=math.exp(_mean(sc.nll[:, first])))
                else:
                    passed, base_passed = sc.correct.bool().all(-1), base.correct.bool().all(-1)
                    rows[task, f.name, s.context] = PasskeyResult(
                        **_common(f, task, s.context, n, head_dim, sc, slice(None), seconds[f.name]),
                        passkey_accuracy=_mean(passed.float()), fp16_passkey_accuracy=_mean(base_passed.float()),
                        same_outcome_as_fp16=_mean((passed == base_passed).float()), depths=list(s.depths), passed=passed.tolist())
    finally:
        bar.close()
    order = {f.name: i for i, f in enumerate(fmts)}
    return [rows[k] for k in sorted(rows, key=lambda k: (LONG_TASKS.index(k[0]), order[k[1]], k[2]))]


def _streamed_scores(model, streamer, windows: torch.Tensor, fmts: Sequence[KVFormat], params: dict, batch_size: int,
                     seconds: dict[str, float], progress: bool) -> dict[str, PositionScores]:
    """``score_windows`` of a streamed model: every format's windows through the streamed layers, then scored batch by batch."""
    logits_of = _streamed_logits(model, streamer, windows, fmts, params, batch_size, seconds, progress)
    n, seq_len = windows.shape
    scores = {f.name: PositionScores(n, seq_len - 1) for f in fmts}
    cols = slice(0, seq_len - 1)
    with torch.inference_mode():
        for row in range(0, n, batch_size):
            ids = windows[row : row + batch_size]
            ref = logits_of(fmts[0], row, ids)[:, :-1]
            for f in fmts:
                logits = ref if f is fmts[0] else logits_of(f, row, ids)[:, :-1]
                scores[f.name].add(row, cols, ref, logits, ids[:, 1:])
    return scores


def _streamed_logits(model, streamer, windows: torch.Tensor, fmts: Sequence[KVFormat], params: dict, batch_size: int,
                     seconds: dict[str, float], progress: bool) -> Callable[[KVFormat, int, torch.Tensor], torch.Tensor]:
    """Run every format's windows through the streamed layers now; return ``(fmt, start, ids) -> logits`` of a batch.

    Each (format, batch) has the quantized cache ``model_logits`` would make and the same block-boundary chunks, every
    chunk one job in order (trtkv.streaming), so each layer's cache sees the chunks in the resident order.
    """
    from rich.console import Console

    from trtkv.streaming import Job, LengthCache, final_logits, record, stream_layers

    console = Console(stderr=True, quiet=not progress, soft_wrap=True)
    num_layers = streamer.num_layers
    jobs: dict[tuple[str, int], list[Job]] = {}
    for f in fmts:
        for start in range(0, windows.shape[0], batch_size):
            ids = windows[start : start + batch_size]
            cache, lengths = make_cache(model, f, params[f.name], num_layers), LengthCache(num_layers)
            jobs[f.name, start] = [Job(ids[:, a:b], cache, lengths, tag=f.name) for a, b in block_chunks(0, ids.shape[1], f.block_size)]
    every = [j for js in jobs.values() for j in js]
    with torch.inference_mode():
        record(model, every)
        stream_layers(streamer, every, release_cache_layer=True,
                      progress=lambda line: console.print(f"  evaluating {line}", highlight=False))
        streamer.materialize_outside_layers()  # the vocabulary projection, for the logits
    for j in every:
        seconds[j.tag] += j.seconds

    def logits_of(f: KVFormat, start: int, ids: torch.Tensor) -> torch.Tensor:
        chunks = jobs.pop((f.name, start))  # each batch's hidden states are freed once scored
        return torch.cat([final_logits(model, j) for j in chunks], dim=1)

    return logits_of


def _generation_check(model, windows, fmts, params, prompts: int, new_tokens: int) -> dict[str, tuple[float, float]]:
    if prompts <= 0 or new_tokens <= 0:
        return {}
    p = windows[:prompts, : min(PROMPT_TOKENS, windows.shape[1])]
    ref = greedy_generate(model, p, fmts[0], None, new_tokens=new_tokens)
    out = {fmts[0].name: (1.0, 1.0)}
    for f in fmts[1:]:
        gen = greedy_generate(model, p, f, params[f.name], new_tokens=new_tokens)
        out[f.name] = (
            prefix_match(ref, gen).double().mean().item() / new_tokens,
            (ref == gen).double().mean().item(),
        )
    return out


class _progress:
    """A rich progress bar on stderr over tokens prefilled, with the elapsed time and an estimate of the time left; or nothing."""

    def __init__(self, enabled: bool, total: int, description: str = "evaluating"):
        self._p = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._p = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                               TextColumn("left"), TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            self._p.start()
            self._task = self._p.add_task(description, total=total)

    def advance(self, amount: int = 1) -> None:
        if self._p is not None:
            self._p.advance(self._task, amount)

    def describe(self, description: str) -> None:
        if self._p is not None:
            self._p.update(self._task, description=description)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()


# --------------------------------------------------------------------------- the command


DEFAULT_FORMATS = ("fp16", "int8", "int4")  # evaluated when no --kv is given
DEFAULT_WINDOWS = 64  # --windows of the perplexity task when not given
DEFAULT_MODEL = "smollm2-135m"


def model_from_calibration(artifact) -> str:
    """The ``--model`` a calibration artifact was made with: its spec when that still resolves, else its source path."""
    from trtkv.models import resolve_model

    m = artifact.recipe.model
    try:
        resolve_model(m.name)
        return m.name
    except TrtkvError:
        if m.source and Path(m.source).exists():
            return m.source
        raise TrtkvError(
            f"calibration {artifact.path} was made for the model {m.name} ({m.source}), which is not found here",
            "pass --model PATH to the same model",
        ) from None


def run_eval(
    model: str | None,
    dataset: str,
    formats: list[str] | None,
    *,
    calibration: Path | None = None,
    windows: int | None = None,
    seq_len: int = 512,
    seed: int = 0,
    device: str = "auto",
    dtype: str = "auto",
    text_field: str = "text",
    batch_size: int = 4,
    generate_prompts: int = 4,
    generate_tokens: int = 32,
    progress: bool = True,
    tokenizer: str | Path | None = None,
    allow_other_model: bool = False,
    meta: dict | None = None,
    stream: str = "auto",
    tasks: Sequence[str] | None = None,
    contexts: Sequence[int] | None = None,
    passage_tokens: int | None = None,
) -> list:
    """Load ``model``, take ``windows`` eval-split windows of ``dataset`` and evaluate ``formats`` (fp16 baseline first).

    ``tasks`` (default ``["ppl"]``): ``ppl`` is the perplexity run over ``windows`` windows of ``seq_len`` tokens
    (``EvalResult`` rows, with the error by position); ``recall`` and ``passkey`` (``trtkv.long_context``) run
    ``windows`` items (default ``long_context.DEFAULT_ITEMS``) at each of ``contexts`` tokens (``TaskResult`` rows). The
    long-context tasks need the resident model (no layer streaming).

    ``model`` None: the calibration's model (else ``DEFAULT_MODEL``). ``formats`` None: ``DEFAULT_FORMATS``,
    skipping those that cannot fit the model's head_dim. Presets are fitted to the head_dim
    (``trtkv.formats.fit_formats``). Everything knowable without the weights (formats, calibration,
    tokenizer, number of windows) is checked before the weights are loaded. ``meta``, when given, is
    filled with what identifies the run (model and its sha256, dataset, calibration and its hash, ...).
    ``stream`` (auto | always | never): layer streaming (trtkv.streaming, the same numbers; no generation check) when
    the memory plan says the resident model does not fit, always, or never; refused before any weights are read when
    neither fits.
    """
    from trtkv import __version__
    from trtkv import long_context as lc
    from trtkv.data import adds_bos, describe_dataset, token_windows
    from trtkv.formats import fit_formats
    from trtkv.models import load_tokenizer, model_info, resolve_device, resolve_dtype

    tasks = lc.check_tasks(tasks)
    long_tasks = [t for t in tasks if t in lc.LONG_TASKS]
    if contexts and not long_tasks:
        raise TrtkvError("--context sets the windows of --task recall / passkey", "use --seq-len for the perplexity task, or add --task recall")
    if passage_tokens is not None and "recall" not in tasks:
        raise TrtkvError("--passage-tokens sets the recall task's passage", "add --task recall, or drop --passage-tokens")
    if long_tasks and stream == "always":
        raise TrtkvError(f"--task {long_tasks[0]} needs the resident model, and --stream always streams its layers",
                         "drop --stream always, or run --task ppl alone")
    if windows is not None and (not isinstance(windows, int) or windows < 1):
        raise TrtkvError(f"--windows must be a positive integer, got {windows!r}", "pass e.g. --windows 8")
    specs = list(formats) if formats else list(DEFAULT_FORMATS)
    artifact = None
    if calibration is not None:  # also supplies clip ratios of dynamic formats calibrated with --method mse
        from trtkv.artifacts import load_calibration

        artifact = load_calibration(calibration)
        specs = [artifact.definition(s) for s in specs]  # names of the artifact's formats (e.g. a --budget choice)
    parsed = [get_format(f) for f in specs]  # validate before loading anything
    skipped = []
    if not formats and calibration is None:  # defaults: leave out what needs a calibration, and say so
        skipped = [f"skipped {f.name}: it needs --calibration DIR" for f in parsed if f.needs_calibration]
        specs = [s for s, f in zip(specs, parsed) if not f.needs_calibration]
        parsed = [f for f in parsed if not f.needs_calibration]
    needs = [f for f in parsed if f.needs_calibration]
    if needs and calibration is None:
        raise calibration_needed(needs, model)
    if model is None:
        model = model_from_calibration(artifact) if artifact is not None else DEFAULT_MODEL
    info0 = model_info(model)
    fmts, notes = fit_formats(specs, info0.head_dim, optional=not formats)
    notes = skipped + notes
    if artifact is not None:
        for f in fmts:  # fail before the long run, not in the middle of it
            if f.is_quantized:
                artifact.params_for(f, info0, allow_other_model=allow_other_model)
    if long_tasks:
        contexts = lc.check_contexts(list(contexts or lc.DEFAULT_CONTEXTS), info0.max_position_embeddings, info0.name)
    dev = resolve_device(device)
    resolve_dtype(dtype, dev)
    tok = load_tokenizer(model, tokenizer)
    ids = None
    if "ppl" in tasks:
        ids = token_windows(tok, dataset, seq_len=seq_len, samples=windows or DEFAULT_WINDOWS, seed=seed, split="eval",
                            text_field=text_field, samples_flag="--windows")
    items = windows or lc.DEFAULT_ITEMS
    sets = lc.task_sets(tok, dataset, long_tasks, contexts or [], items=items, seed=seed, text_field=text_field,
                        passage_tokens=passage_tokens or lc.PASSAGE_TOKENS)
    from rich.console import Console

    if progress:
        for note in notes:
            Console(stderr=True, soft_wrap=True).print(f"note: {note}", highlight=False)

    shape = tuple(ids.shape) if ids is not None else (items, max(contexts))
    loaded = _load(model, info0, tok, shape, len(fmts), device=device, dtype=dtype, batch_size=batch_size,
                   stream="never" if long_tasks else stream, console=Console(stderr=True, quiet=not progress, soft_wrap=True),
                   long_context=max(contexts) if long_tasks else 0)
    if loaded.streamer is not None and generate_prompts > 0:
        notes.append("gen % skipped: the generation check needs the resident model (this run streamed its layers)")
        if progress:
            Console(stderr=True, soft_wrap=True).print(f"note: {notes[-1]}", highlight=False)
        generate_prompts = 0
    info = loaded.info
    params_for = (lambda f: artifact.params_for(f, info, allow_other_model=allow_other_model)) if artifact is not None else None
    if meta is not None:
        import transformers

        from trtkv.artifacts import calibration_sha256

        ds = describe_dataset(dataset, text_field)
        meta.update(
            model=info.name, model_source=info.source, model_sha256=info.sha256, architecture=info.architecture,
            model_shape={"num_layers": info.num_layers, "num_kv_heads": info.num_kv_heads, "head_dim": info.head_dim},
            dataset=dataset, dataset_sha256=ds.get("sha256"), text_field=text_field, split="eval",
            calibration=None if artifact is None else str(artifact.path),
            calibration_sha256=None if artifact is None else calibration_sha256(artifact.path),
            tasks=tasks, seq_len=seq_len if ids is not None else None, windows=int(ids.shape[0]) if ids is not None else None,
            contexts=contexts or None, items_per_context=items if long_tasks else None,
            passage_tokens=(passage_tokens or lc.PASSAGE_TOKENS) if "recall" in tasks else None,
            windows_start_with_bos=adds_bos(tok), seed=seed, device=str(loaded.device),
            dtype=str(loaded.dtype).replace("torch.", ""), batch_size=batch_size, streamed=loaded.streamer is not None,
            generate_prompts=generate_prompts, generate_tokens=generate_tokens,
            formats={f.name: f.spec() for f in fmts}, notes=notes, allow_other_model=allow_other_model,
            trtkv_version=__version__, torch_version=torch.__version__, transformers_version=transformers.__version__,
        )
    results: list = []
    if ids is not None:
        results += evaluate_formats(
            loaded.model,
            ids,
            fmts,
            params_for,
            num_layers=info.num_layers,
            num_kv_heads=info.num_kv_heads,
            head_dim=info.head_dim,
            batch_size=batch_size,
            generate_prompts=generate_prompts,
            generate_tokens=generate_tokens,
            progress=progress,
            streamer=loaded.streamer,
        )
    if sets:
        base = [get_format(BASELINE)] + [f for f in fmts if f.name != BASELINE]
        params = {f.name: (params_for(f) if params_for is not None and f.is_quantized else None) for f in base}
        rows = evaluate_tasks(loaded.model, sets, base, params, head_dim=info.head_dim, batch_size=batch_size, progress=progress)
        results += rows
        notes += lc.weak_baseline_notes(rows, info.name)
        if progress:
            for note in lc.weak_baseline_notes(rows, info.name):
                Console(stderr=True, soft_wrap=True).print(f"note: {note}", highlight=False)
    return results


def _load(model: str, info, tok, windows: tuple[int, int], n_formats: int, *, device: str, dtype: str, batch_size: int,
          stream: str, console, long_context: int = 0) -> Any:
    """The model as the memory plan says (``trtkv.streaming.load_planned``) for eval's working set: every format's
    windows, the reference cache and the logits; for the long-context tasks (``long_context`` tokens) one prefill chunk
    over the whole context and the scored positions' logits."""
    from trtkv.memory import activation_bytes
    from trtkv.streaming import load_planned

    n, seq_len = windows
    f32 = 4
    batch = min(batch_windows(batch_size, seq_len), n)
    cache = batch * seq_len * info.num_layers * info.num_kv_heads * info.head_dim * 2 * f32  # the fp16 run's cache, model dtype
    if long_context:
        chunk = min(seq_len, PREFILL_CHUNK)
        scores = 3 * batch * 2 * PREFILL_CHUNK * info.vocab_size * f32  # generous: the scored positions' logits, twice, and a log-softmax
        acts = activation_bytes(info, batch=batch, seq_len=chunk, context=seq_len, dtype=torch.float32, logits=False) + cache + scores
        return load_planned(model, info, tok, command="eval", windows=(n, seq_len), activations=acts, device=device, dtype=dtype,
                            stream=stream, can_stream=False, console=console)
    held = n_formats * n * seq_len * info.hidden_size * f32  # every format's windows between two streamed layers
    scores = 3 * batch * seq_len * info.vocab_size * f32  # the reference and a format's logits, and a log-softmax
    acts = activation_bytes(info, batch=batch, seq_len=seq_len, dtype=torch.float32, logits=True) + held + cache + scores
    return load_planned(model, info, tok, command="eval", windows=(n, seq_len), activations=acts, device=device, dtype=dtype,
                        stream=stream, can_stream=True, console=console)


# --------------------------------------------------------------------------- output


def table_rows(results: Sequence[EvalResult], title: str | None = None):
    """``(title, columns, rows)`` of the results table: short headers, numbers as full strings."""
    from trtkv.tables import Column

    if results:
        r0 = results[0]
        title = title or f"KV cache accuracy ({r0.windows} windows x {r0.seq_len} tokens, eval split)"
    # KV bytes per token stay in the JSON; the two bits columns say the same per element and keep 80 columns
    columns = [Column("format", numeric=False), Column("pool bits"), Column("bits@ctx"), Column("ppl"),
               Column("Δppl %"), Column("KL"), Column("top-1 %"), Column("gen %")]
    rows = []
    for r in results:
        rows.append([
            r.format,
            f"{r.pool_bits_per_element:.4g}",
            f"{r.bits_per_element:.4g}",
            f"{r.ppl:.4f}",
            f"{r.ppl_delta_pct:+.3f}",
            f"{r.kld_mean:.5f}",
            f"{100 * r.top1_agreement:.2f}",
            "-" if r.generation_match is None else f"{100 * r.generation_match:.1f}",
        ])
    return title, columns, rows


def position_table_rows(results: Sequence) -> tuple[str, list, list]:
    """``(title, columns, rows)`` of the perplexity task's error by position: one row per format and position bucket."""
    from trtkv.tables import Column

    rs = [r for r in results if isinstance(r, EvalResult) and r.kld_by_position]
    title = f"Error by position ({rs[0].windows} windows x {rs[0].seq_len} tokens)" if rs else "Error by position"
    columns = [Column("format", numeric=False), Column("positions", numeric=False), Column("KL mean"), Column("KL p99.9"), Column("top-1 %")]
    rows = []
    for r in rs:
        starts = sorted(r.kld_by_position)
        for a, b in zip(starts, starts[1:] + [r.seq_len - 1]):
            rows.append([r.format, f"{a}-{b - 1}", f"{r.kld_by_position[a]:.5f}", f"{r.kld_p999_by_position.get(a, 0.0):.4f}",
                         f"{100 * r.top1_by_position.get(a, 0.0):.2f}"])
        rows.append([r.format, "all", f"{r.kld_mean:.5f}", f"{r.kld_p999:.4f}", f"{100 * r.top1_agreement:.2f}"])
    return title, columns, rows


def render_table(results: Sequence[EvalResult], title: str | None = None):
    """A rich Table of the results (one row per format); text cells fold, numbers keep their width (see trtkv.tables)."""
    from trtkv.tables import rich_table

    title, columns, rows = table_rows(results, title)
    return rich_table(columns, rows, title)


def render_markdown(results: Sequence[EvalResult], title: str | None = None) -> str:
    """The results table as Markdown."""
    from trtkv.tables import markdown

    title, columns, rows = table_rows(results, title)
    return markdown(columns, rows, title)


def results_to_dict(results: Sequence[EvalResult], meta: dict | None = None) -> dict:
    return {"meta": meta or {}, "results": [r.model_dump() for r in results]}


def write_json(results: Sequence[EvalResult], path: Path | str, meta: dict | None = None) -> Path:
    """Write the results (and optional metadata) as JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results_to_dict(results, meta), indent=2) + "\n")
    return path
