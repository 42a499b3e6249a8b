"""Screen (issue 27): key bits chosen per KV head instead of per layer.

The ``--budget bits=2.5`` mix spends its spare bits on int3 keys in whole layers. SmolLM2 has 3 KV heads per layer;
if the key error that matters sits in one head of a layer, upgrading that head alone buys the same for a third of the
bits. This screen measures it with one rule at both granularities: each unit's gain is the drop in KL on calibration
windows when that unit alone (one layer's keys, or one head's) is stored in ``--wide`` instead of ``--narrow``; the
units with the largest gains are upgraded until ``--units`` layers' worth of keys are (``3 * units`` heads), and both
allocations are measured on held-out windows beside the narrow format, every row from one run. Values, sinks and blocks
stay the narrow format's; the wide keys come from a second cache of ``--wide`` in the same process.

    python bench/screen_head_bits.py --calibration CAL --units 7 --dataset builtin:pydoc --seq-len 2048 --windows 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

STATE: dict = {"layer": None, "wide": None}  # wide: layer -> bool [Hkv] (heads whose keys are read from the wide cache)
WIDE: dict = {}  # fmt, params, rope of the wide format


def _patch() -> None:
    from trtkv.kv_cache import QuantizedKVCache, QuantizedKVLayer

    orig_cache_update, orig_layer_update = QuantizedKVCache.update, QuantizedKVLayer.update

    def cache_update(self, key_states, value_states, layer_idx, *a, **k):
        STATE["layer"] = layer_idx
        return orig_cache_update(self, key_states, value_states, layer_idx, *a, **k)

    def layer_update(self, key_states, value_states, *a, **k):
        keys, values = orig_layer_update(self, key_states, value_states, *a, **k)
        i = STATE["layer"]
        heads = None if STATE["wide"] is None else STATE["wide"].get(i)
        if heads is not None and bool(heads.any()):
            shadow = getattr(self, "_wide", None)
            if shadow is None:
                shadow = self._wide = QuantizedKVLayer(WIDE["fmt"].layer(i), WIDE["params"][i], WIDE["rope"])
            wide_keys, _ = orig_layer_update(shadow, key_states, value_states)
            keys = torch.where(heads.view(1, -1, 1, 1), wide_keys, keys)
        return keys, values

    QuantizedKVCache.update, QuantizedKVLayer.update = cache_update, layer_update


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibration", required=True, help="an artifact calibrated for --narrow and --wide")
    p.add_argument("--narrow", default="int2-nuq")
    p.add_argument("--wide", default="int3-nuq")
    p.add_argument("--units", type=int, default=7, help="layers' worth of keys upgraded (3x as many heads at 3 KV heads)")
    p.add_argument("--search-windows", type=int, default=2)
    p.add_argument("--search-seq-len", type=int, default=512)
    p.add_argument("--dataset", action="append", help="held-out text(s); default pydoc and shakespeare")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--gains", help="a file keeping the search's gains: read when it exists, else written")
    p.add_argument("--json")
    args = p.parse_args(argv)

    from screen_setup import load_screened

    from trtkv.data import token_windows
    from trtkv.evaluate import _Acc, model_logits, perplexity
    from trtkv.formats import get_format
    from trtkv.rope import RopeTable

    _patch()
    screened = load_screened(args.calibration)
    art, info, tok, model = screened.art, screened.info, screened.tokenizer, screened.model
    narrow, wide = get_format(art.definition(args.narrow)), get_format(art.definition(args.wide))
    if (narrow.block_size, narrow.sink_tokens) != (wide.block_size, wide.sink_tokens):
        raise SystemExit("--narrow and --wide must share block size and sinks")
    params = art.params_for(narrow, info)
    WIDE.update(fmt=wide, params=art.params_for(wide, info), rope=RopeTable.of(model) if wide.needs_rope else None)
    layers, hkv, head_dim = info.num_layers, info.num_kv_heads, info.head_dim

    def kl_of(ids, ref, wide_heads) -> float:
        STATE["wide"] = wide_heads
        acc = _Acc.empty()
        acc.add(ref, model_logits(model, ids, narrow, params)[:, :-1], ids[:, 1:])
        STATE["wide"] = None
        return acc.tensors()[1].mean().item()

    def mask(units: list[tuple[int, int | None]]) -> dict:
        m = {i: torch.zeros(hkv, dtype=torch.bool) for i in range(layers)}
        for i, h in units:
            if h is None:
                m[i][:] = True
            else:
                m[i][h] = True
        return m

    def search_gains() -> tuple[float, dict]:
        """KL of the narrow format on the search windows, and each unit's drop in KL when its keys alone are wide."""
        search = token_windows(tok, "builtin:pydoc", seq_len=args.search_seq_len, samples=args.search_windows, seed=0, split="calib")
        ref = model_logits(model, search, "fp16")[:, :-1]
        base = kl_of(search, ref, None)
        gains: dict = {}
        for i in range(layers):
            gains[(i, None)] = base - kl_of(search, ref, mask([(i, None)]))
            for h in range(hkv):
                gains[(i, h)] = base - kl_of(search, ref, mask([(i, h)]))
            print(f"layer {i}: {gains[(i, None)]:+.5f} whole, heads " + " ".join(f"{gains[(i, h)]:+.5f}" for h in range(hkv)),
                  file=sys.stderr, flush=True)
        return base, gains

    t0 = time.perf_counter()
    gains_file = Path(args.gains) if args.gains else None
    if gains_file is not None and gains_file.exists():
        saved = json.loads(gains_file.read_text())
        gains = {(int(i), None if h == "all" else int(h)): g for i, h, g in saved["gains"]}
        base = saved["base"]
    else:
        base, gains = search_gains()
        if gains_file is not None:
            gains_file.write_text(json.dumps({"base": base, "gains": [[i, "all" if h is None else h, g] for (i, h), g in gains.items()]}))
    print(f"search in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    by_layer = sorted((u for u in gains if u[1] is None), key=lambda u: -gains[u])[: args.units]
    by_head = sorted((u for u in gains if u[1] is not None), key=lambda u: -gains[u])[: args.units * hkv]
    allocs = {"narrow": [], "layers": by_layer, "heads": by_head}

    kb_n = narrow.k.bits_per_element(head_dim, narrow.block_size)
    kb_w = wide.k.bits_per_element(head_dim, wide.block_size)
    vb = narrow.v.bits_per_element(head_dim, narrow.block_size)
    out = {"args": vars(args), "search_base_kl": base, "gains": {f"{i}:{'all' if h is None else h}": g for (i, h), g in gains.items()},
           "allocations": {k: [[i, h] for i, h in v] for k, v in allocs.items()}, "results": []}
    for dataset in args.dataset or ["builtin:pydoc", "builtin:shakespeare"]:
        ids = token_windows(tok, dataset, seq_len=args.seq_len, samples=args.windows, seed=0, split="eval")
        accs = {k: _Acc.empty() for k in allocs}
        ref_acc = _Acc.empty()
        for s in range(0, ids.shape[0], args.batch_size):
            batch = ids[s : s + args.batch_size]
            ref = model_logits(model, batch, "fp16")[:, :-1]
            ref_acc.add(ref, ref, batch[:, 1:])
            for k, units in allocs.items():
                STATE["wide"] = mask(units) if units else None
                accs[k].add(ref, model_logits(model, batch, narrow, params)[:, :-1], batch[:, 1:])
                STATE["wide"] = None
            print(f"{dataset} windows {s + len(batch)}/{ids.shape[0]}", file=sys.stderr, flush=True)
        base_ppl = perplexity(ref_acc.tensors()[0])
        print(f"{dataset} {args.windows}x{args.seq_len}: fp16 ppl {base_ppl:.4f}")
        for k, units in allocs.items():
            nll, kld, top1 = accs[k].tensors()
            wide_heads = sum(hkv if h is None else 1 for _, h in units)
            kbits = (wide_heads * kb_w + (layers * hkv - wide_heads) * kb_n) / (layers * hkv)
            row = {"dataset": dataset, "allocation": k, "pool_bits": (kbits + vb) / 2,
                   "dppl_pct": 100 * (perplexity(nll) / base_ppl - 1), "kl": kld.mean().item(), "top1": top1.float().mean().item()}
            out["results"].append(row)
            print(f"  {k:7s} pool {row['pool_bits']:.4f} bits  dppl {row['dppl_pct']:+.3f} %  KL {row['kl']:.5f}  top1 {100 * row['top1']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
