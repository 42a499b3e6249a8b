"""Screen (issue 27): key bits allocated per channel at calibration instead of a Hadamard rotation and equal bits.

The presets rotate pre-RoPE keys by a Hadamard matrix so that every channel has about the same range, and then give
every channel the same number of bits. Pre-RoPE key channels are far from alike: within a sealed block, the variance of
the query-weighted channels (the expected squared logit error each one carries per unit of quantization error) spans
orders of magnitude per KV head. Transform coding's answer is the opposite of equalizing: keep the channels apart and
give each the bits its variance earns (reverse water-filling). This screen allocates, per layer and KV head, integer
bits per pre-RoPE channel (0 = the block mean only) greedily by expected error saved per stored bit, from the
within-block variances of calibration windows; each sealed block then stores per channel an fp16 minimum and step
(a mean alone at 0 bits) and the codes, plus the ``N`` elements of each block and head that would stretch their
channel's range most, kept exactly (32 bits each, like ``outN``). Decoding is per element (no rotation to undo), so a
kernel reads it as cheaply as the presets' grid.

The eval cache's key seal is swapped for this round trip in this process (values stay in ``--kv``'s value format,
sinks and the open block in fp16), every row from one run on the same windows:

    python bench/screen_key_bits.py --calibration CAL --kv int2-nuq --dataset builtin:pydoc --seq-len 512 --windows 8 \
        --rows base,fix2o64,cb2.5o64 --json out.json

A row ``cb{K}o{N}``: ``K`` key bits per element in all (codes, per-block minimum / step or mean, outliers), allocated per
channel within each KV head from the textbook error model; ``cbe{K}o{N}``: from each channel's error measured through
this grid on the calibration windows at every bit count; ``cbg{K}o{N}``: the same bits allocated over every layer's heads at once; ``fix{b}o{N}``:
``b`` bits in every channel, no rotation (what allocation is measured against); ``base``: ``--kv`` itself. An ``m``
after the outlier count stores 1-bit channels as their mean +- mean absolute deviation instead of their extremes, a ``g`` puts channels of 2+ bits on
a grid centered on their mean with the Gaussian-optimal step for their std (tails clipped); then
``s{digits}`` restricts the bit counts a channel may take (``s024``: 0, 2 or 4 -- what a simpler packing would need). A suffix
``+vi{K}`` / ``+vt{K}`` / ``+vtt{K}`` swaps the values too, for ``K`` bits per element, weighted by the squared norms of
the o_proj columns that read each channel: per-channel bits with per-block grids in the value channels (``vi``) or in
their KLT basis (``vt``, the eigenvectors of the weighted within-block covariance, which o_proj could absorb), or
per-token grids in that basis (``vtt``: one fp16 RMS per token and head, each channel through the Lloyd-Max levels of
a standard normal at its bits).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

STATE: dict = {"row": None, "bits": {}, "weights": {}, "values": {}}  # bits, weights: layer -> [Hkv, D]; values: layer -> basis etc.
MAX_BITS = 8


def parse_row(row: str) -> tuple | None:
    """``cb2.5o64`` -> ("cb", 2.5, 64, None, 0, (False, False), None); ``cbe2.75o0ms024+vtt2.25`` -> ("cbe", 2.75, 0,
    "vtt", 2.25, (True, False), (0, 2, 4)); ``base`` -> None."""
    if row == "base":
        return None
    m = re.fullmatch(r"(cbg|cbe|cb|fix)(\d+(?:\.\d+)?)o(\d+)(m?)(g?)(?:s(\d+))?(?:\+(vtt|vt|vi)(\d+(?:\.\d+)?))?", row)
    if not m:
        raise SystemExit(f"bad row {row!r}: base or <cb|cbe|cbg|fix><key bits>o<outliers>[m][g][s<bit counts>][+<vi|vt|vtt><value bits>], e.g. cbe2.75o32")
    allowed = tuple(int(c) for c in m.group(6)) if m.group(6) else None
    quantizer = (bool(m.group(4)), bool(m.group(5)))  # (mad1, sigma grid): roundtrip's options
    return m.group(1), float(m.group(2)), int(m.group(3)), m.group(7), float(m.group(8) or 0), quantizer, allowed


def stored_bits(bits: torch.Tensor, outliers: int, block: int) -> torch.Tensor:
    """Key bits per element of a block and head with per-channel ``bits`` [..., D]: codes, 32 bits of minimum and step
    per coded channel or 16 of mean per uncoded one, and ``outliers`` exact elements at 32 bits each."""
    d = bits.shape[-1]
    side = torch.where(bits > 0, 32.0, 16.0)
    return ((bits * block + side).sum(-1) + 32 * outliers) / (block * d)


def model_errors(var: torch.Tensor) -> torch.Tensor:
    """The textbook error table [..., MAX_BITS + 1] of channels with variance ``var``: var * 4^-bits (the mean alone at 0)."""
    return var.unsqueeze(-1) * 0.25 ** torch.arange(MAX_BITS + 1, dtype=var.dtype)


def allocate(err: torch.Tensor, budget: float, outliers: int, block: int, allowed: tuple[int, ...] | None = None) -> torch.Tensor:
    """Integer bits [Hkv, D] per channel from each channel's expected error at 0..MAX_BITS bits ``err`` [Hkv, D, MAX_BITS + 1]:
    greedily the next one or two allowed bit counts (two where a measured table is not convex) that save the most error
    per stored bit, until ``budget`` bits per element are spent (per-block side data and outlier lists counted).
    ``allowed``: the bit counts a channel may take (all of 0..MAX_BITS by default)."""
    hkv, d, _ = err.shape
    ok = sorted(set(allowed if allowed is not None else range(MAX_BITS + 1)) | {0})
    # nexts[k][b]: the k-th allowed bit count above b (MAX_BITS + 1: none)
    nexts = [torch.tensor([([a for a in ok if a > b] + [MAX_BITS + 1] * 2)[k] for b in range(MAX_BITS + 1)]) for k in (0, 1)]
    padded = torch.cat([err, err[..., -1:]], dim=-1)  # index MAX_BITS + 1: unreachable, masked below
    bits = torch.zeros(hkv, d, dtype=torch.long)
    for h in range(hkv):
        spent = (16 * d + 32 * outliers) / block  # in bits per channel-row: every channel's mean, the outlier list
        cap = budget * d
        while True:
            best, pick = 0.0, None
            for nx in nexts:
                nxt = nx[bits[h]]
                cost = (nxt - bits[h]).float() + torch.where(bits[h] == 0, 16 / block, 0.0)  # a channel's first bit also buys its step
                gain = (padded[h].gather(-1, bits[h].unsqueeze(-1)) - padded[h].gather(-1, nxt.unsqueeze(-1))).squeeze(-1) / cost
                gain[(nxt > MAX_BITS) | (spent + cost > cap + 1e-9)] = -1
                c = int(gain.argmax())
                if gain[c] > best * (1 + 1e-9):
                    best, pick = float(gain[c]), (c, int(nxt[c]), float(cost[c]))
            if pick is None:
                break
            c, b_new, cost_c = pick
            bits[h, c] = b_new
            spent += cost_c
    return bits


def measured_errors(data, block: int, quantizer: tuple[bool, bool] = (False, False)) -> dict[int, torch.Tensor]:
    """Per layer: each channel's query-weighted squared error [Hkv, D, MAX_BITS + 1] when the calibration windows' keys
    go through this screen's block grid at 0..MAX_BITS bits (no outliers; the first block's sink rows counted too)."""
    out = {}
    for i, (k, w) in data.items():
        nw, s, hkv, d = k.shape
        blocks = k[:, : s - s % block].reshape(nw, s // block, block, hkv, d).reshape(-1, block, hkv, d).permute(0, 2, 1, 3)
        table = []
        for b in range(MAX_BITS + 1):
            hat = roundtrip(blocks, torch.full((hkv, d), b, dtype=torch.long), w, 0, 0, *quantizer)
            table.append(((hat - blocks) ** 2).mean(dim=(0, 2)) * w)
        out[i] = torch.stack(table, dim=-1)
    return out


def block_variances(data, block: int, skip: int) -> dict[int, torch.Tensor]:
    """Per layer: the within-block variance [Hkv, D] of query-weighted pre-RoPE keys over the calibration windows."""
    out = {}
    for i, (k, w) in data.items():
        nw, s, hkv, d = k.shape
        kb = k[:, : s - s % block].reshape(nw, s // block, block, hkv, d) * w.sqrt()
        keep = torch.ones(1, s // block, block, 1, 1)
        keep[:, 0, :skip] = 0  # the first block's sink rows stay fp16
        n = keep.sum(2, keepdim=True)
        mu = (kb * keep).sum(2, keepdim=True) / n
        out[i] = (((kb - mu) ** 2) * keep).sum(dim=(0, 1, 2)) / (nw * n.sum())
    return out


def value_weights(model, num_kv_heads: int, head_dim: int) -> dict[int, torch.Tensor]:
    """Per layer: each value channel's weight [Hkv, D] -- the squared norm of the o_proj columns that read it, summed
    over the query heads sharing the KV head."""
    return {i: layer.self_attn.o_proj.weight.detach().float().pow(2).sum(0).reshape(num_kv_heads, -1, head_dim).sum(1)
            for i, layer in enumerate(model.model.layers)}


def value_bases(data, block: int, skip: int, rotate: bool, centered: bool = True) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer: (basis [Hkv, D, D], sqrt weights [Hkv, D], variance per basis channel [Hkv, D]) of the weighted values'
    within-block covariance; ``rotate``: its eigenvectors (the KLT), else the identity."""
    out = {}
    for i, (v, u) in data.items():
        nw, s, hkv, d = v.shape
        sw = u.clamp_min(1e-12).sqrt()
        vb = v[:, skip : s - (s - skip) % block].reshape(nw, -1, block, hkv, d) * sw
        vb = (vb - vb.mean(2, keepdim=True) if centered else vb).reshape(-1, hkv, d)  # per-token grids have no zero-point
        cov = torch.einsum("nhc,nhe->hce", vb, vb) / vb.shape[0]
        if rotate:
            var, basis = torch.linalg.eigh(cov)
        else:
            basis, var = torch.eye(d).expand(hkv, d, d).clone(), torch.diagonal(cov, dim1=-2, dim2=-1)
        out[i] = (basis, sw, var.clamp_min(1e-12))
    return out


