"""A transformers ``Cache`` that really stores K/V in a trtkv format and dequantizes on read.

Per layer, K and V are each kept as a ``trtkv.quant.QuantizedTensor`` (codes in their storage
dtype — int8 / uint8 / fp8 bit patterns / packed int4 nibbles — plus the fp16 dynamic scales and
zero-points), grown by concatenation along the sequence axis. Formats with ``recent_tokens`` keep the
newest N tokens unquantized; a token is quantized when it leaves that window. Reading the cache
dequantizes everything, so attention always sees what a quantized-cache engine would see. The math
is ``trtkv.quant.quantize`` / ``dequantize``; nothing here re-derives it.

Semantics (write, then read). ``update`` first writes the step's new K/V into the cache and then
returns the dequantized cache *including* those new tokens. So within a prefill, every query also
attends to the quantized K/V of its own chunk, itself included — the same thing a decode step does
in a paged engine that appends the token to the pool before running attention over it. Because every
supported quantizer treats each token independently (dynamic per-token scales, or static calibrated
scales), a token's stored value does not depend on how the sequence was chunked: one prefill of N
tokens gives the same logits as N single-token decode steps (up to floating-point reassociation).
That makes teacher-forced perplexity over one prefill measure exactly what decoding sees. An engine
whose prefill attends to the fresh, unquantized K/V of the prompt is *less* affected than this; our
numbers are the decode-time (pessimistic) view.

With ``recent_tokens=R`` the window is kept per chunk: after a write, the newest R tokens of the
sequence are unquantized and everything older is quantized. For single-token decode that is exactly
"every query sees its R newest tokens (itself included) in full precision"; within a prefill chunk
of c <= R tokens, a query sees between R - c + 1 and R unquantized neighbours.

Unquantized storage (``fp16`` tensor formats and the recent window) keeps the model's own compute
dtype, so the ``fp16`` format reproduces plain transformers ``DynamicCache`` exactly (on GPU the
model runs in fp16 and this *is* fp16 storage).

Layout is transformers' ``[batch, kv_heads, seq, head_dim]`` (``head_axis=-3``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from trtkv.errors import TrtkvError
from trtkv.formats import KVFormat, TensorFormat, get_format
from trtkv.quant import QuantizedTensor, TensorParams, dequantize, quantize

if TYPE_CHECKING:  # pragma: no cover
    from trtkv.artifacts import LayerParams

HEAD_AXIS = -3  # transformers: [batch, kv_heads, seq, head_dim]
SEQ_AXIS = -2  # codes [B, H, S, D or D/2], scales / zeros [B, H, S, groups]


def _params_to(p: TensorParams | None, device: torch.device) -> TensorParams | None:
    if p is None:
        return None
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return TensorParams(scale=move(p.scale), smooth=move(p.smooth), clip=move(p.clip))


def _cat(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return torch.cat([a, b], dim=SEQ_AXIS)


def _select(t: torch.Tensor | None, fn) -> torch.Tensor | None:
    return None if t is None else fn(t)


class TensorStore:
    """The stored form of one of K or V in one layer: quantized past plus an optional recent window."""

    def __init__(self, fmt: TensorFormat, params: TensorParams | None, recent_tokens: int = 0):
        self.fmt = fmt
        self.params = params
        self.recent_tokens = recent_tokens if fmt.is_quantized else 0
        self.quantized: QuantizedTensor | None = None  # [B, H, S_q, ...] codes + scales
        self.recent: torch.Tensor | None = None  # [B, H, S_r, D] in the model dtype (unquantized)
        self.dtype: torch.dtype | None = None

    def __len__(self) -> int:
        n = 0 if self.quantized is None else self.quantized.codes.shape[SEQ_AXIS]
        return n + (0 if self.recent is None else self.recent.shape[SEQ_AXIS])

    def _to_device(self, device: torch.device) -> None:
        self.params = _params_to(self.params, device)

    def _write_quantized(self, x: torch.Tensor) -> None:
        if x.shape[SEQ_AXIS] == 0:
            return
        if not self.fmt.is_quantized:  # kept as-is in the model's dtype (see module docstring)
            qt = QuantizedTensor(codes=x)
        else:
            qt = quantize(x, self.fmt, self.params, head_axis=HEAD_AXIS)
        if self.quantized is None:
            self.quantized = qt
        else:
            old = self.quantized
            self.quantized = QuantizedTensor(
                codes=torch.cat([old.codes, qt.codes], dim=SEQ_AXIS),
                scale=_cat(old.scale, qt.scale),
                zero=_cat(old.zero, qt.zero),
            )

    def append(self, x: torch.Tensor) -> None:
        if self.dtype is None:
            self.dtype = x.dtype
            self._to_device(x.device)
        if not self.recent_tokens:
            self._write_quantized(x)
            return
        window = _cat(self.recent, x)
        assert window is not None
        overflow = window.shape[SEQ_AXIS] - self.recent_tokens
        if overflow > 0:
            self._write_quantized(window[..., :overflow, :])
            window = window[..., overflow:, :]
        self.recent = window.contiguous()

    def read(self) -> torch.Tensor:
        """The full cache in the model's dtype and channel space (transforms undone)."""
        assert self.dtype is not None
        parts = []
        if self.quantized is not None:
            if self.fmt.is_quantized:
                parts.append(dequantize(self.quantized, self.fmt, self.params, head_axis=HEAD_AXIS, dtype=self.dtype))
            else:
                parts.append(self.quantized.codes)
        if self.recent is not None:
            parts.append(self.recent)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=SEQ_AXIS)

    def apply(self, fn) -> None:
        """Apply a batch-axis selection (``fn(tensor) -> tensor``) to every stored tensor."""
        if self.quantized is not None:
            q = self.quantized
            self.quantized = QuantizedTensor(codes=fn(q.codes), scale=_select(q.scale, fn), zero=_select(q.zero, fn))
        self.recent = _select(self.recent, fn)

    def nbytes(self) -> int:
        total = 0
        if self.quantized is not None:
            q = self.quantized
            total += sum(t.numel() * t.element_size() for t in (q.codes, q.scale, q.zero) if t is not None)
        if self.recent is not None:
            total += self.recent.numel() * 2  # accounted as fp16, the storage the format promises
        return total


