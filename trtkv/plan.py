"""Memory and capacity planning: how many tokens of KV cache fit on a GPU for each format.

A sealed-block format costs its pool bits for every sealed token plus one fp16 open block per
sequence; ``kv_bytes_per_token`` at a context length counts both, so batch sizes are never flattered.

Bytes per token always come from the format definition (``KVFormat.kv_bytes_per_token``), never from a
hard-coded compression factor, so a new format is planned correctly the moment it is defined.

Sliding-window layers (Gemma 2/3, Mistral / Qwen2 with ``sliding_window``) only read the newest ``window``
tokens, so the runtime's cache frees their sealed blocks that fall out of the window (``trtkv.cache_layout.WindowRing``):
such a layer holds, per sequence, the sealed blocks that still overlap the window plus its open block, in a ring of
``window_ring_blocks`` blocks that each sequence slot owns (at most window + one block of tokens).
``layer_type_bytes`` counts the ring's bytes per layer type -- what the runtime's budget reserves -- and ``plan`` sizes
batches with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from trtkv.cache_layout import first_window_block, window_ring_blocks
from trtkv.errors import TrtkvError
from trtkv.formats import DEFAULT_BLOCK_SIZE, PRESETS, KVFormat
from trtkv.gpu import DEFAULT_RESERVE, kv_budget_bytes
from trtkv.models import FULL_ATTENTION, SLIDING_ATTENTION

MIB = 1024**2
GIB = 1024**3

# Total memory as nvidia-smi reports it (MiB) for each named GPU.
GPUS: dict[str, int] = {
    "A100-40GB": 40960,
    "A100-80GB": 81920,
    "H100-80GB": 81559,
    "H200-141GB": 143771,
    "L4-24GB": 23034,
    "RTX4090-24GB": 24564,
}
DEFAULT_GPU = "H100-80GB"  # assumed when neither --gpu nor --gpu-mem is given (said in the output)


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    weight_bytes: int = 0
    layer_types: tuple[str, ...] = ()  # per layer, as in ModelInfo; () = every layer global
    sliding_window: int | None = None  # tokens a sliding layer attends to (its own included)

    @classmethod
    def from_info(cls, info, weight_bytes: int = 0) -> ModelShape:
        """The planner's view of a ``trtkv.models.ModelInfo`` (the record read once from the config)."""
        return cls(info.name, info.num_layers, info.num_kv_heads, info.head_dim, weight_bytes,
                   tuple(info.layer_types), info.sliding_window)

    def layer_counts(self) -> dict[str, int]:
        """Layers per type, e.g. {"sliding_attention": 40, "full_attention": 8}."""
        types = self.layer_types or (FULL_ATTENTION,) * self.num_layers
        out: dict[str, int] = {}
        for t in types:
            out[t] = out.get(t, 0) + 1
        return out


@dataclass(frozen=True)
class LayerTypeBytes:
    """One layer type's share of one sequence's KV cache at a context length."""

    layer_type: str
    layers: int
    tokens_held: int  # per layer: every token for a global layer; the blocks still in the window + the open block for a local one
    bytes_per_sequence: float  # K + V over this type's layers: pool blocks (a local layer: its slot's ring) + fp16 open blocks


def layer_type_bytes(shape: ModelShape, fmt: KVFormat, context_len: int) -> list[LayerTypeBytes]:
    """Bytes one sequence of ``context_len`` tokens holds per layer type in format ``fmt``.

    A global layer holds every token (``kv_bytes_per_token`` at the context length: sealed blocks + open block).
    A sliding layer of window W, with blocks of ``bs`` tokens (the format's own, else ``DEFAULT_BLOCK_SIZE``), holds
    the sealed blocks that still hold a position the next query reads (positions >= context - W + 1) and its open
    block: ``context//bs - first_window_block(context)`` blocks, in a ring of ``window_ring_blocks(W, bs)`` blocks (at most
    W + one block of tokens) that the runtime reserves per sequence slot: the bytes counted here.
    """
    H, D = shape.num_kv_heads, shape.head_dim
    out = []
    for kind, n in shape.layer_counts().items():
        if kind != SLIDING_ATTENTION or not shape.sliding_window:
            out.append(LayerTypeBytes(kind, n, context_len, fmt.kv_bytes_per_token(n, H, D, context_len) * context_len))
            continue
        paged = fmt if fmt.sealed else fmt.with_block_size(DEFAULT_BLOCK_SIZE)
        bs = paged.block_size
        kept = context_len // bs - first_window_block(context_len, shape.sliding_window, bs)
        pool = window_ring_blocks(shape.sliding_window, bs) * bs * paged.kv_bytes_per_token(n, H, D)  # the slot's ring
        out.append(LayerTypeBytes(kind, n, kept * bs + context_len % bs, pool + paged.tail_bytes_per_slot(n, H, D)))
    return out


