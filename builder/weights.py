"""LLaMA-family weights as numpy arrays: Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm per head),
Phi-3 (fused qkv and gate_up projections, split here), tied or untied embeddings.

Read from a loaded transformers model (``trtkv.models.load_model``), so GGUF files and HF directories
both arrive here in the transformers rotate-half RoPE layout (docs/kv-formats.md section 8).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from trtkv.errors import TrtkvError
from trtkv.models import ModelInfo

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inv_freq (and attention_scaling) fixed at load


@dataclass
class LayerWeights:
    input_norm: np.ndarray
    wq: np.ndarray  # [hidden, nh*D] (transposed for x @ W)
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray  # [nh*D, hidden]
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    post_norm: np.ndarray
    w_gate: np.ndarray  # [hidden, inter]
    w_up: np.ndarray
    w_down: np.ndarray  # [inter, hidden]
    q_norm: np.ndarray | None = None  # [D] Qwen3: RMSNorm over each head's q before RoPE
    k_norm: np.ndarray | None = None  # [D] ... and k


@dataclass
class ModelWeights:
    """The model record (geometry, RoPE base, eps, eos) plus the numpy weights and RoPE constants the graph bakes in."""

    info: ModelInfo
    inv_freq: np.ndarray  # [D/2] float32, rope scaling applied
    attention_scaling: float
    embed: np.ndarray  # [V, hidden]
    lm_head: np.ndarray | None  # [V, hidden]; None when tied to embed
    final_norm: np.ndarray
    layers: list[LayerWeights] = field(default_factory=list)

    @property
    def tied(self) -> bool:
        return self.lm_head is None


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().to("cpu", torch.float32).numpy().copy()


def _t(w: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(_np(w).T)


def extract_weights(model, info: ModelInfo) -> ModelWeights:
    """Numpy float32 weights and the RoPE constants of a transformers LLaMA-family causal LM (``info``: its record)."""
    cfg = model.config.get_text_config(decoder=True)
    arch = info.architecture
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in STATIC_ROPE_TYPES:
        raise TrtkvError(f"RoPE scaling {rope_type!r} changes with the sequence length and is not supported by the step network", f"use a model with RoPE type one of {STATIC_ROPE_TYPES}")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise TrtkvError(f"{arch}: MLP activation {act!r} is not in the step network (it computes SwiGLU)", "use a model with hidden_act silu")
    base = model.model
    rot = base.rotary_emb
    if 2 * rot.inv_freq.numel() != info.head_dim:
        raise TrtkvError(
            f"{arch}: RoPE rotates {2 * rot.inv_freq.numel()} of {info.head_dim} channels (partial rotary), which the step network does not implement",
            "use a model whose RoPE rotates the whole head (partial_rotary_factor 1)",
        )
    H, D, nh = info.num_kv_heads, info.head_dim, info.num_heads
    layers = []
    for layer in base.layers:
        a, m = layer.self_attn, layer.mlp
        if hasattr(a, "qkv_proj"):  # Phi-3: rows [q (nh*D) | k (H*D) | v (H*D)]
            wq, wk, wv = torch.split(a.qkv_proj.weight, [nh * D, H * D, H * D], dim=0)
            bq = bk = bv = None
            if a.qkv_proj.bias is not None:
                bq, bk, bv = (_np(b) for b in torch.split(a.qkv_proj.bias, [nh * D, H * D, H * D]))
        else:
            wq, wk, wv = a.q_proj.weight, a.k_proj.weight, a.v_proj.weight
            bq, bk, bv = _np(a.q_proj.bias), _np(a.k_proj.bias), _np(a.v_proj.bias)
        if hasattr(m, "gate_up_proj"):  # Phi-3: rows [gate | up]
            w_gate, w_up = m.gate_up_proj.weight.chunk(2, dim=0)
            mlp_bias = m.gate_up_proj.bias
        else:
            w_gate, w_up, mlp_bias = m.gate_proj.weight, m.up_proj.weight, m.gate_proj.bias
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        layers.append(
            LayerWeights(
                input_norm=_np(layer.input_layernorm.weight),
                wq=_t(wq), wk=_t(wk), wv=_t(wv), wo=_t(a.o_proj.weight),
                bq=bq, bk=bk, bv=bv,
                post_norm=_np(layer.post_attention_layernorm.weight),
                w_gate=_t(w_gate), w_up=_t(w_up), w_down=_t(m.down_proj.weight),
                q_norm=None if q_norm is None else _np(q_norm.weight), k_norm=None if k_norm is None else _np(k_norm.weight),
            )
        )
        if getattr(a.o_proj, "bias", None) is not None or mlp_bias is not None:
            raise TrtkvError(f"{arch}: biases on o_proj / MLP are not supported", "use a model without o_proj / MLP biases")
    embed = base.embed_tokens.weight
    head = model.lm_head.weight
    tied = head.data_ptr() == embed.data_ptr() or info.tie_word_embeddings
    return ModelWeights(
        info=info,
        inv_freq=rot.inv_freq.detach().to("cpu", torch.float32).numpy().copy(),
        attention_scaling=float(getattr(rot, "attention_scaling", 1.0)),
        embed=_np(embed),
        lm_head=None if tied else _np(head),
        final_norm=_np(base.norm.weight),
        layers=layers,
    )
