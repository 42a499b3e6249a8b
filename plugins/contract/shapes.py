"""Tensor dtypes, placeholders and shapes of op instances (any int-like: int, ``Sym``, tensorrt.plugin ShapeExpr)."""

from __future__ import annotations

import functools
from typing import Any, Sequence

from trtkv.cache_layout import PagedKVLayout
from trtkv.errors import TrtkvError
from trtkv.formats import KVFormat, TensorFormat

from .attrs import Attrs
from .specs import FIX, OpSpec, OpTensor, get_op
from .symbolic import INT_OPS, SymOps, decode_partitions


def codes_dtype(fmt) -> str:
    """Storage dtype name of a tensor format's codes (``trtkv.formats.DTYPES``, by symmetry)."""
    return fmt.storage.name


def tensor_dtype(op: OpSpec, spec: OpTensor, attrs: Attrs) -> str:
    if not spec.dtype.startswith("codes"):
        return spec.dtype
    which = spec.dtype.partition(":")[2] or "x"
    return codes_dtype(attrs.tensor_format(which))


def input_dtypes(op: OpSpec | str, attrs: Attrs) -> list[str]:
    op = get_op(op) if isinstance(op, str) else op
    return [tensor_dtype(op, t, attrs) for t in op.inputs]


def output_dtypes(op: OpSpec | str, attrs: Attrs) -> list[str]:
    op = get_op(op) if isinstance(op, str) else op
    return [tensor_dtype(op, t, attrs) for t in op.outputs]


def placeholder_shape(spec: OpTensor, attrs: Attrs | None = None) -> tuple[int, ...]:
    """Shape of the stand-in for a tensor the format does not use: all ones, the declared rank."""
    return (1,) * spec.rank_of(attrs)


def check_inputs(op: OpSpec | str, attrs: Attrs, ranks: Sequence[int], dtypes: Sequence[str]) -> None:
    """Input count, ranks and dtypes against the contract (TensorRT's register step calls this)."""
    op = get_op(op) if isinstance(op, str) else op
    if len(ranks) != len(op.inputs):
        raise TrtkvError(f"{op.name} takes {len(op.inputs)} inputs ({', '.join(t.name for t in op.inputs)}), "
                         f"got {len(ranks)}", "pass placeholders ([1]*rank tensors) for unused ones")
    want = input_dtypes(op, attrs)
    for t, r, dt, w in zip(op.inputs, ranks, dtypes, want):
        if r != t.rank_of(attrs):
            raise TrtkvError(f"{op.name}: input {t.name} has rank {r}, expected {t.rank_of(attrs)} {t.shape}", FIX)
        if dt != w:
            raise TrtkvError(f"{op.name}: input {t.name} is {dt}, expected {w}", FIX)




@functools.lru_cache(maxsize=None)
def _layout(k: TensorFormat, v: TensorFormat, num_kv_heads: int, head_dim: int, block_size: int, sink_tokens: int) -> PagedKVLayout:
    return PagedKVLayout(KVFormat(name="op", k=k, v=v, block_size=block_size, sink_tokens=sink_tokens), num_kv_heads, head_dim, block_size, 1, 1)


def op_layout(attrs: Attrs) -> PagedKVLayout:
    """The cache layout an op instance reads or writes (its formats, heads, head_dim, block size and sink rows): pool,
    scale and tail shapes are asked of it (``num_blocks`` / ``num_slots`` passed per call, symbolic or not). PagedKVSeal's
    one format is the layout's K."""
    f = attrs.formats
    k, v = f.get("k", f.get("x")), f.get("v", TensorFormat(dtype="fp16"))
    return _layout(k, v, attrs["num_kv_heads"], attrs["head_dim"], attrs.get("block_size", 16), attrs.get("sink_tokens", 0))


def num_partitions(max_blocks, attrs: Attrs, ops: SymOps = INT_OPS):
    """Split-K partitions of a decode op instance (``decode_partitions``)."""
    return decode_partitions(max_blocks, attrs["block_size"], attrs["partition_size"], ops)


def output_shapes(op: OpSpec | str, attrs: Attrs, shapes: Sequence[Sequence[Any]], ops: SymOps = INT_OPS):
    """Output shapes from input shapes (same order as ``op.inputs``)."""
    op = get_op(op) if isinstance(op, str) else op
    s = {t.name: tuple(sh) for t, sh in zip(op.inputs, shapes)}
    name = op.name
    if name == "PagedKVSeal":
        lay, n = op_layout(attrs), s["rows"][0]
        out = [lay.data_shape("k", n)]
        for t in op.outputs[1:]:
            out.append(lay.scale_shape("k", n) if t.used(attrs) else placeholder_shape(t, attrs))
        return out
    if name == "PagedDecodePartition":
        B, M = s["block_tables"]
        S = num_partitions(M, attrs, ops)
        Hq, D = attrs["num_q_heads"], attrs["head_dim"]
        return [(B, Hq, S), (B, Hq, S), (B, Hq, S, D)]
    if name == "PagedDecodeReduce":
        B = s["part_m"][0]
        return [(B, attrs["num_q_heads"], attrs["head_dim"])]
    if name == "PagedPrefillAttention":
        return [(s["q"][0], attrs["num_q_heads"], attrs["head_dim"])]
    raise AssertionError(name)


def expected_input_shapes(op: OpSpec | str, attrs: Attrs, *, batch: int = 2, tokens: int = 5,
                          num_blocks: int = 7, max_blocks: int = 3, num_slots: int = 4, blocks: int = 3,
                          partitions: int | None = None):
    """Concrete input shapes for an op instance (placeholders for unused tensors): docs and tests.

    ``blocks``: blocks sealed by PagedKVSeal; ``tokens``: packed prefill tokens."""
    op = get_op(op) if isinstance(op, str) else op
    D = attrs["head_dim"]
    H = attrs["num_kv_heads"]
    Hq = attrs.get("num_q_heads", H)
    bs = attrs.get("block_size", 16)  # every op with pool / tail inputs has it
    rows = batch if op.name == "PagedDecodePartition" else tokens
    S = partitions if partitions is not None else (
        num_partitions(max_blocks, attrs) if "partition_size" in attrs and "block_size" in attrs else 2)
    lay = op_layout(attrs) if any(t.role in ("pool", "tail") for t in op.inputs) else None

    out = []
    for t in op.inputs:
        if not t.used(attrs):
            out.append(placeholder_shape(t, attrs))
            continue
        shape = {
            "rows": (blocks, H, bs, D), "clip": (H,), "hadamard": (D, D),
            "q": (rows, Hq, D), "k_new": (rows, H, D), "v_new": (rows, H, D),
            "k_tail": lay.tail_shape(num_slots) if lay else None,
            "v_tail": lay.tail_shape(num_slots) if lay else None,
            "cu_seqlens": (batch + 1,), "block_tables": (batch, max_blocks), "context_lens": (batch,),
            "slot_ids": (batch,),
            "part_m": (batch, Hq, S), "part_l": (batch, Hq, S), "part_acc": (batch, Hq, S, D),
        }.get(t.name)
        if shape is None and t.role == "constant":
            shape = (H, D)
        if shape is None and t.role == "pool":
            which = t.name[0]
            shape = lay.data_shape(which, num_blocks) if t.name.endswith("data") else lay.scale_shape(which, num_blocks)
        assert shape is not None, t.name
        out.append(shape)
    return out