def gaussian_levels(bits: int, iters: int = 60) -> torch.Tensor:
    """The 2^bits Lloyd-Max levels of a standard normal (fixed, not fitted to any text)."""
    x = torch.linspace(-6, 6, 24001, dtype=torch.float64)
    p = torch.exp(-x * x / 2)
    lv = torch.linspace(-2, 2, 1 << bits, dtype=torch.float64) if bits else torch.zeros(1, dtype=torch.float64)
    for _ in range(iters):
        idx = (x.unsqueeze(1) - lv).abs().argmin(1)
        lv = torch.stack([(x * p)[idx == j].sum() / p[idx == j].sum().clamp_min(1e-30) for j in range(len(lv))])
    return lv.float()


LEVELS = {b: gaussian_levels(b) for b in range(0, 6)}


def token_roundtrip(z: torch.Tensor, bits: torch.Tensor, sd: torch.Tensor) -> torch.Tensor:
    """Values [B, H, n, D] in the weighted basis, per token: channels standardized by their calibrated std ``sd`` [H, D],
    one fp16 RMS per token and head over the coded channels, each channel through the Gaussian Lloyd-Max levels of its
    ``bits`` [H, D] (0 bits: zero)."""
    y = z / sd.unsqueeze(-2)
    coded = (bits > 0).unsqueeze(-2)
    rms = (y.pow(2) * coded).sum(-1, keepdim=True).div(coded.sum(-1, keepdim=True).clamp_min(1)).sqrt().clamp_min(1e-6).half().float()
    t = y / rms
    out = torch.zeros_like(t)
    for b in range(1, int(bits.max()) + 1):
        sel = (bits == b).unsqueeze(-2).expand_as(t)
        lv = LEVELS[b] if b in LEVELS else torch.linspace(-3, 3, 1 << b)
        q = lv[(t.unsqueeze(-1) - lv).abs().argmin(-1)]
        out = torch.where(sel, q, out)
    return out * rms * sd.unsqueeze(-2)


