"""trtkv build-engine: the ONNX step network under ONNX Runtime against the torch reference path.

Reference: the transformers model reading trtkv's quantized cache (``trtkv.evaluate.model_logits`` /
``greedy_generate``) with the same sealed format. Engines run the way the runtime runs them
(``trtkv.runtime.verify``: block-aligned prefill chunks, decode steps, ``PagedKVCache.write_new_rows``).

Tolerances (tiny model, 2 layers): the engine and the reference both compute in float32. Quantized formats:
the reference rounds its open block to fp16 like the engine's tail, so only summation order differs: bound
1e-5 (measured ~2e-7). fp16 format: the reference keeps its cache in float32 while the engine's open block and
pool are fp16 (K/V rounded by 2^-11 relative): bound 5e-4 (measured 1.7e-4). Real-model tolerances are
explained above ``REF_TOL``.
"""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch
from conftest import calibration_free

from trtkv.builder.build import build_engine
from trtkv.errors import TrtkvError
from trtkv.evaluate import greedy_generate, model_logits
from trtkv.manifest import load_manifest
from trtkv.models import ModelInfo
from trtkv.runtime.backends import OnnxRuntimeEngine
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.verify import StaticBatch, greedy_decode

TINY_BLOCK = 4


@pytest.fixture(scope="module")
def tiny_dir(tiny_models):
    return tiny_models("mistral", with_tokenizer=True)[0]


@pytest.fixture(scope="module")
def tiny_loaded(tiny_dir):
    from trtkv.models import load_model

    return load_model(str(tiny_dir), device="cpu", dtype="float32")


def _engine_logits(engine, cache, ids: torch.Tensor) -> torch.Tensor:
    """Logits [n, S, V] at every position: one token per step (decode), the way the reference computes them."""
    sb = StaticBatch(cache, ids.shape[0])
    out = []
    for t in range(ids.shape[1]):
        out.append(sb.step(engine, {i: [int(ids[i, t])] for i in range(ids.shape[0])}))
    return torch.stack(out, 1)


@pytest.mark.parametrize("kv", ["fp16", "int8", "int4", calibration_free("int3", 24), calibration_free("int2", 24),
                                "k=int8:token:asym,v=int4:g8:sym:hadamard", "k=int3:token:asym,v=int2:g8:sym:hadamard"],
                         ids=["fp16", "int8", "int4", "int3-free", "int2-free", "int8-int4", "int3-int2"])
def test_tiny_engine_matches_reference(tmp_path, tiny_dir, tiny_loaded, kv):
    out = build_engine(str(tiny_dir), None, kv, tmp_path / "eng", backend="onnxruntime", block_size=TINY_BLOCK, max_seq_len=64, max_batch=4, loaded=tiny_loaded)
    eng = OnnxRuntimeEngine(out)
    m = eng.manifest
    torch.manual_seed(0)
    ids = torch.randint(0, m.model.vocab_size, (2, 11))
    cache = PagedKVCache.for_engine(m, out, num_blocks=12, num_slots=2)
    got = _engine_logits(eng, cache, ids)
    with torch.inference_mode():
        ref = model_logits(tiny_loaded.model, ids, m.kv_format, cache.params)
    tol = 5e-4 if kv == "fp16" else 1e-5
    assert (got - ref).abs().max().item() < tol
    # prefill in block-aligned chunks + greedy decode gives the reference's tokens
    cache = PagedKVCache.for_engine(m, out, num_blocks=12, num_slots=2)
    toks = greedy_decode(eng, cache, ids[:, :7].tolist(), 12)
    with torch.inference_mode():
        ref_toks = greedy_generate(tiny_loaded.model, ids[:, :7], m.kv_format, cache.params, new_tokens=12)
    assert torch.equal(toks, ref_toks)


