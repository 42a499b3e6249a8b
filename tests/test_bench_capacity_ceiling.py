"""bench/capacity_ceiling.py end to end at a tiny size: the least time of the load at each batch follows from the
speeds it measured, and the ceiling is the ratio of the completed-per-minute figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trtkv.formats import get_format
from trtkv.plugins import cpu_attention as ca

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(ca.unavailable() is not None, reason="no C compiler for trtkv's CPU kernels")
def test_the_capacity_ceiling_follows_from_the_measured_speeds(tiny_models, tmp_path):
    d, _ = tiny_models("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    requests, prompt, new = 7, 37, 10
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "capacity_ceiling.py"), "--model", str(d), "--format", "int4",
                          "--batches", "2,5", "--requests", str(requests), "--prompt", str(prompt), "--new", str(new),
                          "--steps", "2", "--reps", "2", "--out", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    [report] = tmp_path.glob("capacity-ceiling.json")
    block = get_format("int4").block_size
    r = json.loads(report.read_text())
    assert [row["batch"] for row in r["rows"]] == [2, 5] and r["context"] % block == 0 and r["context"] >= block
    assert r["prefill_seconds"] == pytest.approx(requests * prompt / r["prefill_tok_s"])
    for row in r["rows"]:
        assert row["decode_tok_s"] > 0
        least = requests * prompt / r["prefill_tok_s"] + requests * new / row["decode_tok_s"]
        assert row["least_seconds"] == pytest.approx(least)
        assert row["completed_per_min"] == pytest.approx(requests / least * 60)
    assert r["ceiling"] == pytest.approx(r["rows"][1]["completed_per_min"] / r["rows"][0]["completed_per_min"])
    assert f"**{r['ceiling']:.2f}x**" in report.with_suffix(".md").read_text()
