"""The model families trtkv runs: one row per family, like llama.cpp's architecture table.

A ``Family`` row says everything trtkv needs to know about a decoder family that a model's config does not: how its
checkpoints are named (transformers architectures, config ``model_type``, GGUF ``general.architecture``), what
transformers' implementation of it does (eager attention only, soft-capping, which layers take the sliding window),
how its layers are built where the ONNX step network and the lean decoder rebuild them (norm weight offset, sandwich
norms, per-head q/k norms, fused projections, scaled embeddings), and which of trtkv's paths run it (the ONNX step
network, the lean decoder, the TensorRT-LLM export).

Everything that asks "what is this family" asks ``FAMILIES`` through ``family_of`` / ``require`` /
``family_of_gguf`` / ``family_of_model_type``: model loading (``trtkv.models``), the capability table
(``plugins/contract/capabilities.py``), the lean decoder (``trtkv.runtime.lean``), the builder's weight reader
(``builder/weights.py``), calibration's key hooks (``calibration/stats.py``), the TensorRT-LLM export and the
tests' tiny-model builder. Adding a family is one row here plus a tiny-model test (docs/architecture.md).
What a config holds (head counts, the window size, the soft-cap values, RoPE) is read from the config; the row
only says how this family reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trtkv.errors import TrtkvError

# Layer types the cache can hold: a global layer reads every token, a local one only its window.
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"

# Which layers attend over a sliding window (``Family.windows``):
NO_WINDOWS = "none"  # every layer global: the family's attention takes no window (a sliding_window in its config is ignored)
EVERY_LAYER = "every layer"  # a sliding_window in the config makes every layer local
LAYER_TYPES = "layer_types"  # the config's layer_types say which layers are local (its config class writes them)
WINDOW_RULES = (NO_WINDOWS, EVERY_LAYER, LAYER_TYPES)


@dataclass(frozen=True)
class Family:
    """One decoder family: its names, what transformers' implementation of it does, how its layers are built, and
    which of trtkv's paths run it."""

    name: str  # the table's key, e.g. "qwen3" (the tests' tiny-model builder takes it too)
    title: str  # e.g. "Qwen3"
    architectures: tuple[str, ...]  # transformers causal-LM classes (config.json ``architectures``); a config without
    #                                  ``architectures`` is read as the first
    model_type: str  # config.json ``model_type``: the transformers config class that reads layer types and windows
    gguf: str | None = None  # GGUF ``general.architecture`` transformers' GGUF loader reads as this family (None: none)
    eager_only: bool = False  # transformers runs its attention eagerly only (``sdpa`` asked: ``eager`` given)
    attn_softcap: bool = False  # attention scores become cap * tanh(score / cap) (config ``attn_logit_softcapping``)
    final_softcap: bool = False  # logits become cap * tanh(logit / cap) when the config sets ``final_logit_softcapping``
    windows: str = NO_WINDOWS  # which layers attend over the config's ``sliding_window`` (``WINDOW_RULES``)
    norm_offset: float = 0.0  # each RMSNorm multiplies by (norm_offset + weight): Gemma's 1 + w
    sandwich_norms: bool = False  # the attention and MLP outputs are normalized too (``post_attention_layernorm``,
    #                                ``post_feedforward_layernorm``) and ``pre_feedforward_layernorm`` feeds the MLP
    qk_norm: bool = False  # an RMSNorm over each head's q and k before RoPE (``q_norm``, ``k_norm``)
    fused_projections: bool = False  # one ``qkv_proj`` (rows q | k | v) and one ``gate_up_proj`` (rows gate | up)
    scaled_embedding: bool = False  # the embeddings are multiplied by sqrt(hidden) (the embedding's ``embed_scale``)
    step_network: bool = True  # the ONNX step network (build-engine's onnxruntime / TensorRT backends) computes its layers
    lean: bool = False  # the torch engine's lean decoder (trtkv/runtime/lean.py) runs its layers
    trtllm_export: bool = False  # ``trtkv export --to trtllm`` writes its checkpoint (TensorRT-LLM's LLaMA layout)

    def __post_init__(self):
        if self.windows not in WINDOW_RULES:
            raise ValueError(f"family {self.name}: windows must be one of {WINDOW_RULES}, not {self.windows!r}")
        if not self.architectures:
            raise ValueError(f"family {self.name} names no architecture")
        lean_lacks = [f for f in ("norm_offset", "sandwich_norms", "fused_projections", "scaled_embedding", "attn_softcap",
                                  "final_softcap") if getattr(self, f)]
        if self.lean and lean_lacks:  # the lean decoder runs plain Llama layers (and the per-head q/k norms)
            raise ValueError(f"family {self.name}: the lean decoder does not implement {', '.join(lean_lacks)}")

    def layer_types(self, config: Any, num_layers: int) -> tuple[str, ...]:
        """Each layer's attention type under this family's window rule, from a transformers config (or anything with
        its ``sliding_window`` / ``layer_types`` attributes)."""
        types = getattr(config, "layer_types", None) if self.windows == LAYER_TYPES else None
        if types is not None:
            return tuple(types)
        local = self.windows != NO_WINDOWS and getattr(config, "sliding_window", None) is not None
        return (SLIDING_ATTENTION if local else FULL_ATTENTION,) * num_layers

    def layer_windows(self, config: Any, num_layers: int) -> list[int | None]:
        """The window each layer attends over (None: global)."""
        window = getattr(config, "sliding_window", None)
        return [window if t == SLIDING_ATTENTION else None for t in self.layer_types(config, num_layers)]


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "Llama", ("LlamaForCausalLM",), "llama", gguf="llama", lean=True, trtllm_export=True),
    Family("mistral", "Mistral", ("MistralForCausalLM",), "mistral", gguf="mistral", windows=EVERY_LAYER, lean=True,
           trtllm_export=True),
    Family("qwen2", "Qwen2", ("Qwen2ForCausalLM",), "qwen2", gguf="qwen2", windows=LAYER_TYPES, lean=True),
    Family("qwen3", "Qwen3", ("Qwen3ForCausalLM",), "qwen3", gguf="qwen3", windows=LAYER_TYPES, qk_norm=True, lean=True),
    Family("phi3", "Phi-3", ("Phi3ForCausalLM",), "phi3", gguf="phi3", windows=EVERY_LAYER, fused_projections=True),
    Family("gemma2", "Gemma 2", ("Gemma2ForCausalLM",), "gemma2", gguf="gemma2", eager_only=True, attn_softcap=True,
           final_softcap=True, windows=LAYER_TYPES, norm_offset=1.0, sandwich_norms=True, scaled_embedding=True),
    Family("gemma3", "Gemma 3 (text)", ("Gemma3ForCausalLM",), "gemma3_text", gguf="gemma3", final_softcap=True,
           windows=LAYER_TYPES, norm_offset=1.0, sandwich_norms=True, qk_norm=True, scaled_embedding=True),
)}


