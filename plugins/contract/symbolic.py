"""Symbolic integers and the launch grids written on them.

Shape, grid and scalar-argument functions take an ``ops`` object (``cdiv``, ``max``, ``min``) and only use
``+ - * //`` with the symbolic operand on the left, so the same function runs on ints (``INT_OPS``), on
``Sym`` (used by the tests and the AOT grid formulas) and on ``tensorrt.plugin`` shape expressions
(``ShapeExpr`` has no reflected operators and no truth value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence


class Sym:
    """A symbolic integer that records its expression and carries a value for checking.

    Supports exactly what ``tensorrt.plugin.ShapeExpr`` supports: ``+ - * //`` with the symbolic
    operand on the left (no reflected operators) and no truth value, so code that runs on ``Sym``
    also runs on TensorRT shape expressions.
    """

    __slots__ = ("text", "value")

    def __init__(self, text: str, value: int):
        self.text = text
        self.value = int(value)

    def _bin(self, other: "Sym | int", sym: str, fn: Callable[[int, int], int]) -> "Sym":
        if isinstance(other, Sym):
            return Sym(f"({self.text} {sym} {other.text})", fn(self.value, other.value))
        if isinstance(other, bool) or not isinstance(other, int):
            raise TypeError(f"Sym {sym} {type(other).__name__} is not supported")
        return Sym(f"({self.text} {sym} {other})", fn(self.value, other))

    def __add__(self, other):
        return self._bin(other, "+", lambda a, b: a + b)

    def __sub__(self, other):
        return self._bin(other, "-", lambda a, b: a - b)

    def __mul__(self, other):
        return self._bin(other, "*", lambda a, b: a * b)

    def __floordiv__(self, other):
        return self._bin(other, "//", lambda a, b: a // b)

    def __bool__(self):
        raise TypeError(f"symbolic value {self.text} used as a condition (TensorRT shape expressions cannot)")

    def __index__(self):
        raise TypeError(f"symbolic value {self.text} used as a Python int")

    def __repr__(self) -> str:
        return f"Sym({self.text} = {self.value})"


@dataclass(frozen=True)
class SymOps:
    """cdiv / max / min over ints and symbolic values."""

    cdiv: Callable[[Any, Any], Any]
    max: Callable[[Any, Any], Any]
    min: Callable[[Any, Any], Any]


def _int_cdiv(a: int, b: int) -> int:
    return -(-a // b)


INT_OPS = SymOps(cdiv=_int_cdiv, max=max, min=min)


def _sym_fn(name: str, fn: Callable[[int, int], int]) -> Callable[[Any, Any], Any]:
    def f(a, b):
        if isinstance(a, Sym) or isinstance(b, Sym):
            ta = a.text if isinstance(a, Sym) else str(a)
            tb = b.text if isinstance(b, Sym) else str(b)
            va = a.value if isinstance(a, Sym) else a
            vb = b.value if isinstance(b, Sym) else b
            return Sym(f"{name}({ta}, {tb})", fn(va, vb))
        return fn(a, b)

    return f


SYM_OPS = SymOps(cdiv=_sym_fn("cdiv", _int_cdiv), max=_sym_fn("max", max), min=_sym_fn("min", min))


def sym_shape(name: str, shape: Sequence[int]) -> tuple[Sym, ...]:
    """Symbolic dims ``name[i]`` carrying the concrete ``shape`` values."""
    return tuple(Sym(f"{name}[{i}]", d) for i, d in enumerate(shape))


def value(x: Any) -> int:
    """The int of an int or a ``Sym``."""
    return x.value if isinstance(x, Sym) else int(x)


# Launch grids, each written once. Arguments may be ints, ``Sym`` or tensorrt.plugin shape expressions
# (symbolic operand on the left); ``ops`` supplies cdiv. The Triton launchers (ops.py), the TensorRT
# bindings (kernel_abi.BINDINGS) and the AOT grid formulas (aot.py, evaluated on ``Sym``) all call these.


def seal_grid(num_blocks, num_kv_heads, ops: SymOps = None) -> tuple:
    """Seal: one program per (block to seal, KV head)."""
    return (num_blocks, num_kv_heads, 1)


def decode_partitions(max_blocks, block_size, partition_size, ops: SymOps = None):
    """Split-K partitions covering any context the block table allows: ``max_blocks`` sealed blocks, an
    open block of fewer than ``block_size`` rows and the new row: ``< (max_blocks + 1) * block_size`` keys."""
    ops = ops or INT_OPS
    return ops.cdiv((max_blocks + 1) * block_size, partition_size)


def decode_reduce_grid(batch, num_kv_heads, ops: SymOps = None) -> tuple:
    """Split-K merge: one program per (sequence, KV head), all its query heads."""
    return (batch, num_kv_heads, 1)


def decode_grids(batch, num_kv_heads, max_blocks, block_size, partition_size, ops: SymOps = None) -> tuple:
    """(partition grid, reduce grid) of split-K decode."""
    parts = decode_partitions(max_blocks, block_size, partition_size, ops)
    return (batch, num_kv_heads, parts), decode_reduce_grid(batch, num_kv_heads, ops)


def prefill_grid(max_seqlen_q, num_kv_heads, batch, block_m: int, ops: SymOps = None) -> tuple:
    """One program per BLOCK_M query tokens of a sequence and KV head; ``max_seqlen_q`` may be any upper
    bound (e.g. the total query count): programs past a sequence's queries exit at once."""
    ops = ops or INT_OPS
    return (ops.cdiv(max_seqlen_q, block_m), num_kv_heads, batch)
