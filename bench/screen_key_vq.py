"""Screen (issue 27): keys through a vector codebook over coupled channels instead of a per-channel grid.

At 2 bits a per-channel grid has 4 levels per channel and block; a codebook of 2^(b*g) points over g adjacent pre-RoPE
key channels (coupled quantization, as in "KV Cache is 1 Bit Per Channel", Zhang et al. 2024) spends the same bits on
the joint distribution, which pre-RoPE key channels have strongly correlated. The codebooks are fitted at calibration
(k-means per layer, KV head and channel group on pre-RoPE keys of calibration windows, each channel weighted by the
mean square of the queries that read it, averaged over its RoPE pair, so the distance is the expected squared logit
error) and are a per-layer constant like the value codebooks. Without per-block scales, or (``n``) with each sealed
block's keys standardized per head and channel first (an fp16 mean and std per block channel: 32 / block bits per
element, what the grid's scale and zero-point cost); optionally the ``N`` elements of each sealed block and head with
the largest weighted residual kept exactly (32 bits each, like ``outN``).

This process swaps the eval cache's key seal for the codebook round trip (values stay in ``--kv``'s value format,
sinks and the open block in fp16), every row from one run on the same windows:

    python bench/screen_key_vq.py --calibration CAL --kv int2-nuq --dataset builtin:pydoc --seq-len 512 --windows 8 \
        --rows base,vq4x8no64,vq4x9no64 --json out.json

A row ``vq{g}x{b}[n][o{N}]``: groups of ``g`` channels, ``b``-bit codes (2^b points), ``n`` per-block standardization,
``N`` exact outliers per block and head; ``base`` is ``--kv`` itself. Fitted codebooks are kept under ``--books``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

STATE: dict = {"row": None, "books": {}}  # books: layer -> fit()'s (codebooks, sqrt weights, sqrt query weights) of the row


def parse_row(row: str) -> tuple[int, int, int, bool] | None:
    """``vq4x8no64`` -> (group 4, 8-bit codes, 64 outliers, per-block normalization); ``base`` -> None."""
    if row == "base":
        return None
    m = re.fullmatch(r"vq(\d+)x(\d+)(n?)(?:o(\d+))?", row)
    if not m:
        raise SystemExit(f"bad row {row!r}: base or vq<group>x<bits>[n][o<outliers>], e.g. vq4x8no64")
    return int(m.group(1)), int(m.group(2)), int(m.group(4) or 0), bool(m.group(3))


def key_bits(row, fmt, head_dim: int) -> float:
    if row is None:
        return fmt.k.bits_per_element(head_dim, fmt.block_size)
    g, b, n, norm = row
    return b / g + n * 32 / (fmt.block_size * head_dim) + (32 / fmt.block_size if norm else 0.0)


def block_stats(kb: torch.Tensor, skip: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block, head and channel: mean and std (fp16-rounded, as stored) of keys ``kb`` [..., bs, H, D] over the
    block's rows, the first block's first ``skip`` rows (its fp16 sinks) left out."""
    mask = torch.ones(kb.shape[:-2] + (1, 1))
    if skip:
        mask[..., 0, :skip, :, :] = 0  # only the first block of each window holds sinks
    cnt = mask.sum(-3, keepdim=True)
    mu = (kb * mask).sum(-3, keepdim=True) / cnt
    sd = (((kb - mu) ** 2) * mask).sum(-3, keepdim=True).div(cnt).sqrt().clamp_min(1e-4)
    return mu.half().float(), sd.half().float()


def kmeans(y: torch.Tensor, k: int, iters: int, gen: torch.Generator, chunk: int = 4096) -> torch.Tensor:
    """Centroids [G, k, g] of points ``y`` [G, N, g] (Lloyd's iterations from k random points; empty ones re-drawn)."""
    G, N, g = y.shape
    c = y[:, torch.randperm(N, generator=gen)[:k]].clone()
    for _ in range(iters):
        sums = torch.zeros_like(c)
        counts = torch.zeros(G, k)
        for s in range(0, N, chunk):
            part = y[:, s : s + chunk]
            idx = nearest(part, c)
            sums.scatter_add_(1, idx.unsqueeze(-1).expand(-1, -1, g), part)
            counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=counts.dtype))
        empty = counts == 0
        c = torch.where(empty.unsqueeze(-1), c, sums / counts.clamp_min(1).unsqueeze(-1))
        if empty.any():
            redraw = y[:, torch.randint(N, (k,), generator=gen)]
            c = torch.where(empty.unsqueeze(-1), redraw, c)
    return c


