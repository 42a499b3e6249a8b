"""The offline runtime: tokenizer + scheduler + engine steps + cache writes + sampling, one ``step()`` at a time.

    engine = LLMEngine.from_engine_dir("trtkv-out/engine-int4", RuntimeConfig(kv_memory_gib=0.25))
    for out in engine.generate(["def fib(n):"], SamplingParams(max_tokens=32, temperature=0)):
        print(out.text)

Each ``step()`` asks the scheduler for the next batch, runs the prefill chunks and the decodes as two
engine calls (``[B, T]`` padded, and ``[B, 1]``), writes every sequence's new K/V rows into its open
block (sealing full blocks, ``PagedKVCache.write_new_rows``), samples a token for every sequence
whose chunk reached its last token, and returns what changed per request. Not thread-safe: the
server drives it from one loop thread (``trtkv.runtime.engine_loop``).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from trtkv.cache_layout import WindowRing
from trtkv.errors import TrtkvError
from trtkv.manifest import accepts_any_shape
from trtkv.models import FULL_ATTENTION, SLIDING_ATTENTION
from trtkv.runtime.block_manager import GIB, BlockManager, CacheBudget
from trtkv.runtime.config import RuntimeConfig
from trtkv.runtime.prefix_cache import PrefixCache
from trtkv.runtime.sampler import Sampler, make_generator
from trtkv.runtime.scheduler import Chunk, Scheduler, SchedulerOutput
from trtkv.runtime.sequence import SamplingParams, Sequence
from trtkv.runtime.swap import Swapper


@dataclass
class RequestOutput:
    """What one ``step()`` changed for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str  # text that became final in this step
    text: str  # all new text so far
    finished: bool
    finish_reason: str | None = None
    new_logprobs: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    error: str | None = None


