"""``trtkv build-engine --backend torch``: an engine directory without a network.

The torch engine (``trtkv.runtime.torch_engine``) runs the transformers model itself, so the directory holds
only what the runtime needs around it: ``manifest.json`` (backend ``torch``, the step contract's tensors as
the runtime feeds them, the pool layout and byte counts), ``kv_params.safetensors``, ``tokenizer/``, and a
reference to the weights -- the model's path and sha256 in ``manifest.model`` (``source``, ``sha256``), checked
when the engine is opened. The check stage runs one torch-engine step and wants finite logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trtkv.manifest import EngineManifest, TensorSpec
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.step import StepBatch
from trtkv.runtime.torch_engine import TorchEngine

TORCH_OPSET = 0  # no ONNX graph


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def step_specs(layout, num_layers: int, vocab_size: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The step contract's inputs and outputs as the torch engine takes them (pools in their storage dtype),
    every shape asked of the ``PagedKVLayout`` (a per-layer format: layer 0's; each layer group has its own pools)."""
    layout = layout.layer(0)
    L, H, D = num_layers, layout.num_kv_heads, layout.head_dim
    ins = [
        TensorSpec(name="input_ids", shape=["batch", "new_tokens"], dtype="int64"),
        TensorSpec(name="context_lens", shape=["batch"], dtype="int64"),
        TensorSpec(name="new_lens", shape=["batch"], dtype="int64"),
        TensorSpec(name="block_tables", shape=["batch", "max_blocks"], dtype="int64"),
        TensorSpec(name="slot_ids", shape=["batch"], dtype="int64"),
    ]
    for which in ("k", "v"):
        ins.append(TensorSpec(name=f"{which}_data", shape=list(layout.data_shape(which, "num_blocks", layers=L)), dtype=_name(layout.data_dtype(which))))
        for field, shape in (("scale", layout.scale_shape(which, "num_blocks", layers=L)), ("zero", layout.zero_shape(which, "num_blocks", layers=L))):
            if shape is not None:
                ins.append(TensorSpec(name=f"{which}_{field}", shape=list(shape), dtype="float16"))
        ins.append(TensorSpec(name=f"{which}_tail", shape=list(layout.tail_shape("num_slots", layers=L)), dtype="float16"))
    outs = [
        TensorSpec(name="logits", shape=["batch", vocab_size], dtype="float32"),
        TensorSpec(name="new_k", shape=[L, "batch", "new_tokens", H, D], dtype="float16"),
        TensorSpec(name="new_v", shape=[L, "batch", "new_tokens", H, D], dtype="float16"),
    ]
    return ins, outs


def smoke_step(loaded, layout1, params) -> None:
    """One torch-engine step over a sealed block and an open row (random pool): finite logits, or a RuntimeError."""
    info = loaded.info
    bs = layout1.block_size
    cache = PagedKVCache(type(layout1)(layout1.fmt, info.num_kv_heads, info.head_dim, bs, 2, 1), info.num_layers, params)
    configs = {id(c): c for c in (loaded.model.config, loaded.model.config.get_text_config(decoder=True))}.values()
    before = [c._attn_implementation for c in configs]
    try:  # the engine takes over the model's attention; give it back to the caller afterwards
        out = TorchEngine(loaded.model, kv_format=layout1.fmt).step(StepBatch.make([[1, 2]], [bs], [[0, 1]], [0]), cache)
    finally:
        for c, impl in zip(configs, before):
            c._attn_implementation = impl
    if out.logits.shape != (1, info.vocab_size) or not torch.isfinite(out.logits).all():
        raise RuntimeError(f"the torch engine's smoke step gave logits of shape {tuple(out.logits.shape)} with non-finite values")


def torch_manifest(manifest: EngineManifest, tmp: Path) -> EngineManifest:
    """The manifest ``build._manifest`` wrote for an ONNX engine, made a torch one: no opset, what it needs to run."""
    versions = manifest.build.get("versions", {})
    needs = {"torch": f"torch {versions.get('torch')} and transformers {versions.get('transformers')} (CPU, or CUDA with triton for the "
                      f"paged kernels); the model weights at {manifest.model.source or manifest.model.name} (sha256 {manifest.model.sha256[:16]}...)"}
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    return manifest.model_copy(update={"opset": TORCH_OPSET, "runtime_needs": needs, "files": files})
