"""Sealing on the device: the Triton seal kernel (``torch.ops.trtkv.seal_blocks``) quantizes a full open block
straight into its pool block, in place, for every layer -- what ``PagedKVCache.seal`` does when the cache lives
on a CUDA device (``seal_with_kernels``; on CPU the same kernel runs under ``TRITON_INTERPRET=1``).

Same semantics as ``trtkv.cache_layout.seal_open_block`` (bit for bit: the seal kernel equals ``seal_blocks``
except for Hadamard formats, where a rotation's float32 sums may differ in the last bit -- docs/plugins.md):
a sequence's first block of a format with sink tokens first copies its first ``sink_tokens`` rows to the
slot's sink rows and is quantized ``without_sink``.
"""

from __future__ import annotations

import torch

from trtkv.cache_layout import without_sink
from trtkv.plugins import ops  # noqa: F401  (registers torch.ops.trtkv.*)


def seal_open_block_kernels(cache, slot: int, block: int, block_index: int) -> None:
    """Seal open block ``slot`` (its sequence's block ``block_index``) of every layer into pool block ``block``."""
    bs, sink = cache.layout.block_size, cache.layout.sink_tokens
    dev = cache.tensors["k_tail"].device
    for which in ("k", "v"):
        tail = cache.tensors[f"{which}_tail"]
        if block_index == 0 and sink:
            tail[:, slot, :, bs : bs + sink] = tail[:, slot, :, :sink]
        for layer in range(cache.num_layers):
            spec = cache.layout_of(layer).tensor_format(which).short()
            pool = cache.pool(layer, which)
            rows = pool.tail[slot : slot + 1, :, :bs].float()
            if block_index == 0 and sink:
                rows = without_sink(rows, sink)
            p = getattr(cache.params[layer], which)
            blocks = torch.tensor([cache.seal_target(layer, slot, block, block_index)], dtype=torch.long, device=dev)
            torch.ops.trtkv.seal_blocks(rows, blocks, pool.data, pool.scale, pool.zero, spec, p.scale, p.smooth, p.clip)
