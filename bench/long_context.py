"""Long-context accuracy and decode speed of the KV presets: recall at distance, pass key and KL by position on the
builtin SmolLM2-135M up to its 8192-token context, and the torch engine's decode tokens/s at 1k .. 8k contexts.

Accuracy is ``trtkv eval``'s long-context tasks (``trtkv.evaluate.run_eval``, the eval cache really quantized, every
format against fp16 on the same items): ``--task recall`` at ``--contexts``, ``--task passkey`` at ``--passkey-contexts``
(SmolLM2-135M retrieves a pass key only at short contexts), and the perplexity task at ``--ppl-seq-len`` for its KL by
position. The formats are ``--formats`` (each a ``--kv`` value: a new format is one more entry); those that need
calibrated constants use ``--calibration DIR``, else one ``trtkv calibrate`` run made here. ``--second-family ARCH``
adds KL by position on a random-weight model of another family (no second family with real weights is on this
machine; random weights cannot retrieve, so only its KL by position is reported). Decode is
``bench/torch_engine.py``'s measurement (each engine alone in a fresh process over a random paged cache, rounds
alternating the formats, the median of ``--reps``) at each of ``--decode-contexts``, built by
``bench/low_bit_decode.py``'s ``build``. Writes one Markdown report (the table per task and length bucket, the
targets, the decode curve) and its JSON under bench/results/long-context.{md,json}, after each section.

    .venv/bin/python bench/long_context.py [--formats fp16,int8,int4,int3,int2] [--contexts 768,1024,2048,4096,8192]
        [--windows 3] [--passkey-contexts 1024,2048] [--ppl-seq-len 8192] [--ppl-windows 2] [--decode-formats fp16,int4,int2]
        [--decode-contexts 1024,2048,4096,8064] [--calibration DIR] [--second-family qwen3] [--skip-accuracy] [--skip-decode]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_engine import describe_machine, machine
from low_bit_decode import build
from report import write_report
from torch_engine import measure

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
DATASET = "builtin:pydoc"
# targets, by the preset family a format name starts with: (recall as a share of fp16's, KL of the last position bucket
# over the first's); int8's recall and pass key are to equal fp16's: the same answers on >= 99 % of tokens / items
TARGETS = {"int8": (None, 1.5), "int4": (0.98, 2.0), "int3": (0.98, 2.0), "int2": (0.95, None)}
SAME_ANSWERS = 0.99
AGED_BITS, AGED_PPL, AGED_KL = 2.75, 2.0, 0.02  # a token-age format at the perplexity task's context (8k)
DECODE_TARGET = 1.0  # int4 tokens/s over fp16's at every context
DECODE_AIM_8K = 1.2


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def split_formats(text: str) -> list[str]:
    """``--formats``: comma-separated ``--kv`` values, a token-age spec's fields kept with it (``trtkv.formats.split_specs``)."""
    from trtkv.formats import split_specs

    return split_specs(text)


def _family(name: str) -> str | None:
    return next((k for k in TARGETS if name == k or name.startswith(k + "-")), None)


def calibrate(formats: list[str], out: Path, model: str = MODEL, samples: int | None = None) -> tuple[Path | None, str | None]:
    """A calibration for the formats that need one (``trtkv calibrate``), or None when none does; and its command."""
    from trtkv.formats import get_format

    need = [f for f in formats if get_format(f).needs_calibration]
    if not need:
        return None, None
    cli = str(Path(sys.executable).parent / "trtkv")
    cmd = [cli, "calibrate", "--model", model, "--dataset", DATASET, *[a for f in need for a in ("--kv", f)], "--out", str(out)]
    cmd += ["--samples", str(samples)] if samples else []
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out, " ".join(["trtkv", *cmd[1:]])