# the MSE-optimal step of a uniform quantizer of 2^b levels for a standard normal (Max, 1960), b = 2..8
GAUSS_STEP = {2: 0.9957, 3: 0.5860, 4: 0.3352, 5: 0.1881, 6: 0.1041, 7: 0.0569, 8: 0.0308}


def roundtrip(pre: torch.Tensor, bits: torch.Tensor, w: torch.Tensor, n_out: int, sink_rows: int, mad1: bool = False,
              sigma_grid: bool = False) -> torch.Tensor:
    """Pre-RoPE keys [B, H, n, D] of one sealed block through per-channel grids of ``bits`` [H, D] bits (min / step in
    fp16, the mean alone at 0 bits) with ``n_out`` exact elements per head; sink rows come back unchanged. ``mad1``:
    1-bit channels as mean +- mean absolute deviation (the same two fp16 numbers) instead of their extremes;
    ``sigma_grid``: channels of 2+ bits on a grid centered on the mean with the Gaussian-optimal step for their std
    (clipping the tails) instead of spanning their extremes."""
    b, h, n, d = pre.shape
    x = pre.float()
    bulk = torch.ones(b, h, n, d, dtype=torch.bool)
    bulk[:, :, :sink_rows] = False
    cnt = bulk.sum(2, keepdim=True).clamp_min(1)
    mu = (x * bulk).sum(2, keepdim=True) / cnt
    bits_v = bits.view(1, h, 1, d)
    if n_out:
        # the elements that would stretch their channel's grid most: weighted deviation over the channel's levels
        score = w.view(1, h, 1, d) * (x - mu) ** 2 / 4.0 ** bits_v
        score = score.masked_fill(~bulk, -1.0)
        top = score.reshape(b, h, n * d).topk(n_out, dim=-1).indices
        out_mask = torch.zeros(b, h, n * d, dtype=torch.bool).scatter_(-1, top, True).view(b, h, n, d)
        bulk &= ~out_mask
        cnt = bulk.sum(2, keepdim=True).clamp_min(1)
        mu = (x * bulk).sum(2, keepdim=True) / cnt
    big = torch.finfo(torch.float32).max
    lo = torch.where(bulk, x, big).amin(2, keepdim=True)
    hi = torch.where(bulk, x, -big).amax(2, keepdim=True)
    lo = torch.where(cnt > 0, lo, mu).half().float()
    levels = (2.0**bits_v - 1).clamp_min(1)
    step = ((hi - lo) / levels).clamp_min(1e-6).half().float()
    codes = ((x - lo) / step).round().clamp(torch.zeros_like(levels), levels)
    hat = torch.where(bits_v > 0, lo + codes * step, mu.half().float())
    if sigma_grid:
        sd = (((x - mu) ** 2) * bulk).sum(2, keepdim=True).div(cnt).sqrt().half().float()
        gstep = torch.zeros_like(bits_v, dtype=torch.float32)
        for b, c in GAUSS_STEP.items():
            gstep = torch.where(bits_v == b, c, gstep)
        gstep = (gstep * sd).clamp_min(1e-6).half().float()
        half = levels / 2  # levels = 2^b - 1, the largest code
        j = ((x - mu.half().float()) / gstep + half).round().clamp(torch.zeros_like(levels), levels)
        hat = torch.where(bits_v >= 2, mu.half().float() + (j - half) * gstep, hat)
    if mad1:
        mad = ((x - mu).abs() * bulk).sum(2, keepdim=True).div(cnt).half().float()
        mh = mu.half().float()
        hat = torch.where(bits_v == 1, torch.where(x >= mh, mh + mad, mh - mad), hat)
    if n_out:
        hat = torch.where(out_mask, x.half().float(), hat)
    hat[:, :, :sink_rows] = x[:, :, :sink_rows]
    return hat


