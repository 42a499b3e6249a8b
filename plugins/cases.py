"""Paged test cases: random sequences over the sealed-block cache, built one way for the kernel tests, the
contract tests and ``bench/gpu_check.py``.

A case follows docs/kv-cache-format.md: sequence ``b`` holds ``ctxs[b]`` cached tokens (its sealed blocks at
permuted pool blocks through ``block_table[b]``, its newest ``ctxs[b] % block_size`` rows in
``tail[slot_ids[b]]``, sink rows once a block is sealed) and ``new[b]`` rows of this step (a step never
crosses a block boundary). Pools are sealed by the reference (``cache_layout.seal_blocks``) or, with
``seal=False``, left for the kernel under test (``seal_with``). ``garbage()`` puts NaN / inf / random
bytes wherever attention must not read: unused pool blocks, pool rows the sink rows replace, tail rows
past each context, block-table entries past the sealed blocks.

Only torch APIs: no triton import, so bench/gpu_check.py can use it with any Triton version.
"""

from __future__ import annotations

from typing import Callable

import torch

from trtkv.cache_layout import KVPool, PagedKVLayout, seal_blocks, write_tail
from trtkv.formats import KVFormat, TensorFormat, get_format
from trtkv.quant import TensorParams, forward_transform, hadamard_matrix, per_channel
from trtkv.rope import RopeRows

from . import reference as R

DEFAULT_BLOCK = 16  # the cache block size of formats without their own
BAD_BLOCK = 10**6  # a block-table entry past the sealed blocks: never a valid pool block


def case_rope(positions: int, head_dim: int, base: float = 10000.0) -> RopeRows:
    """A RoPE table of ``positions`` rows in transformers' rotate-half layout (plain RoPE at ``base``): keys stored
    before RoPE (``prerope``) are sealed and read with it."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)
    return RopeRows(ang.cos().float().contiguous(), ang.sin().float().contiguous())


def case_codebook(tf: TensorFormat, kvh: int, gen: torch.Generator) -> torch.Tensor:
    """A stand-in ``nuq`` codebook [kv_heads, 2**bits]: ascending, uneven levels in code units spanning about the
    format's own grid (what ``trtkv calibrate`` fits, roughly), a different one per head."""
    n = tf.codebook_levels
    lo, hi = (tf.traits.sym_min, tf.traits.sym_max) if tf.symmetric else (0.0, tf.traits.asym_max)
    steps = torch.rand(kvh, n, generator=gen) + 0.3
    levels = steps.cumsum(-1)
    levels = (levels - levels[:, :1]) / (levels[:, -1:] - levels[:, :1])
    return (lo + levels * (hi - lo)).float().contiguous()


