"""RoPE for keys stored before it (``prerope`` formats): the model's own rotary tables, and the rotation.

transformers rotates keys in the rotate-half layout (docs/kv-formats.md §8): ``k_post = k * cos + rotate_half(k) * sin``
with ``rotate_half(x) = cat(-x[D/2:], x[:D/2])`` and ``cos`` / ``sin`` of ``position * inv_freq`` (both halves alike,
times the rope type's attention scaling). A ``prerope`` format quantizes ``k_pre = R(p)^T k_post`` -- the key in the
frame where its channels do not turn with the position, so a sealed block's per-channel ranges are not widened by the
rotation -- and a reader applies ``R(p)`` to the dequantized key. ``RopeTable.per_layer(model)`` takes each layer's
table from the model's rotary module, so every rope type transformers implements (linear, dynamic, llama3, yarn, ...)
is the model's, and a model whose layers rotate differently (Gemma 3: local and global layers with their own bases) has
one table per kind of layer: every store and read of a layer's keys asks that layer's table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trtkv.errors import TrtkvError


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE of rows ``x`` [..., D] (rotate-half layout) by ``cos`` / ``sin`` broadcast to ``x``; ``inverse``: by the
    opposite angles (``R^T``; exact when the table's scaling is 1, else it divides by the scaling squared)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    if not inverse:
        return x * cos + rot * sin
    scale2 = (cos.square() + sin.square())  # attention_scaling ** 2 (1 for plain RoPE)
    return (x * cos - rot * sin) / scale2


@dataclass(eq=False)  # one object per kind of layer: tables are told apart by identity
class RopeTable:
    """One kind of layer's RoPE angles: ``cos_sin(positions)`` -> ``(cos, sin)`` [n, D] float32."""

    rotary: torch.nn.Module
    head_dim: int
    layer_type: str | None = None  # a rotary module keyed by layer type (Gemma 3): the type its forward is asked for
    _table: tuple | None = field(default=None, repr=False, compare=False)  # ``upto``'s cached (cos, sin)
    _on: dict = field(default_factory=dict, repr=False, compare=False)  # ``upto``'s copies on other devices

    @classmethod
    def per_layer(cls, model: torch.nn.Module) -> list["RopeTable"]:
        """Each decoder layer's table of a transformers causal LM (layers that rotate alike share one object): the one
        ``rotary_emb`` of Llama, Mistral, Qwen2/3, Phi-3, Gemma 2, or the entry of a rotary module keyed by layer type
        (Gemma 3's ``sliding_attention`` / ``full_attention`` bases). Refused for a partial rotary dimension or a model
        whose rotary module is not found."""
        base = model.get_decoder() if hasattr(model, "get_decoder") else model
        rotary = getattr(base, "rotary_emb", None)
        cfg = model.config.get_text_config(decoder=True)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        num_layers = cfg.num_hidden_layers
        if rotary is None or hasattr(base, "rotary_emb_local"):
            raise TrtkvError(f"{type(model).__name__} has no rotary embedding trtkv can read to store keys before RoPE with",
                             "use a format without prerope for this model (e.g. the int4 preset)")
        if isinstance(getattr(rotary, "rope_type", None), dict):  # one module, one entry per layer type
            types = list(cfg.layer_types)
            tables = {t: cls(rotary, head_dim, t) for t in dict.fromkeys(types)}
            out = [tables[t] for t in types]
        else:
            out = [cls(rotary, head_dim)] * num_layers
        for table in dict.fromkeys(out):
            cos, _ = table.cos_sin(torch.zeros(1, dtype=torch.long))
            if cos.shape[-1] != head_dim:
                raise TrtkvError(f"{type(model).__name__} rotates {cos.shape[-1]} of {head_dim} key channels (partial RoPE)",
                                 "use a format without prerope for this model (e.g. the int4 preset)")
        return out

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = positions.reshape(1, -1).long()
        x = torch.zeros(1, dtype=torch.float32, device=p.device)
        cos, sin = self.rotary(x, p) if self.layer_type is None else self.rotary(x, p, self.layer_type)
        return cos[0].float(), sin[0].float()

    def upto(self, n: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` [P, D] float32, contiguous, of positions ``0 .. P - 1`` with ``P >= n`` (the kernels' table):
        computed once and grown by doubling, so a step asks for it at no cost; ``device``: a copy kept there."""
        if self._table is None or self._table[0].shape[0] < n:
            size = 1 << max(int(n) - 1, 255).bit_length()  # at least 256 rows
            buf = next(iter(self.rotary.buffers()), None)  # computed where the model's rotary module lives
            self._table = tuple(t.cpu().contiguous() for t in self.rows(0, size, None if buf is None else buf.device))
            self._on.clear()
        if device is None or torch.device(device) == self._table[0].device:
            return self._table
        key = str(torch.device(device))
        if key not in self._on:
            self._on[key] = tuple(t.to(device) for t in self._table)
        return self._on[key]

    def rows(self, start: int, n: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` [n, D] of positions ``start .. start + n - 1``."""
        return self.cos_sin(torch.arange(start, start + n, device=device))


@dataclass(frozen=True)
class RopeRows:
    """A RoPE table held as rows ``(cos, sin)`` [P, D] of positions ``0 .. P - 1`` (``RopeTable.upto``): what the
    Triton kernels read, with ``cos_sin`` as ``RopeTable`` has it for the reference readers of the same call."""

    cos: torch.Tensor
    sin: torch.Tensor

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = positions.reshape(-1).long().to(self.cos.device)
        if p.numel() and int(p.max()) >= self.cos.shape[0]:
            raise TrtkvError(f"the RoPE table covers positions below {self.cos.shape[0]}, position {int(p.max())} was asked",
                             "pass a table of every position read (RopeTable.upto)")
        return self.cos[p].float(), self.sin[p].float()
