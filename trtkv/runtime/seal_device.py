"""Sealing on the device: the Triton seal kernel (``ops.seal_into``, what ``torch.ops.trtkv.seal_blocks`` runs)
quantizes a full open block straight into its pool block, in place, for every layer -- what ``PagedKVCache.seal``
does when the cache lives on a CUDA device (``seal_with_kernels``; on CPU the same kernel runs under
``TRITON_INTERPRET=1``).

Same semantics as ``trtkv.cache_layout.seal_open_block`` (bit for bit: the seal kernel equals ``seal_blocks``
except for Hadamard formats, where a rotation's float32 sums may differ in the last bit -- docs/plugins.md): the
rows it quantizes, and the sink rows a first block fills, are ``cache_layout.open_block_to_seal``'s. Formats travel
as the layouts' ``TensorFormat`` objects: nothing is parsed per seal.
"""

from __future__ import annotations

import torch

from trtkv.cache_layout import open_block_to_seal
from trtkv.plugins import ops


def seal_open_block_kernels(cache, slot: int, block: int, block_index: int) -> None:
    """Seal open block ``slot`` (its sequence's block ``block_index``) of every layer into pool block ``block`` (with a
    ``nuq`` format's codebook, an ``outN`` format's outlier lists, an ``allocB`` format's code widths, and for keys
    stored before RoPE the block's first position and the layer's RoPE table)."""
    dev = cache.tensors["k_tail"].device
    first = torch.tensor([block_index * cache.block_size], dtype=torch.int32, device=dev)
    for layer in range(cache.num_layers):
        lay = cache.layout_of(layer)
        blocks = torch.tensor([cache.seal_target(layer, slot, block, block_index)], dtype=torch.long, device=dev)
        for which in ("k", "v"):
            pool = cache.pool(layer, which)
            rows = open_block_to_seal(lay, pool, slot, block_index)
            p, tf = getattr(cache.params[layer], which), lay.tensor_format(which)
            rope = cache.rope_for(layer, tf).upto((block_index + 1) * cache.block_size, dev) if tf.pre_rope else None
            ops.seal_into(rows, blocks, pool.data, pool.scale, pool.zero, tf, p.scale, p.smooth, p.clip, p.codebook,
                          pool.outlier_index, pool.outlier_value, first, rope, p.bits)
