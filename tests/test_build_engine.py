"""trtkv build-engine: the ONNX step network under ONNX Runtime against the torch reference path.

Reference: the transformers model reading trtkv's quantized cache (``trtkv.evaluate.model_logits`` /
``greedy_generate``) with the same sealed format. Engines run the way the runtime runs them
(``trtkv.builder.verify``: block-aligned prefill chunks, decode steps, ``PagedKVCache.write_new_rows``).

Tolerances: the engine computes in float32 like the reference, but its open block and the step's own
rows are fp16 values (what the fp16 tail holds) where the reference keeps the fp16 format's tail in
float32, and ONNX Runtime sums in another order; on the tiny model that is <= 1e-4 absolute on the
logits at fp16 K/V rounding (relative 2^-11 of values ~1, through 2 layers: bound 5e-4); quantized
formats: the reference also rounds its open block to fp16, so only summation order differs (bound 1e-5). On the real model (30 layers, logits of magnitude ~20) the bound is 2e-3 absolute.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from trtkv.builder.build import build_engine
from trtkv.builder.verify import StaticBatch, greedy_decode
from trtkv.errors import TrtkvError
from trtkv.evaluate import greedy_generate, model_logits
from trtkv.manifest import load_manifest
from trtkv.runtime.backends import OnnxRuntimeEngine
from trtkv.runtime.kv_pool import PagedKVCache

TINY_BLOCK = 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from conftest import build_tiny_model

    d = tmp_path_factory.mktemp("tiny") / "tiny-mistral"
    build_tiny_model(d, "mistral", with_tokenizer=True)
    return d


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


@pytest.mark.parametrize("kv", ["fp16", "int8", "int4", "k=int8:token:asym,v=int4:g8:sym:hadamard"])
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
    assert m.kv_spec == "k=int4:bchannel:asym,v=int4:token:asym:hadamard,block=4"
    assert m.limits.max_blocks_per_seq == 16 and m.limits.max_new_tokens_per_step == TINY_BLOCK
    assert {"model.onnx", "model.onnx.data", "kv_params.safetensors", "manifest.json"} - {"manifest.json"} <= set(m.files)
    assert any(f.startswith("tokenizer/") for f in m.files)
    assert [t.name for t in m.inputs][:5] == ["input_ids", "context_lens", "new_lens", "block_tables", "slot_ids"]
    k_data = m.input("k_data")
    assert k_data.dtype == "int8" and k_data.storage_dtype == "uint8" and k_data.shape[-1] == m.model.head_dim // 2
    assert m.bytes_per_token == pytest.approx(m.bytes_per_block / TINY_BLOCK)
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
