"""One-shot GPU check of the trtkv kernels: correctness, TensorRT-ABI launches, decode timing vs SDPA.

    python bench/gpu_check.py --out $OUT         # on a CUDA GPU (written for one H200, < 9 minutes)
    python bench/gpu_check.py --dry-run          # CPU, Triton interpreter, tiny sizes (< 1 minute)

The cache follows the sealed-block contract (docs/kv-cache-format.md): sealed blocks in the pool, each
sequence's fp16 open block (and sink rows) in ``tail[slot]``, this step's fp16 rows beside them.

Sections (``SECTIONS`` below; each is a module of ``bench/gpucheck`` whose docstring says what it measures)
1. correctness (``correctness.py``): every kernel for each KV preset vs the torch reference.
2. TensorRT ABI (``abi.py``, ``driver.py``): the four plugin ops compiled and launched as TensorRT would.
3. engine (``engine.py``): end-to-end decode through the torch engine, ``bench/gpu_engine.py`` run as a child with the
   time left (its own report: capacity per format at one KV budget, tokens/s, step time split, SmolLM2 GPU == CPU).
4.-6. bandwidth, decode timing vs fp16 SDPA, targets (``timing.py``).

A section's ``run(Run)`` fills its part of the result and ``report(result)`` gives its markdown; a new
section is a new module and one row of ``SECTIONS``.

Writes ``<out>/gpu-check-<device>.md`` and ``.json`` (default out: bench/results) with the date,
device, driver, torch / triton / CUDA versions; both are rewritten after each section, so a run cut
short still leaves its results (marked incomplete).
"""

from __future__ import annotations

import os
import sys

DRY = "--dry-run" in sys.argv
if DRY and "--abi-json" not in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import datetime as _dt  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):  # trtkv from this checkout, the sections beside this script
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from gpucheck import abi, correctness, engine, timing  # noqa: E402
from gpucheck.common import HEAD_DIM, HEADS_KV, HEADS_Q, Log, Run, Section, versions  # noqa: E402
from gpucheck.driver import driver_version  # noqa: E402

from trtkv.plugins.cases import DEFAULT_BLOCK  # noqa: E402

# In order; budgets (seconds, GPU run) keep a run under ~8 minutes even when compiles are slow: a section
# checks its budget before each case, so it can overrun by one case. Add a section here.
SECTIONS = (
    Section("correctness", "correctness", correctness.run, correctness.report, budget_s=120),
    Section("abi", "trt_abi", abi.run, abi.report, budget_s=100),
    Section("engine", "engine", engine.run, engine.report, budget_s=220, empty=dict),  # bench/gpu_engine.py, a child
    Section("bandwidth", "copy", timing.run_bandwidth, timing.report_bandwidth, skippable=False, empty=lambda: None),
    Section("timing", "timing", timing.run_timing, timing.report_timing, budget_s=150),
    Section("targets", "targets", timing.run_targets, timing.report_targets, skippable=False),
)


def write_report(out_dir: Path, result: dict) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = re.sub(r"[^A-Za-z0-9]+", "-", result["env"].get("device", "unknown")).strip("-").lower()
    stem = f"gpu-check-{dev}" + ("-dry-run" if result["dry_run"] else "")
    jp, mp = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    jp.write_text(json.dumps(result, indent=1, default=str))
    L = [f"# trtkv GPU check{' (dry run: CPU, Triton interpreter, tiny sizes)' if result['dry_run'] else ''}", "",
         f"- date: {result['date']}", *(f"- {k}: {v}" for k, v in result["env"].items()),
         f"- geometry (timing): {result['geometry']}", f"- wall time: {result['seconds']:.0f} s",
         *([] if result.get("complete") else ["- **incomplete**: written after a section; the run did not finish"]),
         ""]
    for s in SECTIONS:
        L += [*s.report(result), ""]
    mp.write_text("\n".join(L).rstrip("\n") + "\n")
    return jp, mp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter at tiny sizes")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="output directory")
    ap.add_argument("--skip", nargs="*", default=[], choices=[s.name for s in SECTIONS if s.skippable])
    ap.add_argument("--abi-json", help=argparse.SUPPRESS)  # internal: the dry run's compile-only child
    args = ap.parse_args(argv)
    log = Log()
    if args.abi_json:
        run = Run(log, "cpu", True, {"trt_abi": []})
        abi.run(run)
        Path(args.abi_json).write_text(json.dumps(run.result["trt_abi"], default=str))
        return 0
    if args.dry_run:
        device = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run, or on a GPU machine", file=sys.stderr)
        return 2
    else:
        device = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = False
    env = versions(driver_version)
    log(f"env: {env}")
    t0 = time.time()
    result = dict(date=_dt.datetime.now().isoformat(timespec="seconds"), dry_run=args.dry_run, env=env,
                  geometry=("heads 4 q / 2 kv, head_dim 64, block: the format's (else 16)" if args.dry_run else
                            f"heads {HEADS_Q} q / {HEADS_KV} kv, head_dim {HEAD_DIM}, block: the format's (int8 / int4: "
                            f"64), else {DEFAULT_BLOCK}; fp16 queries"),
                  **{s.key: s.empty() for s in SECTIONS}, seconds=0.0, complete=False, out_dir=str(args.out))
    out_dir = Path(args.out)

    def checkpoint():  # the report is rewritten after every section: a run cut short still leaves one
        result["seconds"] = time.time() - t0
        return write_report(out_dir, result)

    for s in SECTIONS:
        if s.name not in args.skip:
            s.run(Run(log, device, args.dry_run, result, s.budget_s))
            checkpoint()
    result["complete"] = True
    jp, mp = checkpoint()
    failed = [r for r in result["correctness"] + result["trt_abi"] if r["ok"] is False]
    log(f"wrote {mp} and {jp}; correctness/abi failures: {len(failed)}; {result['seconds']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
