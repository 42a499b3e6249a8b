"""Exports of calibrated per-tensor KV scales in other engines' checkpoint conventions.

Both conventions store the *dequantization* scale (``x ~= code * scale``), i.e. the same direction
as trtkv's ``TensorParams.scale``: ``amax / 127`` for INT8 and ``amax / 448`` for FP8 E4M3 when
calibrated with max. Sources are listed in docs/calibration.md.

TensorRT-LLM (checkpoint format, ``trtllm/{format}/``):
  ``config.json`` with ``quantization.kv_cache_quant_algo`` = ``"INT8"`` | ``"FP8"`` and
  ``rank0.safetensors`` holding, per layer, ``transformer.layers.{i}.attention.kv_cache_scaling_factor``
  (float32, shape [1]; one scale shared by K and V: the max of the two) and its reciprocal
  ``...attention.kv_cache_rcp_scaling_factor`` (float32, [1]; what the attention plugin multiplies
  by when quantizing). Only the KV-cache tensors are written: merge them into the rank files of a
  converted checkpoint.

vLLM / llm-compressor (compressed-tensors, ``vllm/{format}/``):
  ``kv_scales.safetensors`` with ``model.layers.{i}.self_attn.k_scale`` and ``...v_scale``
  (float32, shape [1] for a per-tensor scale, [num_kv_heads] for per-head FP8), plus
  ``quantization_config.json``: the ``kv_cache_scheme`` block for the model's ``config.json``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, is_dataclass
from typing import Any, Sequence

import torch

from trtkv.artifacts import LayerParams
from trtkv.formats import KVFormat

TRTLLM_ALGO = {"int8": "INT8", "fp8_e4m3": "FP8"}


def _safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)


def safe_name(name: str) -> str:
    """A format name usable as a folder name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "format"


def _info_dict(info: Any) -> dict:
    if is_dataclass(info):
        return asdict(info)
    if hasattr(info, "model_dump"):
        return info.model_dump()
    return dict(info)


def trtllm_supported(fmt: KVFormat) -> bool:
    """TensorRT-LLM's KV cache takes one static per-tensor INT8 or FP8 scale per layer, symmetric, untransformed."""
    return all(
        t.dtype in TRTLLM_ALGO and t.granularity == "per_tensor" and not t.smooth and not t.hadamard for t in (fmt.k, fmt.v)
    ) and fmt.k.dtype == fmt.v.dtype and fmt.block_size is None


def trtllm_scales(params: Sequence[LayerParams]) -> dict[str, torch.Tensor]:
    """``transformer.layers.{i}.attention.kv_cache_(rcp_)scaling_factor`` tensors, float32 [1]."""
    out = {}
    for i, lp in enumerate(params):
        assert lp.k.scale is not None and lp.v.scale is not None
        s = torch.maximum(lp.k.scale.float().reshape(()), lp.v.scale.float().reshape(())).reshape(1)
        out[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"] = s.clone()
        out[f"transformer.layers.{i}.attention.kv_cache_rcp_scaling_factor"] = torch.reciprocal(s)
    return out


def export_trtllm(fmt: KVFormat, params: Sequence[LayerParams], info: Any) -> dict[str, bytes]:
    """Files (relative path -> bytes) of the TensorRT-LLM export, or {} when the format does not map."""
    if not trtllm_supported(fmt):
        return {}
    m = _info_dict(info)
    folder = f"trtllm/{safe_name(fmt.name)}"
    config = {
        "architecture": m.get("architecture"),
        "num_hidden_layers": m.get("num_layers"),
        "num_attention_heads": m.get("num_heads"),
        "num_key_value_heads": m.get("num_kv_heads"),
        "head_size": m.get("head_dim"),
        "hidden_size": m.get("hidden_size"),
        "vocab_size": m.get("vocab_size"),
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": TRTLLM_ALGO[fmt.k.dtype]},
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "trtkv": {
            "note": "KV-cache scales only: merge rank0.safetensors into a converted checkpoint's rank files "
            "and set quantization.kv_cache_quant_algo in its config.json",
            "format": fmt.name,
            "model_sha256": m.get("sha256"),
            "scale_direction": "dequantize: x = code * kv_cache_scaling_factor",
        },
    }
    tensors = trtllm_scales(params)
    return {
        f"{folder}/config.json": (json.dumps(config, indent=2) + "\n").encode(),
        f"{folder}/rank0.safetensors": _safetensors_bytes(tensors, {"format": "pt"}),
    }


def vllm_supported(fmt: KVFormat) -> bool:
    """vLLM's FP8 KV cache: static symmetric e4m3 scales per tensor, or per KV head (``attn_head``)."""
    return all(
        t.dtype == "fp8_e4m3" and t.granularity in ("per_tensor", "per_head") and not t.smooth and not t.hadamard for t in (fmt.k, fmt.v)
    ) and fmt.k.granularity == fmt.v.granularity and fmt.block_size is None


def vllm_scales(params: Sequence[LayerParams]) -> dict[str, torch.Tensor]:
    """``model.layers.{i}.self_attn.{k,v}_scale`` float32: [1] per tensor, [H] per head."""
    out = {}
    for i, lp in enumerate(params):
        for kv in ("k", "v"):
            s = getattr(lp, kv).scale
            assert s is not None
            s = s.float()
            out[f"model.layers.{i}.self_attn.{kv}_scale"] = (s.reshape(1) if s.dim() == 0 else s.reshape(-1)).clone()
    return out


def vllm_kv_cache_scheme(fmt: KVFormat) -> dict:
    """The compressed-tensors ``kv_cache_scheme`` block (``quantization_config.kv_cache_scheme``)."""
    return {
        "num_bits": 8,
        "type": "float",
        "strategy": "attn_head" if fmt.k.granularity == "per_head" else "tensor",
        "dynamic": False,
        "symmetric": True,
    }


def export_vllm(fmt: KVFormat, params: Sequence[LayerParams], info: Any) -> dict[str, bytes]:
    """Files of the vLLM / llm-compressor export, or {} when the format does not map."""
    if not vllm_supported(fmt):
        return {}
    folder = f"vllm/{safe_name(fmt.name)}"
    qc = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": vllm_kv_cache_scheme(fmt),
    }
    return {
        f"{folder}/kv_scales.safetensors": _safetensors_bytes(vllm_scales(params), {"format": "pt"}),
        f"{folder}/quantization_config.json": (json.dumps(qc, indent=2) + "\n").encode(),
    }


def export_all(fmt: KVFormat, params: Sequence[LayerParams], info: Any) -> dict[str, bytes]:
    """Every export that applies to ``fmt`` (relative path -> bytes)."""
    return {**export_trtllm(fmt, params, info), **export_vllm(fmt, params, info)}


def load_safetensors_bytes(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


__all__ = [
    "export_all", "export_trtllm", "export_vllm", "trtllm_scales", "vllm_scales", "vllm_kv_cache_scheme",
    "trtllm_supported", "vllm_supported", "safe_name", "load_safetensors_bytes",
]
