"""The ONNX op contract of the trtkv TensorRT plugins, and the pure parts of their registration.

Nothing here imports tensorrt or triton: op specs, attribute validation, ONNX node emission, output
shape / dtype inference, launch grids and kernel-argument bindings are plain functions, tested on CPU.
``trtkv.plugins.trt_plugins`` is the thin TensorRT glue that feeds them ``tensorrt.plugin`` objects.

How an ONNX node becomes a plugin (TensorRT's ONNX parser, ``FallbackPluginImporter``): a node whose
``op_type`` is not a built-in ONNX op is looked up in the plugin registry by ``op_type`` (the plugin
name), the string attribute ``plugin_namespace`` and ``plugin_version`` (default "1"). The node's
domain is not consulted by the parser; we still put the nodes in domain ``trtkv`` so the model is
valid ONNX (with an ``opset_import`` for ``trtkv``). The parser passes the node attributes whose names
the plugin creator declares (for a ``tensorrt.plugin`` op: the attribute parameters of the
``@trtp.register`` function, in that order) as plugin fields: INT -> int32, FLOAT -> float32,
STRING -> char. A declared attribute missing from the node is skipped with a warning, after which the
QDP call fails, so ``make_node`` always writes every attribute. ``aot=1`` asks the parser for the
ahead-of-time implementation (no Python at serve time).

Engines are pure functions (docs/plugins.md, docs/kv-cache-format.md "The engine step contract"). No op
writes the paged pool or the open blocks:

* ``PagedKVSeal`` quantizes full open blocks ``[blocks, kv_heads, block_size, head_dim]`` (fp16) and
  *returns* their codes / scales / zero-points in pool-block form; the runtime stores them at the pool
  blocks it allocated (``cache_layout.seal_blocks`` writes the same bytes).
* The attention ops read, for new token ``t`` of sequence ``b`` (position ``context_lens[b] + t``): the
  ``context_lens[b] // block_size`` sealed blocks through the block table (dequantized), the open block's
  ``context_lens[b] % block_size`` rows from ``k_tail / v_tail[slot_ids[b]]`` (fp16) and this step's new
  rows ``0 .. t`` (fp16, causal). The result equals float64 attention over ``gather_paged(..., slot=)``
  followed by the new rows (``reference.paged_attention_ref``). A step never crosses a block boundary.

Decode attention is split-K (flash-decoding): an AOT plugin launches exactly one kernel, so the op is
two nodes, ``PagedDecodePartition`` (partial softmax states per context partition) and
``PagedDecodeReduce`` (log-sum-exp merge, normalization, V's output transforms); ``make_decode_nodes``
emits both.

Symbolic shapes. Shape, grid and scalar-argument functions take an ``ops`` object (``cdiv``, ``max``,
``min``) and only use ``+ - * //`` with the symbolic operand on the left, so the same function runs on
ints (``INT_OPS``), on ``Sym`` (the tiny expression type below, used by the tests) and on
``tensorrt.plugin`` shape expressions (``ShapeExpr`` has no reflected operators and no truth value).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from trtkv.errors import TrtkvError
from trtkv.formats import ELEM_TYPES, MAX_SINK_TOKENS

DOMAIN = "trtkv"  # ONNX domain of the nodes and the TensorRT plugin namespace
PLUGIN_VERSION = "1"  # tensorrt.plugin registers every op as version "1"
# attributes the TensorRT ONNX parser reads itself; no plugin attribute may use these names,
# nor the names tensorrt.plugin reserves for its own arguments
PARSER_ATTRS = ("plugin_namespace", "plugin_version", "aot", "tensorrt_plugin_shape_input_indices")
RESERVED_ATTR_NAMES = PARSER_ATTRS + ("outputs", "stream", "tactic")
# op_type names the parser would import as built-in ONNX ops instead of looking up a plugin
_ONNX_BUILTIN_CLASH = {"Attention", "RotaryEmbedding", "DequantizeLinear", "QuantizeLinear", "Scatter", "Gather"}

FIX = "see docs/plugins.md (ONNX op contract)"


# ------------------------------------------------------------------------------------------------
# symbolic integers
# ------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------
# limits and launch grids (the one record / definition contract, ops, aot and kernels read)
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelLimits:
    """What the Triton kernels accept. Every check of a head dim, block size or partition size reads this.

    * head_dim: tiled whole (``tl.arange``) and split in even / odd halves that feed ``tl.dot`` as the
      reduction dimension, which must be >= 16: a power of two, 32 .. 256.
    * block_size: the seal kernel holds one whole block per (block, head) program, its rows are the M
      dimension of the Hadamard ``tl.dot`` (>= 16); a power of two, 16 .. 128 (larger blocks spill).
    * partition_size: split-K decode partitions, a power of two >= 16 (a multiple of the kernel's key tile).
    """

    head_dim_min: int = 32
    head_dim_max: int = 256
    block_size_min: int = 16
    block_size_max: int = 128
    partition_min: int = 16
    default_partition: int = 512

    def head_dim_problem(self, d: int) -> str | None:
        if _is_pow2(d) and self.head_dim_min <= d <= self.head_dim_max:
            return None
        return f"must be a power of two between {self.head_dim_min} and {self.head_dim_max} (the kernels' tile width)"

    def block_size_problem(self, bs: int) -> str | None:
        if _is_pow2(bs) and self.block_size_min <= bs <= self.block_size_max:
            return None
        return f"must be a power of two between {self.block_size_min} and {self.block_size_max}"

    def partition_problem(self, p: int) -> str | None:
        return None if _is_pow2(p) and p >= self.partition_min else f"must be a power of two >= {self.partition_min}"


LIMITS = KernelLimits()


def _is_pow2(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


# Launch grids, each written once. Arguments may be ints, ``Sym`` or tensorrt.plugin shape expressions
# (symbolic operand on the left); ``ops`` supplies cdiv. The Triton launchers (ops.py), the TensorRT
# bindings (BINDINGS below) and the AOT grid formulas (aot.py, evaluated on ``Sym``) all call these.


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


# ------------------------------------------------------------------------------------------------
# op specs
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    """One input or output of an op. ``dtype`` is a dtype name or ``"codes:k"`` / ``"codes:v"`` /
    ``"codes"`` (the storage dtype of the K / V / op's tensor format). ``rank`` is an int or, for the
    scale tensors whose rank depends on the format (per-token ``[.., block_size, groups]`` vs block-wise
    ``[.., head_dim]``), a function of the attributes."""

    name: str
    rank: int | Callable[["Attrs"], int]
    dtype: str
    role: str  # activation | pool | tail | new-rows | block-table | lengths | slots | offsets | constant | partial | output
    shape: str  # documentation, e.g. "[tokens, kv_heads, head_dim]"
    doc: str
    needed: Callable[["Attrs"], bool] | None = None  # None: always used; else placeholder when False

    def used(self, attrs: "Attrs") -> bool:
        return True if self.needed is None else bool(self.needed(attrs))

    def rank_of(self, attrs: "Attrs | None" = None) -> int:
        if callable(self.rank):
            if attrs is None:
                raise ValueError(f"the rank of {self.name} depends on the format: pass the attributes")
            return int(self.rank(attrs))
        return self.rank


@dataclass(frozen=True)
class AttrSpec:
    name: str
    type: type  # int | float | str (the types both ONNX and tensorrt.plugin carry)
    doc: str
    default: Any = None  # None: required


@dataclass(frozen=True)
class OpSpec:
    name: str
    doc: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    attrs: tuple[AttrSpec, ...]

    @property
    def plugin_id(self) -> str:
        return f"{DOMAIN}::{self.name}"

    def input(self, name: str) -> TensorSpec:
        return _by_name(self.inputs, name, self.name)

    def output(self, name: str) -> TensorSpec:
        return _by_name(self.outputs, name, self.name)

    def input_index(self, name: str) -> int:
        return [t.name for t in self.inputs].index(name)


def _by_name(specs, name, op):
    for s in specs:
        if s.name == name:
            return s
    raise KeyError(f"{op} has no tensor {name!r}")


# ---- which optional tensors a format uses ----


def _fmt(attrs: "Attrs", which: str):
    from trtkv.formats import parse_tensor_spec

    return parse_tensor_spec(attrs[f"{which}_format"] if which in ("k", "v") else attrs["tensor_format"])


def _dyn(which):
    return lambda a: _fmt(a, which).is_dynamic


def _asym(which):
    return lambda a: _fmt(a, which).is_dynamic and not _fmt(a, which).symmetric


def _static(which):
    return lambda a: _fmt(a, which).is_static


def _smooth(which):
    return lambda a: _fmt(a, which).smooth


def _clip(which):
    return lambda a: _fmt(a, which).is_dynamic


def _had(*which):
    return lambda a: any(_fmt(a, w).hadamard for w in which)


def _scale_rank(lead: int, which: str):
    """Rank of a scale / zero tensor with ``lead`` leading axes before [kv_heads, ...]: per-token formats
    add [block_size, groups], block-wise ones [head_dim]."""
    return lambda a: lead + (2 if _fmt(a, which).is_block_wise else 3)


_SCALE_SHAPE = "per-token formats [{n}, kv_heads, block_size, groups]; bchannel [{n}, kv_heads, head_dim]"


def _pool(which: str) -> tuple[TensorSpec, ...]:
    W = which.upper()
    return (
        TensorSpec(f"{which}_data", 4, f"codes:{which}", "pool", "[num_blocks, kv_heads, block_size, packed_dim]",
                   f"{W} pool codes: sealed blocks (read-only)"),
        TensorSpec(f"{which}_scale", _scale_rank(1, which), "float16", "pool", _SCALE_SHAPE.format(n="num_blocks"),
                   f"{W} pool dynamic scales", _dyn(which)),
        TensorSpec(f"{which}_zero", _scale_rank(1, which), "float16", "pool", _SCALE_SHAPE.format(n="num_blocks"),
                   f"{W} pool zero-points (asymmetric)", _asym(which)),
    )


def _tails() -> tuple[TensorSpec, ...]:
    return tuple(
        TensorSpec(f"{w}_tail", 4, "float16", "tail", "[num_slots, kv_heads, block_size + sink_tokens, head_dim]",
                   f"{w.upper()} open blocks (fp16, model channel space); slot s holds its sequence's newest "
                   "context_len % block_size rows at offsets 0 .., other open-block rows may hold anything; rows "
                   "block_size .. hold the sequence's first sink_tokens tokens, read instead of the pool's once "
                   "context_len >= block_size")
        for w in ("k", "v"))


def _new(rows: str) -> tuple[TensorSpec, ...]:
    return tuple(
        TensorSpec(f"{w}_new", 3, "float16", "new-rows", f"[{rows}, kv_heads, head_dim]",
                   f"this step's {w.upper()} rows (fp16, model channel space: K after RoPE), the values the open "
                   "block will hold")
        for w in ("k", "v"))


def _const(name: str, which: str, what: str, needed) -> TensorSpec:
    return TensorSpec(name, 2, "float32", "constant", "[kv_heads, head_dim]",
                      f"{which.upper()} {what}, expanded to [kv_heads, head_dim]", needed)


_HAD_DOC = "normalized Hadamard matrix (trtkv.quant.hadamard_matrix)"

_A_KV_FORMATS = (
    AttrSpec("k_format", str, "K tensor format spec (TensorFormat.short(), e.g. 'int4:bchannel:asym')"),
    AttrSpec("v_format", str, "V tensor format spec"),
)
_A_HEADS = (
    AttrSpec("num_q_heads", int, "query heads (a multiple of num_kv_heads)"),
    AttrSpec("num_kv_heads", int, "KV heads"),
    AttrSpec("head_dim", int, "head dimension (contract.LIMITS: a power of two, 32..256)"),
)
_A_BLOCK = AttrSpec("block_size", int, "tokens per pool block and open block (contract.LIMITS: a power of two, 16..128)")
_A_SINK = AttrSpec("sink_tokens", int, "a sequence's first tokens kept fp16 in the tail's last rows (KVFormat.sink_tokens; "
                   "0: none)", 0)
_A_SCALE = AttrSpec("sm_scale", float, "softmax scale (usually 1/sqrt(head_dim))")
_A_PREC = AttrSpec("precision", str, "tl.dot input precision: ieee | tf32x3 | tf32", "tf32x3")
_A_PART = AttrSpec("partition_size", int, "context tokens per split-K partition (a power of two, >= 16)",
                   LIMITS.default_partition)

_CTX = ("tokens cached (sealed + open) BEFORE this step; the pool holds the first context_len // block_size "
        "blocks, the open block the rest")
_BT = "sealed pool blocks of each sequence; entries past context_len // block_size are never read"
_SLOTS = "each sequence's open-block slot (index into k_tail / v_tail)"

SEAL = OpSpec(
    name="PagedKVSeal",
    doc="Quantize full open blocks into the pool form of sealed blocks (trtkv.quant.quantize_block); returns "
        "codes / scales / zero-points, which the runtime stores at the blocks it allocated (pure: no pool input).",
    inputs=(
        TensorSpec("rows", 4, "float16", "activation", "[blocks, kv_heads, block_size, head_dim]",
                   "the open blocks to seal, model channel space (the kernel applies smoothing / Hadamard)"),
        _const("static_scale", "", "static scale", _static("x")),
        _const("smooth", "", "smoothing divisors", _smooth("x")),
        TensorSpec("clip", 1, "float32", "constant", "[kv_heads]",
                   "dynamic range multiplier in (0, 1] (ones when not calibrated)", _clip("x")),
        TensorSpec("hadamard", 2, "float32", "constant", "[head_dim, head_dim]", _HAD_DOC, _had("x")),
    ),
    outputs=(
        TensorSpec("codes", 4, "codes", "output", "[blocks, kv_heads, block_size, packed_dim]", "quantized codes"),
        TensorSpec("scale", _scale_rank(1, "x"), "float16", "output", _SCALE_SHAPE.format(n="blocks"),
                   "dynamic scales", _dyn("x")),
        TensorSpec("zero", _scale_rank(1, "x"), "float16", "output", _SCALE_SHAPE.format(n="blocks"),
                   "zero-points", _asym("x")),
    ),
    attrs=(
        AttrSpec("tensor_format", str, "the tensor format spec (TensorFormat.short())"),
        AttrSpec("num_kv_heads", int, "KV heads"),
        AttrSpec("head_dim", int, "head dimension (contract.LIMITS)"),
        _A_BLOCK,
    ),
)

def _v_transform_consts() -> tuple[TensorSpec, ...]:
    return (_const("v_static", "v", "static scale", _static("v")), _const("v_smooth", "v", "smoothing divisors", _smooth("v")))


def _cache_inputs(rows: str) -> tuple[TensorSpec, ...]:
    """The inputs both attention ops read after their queries: pools, open blocks, this step's rows
    (``rows`` long), the K/V transform constants and the per-sequence block tables, lengths and slots."""
    return (
        *_pool("k"), *_pool("v"), *_tails(), *_new(rows),
        _const("k_static", "k", "static scale", _static("k")),
        _const("k_smooth", "k", "smoothing divisors", _smooth("k")),
        *_v_transform_consts(),
        TensorSpec("hadamard", 2, "float32", "constant", "[head_dim, head_dim]", _HAD_DOC, _had("k", "v")),
        TensorSpec("block_tables", 2, "int32", "block-table", "[batch, max_blocks]", _BT),
        TensorSpec("context_lens", 1, "int32", "lengths", "[batch]", _CTX),
        TensorSpec("slot_ids", 1, "int32", "slots", "[batch]", _SLOTS),
    )


DECODE_PARTITION = OpSpec(
    name="PagedDecodePartition",
    doc="Split-K decode attention, stage 1: partial softmax states of one new token per sequence (position "
        "context_len) over partitions of its keys: sealed blocks (pool), open block (tail) and its own new row.",
    inputs=(
        TensorSpec("q", 3, "float16", "activation", "[batch, q_heads, head_dim]", "queries (model channel space)"),
        *_cache_inputs("batch"),
    ),
    outputs=(
        TensorSpec("part_m", 3, "float32", "partial", "[batch, q_heads, partitions]", "running max (log2 domain)"),
        TensorSpec("part_l", 3, "float32", "partial", "[batch, q_heads, partitions]", "softmax denominators"),
        TensorSpec("part_acc", 4, "float32", "partial", "[batch, q_heads, partitions, head_dim]",
                   "unnormalized outputs (V's stored channel space)"),
    ),
    attrs=(*_A_KV_FORMATS, *_A_HEADS, _A_BLOCK, _A_SINK, _A_SCALE, _A_PART, _A_PREC),
)

DECODE_REDUCE = OpSpec(
    name="PagedDecodeReduce",
    doc="Split-K decode attention, stage 2: merge the partitions (log-sum-exp), normalize, undo V's "
        "static scale / Hadamard / smoothing.",
    inputs=(
        TensorSpec("part_m", 3, "float32", "partial", "[batch, q_heads, partitions]", "PagedDecodePartition output"),
        TensorSpec("part_l", 3, "float32", "partial", "[batch, q_heads, partitions]", "PagedDecodePartition output"),
        TensorSpec("part_acc", 4, "float32", "partial", "[batch, q_heads, partitions, head_dim]",
                   "PagedDecodePartition output"),
        TensorSpec("context_lens", 1, "int32", "lengths", "[batch]", "as given to PagedDecodePartition"),
        *_v_transform_consts(),
        TensorSpec("hadamard", 2, "float32", "constant", "[head_dim, head_dim]", _HAD_DOC, _had("v")),
    ),
    outputs=(TensorSpec("out", 3, "float16", "output", "[batch, q_heads, head_dim]", "attention output"),),
    attrs=(AttrSpec("v_format", str, "V tensor format spec"), *_A_HEADS, _A_PART),
)

PREFILL = OpSpec(
    name="PagedPrefillAttention",
    doc="Causal (chunked) prefill attention of packed new tokens over sealed blocks (pool), the open block "
        "(tail) and this step's new rows; a step never crosses a block boundary.",
    inputs=(
        TensorSpec("q", 3, "float16", "activation", "[tokens, q_heads, head_dim]", "packed queries of all sequences"),
        TensorSpec("cu_seqlens", 1, "int32", "offsets", "[batch + 1]",
                   "sequence b's queries and new rows are rows cu_seqlens[b] .. cu_seqlens[b+1]-1, at positions "
                   "context_len .. (padded [B, T] form: cu_seqlens = arange(B + 1) * T; padding rows come last in "
                   "each sequence and no valid query sees them)"),
        *_cache_inputs("tokens"),
    ),
    outputs=(TensorSpec("out", 3, "float16", "output", "[tokens, q_heads, head_dim]", "attention output"),),
    attrs=(*_A_KV_FORMATS, *_A_HEADS, _A_BLOCK, _A_SINK, _A_SCALE, _A_PREC),
)

OPS: dict[str, OpSpec] = {op.name: op for op in (SEAL, DECODE_PARTITION, DECODE_REDUCE, PREFILL)}


def get_op(name: str) -> OpSpec:
    name = name.split("::")[-1]
    if name not in OPS:
        raise TrtkvError(f"unknown trtkv op {name!r}", f"one of {', '.join(OPS)}")
    return OPS[name]


# ------------------------------------------------------------------------------------------------
# attributes
# ------------------------------------------------------------------------------------------------


class Attrs(dict):
    """Validated attributes of one op instance (a dict in the op's declared attribute order)."""

    op: OpSpec

    def tensor_format(self, which: str):
        """The TensorFormat of K ('k'), V ('v') or, for PagedKVAppend, its own format ('x')."""
        return _fmt(self, which)


def validate_attrs(op: OpSpec | str, raw: dict[str, Any]) -> Attrs:
    """Check and normalize an op's attributes; missing optional ones take their defaults.

    Raises TrtkvError naming the attribute, the bad value and the rule it breaks.
    """
    op = get_op(op) if isinstance(op, str) else op
    known = {a.name for a in op.attrs}
    extra = [k for k in raw if k not in known and k not in PARSER_ATTRS]
    if extra:
        raise TrtkvError(f"{op.name}: unknown attribute(s) {', '.join(sorted(extra))}",
                         f"{op.name} takes {', '.join(a.name for a in op.attrs)}")
    out = Attrs()
    out.op = op
    for a in op.attrs:
        if a.name in raw:
            v = raw[a.name]
        elif a.default is not None:
            v = a.default
        else:
            raise TrtkvError(f"{op.name}: missing attribute {a.name!r} ({a.doc})", FIX)
        if isinstance(v, bytes):
            v = v.decode()
        if hasattr(v, "item") and not isinstance(v, (str, bytes)):  # numpy scalars / 1-element arrays
            v = v.item() if getattr(v, "size", 1) == 1 else v
        try:
            if a.type is int:
                if isinstance(v, float) and not v.is_integer() or isinstance(v, (str, bool)):
                    raise ValueError
                v = int(v)
            elif a.type is float:
                if isinstance(v, (str, bool)):
                    raise ValueError
                v = float(v)
            elif not isinstance(v, str):
                raise ValueError
        except (TypeError, ValueError):
            raise TrtkvError(f"{op.name}: attribute {a.name}={v!r} is not a {a.type.__name__}", FIX) from None
        out[a.name] = v
    _check_values(op, out)
    return out


def _bad(op: OpSpec, name: str, value, rule: str) -> TrtkvError:
    return TrtkvError(f"{op.name}: attribute {name}={value!r} {rule}", FIX)


def _check_values(op: OpSpec, a: Attrs) -> None:
    from trtkv.formats import parse_tensor_spec

    fmts = {}
    for key in ("tensor_format", "k_format", "v_format"):
        if key in a:
            try:
                fmts[key] = parse_tensor_spec(a[key])
            except Exception as exc:  # pydantic ValidationError / ValueError
                msg = exc.errors()[0]["msg"] if hasattr(exc, "errors") else str(exc)
                raise _bad(op, key, a[key], f"is not a tensor format spec ({msg})") from None
    d = a.get("head_dim")
    if d is not None and LIMITS.head_dim_problem(d):
        raise _bad(op, "head_dim", d, LIMITS.head_dim_problem(d))
    for key, f in fmts.items():
        try:
            f.groups(d)
        except TrtkvError as exc:
            raise _bad(op, key, a[key], f"does not fit head_dim {d}: {exc.problem}") from None
        if f.dtype == "int4" and d % 2:
            raise _bad(op, key, a[key], f"packs two codes per byte and needs an even head_dim, got {d}")
    kvh = a.get("num_kv_heads")
    if kvh is not None and kvh < 1:
        raise _bad(op, "num_kv_heads", kvh, "must be >= 1")
    qh = a.get("num_q_heads")
    if qh is not None and (qh < 1 or qh % kvh):
        raise _bad(op, "num_q_heads", qh, f"must be a positive multiple of num_kv_heads={kvh}")
    bs = a.get("block_size")
    if bs is not None and LIMITS.block_size_problem(bs):
        raise _bad(op, "block_size", bs, LIMITS.block_size_problem(bs))
    sink = a.get("sink_tokens")
    if sink is not None and not (0 <= sink <= MAX_SINK_TOKENS and (bs is None or sink < bs)):
        raise _bad(op, "sink_tokens", sink, f"must be in [0, {MAX_SINK_TOKENS}] and below block_size")
    ps = a.get("partition_size")
    if ps is not None and LIMITS.partition_problem(ps):
        raise _bad(op, "partition_size", ps, LIMITS.partition_problem(ps))
    s = a.get("sm_scale")
    if s is not None and not (math.isfinite(s) and s > 0):
        raise _bad(op, "sm_scale", s, "must be a finite positive number")
    p = a.get("precision")
    if p is not None and p not in ("ieee", "tf32x3", "tf32"):
        raise _bad(op, "precision", p, "must be one of ieee, tf32x3, tf32")


def attrs_for(op: OpSpec | str, fmt, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int | None = None, sm_scale: float | None = None,
              partition_size: int = LIMITS.default_partition, precision: str = "tf32x3", which: str = "k") -> Attrs:
    """Attributes of ``op`` for a KVFormat (or spec string) and model geometry: the builder's shortcut.

    ``block_size`` defaults to the format's own (``block=N``); a format without one takes the cache's."""
    from trtkv.formats import get_format

    op = get_op(op) if isinstance(op, str) else op
    f = get_format(fmt)
    bs = block_size if block_size is not None else f.block_size
    if bs is None:
        raise TrtkvError(f"format {f.name!r} has no block size of its own", "pass block_size (the cache's block size)")
    if f.block_size is not None and f.block_size != bs:
        raise TrtkvError(f"format {f.name!r} seals blocks of {f.block_size} tokens, not {bs}",
                         f"use block_size={f.block_size}")
    every = dict(
        tensor_format=(f.k if which == "k" else f.v).short(), k_format=f.k.short(), v_format=f.v.short(),
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=bs, sink_tokens=f.sink_tokens,
        sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim),
        partition_size=partition_size, precision=precision,
    )
    return validate_attrs(op, {a.name: every[a.name] for a in op.attrs})


# ------------------------------------------------------------------------------------------------
# dtypes and placeholders
# ------------------------------------------------------------------------------------------------


def codes_dtype(fmt) -> str:
    """Storage dtype name of a tensor format's codes (``trtkv.formats.DTYPES``, by symmetry)."""
    return fmt.storage.name


def tensor_dtype(op: OpSpec, spec: TensorSpec, attrs: Attrs) -> str:
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


def placeholder_shape(spec: TensorSpec, attrs: Attrs | None = None) -> tuple[int, ...]:
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


# ------------------------------------------------------------------------------------------------
# shapes (any int-like: int, Sym, tensorrt.plugin ShapeExpr)
# ------------------------------------------------------------------------------------------------


def num_partitions(max_blocks, attrs: Attrs, ops: SymOps = INT_OPS):
    """Split-K partitions of a decode op instance (``decode_partitions``)."""
    return decode_partitions(max_blocks, attrs["block_size"], attrs["partition_size"], ops)


def _scale_dims(f, lead, H: int, bs: int, D: int):
    """Shape of a scale / zero tensor with leading dims ``lead`` (placeholder when unused is the caller's)."""
    return (*lead, H, D) if f.is_block_wise else (*lead, H, bs, f.groups(D))


def output_shapes(op: OpSpec | str, attrs: Attrs, shapes: Sequence[Sequence[Any]], ops: SymOps = INT_OPS):
    """Output shapes from input shapes (same order as ``op.inputs``)."""
    op = get_op(op) if isinstance(op, str) else op
    s = {t.name: tuple(sh) for t, sh in zip(op.inputs, shapes)}
    name = op.name
    if name == "PagedKVSeal":
        f = attrs.tensor_format("x")
        n, H, bs, D = s["rows"][0], attrs["num_kv_heads"], attrs["block_size"], attrs["head_dim"]
        packed = D // f.traits.codes_per_byte
        out = [(n, H, bs, packed)]
        for t in op.outputs[1:]:
            out.append(_scale_dims(f, (n,), H, bs, D) if t.used(attrs) else placeholder_shape(t, attrs))
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

    out = []
    for t in op.inputs:
        if not t.used(attrs):
            out.append(placeholder_shape(t, attrs))
            continue
        shape = {
            "rows": (blocks, H, bs, D), "clip": (H,), "hadamard": (D, D),
            "q": (rows, Hq, D), "k_new": (rows, H, D), "v_new": (rows, H, D),
            "k_tail": (num_slots, H, bs + attrs.get("sink_tokens", 0), D),
            "v_tail": (num_slots, H, bs + attrs.get("sink_tokens", 0), D),
            "cu_seqlens": (batch + 1,), "block_tables": (batch, max_blocks), "context_lens": (batch,),
            "slot_ids": (batch,),
            "part_m": (batch, Hq, S), "part_l": (batch, Hq, S), "part_acc": (batch, Hq, S, D),
        }.get(t.name)
        if shape is None and t.role == "constant":
            shape = (H, D)
        if shape is None and t.role == "pool":
            f = attrs.tensor_format(t.name[0])
            if t.name.endswith("data"):
                shape = (num_blocks, H, bs, D // f.traits.codes_per_byte)
            else:
                shape = _scale_dims(f, (num_blocks,), H, bs, D)
        assert shape is not None, t.name
        out.append(shape)
    return out


# ------------------------------------------------------------------------------------------------
# ONNX nodes
# ------------------------------------------------------------------------------------------------

ONNX_ELEM = {name: e.onnx for name, e in ELEM_TYPES.items()}  # onnx.TensorProto enums (trtkv.formats.ELEM_TYPES)


def onnx_attributes(op: OpSpec | str, attrs: dict[str, Any]) -> dict[str, Any]:
    """Every declared attribute (validated) plus the parser's routing attributes."""
    op = get_op(op) if isinstance(op, str) else op
    a = validate_attrs(op, attrs)
    return {**a, "plugin_namespace": DOMAIN, "plugin_version": PLUGIN_VERSION, "aot": 1}


def make_node(op: OpSpec | str, inputs: Sequence[str], outputs: Sequence[str], attrs: dict[str, Any],
              name: str | None = None):
    """An ``onnx.NodeProto`` for one trtkv op in domain ``trtkv`` (TensorRT maps it to the plugin).

    ``inputs`` / ``outputs`` are tensor names in the order of ``op.inputs`` / ``op.outputs``; an
    unused input still needs a (placeholder) tensor — TensorRT plugins have a fixed input count.
    """
    import onnx.helper

    op = get_op(op) if isinstance(op, str) else op
    if op.name in _ONNX_BUILTIN_CLASH:
        raise AssertionError(op.name)
    if len(inputs) != len(op.inputs) or any(not n for n in inputs):
        raise TrtkvError(f"{op.name} takes {len(op.inputs)} named inputs ({', '.join(t.name for t in op.inputs)}), "
                         f"got {list(inputs)}", "give placeholder tensors for unused inputs")
    if len(outputs) != len(op.outputs) or any(not n for n in outputs):
        raise TrtkvError(f"{op.name} has {len(op.outputs)} outputs ({', '.join(t.name for t in op.outputs)}), "
                         f"got {list(outputs)}")
    return onnx.helper.make_node(op.name, list(inputs), list(outputs), name=name or None, domain=DOMAIN,
                                 **onnx_attributes(op, attrs))


def make_decode_nodes(inputs: Sequence[str], out: str, attrs: dict[str, Any], *, prefix: str):
    """The two nodes of one decode attention: PagedDecodePartition -> PagedDecodeReduce.

    ``inputs`` are the PagedDecodePartition inputs; ``attrs`` the PagedDecodePartition attributes
    (the reduce node takes its subset and V's constants from ``inputs``). Returns (nodes, names of the
    three partial tensors).
    """
    parts = [f"{prefix}/part_m", f"{prefix}/part_l", f"{prefix}/part_acc"]
    a = validate_attrs(DECODE_PARTITION, attrs)
    n1 = make_node(DECODE_PARTITION, inputs, parts, a, name=f"{prefix}/partition")
    pick = {n: inputs[DECODE_PARTITION.input_index(n)] for n in ("context_lens", "v_static", "v_smooth", "hadamard")}
    red = {k: a[k] for k in (x.name for x in DECODE_REDUCE.attrs)}
    n2 = make_node(DECODE_REDUCE, [*parts, pick["context_lens"], pick["v_static"], pick["v_smooth"], pick["hadamard"]],
                   [out], red, name=f"{prefix}/reduce")
    return [n1, n2], parts


def opset_imports(onnx_opset: int = 17):
    import onnx.helper

    return [onnx.helper.make_opsetid("", onnx_opset), onnx.helper.make_opsetid(DOMAIN, 1)]


def value_infos(op: OpSpec | str, attrs: dict[str, Any], outputs: Sequence[str], input_shapes,
                symbolic: dict[str, str] | None = None):
    """ONNX value_info for a node's outputs (ONNX shape inference cannot see into custom ops).

    ``input_shapes`` may hold ints or ``Sym``; a ``Sym`` output dim becomes a dim_param (its text,
    or ``symbolic[text]`` when given).
    """
    import onnx.helper

    op = get_op(op) if isinstance(op, str) else op
    a = validate_attrs(op, attrs)
    ops = SYM_OPS if any(isinstance(d, Sym) for sh in input_shapes for d in sh) else INT_OPS
    shapes = output_shapes(op, a, input_shapes, ops)
    infos = []
    for name, shape, dt in zip(outputs, shapes, output_dtypes(op, a)):
        dims = [(symbolic or {}).get(d.text, d.text) if isinstance(d, Sym) else int(d) for d in shape]
        infos.append(onnx.helper.make_tensor_value_info(name, ONNX_ELEM[dt], dims))
    return infos


# ------------------------------------------------------------------------------------------------
# kernel bindings: contract tensors <-> Triton kernel parameters
# ------------------------------------------------------------------------------------------------
#
# A tensorrt.plugin AOT kernel is launched with its arguments in the order
#     input tensors (op.inputs order), extra int32 scalars (aot_impl's SymIntExprs), output tensors
# (tensorrt.plugin.aot_impl docstring; _TemplateAOTPlugin.get_launch_params), nothing after. Triton
# kernels take their parameters in their own order and (since triton 3.3) two trailing hidden
# pointers (global / profile scratch). ``ptx_to_trt_abi`` reorders the .entry parameter list of the
# PTX to the TensorRT order and drops the hidden ones when the kernel body never reads them. Every
# float / shape-independent kernel argument is compiled in as a constexpr (TensorRT's extra
# arguments are integers only), every shape-dependent integer becomes an extra SymInt32.


@dataclass(frozen=True)
class Binding:
    """How one op maps onto one Triton kernel."""

    kernel: str  # attribute name in trtkv.plugins.kernels
    config: str  # which launch config of trtkv.plugins.kernels supplies the kernel's own constexprs
    params: dict[str, str]  # kernel parameter -> contract tensor name (inputs and outputs)
    scalars: tuple[str, ...]  # kernel parameters passed as extra int32 arguments, in this order
    consts: Callable[[Attrs], dict[str, Any]]  # kernel parameters compiled in as constexprs
    grid: Callable[[Attrs, dict, dict, SymOps], tuple]  # (attrs, input shapes by name, constexprs, ops)
    scalar_values: Callable[[Attrs, dict, dict, SymOps], tuple]  # values of ``scalars``, same signature


LOG2E = 1.4426950408889634


def _qk_scale(a: Attrs) -> float:
    return float(a["sm_scale"]) * LOG2E


_POOL_PARAMS = {f"{w}_{p}_ptr": f"{w}_{p}" for w in "kv" for p in ("data", "scale", "zero", "tail", "new")}
_CONST_PARAMS = dict(k_static_ptr="k_static", k_smooth_ptr="k_smooth", v_static_ptr="v_static",
                     v_smooth_ptr="v_smooth", had_ptr="hadamard")
_SEQ_PARAMS = dict(block_table_ptr="block_tables", context_lens_ptr="context_lens", slot_ids_ptr="slot_ids")

BINDINGS: dict[str, Binding] = {
    "PagedKVSeal": Binding(
        kernel="seal_kernel",
        config="seal",
        params=dict(x_ptr="rows", data_ptr="codes", scale_ptr="scale", zero_ptr="zero",
                    static_scale_ptr="static_scale", smooth_ptr="smooth", clip_ptr="clip", had_ptr="hadamard"),
        scalars=(),
        consts=lambda a: dict(num_kv_heads=a["num_kv_heads"]),
        grid=lambda a, s, c, ops: seal_grid(s["rows"][0], a["num_kv_heads"], ops),
        scalar_values=lambda a, s, c, ops: (),
    ),
    "PagedDecodePartition": Binding(
        kernel="paged_decode_partition_kernel",
        config="decode.partition",
        params=dict(q_ptr="q", **_POOL_PARAMS, **_CONST_PARAMS, **_SEQ_PARAMS,
                    part_m_ptr="part_m", part_l_ptr="part_l", part_acc_ptr="part_acc"),
        scalars=("max_blocks", "num_partitions"),
        consts=lambda a: dict(qk_scale=_qk_scale(a), num_heads=a["num_q_heads"], num_kv_heads=a["num_kv_heads"],
                              block_size=a["block_size"], sink_tokens=a["sink_tokens"]),
        grid=lambda a, s, c, ops: decode_grids(s["block_tables"][0], a["num_kv_heads"], s["block_tables"][1],
                                               a["block_size"], a["partition_size"], ops)[0],
        scalar_values=lambda a, s, c, ops: (s["block_tables"][1], num_partitions(s["block_tables"][1], a, ops)),
    ),
    "PagedDecodeReduce": Binding(
        kernel="paged_decode_reduce_kernel",
        config="decode.reduce",
        params=dict(part_m_ptr="part_m", part_l_ptr="part_l", part_acc_ptr="part_acc",
                    context_lens_ptr="context_lens", v_static_ptr="v_static", v_smooth_ptr="v_smooth",
                    had_ptr="hadamard", out_ptr="out"),
        scalars=("num_partitions",),
        consts=lambda a: dict(num_heads=a["num_q_heads"], num_kv_heads=a["num_kv_heads"]),
        grid=lambda a, s, c, ops: decode_reduce_grid(s["part_m"][0], a["num_kv_heads"], ops),
        scalar_values=lambda a, s, c, ops: (s["part_m"][2],),
    ),
    "PagedPrefillAttention": Binding(
        kernel="paged_prefill_kernel",
        config="prefill",
        params=dict(q_ptr="q", cu_seqlens_q_ptr="cu_seqlens", **_POOL_PARAMS, **_CONST_PARAMS, **_SEQ_PARAMS,
                    out_ptr="out"),
        scalars=("max_blocks",),
        consts=lambda a: dict(qk_scale=_qk_scale(a), num_heads=a["num_q_heads"], num_kv_heads=a["num_kv_heads"],
                              block_size=a["block_size"], sink_tokens=a["sink_tokens"]),
        # any query count bounds one sequence's: programs past a sequence's queries exit at once
        grid=lambda a, s, c, ops: prefill_grid(s["q"][0], a["num_kv_heads"], s["context_lens"][0], c["BLOCK_M"], ops),
        scalar_values=lambda a, s, c, ops: (s["block_tables"][1],),
    ),
}


# Dynamic shared memory a kernel may use without opting in: a launch asking for more fails
# (CUDA_ERROR_INVALID_VALUE) unless the function's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES was raised
# first (Triton's launcher and bench/gpu_check.py do; for TensorRT see docs/plugins.md, "Block and shared memory").
SHARED_MEM_DEFAULT_LIMIT = 48 * 1024


@dataclass(frozen=True)
class Launch:
    """A kernel launch in TensorRT terms, every field an int or a symbolic expression."""

    grid: tuple[Any, Any, Any]
    block: int
    shared_mem: int
    scalars: tuple[Any, ...]


def launch(op: OpSpec | str, attrs: Attrs, shapes: Sequence[Sequence[Any]], constexprs: dict, num_warps: int,
           shared_mem: int, ops: SymOps = INT_OPS) -> Launch:
    """Grid, block, shared memory and extra scalar arguments as expressions of the input shapes."""
    op = get_op(op) if isinstance(op, str) else op
    b = BINDINGS[op.name]
    s = {t.name: tuple(sh) for t, sh in zip(op.inputs, shapes)}
    grid = tuple(b.grid(attrs, s, constexprs, ops))
    return Launch(grid=grid, block=num_warps * 32, shared_mem=int(shared_mem),
                  scalars=tuple(b.scalar_values(attrs, s, constexprs, ops)))


@dataclass(frozen=True)
class KernelSignature:
    """What compiling a binding needs: the Triton signature and the TensorRT parameter order."""

    signature: dict[str, str]  # kernel parameter -> triton type ("*fp16", "i32", "constexpr")
    constexprs: dict[str, Any]
    ptx_order: tuple[str, ...]  # non-constexpr kernel parameters in kernel (= PTX) order
    trt_order: tuple[str, ...]  # the same parameters in TensorRT order (inputs, scalars, outputs)
    pointer_params: tuple[str, ...]


TRITON_PTR = {name: e.triton for name, e in ELEM_TYPES.items()}  # trtkv.formats.ELEM_TYPES


def kernel_signature(op: OpSpec | str, attrs: Attrs, arg_names: Sequence[str], kernel_constexprs: dict[str, Any],
                     input_dtypes_: Sequence[str] | None = None, output_dtypes_: Sequence[str] | None = None,
                     ) -> KernelSignature:
    """Map an op instance onto a kernel whose parameters are ``arg_names`` (the JITFunction's).

    ``kernel_constexprs`` are the kernel's own ``tl.constexpr`` values (from its launch config).
    Raises TrtkvError naming kernel parameters the binding leaves unbound or names that the kernel
    lacks (the binding table and trtkv.plugins.kernels disagree), and, for the attention ops, when the
    kernel constexprs do not select the new-rows path (``NEW_ROWS=True``) the contract needs.
    """
    op = get_op(op) if isinstance(op, str) else op
    b = BINDINGS[op.name]
    consts = {**b.consts(attrs), **kernel_constexprs}
    names = list(arg_names)
    missing = [p for p in list(b.params) + list(b.scalars) + list(b.consts(attrs)) if p not in names]
    if missing:
        raise TrtkvError(f"{op.name}: kernel {b.kernel} has no parameter(s) {', '.join(missing)}",
                         "update contract.BINDINGS to the kernel's signature (docs/plugins.md, 'Argument order')")
    unbound = [p for p in names if p not in b.params and p not in b.scalars and p not in consts]
    if unbound:
        raise TrtkvError(f"{op.name}: kernel {b.kernel} parameter(s) {', '.join(unbound)} are not bound", FIX)
    idt = list(input_dtypes_) if input_dtypes_ is not None else input_dtypes(op, attrs)
    odt = list(output_dtypes_) if output_dtypes_ is not None else output_dtypes(op, attrs)
    dtype_of = {t.name: d for t, d in zip(op.inputs, idt)} | {t.name: d for t, d in zip(op.outputs, odt)}
    sig, ptrs = {}, []
    for p in names:
        if p in consts:
            sig[p] = "constexpr"
        elif p in b.scalars:
            sig[p] = "i32"
        else:
            sig[p] = TRITON_PTR[dtype_of[b.params[p]]]
            ptrs.append(p)
    ptx_order = tuple(p for p in names if sig[p] != "constexpr")
    by_tensor = {v: k for k, v in b.params.items()}
    trt_order = (tuple(by_tensor[t.name] for t in op.inputs) + tuple(b.scalars)
                 + tuple(by_tensor[t.name] for t in op.outputs))
    assert sorted(trt_order) == sorted(ptx_order), (trt_order, ptx_order)
    return KernelSignature(signature=sig, constexprs={k: v for k, v in consts.items() if k in names},
                           ptx_order=ptx_order, trt_order=trt_order, pointer_params=tuple(ptrs))


# ------------------------------------------------------------------------------------------------
# PTX: TensorRT's argument order
# ------------------------------------------------------------------------------------------------

_ENTRY = re.compile(r"\.entry\s+(?P<name>[A-Za-z_$][\w$]*)\s*\((?P<params>[^)]*)\)", re.S)


def ptx_entry_params(ptx: str, kernel_name: str) -> list[str]:
    """The .param declaration lines of one .entry, in order (stripped, without trailing commas)."""
    for m in _ENTRY.finditer(ptx):
        if m.group("name") == kernel_name:
            return [p.strip().rstrip(",").strip() for p in m.group("params").split("\n") if p.strip()]
    raise TrtkvError(f"PTX has no .entry {kernel_name}", "pass the kernel name from the compiled metadata")


def ptx_reqntid(ptx: str, kernel_name: str) -> int | None:
    """Threads per block the PTX requires (``.reqntid``), if declared."""
    for m in _ENTRY.finditer(ptx):
        if m.group("name") == kernel_name:
            tail = ptx[m.end():m.end() + 200]
            r = re.match(r"\s*\.reqntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", tail)
            if not r:
                return None
            return math.prod(int(x) for x in r.groups() if x)
    raise TrtkvError(f"PTX has no .entry {kernel_name}")


def ptx_to_trt_abi(ptx: str, kernel_name: str, ptx_order: Sequence[str], trt_order: Sequence[str]) -> str:
    """Reorder an .entry's parameters from the kernel's order to TensorRT's and drop hidden ones.

    ``ptx_order`` names the kernel's non-constexpr parameters as they appear in the PTX (Triton names
    them ``<kernel>_param_<i>``); declarations after them are Triton's hidden scratch pointers, dropped
    only if the body never loads them. The body refers to parameters by name, so reordering the
    declarations changes the launch ABI and nothing else.
    """
    decls = ptx_entry_params(ptx, kernel_name)
    n = len(ptx_order)
    if len(decls) < n:
        raise TrtkvError(f"{kernel_name}: PTX declares {len(decls)} parameters, the binding expects {n}", FIX)
    names = []
    for i, d in enumerate(decls):
        m = re.search(r"([A-Za-z_$][\w$]*)\s*$", d)
        assert m, d
        names.append(m.group(1))
        if m.group(1) != f"{kernel_name}_param_{i}":
            raise TrtkvError(f"{kernel_name}: unexpected PTX parameter name {m.group(1)!r}", FIX)
    m = next(m for m in _ENTRY.finditer(ptx) if m.group("name") == kernel_name)
    body = ptx[m.end():]
    for hidden in names[n:]:
        if re.search(rf"\[\s*{re.escape(hidden)}\s*(\+\s*\d+\s*)?\]", body):
            raise TrtkvError(f"{kernel_name}: hidden parameter {hidden} is used by the kernel (global scratch?)",
                             "TensorRT cannot pass it; change the kernel so it needs no scratch memory")
    index = {p: i for i, p in enumerate(ptx_order)}
    if sorted(index) != sorted(trt_order):
        raise TrtkvError(f"{kernel_name}: the TensorRT order does not list the same parameters", FIX)
    new = [decls[index[p]] for p in trt_order]
    block = "\n" + ",\n".join("\t" + d for d in new) + "\n"
    return ptx[:m.start("params")] + block + ptx[m.end("params"):]


__all__ = [
    "DOMAIN", "PLUGIN_VERSION", "OPS", "SEAL", "LIMITS", "KernelLimits", "seal_grid", "decode_grids",
    "decode_reduce_grid", "decode_partitions", "prefill_grid", "DECODE_PARTITION", "DECODE_REDUCE", "PREFILL", "BINDINGS",
    "Sym", "SymOps", "INT_OPS", "SYM_OPS", "sym_shape", "value", "TensorSpec", "AttrSpec", "OpSpec", "Attrs",
    "Launch", "KernelSignature", "SHARED_MEM_DEFAULT_LIMIT",
    "get_op", "validate_attrs", "attrs_for", "codes_dtype", "input_dtypes",
    "output_dtypes", "placeholder_shape", "check_inputs", "num_partitions", "output_shapes",
    "expected_input_shapes", "onnx_attributes", "make_node", "make_decode_nodes", "opset_imports",
    "value_infos", "launch", "kernel_signature", "ptx_entry_params", "ptx_reqntid", "ptx_to_trt_abi",
]