def test_manifest_is_complete_and_validated(tmp_path, tiny_dir, tiny_loaded):
    out = build_engine(str(tiny_dir), None, "int4", tmp_path / "eng", backend="onnxruntime", block_size=TINY_BLOCK, max_seq_len=64, max_batch=4, loaded=tiny_loaded)
    m = load_manifest(out)
    assert m.kv_spec == "k=int4:bchannel:asym:hadamard,v=int4:g24:sym:hadamard,block=4,sink=2"  # the preset fitted to head_dim 24 and block 4
    assert m.limits.max_blocks_per_seq == 16 and m.limits.max_new_tokens_per_step == TINY_BLOCK
    assert {"model.onnx", "model.onnx.data", "kv_params.safetensors"} <= set(m.files)
    assert any(f.startswith("tokenizer/") for f in m.files)
    assert [t.name for t in m.inputs][:5] == ["input_ids", "context_lens", "new_lens", "block_tables", "slot_ids"]
    k_data = m.input("k_data")
    assert k_data.dtype == "int8" and k_data.storage_dtype == "uint8" and k_data.shape[-1] == m.model.head_dim // 2
    assert m.bytes_per_token == pytest.approx(m.bytes_per_block / TINY_BLOCK)
    # the manifest's model is the record the builder read; eos ids and RoPE base as transformers reports them
    assert ModelInfo.model_validate(m.model.model_dump()) == tiny_loaded.info
    assert list(m.model.eos_token_ids) == [tiny_loaded.model.generation_config.eos_token_id] == [2]
    assert m.model.rope_theta == tiny_loaded.model.config.rope_parameters["rope_theta"]
    # a manifest written before the record's later fields existed still loads, with the same facts
    raw = json.loads((out / "manifest.json").read_text())
    for key in ("rope_layout", "param_bytes", "num_params"):
        del raw["model"][key]
    (out / "manifest.json").write_text(json.dumps(raw))
    assert load_manifest(out).model.model_dump(exclude={"param_bytes", "num_params"}) == m.model.model_dump(exclude={"param_bytes", "num_params"})
    # a truncated file is caught
    data = out / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(TrtkvError, match="model.onnx.data has"):
        load_manifest(out)
    # an unknown field is caught
    raw = json.loads((out / "manifest.json").read_text())
    raw["surprise"] = 1
    (out / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(TrtkvError, match="invalid"):
        load_manifest(out)


# --------------------------------------------------------------------------- bad input: one line, exit 2, nothing written


def write_amax_calibration(loaded, out, formats=("fp8", "int8-static"), seq_len: int = 96):
    """A calibration artifact (``save_calibration``) with max-calibrated static scales of ``formats``:
    per layer, the amax of K (after RoPE) and V over a few windows of the builtin text (or random ids)."""
    from transformers import DynamicCache

    from trtkv.artifacts import CalibrationRecipe, FormatCalibration, LayerParams, ModelIdentity, save_calibration
    from trtkv.formats import get_format
    from trtkv.quant import TensorParams

    torch.manual_seed(0)
    ids = torch.randint(0, loaded.info.vocab_size, (2, seq_len))
    cache = DynamicCache()
    with torch.inference_mode():
        import inspect

        key = "cache" if "cache" in inspect.signature(loaded.model.forward).parameters else "past_key_values"
        loaded.model(input_ids=ids, use_cache=True, **{key: cache})
    amax = [(layer.keys.abs().max().item(), layer.values.abs().max().item()) for layer in cache.layers]
    params, fcs = {}, {}
    for name in formats:
        fmt = get_format(name)
        qmax = fmt.k.traits.sym_max
        if fmt.shared_kv_scale:
            layers = [LayerParams(k=TensorParams(scale=torch.tensor(max(k, v) / qmax)), v=TensorParams(scale=torch.tensor(max(k, v) / qmax))) for k, v in amax]
        else:
            layers = [LayerParams(k=TensorParams(scale=torch.tensor(k / qmax)), v=TensorParams(scale=torch.tensor(v / qmax))) for k, v in amax]
        params[name] = layers
        fcs[name] = FormatCalibration(definition=fmt, method="max")
    recipe = CalibrationRecipe(model=ModelIdentity.of(loaded.info), formats=fcs, requested_formats=list(formats), method="max")
    return save_calibration(out, recipe, params)


@pytest.fixture(scope="module")
def tiny_cal(tiny_loaded, tmp_path_factory):
    """Calibration of the tiny model for fp8 only (static scales)."""
    return write_amax_calibration(tiny_loaded, tmp_path_factory.mktemp("cal") / "cal-fp8", formats=("fp8",))


def test_engine_and_eval_record_the_same_calibration_hash(tmp_path, tiny_dir, tiny_loaded, tiny_cal):
    """One calibration, two consumers: the engine manifest and eval's --json meta name it by the same sha256."""
    from trtkv.artifacts import calibration_sha256
    from trtkv.evaluate import run_eval

    out = build_engine(str(tiny_dir), tiny_cal, "fp8", tmp_path / "eng", backend="onnxruntime", block_size=TINY_BLOCK,
                       max_seq_len=64, max_batch=2, loaded=tiny_loaded)
    meta: dict = {}
    run_eval(str(tiny_dir), "builtin:pydoc", ["fp8"], calibration=tiny_cal, windows=1, seq_len=32, device="cpu",
             dtype="float32", generate_prompts=0, progress=False, meta=meta)
    engine_hash = load_manifest(out).calibration.sha256
    assert len(engine_hash) == 64 and engine_hash == meta["calibration_sha256"] == calibration_sha256(tiny_cal)


def _cli(*args):
    from typer.testing import CliRunner

    from trtkv.cli import app

    return CliRunner().invoke(app, ["build-engine", *map(str, args)])


def _assert_one_line_error(res, *needles):
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip() and "Loading weights" not in ln]  # transformers' progress bar
    assert len(lines) == 1, res.output
    text = lines[0]
    assert text.startswith("error:") and " — " in text, res.output  # problem — fix
    for n in needles:
        assert n in text, (n, res.output)