def seal(store, x: torch.Tensor, start: int, layer: int) -> torch.Tensor | None:
    """The row's round trip for sealed keys (and values, with a ``+v`` suffix) -- screen_setup.swap_seal's hook."""
    from trtkv.rope import rotate

    row = STATE["row"]
    if row is None:
        return None
    bs = store.block_size
    sinks = lambda s: store.sink_tokens if start + s == 0 else 0  # the first block's sink rows stay fp16
    if store.fmt is store.kv_fmt.v:
        if not row[3]:
            return None
        basis, sw, vbits, vsd = STATE["values"][layer]
        z = torch.einsum("bhnc,hce->bhne", x.float() * sw.view(1, -1, 1, sw.shape[-1]), basis)
        if row[3] == "vtt":
            zhat = token_roundtrip(z, vbits, vsd)
        else:
            zhat = torch.cat([roundtrip(z[:, :, s : s + bs], vbits, torch.ones_like(sw), 0, sinks(s)) for s in range(0, z.shape[2], bs)], dim=2)
        hat = (torch.einsum("bhne,hce->bhnc", zhat, basis) / sw.view(1, -1, 1, sw.shape[-1])).to(x.dtype)
        hat[:, :, : sinks(0)] = x[:, :, : sinks(0)]
        return hat
    cos, sin = store.rope.rows(start, x.shape[2], x.device)
    pre = rotate(x.float(), cos, sin, inverse=True)
    parts = [roundtrip(pre[:, :, s : s + bs], STATE["bits"][layer], STATE["weights"][layer], row[2], sinks(s), *row[5]) for s in range(0, pre.shape[2], bs)]
    return rotate(torch.cat(parts, dim=2), cos, sin).to(x.dtype)


