"""`trtkv plan` numbers against hand computations, and the CLI's one-line error contract."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from trtkv.cli import app
from trtkv.errors import TrtkvError
from trtkv.formats import PRESETS
from trtkv.plan import GIB, GPUS, MIB, ModelShape, gpu_memory_bytes, plan

runner = CliRunner()


def test_llama7b_fp16_is_512_kib_per_token():
    shape = ModelShape("llama-7b", 32, 32, 128)
    _, rows = plan(shape, [PRESETS["fp16"]], context_len=4096, gpu_bytes=80 * GIB)
    assert rows[0].kv_bytes_per_token == 512 * 1024


@pytest.mark.parametrize("name", ["int8", "int4", "fp8", "int8-static"])
def test_capacity_matches_hand_count(name):
    fmt = PRESETS[name]
    layers, heads, hd, ctx = 7, 5, 96 if name != "int4" else 64, 3000
    shape = ModelShape("m", layers, heads, hd, weight_bytes=3 * GIB)
    gpu = 24 * GIB
    budget, [row] = plan(shape, [fmt], context_len=ctx, gpu_bytes=gpu, reserve_fraction=0.25)
    assert budget == gpu - 3 * GIB - int(0.25 * gpu)
    # hand count: codes bits + fp16 scale (and zero) per dynamic group (int8/int4 keys: per channel per block of 64),
    # for K and V; sealed-block presets (int8, int4: blocks of 64) add one fp16 open block per sequence (int4: + 4 sink rows)
    bits = {"int8": (8 + 16 / 64 + 8 + 16 / hd) / 2, "int4": (4 + 32 / 64 + 4 + 32 / 64) / 2, "fp8": 8, "int8-static": 8}[name]
    sealed = ctx - ctx % 64 if fmt.sealed else ctx
    open_bytes = 2 * layers * heads * (64 + {"int4": 4}.get(name, 0)) * hd * 2 if fmt.sealed else 0  # + int4's sink rows
    per_token = (sealed * 2 * layers * heads * hd * bits / 8 + open_bytes) / ctx
    assert row.pool_bits_per_element == pytest.approx(bits) and row.tail_bytes_per_slot == open_bytes
    assert row.kv_bytes_per_token == pytest.approx(per_token)
    assert row.max_tokens == int(budget // per_token)
    assert row.max_batch == row.max_tokens // ctx
    assert row.capacity_vs_fp16 == pytest.approx(16 * ctx / (sealed * bits + open_bytes * 8 / (2 * layers * heads * hd)))


def test_gpu_table_and_errors():
    assert gpu_memory_bytes("h200-141gb", None) == GPUS["H200-141GB"] * MIB
    assert gpu_memory_bytes(None, 12.5) == int(12.5 * GIB)
    with pytest.raises(TrtkvError, match="unknown GPU"):
        gpu_memory_bytes("V100", None)
    with pytest.raises(TrtkvError, match="no memory for the KV cache"):
        plan(ModelShape("m", 1, 1, 64, weight_bytes=100 * GIB), [PRESETS["fp16"]], context_len=1, gpu_bytes=80 * GIB)


def test_plan_cli_json(tmp_path):
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--gpu", "H100-80GB", "--kv", "fp16", "--kv", "int4", "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    fp16, int4 = data["rows"]
    assert fp16["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    assert int4["max_tokens"] > 3 * fp16["max_tokens"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["plan", "--kv", "int5", "--layers", "1", "--kv-heads", "1", "--head-dim", "8"], "unknown KV format"),
        (["plan", "--kv", "k=fp8:token:asym,v=int8:token", "--layers", "1", "--kv-heads", "1", "--head-dim", "8"], "fp8_e4m3 is symmetric only"),
        (["plan", "--layers", "4"], "needs a model or all of"),
        (["plan", "--layers", "0", "--kv-heads", "1", "--head-dim", "8"], "must be positive"),
        (["plan", "--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
    ],
)
@pytest.mark.slow
def test_bad_input_is_one_line_error(args, needle):
    proc = subprocess.run([sys.executable, "-m", "trtkv.cli", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert needle in err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_debug_shows_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "trtkv.cli", "--debug", "plan", "--kv", "int5", "--layers", "1", "--kv-heads", "1", "--head-dim", "8"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0 and "Traceback" in proc.stderr


@pytest.mark.parametrize("name", ["fp16", "int8", "int4"])
def test_cached_prefix_cost_is_the_pool_block_bytes(name):
    """`plan`'s cached KiB/tok times the block size is what one cached block takes in the pool (SmolLM2's
    shape, blocks of 64: 1,474,560 / 760,320 / 414,720 B, docs/serving.md "Prefix caching")."""
    from trtkv.cache_layout import PagedKVLayout

    fmt = PRESETS[name].with_block_size(64)
    _, [row] = plan(ModelShape("smollm2", 30, 3, 64), [fmt], context_len=2048, gpu_bytes=80 * GIB)
    block = PagedKVLayout(fmt, 3, 64, 64, 1).bytes_per_block() * 30
    assert row.cached_bytes_per_token * 64 == block == {"fp16": 1_474_560, "int8": 760_320, "int4": 414_720}[name]
