"""Section 1, correctness: every kernel (block seal, split-K decode, prefill) for each KV preset, on the device
vs the torch reference (``trtkv.plugins.reference``: seal_blocks / gather_paged, float64 attention). The
pools are sealed by the seal kernel; everything attention must not read holds garbage (``PagedCase``)."""

from __future__ import annotations

import time
import traceback

import torch

from trtkv.plugins.cases import PagedCase

from .common import Run, rel_err

# most important first (time budget): the presets (int3 / int2: keys before RoPE at per-channel widths, codebooks, int2's
# outlier lists), then symmetric int4 groups without a transform
CHECK_FORMATS = ("int4", "int8", "fp16", "int8-static", "fp8", "int3", "int2", "k=int4:g32:sym,v=int4:g32:sym")
DRY_FORMATS = ("fp16", "int8", "int4", "int3")  # the dry run's correctness formats
# (contexts, new rows per sequence, heads q / kv, head_dim); new rows are cut to each open block
SHAPES = [dict(ctx=[1, 300, 77, 1024, 63], new=[1, 4, 3, 16, 1], hq=32, hkv=8, d=128),
          dict(ctx=[513, 45, 0], new=[1, 3, 16], hq=8, hkv=8, d=64)]
DRY_SHAPES = [dict(ctx=[37, 20, 130], new=[3, 1, 16], hq=4, hkv=2, d=64)]  # 130: a sealed block of 128 too


def _kernel_seal(c: PagedCase, rows_out: list, tag: str):
    """A ``PagedCase.seal_with`` callback: the seal kernel, checked against ``reference.seal_ref`` at once
    (bit-exact codes expected; scales bit-exact or, for a few, one ulp apart: fp32 summation-order ties that
    round a half-way fp16 scale the other way)."""
    from trtkv.plugins import ops
    from trtkv.plugins import reference as ref

    def seal(which, rows, blocks, pool, p):
        tf = c.tensor_format(which)
        first, rope = c.first_positions(), None if c.rope is None else (c.rope.cos.to(rows.device), c.rope.sin.to(rows.device))
        ops.launch_seal_into(rows, blocks, pool.data, pool.scale, pool.zero, tf, p.scale, p.smooth, p.clip,
                             codebook=p.codebook, outlier_index=pool.outlier_index, outlier_value=pool.outlier_value,
                             first_positions=first, rope=rope, bits=p.bits)
        cpu = [None if t is None else t.cpu() for t in (p.scale, p.smooth, p.clip, p.codebook)]
        want = ref.seal_ref_pool(rows.cpu(), tf, *cpu, first.cpu(), None if rope is None else tuple(t.cpu() for t in rope),
                                 None if p.bits is None else p.bits.cpu())
        got = pool.data[blocks].cpu()
        mism = float((got.view(torch.uint8) != want.data.view(torch.uint8)).float().mean()) \
            if got.dtype != torch.float16 else float((got != want.data).float().mean())
        smis = sties = 0.0
        if want.scale is not None:  # scales off by more than one ulp of their dtype; one-ulp rounding ties apart
            got_s, want_s = pool.scale[blocks].cpu().float(), want.scale.float()
            ulp = torch.finfo(want.scale.dtype).eps * want_s.abs()
            smis = float(((got_s - want_s).abs() > ulp).float().mean())
            sties = float(((got_s != want_s) & ((got_s - want_s).abs() <= ulp)).float().mean())
        omis = 0.0
        if want.outlier_index is not None:  # fraction of outlier positions not chosen alike (score ties within an ulp)
            omis = float((pool.outlier_index[blocks].cpu() != want.outlier_index).float().mean())
        rows_out.append(dict(kernel="seal", case=f"{tag} {which}", code_mismatch=mism, scale_mismatch=smis,
                             scale_ulp_ties=sties, outlier_mismatch=omis,
                             ok=mism <= 1e-3 and smis <= 1e-3 and sties <= 2e-2 and omis <= 2e-2))

    return seal


def run(r: Run) -> None:
    """Kernels vs the torch reference: seal, decode (two partition sizes) and prefill over sealed blocks +
    open blocks + this step's rows."""
    from trtkv.plugins import ops

    rows = r.result["correctness"]
    shapes, formats = (DRY_SHAPES, DRY_FORMATS) if r.dry else (SHAPES, CHECK_FORMATS)
    t_start = time.time()
    # the timing geometry for every format first, then the second shape (the budget may cut it short)
    for sh in shapes:
        for fmt_name in formats:
            tag = f"{fmt_name} d{sh['d']} hq{sh['hq']}/{sh['hkv']} ctx{sh['ctx']}"
            if time.time() - t_start > r.budget_s:
                rows.append(dict(kernel="*", case=tag, ok=None, error="skipped: time budget"))
                r.log(f"correctness {tag}: skipped (time budget)")
                continue
            try:
                c = PagedCase(fmt_name, sh["ctx"], _within_open_block(fmt_name, sh), heads_q=sh["hq"],
                              kv_heads=sh["hkv"], head_dim=sh["d"], device=r.device, seal=False)
                c.seal_with(_kernel_seal(c, rows, tag))
                ext = ops.SealedExtras(**c.extras_kwargs())  # codebooks, outlier lists, RoPE table, channel widths
                psize = 64 if r.dry else 512  # the ops default (several partitions at ctx 1024)
                e = rel_err(ops.launch_paged_decode(c.q_dec, *c.attn_args(), partition_size=psize, extras=ext), c.reference())
                rows.append(dict(kernel="paged_decode", case=f"{tag} part{psize}", rel_err=e, ok=e < 2e-2))
                e = rel_err(ops.launch_paged_decode(c.q_dec, *c.attn_args(), partition_size=16, extras=ext), c.reference())
                rows.append(dict(kernel="paged_decode", case=f"{tag} part16", rel_err=e, ok=e < 2e-2))
                e = rel_err(ops.launch_paged_prefill(c.q_pre, c.cu, *c.attn_args(prefill=True), extras=ext),
                            c.reference(prefill=True))
                rows.append(dict(kernel="paged_prefill", case=tag, rel_err=e, ok=e < 2e-2))
            except Exception as exc:  # one failing case must not hide the others
                rows.append(dict(kernel="?", case=tag, ok=False, error=f"{type(exc).__name__}: {exc}"[:400]))
                r.log(traceback.format_exc(limit=3))
            bad = [x for x in rows if x["case"].startswith(tag) and x["ok"] is False]
            r.log(f"correctness {tag}: {'ok' if not bad else 'FAIL ' + str(bad)[:300]}")


def _within_open_block(fmt_name: str, sh: dict) -> list[int]:
    from trtkv.formats import get_format
    from trtkv.plugins.cases import DEFAULT_BLOCK

    bs = get_format(fmt_name).block_size or DEFAULT_BLOCK
    return [min(n, bs - c % bs) for c, n in zip(sh["ctx"], sh["new"])]


def report(result: dict) -> list[str]:
    L = ["## Correctness (kernel vs torch reference)", "", "| kernel | case | metric | ok |", "|---|---|---|---|"]
    for r in result["correctness"]:
        metric = r.get("error") or ", ".join(f"{k}={v:.2e}" for k, v in r.items() if isinstance(v, float))
        L.append(f"| {r['kernel']} | {r['case']} | {metric} | {r['ok']} |")
    return L