def main(argv: list[str] | None = None) -> None:
    from screen_setup import add_screen_args, load_screened, measure_rows, swap_seal

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_screen_args(p)
    p.add_argument("--rows", default="base,fix2o64,cb2.5o64")
    p.add_argument("--json")
    args = p.parse_args(argv)

    from screen_key_vq import collect

    from trtkv.data import token_windows
    from trtkv.evaluate import perplexity
    from trtkv.formats import get_format

    swap_seal(seal)
    screened = load_screened(args.calibration)
    art, info, tok, model = screened.art, screened.info, screened.tokenizer, screened.model
    fmt = get_format(art.definition(args.kv))
    if not fmt.k.pre_rope:
        raise SystemExit(f"--kv {args.kv}: its keys are not prerope; pass a format with prerope keys (int2-nuq)")
    params = art.params_for(fmt, info)
    rows = [(r, parse_row(r)) for r in args.rows.split(",")]
    head_dim, bs = info.head_dim, fmt.block_size

    t0 = time.perf_counter()
    fit_ids = token_windows(tok, args.fit_dataset, seq_len=args.fit_seq_len, samples=args.fit_windows, seed=0, split="calib")
    value_kinds = {row[3] for _, row in rows if row is not None and row[3]}
    vals: dict[int, list] = {}  # value rows: the values of the same pass over the calibration windows
    also = {"v_proj": lambda i, out: vals.setdefault(i, []).append(out.float().reshape(out.shape[0], out.shape[1], info.num_kv_heads, head_dim))}
    data = collect(model, fit_ids, fmt.sink_tokens, also if value_kinds else None)
    var = block_variances(data, bs, fmt.sink_tokens)
    errors = {q: measured_errors(data, bs, q) for q in {row[5] for _, row in rows if row is not None and row[0] == "cbe"}}
    weights = {i: w for i, (_, w) in data.items()}
    data = None
    bases = {}
    if value_kinds:
        u = value_weights(model, info.num_kv_heads, head_dim)
        vdata = {i: (torch.cat(v), u[i]) for i, v in vals.items()}
        bases = {kind: value_bases(vdata, bs, fmt.sink_tokens, rotate=kind != "vi", centered=kind != "vtt") for kind in value_kinds}
        vdata = vals = None
    values_of: dict = {}
    print(f"statistics of {fit_ids.numel()} tokens in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    bits_of: dict = {}
    for r, row in rows:
        if row is None:
            continue
        kind, k, n_out = row[:3]
        if kind == "fix":
            bits_of[r] = {i: torch.full_like(v, int(k), dtype=torch.long) for i, v in var.items()}
        elif kind == "cbg":  # one pool over every layer's heads: bits go where the weighted variance is, whichever layer
            layers = sorted(var)
            pooled = allocate(model_errors(torch.cat([var[i] for i in layers]).reshape(1, -1)), k, n_out * len(layers) * var[layers[0]].shape[0], bs)
            bits_of[r] = dict(zip(layers, pooled.reshape(len(layers), *var[layers[0]].shape).unbind(0)))
        elif kind == "cbe":
            bits_of[r] = {i: allocate(e, k, n_out, bs, row[6]) for i, e in errors[row[5]].items()}
        else:
            bits_of[r] = {i: allocate(model_errors(v), k, n_out, bs, row[6]) for i, v in var.items()}
        if row[3]:
            vb = bases[row[3]]
            if row[3] == "vtt":  # per token: 16 bits of scale per token and head, no per-channel side data
                values_of[r] = {i: (basis, sw, allocate(model_errors(vv), row[4] - 16 / vv.shape[-1], 0, 1 << 30), vv.sqrt()) for i, (basis, sw, vv) in vb.items()}
            else:
                values_of[r] = {i: (basis, sw, allocate(model_errors(vv), row[4], 0, bs), vv.sqrt()) for i, (basis, sw, vv) in vb.items()}

    ids = token_windows(tok, args.dataset, seq_len=args.seq_len, samples=args.windows, seed=0, split="eval")

    def use(name: str | None) -> None:
        STATE.update(row=parsed.get(name), bits=bits_of.get(name, {}), values=values_of.get(name, {}))

    parsed = dict(rows)
    STATE["weights"] = weights
    base_ppl, measured = measure_rows(model, ids, fmt, params, [r for r, _ in rows], args.batch_size, use)
    fmt_v_bits = fmt.v.bits_per_element(head_dim, bs)
    out = {"args": vars(args), "fp16_ppl": base_ppl, "v_bits": fmt_v_bits, "rows": []}
    print(f"fp16 ppl {base_ppl:.4f}  values of {args.kv} ({fmt_v_bits:.3f} bits) unless a row says otherwise  {args.dataset} {args.windows}x{args.seq_len}")
    for r, row in rows:
        nll, kld, top1 = measured[r]
        if row is None:
            kb = fmt.k.bits_per_element(head_dim, bs)
            hist = None
        else:
            kb = torch.stack([stored_bits(b, row[2], bs) for b in bits_of[r].values()]).mean().item()
            hist = torch.bincount(torch.stack(list(bits_of[r].values())).flatten(), minlength=MAX_BITS + 1).tolist()
        v_bits = fmt_v_bits
        if row is not None and row[3]:
            per_token = row[3] == "vtt"
            v_bits = torch.stack([b.sum(-1).float() / b.shape[-1] + 16 / b.shape[-1] if per_token else stored_bits(b, 0, bs)
                                  for _, _, b, _ in values_of[r].values()]).mean().item()
        res = {"row": r, "k_bits": kb, "v_bits": v_bits, "pool_bits": (kb + v_bits) / 2, "dppl_pct": 100 * (perplexity(nll) / base_ppl - 1),
               "kl": kld.mean().item(), "top1": top1.float().mean().item(), "channels_per_bits": hist}
        out["rows"].append(res)
        print(f"{r:10s} k {kb:.3f} v {v_bits:.3f} pool {res['pool_bits']:.3f} bits  dppl {res['dppl_pct']:+.3f} %  KL {res['kl']:.5f}  "
              f"top1 {100 * res['top1']:.2f}  channels at 0..{MAX_BITS} bits {hist}")
    if args.json:
        out["bits"] = {r: {i: b.tolist() for i, b in v.items()} for r, v in bits_of.items()}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