def random_second_model(arch: str, out: Path) -> Path:
    """A random-weight model of ``arch`` (a few small layers, SmolLM2's head_dim and tokenizer, an 8192-token context)."""
    import transformers

    from trtkv.models import load_tokenizer

    configs = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
               "phi3": ("Phi3Config", "Phi3ForCausalLM")}
    if arch not in configs:
        raise SystemExit(f"--second-family {arch}: use one of {', '.join(configs)}")
    tok = load_tokenizer(MODEL, None)
    cfg = getattr(transformers, configs[arch][0])(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                                                  tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    import torch

    torch.manual_seed(0)
    model = getattr(transformers, configs[arch][1])(cfg).eval()
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def accuracy(args, results: dict, stem: Path, tmp: Path) -> None:
    from trtkv.evaluate import run_eval

    formats = split_formats(args.formats)
    cal, cal_cmd = (Path(args.calibration), None) if args.calibration else calibrate(formats, tmp / "calibration")
    results["calibration"] = cal_cmd or (str(cal) if cal else None)
    common = dict(calibration=cal, device="cpu", dtype="float32", seed=args.seed, progress=args.progress)
    sections = [("recall", dict(tasks=["recall"], contexts=_ints(args.contexts), windows=args.windows)),
                ("passkey", dict(tasks=["passkey"], contexts=_ints(args.passkey_contexts), windows=args.passkey_windows)),
                ("ppl", dict(tasks=["ppl"], seq_len=args.ppl_seq_len, windows=args.ppl_windows, generate_prompts=0))]
    for name, kw in sections:
        if not kw.get("contexts", [1]):
            continue
        t0 = time.perf_counter()
        rows = run_eval(MODEL, DATASET, formats, **common, **kw)
        results["accuracy"][name] = [r.model_dump() for r in rows]
        results["seconds"][name] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {results['seconds'][name]} s", flush=True)
        write_report(stem, results, render(results))
    if args.second_family:
        t0 = time.perf_counter()
        second = random_second_model(args.second_family, tmp / f"random-{args.second_family}")
        cal2, _ = calibrate(formats, tmp / "calibration-second", model=str(second), samples=4)
        rows = run_eval(str(second), DATASET, formats, tasks=["ppl"], seq_len=args.ppl_seq_len, windows=args.ppl_windows,
                        generate_prompts=0, calibration=cal2, device="cpu", dtype="float32", seed=args.seed, progress=args.progress)
        results["second_family"] = {"arch": args.second_family, "rows": [r.model_dump() for r in rows]}
        results["seconds"]["second_family"] = round(time.perf_counter() - t0, 1)
        write_report(stem, results, render(results))


def decode(args, results: dict, stem: Path, tmp: Path) -> None:
    formats, contexts = split_formats(args.decode_formats), _ints(args.decode_contexts)
    engines = {f: build(f, tmp, 8, min(8192, max(contexts) + 128)) for f in formats}
    t0 = time.perf_counter()
    for ctx in contexts:
        runs: dict[str, list[float]] = {f: [] for f in formats}
        opts = argparse.Namespace(batch=args.batch, context=ctx, steps=args.steps)
        for _ in range(args.reps):  # rounds alternate the formats: a slow moment of the machine hits each alike
            for f in formats:
                runs[f].append(measure(engines[f], opts))
                print("decode", ctx, f, round(runs[f][-1], 2), flush=True)
        results["decode"].append({"context": ctx, **{f: {"tok_s": round(statistics.median(x), 2), "runs": [round(v, 2) for v in x]}
                                                     for f, x in runs.items()}})
        write_report(stem, results, render(results))
    results["seconds"]["decode"] = round(time.perf_counter() - t0, 1)


# --------------------------------------------------------------------------- the report


def _rows(results: dict, task: str) -> list[dict]:
    return results["accuracy"].get(task, [])


def _by(rows: list[dict], key: str) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(r[key], {})[r["format"]] = r
    return out


def _buckets(r: dict) -> list[tuple[int, int]]:
    """(start, end) of each position bucket of a perplexity row, the end exclusive."""
    starts = sorted(int(k) for k in r["kld_by_position"])
    return list(zip(starts, starts[1:] + [r["seq_len"] - 1]))


def table(results: dict) -> list[str]:
    """The one accuracy table: a row per task, length bucket and metric, a column per format."""
    formats = results["formats"]
    head = ["| task | bucket | metric | " + " | ".join(formats) + " |", "|---|---|---|" + "---:|" * len(formats)]
    lines = []
    for ctx, by in sorted(_by(_rows(results, "recall"), "context").items()):
        cells = [f"{100 * by[f]['recall_top1']:.1f}" + ("" if f == "fp16" or not by[f]["fp16_recall_top1"] else
                                                          f" ({100 * by[f]['recall_top1'] / by[f]['fp16_recall_top1']:.1f} %)")
                 if f in by else "" for f in formats]
        lines.append(f"| recall | {ctx} tokens (distance {next(iter(by.values()))['distance']}) | top-1 % (of fp16) | " + " | ".join(cells) + " |")
        cells = [f"{100 * by[f]['fp16_agreement']:.1f}" if f in by else "" for f in formats]
        lines.append(f"| recall | {ctx} tokens | same top-1 as fp16 % | " + " | ".join(cells) + " |")
    for ctx, by in sorted(_by(_rows(results, "passkey"), "context").items()):
        cells = [f"{round(by[f]['passkey_accuracy'] * by[f]['windows'])}/{by[f]['windows']}" if f in by else "" for f in formats]
        lines.append(f"| pass key | {ctx} tokens | items passed | " + " | ".join(cells) + " |")
    ppl = {r["format"]: r for r in _rows(results, "ppl")}
    if ppl:
        r0 = next(iter(ppl.values()))
        for a, b in _buckets(r0):
            cells = [f"{_kl(ppl[f], a):.5f}" if f in ppl else "" for f in formats]
            lines.append(f"| KL by position | {a}-{b - 1} | mean KL | " + " | ".join(cells) + " |")
        lines.append("| KL by position | all | KL p99.9 | " + " | ".join(f"{ppl[f]['kld_p999']:.4f}" if f in ppl else "" for f in formats) + " |")
        lines.append("| KL by position | all | Δppl % | " + " | ".join(f"{ppl[f]['ppl_delta_pct']:+.3f}" if f in ppl else "" for f in formats) + " |")
    second = results.get("second_family")
    if second:
        rows = {r["format"]: r for r in second["rows"]}
        r0 = next(iter(rows.values()))
        for a, b in _buckets(r0):
            cells = [f"{_kl(rows[f], a):.5f}" if f in rows else "" for f in formats]
            lines.append(f"| KL by position, random-weight {second['arch']} | {a}-{b - 1} | mean KL | " + " | ".join(cells) + " |")
    return head + lines if lines else []


def _per_format(rows: list[dict]) -> dict:
    """{format: {context: row}}."""
    out: dict = {}
    for r in rows:
        out.setdefault(r["format"], {})[r["context"]] = r
    return out


def _kl(r: dict, start: int) -> float:
    d = r["kld_by_position"]
    return d[str(start)] if str(start) in d else d[start]


def token_age_target(name: str, r: dict) -> str | None:
    """The token-age target of a ``recent=`` format's perplexity row: at most ``AGED_BITS`` pool and ring bits per element
    at the row's context, at most ``AGED_PPL`` % perplexity and ``AGED_KL`` mean KL in the last position bucket."""
    from trtkv.formats import get_format
    from trtkv.models import model_info

    fmt = get_format(name)
    if not fmt.token_aged:
        return None
    bits = fmt.sealed_bits_per_element(model_info(MODEL).head_dim, r["seq_len"])
    a1 = _buckets(r)[-1][0]
    kl = _kl(r, a1)
    misses = [f"{what} {got:.4g} (target ≤ {goal:g})" for what, got, goal in
              ((f"pool + ring bits at {r['seq_len']}", bits, AGED_BITS), ("Δppl %", r["ppl_delta_pct"], AGED_PPL), (f"mean KL at positions ≥ {a1}", kl, AGED_KL))
              if got > goal]
    return (f"- {name}: {bits:.3f} pool + ring bits at {r['seq_len']}, Δppl {r['ppl_delta_pct']:+.2f} %, KL {kl:.4f} at positions ≥ {a1}: "
            + ("met" if not misses else "**missed**: " + "; ".join(misses)))


def targets(results: dict) -> list[str]:
    """Each target of a measured format: met, or missed and by how much."""
    out = []
    recall = _per_format(_rows(results, "recall"))
    passkey = _per_format(_rows(results, "passkey"))
    ppl = {r["format"]: r for r in _rows(results, "ppl")}
    for f in results["formats"]:
        if f in ppl and (aged := token_age_target(f, ppl[f])):
            out.append(aged)
        fam = _family(f)
        if fam is None:
            continue
        share, kl_ratio = TARGETS[fam]
        misses = []
        for ctx, r in sorted(recall.get(f, {}).items()):
            got = r["recall_top1"] / r["fp16_recall_top1"] if r["fp16_recall_top1"] else 1.0
            if share is not None and got < share - 1e-9:
                misses.append(f"recall at {ctx}: {100 * got:.1f} % of fp16 (target {100 * share:.0f} %, short by {100 * (share - got):.1f} percentage points)")
            if fam == "int8" and r["fp16_agreement"] < SAME_ANSWERS:
                misses.append(f"recall at {ctx}: same top-1 as fp16 on {100 * r['fp16_agreement']:.1f} % of tokens (target {100 * SAME_ANSWERS:.0f} %)")
        if fam == "int8":
            for ctx, r in sorted(passkey.get(f, {}).items()):
                if r["same_outcome_as_fp16"] < SAME_ANSWERS:
                    misses.append(f"pass key at {ctx}: same outcome as fp16 on {100 * r['same_outcome_as_fp16']:.0f} % of items")
        if kl_ratio and f in ppl and len(ppl[f]["kld_by_position"]) > 1:
            (a0, b0), (a1, b1) = _buckets(ppl[f])[0], _buckets(ppl[f])[-1]
            ratio = _kl(ppl[f], a1) / max(_kl(ppl[f], a0), 1e-12)
            verdict = "met" if ratio <= kl_ratio else f"**missed** by {ratio / kl_ratio - 1:.0%}"
            out.append(f"- {f}: mean KL at positions {a1}-{b1 - 1} is {ratio:.2f}x that at {a0}-{b0 - 1} (target ≤ {kl_ratio}x): {verdict}")
        if f in recall:
            goal = "recall equal to fp16's (same top-1 on ≥ 99 % of tokens)" if fam == "int8" else f"recall ≥ {100 * share:.0f} % of fp16's"
            out.append(f"- {f}: {goal} in every bucket: " + ("met" if not misses else "**missed**: " + "; ".join(misses)))
    rows = results["decode"]
    fmts = [f for f in results.get("decode_formats", []) if f != "fp16"]
    for f in fmts:
        if _family(f) != "int4" or not rows:
            continue
        ratios = {r["context"]: r[f]["tok_s"] / r["fp16"]["tok_s"] for r in rows if f in r and "fp16" in r}
        low = {c: x for c, x in ratios.items() if x < DECODE_TARGET}
        line = f"- {f} decode ≥ {DECODE_TARGET}x fp16 tok/s at every context: " + (
            "met" if not low else "**missed** at " + ", ".join(f"{c} ({x:.2f}x, short by {DECODE_TARGET - x:.2f})" for c, x in low.items()))
        last = max(ratios) if ratios else None
        if last is not None:
            line += f"; at {last}: {ratios[last]:.2f}x (aim {DECODE_AIM_8K}x{'' if ratios[last] >= DECODE_AIM_8K else ', not reached'})"
        out.append(line)
    return out


def render(r: dict) -> str:
    lines = [
        f"# Long context: recall, pass key, KL by position and decode speed, SmolLM2-135M ({r['date']})",
        "",
        f"Command: `{r['command']}`  ",
        f"Machine: {describe_machine(r['machine'])}  ",
        (f"Accuracy: `trtkv eval` tasks on {DATASET}'s eval split, float32 on CPU, the cache really quantized (sealed blocks as the engine "
         f"seals them), every format against fp16 on the same items; recall: {r['windows']} passages of 256 tokens per context; pass key: "
         f"{r['passkey_windows']} items per context at depths 0..1; KL by position: {r['ppl_windows']} windows of {r['ppl_seq_len']} tokens. "
         f"Calibration (for the formats that need it): {r.get('calibration') or 'none needed'}. " if r["accuracy"] else "Decode only. ")
        + f"Seconds per section: {r['seconds']}.",
        "",
    ]
    t = table(r)
    if t:
        lines += ["Recall cells: the second copy's top-1 against the true tokens, and in brackets as a share of fp16's on the same items. "
                  "KL rows: mean KL(fp16 ‖ format) over the positions of each bucket (position t predicts token t + 1).", "", *t, ""]
    if r.get("second_family"):
        lines += [f"The random-weight {r['second_family']['arch']} (4 layers, head_dim 64, SmolLM2's tokenizer) stands in for a second family: "
                  "no second family with real weights is on this machine, and a random model cannot retrieve, so only its KL by position "
                  "is reported.", ""]
    tg = targets(r)
    if tg:
        lines += ["Targets (SmolLM2-135M):", "", *tg, ""]
    if r["decode"]:
        fmts = r["decode_formats"]
        lines += [f"Decode, torch engine (CPU, float32, batch {r['batch']}, {r['steps']} timed steps after one warm-up, each engine alone in a "
                  f"fresh process over a random paged cache, median of {r['reps']} alternated rounds); tokens/s and the ratio to fp16 in the same run:",
                  "", "| context | " + " | ".join(fmts) + " | " + " | ".join(f"{f} / fp16" for f in fmts if f != "fp16") + " |",
                  "|---:|" + "---:|" * (2 * len(fmts) - 1)]
        for row in r["decode"]:
            base = row.get("fp16", {}).get("tok_s")
            lines.append(f"| {row['context']} | " + " | ".join(str(row[f]["tok_s"]) if f in row else "" for f in fmts) + " | "
                         + " | ".join(f"{row[f]['tok_s'] / base:.2f}x" if f in row and base else "" for f in fmts if f != "fp16") + " |")
        lines.append("")
    if r.get("notes"):
        lines += ["## Reading it", "", r["notes"], ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="fp16,int8,int4,int3,int2", help="--kv values to compare (fp16 is the baseline)")
    ap.add_argument("--contexts", default="768,1024,2048,4096,8192", help="recall: tokens per window (768: a distance of 512 with 256-token passages)")
    ap.add_argument("--windows", type=int, default=3, help="recall: passages per context")
    ap.add_argument("--passkey-contexts", default="1024,2048", help="pass key: tokens per window ('' to skip)")
    ap.add_argument("--passkey-windows", type=int, default=4)
    ap.add_argument("--ppl-seq-len", type=int, default=8192, help="KL by position: tokens per window")
    ap.add_argument("--ppl-windows", type=int, default=2)
    ap.add_argument("--calibration", help="a `trtkv calibrate` output holding the formats that need calibration (else made here)")
    ap.add_argument("--second-family", default="", help="also KL by position on a random-weight model of this family (qwen3, mistral, phi3)")
    ap.add_argument("--decode-formats", default="fp16,int4,int2")
    ap.add_argument("--decode-contexts", default="1024,2048,4096,8064", help="multiples of 128 (whole sealed blocks), at most 8189")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--progress", action="store_true", help="show eval's progress bar (on a terminal)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default="long-context", help="report file stem: a rerun replaces the report it repeats")
    ap.add_argument("--render", help="only rewrite the Markdown of this results JSON (after a change to the report)")
    ap.add_argument("--notes", help="with --render: a Markdown file of what the run shows and does not (why a target was missed, the next "
                                    "measure), kept in the JSON and printed after the tables")
    args = ap.parse_args()
    if args.render:
        data = json.loads(Path(args.render).read_text())
        if args.notes:
            data["notes"] = Path(args.notes).read_text().strip()
            Path(args.render).write_text(json.dumps(data, indent=1))
        Path(args.render).with_suffix(".md").write_text(render(data))
        return
    if args.notes:
        ap.error("--notes goes with --render: write the notes once the run's numbers are in")
    results: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": str(date.today()), "machine": machine(),
                     "formats": split_formats(args.formats), "decode_formats": split_formats(args.decode_formats), "windows": args.windows,
                     "passkey_windows": args.passkey_windows, "ppl_windows": args.ppl_windows, "ppl_seq_len": args.ppl_seq_len,
                     "batch": args.batch, "steps": args.steps, "reps": args.reps, "accuracy": {}, "decode": [], "seconds": {}}
    stem = Path(args.out) / args.name
    tmp = Path(tempfile.mkdtemp(prefix="trtkv-bench-longctx-"))
    try:
        if not args.skip_accuracy:
            accuracy(args, results, stem, tmp)
        if not args.skip_decode:
            decode(args, results, stem, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_report(stem, results, render(results))
    print(render(results))


if __name__ == "__main__":
    main()
