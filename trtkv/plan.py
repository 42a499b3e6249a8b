"""Memory and capacity planning: how many tokens of KV cache fit on a GPU for each format.

A sealed-block format costs its pool bits for every sealed token plus one fp16 open block per
sequence; ``kv_bytes_per_token`` at a context length counts both, so batch sizes are never flattered.

Bytes per token always come from the format definition (``KVFormat.kv_bytes_per_token``), never from a
hard-coded compression factor, so a new format is planned correctly the moment it is defined.
"""

from __future__ import annotations

from dataclasses import dataclass

from trtkv.errors import TrtkvError
from trtkv.formats import PRESETS, KVFormat

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
    cached_bytes_per_token: float = 0.0  # what a prefix kept in the prefix cache costs: sealed blocks only, no open block


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
    reserve_fraction: float = 0.1,
) -> tuple[int, list[PlanRow]]:
    """KV budget after weights and a reserve, and per format the tokens and batch that fit at ``context_len``."""
    if context_len <= 0:
        raise TrtkvError(f"context length must be positive, got {context_len}", "pass --context N with N >= 1")
    if not 0 <= reserve_fraction < 1:
        raise TrtkvError(f"reserve fraction {reserve_fraction} is outside [0, 1)", "pass e.g. --reserve 0.1")
    budget = gpu_bytes - shape.weight_bytes - int(reserve_fraction * gpu_bytes)
    if budget <= 0:
        raise TrtkvError(
            f"the weights ({shape.weight_bytes / GIB:.1f} GiB) and reserve leave no memory for the KV cache on this GPU",
            "pick a larger GPU, lower --reserve, or shard the model",
        )
    fp16_bytes = PRESETS["fp16"].kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim)
    rows = []
    for fmt in formats:
        per_token = fmt.kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, context_len)
        tokens = int(budget // per_token)
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
                cached_bytes_per_token=fmt.kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim),
            )
        )
    return budget, rows