def sequence_bytes(shape: ModelShape, fmt: KVFormat, context_len: int) -> float:
    """K + V bytes of one sequence of ``context_len`` tokens, all layers, freed sliding-window blocks not counted."""
    return sum(r.bytes_per_sequence for r in layer_type_bytes(shape, fmt, context_len))


@dataclass(frozen=True)
class PlanRow:
    format: str
    pool_bits_per_element: float  # sealed blocks in the pool, scales included
    tail_bytes_per_slot: int  # the fp16 open blocks of one sequence (sealed-block formats)
    bits_per_element: float  # mean for one sequence of context_len tokens, open block included
    kv_bytes_per_token: float
    max_tokens: int
    max_batch: int
    capacity_vs_fp16: float
    window_saving: float = 1.0  # bytes if every layer were global / bytes with sliding layers' freed blocks (1 without local layers)
    by_layer_type: tuple[LayerTypeBytes, ...] = ()
    cached_bytes_per_token: float = 0.0  # what a prefix kept in the prefix cache costs: sealed blocks only, no open block
    constant_bytes: int = 0  # per-layer constants the format fixes (``nuq`` codebooks), all layers: taken from the budget once


def gpu_memory_bytes(gpu: str | None, gpu_mem_gib: float | None) -> int:
    if gpu_mem_gib is not None:
        if gpu_mem_gib <= 0:
            raise TrtkvError(f"--gpu-mem must be positive, got {gpu_mem_gib}", "give the GPU memory in GiB, e.g. --gpu-mem 80")
        return int(gpu_mem_gib * GIB)
    name = gpu or DEFAULT_GPU
    if name.lower() == "auto":  # this machine's GPU, as pynvml (or torch.cuda) reports it; trtkv serve reads the same
        from trtkv.gpu import device_memory

        return device_memory(0)[1]
    for known, mib in GPUS.items():
        if known.lower() == name.lower():
            return mib * MIB
    raise TrtkvError(f"unknown GPU {name!r}", f"use one of {', '.join(GPUS)} or --gpu-mem GIB")


def plan(
    shape: ModelShape,
    formats: list[KVFormat],
    *,
    context_len: int,
    gpu_bytes: int,
    reserve_fraction: float = DEFAULT_RESERVE,
) -> tuple[int, list[PlanRow]]:
    """KV budget after weights and a reserve (``trtkv.gpu.kv_budget_bytes``, the rule `serve` sizes its pool by), and
    per format the tokens and batch that fit at ``context_len``."""
    if context_len <= 0:
        raise TrtkvError(f"context length must be positive, got {context_len}", "pass --context N with N >= 1")
    if not 0 <= reserve_fraction < 1:
        raise TrtkvError(f"reserve fraction {reserve_fraction} is outside [0, 1)", f"pass e.g. --reserve {DEFAULT_RESERVE:g}")
    budget = kv_budget_bytes(gpu_bytes, shape.weight_bytes, reserve_fraction)
    if budget <= 0:
        raise TrtkvError(
            f"the weights ({shape.weight_bytes / GIB:.1f} GiB) and reserve leave no memory for the KV cache on this GPU",
            "pick a larger GPU, lower --reserve, or shard the model",
        )
    fp16_bytes = sequence_bytes(shape, PRESETS["fp16"], context_len) / context_len
    rows = []
    for fmt in formats:
        fmt.check_layers(shape.num_layers)
        all_global = fmt.kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, context_len)
        by_type = layer_type_bytes(shape, fmt, context_len)
        per_token = sum(r.bytes_per_sequence for r in by_type) / context_len  # a sequence's bytes over its tokens
        constants = fmt.constant_bytes(shape.num_layers, shape.num_kv_heads)
        tokens = int(max(budget - constants, 0) // per_token)
        rows.append(
            PlanRow(
                format=fmt.name,
                pool_bits_per_element=fmt.pool_bits_per_element(shape.head_dim),
                tail_bytes_per_slot=fmt.tail_bytes_per_slot(shape.num_layers, shape.num_kv_heads, shape.head_dim),
                bits_per_element=fmt.bits_per_element(shape.head_dim, context_len),
                kv_bytes_per_token=per_token,
                max_tokens=tokens,
                max_batch=tokens // context_len,
                capacity_vs_fp16=fp16_bytes / per_token,
                window_saving=all_global / per_token,
                by_layer_type=tuple(by_type),
                cached_bytes_per_token=fmt.kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim),
                constant_bytes=constants,
            )
        )
    return budget, rows