def nearest(y: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Index [G, n] of the centroid of ``c`` [G, k, g] nearest each point of ``y`` [G, n, g]."""
    return torch.baddbmm((c * c).sum(-1).unsqueeze(1), y, c.transpose(1, 2), alpha=-2).argmin(-1)


def collect(model, ids: torch.Tensor, skip: int, also: dict | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: pre-RoPE keys [W, S, Hkv, D] of each window and the mean square of the queries per KV head and channel
    [Hkv, D]. ``also``: more projection hooks for the same pass (screen_setup.run_with_hooks)."""
    from screen_setup import run_with_hooks

    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    keys: dict[int, list] = {}
    qsq: dict[int, list] = {}

    def k_hook(i, out):
        keys.setdefault(i, []).append(out.float().reshape(out.shape[0], out.shape[1], hkv, d))

    def q_hook(i, out):
        q = out.float().reshape(out.shape[0], out.shape[1], hkv, hq // hkv, d)[:, skip:]
        qsq.setdefault(i, []).append((q.pow(2).sum(dim=(0, 1, 3)), q.shape[0] * q.shape[1] * q.shape[3]))

    run_with_hooks(model, ids, {"k_proj": k_hook, "q_proj": q_hook, **(also or {})})
    out = {}
    for i in keys:
        w = sum(s for s, _ in qsq[i]) / sum(n for _, n in qsq[i])
        half = d // 2
        pair = (w[:, :half] + w[:, half:]) / 2  # RoPE mixes each pair (c, c + D/2): the error sees their mean
        out[i] = (torch.cat(keys[i]), torch.cat([pair, pair], dim=-1))
    return out


def fit(data, g: int, bits: int, norm: bool, block: int, skip: int, iters: int, seed: int) -> dict:
    """Per layer: (codebooks [Hkv, D/g, 2^bits, g] in the weighted space, sqrt weights of that space [Hkv, D], sqrt
    query weights [Hkv, D]); ``norm``: fitted to keys standardized per block, head and channel."""
    gen = torch.Generator().manual_seed(seed)
    books = {}
    for i, (k, w) in sorted(data.items()):
        nw, s, hkv, d = k.shape
        sq = w.clamp_min(1e-12).sqrt()
        if norm:
            kb = k[:, : s - s % block].reshape(nw, s // block, block, hkv, d)
            mu, sd = block_stats(kb, skip)
            pts = ((kb - mu) / sd).reshape(nw, -1, hkv, d)
            sw = (w * sd.pow(2).mean(dim=(0, 1, 2)).squeeze(0)).clamp_min(1e-12).sqrt()  # the error in key units, on average
        else:
            pts, sw = k, sq
        pts = pts[:, skip:].reshape(-1, hkv, d)
        y = (pts * sw).reshape(-1, hkv * d // g, g).transpose(0, 1).contiguous()  # [G, N, g]
        c = kmeans(y, 1 << bits, iters, gen)
        books[i] = (c.reshape(hkv, d // g, 1 << bits, g), sw, sq)
    return books


def roundtrip(pre: torch.Tensor, book, g: int, n_out: int, norm: bool, sink_rows: int) -> torch.Tensor:
    """Pre-RoPE keys [B, H, n, D] of one block through the codebooks (and ``n_out`` exact outliers per head)."""
    c, sw, sq = book
    b, h, n, d = pre.shape
    if norm:
        mu, sd = block_stats(pre.permute(0, 2, 1, 3).unsqueeze(1), sink_rows)  # [B, 1, 1, H, D]
        mu, sd = (t[:, 0].permute(0, 2, 1, 3) for t in (mu, sd))  # [B, H, 1, D]
    else:
        mu, sd = torch.zeros(1), torch.ones(1)
    y = (pre - mu) / sd * sw.view(1, h, 1, d)
    yg = y.reshape(b, h, n, d // g, g).permute(1, 3, 0, 2, 4).reshape(h * d // g, b * n, g)  # [G, B*n, g]
    cg = c.reshape(h * d // g, c.shape[2], g)
    idx = nearest(yg, cg)
    yhat = torch.gather(cg, 1, idx.unsqueeze(-1).expand(-1, -1, g))
    yhat = yhat.reshape(h, d // g, b, n, g).permute(2, 0, 3, 1, 4).reshape(b, h, n, d)
    khat = yhat / sw.view(1, h, 1, d) * sd + mu
    if n_out:
        r = ((pre - khat) * sq.view(1, h, 1, d)).pow(2)  # each element's share of the expected logit error
        r[:, :, :sink_rows] = 0  # sink rows stay fp16 anyway
        top = r.reshape(b, h, n * d).topk(n_out, dim=-1).indices
        flat = khat.reshape(b, h, n * d)
        flat.scatter_(-1, top, pre.reshape(b, h, n * d).gather(-1, top))
        khat = flat.reshape(b, h, n, d)
    return khat


def seal(store, x: torch.Tensor, start: int, layer: int) -> torch.Tensor | None:
    """The row's codebook round trip for sealed keys (screen_setup.swap_seal); values and ``base`` keep the format's."""
    from trtkv.rope import rotate

    row = STATE["row"]
    if row is None or store.fmt is not store.kv_fmt.k:
        return None
    g, _bits, n_out, norm = row
    cos, sin = store.rope.rows(start, x.shape[2], x.device)
    pre = rotate(x.float(), cos, sin, inverse=True)
    hat = roundtrip(pre, STATE["books"][layer], g, n_out, norm, store.sink_tokens if start == 0 else 0)
    return rotate(hat, cos, sin).to(x.dtype)


def main(argv: list[str] | None = None) -> None:
    from screen_setup import add_screen_args, load_screened, measure_rows, swap_seal

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_screen_args(p)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--books", default=str(Path.home() / ".cache/trtkv/screen-key-vq"), help="where fitted codebooks are kept")
    p.add_argument("--rows", default="base,vq4x8,vq4x8o64,vq4x8no64,vq4x9no64")
    p.add_argument("--json")
    args = p.parse_args(argv)


    from trtkv.data import token_windows
    from trtkv.evaluate import perplexity
    from trtkv.formats import get_format

    swap_seal(seal)
    screened = load_screened(args.calibration)
    art, info, tok, model, name = screened.art, screened.info, screened.tokenizer, screened.model, screened.name
    fmt = get_format(art.definition(args.kv))
    if not fmt.k.pre_rope:
        raise SystemExit(f"--kv {args.kv}: its keys are not prerope; pass a format with prerope keys (int2-nuq)")
    params = art.params_for(fmt, info)
    rows = [(r, parse_row(r)) for r in args.rows.split(",")]
    head_dim = info.head_dim

    data = None
    fitted: dict = {}  # tag -> books, one fit per codebook shape
    books_of: dict = {}  # row -> its books
    for r, row in rows:
        if row is None:
            continue
        g, bits, _, norm = row
        tag = f"g{g}b{bits}{'n' if norm else ''}"
        if tag in fitted:
            books_of[r] = fitted[tag]
            continue
        path = Path(args.books) / f"{name.replace('/', '_')}-{args.fit_dataset.replace(':', '_')}-{args.fit_windows}x{args.fit_seq_len}-{tag}-i{args.iters}-v2.pt"
        if path.exists():
            books = torch.load(path)
        else:
            if data is None:
                t0 = time.perf_counter()
                fit_ids = token_windows(tok, args.fit_dataset, seq_len=args.fit_seq_len, samples=args.fit_windows, seed=0, split="calib")
                data = collect(model, fit_ids, fmt.sink_tokens)
                print(f"collected {fit_ids.numel()} keys per layer in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            books = fit(data, g, bits, norm, fmt.block_size, fmt.sink_tokens, args.iters, seed=0)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(books, path)
            print(f"fitted {tag} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        fitted[tag] = books_of[r] = books
    data = None

    ids = token_windows(tok, args.dataset, seq_len=args.seq_len, samples=args.windows, seed=0, split="eval")

    def use(name: str | None) -> None:
        STATE.update(row=parsed.get(name), books=books_of.get(name, {}))

    parsed = dict(rows)
    base_ppl, measured = measure_rows(model, ids, fmt, params, [r for r, _ in rows], args.batch_size, use)
    v_bits = fmt.v.bits_per_element(head_dim, fmt.block_size)
    out = {"args": vars(args), "fp16_ppl": base_ppl, "v_bits": v_bits, "rows": []}
    print(f"fp16 ppl {base_ppl:.4f}  values of {args.kv} ({v_bits:.3f} bits)  {args.dataset} {args.windows}x{args.seq_len}")
    for r, row in rows:
        nll, kld, top1 = measured[r]
        ppl = perplexity(nll)
        kb = key_bits(row, fmt, head_dim)
        res = {"row": r, "k_bits": kb, "pool_bits": (kb + v_bits) / 2, "dppl_pct": 100 * (ppl / base_ppl - 1),
               "kl": kld.mean().item(), "top1": top1.float().mean().item()}
        out["rows"].append(res)
        print(f"{r:10s} k {kb:.3f} pool {res['pool_bits']:.3f} bits  dppl {res['dppl_pct']:+.3f} %  KL {res['kl']:.5f}  top1 {100 * res['top1']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
