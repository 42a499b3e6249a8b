"""The four ops: their tensors, attributes and which optional tensors a format uses (``OPS``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from trtkv.errors import TrtkvError

from .limits import LIMITS

if TYPE_CHECKING:
    from .attrs import Attrs

DOMAIN = "trtkv"  # ONNX domain of the nodes and the TensorRT plugin namespace
PLUGIN_VERSION = "1"  # tensorrt.plugin registers every op as version "1"
# attributes the TensorRT ONNX parser reads itself; no plugin attribute may use these names,
# nor the names tensorrt.plugin reserves for its own arguments
PARSER_ATTRS = ("plugin_namespace", "plugin_version", "aot", "tensorrt_plugin_shape_input_indices")
RESERVED_ATTR_NAMES = PARSER_ATTRS + ("outputs", "stream", "tactic")

FIX = "see docs/plugins.md (ONNX op contract)"


@dataclass(frozen=True)
class OpTensor:
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
    inputs: tuple[OpTensor, ...]
    outputs: tuple[OpTensor, ...]
    attrs: tuple[AttrSpec, ...]

    @property
    def plugin_id(self) -> str:
        return f"{DOMAIN}::{self.name}"

    def input(self, name: str) -> OpTensor:
        return _by_name(self.inputs, name, self.name)

    def output(self, name: str) -> OpTensor:
        return _by_name(self.outputs, name, self.name)

    def input_index(self, name: str) -> int:
        return [t.name for t in self.inputs].index(name)


def _by_name(specs, name, op):
    for s in specs:
        if s.name == name:
            return s
    raise KeyError(f"{op} has no tensor {name!r}")


# ---- which optional tensors a format uses ----


def _dyn(which):
    return lambda a: a.tensor_format(which).is_dynamic


def _asym(which):
    return lambda a: a.tensor_format(which).is_dynamic and not a.tensor_format(which).symmetric


def _static(which):
    return lambda a: a.tensor_format(which).is_static


def _smooth(which):
    return lambda a: a.tensor_format(which).smooth


def _clip(which):
    return lambda a: a.tensor_format(which).is_dynamic


def _had(*which):
    return lambda a: any(a.tensor_format(w).hadamard for w in which)


_PLACEHOLDER_SCALE_RANK = 4  # a format without dynamic scales passes a per-token-rank placeholder


def _scale_rank(which: str):
    """Rank of a ``[blocks, *scale]`` tensor: ``TensorFormat.scale_shape`` decides it."""
    def rank(a: "Attrs") -> int:
        shape = a.tensor_format(which).scale_shape((1,), 1, 1, a["head_dim"])
        return _PLACEHOLDER_SCALE_RANK if shape is None else len(shape)

    return rank


_SCALE_SHAPE = "per-token formats [{n}, kv_heads, block_size, groups]; bchannel [{n}, kv_heads, head_dim]"


def _pool(which: str) -> tuple[OpTensor, ...]:
    W = which.upper()
    return (
        OpTensor(f"{which}_data", 4, f"codes:{which}", "pool", "[num_blocks, kv_heads, block_size, packed_dim]",
                 f"{W} pool codes: sealed blocks (read-only)"),
        OpTensor(f"{which}_scale", _scale_rank(which), "float16", "pool", _SCALE_SHAPE.format(n="num_blocks"),
                 f"{W} pool dynamic scales", _dyn(which)),
        OpTensor(f"{which}_zero", _scale_rank(which), "float16", "pool", _SCALE_SHAPE.format(n="num_blocks"),
                 f"{W} pool zero-points (asymmetric)", _asym(which)),
    )


def _tails() -> tuple[OpTensor, ...]:
    return tuple(
        OpTensor(f"{w}_tail", 4, "float16", "tail", "[num_slots, kv_heads, block_size + sink_tokens, head_dim]",
                 f"{w.upper()} open blocks (fp16, model channel space); slot s holds its sequence's newest "
                 "context_len % block_size rows at offsets 0 .., other open-block rows may hold anything; rows "
                 "block_size .. hold the sequence's first sink_tokens tokens, read instead of the pool's once "
                 "context_len >= block_size")
        for w in ("k", "v"))


def _new(rows: str) -> tuple[OpTensor, ...]:
    return tuple(
        OpTensor(f"{w}_new", 3, "float16", "new-rows", f"[{rows}, kv_heads, head_dim]",
                 f"this step's {w.upper()} rows (fp16, model channel space: K after RoPE), the values the open "
                 "block will hold")
        for w in ("k", "v"))


def _const(name: str, which: str, what: str, needed) -> OpTensor:
    return OpTensor(name, 2, "float32", "constant", "[kv_heads, head_dim]",
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
        OpTensor("rows", 4, "float16", "activation", "[blocks, kv_heads, block_size, head_dim]",
                 "the open blocks to seal, model channel space (the kernel applies smoothing / Hadamard)"),
        _const("static_scale", "", "static scale", _static("x")),
        _const("smooth", "", "smoothing divisors", _smooth("x")),
        OpTensor("clip", 1, "float32", "constant", "[kv_heads]",
                 "dynamic range multiplier in (0, 1] (ones when not calibrated)", _clip("x")),
        OpTensor("hadamard", 2, "float32", "constant", "[head_dim, head_dim]", _HAD_DOC, _had("x")),
    ),
    outputs=(
        OpTensor("codes", 4, "codes", "output", "[blocks, kv_heads, block_size, packed_dim]", "quantized codes"),
        OpTensor("scale", _scale_rank("x"), "float16", "output", _SCALE_SHAPE.format(n="blocks"),
                 "dynamic scales", _dyn("x")),
        OpTensor("zero", _scale_rank("x"), "float16", "output", _SCALE_SHAPE.format(n="blocks"),
                 "zero-points", _asym("x")),
    ),
    attrs=(
        AttrSpec("tensor_format", str, "the tensor format spec (TensorFormat.short())"),
        AttrSpec("num_kv_heads", int, "KV heads"),
        AttrSpec("head_dim", int, "head dimension (contract.LIMITS)"),
        _A_BLOCK,
    ),
)

def _v_transform_consts() -> tuple[OpTensor, ...]:
    return (_const("v_static", "v", "static scale", _static("v")), _const("v_smooth", "v", "smoothing divisors", _smooth("v")))


def _cache_inputs(rows: str) -> tuple[OpTensor, ...]:
    """The inputs both attention ops read after their queries: pools, open blocks, this step's rows
    (``rows`` long), the K/V transform constants and the per-sequence block tables, lengths and slots."""
    return (
        *_pool("k"), *_pool("v"), *_tails(), *_new(rows),
        _const("k_static", "k", "static scale", _static("k")),
        _const("k_smooth", "k", "smoothing divisors", _smooth("k")),
        *_v_transform_consts(),
        OpTensor("hadamard", 2, "float32", "constant", "[head_dim, head_dim]", _HAD_DOC, _had("k", "v")),
        OpTensor("block_tables", 2, "int32", "block-table", "[batch, max_blocks]", _BT),
        OpTensor("context_lens", 1, "int32", "lengths", "[batch]", _CTX),
        OpTensor("slot_ids", 1, "int32", "slots", "[batch]", _SLOTS),
    )


def _partials(m_doc: str, l_doc: str, acc_doc: str) -> tuple[OpTensor, ...]:
    """Split-K partial states: PagedDecodePartition's outputs are PagedDecodeReduce's first inputs."""
    return (
        OpTensor("part_m", 3, "float32", "partial", "[batch, q_heads, partitions]", m_doc),
        OpTensor("part_l", 3, "float32", "partial", "[batch, q_heads, partitions]", l_doc),
        OpTensor("part_acc", 4, "float32", "partial", "[batch, q_heads, partitions, head_dim]", acc_doc),
    )


def _attention_output(rows: str) -> tuple[OpTensor, ...]:
    """The attention result both the decode reduce and the prefill return: fp16 ``[rows, q_heads, head_dim]``."""
    return (OpTensor("out", 3, "float16", "output", f"[{rows}, q_heads, head_dim]", "attention output"),)


DECODE_PARTITION = OpSpec(
    name="PagedDecodePartition",
    doc="Split-K decode attention, stage 1: partial softmax states of one new token per sequence (position "
        "context_len) over partitions of its keys: sealed blocks (pool), open block (tail) and its own new row.",
    inputs=(
        OpTensor("q", 3, "float16", "activation", "[batch, q_heads, head_dim]", "queries (model channel space)"),
        *_cache_inputs("batch"),
    ),
    outputs=_partials("running max (log2 domain)", "softmax denominators",
                      "unnormalized outputs (V's stored channel space)"),
    attrs=(*_A_KV_FORMATS, *_A_HEADS, _A_BLOCK, _A_SINK, _A_SCALE, _A_PART, _A_PREC),
)

DECODE_REDUCE = OpSpec(
    name="PagedDecodeReduce",
    doc="Split-K decode attention, stage 2: merge the partitions (log-sum-exp), normalize, undo V's "
        "static scale / Hadamard / smoothing.",
    inputs=(
        *_partials(*["PagedDecodePartition output"] * 3),
        OpTensor("context_lens", 1, "int32", "lengths", "[batch]", "as given to PagedDecodePartition"),
        *_v_transform_consts(),
        OpTensor("hadamard", 2, "float32", "constant", "[head_dim, head_dim]", _HAD_DOC, _had("v")),
    ),
    outputs=_attention_output("batch"),
    attrs=(AttrSpec("v_format", str, "V tensor format spec"), *_A_HEADS, _A_PART),
)

PREFILL = OpSpec(
    name="PagedPrefillAttention",
    doc="Causal (chunked) prefill attention of packed new tokens over sealed blocks (pool), the open block "
        "(tail) and this step's new rows; a step never crosses a block boundary.",
    inputs=(
        OpTensor("q", 3, "float16", "activation", "[tokens, q_heads, head_dim]", "packed queries of all sequences"),
        OpTensor("cu_seqlens", 1, "int32", "offsets", "[batch + 1]",
                 "sequence b's queries and new rows are rows cu_seqlens[b] .. cu_seqlens[b+1]-1, at positions "
                 "context_len .. (padded [B, T] form: cu_seqlens = arange(B + 1) * T; padding rows come last in "
                 "each sequence and no valid query sees them)"),
        *_cache_inputs("tokens"),
    ),
    outputs=_attention_output("tokens"),
    attrs=(*_A_KV_FORMATS, *_A_HEADS, _A_BLOCK, _A_SINK, _A_SCALE, _A_PREC),
)

OPS: dict[str, OpSpec] = {op.name: op for op in (SEAL, DECODE_PARTITION, DECODE_REDUCE, PREFILL)}


def get_op(name: str) -> OpSpec:
    name = name.split("::")[-1]
    if name not in OPS:
        raise TrtkvError(f"unknown trtkv op {name!r}", f"one of {', '.join(OPS)}")
    return OPS[name]
