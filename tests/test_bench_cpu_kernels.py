"""bench/cpu_kernels.py end to end at a tiny size: it measures every format it is given and writes its report."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from trtkv.plugins import cpu_attention as ca

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(ca.unavailable() is not None, reason="no C compiler for trtkv's CPU kernels")
def test_the_kernel_bench_reports_each_format_against_the_first(tmp_path):
    formats = ["fp16", "int4", "k=int8:token:asym:smooth,v=int8:bchannel:sym:hadamard,block=64",
               "k=int3:bchannel:asym:qsmooth:hadamard,v=int3:g32:sym:hadamard:nuq,block=64",
               "k=int8:bchannel:asym:prerope:alloc3.5:out4,v=int2:token:sym:hadamard:nuq:out8,block=64"]  # bits per channel
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_kernels.py"), "--formats", *formats, "--batch", "2",
                          "--context", "128", "--threads", "1", "2", "--reps", "2", "--iters", "1", "--out", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    [report] = tmp_path.glob("cpu-kernels-threads-1-2.json")
    data = json.loads(report.read_text())
    assert list(data["results"]) == formats and data["batch"] == 2 and data["context"] == 128 and data["threads"] == [1, 2]
    first = data["results"]["fp16"]
    assert first["vs_first"] == 1.0 and len(first["rounds_ms"]) == 2
    for r in data["results"].values():
        assert r["ms_per_layer"] > 0 and r["ns_per_row_head"] == pytest.approx(r["ms_per_layer"] * 1e6 / (2 * 3 * 128))
        assert list(r["threads"]) == ["1", "2"] and r["threads"]["1"]["speedup"] == 1.0 and r["threads"]["2"]["ms_per_layer"] > 0
        two = r["threads"]["2"]  # its own rounds against the same format's one-thread rounds
        assert len(two["rounds_ms"]) == 2
        assert two["speedup"] == pytest.approx(statistics.median(a / b for a, b in zip(r["rounds_ms"], two["rounds_ms"])))
    assert all(f"`{f}`" in report.with_suffix(".md").read_text() for f in formats)
