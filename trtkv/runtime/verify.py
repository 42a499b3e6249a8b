"""A minimal static-batch driver over an engine: prefill in block-aligned chunks, then greedy decode.

Used by the engine tests (tests/test_build_engine.py) to run an engine the way the runtime does
(step -> ``cache.write_new_rows``), without the runtime's scheduler: every sequence owns slot ``i`` and
gets pool blocks from a simple free list, allocated before the step that may seal into them.
"""

from __future__ import annotations

import torch

from trtkv.cache_layout import chunk_length
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.step import StepBatch


class StaticBatch:
    """Sequences ``0 … n-1`` in slots ``0 … n-1`` with block tables from a free list."""

    def __init__(self, cache: PagedKVCache, n: int):
        self.cache = cache
        self.bs = cache.block_size
        self.free = list(range(cache.layout.num_blocks))
        self.tables: list[list[int]] = [[] for _ in range(n)]
        self.lens = [0] * n

    def step(self, engine, rows: dict[int, list[int]]):
        """One engine step for the sequences in ``rows`` (seq -> new tokens, within one block); returns logits [len(rows), V]."""
        seqs = sorted(rows)
        for s in seqs:
            need = self.lens[s] // self.bs + 1  # the open block's future pool block is allocated ahead
            while len(self.tables[s]) < need:
                self.tables[s].append(self.free.pop(0))
        batch = StepBatch.make([rows[s] for s in seqs], [self.lens[s] for s in seqs], [self.tables[s] for s in seqs], seqs)
        batch.validate(self.bs)
        out = engine.step(batch, self.cache)
        self.cache.write_new_rows(batch, out)
        for s in seqs:
            self.lens[s] += len(rows[s])
        return out.logits

    def prefill(self, engine, prompts: list[list[int]]) -> torch.Tensor:
        """Block-aligned chunks of every prompt, batched; returns the logits after each prompt's last token."""
        last = [None] * len(prompts)
        pos = [0] * len(prompts)
        while any(pos[i] < len(p) for i, p in enumerate(prompts)):
            rows = {}
            for i, p in enumerate(prompts):
                if pos[i] < len(p):
                    rows[i] = p[pos[i] : pos[i] + chunk_length(self.lens[i], len(p) - pos[i], self.bs)]
            logits = self.step(engine, rows)
            for j, i in enumerate(sorted(rows)):
                pos[i] += len(rows[i])
                if pos[i] == len(prompts[i]):
                    last[i] = logits[j]
        return torch.stack(last)


def greedy_decode(engine, cache: PagedKVCache, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
    """Greedy continuation [n, new_tokens] of ``prompts`` through ``engine`` (prefill chunks, then decode steps)."""
    sb = StaticBatch(cache, len(prompts))
    logits = sb.prefill(engine, prompts)
    out = []
    for _ in range(new_tokens):
        nxt = logits.argmax(-1)
        out.append(nxt)
        if len(out) == new_tokens:
            break
        logits = sb.step(engine, {i: [int(nxt[i])] for i in range(len(prompts))})
    return torch.stack(out, 1)
