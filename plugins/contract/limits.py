"""What the Triton kernels accept: the one record every head-dim / block-size / partition check reads."""

from __future__ import annotations

from dataclasses import dataclass

from trtkv.formats import OUTLIER_MULTIPLE


@dataclass(frozen=True)
class KernelLimits:
    """What the Triton kernels accept. Every check of a head dim, block size or partition size reads this.

    * head_dim: tiled whole (``tl.arange``) and split in even / odd halves that feed ``tl.dot`` as the
      reduction dimension, which must be >= 16: a power of two, 32 .. 256.
    * block_size: the seal kernel holds one whole block per (block, head) program, its rows are the M
      dimension of the Hadamard ``tl.dot`` (>= 16); a power of two, 16 .. 128 (larger blocks spill).
    * partition_size: split-K decode partitions, a power of two >= 16 (a multiple of the kernel's key tile).
    * outliers (``outN``): a block's list is the reduction dimension of the one-hot products that write it over a
      tile (``tl.dot``, >= 16), read in chunks of its largest power-of-two divisor (``tl.arange``): a multiple of 16,
      16 .. 1024 (the seal kernel's selection counts, any number).
    """

    head_dim_min: int = 32
    head_dim_max: int = 256
    block_size_min: int = 16
    block_size_max: int = 128
    partition_min: int = 16
    default_partition: int = 512
    outliers_min: int = OUTLIER_MULTIPLE
    outliers_max: int = 1024

    # storage dtypes the kernels decode and seal (DTYPES rows). Packed ints need whole bytes per plane and row
    # (int4: head_dim % 2, int2: % 4, int3: % 8), which every head_dim above satisfies.
    dtypes: tuple[str, ...] = ("fp16", "fp8_e4m3", "int8", "int4", "int3", "int2")

    def dtype_problem(self, dtype: str) -> str | None:
        if dtype in self.dtypes:
            return None
        return f"has storage {dtype}, which the Triton kernels do not implement yet (they take {', '.join(self.dtypes)})"

    def head_dim_problem(self, d: int) -> str | None:
        if _is_pow2(d) and self.head_dim_min <= d <= self.head_dim_max:
            return None
        return f"must be a power of two between {self.head_dim_min} and {self.head_dim_max} (the kernels' tile width)"

    def block_size_problem(self, bs: int) -> str | None:
        if _is_pow2(bs) and self.block_size_min <= bs <= self.block_size_max:
            return None
        return f"must be a power of two between {self.block_size_min} and {self.block_size_max}"

    def outliers_problem(self, n: int | None) -> str | None:
        if not n or (n % self.outliers_min == 0 and self.outliers_min <= n <= self.outliers_max):
            return None
        return (f"keeps {n} outliers per block, and the Triton kernels take a multiple of {self.outliers_min} between "
                f"{self.outliers_min} and {self.outliers_max}")

    def partition_problem(self, p: int) -> str | None:
        return None if _is_pow2(p) and p >= self.partition_min else f"must be a power of two >= {self.partition_min}"


LIMITS = KernelLimits()


def _is_pow2(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0