class _Detok:
    """Incremental detokenization: emit text only once it no longer ends in a partial character."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.text = ""

    def update(self, output_ids: list[int], final: bool) -> str:
        full = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        if not final and full.endswith("\ufffd"):
            return ""
        new = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = full if full.startswith(self.text) else self.text
        return new


class _Request:
    def __init__(self, seq: Sequence, detok: _Detok, banned: list[int], end_ids: list[int], generator: torch.Generator, bad_seqs=()):
        self.seq = seq
        self.detok = detok
        self.banned = banned
        self.bad_seqs: list[list[int]] = list(bad_seqs)  # multi-token bad words: the last token is banned after the others
        self.end_ids = end_ids
        self.generator = generator
        self.emitted_tokens = 0
        self.sent_chars = 0  # characters of detok.text already returned as new_text


class LLMEngine:
    def __init__(self, engine, manifest, cache, tokenizer, config: RuntimeConfig, budget: CacheBudget):
        self.engine = engine
        self.manifest = manifest
        self.cache = cache
        self.tokenizer = tokenizer
        self.config = config
        self.budget = budget
        lim = manifest.limits
        self.max_batch = budget.num_slots if accepts_any_shape(engine.name) else lim.max_batch
        # a window ring frees the sliding layers' blocks a prefix hit would need: no prefix caching with one
        self.prefix_caching = config.enable_prefix_caching and cache.ring is None
        prefix = PrefixCache(lim.block_size, prefix_salt(manifest, engine.name), cache) if self.prefix_caching else None
        self.block_manager = BlockManager(budget.num_blocks, budget.num_slots, lim.block_size, prefix)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=budget.num_slots,
            max_num_batched_tokens=config.max_batched_tokens,
            max_step_tokens=lim.max_new_tokens_per_step,
            max_model_len=lim.max_seq_len,
            # an engine that seals blocks inside a step takes a prompt in chunks of the token budget, not of a block;
            # not in the deterministic mode, where every prefill chunk is one whole block (or a prompt's last part)
            cross_blocks=engine.cross_blocks and cache.ring is None and not config.deterministic,
            whole_blocks=config.deterministic,
        )
        self.scheduler.swapper = Swapper(cache)  # preemption never changes an output (runtime/swap.py)
        self.sampler = Sampler()
        self.requests: dict[str, _Request] = {}
        # a CPU torch engine sets its torch threads per step (RuntimeConfig.step_threads); other engines keep theirs
        self.cores = usable_cores() if engine.runs_torch_on_cpu else None
        self.pads_prefill = self.cores is not None and engine.cross_blocks
        self.eos_ids = list(manifest.model.eos_token_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        self.stats_counters = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0, "finished": 0, "rejected": 0, "aborted": 0, "peak_running": 0}
        self._reject_lock = threading.Lock()  # make_sequence runs on the server's request threads

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_engine_dir(cls, engine_dir: str | Path, config: RuntimeConfig | None = None) -> "LLMEngine":
        from transformers import AutoTokenizer

        from trtkv.manifest import TOKENIZER_DIR, load_manifest
        from trtkv.runtime.backends import open_engine
        from trtkv.runtime.kv_pool import PagedKVCache

        config = config or RuntimeConfig()
        engine_dir = Path(engine_dir)
        manifest = load_manifest(engine_dir)  # the one load in this process; the engine and the cache get the object
        kw = {}
        if config.backend == "torch" or (config.backend == "auto" and manifest.backend == "torch"):
            # the torch engine plans its weights with the KV budget before it reads them (torch_engine.load_plan);
            # on CUDA without --kv-memory the pool takes what --reserve leaves once the weights are loaded: not counted
            dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            kw["kv_bytes"] = resolve_kv_budget(config, dev) if (dev.type == "cpu" or config.kv_memory_gib is not None) else 0
            kw["attention"] = config.attention
        elif config.attention != "auto":
            raise TrtkvError(f"--attention {config.attention} chooses the torch engine's attention; this engine runs {manifest.backend}'s network",
                             "leave --attention at auto, or build the engine with --backend torch")
        engine = open_engine(engine_dir, config.backend, manifest=manifest, **kw)
        if engine.name == "onnxruntime":
            # The runtime's own torch work (sealing blocks, sampling) is small; on one thread it does not
            # wake an OpenMP pool that competes with ONNX Runtime's threads (measured: 40 ms -> 4 us per seal matmul).
            torch.set_num_threads(1)
        budget = plan_budget(manifest, config, engine.device, engine.name)
        cache = PagedKVCache.for_engine(manifest, engine_dir, budget.num_blocks, budget.num_slots, device=engine.device, backend=engine.name,
                                        ring=window_ring(manifest, config, engine.name), attention=engine.attention_backend)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(engine_dir / TOKENIZER_DIR), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise TrtkvError(f"cannot load the tokenizer in {engine_dir / TOKENIZER_DIR}: {exc}", "rebuild the engine") from None
        return cls(engine, manifest, cache, tokenizer, config, budget)

    # ------------------------------------------------------------------ requests
    def make_sequence(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Tokenize and validate a request (thread-safe: reads only constants); raises TrtkvError to reject it."""
        try:
            params.validate()
            # a text prompt gets the special tokens the tokenizer adds (BOS when it adds one): tokenizer(prompt).input_ids
            ids = list(self.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
            if not ids:
                raise TrtkvError("the prompt encodes to no tokens", "send a non-empty prompt")
            vocab = self.manifest.model.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise TrtkvError(f"prompt token ids must be in [0, {vocab})", "use the engine's tokenizer")
            if params.end_id is not None and not 0 <= params.end_id < vocab:
                raise TrtkvError(f"end_id {params.end_id} is not a token id of this model (0 ... {vocab - 1})", "leave end_id out for the model's own end token")
            seq = Sequence(ids, params, request_id)
            self.scheduler.check(seq)
        except TrtkvError:
            with self._reject_lock:
                self.stats_counters["rejected"] += 1
            raise
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        p = seq.params
        end_ids = [] if p.ignore_eos else ([p.end_id] if p.end_id is not None else list(self.eos_ids))
        bad_seqs = self.bad_word_sequences(p.bad_words)
        banned = sorted({*p.bad_token_ids, *(s[0] for s in bad_seqs if len(s) == 1)})
        if seq.request_id in self.requests:
            raise TrtkvError(f"request id {seq.request_id!r} is already running", "use unique request ids")
        self.scheduler.add(seq)
        self.requests[seq.request_id] = _Request(
            seq, _Detok(self.tokenizer, seq.prompt_ids), banned, end_ids, make_generator(p.seed), [s for s in bad_seqs if len(s) > 1]
        )
        self.stats_counters["prompt_tokens"] += len(seq.prompt_ids)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        seq = self.make_sequence(prompt, params, request_id)
        self.add_sequence(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(req.seq)
        self.stats_counters["aborted"] += 1
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def bad_word_sequences(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, as written and (unless it starts with a space) after a space."""
        out: list[list[int]] = []
        for w in words:
            for variant in (w,) if w.startswith(" ") else (w, " " + w):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.empty:
            return []
        self.stats_counters["steps"] += 1
        self.stats_counters["peak_running"] = max(self.stats_counters["peak_running"], len(self.scheduler.running))
        logits: dict[int, torch.Tensor] = {}
        # deterministic: one engine call per chunk, so a sequence's numbers never depend on what else is in the step
        per_call = 1 if self.config.deterministic else self.max_batch
        for batch in padded_batches(out.prefill, per_call):
            logits.update(self._run(batch, prefill=True))
        for batch in padded_batches(out.decode, per_call):
            logits.update(self._run(batch))
        self.scheduler.postprocess(out)
        return self._sample(out, logits)

    def _run(self, chunks: list[Chunk], prefill: bool = False) -> dict[int, torch.Tensor]:
        from trtkv.runtime.step import StepBatch

        rows = [c.seq.tokens(c.start, c.start + c.length) for c in chunks]
        # a prefill call of the CPU torch engine has MIN_PREFILL_ROWS rows at least (padding): its matrix products then
        # give each row the bits it gets inside any larger call, so a chunk's numbers do not depend on its length
        min_len = -(-MIN_PREFILL_ROWS // len(rows)) if prefill and self.pads_prefill else 1
        batch = StepBatch.make(rows=rows, context_lens=[c.start for c in chunks], block_tables=[c.seq.block_table for c in chunks],
                               slot_ids=[c.seq.slot for c in chunks], min_len=min_len)
        if self.cores is not None:
            threads = self.config.step_threads(self.cores)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        result = self.engine.step(batch, self.cache)
        self.cache.write_new_rows(batch, result)
        logits = result.logits
        if logits.dim() == 3:  # all-logits build: take each row's last valid token
            logits = logits[torch.arange(len(chunks)), batch.new_lens - 1]
        return {c.seq.seq_id: logits[i] for i, c in enumerate(chunks) if c.samples}

    def _sample(self, out: SchedulerOutput, logits: dict[int, torch.Tensor]) -> list[RequestOutput]:
        chunks = [c for c in out.prefill + out.decode if c.seq.seq_id in logits]
        if not chunks:
            return []
        reqs = [self.requests[c.seq.request_id] for c in chunks]
        banned = []
        for r in reqs:
            ban = list(r.banned) + bad_word_bans(r.seq, r.bad_seqs)
            if len(r.seq.output_ids) < r.seq.params.min_tokens:
                ban += r.end_ids
            banned.append(ban)
        stacked = torch.stack([logits[c.seq.seq_id].float().cpu() for c in chunks])
        tokens, logprobs = self.sampler(stacked, [r.seq.params for r in reqs], [r.generator for r in reqs], banned)
        results = []
        for r, tok, lp in zip(reqs, tokens, logprobs):
            results.append(self._advance(r, tok, lp))
        return results

    def _advance(self, r: _Request, token: int, logprob: float) -> RequestOutput:
        seq, p = r.seq, r.seq.params
        reason = None
        if token in r.end_ids:
            reason = "stop"
        else:
            seq.append_token(token, logprob)
            self.stats_counters["generated_tokens"] += 1
        if reason is None and len(seq.output_ids) >= p.max_tokens:
            reason = "length"
        if reason is None and token in p.stop_token_ids:
            reason = "stop"
        fresh = r.detok.update(seq.output_ids, final=reason is not None)
        if p.stop_words and len(seq.output_ids) >= p.min_tokens:
            cut = _find_stop(r.detok.text, p.stop_words, len(r.detok.text) - len(fresh))
            if cut is not None:
                r.detok.text = r.detok.text[:cut]
                reason = "stop"
        # streamed text never has to be taken back: the end of the text that could still become a stop word is
        # held until the next step tells (vLLM does the same)
        text = r.detok.text
        end = len(text) if reason is not None else len(text) - _stop_prefix_len(text, p.stop_words)
        new_text = text[r.sent_chars : end]
        r.sent_chars = max(r.sent_chars, end)
        new_ids = seq.output_ids[r.emitted_tokens :]
        new_lps = seq.logprobs[r.emitted_tokens :]
        r.emitted_tokens = len(seq.output_ids)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self.requests.pop(seq.request_id, None)
            self.stats_counters["finished"] += 1
        return RequestOutput(
            seq.request_id, new_ids, new_text, r.detok.text, reason is not None, reason, new_lps, len(seq.prompt_ids)
        )

    # ------------------------------------------------------------------ offline use
    def generate(
        self,
        prompts: Iterable[str | list[int]],
        params: SamplingParams | list[SamplingParams],
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); returns the final output of each, in order."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(pr, pa) for pr, pa in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        ids: dict[str, list[int]] = {s.request_id: [] for s in seqs}
        while self.has_work():
            for o in self.step():
                ids[o.request_id] += o.new_token_ids
                if on_output is not None:
                    on_output(o)
                if o.finished:
                    final[o.request_id] = o
        for s in seqs:
            final[s.request_id].new_token_ids = ids[s.request_id]
        return [final[s.request_id] for s in seqs]

    # ------------------------------------------------------------------ status
    def layer_type_bytes(self) -> dict[str, int]:
        """KV bytes the running sequences hold, per layer type (``kv_bytes_used_<type>``): the sealed blocks (a global
        layer: its used pool blocks; a ringed sliding layer: the ring blocks its window still covers) and the used
        slots' open blocks."""
        cache, ring = self.cache, self.cache.ring
        lay = cache.layout
        per_slot = lay.tail_bytes_per_slot()
        running = [s for s in self.scheduler.running if s.slot is not None]
        in_window = 0 if ring is None else sum(s.num_cached // lay.block_size - int(ring.first_block(s.num_cached)) for s in running)
        types = tuple(getattr(self.manifest.model, "layer_types", ()) or ())
        out = {f"kv_bytes_used_{t}": 0 for t in (FULL_ATTENTION, SLIDING_ATTENTION)}
        for layer in range(cache.num_layers):
            blocks = in_window if cache.is_ringed(layer) else self.block_manager.num_used_blocks
            out[f"kv_bytes_used_{types[layer] if types else FULL_ATTENTION}"] += blocks * lay.layer(layer).bytes_per_block() + len(running) * per_slot
        return out

    def describe_cache(self) -> str:
        """The budget's split, and the window ring when the sliding layers free their blocks (the server's start line)."""
        ring = self.cache.ring
        if ring is None:
            return self.budget.describe()
        return (f"{self.budget.describe()}; sliding layers ({len(ring.layers)} of {self.cache.num_layers}, window {ring.window}) keep a ring "
                f"of {ring.ring_blocks} blocks per slot, prefix caching {'on' if self.prefix_caching else 'off'}")

    def describe_engine(self) -> str:
        """How the engine runs (the server's start line): backend, device, attention, forward, steps, CPU threads."""
        parts = [self.engine.describe()]
        if self.scheduler.cross_blocks:
            parts.append("steps across blocks")
        if self.cores is not None:
            parts.append(f"threads {self.config.step_threads(self.cores)}")
        return ", ".join(parts)

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "kv_format": self.manifest.kv_spec,
            "kv_format_name": self.manifest.kv_format.name,
            "block_size": bm.block_size,
            "blocks_total": bm.num_blocks,
            "blocks_used": bm.num_used_blocks,
            "blocks_free": len(bm.free_blocks),
            "blocks_cached": bm.num_cached_blocks,  # sealed, held by no sequence, kept for prefix hits until evicted
            "prefix_hit_tokens": 0 if bm.prefix is None else bm.prefix.hit_tokens,
            "prefix_hit_rate": (bm.prefix.hit_tokens / self.stats_counters["prompt_tokens"]) if bm.prefix and self.stats_counters["prompt_tokens"] else 0.0,
            "blocks_evicted": 0 if bm.prefix is None else bm.prefix.evicted,
            "slots_total": bm.num_slots,
            "slots_used": bm.num_slots - bm.num_free_slots,
            "bytes_per_block": self.budget.bytes_per_block,
            "bytes_per_slot": self.budget.bytes_per_slot,
            **self.layer_type_bytes(),
            "prefix_caching": self.prefix_caching,
            "kv_budget_bytes": self.budget.budget_bytes,
            "pool_tokens": self.budget.pool_tokens,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            **self.stats_counters,
        }


# Measured with torch 2.13's MKL (AVX-512): a row of a float32 matrix product over 1, 2, 3, 5, 6, 7, 9, 10 or 11 rows
# differs in its last bits from the same row inside a larger product (MKL's small-matrix kernels); from 12 rows on (and
# at 4 and 8) it is the same. Prefill calls are padded to this many rows (bench/results/deterministic.md).
MIN_PREFILL_ROWS = 16
PAD_LIMIT = 1.25  # a prefill batch is padded to its longest chunk: at most this many computed rows per real token


def padded_batches(chunks: list[Chunk], max_batch: int) -> list[list[Chunk]]:
    """The engine calls of a step's chunks: at most ``max_batch`` each, longest first, a new call whenever padding every
    chunk to the call's longest would compute more than ``PAD_LIMIT`` rows per real token (a 2-token rest beside a
    500-token chunk would double the step's work); chunks of one length (decodes, equal prefill chunks) share a call."""
    out: list[list[Chunk]] = []
    for c in sorted(chunks, key=lambda c: -c.length):
        cur = out[-1] if out else None
        if cur and len(cur) < max_batch and (len(cur) + 1) * cur[0].length <= PAD_LIMIT * (sum(x.length for x in cur) + c.length):
            cur.append(c)
        else:
            out.append([c])
    return out


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container's cpuset sets)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def prefix_salt(manifest, engine_name: str) -> str:
    """What besides the tokens makes a sealed block's bytes reproducible: the engine backend (its manifest names the
    model, weights and calibration constants), the KV format (sink tokens included) and the block size."""
    dump = getattr(manifest, "model_dump_json", None)
    ident = dump() if dump is not None else repr(getattr(manifest, "model", None))
    return f"{engine_name}|{manifest.kv_format.model_dump_json()}|{manifest.limits.block_size}|{ident}"


def bad_word_bans(seq: Sequence, bad_seqs: list[list[int]]) -> list[int]:
    """Last tokens of multi-token bad words whose other tokens are the sequence's latest tokens (TensorRT-LLM's
    matching): a word is never completed, and its first tokens (e.g. a bare space) stay allowed elsewhere."""
    out = []
    for ids in bad_seqs:
        n = len(ids) - 1
        if seq.num_tokens >= n and seq.tokens(seq.num_tokens - n, seq.num_tokens) == ids[:-1]:
            out.append(ids[-1])
    return out


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that is the beginning of a stop word (0: nothing to hold back)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def _find_stop(text: str, stops: list[str], new_from: int) -> int | None:
    """Index where the earliest stop word that overlaps the new text starts, or None."""
    best = None
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def window_ring(manifest, config: RuntimeConfig, backend: str) -> WindowRing | None:
    """The sliding layers' window ring when this runtime frees their passed blocks: with ``free_window_blocks`` and the
    torch engine (the ONNX / TensorRT step networks read every layer through the block tables)."""
    if backend != "torch" or not config.free_window_blocks:
        return None
    return WindowRing.of(manifest.model, manifest.limits.block_size)


def plan_budget(manifest, config: RuntimeConfig, device: torch.device, backend: str) -> CacheBudget:
    """Slots and pool blocks of ``config``'s budget for ``manifest``'s engine run by ``backend`` (the server and the CLI banner).
    With a window ring the pool blocks hold the global layers only, and each slot also pays for its ring blocks."""
    lim = manifest.limits
    any_shape = accepts_any_shape(backend)
    num_slots = min(config.slots(lim.max_batch)[0], lim.max_num_slots)  # the one batch rule: RuntimeConfig.slots
    bytes_per_block, bytes_per_slot = manifest.bytes_per_block, manifest.tail_bytes_per_slot
    ring = window_ring(manifest, config, backend)
    if ring is not None:
        layout = manifest.layout(1, 1)
        bytes_per_block = layout.block_bytes(i for i in range(manifest.model.num_layers) if i not in ring.layers)
        bytes_per_slot += ring.bytes_per_slot(layout)
    budget = CacheBudget.plan(
        resolve_kv_budget(config, device),
        bytes_per_block=bytes_per_block,
        bytes_per_slot=bytes_per_slot,
        block_size=lim.block_size,
        num_slots=num_slots,
        blocks_when_free=num_slots * lim.max_blocks_per_seq,
    )
    if not any_shape and budget.num_blocks > lim.max_num_blocks:
        budget = CacheBudget(budget.budget_bytes, budget.bytes_per_block, budget.bytes_per_slot, budget.block_size, num_slots, lim.max_num_blocks)
    return budget


def resolve_kv_budget(config: RuntimeConfig, device: torch.device) -> int:
    """The KV budget in bytes: ``config.kv_memory`` on this device, else (a GPU) what ``config.reserve`` leaves of the
    device once the engine is loaded (``trtkv.gpu.kv_budget_bytes``, the rule `trtkv plan` plans with).
    The values were validated when ``config`` was made (RuntimeConfig's ranges)."""
    device = torch.device(device)
    gib = config.kv_memory(gpu=device.type == "cuda")
    if gib is not None:
        return int(gib * GIB)
    from trtkv.gpu import device_memory, kv_budget_bytes

    free, total = device_memory(device.index or 0)
    budget = kv_budget_bytes(total, total - free, config.reserve)
    if budget <= 0:
        raise TrtkvError(f"the loaded engine and --reserve {config.reserve:g} leave no GPU memory for the KV cache "
                         f"({free / GIB:.1f} of {total / GIB:.1f} GiB free)", "lower --reserve, or pass --kv-memory GIB")
    return budget