def _nothing_written(parent, name="eng"):
    return not any(p.name.startswith(name) for p in parent.iterdir())


def test_errors_calibration_of_another_model(tmp_path, tiny_dir, tiny_cal, tiny_models):
    other, _ = tiny_models("llama", with_tokenizer=True)
    res = _cli("--model", other, "--calibration", tiny_cal, "--kv", "fp8", "--out", tmp_path / "eng", "--backend", "onnxruntime", "--max-seq-len", "64")
    _assert_one_line_error(res, str(tiny_dir), str(other), "calibrate")
    assert _nothing_written(tmp_path)


def test_errors_format_needs_scales_the_calibration_lacks(tmp_path, tiny_dir, tiny_cal):
    res = _cli("--model", tiny_dir, "--calibration", tiny_cal, "--kv", "int8-static", "--out", tmp_path / "eng", "--backend", "onnxruntime", "--max-seq-len", "64")
    _assert_one_line_error(res, "int8-static", "calibrate")
    res = _cli("--model", tiny_dir, "--kv", "fp8", "--out", tmp_path / "eng", "--backend", "onnxruntime", "--max-seq-len", "64")
    _assert_one_line_error(res, "fp8 needs a calibration (scales)", "trtkv calibrate", "--kv fp8", "--calibration")
    assert _nothing_written(tmp_path)


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--max-seq-len", "512"], ["--max-seq-len 512", "256 positions", "--max-seq-len 256"]),
        (["--block-size", "48", "--max-seq-len", "96"], ["block sizes", "48", "--block-size"]),
        (["--backend", "tensorrt-rtx", "--compute-capability", "89,90", "--max-seq-len", "64"], ["SM90", "--backend tensorrt"]),
        (["--backend", "tensorrt", "--max-seq-len", "64"], ["tensorrt", "NGC", "pip install tensorrt"]),
        (["--kv", "k=int4:g32,v=int4:g32", "--max-seq-len", "64"], ["group size 32", "head_dim 24"]),  # a written-out spec is not refitted
    ],
)
def test_errors_bad_arguments(tmp_path, tiny_dir, args, needles):
    if "tensorrt" in args and _has("tensorrt"):
        pytest.skip("tensorrt is installed here")
    res = _cli("--model", tiny_dir, "--out", tmp_path / "eng", "--kv", "int8", *args)
    _assert_one_line_error(res, *needles)
    assert _nothing_written(tmp_path)


