"""What the issue-27 screens share: the calibrated model loaded on CPU for eval-cache measurements in their own process,
and the hook through which a screen swaps the eval cache's seal for its own round trip."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class Screened:
    """A calibration artifact with its model: ``info`` (trtkv.models.model_info), the tokenizer and the HF model."""

    art: Any
    info: Any
    tokenizer: Any
    model: Any

    @property
    def name(self) -> str:
        return self.art.recipe.model.name


def load_screened(calibration: str) -> Screened:
    """The artifact at ``calibration`` and the model it was calibrated for (CPU, gradients off)."""
    import torch

    from trtkv.artifacts import load_calibration
    from trtkv.models import load_model, load_tokenizer, model_info

    art = load_calibration(calibration)
    name = art.recipe.model.name
    loaded = load_model(name, device="cpu")
    torch.set_grad_enabled(False)
    return Screened(art, model_info(name), load_tokenizer(name), loaded.model if hasattr(loaded, "model") else loaded)


def swap_seal(seal: Callable[[Any, Any, int, int], Any]) -> None:
    """Patch the eval cache (this process only) so that a screen may replace a sealed block's round trip.

    ``seal(store, x, start, layer)`` gets the rows ``x`` [B, H, n, D] being sealed by ``store`` (a TensorStore; its
    ``fmt`` is the K or V side), the index of their first row and the layer; it returns the rows as the cache should
    read them back, or None to leave them to the store's own quantizer."""
    from trtkv.kv_cache import QuantizedKVCache, TensorStore
    from trtkv.quant import QuantizedTensor

    orig_update, orig_write, orig_deq = QuantizedKVCache.update, TensorStore._write_quantized, TensorStore._dequantized
    layer = {"index": None}

    def update(self, key_states, value_states, layer_idx, *a, **k):
        layer["index"] = layer_idx
        return orig_update(self, key_states, value_states, layer_idx, *a, **k)

    def write(self, x):
        start = 0 if self.quantized is None else self.quantized.codes.shape[2]
        hat = None if x.shape[2] == 0 else seal(self, x, start, layer["index"])
        if hat is None:
            return orig_write(self, x)
        self._swapped = True  # the store then holds the read-back rows themselves as its "codes"
        self.quantized = QuantizedTensor(codes=hat if self.quantized is None else torch.cat([self.quantized.codes, hat], dim=2))

    def dequantized(self):
        return self.quantized.codes.to(self.dtype) if getattr(self, "_swapped", False) else orig_deq(self)

    QuantizedKVCache.update, TensorStore._write_quantized, TensorStore._dequantized = update, write, dequantized


def add_screen_args(p) -> None:
    """The arguments every seal-swapping screen takes: the artifact, the format it starts from, held-out windows, fit windows."""
    p.add_argument("--calibration", required=True)
    p.add_argument("--kv", default="int2-nuq", help="the format whose values, sinks and blocks the rows keep (its keys must be prerope)")
    p.add_argument("--dataset", default="builtin:pydoc")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--fit-dataset", default="builtin:pydoc")
    p.add_argument("--fit-windows", type=int, default=11, help="SmolLM2's pydoc calib split holds 11 windows of 2048")
    p.add_argument("--fit-seq-len", type=int, default=2048)


def measure_rows(model, ids, fmt, params, names: list[str], batch_size: int, use: Callable[[str | None], None]) -> tuple[float, dict]:
    """Every row on the same held-out windows ``ids``: ``use(name)`` sets the screen up for a row (None: no row, while
    the fp16 reference runs). The fp16 perplexity and, per row, the eval accumulator's (nll, KL, top-1) tensors."""
    from trtkv.evaluate import _Acc, model_logits, perplexity

    accs = {n: _Acc.empty() for n in names}
    base = _Acc.empty()
    for start in range(0, ids.shape[0], batch_size):
        batch = ids[start : start + batch_size]
        use(None)
        ref = model_logits(model, batch, "fp16")[:, :-1]
        base.add(ref, ref, batch[:, 1:])
        for n in names:
            use(n)
            accs[n].add(ref, model_logits(model, batch, fmt, params)[:, :-1], batch[:, 1:])
        print(f"windows {start + len(batch)}/{ids.shape[0]}", file=sys.stderr, flush=True)
    use(None)
    return perplexity(base.tensors()[0]), {n: a.tensors() for n, a in accs.items()}


def run_with_hooks(model, ids, hooks: dict[str, Callable[[int, torch.Tensor], None]]) -> None:
    """Run the windows ``ids`` [W, S] through ``model`` one at a time with ``hooks[name](layer, output)`` called on each
    layer's ``self_attn.<name>`` projection (``"k_proj"``, ``"q_proj"``, ``"v_proj"``); the hooks are removed after."""
    handles = [getattr(layer.self_attn, name).register_forward_hook(lambda _m, _a, out, i=i, fn=fn: fn(i, out.detach()))
               for i, layer in enumerate(model.model.layers) for name, fn in hooks.items()]
    try:
        for w in range(ids.shape[0]):
            model(ids[w : w + 1])
    finally:
        for h in handles:
            h.remove()
