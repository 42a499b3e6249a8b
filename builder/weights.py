"""The weights of a model of the family table (``trtkv.families``) as numpy arrays, read as its row says: q/k
RMSNorm per head (``qk_norm``: Qwen3, Gemma 3), fused qkv and gate_up projections split here (``fused_projections``:
Phi-3), (1 + w) RMSNorms folded into the weights here (``norm_offset``: Gemma), norms around attention and MLP
(``sandwich_norms``), scaled embeddings (``scaled_embedding``), attention / final logit soft-capping
(``attn_softcap`` / ``final_softcap``: Gemma 2); q/k/v biases where the model has them, GeGLU, the attention
module's query scale (query_pre_attn_scalar), a RoPE base per layer type (Gemma 3), tied or untied embeddings.

Read from a loaded transformers model (``trtkv.models.load_model``), so GGUF files and HF directories
both arrive here in the transformers rotate-half RoPE layout (docs/kv-formats.md section 8).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from trtkv.errors import TrtkvError
from trtkv.families import require
from trtkv.models import ModelInfo

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inv_freq (and attention_scaling) fixed at load
GATE_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # SwiGLU, GeGLU (tanh approximation)


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
    q_norm: np.ndarray | None = None  # [D] Qwen3 / Gemma 3: RMSNorm over each head's q before RoPE
    k_norm: np.ndarray | None = None  # [D] ... and k
    attn_out_norm: np.ndarray | None = None  # Gemma: RMSNorm of the attention output before the residual add
    mlp_out_norm: np.ndarray | None = None  # Gemma: RMSNorm of the MLP output before the residual add


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
    rope_by_type: dict[str, tuple[np.ndarray, float]] = field(default_factory=dict)  # layer type -> (inv_freq, scaling) where it has its own (Gemma 3)
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden) (rounded to the weights' dtype, as transformers)
    query_scale: float | None = None  # multiplies q before q.K; None: 1/sqrt(head_dim)
    activation: str = "silu"  # gate activation of the gated MLP: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    attn_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits = cap * tanh(logits / cap)

    def rope_for(self, layer: int) -> tuple[np.ndarray, float]:
        """(inv_freq, attention scaling) of ``layer``'s RoPE."""
        return self.rope_by_type.get(self.info.layer_type(layer), (self.inv_freq, self.attention_scaling))

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
    family = require(arch, f"model '{info.name}'")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    per_type = [rope[t] for t in info.layer_groups() if isinstance(rope, dict) and isinstance(rope.get(t), dict)]  # Gemma 3
    for r in per_type or [rope]:
        rope_type = r.get("rope_type", r.get("type", "default")) if isinstance(r, dict) else "default"
        if rope_type not in STATIC_ROPE_TYPES:
            raise TrtkvError(f"RoPE scaling {rope_type!r} changes with the sequence length and is not supported by the step network", f"use a model with RoPE type one of {STATIC_ROPE_TYPES}")
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act not in GATE_ACTIVATIONS:
        raise TrtkvError(f"{arch}: MLP activation {act!r} is not in the step network", f"use a model whose hidden_act is one of {GATE_ACTIVATIONS}")
    base = model.model
    rot = base.rotary_emb
    rope_by_type = {}
    for t in getattr(rot, "layer_types", ()):  # Gemma 3: one inv_freq (RoPE base) per layer type
        rope_by_type[t] = (_np(getattr(rot, f"{t}_inv_freq")), float(getattr(rot, f"{t}_attention_scaling", 1.0)))
    inv_freq = _np(rot.inv_freq) if hasattr(rot, "inv_freq") else rope_by_type[info.layer_type(0)][0]
    attention_scaling = float(getattr(rot, "attention_scaling", 1.0)) if hasattr(rot, "inv_freq") else rope_by_type[info.layer_type(0)][1]
    for f in [inv_freq] + [f for f, _ in rope_by_type.values()]:
        if 2 * f.size != info.head_dim:
            raise TrtkvError(
                f"{arch}: RoPE rotates {2 * f.size} of {info.head_dim} channels (partial rotary), which the step network does not implement",
                "use a model whose RoPE rotates the whole head (partial_rotary_factor 1)",
            )

    def norm(module) -> np.ndarray:  # output * (norm_offset + w): the offset folded into the weight
        return _np(module.weight) + np.float32(family.norm_offset)

    H, D, nh = info.num_kv_heads, info.head_dim, info.num_heads
    layers = []
    for layer in base.layers:
        a, m = layer.self_attn, layer.mlp
        if family.fused_projections:  # qkv_proj rows [q (nh*D) | k (H*D) | v (H*D)], gate_up_proj rows [gate | up]
            wq, wk, wv = torch.split(a.qkv_proj.weight, [nh * D, H * D, H * D], dim=0)
            bq = bk = bv = None
            if a.qkv_proj.bias is not None:
                bq, bk, bv = (_np(b) for b in torch.split(a.qkv_proj.bias, [nh * D, H * D, H * D]))
            w_gate, w_up = m.gate_up_proj.weight.chunk(2, dim=0)
            mlp_bias = m.gate_up_proj.bias
        else:
            wq, wk, wv = a.q_proj.weight, a.k_proj.weight, a.v_proj.weight
            bq, bk, bv = _np(a.q_proj.bias), _np(a.k_proj.bias), _np(a.v_proj.bias)
            w_gate, w_up, mlp_bias = m.gate_proj.weight, m.up_proj.weight, m.gate_proj.bias
        sandwich = family.sandwich_norms  # post_attention_layernorm normalizes the attention output
        layers.append(
            LayerWeights(
                input_norm=norm(layer.input_layernorm),
                wq=_t(wq), wk=_t(wk), wv=_t(wv), wo=_t(a.o_proj.weight),
                bq=bq, bk=bk, bv=bv,
                post_norm=norm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm),
                w_gate=_t(w_gate), w_up=_t(w_up), w_down=_t(m.down_proj.weight),
                q_norm=norm(a.q_norm) if family.qk_norm else None, k_norm=norm(a.k_norm) if family.qk_norm else None,
                attn_out_norm=norm(layer.post_attention_layernorm) if sandwich else None,
                mlp_out_norm=norm(layer.post_feedforward_layernorm) if sandwich else None,
            )
        )
        if getattr(a.o_proj, "bias", None) is not None or mlp_bias is not None:
            raise TrtkvError(f"{arch}: biases on o_proj / MLP are not supported", "use a model without o_proj / MLP biases")
    embed = base.embed_tokens.weight
    head = model.lm_head.weight
    tied = head.data_ptr() == embed.data_ptr() or info.tie_word_embeddings
    return ModelWeights(
        info=info,
        inv_freq=inv_freq,
        attention_scaling=attention_scaling,
        embed=_np(embed),
        lm_head=None if tied else _np(head),
        final_norm=norm(base.norm),
        layers=layers,
        rope_by_type=rope_by_type,
        embed_scale=float(base.embed_tokens.embed_scale.to(embed.dtype)) if family.scaled_embedding else 1.0,
        query_scale=float(base.layers[0].self_attn.scaling),
        activation=act,
        attn_softcap=getattr(cfg, "attn_logit_softcapping", None) if family.attn_softcap else None,
        final_softcap=getattr(cfg, "final_logit_softcapping", None) if family.final_softcap else None,
    )
