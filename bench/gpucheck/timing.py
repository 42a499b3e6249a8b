"""Sections 3-5: bandwidth reference, decode timing, targets.

3. bandwidth: device-to-device copy of a large tensor (read + write bytes / time): the reference rate.
4. decode timing: heads 32 query / 8 KV, head_dim 128, contexts 4k / 32k / 128k, batch 1 and 8: the fp16
   baseline is torch ``scaled_dot_product_attention`` (flash backend, ``enable_gqa``) on a contiguous fp16
   cache; ours is the engine's decode step: ``ctx - 1`` cached tokens (sealed blocks of the format's block
   size, the rest in the open block) plus one new row per sequence. Each timing is the median over repeats
   of CUDA-graph replays (no launch overhead) between CUDA events, after warmup. Achieved bandwidth counts
   the bytes read: codes + scales (+ zero-points) + open-block rows + new rows + query + block table.
5. targets: int4 >= 2.5x faster than fp16 SDPA at 32k batch 8 and >= 70% of copy bandwidth; int8 >= 1.6x.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from trtkv.cache_layout import PagedKVLayout
from trtkv.formats import get_format
from trtkv.plugins.cases import DEFAULT_BLOCK, case_params
from trtkv.quant import TensorParams

from .common import Log, Run, geometry, rel_err

CONTEXTS = (4096, 32768, 131072)
BATCHES = (1, 8)
TIMED_FORMATS = ("fp16", "int8", "int4")
TARGETS = {"int4_speedup": 2.5, "int4_bw_frac": 0.70, "int8_speedup": 1.6}


def _device_params(p: TensorParams, device) -> TensorParams:
    return p.map(lambda t: t.to(device))


def _time_cuda(fn, warmup: int = 3, reps: int = 5, inner: int = 20, use_graph: bool = True) -> float:
    """Median seconds per call: CUDA-graph replays of ``inner`` calls (eager if capture fails)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = None
    try:
        if not use_graph:
            raise RuntimeError("eager timing requested")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception:
        graph = None
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if graph is not None:
            graph.replay()
        else:
            for _ in range(inner):
                fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / inner)
    return statistics.median(times)


def _time_cpu(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(log: Log, device, dry: bool) -> dict:
    """Device-to-device copy of a large tensor (read + write bytes / time): the reference rate."""
    n = (1 << 20) if dry else (2 << 30)  # bytes
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    t = (_time_cpu if dry else _time_cuda)(lambda: dst.copy_(src))
    bw = 2 * n / t
    log(f"copy bandwidth: {bw / 1e9:.1f} GB/s ({n / 2**20:.0f} MiB copy, read + write)")
    return dict(bytes=n, seconds=t, bandwidth_gbs=bw / 1e9)


def _sdpa_setup(B, ctx, hq, hkv, d, device):
    q = torch.randn(B, hq, 1, d, dtype=torch.float16, device=device)
    k = torch.randn(B, hkv, ctx, d, dtype=torch.float16, device=device)
    v = torch.randn(B, hkv, ctx, d, dtype=torch.float16, device=device)
    return q, k, v


def _sdpa_fn(q, k, v, dry: bool):
    """(callable, backend name): flash with enable_gqa, else the default dispatcher with enable_gqa."""
    import torch.nn.functional as F

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover
        SDPBackend = sdpa_kernel = None
    tries = []
    if sdpa_kernel is not None and not dry:
        tries.append(("flash+enable_gqa", lambda: _with(sdpa_kernel(SDPBackend.FLASH_ATTENTION),
                                                         lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))))
        tries.append(("efficient+enable_gqa", lambda: _with(sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION),
                                                             lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))))
    tries.append(("default+enable_gqa", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)))
    for name, fn in tries:
        try:
            fn()
            return fn, name
        except Exception:
            continue
    raise RuntimeError("no SDPA backend ran")


def _with(ctx, fn):
    with ctx:
        return fn()


