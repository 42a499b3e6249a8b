"""``build-engine --backend torch`` end to end: the engine directory (no network, the weights by reference),
``open_engine`` / ``LLMEngine``, ``trtkv inspect``, ``trtkv generate --engine``, and ``trtkv serve`` over the real
tritonserver (python backend, CPU). Reference: the ONNX Runtime engine of the same model and format, run by the
same runtime (its greedy text), and the offline torch engine for the served text."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from trtkv.builder.build import build_engine
from trtkv.cli import app
from trtkv.errors import TrtkvError
from trtkv.manifest import load_manifest
from trtkv.models import load_model
from trtkv.runtime.backends import open_engine
from trtkv.runtime.llm_engine import LLMEngine, RuntimeConfig
from trtkv.runtime.sequence import SamplingParams
from trtkv.runtime.torch_engine import TorchEngine

PROMPTS = ["The quick brown fox", "def f(x):\n    return", "Pack my box with"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from conftest import build_tiny_model

    root = tmp_path_factory.mktemp("torchwire")
    build_tiny_model(root / "model", "llama", with_tokenizer=True, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    loaded = load_model(str(root / "model"), device="cpu", dtype="float32")
    return {be: build_engine(str(root / "model"), kv="int4", out=root / f"engine-{be}", backend=be, block_size=16, max_batch=8,
                             max_seq_len=256, loaded=loaded) for be in ("torch", "onnxruntime")}


def offline(engine, prompts, max_tokens: int, **kw) -> list[str]:
    llm = LLMEngine.from_engine_dir(engine, RuntimeConfig(kv_memory_gib=0.01, max_seqs=16))
    return [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, **kw))]


def test_torch_engine_directory_opens_and_generates_like_onnxruntime(engines):
    d = engines["torch"]
    m = load_manifest(d)
    assert m.backend == "torch" and m.opset == 0 and not m.plans
    (d / "manifest.json").read_bytes().decode("ascii")  # tritonserver's python stub reads it with the ASCII locale
    assert not any(f.endswith(".onnx") or f.endswith(".onnx.data") for f in m.files)
    assert "kv_params.safetensors" in m.files and any(f.startswith("tokenizer/") for f in m.files)
    assert m.model.source.endswith("model") and len(m.model.sha256) == 64 and "torch" in m.runtime_needs
    assert [t.name for t in m.inputs][:5] == ["input_ids", "context_lens", "new_lens", "block_tables", "slot_ids"]
    assert m.input("k_data").dtype == "uint8" and m.input("k_data").shape[-1] == m.model.head_dim // 2
    assert isinstance(open_engine(d), TorchEngine)
    assert offline(d, PROMPTS, 20, ignore_eos=True) == offline(engines["onnxruntime"], PROMPTS, 20, ignore_eos=True)


def test_torch_engine_refuses_other_weights(engines, tmp_path):
    import shutil

    d = tmp_path / "moved"
    shutil.copytree(engines["torch"], d)
    raw = json.loads((d / "manifest.json").read_text())
    raw["model"]["sha256"] = "0" * 64
    (d / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(TrtkvError, match="not the ones the engine was built for"):
        open_engine(d)


def test_inspect_and_generate_cli(engines):
    res = CliRunner().invoke(app, ["inspect", str(engines["torch"])])
    assert res.exit_code == 0, res.output
    assert "valid" in res.output and "torch" in res.output and "run with   torch" in res.output
    res = CliRunner().invoke(app, ["generate", "The quick brown fox", "--engine", str(engines["torch"]), "-n", "8", "--no-stream"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("The quick brown fox")


def test_generate_runs_the_attention_asked_for_and_refuses_one_that_cannot_run(engines):
    """``generate --attention``: the torch ops and the C kernels give the same greedy text, the last line names the
    backend that ran; a network engine refuses any choice but auto in one line."""
    texts = {}
    for attention in ("torch", "cpu"):
        res = CliRunner().invoke(app, ["generate", "The quick brown fox", "--engine", str(engines["torch"]), "-n", "12", "--no-stream",
                                       "--attention", attention])
        assert res.exit_code == 0, res.output
        texts[attention] = res.stdout
        assert f"attention {attention} (torch engine, " in " ".join(res.stderr.split())
    assert texts["torch"] == texts["cpu"] and texts["cpu"].startswith("The quick brown fox")
    res = CliRunner().invoke(app, ["generate", "x", "--engine", str(engines["onnxruntime"]), "-n", "2", "--attention", "cpu"])
    assert res.exit_code == 2 and "--attention cpu chooses the torch engine's attention" in res.output
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.server
@pytest.mark.slow
def test_served_greedy_equals_offline(engines, tmp_path):
    pytest.importorskip("pytriton")
    pytest.importorskip("tritonclient")
    from trtkv.triton_repo.client import generate
    from trtkv.triton_repo.repository import RepoOptions, write_repository
    from trtkv.triton_repo.server import TritonServer, free_port

    want = offline(engines["torch"], PROMPTS, 16, ignore_eos=True)
    repo = write_repository(engines["torch"], tmp_path / "repo", RepoOptions(runtime=RuntimeConfig(kv_memory_gib=0.01, max_seqs=16), instance_kind="cpu"), force=True)
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_file=tmp_path / "server.log")
    server.start(timeout=180)
    try:
        got = [generate(server.http_url, p, 16, min_length=16, exclude_input_in_output=True)["text_output"] for p in PROMPTS]
    finally:
        server.stop()
    assert got == want
