"""Token-age formats: what the pool should hold of a block that ages out of the recent set.

A token-age format (``recent=R:FORMAT``) reads a sequence's newest R sealed blocks in the wider storage and older ones
from the pool. The pool's copy of a block can be made two ways: **sealed twice** (every full block quantized from its
fp16 rows into the pool as well as into the slot's ring: what the engine does) or **requantize** (the pool's copy
quantized at age-out from the values the recent codes decode to: one seal per block at a time, but two roundings).
This measures both with the eval cache (``trtkv.kv_cache``, ``age_out``) on the perplexity task: perplexity, KL from
fp16 (mean, 99.9th percentile) and top-1 agreement over every position of ``--windows`` windows of ``--seq-len`` tokens,
on each ``--datasets`` text, against the unquantized model on the same windows.

    .venv/bin/python bench/token_age.py --kv 'int2,recent=3:int4' --calibration DIR [--seq-len 8192] [--windows 1]
        [--datasets builtin:pydoc,builtin:shakespeare]

Prints one Markdown table (a row per dataset and age-out choice).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_engine import machine

MODEL = "smollm2-135m"


def run(kv: str, calibration: str, datasets: list[str], seq_len: int, windows: int) -> list[dict]:
    from trtkv.artifacts import load_calibration
    from trtkv.data import token_windows
    from trtkv.evaluate import PositionScores, kept_logits
    from trtkv.formats import get_format
    from trtkv.models import load_model, load_tokenizer, model_info

    fmt = get_format(kv)
    loaded = load_model(MODEL, device="cpu", dtype="float32")
    info = model_info(MODEL)
    params = load_calibration(calibration).params_for(fmt, info) if fmt.needs_calibration else None
    tok = load_tokenizer(MODEL, None)
    rows = []
    for dataset in datasets:
        ids = token_windows(tok, dataset, seq_len=seq_len, samples=windows, seed=0, split="eval", text_field="text", samples_flag="--windows")
        positions = torch.arange(ids.shape[1] - 1)
        targets = ids[:, 1:]
        with torch.inference_mode():
            ref = torch.cat([x for _, x in kept_logits(loaded.model, ids, get_format("fp16"), None, positions)], 1)
            base = PositionScores(ids.shape[0], positions.numel())
            base.add(0, slice(0, positions.numel()), ref, ref, targets)
            ppl0 = math.exp(base.nll.mean().item())
            for age_out in ("sealed_twice", "requantize"):
                t0 = time.perf_counter()
                sc = PositionScores(ids.shape[0], positions.numel())
                for cols, logits in kept_logits(loaded.model, ids, fmt, params, positions, age_out=age_out):
                    sc.add(0, cols, ref[:, cols], logits, targets[:, cols])
                ppl = math.exp(sc.nll.mean().item())
                rows.append(dict(dataset=dataset, age_out=age_out, ppl_fp16=ppl0, ppl=ppl, delta=100 * (ppl / ppl0 - 1), kl=sc.kld.mean().item(),
                                 kl_p999=torch.quantile(sc.kld.flatten(), 0.999).item(), top1=sc.agree.mean().item(),
                                 seconds=time.perf_counter() - t0))
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", required=True)
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--datasets", default="builtin:pydoc,builtin:shakespeare")
    a = ap.parse_args()
    rows = run(a.kv, a.calibration, a.datasets.split(","), a.seq_len, a.windows)
    print(f"\n{MODEL}, `{a.kv}`, {a.windows} window(s) of {a.seq_len} tokens, {machine()}\n")
    print("| dataset | pool copy of an aged block | ppl (fp16) | ppl | Δppl % | KL mean | KL p99.9 | top-1 vs fp16 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dataset']} | {r['age_out'].replace('_', ' ')} | {r['ppl_fp16']:.3f} | {r['ppl']:.3f} | {r['delta']:+.2f} | {r['kl']:.4f} | "
              f"{r['kl_p999']:.3f} | {100 * r['top1']:.2f} % |")


if __name__ == "__main__":
    main()