class QuantizedKVLayer(DynamicLayer):
    """One layer's quantized K and V (see the module docstring for the semantics)."""

    is_croppable = False

    def __init__(self, fmt: KVFormat, params: "LayerParams | None" = None):
        super().__init__()
        self.fmt = fmt
        self.k_store = TensorStore(fmt.k, None if params is None else params.k, fmt.recent_tokens)
        self.v_store = TensorStore(fmt.v, None if params is None else params.v, fmt.recent_tokens)
        self.cumulative_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        # No full-precision copy lives here; keys/values are empty placeholders for code that inspects them.
        self.keys = torch.tensor([], dtype=key_states.dtype, device=self.device)
        self.values = torch.tensor([], dtype=value_states.dtype, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.k_store.append(key_states)
        self.v_store.append(value_states)
        self.cumulative_length += key_states.shape[SEQ_AXIS]
        return self.k_store.read(), self.v_store.read()

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def reset(self) -> None:
        fmt = self.fmt
        k, v = self.k_store, self.v_store
        self.k_store = TensorStore(fmt.k, k.params, fmt.recent_tokens)
        self.v_store = TensorStore(fmt.v, v.params, fmt.recent_tokens)
        self.cumulative_length = 0
        self.keys = self.values = None
        self.is_initialized = False

    def offload(self) -> None:  # nothing to offload lazily; the stores live where they were written
        pass

    def prefetch(self) -> None:
        pass

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the quantized KV cache cannot be cropped")

    def _apply(self, fn) -> None:
        self.k_store.apply(fn)
        self.v_store.apply(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.cumulative_length:
            self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.cumulative_length:
            self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.cumulative_length:
            self._apply(lambda t: t[indices, ...])

    def nbytes(self) -> int:
        """Bytes actually held for this layer's K and V (codes, scales, zero-points, recent window)."""
        return self.k_store.nbytes() + self.v_store.nbytes()


class QuantizedKVCache(Cache):
    """A transformers cache storing every layer's K/V in ``fmt`` (a preset name, spec string or KVFormat).

    ``params`` are the calibrated per-layer constants (``LayerParams`` with ``.k`` / ``.v`` ``TensorParams``),
    required by formats with static scales or smoothing. Pass the cache as ``model(..., cache=cache)``
    (``past_key_values=`` on older transformers).
    """

    def __init__(self, fmt: str | KVFormat, num_layers: int, params: "Sequence[LayerParams] | None" = None):
        self.fmt = get_format(fmt)
        if params is not None and len(params) != num_layers:
            raise TrtkvError(
                f"calibration has {len(params)} layers but the model has {num_layers}",
                "calibrate this model with `trtkv calibrate` and pass its artifact",
            )
        if params is None and self.fmt.needs_calibration:
            raise TrtkvError(
                f"KV format {self.fmt.name!r} needs calibrated scales or smoothing factors",
                "run `trtkv calibrate` and pass --calibration",
            )
        layers = [QuantizedKVLayer(self.fmt, None if params is None else params[i]) for i in range(num_layers)]
        super().__init__(layers=layers)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