def _paged_setup(fmt_name, B, ctx, hq, hkv, d, device):
    """B sequences holding ``ctx - 1`` cached tokens -- sealed blocks of the format's block size in the pool,
    the rest in the open block -- plus this step's one new row each (the engine's decode step). Random
    codes / scales: timing only."""
    fmt = get_format(fmt_name)
    bs = fmt.block_size or DEFAULT_BLOCK
    gen = torch.Generator().manual_seed(7)
    cached = ctx - 1
    sealed = cached // bs
    blocks = max(B * sealed, 1)
    lay = PagedKVLayout(fmt, hkv, d, bs, blocks, num_slots=B)
    pools = []
    for which in ("k", "v"):
        p = lay.allocate(which, device)
        if p.data.dtype == torch.float16:
            p.data.normal_()
        else:
            p.data.view(torch.uint8).random_(0, 255)
        if p.scale is not None:
            p.scale.uniform_(0.01, 0.02)
        if p.zero is not None:
            p.zero.uniform_(-0.1, 0.1)
        p.tail.normal_()
        pools.append(p)
    bt = torch.randperm(blocks, device=device).to(torch.int32)[: B * sealed].view(B, sealed).contiguous() if sealed \
        else torch.zeros(B, 1, dtype=torch.int32, device=device)
    cl = torch.full((B,), cached, dtype=torch.int32, device=device)
    slots = torch.arange(B, dtype=torch.int32, device=device)
    q = torch.randn(B, hq, d, dtype=torch.float16, device=device)
    k_new = torch.randn(B, hkv, d, dtype=torch.float16, device=device)
    v_new = torch.randn(B, hkv, d, dtype=torch.float16, device=device)
    k_params, v_params = (_device_params(case_params(fmt.k if w == "k" else fmt.v, w, torch.randn(4, hkv, d), gen), device)
                          for w in "kv")
    read = q.numel() * 2 + bt.numel() * 4 + cl.numel() * 4 + (k_new.numel() + v_new.numel()) * 2
    for p in pools:  # every sealed block and the open rows
        for t in (p.data, p.scale, p.zero):
            if t is not None:
                read += t.numel() * t.element_size() * (B * sealed) // blocks
        read += 2 * B * hkv * (cached % bs) * d
    args = (pools[0].data, pools[0].scale, pools[0].zero, pools[1].data, pools[1].scale, pools[1].zero,
            pools[0].tail, pools[1].tail, k_new, v_new, bt, cl, slots, fmt.k, fmt.v,
            k_params.scale, k_params.smooth, v_params.scale, v_params.smooth)
    return q, args, read


