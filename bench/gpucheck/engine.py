"""Section "engine": end-to-end decode through the torch engine (``bench/gpu_engine.py``), run as a child process
with the time this run has left, so one prepared GPU run covers the kernels and the engine. The child writes its
own report (``gpu-engine-*.json`` / ``.md``) after every section; this section records where it is and a summary."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from gpucheck.common import Run

SCRIPT = Path(__file__).resolve().parents[1] / "gpu_engine.py"
TOTAL_S = 540.0  # the whole prepared run fits 9 minutes on one GPU


def run(r: Run) -> None:
    left = max(30.0, min(r.budget_s, TOTAL_S - r.result.get("seconds", 0.0)))
    out = Path(r.result.get("out_dir", Path(SCRIPT).parent / "results"))
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--time-limit", f"{left:.0f}", *(["--dry-run"] if r.dry else [])]
    r.log(f"engine: {' '.join(cmd)}")
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left + 120)
    reports = sorted(out.glob("gpu-engine*.json"), key=lambda p: p.stat().st_mtime)
    summary = json.loads(reports[-1].read_text()) if reports and reports[-1].stat().st_mtime >= t0 else None
    r.result["engine"] = dict(returncode=proc.returncode, seconds=time.time() - t0, report=str(reports[-1]) if summary else None,
                              stderr_tail=proc.stderr[-2000:], complete=bool(summary and summary.get("complete")))
    r.log(f"engine: exit {proc.returncode} in {time.time() - t0:.0f} s; report {r.result['engine']['report']}")


def report(result: dict) -> list[str]:
    e = result.get("engine") or {}
    if not e:
        return ["## Torch engine end to end", "", "not run", ""]
    return ["## Torch engine end to end", "", f"`bench/gpu_engine.py`: exit {e['returncode']}, {e['seconds']:.0f} s, "
            f"complete: {e['complete']}; report: `{e['report']}`", ""]