def case_widths(tf: TensorFormat, kvh: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    """Stand-in code widths [kv_heads, head_dim] of an ``allocB`` format ``tf`` (float32, as the artifact stores them):
    head 0 starts with every allowed width once, the other channels are random, lowered one bit at a time at random
    until each head's row fits the format's bits."""
    choices = torch.tensor(tf.channel_widths)
    w = choices[torch.randint(0, len(choices), (kvh, head_dim), generator=gen)]
    fixed = min(len(choices), head_dim)
    w[0, :fixed] = choices[:fixed]
    budget = tf.row_code_bits(head_dim)
    for h in range(kvh):
        free = torch.arange(fixed if h == 0 else 0, head_dim)
        while int(w[h].sum()) > budget:
            c = int(free[torch.randint(0, len(free), (1,), generator=gen)])
            w[h, c] = max(0, int(w[h, c]) - 1)
    return w.float()


def case_params(tf: TensorFormat, which: str, x: torch.Tensor, gen: torch.Generator) -> TensorParams:
    """Stand-in calibration for rows ``x`` [n, kv_heads, head_dim]: smoothing divisors in [0.5, 2], static
    scales from the transformed rows' absolute maximum at the format's granularity (what ``trtkv
    calibrate`` picks, roughly), range multipliers 1 / 0.9 for dynamic K (clip search), codebooks
    (``case_codebook``), code widths per channel (``case_widths``)."""
    kvh, d = x.shape[1:]
    p = TensorParams()
    if tf.codebook:
        p.codebook = case_codebook(tf, kvh, gen)
    if tf.allocated_bits is not None:
        p.bits = case_widths(tf, kvh, d, gen)
    if tf.smooth:
        p.smooth = torch.rand(kvh, d, generator=gen) * 1.5 + 0.5
    if tf.is_static:
        xt = forward_transform(x.float(), tf, p, head_axis=-2).abs()
        amax = {"per_tensor": lambda: xt.amax(), "per_head": lambda: xt.amax(dim=(0, 2)),
                "per_channel": lambda: xt.amax(dim=0)}[tf.granularity]()
        p.scale = amax.clamp_min(1e-3) / tf.traits.sym_max
    if tf.is_dynamic and which == "k":
        p.clip = torch.tensor([1.0, 0.9]).repeat(kvh)[:kvh]
    return p


class PagedCase:
    """Random K / V for sequences holding ``ctxs`` cached tokens and ``new`` rows this step (decode: None,
    one each), queries for both, on ``device`` (generated on the CPU from ``seed``)."""

    def __init__(self, fmt: KVFormat | str, ctxs, new=None, *, heads_q: int, kv_heads: int, head_dim: int,
                 block_size: int | None = None, seed: int = 0, device="cpu", seal: bool = True,
                 garbage: bool = True):
        fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        bs = block_size or fmt.block_size or DEFAULT_BLOCK
        self.gen = gen = torch.Generator().manual_seed(seed)
        self.ctxs, self.bs, self.device = list(ctxs), bs, device
        self.new = [1] * len(self.ctxs) if new is None else list(new)
        assert all(c % bs + n <= bs for c, n in zip(self.ctxs, self.new)), "a step never crosses a block boundary"
        B, D = len(self.ctxs), head_dim
        self.kvh, self.heads, self.d = kv_heads, heads_q, D
        self.sealed = [c // bs for c in self.ctxs]
        max_blocks = max(self.sealed) + 2  # spare entries past the sealed blocks
        self.layout = PagedKVLayout(fmt.with_block_size(bs), kv_heads, D, bs, B * max_blocks + 3, num_slots=B + 2)
        self.fmt = self.layout.fmt
        perm = torch.randperm(self.layout.num_blocks, generator=gen)[: B * max_blocks]
        self.block_table = perm.view(B, max_blocks).to(torch.int32).to(device)  # permuted, non-contiguous blocks
        self.slot_ids = torch.randperm(B + 2, generator=gen)[:B].to(torch.int32).to(device)
        self.context_lens = torch.tensor(self.ctxs, dtype=torch.int32, device=device)
        self.cu = torch.tensor([0] + torch.tensor(self.new).cumsum(0).tolist(), dtype=torch.int32, device=device)

        ch = torch.rand(kv_heads, D, generator=gen) * 2 + 0.2  # channel outliers, like real keys
        n_sealed, S, total = sum(self.sealed), self.layout.sink_tokens, sum(self.new)
        self.rows, self.tail_rows, self.sink_rows = {}, {}, {}
        for which, scale in (("k", ch[None, :, None, :]), ("v", 1.0)):
            self.rows[which] = (torch.randn(n_sealed, kv_heads, bs, D, generator=gen) * scale).half()  # sealed blocks
            self.tail_rows[which] = [torch.randn(c % bs, kv_heads, D, generator=gen).half() for c in self.ctxs]
            self.sink_rows[which] = (torch.randn(B, kv_heads, S, D, generator=gen) * 4).half()  # attention sinks
        self.k_new = torch.randn(total, kv_heads, D, generator=gen).half().to(device)
        self.v_new = torch.randn(total, kv_heads, D, generator=gen).half().to(device)
        self.q_dec = torch.randn(B, heads_q, D, generator=gen).half().to(device)
        self.q_pre = torch.randn(total, heads_q, D, generator=gen).half().to(device)
        self.params = {}
        for which in ("k", "v"):
            x = torch.cat([self.rows[which].transpose(1, 2).reshape(-1, kv_heads, D),
                           (self.k_new if which == "k" else self.v_new).cpu()])
            p = case_params(self.tensor_format(which), which, x, gen)
            self.params[which] = p.map(lambda t: t.to(device))
            self.rows[which] = self.rows[which].to(device)
        self.kp, self.vp = self.params["k"], self.params["v"]
        # keys stored before RoPE: a table past every position of the case
        self.rope = case_rope(max(c + n for c, n in zip(self.ctxs, self.new)) + 1, D) if self.fmt.k.pre_rope else None
        self.dirty = garbage
        self.k_pool, self.v_pool = self._pools()
        if seal:
            self.seal_with(None)
        elif garbage:
            self.garbage()

    # ---- cache contents ----

    def tensor_format(self, which: str) -> TensorFormat:
        return self.fmt.k if which == "k" else self.fmt.v

    def pool(self, which: str) -> KVPool:
        return self.k_pool if which == "k" else self.v_pool

    def _pools(self) -> tuple[KVPool, KVPool]:
        """Pools with each sequence's open-block rows and sink rows written; the pool blocks still empty."""
        out = []
        for which in ("k", "v"):
            pool = self.layout.allocate(which, self.device)
            for b, c in enumerate(self.ctxs):
                slot = int(self.slot_ids[b])
                if c % self.bs:
                    write_tail(pool, slot, self.tail_rows[which][b].to(self.device), 0, self.bs)
                if self.sealed[b] and self.layout.sink_tokens:
                    pool.tail[slot, :, self.bs:] = self.sink_rows[which][b].to(self.device)
            out.append(pool)
        return out[0], out[1]

    def sealed_blocks(self) -> torch.Tensor:
        """Pool blocks [n] of every sealed block, sequence by sequence (the order of ``rows``)."""
        bt = self.block_table
        parts = [bt[b, :n].long() for b, n in enumerate(self.sealed) if n]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=self.device)

    def first_positions(self) -> torch.Tensor:
        """The first position of every sealed block [n], in the order of ``sealed_blocks``."""
        parts = [torch.arange(n) * self.bs for n in self.sealed if n]
        return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)).to(self.device)

    def seal_with(self, seal: Callable | None) -> None:
        """Seal every sealed block: ``seal(which, rows, blocks, pool, params)`` (the kernel under test) or, for
        None, the reference ``cache_layout.seal_blocks``; then the garbage again if the case has it."""
        blocks = self.sealed_blocks()
        for which in ("k", "v"):
            rows, pool, p = self.rows[which], self.pool(which), self.params[which]
            if not blocks.numel():
                continue
            if seal is None:
                seal_blocks(self.layout, which, pool, rows, blocks, p, self.first_positions(), self.rope)
            else:
                seal(which, rows, blocks, pool, p)
        if self.dirty:
            self.garbage()

    def garbage(self) -> None:
        """NaN / inf / random bytes everywhere attention must not read."""
        bs, gen, dev = self.bs, self.gen, self.device
        live = {int(self.block_table[b, i]) for b, n in enumerate(self.sealed) for i in range(n)}
        dead = torch.tensor([i not in live for i in range(self.layout.num_blocks)], device=dev)
        sink = self.layout.sink_tokens
        for pool in (self.k_pool, self.v_pool):
            data = pool.data
            if data.dtype == torch.float16:
                junk = (torch.randn(data.shape, generator=gen) * 1e4).half()
                junk[..., 0] = float("nan")
            else:
                junk = torch.randint(0, 256, data.shape, generator=gen, dtype=torch.int32).to(torch.uint8).view(data.dtype)
            junk = junk.to(dev)
            data[dead] = junk[dead]
            for b, n in enumerate(self.sealed):  # pool rows a sequence reads from its sink rows instead
                if n and sink:
                    first = int(self.block_table[b, 0])
                    data[first, :, :sink] = junk[first, :, :sink]
            if pool.outlier_index is not None:  # dead blocks' lists: positions anywhere, NaN values
                junk_idx = torch.randint(-2**15, 2**15, pool.outlier_index.shape, generator=gen, dtype=torch.int32)
                pool.outlier_index[dead] = junk_idx.to(torch.int16).to(dev)[dead]
                pool.outlier_value[dead] = float("nan")
            for t in (pool.scale, pool.zero):
                if t is not None:
                    j = torch.full(t.shape, float("nan"), dtype=torch.float16, device=dev)
                    j[..., ::2] = float("inf")
                    t[dead] = j[dead]
            tail = pool.tail
            used = torch.zeros(tail.shape[0], tail.shape[2], dtype=torch.bool, device=dev)
            for b, c in enumerate(self.ctxs):
                used[int(self.slot_ids[b]), : c % bs] = True
                used[int(self.slot_ids[b]), bs:] = c >= bs  # sink rows: read once a block is sealed
            j = torch.full(tail.shape, float("nan"), dtype=torch.float16, device=dev)
            j[..., 1::2] = float("inf")
            m = ~used[:, None, :, None].expand_as(tail)
            tail[m] = j[m]
        bt = self.block_table.clone()
        for b, n in enumerate(self.sealed):
            bt[b, n:] = BAD_BLOCK  # entries past the sealed blocks may hold anything, even invalid indices
        self.block_table = bt

    # ---- arguments ----

    def new_rows(self, prefill: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's K / V rows: all of them (prefill) or each sequence's first (decode)."""
        if prefill:
            return self.k_new, self.v_new
        first = self.cu[:-1].long()
        return self.k_new[first], self.v_new[first]

    def attn_args(self, prefill: bool = False, pools: tuple[KVPool, KVPool] | None = None) -> tuple:
        """``ops.launch_paged_decode`` / ``_prefill`` arguments after q (and cu_seqlens), formats as objects."""
        kp, vp = pools or (self.k_pool, self.v_pool)
        k_new, v_new = self.new_rows(prefill)
        return (kp.data, kp.scale, kp.zero, vp.data, vp.scale, vp.zero, kp.tail, vp.tail, k_new, v_new,
                self.block_table, self.context_lens, self.slot_ids, self.fmt.k, self.fmt.v,
                self.kp.scale, self.kp.smooth, self.vp.scale, self.vp.smooth)

    def extras_kwargs(self, pools: tuple[KVPool, KVPool] | None = None) -> dict:
        """What the calibrated storage features add to a read (``ops.SealedExtras``' fields): codebooks, outlier lists, RoPE table,
        code widths."""
        kp, vp = pools or (self.k_pool, self.v_pool)
        return dict(k_codebook=self.kp.codebook, v_codebook=self.vp.codebook, k_bits=self.kp.bits, v_bits=self.vp.bits, k_outlier_index=kp.outlier_index,
                    k_outlier_value=kp.outlier_value, v_outlier_index=vp.outlier_index, v_outlier_value=vp.outlier_value,
                    rope_cos=None if self.rope is None else self.rope.cos.to(self.device),
                    rope_sin=None if self.rope is None else self.rope.sin.to(self.device))

    def op_args(self, prefill: bool = False) -> tuple:
        """The same for the torch custom ops, whose schema carries formats as spec strings."""
        a = list(self.attn_args(prefill))
        a[13], a[14] = self.fmt.k.short(), self.fmt.v.short()
        return tuple(a)

    def contract_tensors(self, prefill: bool, q: torch.Tensor | None = None) -> dict:
        """Named inputs of PagedDecodePartition / PagedPrefillAttention (unused ones None)."""
        k_new, v_new = self.new_rows(prefill)
        t = dict(q=q if q is not None else (self.q_pre if prefill else self.q_dec), cu_seqlens=self.cu,
                 block_tables=self.block_table, context_lens=self.context_lens, slot_ids=self.slot_ids,
                 k_new=k_new, v_new=v_new, hadamard=hadamard_matrix(self.d, torch.float32, self.device))
        for w in "kv":
            pool, p = self.pool(w), self.params[w]
            t.update({f"{w}_data": pool.data, f"{w}_scale": pool.scale, f"{w}_zero": pool.zero,
                      f"{w}_tail": pool.tail, f"{w}_smooth": p.smooth,
                      f"{w}_static": None if p.scale is None else per_channel(p.scale, self.kvh, self.d)})
        return t

    def reference(self, q: torch.Tensor | None = None, prefill: bool = False, sm_scale: float | None = None,
                  pools: tuple[KVPool, KVPool] | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """Float64 attention over the pools (``gather_paged``) followed by this step's rows, on the CPU (``window`` /
        ``softcap``: ``reference.paged_attention_ref``'s)."""
        q = q if q is not None else (self.q_pre if prefill else self.q_dec)
        a = [_cpu(x) for x in self.attn_args(prefill, pools)]
        kp, vp = pools or (self.k_pool, self.v_pool)
        kpool = KVPool(a[0], a[1], a[2], a[6], _cpu(kp.outlier_index), _cpu(kp.outlier_value))
        vpool = KVPool(a[3], a[4], a[5], a[7], _cpu(vp.outlier_index), _cpu(vp.outlier_value))
        return R.paged_attention_ref(_cpu(q), _cpu(self.cu) if prefill else None, kpool, vpool, a[8], a[9], a[10],
                                     a[11], a[12], a[13], a[14], _cpu_params(self.kp), _cpu_params(self.vp), sm_scale,
                                     window, softcap, self.rope)


def _cpu(t):
    return t.detach().cpu() if isinstance(t, torch.Tensor) else t


def _cpu_params(p: TensorParams) -> TensorParams:
    return p.map(_cpu)