class PreparedDecode:
    """The two decode launches of ``ops.launch_paged_decode`` with every tensor prepared once, so a call is
    only the launches (capturable in a CUDA graph: no allocation, no host copy). Kernel arguments are
    passed by parameter name, so a reordered kernel signature cannot shift them.

    ``args``: ops.launch_paged_decode's arguments after q up to v_smooth (pools, tails, new rows, block
    table, context lengths, slots, formats, constants)."""

    def __init__(self, q, args: tuple, precision: str, partition_size: int = 512, interpret: bool | None = None):
        from trtkv.plugins import contract as C
        from trtkv.plugins import kernels as K
        from trtkv.plugins import ops

        (k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new, v_new, bt, cl, slots, k_fmt, v_fmt,
         k_static, k_smooth, v_static, v_smooth) = args
        B, heads, d = q.shape
        A = ops._attn_tensors(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_tail, v_tail, k_new, v_new,
                              bt, cl, slots, k_fmt, v_fmt, k_static, k_smooth, v_static, v_smooth, interpret)
        interpret, kvh, bs, t = A.interpret, A.kvh, A.block_size, A.tensors
        cfg = K.decode_config(A.kf, A.vf, d, heads // kvh, partition_size, precision, interpret=interpret)
        self.grid_p, self.grid_r = C.decode_grids(B, kvh, bt.shape[1], bs, partition_size)
        S = self.grid_p[2]
        self.part_m = torch.empty(B, heads, S, device=q.device)
        self.part_l = torch.empty_like(self.part_m)
        self.part_acc = torch.empty(B, heads, S, d, device=q.device)
        self.out = torch.empty_like(q)
        kmod = K.load_kernels(interpret)
        self._part, self._red = kmod.paged_decode_partition_kernel, kmod.paged_decode_reduce_kernel
        common = dict(q_ptr=q.contiguous(),
                      part_m_ptr=self.part_m, part_l_ptr=self.part_l, part_acc_ptr=self.part_acc, out_ptr=self.out,
                      qk_scale=(1.0 / math.sqrt(d)) * K.LOG2E, num_heads=heads, num_kv_heads=kvh, block_size=bs,
                      sink_tokens=A.sink, max_blocks=bt.shape[1], num_partitions=S, window=0, softcap=0.0, **t)
        self._p_args = {n: common[n] for n in self._part.arg_names if n in common}
        self._p_args.update(cfg["partition"]["constexprs"], num_warps=cfg["partition"]["num_warps"])
        self._r_args = {n: common[n] for n in self._red.arg_names if n in common}
        self._r_args.update(cfg["reduce"]["constexprs"], num_warps=cfg["reduce"]["num_warps"])

    def partition(self):
        self._part[self.grid_p](**self._p_args)
        return self.part_m, self.part_l, self.part_acc

    def reduce(self):
        self._red[self.grid_r](**self._r_args)
        return self.out

    def __call__(self):
        self.partition()
        return self.reduce()


def decode_timing(log: Log, device, dry: bool, copy_bw: float, budget_s: float = 1e9) -> list[dict]:
    """Decode attention of one new token per sequence as the TensorRT engine runs it: ``ctx - 1`` cached
    tokens (sealed blocks + open block) and the step's new row, vs fp16 SDPA over ``ctx``."""
    from trtkv.plugins import ops

    rows = []
    if dry:
        grid = [(64, 1), (160, 2)]
        hq, hkv, d = 4, 2, 64
    else:
        grid = [(c, b) for c in CONTEXTS for b in BATCHES]
        hq, hkv, d = geometry(False)
    timer = _time_cpu if dry else _time_cuda
    t_start = time.time()
    for ctx, B in grid:
        if time.time() - t_start > budget_s:
            rows.append(dict(impl="*", ctx=ctx, batch=B, error="skipped: time budget"))
            log(_fmt_row(rows[-1]))
            continue
        base = None
        try:
            q, k, v = _sdpa_setup(B, ctx, hq, hkv, d, device)
            fn, backend = _sdpa_fn(q, k, v, dry)
            t = timer(fn)
            read = (q.numel() + k.numel() + v.numel()) * 2
            base = t
            rows.append(dict(impl="sdpa-fp16", backend=backend, ctx=ctx, batch=B, us=t * 1e6, bytes_read=read,
                             gbs=read / t / 1e9, bw_frac=read / t / copy_bw, speedup=1.0))
            del q, k, v, fn
        except Exception as exc:
            rows.append(dict(impl="sdpa-fp16", ctx=ctx, batch=B, error=f"{type(exc).__name__}: {exc}"[:300]))
        log(_fmt_row(rows[-1]))
        for fmt_name in TIMED_FORMATS:
            try:
                q, args, read = _paged_setup(fmt_name, B, ctx, hq, hkv, d, device)
                for prec in (("ieee",) if dry else ("tf32x3", "tf32")):
                    mode = "prepared"
                    try:
                        fn = PreparedDecode(q, args, prec)
                        want = ops.launch_paged_decode(q, *args, precision=prec)
                        same = rel_err(fn(), want)
                        assert same < 1e-3, f"prepared decode differs from ops.launch_paged_decode: {same}"
                        t = timer(fn)
                    except Exception as exc:  # kernels changed under this script: time the stable op API
                        log(f"prepared decode unavailable ({type(exc).__name__}: {str(exc)[:200]}); timing "
                            "ops.launch_paged_decode eagerly (includes Python launch overhead)")
                        mode = "ops-eager"
                        fn = (lambda prec=prec, q=q, args=args: ops.launch_paged_decode(q, *args, precision=prec))
                        t = timer(fn) if dry else _time_cuda(fn, use_graph=False)
                    rows.append(dict(impl=f"paged-{fmt_name}", precision=prec, mode=mode, ctx=ctx, batch=B,
                                     us=t * 1e6, bytes_read=read, gbs=read / t / 1e9, bw_frac=read / t / copy_bw,
                                     speedup=(base / t) if base else None))
                    log(_fmt_row(rows[-1]))
                del args, fn
            except Exception as exc:
                rows.append(dict(impl=f"paged-{fmt_name}", ctx=ctx, batch=B, error=f"{type(exc).__name__}: {exc}"[:300]))
                log(_fmt_row(rows[-1]))
        if not dry:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return rows


def _fmt_row(r: dict) -> str:
    if "error" in r:
        return f"timing {r['impl']} ctx={r['ctx']} B={r['batch']}: ERROR {r['error']}"
    sp = f" speedup {r['speedup']:.2f}x" if r.get("speedup") else ""
    extra = f" [{r.get('backend') or r.get('precision')}]"
    return (f"timing {r['impl']}{extra} ctx={r['ctx']} B={r['batch']}: {r['us']:.1f} us, "
            f"{r['gbs']:.0f} GB/s ({100 * r['bw_frac']:.0f}% of copy){sp}")


def evaluate_targets(timing: list[dict], dry: bool) -> list[dict]:
    ctx, B = (128, 2) if dry else (32768, 8)

    def best(impl):
        rs = [r for r in timing if r.get("impl") == impl and r["ctx"] == ctx and r["batch"] == B and "us" in r]
        return min(rs, key=lambda r: r["us"]) if rs else None

    out = []
    i4, i8 = best("paged-int4"), best("paged-int8")
    if dry:  # CPU interpreter timings say nothing about the GPU targets
        return [dict(target="(dry run: targets are evaluated on a GPU only)", want=None, got=None, ok=None)]
    out.append(dict(target=f"int4 speedup vs fp16 SDPA at ctx {ctx}, batch {B}", want=TARGETS["int4_speedup"],
                    got=i4 and i4["speedup"], ok=bool(i4 and i4["speedup"] and i4["speedup"] >= TARGETS["int4_speedup"])))
    out.append(dict(target=f"int4 fraction of copy bandwidth at ctx {ctx}, batch {B}", want=TARGETS["int4_bw_frac"],
                    got=i4 and i4["bw_frac"], ok=bool(i4 and i4["bw_frac"] >= TARGETS["int4_bw_frac"])))
    out.append(dict(target=f"int8 speedup vs fp16 SDPA at ctx {ctx}, batch {B}", want=TARGETS["int8_speedup"],
                    got=i8 and i8["speedup"], ok=bool(i8 and i8["speedup"] and i8["speedup"] >= TARGETS["int8_speedup"])))
    return out


# ---- the sections ----


def run_bandwidth(r: Run) -> None:
    r.result["copy"] = copy_bandwidth(r.log, r.device, r.dry)


def run_timing(r: Run) -> None:
    r.result["timing"] = decode_timing(r.log, r.device, r.dry, r.result["copy"]["bandwidth_gbs"] * 1e9, r.budget_s)


def run_targets(r: Run) -> None:
    r.result["targets"] = evaluate_targets(r.result["timing"], r.dry)
    for t in r.result["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["ok"]]
        r.log(f"target {t['target']}: want {t['want']}, got {t['got']}: {verdict}")


def report_bandwidth(result: dict) -> list[str]:
    cb = result["copy"]
    return [f"## Bandwidth reference: device copy {cb['bandwidth_gbs']:.0f} GB/s" if cb else
            "## Bandwidth reference: not measured yet"]


def report_timing(result: dict) -> list[str]:
    L = ["## Decode attention timing (one new token per sequence: sealed blocks + open block + the new row)", "",
         "| impl | prec/backend | ctx | batch | us | GB/s | % copy | speedup vs SDPA |", "|---|---|---|---|---|---|---|---|"]
    for r in result["timing"]:
        if "error" in r:
            L.append(f"| {r['impl']} | | {r['ctx']} | {r['batch']} | ERROR {r['error']} | | | |")
            continue
        sp = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        how = (r.get("precision") or r.get("backend") or "") + (" (eager op)" if r.get("mode") == "ops-eager" else "")
        L.append(f"| {r['impl']} | {how} | {r['ctx']} | {r['batch']} | "
                 f"{r['us']:.1f} | {r['gbs']:.0f} | {100 * r['bw_frac']:.0f}% | {sp} |")
    return L


def report_targets(result: dict) -> list[str]:
    L = ["## Targets", "", "| target | want | got | ok |", "|---|---|---|---|"]
    for t in result["targets"]:
        got = f"{t['got']:.2f}" if isinstance(t["got"], float) else str(t["got"])
        L.append(f"| {t['target']} | {t['want']} | {got} | {t['ok']} |")
    return L
