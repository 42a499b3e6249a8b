"""bench/gpu_engine.py --dry-run: the prepared GPU run end to end on CPU (tiny shapes, Triton kernels under
the interpreter), so the script a GPU session will run has run here: every section writes its report, the
capacity follows the formats' byte counts, and the kernel-path engine's greedy tokens equal the CPU engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.tier2  # the prepared GPU run end to end under the interpreter (a minute or more): CI's second step
@pytest.mark.slow
def test_gpu_engine_dry_run(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    # through the prepared run's entry point: gpu_check's engine section starts bench/gpu_engine.py as its child
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--skip", "correctness", "abi", "timing",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    [check] = tmp_path.glob("gpu-check-*-dry-run.json")
    engine = json.loads(check.read_text())["engine"]
    assert engine["returncode"] == 0 and engine["complete"], engine
    [report] = tmp_path.glob("gpu-engine-dry-run.json")
    assert engine["report"] == str(report)
    data = json.loads(report.read_text())
    assert report.with_suffix(".md").is_file() and data["dry_run"]
    cap = data["sections"]["capacity"]
    for c in data["shape"]["contexts"]:  # fewer bytes per token admit more sequences
        assert cap["fp16"][f"seqs_at_{c}"] <= cap["int8"][f"seqs_at_{c}"] <= cap["int4"][f"seqs_at_{c}"]
    rows = data["sections"]["decode"]
    assert {r["format"] for r in rows} == {"fp16", "int8", "int4"} or data["skipped"]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    # the graph path's padded steps (eager on CPU) give the eager step's logits
    assert all(r["graph_vs_eager_max_logit_diff"] < 1e-4 for r in rows), rows
    tiny = data["sections"]["tiny_kernels_vs_cpu"]
    assert set(tiny) == {"fp16", "int8", "int4"}
    assert all(v["equal_except_near_ties"] and v["max_abs_logit_diff"] < 1e-3 for v in tiny.values()), tiny
