"""bench/prefill.py end to end at a tiny size: both pool writes of every format, each against the first format's."""

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
@pytest.mark.parametrize("prompts, chunk", [(1, None), (3, 8)])  # one step; the server's pattern: prompts in steps of a block
def test_the_prefill_bench_reports_stored_and_resealed_writes(tiny_models, tmp_path, prompts, chunk):
    d, _ = tiny_models("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    formats = ["fp16", "k=int4:bchannel:asym:hadamard,v=int4:g32:sym:hadamard,block=8,sink=2"]
    shape = ["--prompts", str(prompts)] + (["--chunk", str(chunk)] if chunk else [])
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "prefill.py"), "--model", str(d), "--tokens", "21", "--formats", *formats,
                          "--block", "8", "--threads", "1", "--reps", "3", *shape, "--out", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    [report] = tmp_path.glob("prefill*.json")
    data = json.loads(report.read_text())
    assert list(data["results"]) == formats and data["tokens"] == 21
    assert (data["prompts"], data["chunk"]) == (prompts, chunk or 21) and (chunk is None) == (report.name == "prefill.json")
    base = data["results"]["fp16"]["stored"]["rounds_ms"]
    for modes in data["results"].values():
        assert list(modes) == ["stored", "resealed"]
        for x in modes.values():
            assert len(x["rounds_ms"]) == 2 and x["step_ms"] > 0 and x["write_ms"] > 0
            assert x["total_ms"] == pytest.approx(statistics.median(s + w for s, w in x["rounds_ms"]))
            assert x["vs_first"] == pytest.approx(statistics.median((s + w) / (bs + bw) for (s, w), (bs, bw) in zip(x["rounds_ms"], base)))
    assert data["results"]["fp16"]["stored"]["vs_first"] == 1.0
    assert all(f"`{f}`" in report.with_suffix(".md").read_text() for f in formats)


def test_random_pools_for_throughput_keep_outlier_positions_inside_their_blocks():
    """bench/build_engine.fill_random: an outN pool's random outlier lists point inside their blocks (a decode over
    them must not index out of range), and the codes are random bytes."""

    sys.path.insert(0, str(ROOT / "bench"))
    from build_engine import fill_random

    from trtkv.cache_layout import PagedKVLayout
    from trtkv.formats import get_format
    from trtkv.runtime.kv_pool import PagedKVCache

    fmt = get_format("k=int3:bchannel:asym:hadamard:out7,v=int3:g8:sym:hadamard,block=8")
    cache = PagedKVCache(PagedKVLayout(fmt, 2, 16, 8, 5, 1), 3)
    fill_random(cache, seed=3)
    index = cache.tensors["k_outlier_index"]
    assert index.min() >= 0 and index.max() < 8 * 16 and index.unique().numel() > 8
    assert cache.tensors["k_data"].unique().numel() > 16
