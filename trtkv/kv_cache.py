"""A transformers ``Cache`` that really stores K/V in a trtkv format and dequantizes on read.

Per layer, K and V are each kept as a ``trtkv.quant.QuantizedTensor`` (codes in their storage
dtype — int8 / uint8 / fp8 bit patterns / packed int4 nibbles — plus the fp16 dynamic scales and
zero-points), grown along the sequence axis. Reading the cache returns everything dequantized, so attention
always sees what a quantized-cache engine would see; each stored row is dequantized once, when first read, and
kept beside the codes (a prefill of N tokens dequantizes N rows, not one copy of the past per chunk). The math is ``trtkv.quant``; nothing here
re-derives it.

Two semantics, chosen by the format:

* **Sealed blocks** (``fmt.block_size = N``, the paged engine's contract, docs/kv-cache-format.md):
  new tokens go into an unquantized open block; when it holds N tokens and more arrive, it is sealed —
  quantized as a whole (``quantize_block``, so per-block channel scales work) — and a new open block
  starts. A query at position t therefore sees positions >= N*floor(t/N) unquantized and everything
  older quantized, exactly as the engine computes it. One ``update`` must not cross a block boundary
  (a chunk that did would need some of its own tokens quantized for others): callers chunk at block
  boundaries (``block_chunks``), and ``update`` refuses a chunk that crosses one. With ``sink=S`` the
  first block is quantized ``without_sink`` and its first S tokens are read back unquantized, as the
  engine reads them from a slot's sink rows.
* **Quantize on write** (``block_size`` None): each token is quantized when written and ``update``
  returns the dequantized cache including the step's own tokens, so within a prefill every query
  also attends to the quantized K/V of its own chunk — the decode-time view. Every such quantizer
  treats each token independently, so one prefill of N tokens gives the same logits as N decode steps.

Unquantized storage of ``fp16`` tensor formats keeps the model's own compute dtype, so the ``fp16``
format reproduces plain transformers ``DynamicCache`` exactly (on GPU the model runs in fp16 and this
*is* fp16 storage). The open block of a quantized format holds fp16-rounded values, as the engine's
fp16 tail does, so sealing quantizes exactly the values the engine seals.

Sliding-window layers (Gemma 2/3, Mistral / Qwen2 / Phi-3 with ``sliding_window``) keep their full K/V here
(``is_sliding`` stays False, so the mask builder gets every cached position at offset 0) and the model's own
sliding mask, built from ``config.sliding_window`` at every forward, drops the keys outside the window: the fp16
format gives exactly the model's own logits (tests/test_families.py). Which blocks a paged cache may free is
``trtkv.plan``'s count; no query reads them, so keeping them changes no logit.

Layout is transformers' ``[batch, kv_heads, seq, head_dim]`` (``head_axis=-3``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from trtkv.cache_layout import sealing
from trtkv.errors import TrtkvError
from trtkv.formats import KVFormat, TensorFormat, calibration_needed, get_format
from trtkv.quant import QuantizedTensor, TensorParams, dequantize, quantize_block

if TYPE_CHECKING:  # pragma: no cover
    from trtkv.artifacts import LayerParams
    from trtkv.rope import RopeTable

HEAD_AXIS = -3  # transformers: [batch, kv_heads, seq, head_dim]
SEQ_AXIS = -2  # codes [B, H, S, D or D/2], scales / zeros [B, H, S, groups]


def _params_to(p: TensorParams | None, device: torch.device) -> TensorParams | None:
    return None if p is None else p.map(lambda t: t.to(device))


AGE_OUT = ("sealed_twice", "requantize")  # what a token-age format's pool holds of a block that ages out (``TensorStore``)
_PER_BLOCK = ("outlier_index", "outlier_value")  # a sealed block's outlier list: one row per block, like block-wise scales


def _qt_map(q: QuantizedTensor, fn) -> QuantizedTensor:
    """``fn`` applied to every stored tensor of ``q`` that is set."""
    return QuantizedTensor(**{f: None if (t := getattr(q, f)) is None else fn(t) for f in ("codes", "scale", "zero", *_PER_BLOCK)})


def _cat(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return torch.cat([a, b], dim=SEQ_AXIS)


def _cat_all(ts: list) -> torch.Tensor | None:
    return None if ts[0] is None else torch.cat(ts, dim=SEQ_AXIS)


def _select(t: torch.Tensor | None, fn) -> torch.Tensor | None:
    return None if t is None else fn(t)


class TensorStore:
    """The stored form of one of K or V in one layer: the quantized past plus, for sealed formats, the open block."""

    def __init__(self, kv_fmt: KVFormat, which: str, params: TensorParams | None, rope: "RopeTable | None" = None,
                 age_out: str = "sealed_twice"):
        self.kv_fmt = kv_fmt  # the open block's byte count is the format's (``KVFormat.tail_bytes``)
        self.fmt: TensorFormat = getattr(kv_fmt, which)
        self.params = params
        self.rope = rope if self.fmt.pre_rope else None  # prerope keys: RoPE is undone before the seal, applied on read
        self.block_size = kv_fmt.block_size
        self.sink_tokens = kv_fmt.sink_tokens if self.fmt.is_quantized else 0  # fp16 storage keeps every row as it is
        self.sink: torch.Tensor | None = None  # [B, H, sink_tokens, D]: the first tokens, unquantized
        self.quantized: QuantizedTensor | None = None  # [B, H, S_q, ...] codes + scales (block-wise: scales [B, H, blocks, D])
        self.open: torch.Tensor | None = None  # [B, H, S_o, D] in the model dtype (unquantized open block)
        self.dtype: torch.dtype | None = None
        self.head_dim = 0
        self.sealed_count = 0  # sealed blocks
        # the pool's first ``decoded_units`` sealed blocks (tokens, for quantize-on-write) as ``read`` returns them (sink rows
        # in place): each read dequantizes only what was sealed since the last, so a prefill costs linear dequantization
        self.decoded: torch.Tensor | None = None
        self.decoded_units = 0
        # a token-age format's newest sealed blocks in its recent storage (one QuantizedTensor per block, oldest first),
        # encoded and decoded by a store of the recent format; ``age_out``: what the pool holds of a block that ages out
        # of them -- "sealed_twice" (what the engine does: every block sealed from its fp16 rows into the pool as well)
        # or "requantize" (the pool's block quantized from the recent codes when it ages out; an eval-only comparison)
        if age_out not in AGE_OUT:
            raise ValueError(f"age_out must be one of {AGE_OUT}, not {age_out!r}")
        self.age_out = age_out
        self.wide = TensorStore(kv_fmt.recent_format(), which, None) if kv_fmt.token_aged else None
        self.wide_blocks: list[QuantizedTensor] = []

    def __len__(self) -> int:
        n = self.sealed_count * self.block_size if self.block_size else 0 if self.quantized is None else self.quantized.codes.shape[SEQ_AXIS]
        return n + (0 if self.open is None else self.open.shape[SEQ_AXIS])

    def _to_device(self, device: torch.device) -> None:
        self.params = _params_to(self.params, device)

    def _positions(self, start: int, n: int, device) -> tuple | None:
        """``(cos, sin)`` [n, D] of positions ``start ..`` for prerope keys (windows start at position 0), else None."""
        return None if self.rope is None else self.rope.rows(start, n, device)

    def _quantize(self, x: torch.Tensor) -> QuantizedTensor:
        """Rows ``x`` (a whole block, or the tokens of a quantize-on-write step) as this store keeps them, appended after
        what it holds (prerope keys: RoPE undone at those positions)."""
        if not self.fmt.is_quantized:  # kept as-is in the model's dtype (see module docstring)
            return QuantizedTensor(codes=x)
        start = 0 if self.quantized is None else self.quantized.codes.shape[SEQ_AXIS]
        qt = quantize_block(x, self.fmt, self.params, head_axis=HEAD_AXIS, rope=self._positions(start, x.shape[SEQ_AXIS], x.device))
        per_block = self._per_block_fields()
        # one row per block: [B, H, D] -> [B, H, 1, D] (block-wise scales), [B, H, N] -> [B, H, 1, N] (outliers)
        return QuantizedTensor(**{f: None if (t := getattr(qt, f)) is None else t.unsqueeze(SEQ_AXIS) if f in per_block else t
                                  for f in ("codes", "scale", "zero", *_PER_BLOCK)})

    def _per_block_fields(self) -> tuple[str, ...]:
        return _PER_BLOCK + (("scale", "zero") if self.fmt.is_block_wise else ())

    def _write_quantized(self, x: torch.Tensor) -> None:
        if x.shape[SEQ_AXIS] == 0:
            return
        qt = self._quantize(x)
        if self.quantized is None:
            self.quantized = qt
        else:
            old = self.quantized
            self.quantized = QuantizedTensor(**{f: _cat(getattr(old, f), getattr(qt, f)) for f in ("codes", "scale", "zero", *_PER_BLOCK)})

    def append(self, x: torch.Tensor) -> None:
        if self.dtype is None:
            self.dtype, self.head_dim = x.dtype, x.shape[-1]
            self._to_device(x.device)
        if not self.block_size:
            self._write_quantized(x)
            return
        open_len = 0 if self.open is None else self.open.shape[SEQ_AXIS]
        if open_len == self.block_size:  # the open block is full: seal it before new tokens arrive
            block, sink = sealing(self.open, self.sealed_count, self.sink_tokens, SEQ_AXIS)  # a first block keeps its sink rows
            if sink is not None:
                self.sink = sink
            self._seal(block)
            self.open, open_len = None, 0
        if open_len + x.shape[SEQ_AXIS] > self.block_size:
            raise TrtkvError(
                f"a chunk of {x.shape[SEQ_AXIS]} tokens after {len(self)} cached ones crosses a sealed-block boundary (blocks of {self.block_size})",
                "feed the model chunks that end at block boundaries (trtkv.cache_layout.block_chunks)",
            )
        if self.fmt.is_quantized:  # the engine's open block is fp16: attention and sealing see fp16 values
            x = x.to(torch.float16).to(x.dtype)
        self.open = _cat(self.open, x)

    def _seal(self, block: torch.Tensor) -> None:
        """Store a full block (sink rows already taken out): into the quantized past, and a token-age format's newest
        blocks also in the recent storage (``age_out`` says when the pool's copy is made)."""
        self.sealed_count += 1
        if self.wide is None:
            self._write_quantized(block)
            return
        if self.wide.dtype is None:
            self.wide.dtype, self.wide.head_dim = block.dtype, block.shape[-1]
            self.wide._to_device(block.device)
        self.wide_blocks.append(self.wide._quantize(block))
        if self.age_out == "sealed_twice":
            self._write_quantized(block)
        if len(self.wide_blocks) > self.kv_fmt.recent_blocks:
            aged = self.wide_blocks.pop(0)
            if self.age_out == "requantize":  # the pool's copy from the recent codes, as a re-seal at age-out would make it
                self._write_quantized(self.wide._decode(aged))

    def read(self) -> torch.Tensor:
        """The full cache in the model's dtype and channel space (transforms undone): a token-age format's newest
        ``recent_blocks`` sealed blocks from the recent storage, older ones from the pool's."""
        assert self.dtype is not None
        parts = []
        if self.quantized is not None:  # the pool's blocks not in the recent storage (quantize-on-write: every token)
            units = self.sealed_count - len(self.wide_blocks) if self.block_size else self.quantized.codes.shape[SEQ_AXIS]
            if units:
                parts.append(self._pool_rows(units))
        if self.wide_blocks:
            wide = QuantizedTensor(**{f: _cat_all([getattr(q, f) for q in self.wide_blocks]) for f in ("codes", "scale", "zero", *_PER_BLOCK)})
            recent = self.wide._decode(wide)
            parts.append(recent if parts else self._with_sink(recent))
        if self.open is not None:
            parts.append(self.open)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=SEQ_AXIS)

    def _with_sink(self, x: torch.Tensor) -> torch.Tensor:
        """Rows from the cache's first one with the sink rows read back unquantized."""
        return x if self.sink is None else torch.cat([self.sink, x[:, :, self.sink_tokens :]], dim=SEQ_AXIS)

    def _pool_rows(self, units: int) -> torch.Tensor:
        """The pool's first ``units`` blocks (tokens) read back, dequantizing only those not read before."""
        if not self.fmt.is_quantized:  # stored as the model computes them: nothing to dequantize
            return self._with_sink(self._decode(self.quantized, 0, units))
        assert units >= self.decoded_units, "the pool's read-back only grows"
        if units > self.decoded_units:
            new = self._decode(self.quantized, self.decoded_units, units)
            self.decoded = self._with_sink(new) if self.decoded is None else torch.cat([self.decoded, new], dim=SEQ_AXIS)
            self.decoded_units = units
        return self.decoded

    def _decode(self, q: QuantizedTensor, first: int = 0, last: int | None = None) -> torch.Tensor:
        """Stored ``q``'s sealed blocks ``first .. last - 1`` (tokens, without sealed blocks; ``last`` None: to the end) in
        the model's dtype and space."""
        rows = self.block_size or 1
        total = q.codes.shape[SEQ_AXIS] // rows
        last = total if last is None else last
        if (first, last) != (0, total):
            per_block = self._per_block_fields() if self.block_size else ()
            q = QuantizedTensor(**{f: None if (t := getattr(q, f)) is None else
                                   t.narrow(SEQ_AXIS, first, last - first) if f in per_block else t.narrow(SEQ_AXIS, first * rows, (last - first) * rows)
                                   for f in ("codes", "scale", "zero", *_PER_BLOCK)})
        if not self.fmt.is_quantized:
            return q.codes
        return self._dequantized(q, first * rows)

    def _dequantized(self, q: QuantizedTensor, start: int = 0) -> torch.Tensor:
        """``q``, whose first row is the store's row ``start`` (prerope keys: RoPE applied at those positions), dequantized."""
        assert self.dtype is not None
        *lead, s, dp = q.codes.shape
        rope = self._positions(start, s, q.codes.device)
        if not (self.fmt.is_block_wise or self.fmt.outliers):
            return dequantize(q, self.fmt, self.params, head_axis=HEAD_AXIS, dtype=self.dtype, rope=rope)
        bs = self.block_size
        assert bs
        by_block = lambda t: t.reshape(*lead, s // bs, bs, t.shape[-1])  # per-token rows -> [B, H, blocks, bs, .]
        blocks = QuantizedTensor(  # block-wise scales and outlier lists are [B, H, blocks, .] already
            by_block(q.codes),
            *(t if t is None or self.fmt.is_block_wise else by_block(t) for t in (q.scale, q.zero)),
            q.outlier_index, q.outlier_value,
        )
        rope = None if rope is None else tuple(t.reshape(s // bs, bs, t.shape[-1]) for t in rope)
        x = dequantize(blocks, self.fmt, self.params, head_axis=HEAD_AXIS - 1, dtype=self.dtype, rope=rope)
        return x.reshape(*lead, s, x.shape[-1])

    def apply(self, fn) -> None:
        """Apply a batch-axis selection (``fn(tensor) -> tensor``) to every stored tensor."""
        if self.quantized is not None:
            self.quantized = _qt_map(self.quantized, fn)
        self.wide_blocks = [_qt_map(q, fn) for q in self.wide_blocks]
        self.open = _select(self.open, fn)
        self.sink = _select(self.sink, fn)
        self.decoded = _select(self.decoded, fn)

    def nbytes(self) -> int:
        """Bytes held: codes, scales, zero-points, outlier lists, and the open block and sink rows counted at their full fp16
        size (a reservation)."""
        total = 0
        if self.quantized is not None:
            q = self.quantized
            total += sum(t.numel() * t.element_size() for f in ("codes", "scale", "zero", *_PER_BLOCK) if (t := getattr(q, f)) is not None)
        for q in self.wide_blocks:
            total += sum(t.numel() * t.element_size() for f in ("codes", "scale", "zero", *_PER_BLOCK) if (t := getattr(q, f)) is not None)
        if self.block_size and len(self):  # the open block is a fixed fp16 reservation per sequence
            ref = self.open if self.open is not None else self.quantized.codes if self.quantized is not None else self.wide_blocks[0].codes
            total += ref.shape[0] * self.kv_fmt.tail_bytes(ref.shape[1], self.head_dim)
        return total


class QuantizedKVLayer(DynamicLayer):
    """One layer's quantized K and V (see the module docstring for the semantics)."""

    is_croppable = False

    def __init__(self, fmt: KVFormat, params: "LayerParams | None" = None, rope: "RopeTable | None" = None, age_out: str = "sealed_twice"):
        """``rope``: this layer's RoPE table (keys stored before RoPE); ``age_out``: see ``TensorStore``."""
        super().__init__()
        self.fmt = fmt
        self.age_out = age_out
        self.k_store = TensorStore(fmt, "k", None if params is None else params.k, rope, age_out)
        self.v_store = TensorStore(fmt, "v", None if params is None else params.v, age_out=age_out)
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
        self.k_store = TensorStore(fmt, "k", k.params, k.rope, self.age_out)
        self.v_store = TensorStore(fmt, "v", v.params, age_out=self.age_out)
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
        """Bytes actually held for this layer's K and V (codes, scales, zero-points, the open block's reservation)."""
        return self.k_store.nbytes() + self.v_store.nbytes()


class QuantizedKVCache(Cache):
    """A transformers cache storing every layer's K/V in ``fmt`` (a preset name, spec string or KVFormat; a per-layer
    format stores each layer in its own ``fmt.layer(i)``).

    ``params`` are the calibrated per-layer constants (``LayerParams`` with ``.k`` / ``.v`` ``TensorParams``),
    required by formats with static scales, smoothing or codebooks; ``rope`` (each layer's table,
    ``trtkv.rope.RopeTable.per_layer(model)``) by formats whose keys are stored before RoPE (each sequence's tokens at
    positions 0, 1, ...). Pass the cache as ``model(..., cache=cache)`` (``past_key_values=`` on older transformers).
    ``age_out``: what a token-age format's pool holds of a block that ages out of its recent blocks (``TensorStore``).
    """

    def __init__(self, fmt: str | KVFormat, num_layers: int, params: "Sequence[LayerParams] | None" = None,
                 rope: "Sequence[RopeTable] | None" = None, age_out: str = "sealed_twice"):
        self.fmt = get_format(fmt)
        self.fmt.check_layers(num_layers)
        if self.fmt.needs_rope and (rope is None or len(rope) != num_layers):
            raise TrtkvError(f"KV format {self.fmt.name!r} stores keys before RoPE and the cache was given "
                             f"{'no RoPE tables' if rope is None else f'{len(rope)} RoPE tables for {num_layers} layers'}",
                             "pass rope=trtkv.rope.RopeTable.per_layer(model) (one table per layer)")
        if params is not None and len(params) != num_layers:
            raise TrtkvError(
                f"calibration has {len(params)} layers but the model has {num_layers}",
                "calibrate this model with `trtkv calibrate` and pass its artifact",
            )
        if params is None and self.fmt.needs_calibration:
            raise calibration_needed([self.fmt])
        layers = [QuantizedKVLayer(self.fmt.layer(i), None if params is None else params[i], None if rope is None else rope[i], age_out)
                  for i in range(num_layers)]
        super().__init__(layers=layers)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
