"""Screen (issue 27): does subtracting the key noise's softmax inflation from sealed tokens' logits pay?

A zero-mean error e on an attention logit inflates that token's softmax weight on average by E[exp(e)] = exp(var/2);
every quantized (sealed) key is inflated, the fp16 sinks and open block are not, so the longer the context the more
mass moves to quantized tokens. This screen replaces the model's attention in this process with one that adds
``-c * var / 2`` to the logits of sealed non-sink keys, ``var`` per query and head, estimated three ways:

- ``oracle``: the mean squared logit error over the query's visible sealed keys (needs the true keys: upper bound);
- ``channel``: scaling^2 * sum_c q_c^2 * var_c with var_c each KV head's per-channel key error variance measured on
  the same window (the deployable form, constants measured instead of calibrated);
- ``calib``: the same with var_c measured on calibration windows of ``--calib-dataset`` (what a product would store per
  layer);
- ``block`` / ``token``: var from each sealed block's (each key's) own per-channel error: a per-key oracle.

    python bench/screen_logit_bias.py --calibration CAL --kv int2-nuq --dataset builtin:pydoc --seq-len 2048 --windows 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

STATE: dict = {"mode": None, "c": 0.0, "var": {}, "collect": None}
REC: dict = {}  # layer_idx -> (layer object, list of true key chunks)


def _patch_cache() -> None:
    from trtkv.kv_cache import QuantizedKVCache

    orig = QuantizedKVCache.update

    def update(self, key_states, value_states, layer_idx, *a, **k):
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        out = orig(self, key_states, value_states, layer_idx, *a, **k)
        layer = self.layers[layer_idx]
        have = REC.get(layer_idx)
        if have is None or have[0] is not layer:
            REC[layer_idx] = (layer, [])
        REC[layer_idx][1].append(key_states.detach().float())
        return out

    QuantizedKVCache.update = update


def _sealed_range(layer) -> tuple[int, int]:
    store = layer.k_store
    if not store.fmt.is_quantized or store.quantized is None:
        return 0, 0
    return store.sink_tokens, store.quantized.codes.shape[2]


def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    """Eager attention in float32 with the sealed keys' logits lowered by c * var / 2."""
    b, hq, sq, d = query.shape
    hkv, sk = key.shape[1], key.shape[2]
    g = hq // hkv
    q = query.float()
    k = key.float().repeat_interleave(g, dim=1)
    v = value.float().repeat_interleave(g, dim=1)
    logits = q @ k.transpose(-1, -2) * scaling
    qpos = torch.arange(sk - sq, sk).view(sq, 1)
    visible = torch.arange(sk).view(1, sk) <= qpos  # [sq, sk]
    rec = REC.get(module.layer_idx)
    lo, hi = _sealed_range(rec[0]) if rec is not None else (0, 0)
    if hi > lo:
        true_k = torch.cat(rec[1], dim=2)[:, :, :sk]
        err = (key.float() - true_k)[:, :, lo:hi]  # [b, hkv, n, d]
        if STATE["collect"] is not None:
            acc = STATE["collect"].setdefault(module.layer_idx, [torch.zeros(hkv, d, dtype=torch.float64), 0])
            acc[0] += err.double().pow(2).sum(dim=(0, 2))
            acc[1] += err.shape[0] * err.shape[2]
        mode, c = STATE["mode"], STATE["c"]
        if mode and c:
            sealed = torch.zeros(sk, dtype=torch.bool)
            sealed[lo:hi] = True
            cols = visible & sealed  # [sq, sk]
            if mode in ("block", "token"):
                e2 = err.pow(2)  # [b, hkv, n, d]
                if mode == "block":
                    bs = rec[0].k_store.block_size
                    n0 = lo - lo % bs  # the first sealed block starts at 0; its sink rows carry no error
                    e2 = torch.cat([torch.zeros_like(e2[:, :, : lo - n0]), e2], dim=2)
                    nb = e2.shape[2] // bs
                    e2 = e2.reshape(b, hkv, nb, bs, d).mean(3).repeat_interleave(bs, dim=2)[:, :, lo - n0 :]
                var = (q.pow(2) @ e2.repeat_interleave(g, dim=1).transpose(-1, -2)) * scaling**2  # [b, hq, sq, n]
                bias = torch.zeros(b, hq, sq, sk)
                bias[..., lo:hi] = c * var / 2
                logits = logits - bias * cols.float()
            elif mode == "oracle":
                e = (q @ err.repeat_interleave(g, dim=1).transpose(-1, -2)) * scaling  # [b, hq, sq, n]
                m = cols[:, lo:hi].float()
                var = (e.pow(2) * m).sum(-1) / m.sum(-1).clamp_min(1)
            else:
                if mode == "channel":
                    var_c = err.pow(2).mean(dim=2)  # [b, hkv, d]
                else:
                    var_c = STATE["var"][module.layer_idx].float().unsqueeze(0)  # [1, hkv, d]
                var = (q.pow(2) * var_c.repeat_interleave(g, dim=1).unsqueeze(2)).sum(-1) * scaling**2  # [b, hq, sq]
            if mode not in ("block", "token"):
                logits = logits - (c * var / 2).unsqueeze(-1) * cols.float()
    logits = logits.masked_fill(~visible, float("-inf"))
    w = torch.softmax(logits, dim=-1)
    out = (w @ v).to(query.dtype).transpose(1, 2).contiguous()
    return out, None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibration", required=True)
    p.add_argument("--kv", required=True)
    p.add_argument("--dataset", default="builtin:pydoc")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--calib-windows", type=int, default=2)
    p.add_argument("--calib-dataset", default="builtin:pydoc", help="where ``calib`` measures the key error (the calibration's text)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--rows", default="none:0,oracle:1,channel:1,calib:1")
    p.add_argument("--json")
    args = p.parse_args(argv)

    from screen_setup import load_screened
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from trtkv.data import token_windows
    from trtkv.evaluate import _Acc, model_logits, perplexity
    from trtkv.formats import get_format

    _patch_cache()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = attention
    screened = load_screened(args.calibration)
    art, info, tok, model = screened.art, screened.info, screened.tokenizer, screened.model
    fmt = get_format(art.definition(args.kv))
    params = art.params_for(fmt, info)

    calib = token_windows(tok, args.calib_dataset, seq_len=args.seq_len, samples=args.calib_windows, seed=0, split="calib")
    STATE["collect"], STATE["mode"] = {}, None
    for i in range(calib.shape[0]):
        REC.clear()
        model_logits(model, calib[i : i + 1], fmt, params)
    STATE["var"] = {layer: s / n for layer, (s, n) in STATE["collect"].items()}
    STATE["collect"] = None

    ids = token_windows(tok, args.dataset, seq_len=args.seq_len, samples=args.windows, seed=0, split="eval")
    rows = [(r.split(":")[0], float(r.split(":")[1])) for r in args.rows.split(",")]
    accs = {r: _Acc.empty() for r in rows}
    base = _Acc.empty()
    for start in range(0, ids.shape[0], args.batch_size):
        batch = ids[start : start + args.batch_size]
        STATE["mode"] = None
        REC.clear()
        ref = model_logits(model, batch, "fp16")[:, :-1]
        base.add(ref, ref, batch[:, 1:])
        for r in rows:
            STATE["mode"], STATE["c"] = r
            REC.clear()
            accs[r].add(ref, model_logits(model, batch, fmt, params)[:, :-1], batch[:, 1:])
        print(f"windows {start + len(batch)}/{ids.shape[0]}", file=sys.stderr, flush=True)
    base_ppl = perplexity(base.tensors()[0])
    out = {"args": vars(args), "fp16_ppl": base_ppl, "rows": []}
    print(f"fp16 ppl {base_ppl:.4f}  {args.kv} {args.dataset} {args.windows}x{args.seq_len}")
    for r in rows:
        nll, kld, top1 = accs[r].tensors()
        ppl = perplexity(nll)
        row = {"mode": r[0], "c": r[1], "dppl_pct": 100 * (ppl / base_ppl - 1), "kl": kld.mean().item(), "top1": top1.float().mean().item()}
        out["rows"].append(row)
        print(f"{r[0]:8s} c={r[1]:<4} dppl {row['dppl_pct']:+.3f} %  KL {row['kl']:.5f}  top1 {100 * row['top1']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
