"""trtkv's Triton kernels (``plugins.ops``): the CUDA attention and seal (on CPU they run under ``TRITON_INTERPRET=1``).

* **Attention**: ``ops.decode_attention`` (split-K decode) for one token per sequence, ``ops.prefill_attention`` on
  the packed valid rows otherwise, with the layer's window and soft-cap (the loops start at the first sealed block the
  window reaches). The layouts' ``TensorFormat`` objects travel: no spec string is made or parsed per step. A ringed
  layer (a window ring) reads its ring blocks through a logical block table whose column ``j`` is the ring block of
  sealed block ``j`` (``ring_table``). No host sync in a decode step: its steps are captured as CUDA graphs.
* **Seal**: on CUDA, the Triton seal kernel (``ops.seal_into``, what ``torch.ops.trtkv.seal_blocks`` runs) quantizes a
  full open block straight into its pool block, in place, for every layer (``seal_in_place``), where the capability
  table's ``seal`` row takes the format and sizes; an ``mse`` format is sealed by the reference quantizer, which runs
  its search. Its bytes are the reference seal's (``cache_layout.seal_open_block``) except for Hadamard formats, where
  a rotation's float32 sums may differ in the last bit (docs/plugins.md); its rows and sink rows are
  ``cache_layout.open_block_to_seal``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trtkv.attention.base import AttentionBackend, AttentionStep
from trtkv.cache_layout import open_block_to_seal
from trtkv.plugins import ops
from trtkv.plugins.contract.capabilities import KERNEL_ATTENTION, KERNEL_SEAL


@dataclass
class KernelStep(AttentionStep):
    cu_seqlens: torch.Tensor | None = None  # [B + 1] int32, a prefill's packed rows
    ring_table: torch.Tensor | None = None  # the ringed layers' logical block table (``ring_table``)

    def ringed_tables(self) -> torch.Tensor:
        """The block table a ringed layer's kernels read: ``[B, max_blocks]`` whose column ``j`` is the ring block of the
        sequence's sealed block ``j`` (``WindowRing.block(slot, j)``). Only columns from the window's first block on hold
        that block (earlier ones were overwritten); the kernels start there and never read the others. Built once per
        step, as wide as the step's block tables (a fixed shape: CUDA graphs replay it)."""
        if self.ring_table is None:
            b = self.batch
            cols = torch.arange(b.block_tables.shape[1], device=b.slot_ids.device)
            self.ring_table = self.cache.ring.block(b.slot_ids[:, None].long(), cols[None, :]).to(torch.int32)
        return self.ring_table


class TritonKernels(AttentionBackend):
    """The Triton kernels (see the module docstring): the default on CUDA where they take the format and sizes."""

    name = "kernels"
    path = KERNEL_ATTENTION
    seal_path = KERNEL_SEAL
    runs_on = ("cuda", "cpu")  # on CPU under the Triton interpreter (the tests' way of running them)
    auto_on = ("cuda",)
    runs_on_note = "on cpu under the Triton interpreter"
    cuda_graphs = True

    def __init__(self, device="cpu", max_seq_len=None, *, seal_kernel: bool | None = None):
        """``seal_kernel``: seal open blocks with the seal kernel (default: on CUDA; True runs it under the interpreter)."""
        super().__init__(device, max_seq_len)
        self.seal_kernel = seal_kernel

    def begin(self, batch, cache, valid, crossing):
        st = KernelStep(backend=self, batch=batch, cache=cache, valid=valid)
        if batch.input_ids.shape[1] > 1:
            st.cu_seqlens = F.pad(batch.new_lens.cumsum(0), (1, 0)).to(torch.int32)
        return st

    def attend(self, st, layer, q, k, v, scaling, window, softcap):
        cache, b = st.cache, st.batch
        kp, vp = self.layer_params(cache, layer)
        kpool, vpool = cache.pool(layer, "k"), cache.pool(layer, "v")
        lay = cache.layout_of(layer)
        tables = st.ringed_tables() if cache.is_ringed(layer) else b.block_tables
        extra = dict(sm_scale=scaling, window=int(window or 0), softcap=float(softcap or 0.0))
        kf = lay.tensor_format("k")
        if kf.pre_rope:  # keys stored before RoPE: the layer's table on the device, to the engine's longest sequence (no
            # host sync: CUDA graphs capture this step); without a manifest, to this step's
            n = self.max_seq_len if self.max_seq_len is not None else int(b.context_lens.max()) + q.shape[2]
            extra["rope"] = cache.rope_for(layer, kf).upto(n, q.device)
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, T, heads, D]
        if qh.shape[1] == 1:
            out = ops.decode_attention(qh[:, 0].contiguous(), lay, kpool, vpool, kh[:, 0].contiguous(), vh[:, 0].contiguous(),
                                       tables, b.context_lens, b.slot_ids, kp, vp, **extra)
            return out[:, None]
        valid = st.valid
        packed = ops.prefill_attention(qh[valid].contiguous(), st.cu_seqlens, lay, kpool, vpool, kh[valid].contiguous(),
                                       vh[valid].contiguous(), tables, b.context_lens, b.slot_ids, kp, vp,
                                       max_seqlen_q=qh.shape[1], **extra)
        out = torch.zeros_like(qh)
        out[valid] = packed
        return out

    # ------------------------------------------------------------------ the seal

    def seals_in_place(self, cache) -> bool:
        """On CUDA (or with ``seal_kernel``) where the capability table's ``seal`` row takes the format and sizes."""
        lay = cache.layout
        on = cache.tensors["k_tail"].device.type == "cuda" if self.seal_kernel is None else self.seal_kernel
        return on and not KERNEL_SEAL.reasons(lay.fmt, None, lay.block_size, lay.head_dim)

    def seal_in_place(self, cache, slot: int, block: int, block_index: int) -> None:
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
