"""The memory plan before any weights are read (trtkv/memory.py).

The host readers run on fake /proc and cgroup trees (v1 and v2) in tmp dirs; the GPU side on fake NVML /
``torch.cuda.mem_get_info`` readings (it is unexercised on a real GPU here); ``choose_load``'s decisions on a
Llama-3.1-8B-shaped record under ``TRTKV_MEMORY_LIMIT``; and the CLI refusal on a tiny model.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trtkv import memory
from trtkv.errors import TrtkvError
from trtkv.memory import (
    GIB,
    LIMIT_ENV,
    MemoryBudget,
    MemoryPlan,
    activation_bytes,
    cgroup_available,
    choose_load,
    gpu_memory,
    host_memory,
    parse_bytes,
    weight_bytes,
)
from trtkv.models import ModelInfo

MIB = 2**20


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _proc(tmp: Path, cgroup: str, mem_available: int = 20 * GIB) -> Path:
    proc = tmp / "proc"
    _write(proc / "self" / "cgroup", cgroup)
    _write(proc / "meminfo", f"MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   {mem_available // 1024} kB\n")
    return proc


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("text,want", [("1024", 1024), ("8GiB", 8 * GIB), ("512MiB", 512 * MIB), ("512 MiB", 512 * MIB),
                                       ("1.5G", int(1.5 * GIB)), ("2GB", 2 * 10**9), ("1MiB", MIB)])
def test_parse_bytes(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize("text", ["", "lots", "8 parsecs", "-1GiB"])
def test_parse_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(TrtkvError, match=LIMIT_ENV):
        parse_bytes(text)


def test_env_override_wins_over_cgroup_and_meminfo(tmp_path):
    proc = _proc(tmp_path, "0::/job\n", mem_available=GIB)
    assert host_memory(proc, tmp_path / "cg", env={LIMIT_ENV: "8GiB"}) == MemoryBudget(8 * GIB, LIMIT_ENV)
    assert host_memory(proc, tmp_path / "cg", env={}) == MemoryBudget(GIB, "MemAvailable")


# ----------------------------------------------------------------------------- cgroup v2


def _v2(tmp: Path, limit: str, current: int, inactive: int, path: str = "user.slice/job") -> Path:
    cg = tmp / "cg"
    _write(cg / "cgroup.controllers", "cpu memory\n")
    d = cg / path
    _write(d / "memory.max", limit + "\n")
    _write(d / "memory.current", f"{current}\n")
    _write(d / "memory.stat", f"anon {current - inactive}\nfile {inactive}\ninactive_file {inactive}\nactive_file 0\n")
    return cg


def test_cgroup_v2_limit_minus_usage_less_inactive_page_cache(tmp_path):
    proc = _proc(tmp_path, "0::/user.slice/job\n")
    cg = _v2(tmp_path, str(8 * GIB), current=3 * GIB, inactive=GIB)
    assert cgroup_available(proc, cg) == (6 * GIB, "cgroup v2 memory.max")
    assert host_memory(proc, cg, env={}) == MemoryBudget(6 * GIB, "cgroup v2 memory.max")


def test_cgroup_v2_max_means_no_limit(tmp_path):
    proc = _proc(tmp_path, "0::/user.slice/job\n", mem_available=20 * GIB)
    cg = _v2(tmp_path, "max", current=3 * GIB, inactive=GIB)
    assert cgroup_available(proc, cg) is None
    assert host_memory(proc, cg, env={}) == MemoryBudget(20 * GIB, "MemAvailable")


def test_cgroup_v2_tighter_ancestor_wins(tmp_path):
    proc = _proc(tmp_path, "0::/user.slice/job\n")
    cg = _v2(tmp_path, str(8 * GIB), current=3 * GIB, inactive=GIB)
    _write(cg / "user.slice" / "memory.max", f"{4 * GIB}\n")
    _write(cg / "user.slice" / "memory.current", f"{GIB}\n")
    assert cgroup_available(proc, cg) == (3 * GIB, "cgroup v2 memory.max")


def test_meminfo_below_the_cgroup_limit_is_the_budget(tmp_path):
    proc = _proc(tmp_path, "0::/user.slice/job\n", mem_available=2 * GIB)
    cg = _v2(tmp_path, str(8 * GIB), current=GIB, inactive=0)
    assert host_memory(proc, cg, env={}) == MemoryBudget(2 * GIB, "MemAvailable")


# ----------------------------------------------------------------------------- cgroup v1


def _v1(tmp: Path, limit: int, usage: int, inactive: int, path: str = "docker/abc") -> Path:
    cg = tmp / "cg"
    d = cg / "memory" / path
    _write(d / "memory.limit_in_bytes", f"{limit}\n")
    _write(d / "memory.usage_in_bytes", f"{usage}\n")
    _write(d / "memory.stat", f"rss {usage - inactive}\ninactive_file 0\ntotal_rss {usage - inactive}\ntotal_inactive_file {inactive}\n")
    _write(cg / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # the root: no limit
    return cg


V1_CGROUP = "12:pids:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc\n"


def test_cgroup_v1_limit_minus_usage_less_inactive_page_cache(tmp_path):
    proc = _proc(tmp_path, V1_CGROUP)
    cg = _v1(tmp_path, 8 * GIB, usage=5 * GIB, inactive=2 * GIB)
    assert cgroup_available(proc, cg) == (5 * GIB, "cgroup v1 memory.limit_in_bytes")
    assert host_memory(proc, cg, env={}) == MemoryBudget(5 * GIB, "cgroup v1 memory.limit_in_bytes")


def test_cgroup_v1_active_page_cache_counts_as_reclaimable(tmp_path):
    """A checkpoint just hashed sits in active_file: that page cache is reclaimed before the kernel kills anyone."""
    proc = _proc(tmp_path, V1_CGROUP)
    cg = _v1(tmp_path, 8 * GIB, usage=6 * GIB, inactive=GIB)
    stat = cg / "memory" / "docker/abc" / "memory.stat"
    stat.write_text(stat.read_text() + f"total_active_file {3 * GIB}\n")
    assert cgroup_available(proc, cg) == (6 * GIB, "cgroup v1 memory.limit_in_bytes")  # 8 - (6 - 1 - 3)


def test_cgroup_v1_huge_limit_means_no_limit(tmp_path):
    proc = _proc(tmp_path, V1_CGROUP, mem_available=20 * GIB)
    cg = _v1(tmp_path, 9223372036854771712, usage=5 * GIB, inactive=2 * GIB)
    assert cgroup_available(proc, cg) is None
    assert host_memory(proc, cg, env={}) == MemoryBudget(20 * GIB, "MemAvailable")


def test_no_cgroup_file_reads_meminfo(tmp_path):
    proc = _proc(tmp_path, "", mem_available=7 * GIB)
    assert host_memory(proc, tmp_path / "nowhere", env={}) == MemoryBudget(7 * GIB, "MemAvailable")


def test_this_machine_gives_a_positive_budget():
    b = host_memory(env={})
    assert b.bytes > 0 and b.source in memory.SOURCES


# ----------------------------------------------------------------------------- GPU (fake readings)


def _boom(index):
    raise AssertionError("this reader must not be asked")


def test_gpu_nvml_first_then_mem_get_info():
    assert gpu_memory(0, nvml=lambda i: 40 * GIB, mem_get_info=_boom, env={}) == MemoryBudget(40 * GIB, "NVML")
    assert gpu_memory(1, nvml=lambda i: None, mem_get_info=lambda i: 12 * GIB, env={}) == MemoryBudget(12 * GIB, "torch.cuda.mem_get_info")
    # CUDA_VISIBLE_DEVICES renumbers devices: NVML's index would be another GPU
    assert gpu_memory(0, nvml=_boom, mem_get_info=lambda i: 9 * GIB, env={"CUDA_VISIBLE_DEVICES": "3"}).source == "torch.cuda.mem_get_info"


def test_available_memory_on_cuda_reads_the_gpu(monkeypatch):
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen = []
    monkeypatch.setattr(memory, "nvml_free", lambda i: seen.append(i) or 30 * GIB)
    assert memory.available_memory(torch.device("cuda:1")) == MemoryBudget(30 * GIB, "NVML") and seen == [1]
    monkeypatch.setattr(memory, "nvml_free", lambda i: None)
    monkeypatch.setattr(memory, "torch_free", lambda i: 5 * GIB)
    assert memory.available_memory(torch.device("cuda")) == MemoryBudget(5 * GIB, "torch.cuda.mem_get_info")


# ----------------------------------------------------------------------------- what is counted

LLAMA_8B = ModelInfo(name="llama-3.1-8b-shape", sha256="0" * 64, architecture="LlamaForCausalLM", num_layers=32, num_heads=32,
                     num_kv_heads=8, head_dim=128, hidden_size=4096, vocab_size=128256, num_params=8_030_261_248)


def test_weight_bytes_resident_and_streamed():
    info = ModelInfo(name="t", sha256="0", num_layers=4, num_kv_heads=1, head_dim=8, hidden_size=10, vocab_size=1000,
                     num_params=2 * 10_000 + 10 + 4 * 500)
    assert weight_bytes(info, torch.float32, streamed=False) == info.num_params * 4
    assert weight_bytes(info, torch.bfloat16, streamed=False) == info.num_params * 2
    assert weight_bytes(info, torch.float32, streamed=True) == (20_010 + 500) * 4  # embeddings + head + norm + one layer
    tied = info.model_copy(update={"tie_word_embeddings": True, "num_params": 10_000 + 10 + 4 * 500})
    assert weight_bytes(tied, torch.float32, streamed=True) == (10_010 + 500) * 4


def test_activation_bytes_grow_with_the_window_and_count_logits():
    a = activation_bytes(LLAMA_8B, batch=1, seq_len=256, dtype=torch.float32)
    assert activation_bytes(LLAMA_8B, batch=2, seq_len=256, dtype=torch.float32) > a
    assert a - activation_bytes(LLAMA_8B, batch=1, seq_len=256, dtype=torch.float32, logits=False) == 2 * 256 * 128256 * 4
    assert a < GIB  # one 256-token window of an 8B model is well under a GiB


def test_describe_is_one_line_with_the_numbers():
    p = MemoryPlan(weights=int(27.4 * GIB), activations=int(0.1 * GIB), kv=0, overhead=GIB // 2,
                   budget=MemoryBudget(int(7.6 * GIB), "cgroup v1 memory.limit_in_bytes"), dtype=torch.float32)
    s = p.describe()
    assert "\n" not in s and not p.fits
    assert s.startswith("needs 28.0 GiB (weights 27.4 GiB float32 + activations 0.1 GiB + KV 0 GiB + overhead 0.5 GiB)")
    assert "the process can have 7.6 GiB (cgroup v1 memory.limit_in_bytes)" in s


# ----------------------------------------------------------------------------- choose_load


def _choose(monkeypatch, limit, device="cpu", dtype="auto", **kw):
    monkeypatch.setenv(LIMIT_ENV, limit)
    kw.setdefault("activations", 100 * MIB)
    kw.setdefault("can_stream", True)
    return choose_load(LLAMA_8B, torch.device(device), dtype, command="calibrate", **kw)


def test_auto_on_cpu_float32_resident_when_it_fits(monkeypatch):
    lp = _choose(monkeypatch, "64GiB")
    assert (lp.dtype, lp.streamed) == (torch.float32, False) and lp.plan.fits
    assert "float32" in lp.note and "resident" in lp.note


def test_auto_on_cpu_streams_float32_before_it_falls_to_bfloat16(monkeypatch):
    lp = _choose(monkeypatch, "8GiB")
    assert (lp.dtype, lp.streamed) == (torch.float32, True)
    assert "streamed" in lp.note and "float32 resident would need 30.5 GiB" in lp.note


def test_auto_on_cpu_without_streaming_takes_bfloat16_resident(monkeypatch):
    lp = _choose(monkeypatch, "20GiB", can_stream=False)
    assert (lp.dtype, lp.streamed) == (torch.bfloat16, False)
    assert "bfloat16" in lp.note


def test_stream_always_and_never(monkeypatch):
    assert _choose(monkeypatch, "64GiB", stream="always").streamed
    with pytest.raises(TrtkvError) as e:
        _choose(monkeypatch, "8GiB", stream="never", dtype="float32")
    assert "--stream" in str(e.value) and "--dtype bfloat16" in str(e.value)
    with pytest.raises(TrtkvError):
        _choose(monkeypatch, "64GiB", stream="always", can_stream=False)


def test_explicit_dtype_is_kept(monkeypatch):
    lp = _choose(monkeypatch, "20GiB", dtype="bf16", can_stream=False)
    assert (lp.dtype, lp.streamed, lp.note) == (torch.bfloat16, False, None)
    lp = _choose(monkeypatch, "8GiB", dtype="float32")
    assert (lp.dtype, lp.streamed) == (torch.float32, True) and lp.note


def test_auto_on_cuda_is_float16(monkeypatch):
    monkeypatch.setattr(memory, "nvml_free", _boom)  # the override applies to the GPU too
    lp = _choose(monkeypatch, "24GiB", device="cuda", can_stream=False)
    assert (lp.dtype, lp.streamed) == (torch.float16, False)
    assert _choose(monkeypatch, "8GiB", device="cuda").streamed


def test_refusal_names_the_numbers_and_the_fixes(monkeypatch):
    with pytest.raises(TrtkvError) as e:
        _choose(monkeypatch, "8GiB", can_stream=False)
    msg = str(e.value)
    assert "\n" not in msg and "calibrate does not fit in memory" in msg
    assert "needs 15.6 GiB" in msg and "bfloat16" in msg and "8.0 GiB (TRTKV_MEMORY_LIMIT)" in msg
    assert "--stream" not in msg and "--kv-memory" not in msg and "--samples" not in msg  # none of them apply
    with pytest.raises(TrtkvError) as e:
        _choose(monkeypatch, "1MiB", activations=4 * GIB, kv=2 * GIB)
    msg = str(e.value)
    assert "--samples" in msg and "--kv-memory" in msg and "--stream" not in msg  # streaming was already tried
    assert "KV 2.0 GiB" in msg and "one layer streamed" in msg


# ----------------------------------------------------------------------------- the commands


def _cli(*args: str, limit: str) -> subprocess.CompletedProcess:
    env = {**os.environ, LIMIT_ENV: limit}
    return subprocess.run([sys.executable, "-m", "trtkv.cli", *args], capture_output=True, text=True, timeout=300, env=env)


def test_build_engine_refuses_in_one_line_and_writes_nothing(tiny_model, tmp_path):
    model_dir, _ = tiny_model("llama", with_tokenizer=True)
    out = tmp_path / "eng"
    proc = _cli("build-engine", "--model", str(model_dir), "--kv", "fp16", "--backend", "onnxruntime", "--out", str(out), limit="1MiB")
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.stdout, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "does not fit in memory" in err and "1.0 MiB (TRTKV_MEMORY_LIMIT)" in err and "--backend torch" in err
    assert not out.exists() and not any(p.name.startswith(f".{out.name}") or p.name.startswith(out.name) for p in tmp_path.iterdir())


def test_torch_backend_build_reads_no_weights_and_opening_it_is_planned(tiny_model, tmp_path, monkeypatch):
    """--backend torch needs the record and the tokenizer only: it builds in a limit the weights do not fit in (the
    check step skipped with a note); opening the engine then refuses in one line, before a weight is read."""
    import trtkv.builder.build as build
    import trtkv.runtime.torch_engine as te
    from trtkv.builder.build import build_engine

    model_dir, _ = tiny_model("mistral", with_tokenizer=True)

    def boom(*a, **k):
        raise AssertionError("weights loaded")

    monkeypatch.setattr(build, "load_model", boom)
    monkeypatch.setattr(te, "load_model", boom)
    monkeypatch.setenv(LIMIT_ENV, "1MiB")
    out = build_engine(str(model_dir), None, "fp16", tmp_path / "eng", backend="torch", block_size=16, max_batch=2, max_seq_len=64)
    assert (out / "manifest.json").is_file() and (out / "tokenizer").is_dir()
    with pytest.raises(TrtkvError, match=r"opening the torch engine of .* does not fit in memory: .*KV 0\.2 GiB"):
        te.TorchEngine.from_engine_dir(out, device="cpu", kv_bytes=GIB // 5)
    proc = _cli("generate", "--engine", str(out), "hello", "-n", "2", limit="1MiB")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "does not fit in memory" in proc.stderr and "--kv-memory" in proc.stderr


def test_torch_backend_build_still_checks_a_step_when_the_weights_fit(tiny_model, tmp_path, monkeypatch):
    import trtkv.builder.torch_build as tb
    from trtkv.builder.build import build_engine

    model_dir, _ = tiny_model("mistral", with_tokenizer=True)
    steps = []
    real = tb.smoke_step
    monkeypatch.setattr(tb, "smoke_step", lambda *a: steps.append(1) or real(*a))
    monkeypatch.setenv(LIMIT_ENV, "64GiB")
    build_engine(str(model_dir), None, "fp16", tmp_path / "eng", backend="torch", block_size=16, max_batch=2, max_seq_len=64)
    assert steps == [1]
    monkeypatch.setenv(LIMIT_ENV, "1MiB")
    build_engine(str(model_dir), None, "fp16", tmp_path / "eng2", backend="torch", block_size=16, max_batch=2, max_seq_len=64)
    assert steps == [1]


def test_serve_counts_every_instance_copy_of_the_weights(tiny_model, tmp_path, monkeypatch):
    from trtkv.builder.build import build_engine
    from trtkv.manifest import load_manifest
    from trtkv.runtime.config import RuntimeConfig
    from trtkv.runtime.torch_engine import load_plan
    from trtkv.triton_repo.cli import _plan_torch_serve
    from trtkv.triton_repo.repository import RepoOptions

    model_dir, _ = tiny_model("mistral", with_tokenizer=True)
    monkeypatch.setenv(LIMIT_ENV, "1MiB")
    m = load_manifest(build_engine(str(model_dir), None, "fp16", tmp_path / "eng", backend="torch", block_size=16, max_batch=2, max_seq_len=64))
    monkeypatch.setenv(LIMIT_ENV, "64GiB")
    one = load_plan(m, torch.device("cpu"), kv_bytes=GIB // 100).plan
    assert one.kv == GIB // 100 and one.weights == m.model.num_params * 4 and one.activations > 0
    monkeypatch.setenv(LIMIT_ENV, str(one.total + (one.weights + one.activations) // 2))
    _plan_torch_serve(m, RepoOptions(runtime=RuntimeConfig(kv_memory_gib=0.01), instances=1, instance_kind="cpu"))
    with pytest.raises(TrtkvError, match="2 instances need"):
        _plan_torch_serve(m, RepoOptions(runtime=RuntimeConfig(kv_memory_gib=0.01), instances=2, instance_kind="cpu"))


def test_export_plans_its_load(tiny_model, tmp_path, monkeypatch):
    """Refused before a weight is read (nothing written); between the float32 plan and the output dtype's, the weights
    are loaded at the output dtype, and the result says so."""
    from trtkv.calibration.checkpoint import export_checkpoint
    from trtkv.calibration.run import run_calibration
    from trtkv.memory import HOST_OVERHEAD
    from trtkv.models import model_info

    model_dir, _ = tiny_model("mistral", with_tokenizer=True)
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    cal = run_calibration(str(model_dir), "builtin:pydoc", tmp_path / "cal", formats=["fp8"], method="max", samples=2, seq_len=16,
                          progress=False, reservoir=16)
    monkeypatch.setenv(LIMIT_ENV, "1MiB")
    with pytest.raises(TrtkvError, match=r"export does not fit in memory: .*1\.0 MiB \(TRTKV_MEMORY_LIMIT\)"):
        export_checkpoint(cal, str(model_dir), "vllm", tmp_path / "vllm", kv="fp8", dtype="float16")
    assert not (tmp_path / "vllm").exists()
    n = model_info(str(model_dir)).num_params
    monkeypatch.setenv(LIMIT_ENV, str(HOST_OVERHEAD + 4 * n))  # float32 + the float16 copy: 6n; float16 alone: 2n
    res = export_checkpoint(cal, str(model_dir), "vllm", tmp_path / "vllm", kv="fp8", dtype="float16")
    assert res.dtype == "float16" and any("weights loaded in float16" in note for note in res.notes), res.notes
    monkeypatch.setenv(LIMIT_ENV, "64GiB")
    res = export_checkpoint(cal, str(model_dir), "vllm", tmp_path / "vllm2", kv="fp8", dtype="float16")
    assert not any("weights loaded" in note for note in res.notes)


# --------------------------------------------------------------------------- the GGUF conversion


def test_gguf_conversion_is_refused_in_one_line_when_the_float32_model_does_not_fit(tiny_models, tmp_path, monkeypatch):
    """transformers dequantizes a GGUF whole in float32: a limit under that is refused before anything is read or
    written; at the limit it converts."""
    from test_families import FAMILIES, GGUF, GGUF_UNMAPPED, _write_gguf
    from transformers import AutoTokenizer

    from trtkv.models import _CACHE_MARKER, checkpoint_dir, gguf_cache_dir, model_info

    monkeypatch.setenv("TRTKV_CACHE", str(tmp_path / "cache"))
    arch, kw = FAMILIES["qwen3"]
    d, model = tiny_models(arch, with_tokenizer=True, **{k: v for k, v in kw.items() if k not in GGUF_UNMAPPED})
    path = tmp_path / "tiny.gguf"
    _write_gguf(model, AutoTokenizer.from_pretrained(str(d)), path, GGUF["qwen3"])
    info = model_info(str(path))
    params = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    need = memory.conversion_bytes(info)
    assert need == params * 4 + emb * 4 + memory.HOST_OVERHEAD  # independent count: the model's own parameters
    monkeypatch.setenv(memory.LIMIT_ENV, str(need - 1))
    with pytest.raises(TrtkvError, match=r"converting tiny\.gguf .* needs .* float32") as e:
        checkpoint_dir(str(path))
    assert "\n" not in str(e.value) and str(gguf_cache_dir(str(path))) in e.value.fix
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.safetensors"))
    monkeypatch.setenv(memory.LIMIT_ENV, str(need))
    ckpt, _ = checkpoint_dir(str(path))
    assert (ckpt / _CACHE_MARKER).is_file()
