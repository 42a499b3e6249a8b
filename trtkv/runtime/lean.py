"""A lean forward of the Llama-family decoder for the torch engine: the same weights, a fraction of the tensor ops.

transformers' modules run each decoder layer as some forty small tensor ops and a dozen module calls; on a CPU, where
one decode step of a 135M model is ~35 ms of matrix products, the rest is as long again. ``LeanDecoder`` runs the
same layers -- RMSNorm, fused Q/K/V projection (+ bias), Qwen3's per-head Q/K norms, RoPE, trtkv's paged attention,
the output projection, the fused gate / up projection, SiLU, the down projection -- in about fifteen ops per layer:

* Q, K and V are one matrix product, gate and up another; their weights are stored once, transposed (``[in, out]``:
  the row-vector product reads them in order, faster for one or a few tokens), and the model's own ``nn.Linear``
  weights become views of them, so the model still runs its own forward (CUDA graphs, the kernels) with no copy;
* RoPE takes the model's rotary module's ``cos`` / ``sin`` once per step (every RoPE scaling type) and rotates Q and
  K together (``x * cos + roll(x, D/2) * sin`` with the sign of ``rotate_half`` folded into ``sin``);
* RMSNorm is ``torch.nn.functional.rms_norm``.

Families: the rows of the family table (``trtkv.families``) marked ``lean`` (Llama, Mistral, Qwen2, Qwen3); the row
also says whether each head's q and k are normalized (``qk_norm``) and which layers take the window (``windows``).
``LeanDecoder.reason(model)`` says why another model is not run lean, and the engine then runs transformers' modules.
The step contract and the attention are the engine's (``paged_attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trtkv.families import Family, architectures, family_of


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights of ``linears`` as one transposed tensor ``[in, sum(out)]`` (and their bias ``[sum(out)]``); each
    linear's ``weight`` becomes a view of it (``[out, in]``, transposed), so nothing is stored twice."""
    w = torch.cat([lin.weight.detach() for lin in linears], 0).t().contiguous()
    biases = [lin.bias for lin in linears]
    b = None if all(x is None for x in biases) else torch.cat([
        x.detach() if x is not None else torch.zeros(lin.out_features, dtype=w.dtype, device=w.device) for x, lin in zip(biases, linears)])
    o = 0
    for lin in linears:
        n = lin.out_features
        lin.weight.data = w[:, o : o + n].t()
        if b is not None and lin.bias is not None:
            lin.bias.data = b[o : o + n]
        o += n
    return w, b


class _Layer:
    def __init__(self, layer, family: Family, window: int | None):
        att, mlp = layer.self_attn, layer.mlp
        self.attn = att  # passed to the attention function (its layer_idx, like transformers does)
        self.qkv, self.qkv_bias = _fuse([att.q_proj, att.k_proj, att.v_proj])
        self.gate_up, _ = _fuse([mlp.gate_proj, mlp.up_proj])
        self.o, self.o_bias = att.o_proj.weight, att.o_proj.bias
        self.down, self.down_bias = mlp.down_proj.weight, mlp.down_proj.bias
        self.norm_in, self.eps_in = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.norm_post, self.eps_post = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        # the family's RMSNorm of each head's q and k (Qwen3)
        self.q_norm = (att.q_norm.weight, att.q_norm.variance_epsilon) if family.qk_norm else None
        self.k_norm = (att.k_norm.weight, att.k_norm.variance_epsilon) if family.qk_norm else None
        self.scaling = att.scaling
        self.window = window
        self.inter = mlp.gate_proj.out_features


class LeanDecoder:
    """The decoder stack of a supported model (see the module docstring): ``__call__(input_ids [B, T], positions
    [B, T], **attention_kwargs) -> hidden [B, T, hidden]`` after the final norm."""

    def __init__(self, model, attention):
        self.model = model
        dec = model.get_decoder()
        cfg = model.config
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.embed, self.rotary = dec.embed_tokens, dec.rotary_emb
        self.norm, self.eps = dec.norm.weight, dec.norm.variance_epsilon
        family = family_of(type(model).__name__)
        windows = family.layer_windows(cfg, cfg.num_hidden_layers)
        self.layers = [_Layer(layer, family, windows[i]) for i, layer in enumerate(dec.layers[: cfg.num_hidden_layers])]
        self.attention = attention  # transformers' attention-function signature (the torch engine's paged_attention)

    @staticmethod
    def reason(model) -> str | None:
        """Why ``model`` runs transformers' modules instead (None: it runs lean)."""
        arch = type(model).__name__
        family = family_of(arch)
        if family is None or not family.lean:
            return f"{arch} is not one of the lean families ({', '.join(architectures(lambda f: f.lean))})"
        cfg = model.config
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            return f"activation {cfg.hidden_act!r} (the lean MLP is SiLU-gated)"
        if getattr(cfg, "mlp_bias", False):
            return "an MLP with biases"
        return None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, **kwargs) -> torch.Tensor:
        B, T = input_ids.shape
        Hq, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        x = self.embed(input_ids)
        cos, sin = self.rotary(x, positions)  # [B, T, D], every RoPE type of the model
        half = D // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)  # rotate_half(x) * sin == roll(x, D/2) * this
        cos, sin = cos[:, :, None], sin[:, :, None]
        nq, nk = Hq * D, Hk * D
        for layer in self.layers:
            h = _rms(x, layer.norm_in, layer.eps_in)
            qkv = h @ layer.qkv
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            qk = qkv[..., : nq + nk].unflatten(-1, (Hq + Hk, D))
            if layer.q_norm is not None:
                q = _rms(qk[..., :Hq, :], *layer.q_norm)
                k = _rms(qk[..., Hq:, :], *layer.k_norm)
                qk = torch.cat([q, k], -2)
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)
            q, k = qk[..., :Hq, :], qk[..., Hq:, :]
            v = qkv[..., nq + nk :].unflatten(-1, (Hk, D))
            out, _ = self.attention(layer.attn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, scaling=layer.scaling,
                                    sliding_window=layer.window, **kwargs)
            x = x + F.linear(out.reshape(B, T, nq), layer.o, layer.o_bias)
            h = _rms(x, layer.norm_post, layer.eps_post)
            gu = h @ layer.gate_up
            x = x + F.linear(F.silu(gu[..., : layer.inter]) * gu[..., layer.inter :], layer.down, layer.down_bias)
        return _rms(x, self.norm, self.eps)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalized in float32, back to x's dtype, times the weight."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