def _find(pred: Callable[[Family], bool]) -> Family | None:
    return next((f for f in FAMILIES.values() if pred(f)), None)


def family_of(architecture: str | None) -> Family | None:
    """The row of a transformers architecture (``ModelInfo.architecture``), or None."""
    return _find(lambda f: architecture in f.architectures)


def family_of_gguf(key: str | None) -> Family | None:
    """The row whose GGUF ``general.architecture`` is ``key``, or None."""
    return _find(lambda f: f.gguf is not None and f.gguf == key)


def family_of_model_type(model_type: str | None) -> Family | None:
    """The row of a config.json ``model_type``, or None."""
    return _find(lambda f: f.model_type == model_type)


def architectures(where: Callable[[Family], bool] | None = None) -> list[str]:
    """The architectures of the rows ``where`` accepts (every row without it), sorted: what messages list."""
    return sorted(a for f in FAMILIES.values() if where is None or where(f) for a in f.architectures)


def require(architecture: str | None, where: str) -> Family:
    """The row of ``architecture``; a ``TrtkvError`` naming the supported architectures when there is none."""
    family = family_of(architecture)
    if family is None:
        raise TrtkvError(
            f"{where}: architecture {architecture or 'unknown'} is not supported",
            f"use a model of one of the supported architectures: {', '.join(architectures())}",
        )
    return family


def of_model(model: Any) -> Family:
    """The row of a loaded transformers causal LM (its class is its architecture)."""
    return require(type(model).__name__, f"model {type(model).__name__}")