def _has(mod: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(mod) is not None


def test_existing_out_needs_force_and_failed_build_leaves_nothing(tmp_path, tiny_dir, monkeypatch):
    out = tmp_path / "eng"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = _cli("--model", tiny_dir, "--kv", "int8", "--out", out, "--backend", "onnxruntime", "--max-seq-len", "64")
    _assert_one_line_error(res, "already exists", "--force")
    assert (out / "keep.txt").read_text() == "mine"
    # a failure mid-build (after the export stage wrote the ONNX files): no directory, no temp sibling, old one intact
    monkeypatch.setenv("TRTKV_BUILD_FAIL_AFTER", "export")
    res = _cli("--model", tiny_dir, "--kv", "int8", "--out", out, "--backend", "onnxruntime", "--max-seq-len", "64", "--force")
    assert res.exit_code == 1 and "simulated failure after stage export" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eng"] and (out / "keep.txt").read_text() == "mine"
    fresh = tmp_path / "fresh"
    res = _cli("--model", tiny_dir, "--kv", "int8", "--out", fresh, "--backend", "onnxruntime", "--max-seq-len", "64")
    assert res.exit_code == 1 and not fresh.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["eng"]
    monkeypatch.delenv("TRTKV_BUILD_FAIL_AFTER")
    res = _cli("--model", tiny_dir, "--kv", "int8", "--out", out, "--backend", "onnxruntime", "--max-seq-len", "64", "--force")
    assert res.exit_code == 0, res.output
    assert not (out / "keep.txt").exists() and (out / "manifest.json").is_file()
    from typer.testing import CliRunner

    from trtkv.cli import app

    shown = CliRunner().invoke(app, ["inspect", str(out)])
    assert shown.exit_code == 0 and "valid" in shown.output and "k=int8:bchannel:sym" in shown.output
    bad = CliRunner().invoke(app, ["inspect", str(tmp_path)])
    assert bad.exit_code == 2 and "not an engine directory" in bad.output


def test_max_seq_len_defaults_to_the_models_context(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.setenv("TRTKV_MEMORY_LIMIT", "64GiB")
    res = _cli("--model", tiny_dir, "--kv", "int8", "--out", tmp_path / "eng", "--backend", "torch", "--max-batch", "4")
    assert res.exit_code == 0, res.output
    m = load_manifest(tmp_path / "eng")
    assert m.limits.max_seq_len == m.model.max_position_embeddings == 256 and "note: --max-seq-len" not in res.output
    res = _cli("--model", tiny_dir, "--kv", "int8", "--out", tmp_path / "eng2", "--backend", "torch", "--max-seq-len", "96")
    assert res.exit_code == 0, res.output
    assert load_manifest(tmp_path / "eng2").limits.max_seq_len == 96  # given: kept


@pytest.mark.parametrize("limit", ["3GiB", "6GiB"])
def test_max_seq_len_default_is_bounded_by_the_memory_plan(tiny_dir, monkeypatch, limit):
    """A context the engine could not be opened with on this machine (the weights and its largest step's activations,
    ``load_plan``'s rule) is halved, in whole blocks, to the longest that opens; the note says so."""
    from trtkv.builder.build import default_max_seq_len
    from trtkv.manifest import Limits
    from trtkv.models import model_info
    from trtkv.runtime import torch_engine

    monkeypatch.setenv("TRTKV_MEMORY_LIMIT", limit)
    info = model_info(str(tiny_dir)).model_copy(update={"max_position_embeddings": 1 << 20})
    n, note = default_max_seq_len(info, "torch", 16, 64)

    def opens(length: int) -> bool:
        lim = Limits(max_batch=16, max_seq_len=length, block_size=64, max_blocks_per_seq=length // 64, max_new_tokens_per_step=64,
                     max_num_blocks=16 * length // 64, max_num_slots=16)
        try:
            torch_engine.load_plan(types.SimpleNamespace(limits=lim, model=info), torch.device("cpu"))
            return True
        except TrtkvError:
            return False

    assert 64 <= n < 1 << 20 and n % 64 == 0 and opens(n) and not opens(2 * n)
    assert f"--max-seq-len {n}" in note and str(1 << 20) in note and "--max-batch 16" in note
    assert default_max_seq_len(info, "tensorrt-rtx", 16, 64) == (1 << 20, None)  # built for GPUs this machine lacks


def test_max_seq_len_default_where_the_weights_do_not_fit_is_the_models_context(tiny_dir, monkeypatch):
    """A build machine that cannot hold the weights at all says nothing about the context: the engine is for another."""
    from trtkv.builder.build import default_max_seq_len
    from trtkv.models import model_info

    monkeypatch.setenv("TRTKV_MEMORY_LIMIT", "1MiB")
    info = model_info(str(tiny_dir))
    n, note = default_max_seq_len(info, "torch", 16, 64)
    assert n == info.max_position_embeddings and "do not fit" in note and "trtkv serve" in note


@pytest.mark.parametrize("gpu,trt,want", [(False, False, "cpu"), (False, True, "cpu"), (True, False, "torch"), (True, True, "tensorrt")])
def test_auto_backend_follows_the_machine(monkeypatch, gpu, trt, want):
    """--backend auto: TensorRT only with both a GPU and the package; a GPU without TensorRT (the H200 machine)
    gets the torch engine; no GPU: the measured CPU default."""
    import types

    from trtkv.builder import build

    monkeypatch.setattr(build, "gpu_present", lambda: gpu)
    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt") if trt else None)
    assert build.resolve_backend("auto") == (build.CPU_DEFAULT_BACKEND if want == "cpu" else want)
    assert build.resolve_backend("onnxruntime") == "onnxruntime"
    with pytest.raises(TrtkvError, match="unknown backend"):
        build.resolve_backend("tensorrt-llm")


def test_polygraphy_inspects_the_onnx(tmp_path, tiny_dir, tiny_loaded):
    import subprocess
    import sys

    out = build_engine(str(tiny_dir), None, "int4", tmp_path / "eng", backend="onnxruntime", block_size=TINY_BLOCK, max_seq_len=64, max_batch=4, loaded=tiny_loaded)
    exe = os.path.join(os.path.dirname(sys.executable), "polygraphy")
    res = subprocess.run([exe, "inspect", "model", str(out / "model.onnx")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    for name in ("input_ids", "k_data", "k_tail", "new_k", "logits"):
        assert name in res.stdout


# --------------------------------------------------------------------------- the real model (SmolLM2-135M)

# the first tier takes one format of each kind (unquantized, dynamic per-token int8, int4 with sealed blocks, sinks
# and Hadamard); the statically calibrated ones run in the second tier (the same CI run, its own step)
REAL_FORMATS = ["fp16", "int8", pytest.param("int8-static", marks=pytest.mark.tier2), pytest.param("fp8", marks=pytest.mark.tier2), "int4"]
# Tolerances on logits of magnitude ~20 after 30 layers (float32 everywhere):
# * against ``model_logits`` (the transformers model sealing ITS OWN K/V rows): the engine's rows come from
#   ONNX Runtime's float32 matmuls, the reference's from torch's; they differ in the last bits, and the fp16
#   rounding of the open block (then quantization when sealing) turns that into a different fp16 value / code for
#   0.1-0.6 % of the sealed elements (measured: int8 1456 of 737280 K codes, int4 597 of 368640 bytes). One code
#   step is 1/127 (int8) to 1/15 (int4) of a group's range, so the bound grows with the step: measured max
#   |diff| fp16 8.1e-3, fp8 9.4e-3, int8-static 2.1e-2, int8 2.2e-2, int4 6.7e-2; bounds below are ~2.5x that,
#   and the argmax must agree.
# * against ``TorchReferenceEngine`` reading the ENGINE's cache (same sealed codes): only the step's own rows
#   differ (fp16 values in the engine, float32 in transformers): measured <= 7.6e-3, bound 2e-2 for every format.
REF_TOL = {"fp16": 2e-2, "fp8": 3e-2, "int8-static": 5e-2, "int8": 5e-2, "int4": 0.15}
SAME_CACHE_TOL = 2e-2


@pytest.fixture(scope="module")
def real_cal(builtin_model, tmp_path_factory):
    return write_amax_calibration(builtin_model, tmp_path_factory.mktemp("realcal") / "cal", formats=("fp8", "int8-static"))


@pytest.fixture(scope="module")
def real_engines(builtin_model, real_cal, tmp_path_factory):
    """Lazily built ONNX Runtime engines of the real model, one per format (each export ~10 s)."""
    root = tmp_path_factory.mktemp("real-engines")
    built = {}

    def get(kv: str):
        if kv not in built:
            built[kv] = build_engine("smollm2-135m", real_cal, kv, root / kv, backend="onnxruntime", max_batch=4, max_seq_len=512, loaded=builtin_model)
        return built[kv]

    return get


@pytest.fixture(scope="module")
def real_prompts(builtin_model):
    from trtkv.data import token_windows

    return token_windows(builtin_model.tokenizer, "builtin:pydoc", seq_len=100, split="eval", samples=4)


@pytest.mark.model
@pytest.mark.parametrize("kv", REAL_FORMATS)
def test_real_model_logits_and_sealed_codes(builtin_model, real_engines, real_prompts, kv):
    """2 prompts of 100 tokens, prefilled in block-aligned chunks (0-64 sealed when written, 64-100 open)."""
    from trtkv.cache_layout import without_sink
    from trtkv.evaluate import _prefill
    from trtkv.kv_cache import QuantizedKVCache
    from trtkv.quant import quantize_block
    from trtkv.runtime.backends import TorchReferenceEngine
    from trtkv.runtime.step import StepBatch

    out = real_engines(kv)
    eng = OnnxRuntimeEngine(out, threads=2)
    m, fmt = eng.manifest, eng.manifest.kv_format
    ids = real_prompts[:2]
    cache = PagedKVCache.for_engine(m, out, num_blocks=8, num_slots=2)
    first = StepBatch.make(ids[:, :64].tolist(), [0, 0], [[3], [5]], [0, 1])
    out64 = eng.step(first, cache)
    cache.write_new_rows(first, out64)  # seals block 3 (sequence 0) and 5 (sequence 1)
    second = StepBatch.make(ids[:, 64:].tolist(), [64, 64], [[3, 4], [5, 6]], [0, 1])
    same_cache_ref = TorchReferenceEngine(builtin_model.model).step(second, cache).logits
    out100 = eng.step(second, cache)
    qc = QuantizedKVCache(fmt, m.model.num_layers, cache.params)
    with torch.inference_mode():
        ref = _prefill(builtin_model.model, ids, qc, fmt.block_size)  # model_logits, keeping the cache to read its codes
    err = max((out64.logits - ref[:, 63]).abs().max().item(), (out100.logits - ref[:, 99]).abs().max().item())
    err_same = (out100.logits - same_cache_ref).abs().max().item()
    mismatch = []
    for layer in range(m.model.num_layers):
        for which, new in (("k", out64.new_k), ("v", out64.new_v)):
            pool = cache.pool(layer, which)
            tf = cache.layout.tensor_format(which)
            for s, block in ((0, 3), (1, 5)):
                # bit for bit: the sealed block is trtkv.quant.quantize_block of the fp16 rows the engine returned,
                # its first sink_tokens rows kept in the slot's sink rows and replaced before quantizing
                rows = new[layer, s].transpose(0, 1).float()[None]  # [1, H, 64, D]
                sink = cache.layout.sink_tokens
                assert torch.equal(pool.tail[s, :, 64:].float(), rows[0, :, :sink]), (layer, which, "sink rows")
                qt = quantize_block(without_sink(rows, sink), tf, getattr(cache.params[layer], which), head_axis=-3)
                assert torch.equal(pool.data[block], qt.codes[0].to(pool.data.dtype)), (layer, which, s)
                for field in ("scale", "zero"):
                    if getattr(pool, field) is not None:
                        assert torch.equal(getattr(pool, field)[block], getattr(qt, field)[0]), (layer, which, field)
                if tf.is_quantized:  # against the reference's own sealed codes (from its own K/V rows)
                    theirs = getattr(qc.layers[layer], f"{which}_store").quantized.codes[s].to(pool.data.dtype)
                    mismatch.append((pool.data[block].view(torch.uint8) != theirs.view(torch.uint8)).float().mean().item())
    worst = max(mismatch, default=0.0)
    mean = sum(mismatch) / len(mismatch) if mismatch else 0.0
    print(f"{kv}: max |logit diff| vs model_logits {err:.2e}, vs torch reference on the engine's cache {err_same:.2e}, "
          f"sealed bytes differing from the reference's {mean:.2%} (worst layer {worst:.2%})")
    assert err < REF_TOL[kv] and err_same < SAME_CACHE_TOL
    assert torch.equal(out100.logits.argmax(-1), ref[:, 99].argmax(-1)) and torch.equal(out64.logits.argmax(-1), ref[:, 63].argmax(-1))
    assert mean < 0.01 and worst < 0.05


@pytest.mark.model
@pytest.mark.slow
def test_real_model_greedy_32_tokens_match_reference(builtin_model, real_engines, real_prompts):
    """4 prompts x 100 tokens: prefill chunks 0-64 / 64-100, 32 decode steps (the open block seals at 128 mid-decode)."""
    out = real_engines("int4")
    eng = OnnxRuntimeEngine(out, threads=2)
    cache = PagedKVCache.for_engine(eng.manifest, out, num_blocks=16, num_slots=4)
    got = greedy_decode(eng, cache, real_prompts.tolist(), 32)
    with torch.inference_mode():
        ref = greedy_generate(builtin_model.model, real_prompts, eng.manifest.kv_format, cache.params, new_tokens=32)
    same = (got == ref).int().cumprod(-1).sum(-1)  # tokens before the first divergence, per prompt
    assert (same == 32).sum() >= 2 and same.min() >= 16, same.tolist()  # most continuations identical, none diverging early
    for b in (same < 32).nonzero().flatten().tolist():
        # a divergence is allowed only at a near-tie the measured logit noise (REF_TOL) can flip:
        # the reference's top-2 margin at that step, with the same cache format
        d = int(same[b])
        ids = torch.cat([real_prompts[b], ref[b, :d]])[None]
        with torch.inference_mode():
            last = model_logits(builtin_model.model, ids, eng.manifest.kv_format, cache.params)[0, -1]
        top2 = last.topk(2).values
        assert float(top2[0] - top2[1]) < REF_TOL["int4"], (b, d, float(top2[0] - top2[1]))


@pytest.mark.tier2
@pytest.mark.model
@pytest.mark.slow
def test_tensorrt_rtx_builds_the_real_network_sm89(builtin_model, tmp_path):
    pytest.importorskip("tensorrt_rtx")
    out = build_engine("smollm2-135m", None, "int4", tmp_path / "rtx", backend="tensorrt-rtx", compute_capabilities=[89], max_batch=8, max_seq_len=1024, loaded=builtin_model)
    m = load_manifest(out)
    assert m.backend == "tensorrt-rtx" and m.dtype == "fp16" and [p.compute_capability for p in m.plans] == [89]
    plan = m.plans[0]
    assert plan.bytes > 200 * 2**20  # fp16 weights of 135M parameters are ~270 MB
    print(f"TensorRT-RTX SM89 build: {plan.build_seconds:.1f} s, plan {plan.bytes / 2**20:.1f} MiB")


@pytest.mark.tier2
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("TRTKV_SLOW_TESTS"), reason="four TensorRT-RTX plans of the real model (~2 min quiet, ~8 min under load); set TRTKV_SLOW_TESTS=1")
def test_tensorrt_rtx_builds_all_capabilities(builtin_model, tmp_path):
    pytest.importorskip("tensorrt_rtx")
    out = build_engine("smollm2-135m", None, "int4", tmp_path / "rtx", backend="tensorrt-rtx", compute_capabilities=[80, 86, 89, 120], max_batch=8, max_seq_len=1024, loaded=builtin_model)
    m = load_manifest(out)
    assert [p.compute_capability for p in m.plans] == [80, 86, 89, 120]


# --------------------------------------------------------------------------- plugin attention


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):
    """A tiny model inside the op contract's limits (head dim 32) and its fp8 calibration."""
    from conftest import build_tiny_model

    from trtkv.models import load_model

    d = tmp_path_factory.mktemp("tiny32") / "tiny-mistral-32"
    build_tiny_model(d, "mistral", with_tokenizer=True, head_dim=32)
    lm = load_model(str(d), device="cpu", dtype="float32")
    return d, lm, write_amax_calibration(lm, tmp_path_factory.mktemp("cal32") / "cal", formats=("fp8",))


@pytest.mark.parametrize("kv", ["int4", "fp8", "k=int8:token:asym,v=fp16"])
def test_native_and_plugin_graphs_give_the_same_logits(tmp_path, tiny32, kv):
    """The same steps (block-aligned prefill chunks that seal, then decode) through both graphs; the plugin graph's
    attention is one trtkv::PagedPrefillAttention per layer, run by the op contract's reference."""
    d, lm, cal32 = tiny32
    kw = dict(backend="onnxruntime", block_size=16, max_seq_len=64, max_batch=4, loaded=lm)
    cal = cal32 if kv == "fp8" else None
    native = OnnxRuntimeEngine(build_engine(str(d), cal, kv, tmp_path / "native", attention="native", **kw))
    plugin_dir = build_engine(str(d), cal, kv, tmp_path / "plugin", attention="plugin", **kw)
    plugin = OnnxRuntimeEngine(plugin_dir)
    assert plugin.manifest.attention == "plugin" and "model.ort.onnx" in plugin.manifest.files
    import onnx

    ops = {(n.domain, n.op_type) for n in onnx.load(str(plugin_dir / "model.onnx"), load_external_data=False).graph.node}
    assert ("trtkv", "PagedPrefillAttention") in ops and not any(t == "Softmax" for _, t in ops)
    torch.manual_seed(1)
    ids = torch.randint(0, native.manifest.model.vocab_size, (2, 24))
    caches = [PagedKVCache.for_engine(e.manifest, p, num_blocks=8, num_slots=2) for e, p in ((native, tmp_path / "native"), (plugin, plugin_dir))]
    drivers = [StaticBatch(c, 2) for c in caches]
    steps = [{0: ids[0, :16].tolist(), 1: ids[1, :10].tolist()}, {0: ids[0, 16:19].tolist(), 1: ids[1, 10:16].tolist()}]
    steps += [{0: [int(ids[0, t])], 1: [int(ids[1, t])]} for t in range(19, 23)]
    for rows in steps:
        a = drivers[0].step(native, rows)
        b = drivers[1].step(plugin, rows)
        assert (a - b).abs().max().item() < 2e-3  # the contract's q / k_new / v_new / output are fp16
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_plugin_attention_states_its_limits(tmp_path, tiny_dir, tiny_loaded):
    with pytest.raises(TrtkvError, match="head dims"):
        build_engine(str(tiny_dir), None, "int8", tmp_path / "p", attention="plugin", backend="onnxruntime", block_size=16, max_seq_len=64, loaded=tiny_loaded)
    with pytest.raises(TrtkvError, match="TensorRT-RTX loads no plugins"):
        build_engine(str(tiny_dir), None, "int8", tmp_path / "p", attention="plugin", backend="tensorrt-rtx", block_size=16, max_seq_len=64, loaded=tiny_loaded)


# --------------------------------------------------------------------------- TensorRT-RTX: every format's graph pattern


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["fp16", "int8", "fp8", "int4", "k=int8:token:asym,v=int4:g8:sym:hadamard"])
def test_tensorrt_rtx_builds_every_pool_pattern(tmp_path, tiny_dir, tiny_loaded, tiny_cal, kv):
    """The tiny model's native network for each pool encoding (fp16, int8 Cast, fp8 LUT Gather, int4 and unsigned
    int8 integer unpack from the int8-declared pool, dynamic / per-block scales) parses and builds for SM89."""
    pytest.importorskip("tensorrt_rtx")
    out = build_engine(str(tiny_dir), tiny_cal if kv == "fp8" else None, kv, tmp_path / "rtx", backend="tensorrt-rtx", compute_capabilities=[89],
                       block_size=16, max_seq_len=128, max_batch=4, loaded=tiny_loaded)
    m = load_manifest(out)
    assert m.plans[0].compute_capability == 89 and m.plans[0].bytes > 0 and (out / m.plans[0].path).stat().st_size == m.plans[0].bytes


@pytest.mark.parametrize("spec", ["int4:token", "int4:token:asym", "int8:token:asym", "fp8:tensor"])
def test_byte_lut_is_indexed_by_the_byte_read_as_int8_plus_128(spec):
    """The native graph reads uint8 pools as int8 and gathers row int32(x) + 128: that row holds the byte's codes."""
    from trtkv.builder.attention import _byte_lut
    from trtkv.formats import parse_tensor_spec

    t = parse_tensor_spec(spec)
    lut = _byte_lut(t)
    for b in range(256):
        x = b - 256 if b > 127 else b  # the byte read as int8
        row = lut[x + 128].tolist()
        if t.dtype == "int4":
            off = 8 if t.symmetric else 0
            assert row == [(b & 15) - off, (b >> 4) - off]
        elif t.dtype == "int8":
            assert row == b  # asymmetric codes are the unsigned byte
        elif b not in (0x7F, 0xFF):
            assert row == torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()
