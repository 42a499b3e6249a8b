"""KV cache formats: one validated definition used by calibration, eval, kernels, ONNX and plugins.

A format is a table row, not code: the storage dtypes are rows of ``DTYPES`` (bits, code range,
bit planes and packing), and a ``KVFormat`` combines one ``TensorFormat`` for K and one for V with the
optional transforms. The quantization math that reads these rows lives once, in ``trtkv.quant``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trtkv.errors import TrtkvError
from trtkv.preset_names import PRESET_NAMES

StorageDtype = Literal["fp16", "fp8_e4m3", "int8", "int4", "int3", "int2"]
Granularity = Literal["none", "per_tensor", "per_head", "per_channel", "per_token", "per_token_group", "per_block_channel"]

STATIC_GRANULARITIES = ("per_tensor", "per_head", "per_channel")
DYNAMIC_GRANULARITIES = ("per_token", "per_token_group", "per_block_channel")
# per_block_channel: one scale (and zero-point) per channel over the tokens of a sealed block (KIVI's
# key layout); it exists only in formats with sealed blocks, because a block is quantized when it fills.
SCALE_BITS = 16  # dynamic scales and zero-points are stored as fp16 beside the codes
DEFAULT_BLOCK_SIZE = 64  # tokens per sealed block of a paged cache whose format names none (build-engine, plan)
CLIP_GRID = tuple(1.0 - 0.05 * i for i in range(11))  # range shrinks a ``mse`` block-channel search tries: 1.0 .. 0.5
MAX_SINK_TOKENS = 16  # fp16 sink rows a format may keep per sequence (a few tokens carry the attention sink)
# Dense-and-sparse outliers (spec word ``outN``): a sealed block keeps, per KV head, the N elements farthest from their
# quantization group's centre exactly, as an fp16 value and an int16 position ``token * head_dim + channel`` in the block.
OUTLIER_VALUE_BITS = 16
OUTLIER_INDEX_BITS = 16
OUTLIER_BITS = OUTLIER_VALUE_BITS + OUTLIER_INDEX_BITS
MAX_OUTLIER_POSITIONS = 1 << 15  # positions are int16: block_size * head_dim must stay below this
OUTLIER_MULTIPLE = 16  # outlier counts presets are fitted to (``fit_format``): the Triton kernels tile a list by 16
CODEBOOK_BITS = 32  # a codebook level is a float32 layer constant (counted beside the pools, not per element)
# Per-channel code widths (spec word ``allocB``): 0 keeps the block's mean alone; a code may span two bytes (a reader loads
# the byte pair). A format's own set is those up to its dtype's bits (``TensorFormat.channel_widths``).
CHANNEL_WIDTHS = tuple(range(9))


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit codes [..., D] (D even) to bytes [..., D/2], the even channel in the low nibble."""
    if codes.shape[-1] % 2:
        raise TrtkvError(f"int4 packing needs an even last dimension, got {codes.shape[-1]}", "use an even head_dim")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: bytes [..., D/2] to unsigned codes [..., D] (uint8)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def channel_offsets(widths: torch.Tensor) -> torch.Tensor:
    """Bit offset [..., D] (int64) of each channel's code in a token row of per-channel ``widths`` [..., D] (``allocB``
    formats): channels are laid out in their own order, each code right after the one before, so that any 8 channels in
    a row lie within 9 bytes (a SIMD reader takes them with one 16-byte load and a byte shuffle); a code may span two
    bytes (readers load the byte pair); a 0-width channel (no code) is given offset 0. The one layout every packer and
    reader of such rows uses."""
    w = widths.long()
    return (torch.cumsum(w, -1) - w).masked_fill_(w == 0, 0)


def pack_channel_codes(codes: torch.Tensor, widths: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """Unsigned codes [..., D] (each below ``2 ** width``) to token rows of ``row_bytes`` bytes [..., row_bytes] by
    ``channel_offsets(widths)``; ``widths`` [..., D] broadcasts against ``codes`` (per KV head: [H, 1, D] for rows
    [..., H, n, D]). Unused bits stay 0."""
    off = channel_offsets(widths)
    byte = (off >> 3).expand(codes.shape)
    shifted = codes.to(torch.int32) << (off & 7).to(torch.int32)  # at most 15 bits: this byte and the next
    out = torch.zeros(*codes.shape[:-1], row_bytes + 1, dtype=torch.int32, device=codes.device)  # + 1: a spill slot
    out.scatter_add_(-1, byte, shifted & 0xFF).scatter_add_(-1, byte + 1, shifted >> 8)  # codes never overlap: sums are ORs
    return out[..., :row_bytes].to(torch.uint8)  # the spill slot only ever holds zeros (the last code ends in the row)


def unpack_channel_codes(rows: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_channel_codes``: rows [..., row_bytes] to unsigned codes [..., D] (uint8; a 0-width channel
    reads 0); ``widths`` [..., D] broadcasts against the rows' leading axes. Each code is read from its byte and the next
    (the last byte of a row stands in for the one past it: a code that starts there ends there)."""
    w = widths.long()
    off = channel_offsets(w)
    shape = (*torch.broadcast_shapes(rows.shape[:-1], w.shape[:-1]), w.shape[-1])
    rows = rows.expand(*shape[:-1], rows.shape[-1])
    byte = (off >> 3).expand(shape)
    pair = rows.gather(-1, byte).to(torch.int32) | (rows.gather(-1, (byte + 1).clamp_max(rows.shape[-1] - 1)).to(torch.int32) << 8)
    return ((pair >> (off & 7).to(torch.int32)) & ((1 << w) - 1).to(torch.int32)).to(torch.uint8)


@dataclass(frozen=True)
class DtypeTraits:
    """One storage dtype: everything the math, the pools, the graphs and the byte accounting need to know.

    Like ggml's type traits, a row also carries its codec: ``encode`` turns rounded, clamped code values into
    the pool's storage tensor and ``decode`` turns it back (``code_offset`` is what symmetric codes are shifted
    by to be stored unsigned: int4's +8), and ``byte_table`` is the value of every storage byte, for decoders
    that look bytes up (the ONNX graph's Gather).
    """

    name: str
    bits: int
    is_int: bool
    sym_min: float  # symmetric code range (signed codes; floats: the finite range)
    sym_max: float
    asym_max: int  # asymmetric codes are unsigned 0..asym_max (ints only)
    storage: torch.dtype  # dtype of the packed storage tensor in a pool (symmetric / static codes)
    storage_asym: torch.dtype | None = None  # asymmetric (unsigned) codes, when they differ from ``storage``
    code_offset: int = 0  # added to symmetric codes before they are stored (int4: +8, so nibbles are unsigned)
    # Bit planes of a packed code, low bits first (ints below 8 bits): plane k holds bits
    # ``sum(planes[:k]) ..`` of every code, 8 / planes[k] codes per byte, channel c at bit (c % per byte) * width.
    # A token row stores its planes one after the other: int4 (4,) is two nibbles per byte, int2 (2,) four
    # codes per byte, int3 (2, 1) a 2-bit plane (D/4 bytes) then a 1-bit plane (D/8 bytes), 3/8 byte per code.
    planes: tuple[int, ...] = ()

    @property
    def packed_bytes_per_code(self) -> float:
        return self.bits / 8

    @property
    def packed(self) -> bool:
        """Several codes (or code planes) share a byte: ints below 8 bits."""
        return bool(self.planes)

    @property
    def codes_per_byte(self) -> int:
        """Codes per storage element: 1 unpacked, 8 / bits for one-plane packings (int4: 2, int2: 4). A bit-plane
        dtype (int3) has no whole number: ask ``packed_dim`` / ``row_align`` / ``planes`` instead."""
        if not self.planes:
            return 1
        if len(self.planes) > 1:
            raise ValueError(f"{self.name} is stored in bit planes {self.planes}: it has no whole number of codes per byte")
        return 8 // self.planes[0]

    @property
    def row_align(self) -> int:
        """head_dim must be a multiple of this for a token row to fill whole bytes in every plane (int3: 8)."""
        align = 1
        for width in self.planes:
            align = max(align, 8 // width)  # widths divide 8: the largest codes-per-byte is the lcm
        return align

    def packed_dim(self, head_dim: int) -> int:
        """Storage elements per token row of ``head_dim`` codes (int4: D/2, int3: 3D/8, int2: D/4)."""
        return head_dim * self.bits // (8 * self.storage.itemsize)

    def plane_layout(self, head_dim: int) -> list[tuple[int, int, int]]:
        """``(byte offset in the row, bit width, lowest code bit)`` of each plane of a ``head_dim`` row."""
        out, byte, low = [], 0, 0
        for width in self.planes:
            out.append((byte, width, low))
            byte += head_dim * width // 8
            low += width
        return out

    def storage_for(self, symmetric: bool) -> torch.dtype:
        """Torch dtype of a pool's ``data`` tensor for symmetric (or static) / asymmetric codes."""
        return self.storage if symmetric or self.storage_asym is None else self.storage_asym

    def elem_type(self, symmetric: bool) -> "ElemType":
        """The storage element type of these codes, with its name for every consumer."""
        return ELEM_TYPES[str(self.storage_for(symmetric)).removeprefix("torch.")]

    def offset(self, symmetric: bool) -> int:
        """What a stored code is minus the code value (symmetric int4: 8; everything else 0)."""
        return self.code_offset if symmetric else 0

    def encode(self, q: torch.Tensor, symmetric: bool) -> torch.Tensor:
        """Rounded, clamped code values (float) [..., D] -> the pool's storage tensor [..., D / codes_per_byte]."""
        if self.name == "fp16":
            return q.to(torch.float16)
        if not self.is_int:  # fp8: the e4m3fn bit pattern (rounding to nearest even happens in this cast)
            return q.to(torch.float8_e4m3fn).view(torch.uint8)
        stored = q + self.offset(symmetric) if self.offset(symmetric) else q
        if self.packed:
            return self._pack(stored.to(torch.uint8))
        return stored.to(self.storage_for(symmetric))

    def decode(self, codes: torch.Tensor, symmetric: bool) -> torch.Tensor:
        """Storage tensor -> code values as float32 [..., D] (the inverse of ``encode``)."""
        q = self.stored_values(codes)
        return q - self.offset(symmetric) if self.is_int and self.offset(symmetric) else q

    def stored_values(self, codes: torch.Tensor) -> torch.Tensor:
        """Storage tensor -> the stored codes as float32 [..., D], ``offset`` not yet subtracted (dequantizers fold
        it into their zero-point: ``(c - offset) * s + z == c * s + (z - offset * s)``, one pass fewer)."""
        if self.name == "fp16":
            return codes.float()
        if not self.is_int:
            return codes.view(torch.float8_e4m3fn).float()
        return (self._unpack(codes) if self.packed else codes).float()

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        """Unsigned codes uint8 [..., D] -> bytes [..., packed_dim(D)], plane after plane (see ``planes``)."""
        D = codes.shape[-1]
        if D % self.row_align:
            raise TrtkvError(f"{self.name} packing needs a last dimension that is a multiple of {self.row_align}, got {D}",
                             f"use a head_dim that is a multiple of {self.row_align}")
        out = []
        for _, width, low in self.plane_layout(D):
            per = 8 // width
            bits = ((codes >> low) & ((1 << width) - 1)).reshape(*codes.shape[:-1], D // per, per)
            shifts = torch.arange(per, dtype=torch.uint8, device=codes.device) * width
            out.append((bits << shifts).sum(-1, dtype=torch.int32).to(torch.uint8))
        return torch.cat(out, -1)

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Inverse of ``_pack``: bytes [..., packed_dim(D)] -> unsigned codes uint8 [..., D]."""
        D = packed.shape[-1] * 8 // self.bits
        codes = None
        for byte, width, low in self.plane_layout(D):
            plane = packed[..., byte : byte + D * width // 8]
            bits = torch.stack(self._fields(plane, width), -1).flatten(-2)
            codes = bits if codes is None else codes | (bits << low)
        return codes

    def code_fields(self, codes: torch.Tensor) -> list[torch.Tensor]:
        """The stored codes [..., packed_dim(D)] as ``n`` tensors [..., D / n], field ``i`` holding channels
        ``i, i + n, i + 2n ...`` (unpacked dtypes: n = 1, the codes themselves; int4: the low and the high nibbles):
        consumers that can take channels in that order (the torch engine's folded attention) skip the interleave."""
        if len(self.planes) > 1:
            raise ValueError(f"{self.name} is stored in bit planes {self.planes}: a code spans several fields")
        return self._fields(codes, self.planes[0]) if self.planes else [codes]

    @staticmethod
    def _fields(plane: torch.Tensor, width: int) -> list[torch.Tensor]:
        """The ``8 // width`` bit fields of each byte, low first. Shifts by Python ints (a broadcast shift tensor
        takes torch's slow path: 30x slower on CPU); the top field needs no mask."""
        per, mask = 8 // width, (1 << width) - 1
        return [plane & mask if i == 0 else (plane >> (i * width)) if i == per - 1 else (plane >> (i * width)) & mask for i in range(per)]

    def byte_table(self, symmetric: bool) -> torch.Tensor:
        """float32 [256, codes_per_byte]: the code values stored in each byte 0..255 (the even channel first).
        fp8's two NaN patterns read as 0: they never occur, inputs are clamped to ±448."""
        if self.bits > 8:
            raise ValueError(f"{self.name} is not stored in bytes")
        if len(self.planes) > 1:
            raise ValueError(f"{self.name} is stored in bit planes {self.planes}: a byte holds parts of codes (use plane_tables)")
        if self.planes:
            return self.plane_tables(symmetric)[0]
        b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        if self.codes_per_byte == 1 and self.is_int:
            b = b.view(self.storage_for(symmetric))
        table = self.decode(b.reshape(256, 1), symmetric)
        return torch.nan_to_num(table, nan=0.0).reshape(256, self.codes_per_byte)


    def plane_tables(self, symmetric: bool) -> list[torch.Tensor]:
        """Per bit plane, float32 [256, 8 / width]: what each byte 0..255 of that plane adds to the code values of
        its channels (bits shifted into place; the first plane also subtracts the symmetric offset), so a code is
        the sum over planes of one lookup each (the ONNX graph's Gathers). Packed ints only."""
        if not self.planes:
            raise ValueError(f"{self.name} has no bit planes")
        b = torch.arange(256, dtype=torch.int32)
        out = []
        for k, (_, width, low) in enumerate(self.plane_layout(8)):
            per = 8 // width
            shifts = torch.arange(per, dtype=torch.int32) * width
            vals = (((b[:, None] >> shifts) & ((1 << width) - 1)) << low).float()
            out.append(vals - self.offset(symmetric) if k == 0 else vals)
        return out

    def grid(self, symmetric: bool) -> torch.Tensor:
        """float32 [2**bits]: the code values of the uniform grid, ascending (symmetric int3: -4 .. 3, asymmetric 0 .. 7) --
        the codebook a ``nuq`` format starts from, and the one that reproduces the grid. Packed ints only."""
        if not self.planes:
            raise ValueError(f"{self.name} has no code grid small enough for a codebook")
        lo = self.sym_min if symmetric else 0
        return torch.arange(2**self.bits, dtype=torch.float32) + lo


@dataclass(frozen=True)
class ElemType:
    """One element type exchanged between torch, ONNX graphs, Triton kernels and TensorRT plugins."""

    name: str  # torch / numpy name, the contract's dtype name ("float16", "uint8", ...)
    torch: torch.dtype
    onnx: int  # onnx.TensorProto element type
    triton: str  # Triton pointer type of a kernel argument ("*fp16")
    trt: str  # tensorrt.DataType attribute ("float16" -> trt.float16)


ELEM_TYPES: dict[str, ElemType] = {
    e.name: e
    for e in [
        ElemType("float16", torch.float16, 10, "*fp16", "float16"),
        ElemType("bfloat16", torch.bfloat16, 16, "*bf16", "bfloat16"),
        ElemType("float32", torch.float32, 1, "*fp32", "float32"),
        ElemType("int8", torch.int8, 3, "*i8", "int8"),
        ElemType("uint8", torch.uint8, 2, "*u8", "uint8"),
        ElemType("int32", torch.int32, 6, "*i32", "int32"),
        ElemType("int64", torch.int64, 7, "*i64", "int64"),
    ]
}

DTYPES: dict[str, DtypeTraits] = {
    "fp16": DtypeTraits("fp16", 16, False, -65504.0, 65504.0, 0, torch.float16),
    "fp8_e4m3": DtypeTraits("fp8_e4m3", 8, False, -448.0, 448.0, 0, torch.uint8),
    "int8": DtypeTraits("int8", 8, True, -128, 127, 255, torch.int8, torch.uint8),
    "int4": DtypeTraits("int4", 4, True, -8, 7, 15, torch.uint8, code_offset=8, planes=(4,)),
    "int3": DtypeTraits("int3", 3, True, -4, 3, 7, torch.uint8, code_offset=4, planes=(2, 1)),
    "int2": DtypeTraits("int2", 2, True, -2, 1, 3, torch.uint8, code_offset=2, planes=(2,)),
}


class TensorFormat(BaseModel):
    """How one of K or V is stored: dtype, scale granularity, symmetry and transforms.

    Transforms are applied before quantization and undone after dequantization:
    ``x -> x / smooth -> x @ H -> quantize``. Both are exact identities on the attention
    result when undone on the other operand (the query for K, the output for V).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: StorageDtype
    granularity: Granularity = "none"
    group_size: int | None = Field(default=None, ge=2)
    symmetric: bool = True
    smooth: bool = False  # divide by calibrated per-channel factors (folded into the query / output)
    # what calibration sets the factors from: the tensor's channel absmax (``smooth``: absmax ** alpha) or, for keys, the
    # balance of key and query energy (``qsmooth``: sqrt(rms_K / rms_Q), the error-optimal diagonal scaling before a rotation)
    smooth_by: Literal["keys", "queries"] = "keys"
    hadamard: bool = False  # rotate head_dim with a normalized Hadamard matrix
    # keys only (spec word ``prerope``): quantized in the frame before RoPE -- the seal undoes each token's RoPE first
    # (``trtkv.rope``), and readers apply it again after dequantizing; every other transform happens in that frame
    pre_rope: bool = False
    # per_block_channel only: each channel's range in a sealed block is the MSE-best of ``CLIP_GRID`` shrinks of
    # [min, max] (searched when the block is sealed; the stored scale / zero-point are the chosen ones, same bytes)
    mse: bool = False
    # Non-uniform codes (spec word ``nuq``): a code indexes a calibrated table of 2**bits levels (per layer and KV head,
    # ``TensorParams.codebook``) in the grid's code units instead of standing for its own value: x = level[code] * s (+ z).
    codebook: bool = False
    # Dense-and-sparse (spec word ``outN``): per sealed block and KV head, the N elements farthest from their group's
    # centre are kept exactly beside the codes (sealed-block formats only) and set no range.
    outliers: int = Field(default=0, ge=0)
    # Per-channel bits (spec word ``allocB``): each channel of a KV head has its own code width (``channel_widths``:
    # 0 .. the dtype's bits, 0 = the block's mean alone), allocated at calibration from the queries' weight of its measured error
    # (``TensorParams.bits``, calibration/channel_bits.py) so that a token row's codes take ``B`` bits per element; the
    # dtype is the widest code. Rows are packed by ``channel_offsets``; per block and channel an fp16 step and minimum
    # as ``bchannel:asym`` (a 0-bit channel: step 0 and its mean), so ``code * s + z`` decodes every channel.
    allocated_bits: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "TensorFormat":
        if self.dtype == "fp16":
            if self.granularity != "none" or self.group_size is not None or not self.symmetric or self.smooth or self.hadamard:
                raise ValueError("fp16 storage takes no scales, zero-points or transforms (granularity 'none')")
            return self
        if self.granularity == "none":
            raise ValueError(f"{self.dtype} needs a scale granularity: one of {STATIC_GRANULARITIES + DYNAMIC_GRANULARITIES}")
        if self.dtype == "fp8_e4m3" and not self.symmetric:
            raise ValueError("fp8_e4m3 is symmetric only")
        if self.granularity == "per_token_group" and self.group_size is None:
            raise ValueError("per_token_group needs group_size")
        if self.granularity != "per_token_group" and self.group_size is not None:
            raise ValueError("group_size only applies to per_token_group")
        if not self.symmetric and self.granularity in STATIC_GRANULARITIES:
            raise ValueError("asymmetric (zero-point) quantization is only supported for dynamic granularities")
        if self.mse and self.granularity != "per_block_channel":
            raise ValueError("mse (a range searched per sealed block and channel) needs per_block_channel (bchannel) scales")
        if self.codebook:
            if not self.traits.planes:
                raise ValueError(f"nuq (a codebook of 2**bits levels) needs int4, int3 or int2 codes, not {self.dtype}")
            if not self.is_dynamic:
                raise ValueError("nuq needs dynamic scales (token, gN or bchannel): the codebook is in the units of a group's scale")
            if self.mse:
                raise ValueError("nuq and mse both choose what a code stands for: give one")
        if self.smooth_by == "queries" and not self.smooth:
            raise ValueError("smooth_by 'queries' needs smooth (spec word qsmooth)")
        if self.pre_rope and not self.is_dynamic:
            raise ValueError("prerope needs dynamic scales (token, gN or bchannel): calibrated static ranges are of keys after RoPE")
        if self.pre_rope and self.codebook:
            raise ValueError("prerope with nuq: key codebooks are fitted to keys after RoPE; give one")
        if self.allocated_bits is not None:
            if not self.traits.is_int or self.granularity != "per_block_channel" or self.symmetric:
                raise ValueError(f"alloc (bits per channel) needs int codes with asymmetric block-channel scales (e.g. int8:bchannel:asym:alloc2.5), not {self.short()}")
            if self.codebook or self.mse or self.hadamard:
                raise ValueError("alloc gives each channel its own bits: it takes no nuq, mse or hadamard (a rotation spreads what it allocates)")
            if self.allocated_bits > self.traits.bits:
                raise ValueError(f"alloc{self.allocated_bits:g} spends more bits than {self.dtype}'s widest code: use a wider dtype (int8)")
        return self

    @property
    def traits(self) -> DtypeTraits:
        return DTYPES[self.dtype]

    @property
    def is_quantized(self) -> bool:
        return self.dtype != "fp16"

    @property
    def storage(self) -> ElemType:
        """Element type of this format's pool codes (``DTYPES`` row, by symmetry; static codes are symmetric)."""
        return self.traits.elem_type(self.symmetric)

    @property
    def is_static(self) -> bool:
        return self.granularity in STATIC_GRANULARITIES

    @property
    def is_dynamic(self) -> bool:
        return self.granularity in DYNAMIC_GRANULARITIES

    @property
    def is_block_wise(self) -> bool:
        """Scales computed over a whole sealed block (not per token)."""
        return self.granularity == "per_block_channel"

    def groups(self, head_dim: int) -> int:
        """Number of dynamic scales per token and head (0 for static, block-wise and unquantized)."""
        if self.granularity == "per_token":
            return 1
        if self.granularity == "per_token_group":
            assert self.group_size is not None
            if head_dim % self.group_size:
                raise TrtkvError(
                    f"group size {self.group_size} does not divide head_dim {head_dim}",
                    "pick a group size that divides the model's head_dim",
                )
            return head_dim // self.group_size
        return 0

    @property
    def channel_widths(self) -> tuple[int, ...]:
        """The code widths a channel of an ``allocB`` format may take: ``CHANNEL_WIDTHS`` up to the dtype's bits."""
        return tuple(w for w in CHANNEL_WIDTHS if w <= self.traits.bits)

    def row_code_bits(self, head_dim: int) -> int:
        """Bits of one token row's codes (``allocB``: B per element, whatever the calibrated widths)."""
        if self.allocated_bits is None:
            return head_dim * self.traits.bits
        bits = self.allocated_bits * head_dim
        if bits != int(bits) or int(bits) % 8:
            fits = [n / 8 for n in range(1, 8 * self.traits.bits + 1) if n * head_dim % 64 == 0]  # eighths: exact decimals
            near = min(fits, key=lambda b: abs(b - self.allocated_bits)) if fits else None
            raise TrtkvError(f"alloc{self.allocated_bits:g} x head_dim {head_dim} is {bits:g} bits, not whole bytes per token row",
                             f"pick alloc bits whose product with {head_dim} is a multiple of 8" + (f" (e.g. alloc{near:g})" if near else ""))
        return int(bits)

    def check_head_dim(self, head_dim: int) -> None:
        """The one place that says whether this storage fits a head_dim: TrtkvError naming the rule, else None."""
        self.groups(head_dim)  # a group size must divide head_dim
        if self.allocated_bits is not None:
            self.row_code_bits(head_dim)
            return
        align = self.traits.row_align
        if head_dim % align:
            what = "two codes per byte and needs an even head_dim" if align == 2 else \
                f"{'bit planes ' + str(self.traits.planes) if len(self.traits.planes) > 1 else str(align) + ' codes per byte'} and needs a head_dim that is a multiple of {align}"
            raise TrtkvError(f"{self.dtype} packs {what}, got {head_dim}", "use int8 for this model")
        if head_dim % 2 and self.hadamard:
            raise TrtkvError(f"a Hadamard rotation needs an even head_dim, got {head_dim}", "drop the hadamard transform for this model")

    def packed_dim(self, head_dim):
        """Storage elements per token and head in a pool (the ``DTYPES`` row's packing: int4 D/2, int3 3D/8, int2 D/4;
        ``allocB``: B x D / 8 bytes)."""
        if self.allocated_bits is not None:
            return self.row_code_bits(head_dim) // 8
        return self.traits.packed_dim(head_dim)

    def scale_shape(self, lead: tuple, num_kv_heads, block_size, head_dim: int) -> tuple | None:
        """Shape of this format's dynamic scale (and zero-point) tensor after the ``lead`` axes, or None when it
        has none: per sealed block and channel ``[*lead, kv_heads, head_dim]``, per token (group)
        ``[*lead, kv_heads, block_size, groups]``. Dimensions other than ``head_dim`` may be symbolic."""
        if not self.is_dynamic:
            return None
        if self.is_block_wise:
            return (*lead, num_kv_heads, head_dim)
        return (*lead, num_kv_heads, block_size, self.groups(head_dim))

    def block_bits(self, block_size: int, head_dim: int) -> int:
        """Bits of one KV head's share of one pool block of ``block_size`` tokens: the codes, the dynamic scales and
        zero-points (``scale_shape``, ``SCALE_BITS`` each) and the outlier list (``outlier_shape``, ``OUTLIER_BITS`` per
        kept element). The one byte count: ``bits_per_element`` and ``PagedKVLayout``'s bytes per block are this over
        the block's elements / times the KV heads, and the layout allocates its tensors from the same shapes. A
        codebook (``nuq``) is a per-layer constant, not in the block (``KVFormat.constant_bytes``)."""
        bits = block_size * self.row_code_bits(head_dim)
        if (shape := self.scale_shape((), 1, block_size, head_dim)) is not None:
            bits += math.prod(shape) * SCALE_BITS * (1 if self.symmetric else 2)
        if (shape := self.outlier_shape((), 1)) is not None:
            bits += math.prod(shape) * OUTLIER_BITS
        return bits

    def bits_per_element(self, head_dim: int, block_size: int | None = None) -> float:
        """Storage bits per element, dynamic scales, zero-points and outlier lists included (block-wise: amortised over
        the block): ``block_bits`` over the block's elements (formats without sealed blocks: a one-token block)."""
        if (self.is_block_wise or self.outliers) and not block_size:
            raise ValueError(f"{self.short()} needs a block size (per_block_channel scales and outliers are per sealed block)")
        bs = block_size or 1
        return self.block_bits(bs, head_dim) / (bs * head_dim)

    def outlier_shape(self, lead: tuple, num_kv_heads) -> tuple | None:
        """Shape of this format's outlier values (fp16) and positions (int16) after the ``lead`` axes (one entry per
        sealed block): ``[*lead, kv_heads, outliers]``; None without outliers."""
        return (*lead, num_kv_heads, self.outliers) if self.outliers else None

    def check_block(self, block_size: int, head_dim: int) -> None:
        """Whether this format's outlier list fits a sealed block of ``block_size`` x ``head_dim``: TrtkvError, else None."""
        if not self.outliers:
            return
        n = block_size * head_dim
        if n > MAX_OUTLIER_POSITIONS:
            raise TrtkvError(f"outlier positions are int16, and a block of {block_size} x {head_dim} has {n} elements (at most {MAX_OUTLIER_POSITIONS})",
                             "use a smaller block size")
        if self.outliers >= n:
            raise TrtkvError(f"out{self.outliers} keeps at least every element of a block of {block_size} x {head_dim}", "keep ~1 % of a block's elements")

    @property
    def codebook_levels(self) -> int:
        """Entries of this format's codebook per layer and KV head (0 without ``nuq``)."""
        return 2**self.traits.bits if self.codebook else 0

    @property
    def code_bits(self) -> float:
        """Bits of one code, as the spec names them (``allocB``: B; else the dtype's): what ``recent=`` compares."""
        return self.allocated_bits if self.allocated_bits is not None else self.traits.bits

    def short(self) -> str:
        """Compact spec string, the inverse of ``parse_tensor_spec``."""
        if self.dtype == "fp16":
            return "fp16"
        gran = {"per_tensor": "tensor", "per_head": "head", "per_channel": "channel", "per_token": "token", "per_block_channel": "bchannel"}.get(
            self.granularity, f"g{self.group_size}"
        )
        parts = [self.dtype, gran, "sym" if self.symmetric else "asym"]
        smooth = "qsmooth" if self.smooth_by == "queries" else "smooth"
        parts += [t for t, on in (("prerope", self.pre_rope), (smooth, self.smooth), ("hadamard", self.hadamard), ("mse", self.mse),
                                  ("nuq", self.codebook)) if on]
        if self.allocated_bits is not None:
            parts.append(f"alloc{self.allocated_bits:g}")
        if self.outliers:
            parts.append(f"out{self.outliers}")
        return ":".join(parts)

    @property
    def code_symmetric(self) -> bool:
        """The symmetry the codec stores codes with: a codebook's codes are table indices 0 .. 2**bits - 1 (unsigned,
        no offset), whatever the scales' symmetry; static codes are symmetric."""
        return (self.symmetric or self.is_static) and not self.codebook


class LayerStorage(BaseModel):
    """One layer's K and V storage in a per-layer format (``KVFormat.layers``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    k: TensorFormat
    v: TensorFormat

    def short(self) -> str:
        return f"{self.k.short()}/{self.v.short()}"


class KVFormat(BaseModel):
    """A complete KV cache format: K and V storage plus cache-level options.

    ``layers`` (an accuracy budget's choice, ``trtkv calibrate --budget``): each layer's own K and V storage, with the
    format's block size and sink tokens; ``k`` / ``v`` are then layer 0's. ``layer(i)`` is layer ``i``'s format and
    every byte count sums over the layers, so a per-layer format travels wherever a format does; the paged cache keeps
    one pool group per distinct layer storage.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    k: TensorFormat
    v: TensorFormat
    # Sealed blocks: a sequence's newest tokens live in an fp16 open block of this many tokens, which is
    # quantized as a whole ("sealed") into the pool when it fills. None: every token is quantized on write.
    block_size: int | None = Field(default=None, ge=1)
    # Attention sinks: the first ``sink_tokens`` tokens of a sequence stay fp16 after its first block is sealed
    # (beside the open block, in the slot's tail), and that block is quantized with them replaced by token
    # ``sink_tokens`` so that their outlier keys neither lose precision nor stretch the block's ranges.
    sink_tokens: int = Field(default=0, ge=0, le=MAX_SINK_TOKENS)
    shared_kv_scale: bool = False  # one static scale for K and V together (TensorRT-LLM's convention)
    description: str = ""
    layers: tuple[LayerStorage, ...] = ()  # per-layer K / V storage; () = every layer stores k / v
    # Token age (spec field ``recent=R:FORMAT``): a sequence's newest ``recent_blocks`` sealed blocks are also kept in
    # the wider ``recent`` storage, in a ring of R blocks per sequence slot, and read from there; older sealed blocks are
    # read from the pool, where every block is sealed in ``k`` / ``v`` from its fp16 rows ("sealed twice").
    recent: LayerStorage | None = None
    recent_blocks: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> "KVFormat":
        if self.layers:
            if (self.k, self.v) != (self.layers[0].k, self.layers[0].v):
                raise ValueError("a per-layer format's k / v must be its layer 0's")
            if self.shared_kv_scale:
                raise ValueError("shared_kv_scale is per-tensor static: not for a per-layer format")
            for i, ls in enumerate(self.layers):
                if self.block_size is None and (ls.k.is_block_wise or ls.v.is_block_wise):
                    raise ValueError(f"layer {i}: per_block_channel (bchannel) scales need sealed blocks: add block=N")
        if any(f.v.smooth_by == "queries" for f in self.layer_formats()):
            raise ValueError("qsmooth balances keys against the queries that read them: it is for k=, not v=")
        if any(f.v.pre_rope for f in self.layer_formats()):
            raise ValueError("prerope is for keys (values are not rotated by RoPE): k=, not v=")
        if self.shared_kv_scale and not (self.k.is_static and self.v.is_static and self.k.granularity == self.v.granularity == "per_tensor"):
            raise ValueError("shared_kv_scale needs per_tensor static scales on both K and V")
        if self.block_size is None and (self.k.is_block_wise or self.v.is_block_wise):
            raise ValueError("per_block_channel (bchannel) scales need sealed blocks: add block=N (e.g. block=64)")
        if self.block_size is None and any(t.outliers for f in self.layer_formats() for t in (f.k, f.v)):
            raise ValueError("outN (outliers kept per sealed block) needs sealed blocks: add block=N (e.g. block=64)")
        if self.sink_tokens and (self.block_size is None or self.sink_tokens >= self.block_size):
            raise ValueError(f"sink={self.sink_tokens} needs sealed blocks of more than {self.sink_tokens} tokens: add block=N (e.g. block=64)")
        if self.recent is not None or self.recent_blocks:
            self._check_recent()
        return self

    def _check_recent(self) -> None:
        """The rules of a token-age format (``recent=R:FORMAT``), each a one-line ValueError."""
        if self.recent is None or self.recent_blocks < 1:
            raise ValueError(f"recent={self.recent_blocks} keeps no blocks: give recent=R:FORMAT with R >= 1 sealed blocks")
        if self.block_size is None:
            raise ValueError("recent=R counts sealed blocks: add block=N (e.g. block=64)")
        if self.layers:
            raise ValueError("recent=R with a per-layer format (layers=) is not supported: give one k= / v= storage")
        for side in ("k", "v"):
            wide: TensorFormat = getattr(self.recent, side)
            if calibrated := [w for w, on in (("static scales", wide.is_static), ("smoothing", wide.smooth), ("codebooks", wide.codebook),
                                              ("channel bits", wide.allocated_bits is not None)) if on]:
                raise ValueError(f"the recent {side}={wide.short()} needs a calibration ({', '.join(calibrated)}): recent blocks take a "
                                 "calibration-free format (fp16, int8, int4, or a calibration-free int3 / int2 spec)")
            if wide.pre_rope:
                raise ValueError(f"the recent k={wide.short()} keeps keys before RoPE (prerope), which recent blocks do not: drop prerope")
        k, v = self.recent.k, self.recent.v
        if k.code_bits < self.k.code_bits or v.code_bits < self.v.code_bits or (k.code_bits, v.code_bits) == (self.k.code_bits, self.v.code_bits):
            raise ValueError(f"recent={self.recent_blocks}:{self.recent.short()} is not wider than the base "
                             f"k={self.k.short()},v={self.v.short()} ({k.code_bits:g}/{v.code_bits:g} vs {self.k.code_bits:g}/{self.v.code_bits:g} "
                             "bits): give recent blocks more bits for K or V, and no fewer for either")

    @property
    def token_aged(self) -> bool:
        """A sequence's newest ``recent_blocks`` sealed blocks are read in the wider ``recent`` storage."""
        return self.recent is not None

    def recent_format(self) -> "KVFormat":
        """The recent blocks' own format: the ``recent`` K / V storage with this format's block size and sink tokens
        (what the ring of recent blocks is laid out, sealed and decoded with)."""
        if self.recent is None:
            raise ValueError(f"format {self.name} keeps no recent blocks")
        return KVFormat(name=f"{self.name}[recent]", k=self.recent.k, v=self.recent.v, block_size=self.block_size, sink_tokens=self.sink_tokens)

    def recent_bytes(self, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one sequence slot's ring of recent blocks, one layer, K and V (0 without ``recent=``)."""
        if self.recent is None:
            return 0
        bs = self.block_size
        return self.recent_blocks * num_kv_heads * (self.recent.k.block_bits(bs, head_dim) + self.recent.v.block_bits(bs, head_dim)) // 8

    def sealed_bits_per_element(self, head_dim: int, context_len: int | None = None) -> float:
        """Bits per K/V element of a sequence's sealed storage at ``context_len`` tokens: the pool's, plus a token-age
        format's ring of recent blocks (a fixed reserve per slot) over the context; ``None``: the long-context limit
        (the pool's). The one count of a token-age format's bits at a context."""
        pool = self.pool_bits_per_element(head_dim)
        if self.recent is None or context_len is None:
            return pool
        return pool + self.recent_bytes(1, head_dim) * 8 / (2 * head_dim * context_len)

    @property
    def is_per_layer(self) -> bool:
        return bool(self.layers)

    @property
    def num_layers(self) -> int | None:
        """Layers a per-layer format is for (None: any number)."""
        return len(self.layers) or None

    def layer(self, i: int) -> "KVFormat":
        """Layer ``i``'s format: this one, or, for a per-layer format, one with that layer's K / V storage."""
        if not self.layers:
            return self
        ls = self.layers[i]
        return KVFormat(name=f"{self.name}[{i}]", k=ls.k, v=ls.v, block_size=self.block_size, sink_tokens=self.sink_tokens)

    def check_layers(self, num_layers: int) -> None:
        """Refuse a per-layer format made for another number of layers."""
        if self.layers and len(self.layers) != num_layers:
            raise TrtkvError(f"KV format {self.name} has storage for {len(self.layers)} layers but the model has {num_layers}",
                             "calibrate this model with --budget (a per-layer choice is for one model)")

    def layer_formats(self) -> list["KVFormat"]:
        return [self.layer(i) for i in range(len(self.layers))] if self.layers else [self]

    @property
    def tail_rows(self) -> int:
        """fp16 rows a sequence slot holds per layer, K or V: the open block, then the sink tokens."""
        return (self.block_size or 0) + self.sink_tokens

    def with_block_size(self, block_size: int) -> "KVFormat":
        """This format with sealed blocks of ``block_size`` tokens (what a paged engine stores); sink tokens are
        capped at half a block, and outlier lists (``outN``, a count per block) keep their share of the block's
        elements, so that presets fit the small blocks of small models and keep their pool bits at any block size."""
        if self.block_size == block_size:
            return self
        base = self.name.split("@block")[0]
        d = self.model_dump()
        for storage in (d, *d["layers"]):
            for side in ("k", "v"):
                if storage[side]["outliers"] and self.block_size:
                    storage[side]["outliers"] = max(1, storage[side]["outliers"] * block_size // self.block_size)
        return KVFormat.model_validate({**d, "block_size": block_size, "name": f"{base}@block{block_size}",
                                        "sink_tokens": min(self.sink_tokens, block_size // 2)})

    @property
    def sealed(self) -> bool:
        """True when the newest block stays fp16 and blocks are quantized as a whole when they fill."""
        return self.block_size is not None

    @property
    def needs_calibration(self) -> bool:
        """Static scales, smoothing factors, codebooks or per-channel bits: constants ``trtkv calibrate`` makes."""
        return bool(calibrated_constants(self))

    def constant_bytes(self, num_layers: int, num_kv_heads: int) -> int:
        """Bytes of the per-layer constants the pools are read with that the format itself fixes, over ``num_layers``
        layers: the codebooks (``nuq``: 2**bits float32 levels per KV head, K and V apart). Static scales and smoothing
        factors are not counted (docs/kv-formats.md §6)."""
        self.check_layers(num_layers)
        return sum(num_kv_heads * t.codebook_levels * CODEBOOK_BITS // 8 for i in range(num_layers) for t in (self.layer(i).k, self.layer(i).v))

    @property
    def is_quantized(self) -> bool:
        return any(t.is_quantized for f in self.layer_formats() for t in (f.k, f.v))

    @property
    def needs_rope(self) -> bool:
        """Keys stored before RoPE (``prerope``): the cache needs each layer's RoPE table (``trtkv.rope.RopeTable.per_layer``)."""
        return any(f.k.pre_rope for f in self.layer_formats())

    def pool_bits_per_element(self, head_dim: int) -> float:
        """Bits per K/V element in the pool (sealed blocks), scales and zero-points included (a per-layer format:
        the mean over its layers, which all hold the same number of elements)."""
        per = [(f.k.bits_per_element(head_dim, self.block_size) + f.v.bits_per_element(head_dim, self.block_size)) / 2 for f in self.layer_formats()]
        return sum(per) / len(per)

    def bits_per_element(self, head_dim: int, context_len: int | None = None) -> float:
        """Mean storage bits per K/V element of one sequence of ``context_len`` tokens, its fp16 open block included.

        A sealed-block format reserves one fp16 block per sequence slot on top of the pool blocks of the
        tokens already sealed (and a token-age format its ring of recent blocks); those reserves are counted here.
        ``None``: the long-context limit (pool bits).
        """
        pool = self.pool_bits_per_element(head_dim)
        if self.block_size is None or context_len is None:
            return pool
        sealed = context_len - context_len % self.block_size
        ring = self.recent_bytes(1, head_dim) * 8 / (2 * head_dim)
        return (sealed * pool + ring + self.tail_rows * DTYPES["fp16"].bits) / context_len

    def kv_bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int, context_len: int | None = None) -> float:
        """Bytes of K and V cache per token over all layers, scales (and, at a context length, the open block) included."""
        elements = 2 * num_layers * num_kv_heads * head_dim
        return elements * self.bits_per_element(head_dim, context_len) / 8

    def tail_bytes(self, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one sequence slot's fp16 open block and sink rows, one layer, K or V: the one count the
        layout, the eval cache and ``tail_bytes_per_slot`` share; 0 without sealed blocks."""
        return num_kv_heads * self.tail_rows * head_dim * DTYPES["fp16"].bits // 8

    def tail_bytes_per_slot(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of the fp16 open blocks and sink rows (K and V, all layers) one sequence slot holds, and a token-age
        format's ring of recent blocks (``recent_bytes``): the fixed reserve per slot."""
        return num_layers * (2 * self.tail_bytes(num_kv_heads, head_dim) + self.recent_bytes(num_kv_heads, head_dim))

    def spec(self) -> str:
        out = f"k={self.k.short()},v={self.v.short()}"
        if self.block_size:
            out += f",block={self.block_size}"
        if self.sink_tokens:
            out += f",sink={self.sink_tokens}"
        if self.shared_kv_scale:
            out += ",shared"
        if self.layers:
            out += ",layers=" + "|".join(ls.short() for ls in self.layers)
        if self.recent is not None:
            out += f",recent={self.recent_blocks}:{self.recent.short()}"
        return out


def _t(dtype: str, granularity: str = "none", **kw) -> TensorFormat:
    return TensorFormat(dtype=dtype, granularity=granularity, **kw)


def _alike(name: str, t: TensorFormat, **kw) -> KVFormat:
    """A preset that stores K and V alike."""
    return KVFormat(name=name, k=t, v=t, **kw)


PRESETS: dict[str, KVFormat] = {
    p.name: p
    for p in [
        _alike("fp16", _t("fp16"), description="unquantized baseline"),
        _alike("fp8", _t("fp8_e4m3", "per_tensor"),
               description="fp8 e4m3, calibrated per-tensor k_scale / v_scale (what vLLM and TensorRT-LLM load as FP8 KV)"),
        _alike("int8-static", _t("int8", "per_tensor"), shared_kv_scale=True,
               description="int8, one calibrated scale per layer for K and V (what TensorRT-LLM loads as INT8 KV)"),
        KVFormat(name="int8", k=_t("int8", "per_block_channel"), v=_t("int8", "per_token"), block_size=64,
                 description="int8 in sealed blocks of 64 (8.25 bits): keys one fp16 scale per channel per block, values one "
                 "per token; the open block stays fp16; no calibration"),
        KVFormat(name="int4", k=_t("int4", "per_block_channel", symmetric=False, hadamard=True),
                 v=_t("int4", "per_token_group", group_size=32, hadamard=True), block_size=64, sink_tokens=4,
                 description="int4 in sealed blocks of 64 (4.5 bits): keys Hadamard-rotated, asymmetric per channel over each "
                 "block; values rotated, symmetric groups of 32; the open block and the first 4 tokens (attention sinks) stay "
                 "fp16; no calibration"),
        KVFormat(name="int3", k=_t("int8", "per_block_channel", symmetric=False, pre_rope=True, allocated_bits=3.5),
                 v=_t("int3", "per_token", hadamard=True, codebook=True), block_size=128, sink_tokens=4,
                 description="3.5 bits at head_dim 64, sealed blocks of 128: keys quantized before RoPE with each channel's "
                 "bits (0 to 8, 3.5 on average) allocated at calibration, asymmetric per channel over each block; values "
                 "Hadamard-rotated, symmetric per token through a calibrated codebook of 8 levels; needs trtkv calibrate"),
        KVFormat(name="int2", k=_t("int8", "per_block_channel", symmetric=False, pre_rope=True, allocated_bits=2.25, outliers=16),
                 v=_t("int2", "per_token", hadamard=True, codebook=True, outliers=48), block_size=128, sink_tokens=4,
                 description="2.5 bits at head_dim 64, sealed blocks of 128: keys quantized before RoPE with each channel's "
                 "bits (0 to 8, 2.25 on average) allocated at calibration, asymmetric per channel over each block, 16 "
                 "outliers per block and head kept exactly; values Hadamard-rotated, symmetric per token through a "
                 "calibrated codebook of 4 levels, 48 outliers per block and head; needs trtkv calibrate"),
    ]
}
assert tuple(PRESETS) == PRESET_NAMES, "trtkv.preset_names.PRESET_NAMES lists the presets (for --help without torch)"

# Outlier counts of a preset (``outN``) are per block and head at this head_dim; ``fit_format`` keeps their share of a
# block's elements at the model's head_dim (``int2``'s 16 / 48 become 32 / 96 at head_dim 128).
PRESET_HEAD_DIM = 64

# The calibration-free 3- and 2-bit layouts: keys Hadamard-rotated, asymmetric per channel over each block of 64; values
# rotated. Every engine path reads them (the ONNX step network, TensorRT-RTX, the TensorRT plugins), where the int3 / int2
# presets' per-channel key widths and codebooks are read by the torch engine only. Spec strings, not presets
# (docs/kv-formats.md).
CALIBRATION_FREE: dict[str, str] = {
    "int3": "k=int3:bchannel:asym:hadamard,v=int3:g32:sym:hadamard,block=64,sink=4",
    "int2": "k=int2:bchannel:asym:hadamard,v=int2:token:asym:hadamard,block=64,sink=4",
}

# Names that were presets (or --budget-formats sets) and what replaces each: ``get_format`` answers them with one line.
RETIRED: dict[str, tuple[str, str]] = {  # name -> (the preset or spec string to use, why)
    "int3-alloc": ("int3", "the int3 preset is this recipe"),
    "int2-alloc": ("int2", "the int2 preset is this recipe"),
    "int8-token": ("k=int8:token:sym,v=int8:token:sym", "every token quantized on write; the int8 preset keeps the newest block fp16"),
    "int4-token": ("k=int4:token:asym:smooth:hadamard,v=int4:token:asym:hadamard",
                   "every token quantized on write; the int4 preset keeps the newest block fp16"),
    "int4-g32": ("k=int4:g32:sym,v=int4:g32:sym", "llama.cpp q4_0-like groups; the int4 preset is more accurate"),
    "int4-b128": ("k=int4:bchannel:asym:hadamard,v=int4:g32:sym:hadamard,block=128,sink=4",
                  "the int4 layout in blocks of 128; --budget brings int4 to its other candidates' blocks itself"),
    "int3-qs": ("k=int3:bchannel:asym:qsmooth:hadamard,v=int3:g32:sym:hadamard,block=64,sink=4",
                "the int3 preset is more accurate at the same size"),
    "int2-qs": ("k=int2:bchannel:asym:qsmooth:hadamard,v=int2:token:asym:hadamard,block=64,sink=4",
                "the int2 preset is more accurate at the same size"),
    "int3-nuq": ("k=int3:bchannel:asym:prerope:qsmooth:hadamard:out128,v=int3:token:sym:hadamard:nuq,block=128,sink=4",
                 "the int3 preset is more accurate at the same size"),
    "int2-nuq": ("k=int2:bchannel:asym:prerope:qsmooth:hadamard:out64,v=int2:token:sym:hadamard:nuq,block=128,sink=4",
                 "the int2 preset is more accurate at about the same size"),
    "int3-nuq-kout64": ("k=int3:bchannel:asym:prerope:qsmooth:hadamard:out64,v=int3:token:sym:hadamard:nuq,block=128,sink=4",
                        "a --budget candidate beside int3-nuq; the default candidates are int4,int3,int2"),
    "int2-nuq-kout128": ("k=int2:bchannel:asym:prerope:qsmooth:hadamard:out128,v=int2:token:sym:hadamard:nuq,block=128,sink=4",
                         "a --budget candidate beside int2-nuq; the default candidates are int4,int3,int2"),
    "nuq": ("int4,int3,int2", "a --budget-formats set; the default candidates int4,int3,int2 were measured better"),
    "alloc": ("int4,int3,int2", "a --budget-formats set; it is now the default candidates int4,int3,int2"),
}
assert not set(RETIRED) & set(PRESETS)


def retired_error(name: str) -> TrtkvError:
    """The one line a retired preset or set name answers with: what replaces it, and why."""
    use, why = RETIRED[name]
    return TrtkvError(f"KV format name {name!r} was retired ({why})", f"use '{use}' instead")


_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "e4m3": "fp8_e4m3"}
_GRAN_WORDS = {"tensor": "per_tensor", "head": "per_head", "channel": "per_channel", "token": "per_token", "bchannel": "per_block_channel"}
SPEC_HELP = ("use a preset (" + ", ".join(PRESETS) + "), the name a calibration saved (--budget), a JSON file, or a spec string "
             "'k=int4:bchannel:asym,v=int4:token:asym:hadamard[,block=N][,sink=N][,shared][,recent=R:FORMAT]' (docs/kv-formats.md)")


def calibration_needed(fmts: Sequence[KVFormat], model: str | None = None) -> TrtkvError:
    """The one line formats that need calibrated constants answer with when they are given none: what each calibrates,
    and the command that makes them."""
    what = "; ".join((f"{f.name}: " if len(fmts) > 1 else "") + ", ".join(calibrated_constants(f)) for f in fmts)
    kv = " ".join(f"--kv {f.name if f.name in PRESETS else repr(f.spec())}" for f in fmts)
    cmd = "trtkv calibrate" + (f" --model {model}" if model else "") + f" {kv} --out DIR"
    names = ", ".join(f.name for f in fmts)
    return TrtkvError(f"KV format{'s' if len(fmts) > 1 else ''} {names} need{'' if len(fmts) > 1 else 's'} a calibration ({what})",
                      f"run `{cmd}` and pass --calibration DIR")


def calibrated_constants(fmt: KVFormat) -> list[str]:
    """What calibration sets for ``fmt`` (empty: it needs none): static scales, and per side its smoothing factors,
    codebooks and per-channel bits. ``KVFormat.needs_calibration`` is this being non-empty."""
    what = ["scales"] if any(t.is_static for f in fmt.layer_formats() for t in (f.k, f.v)) else []
    for side in ("k", "v"):
        ts = [getattr(f, side) for f in fmt.layer_formats()]
        what += [f"{side.upper()} {word}" for word, on in (("smoothing", any(t.smooth for t in ts)), ("codebooks", any(t.codebook for t in ts)),
                                                           ("channel bits", any(t.allocated_bits is not None for t in ts))) if on]
    return what


def parse_tensor_spec(text: str) -> TensorFormat:
    """Parse ``dtype[:granularity][:sym|asym][:prerope][:smooth|qsmooth][:hadamard][:mse][:nuq][:allocB][:outN]`` (granularity: tensor|head|channel|token|gN|bchannel).

    Each field is given at most once: two granularities, two symmetries or a repeated word are errors.
    """
    parts = [p.strip() for p in text.split(":") if p.strip()]
    if not parts:
        raise ValueError("empty tensor spec")
    fields: dict = {"dtype": _DTYPE_ALIASES.get(parts[0], parts[0])}
    seen: dict[str, str] = {}  # field -> the word that set it
    for word in parts[1:]:
        if word in _GRAN_WORDS or re.fullmatch(r"g\d+", word):
            field = "granularity"
        elif word in ("sym", "asym"):
            field = "symmetry"
        elif word in ("smooth", "qsmooth"):
            field = "smooth"
        elif word in ("hadamard", "mse", "nuq", "prerope"):
            field = word
        elif re.fullmatch(r"out\d+", word):
            field = "outliers"
        elif re.fullmatch(r"alloc\d+(?:\.\d+)?", word):
            field = "alloc"
        else:
            raise ValueError(f"unknown word {word!r}")
        if field in seen:
            what = f"repeated word {word!r}" if seen[field] == word else f"conflicting {field} words {seen[field]!r} and {word!r}"
            raise ValueError(f"{what} in {text.strip()!r}: give one")
        seen[field] = word
        if word in _GRAN_WORDS:
            fields["granularity"] = _GRAN_WORDS[word]
        elif field == "granularity":
            fields["granularity"], fields["group_size"] = "per_token_group", int(word[1:])
        elif field == "symmetry":
            fields["symmetric"] = word == "sym"
        elif field == "outliers":
            fields["outliers"] = int(word[3:])
        elif field == "alloc":
            fields["allocated_bits"] = float(word[5:])
        elif word == "nuq":
            fields["codebook"] = True
        elif word == "qsmooth":
            fields["smooth"], fields["smooth_by"] = True, "queries"
        elif word == "prerope":
            fields["pre_rope"] = True
        else:
            fields[word] = True
    return TensorFormat(**fields)


def split_specs(text: str) -> list[str]:
    """The formats of a comma-separated list of ``--kv`` values: each a preset, a name or a ``k=...`` spec, with the
    ``field=value`` items after it (``int4,int2,recent=3:int4`` is int4 and the token-age ``int2,recent=3:int4``)."""
    out: list[str] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if out and "=" in item and not item.startswith("k="):
            out[-1] += "," + item
        else:
            out.append(item)
    return out


def parse_recent(text: str) -> tuple[int, LayerStorage]:
    """``R:FORMAT`` of a spec's ``recent=`` field: R sealed blocks, FORMAT a preset name (its K / V storage) or
    ``k_spec/v_spec`` (each may be written ``k=`` / ``v=`` as well)."""
    count, _, fmt = text.partition(":")
    if not count.strip().isdigit() or not fmt.strip():
        raise ValueError(f"recent={text!r}: give recent=R:FORMAT, R sealed blocks and a preset or k_spec/v_spec (e.g. recent=3:int4)")
    fmt = fmt.strip()
    if fmt in PRESETS:
        return int(count), LayerStorage(k=PRESETS[fmt].k, v=PRESETS[fmt].v)
    if "/" not in fmt:
        raise ValueError(f"recent={text!r}: {fmt!r} is neither a preset nor k_spec/v_spec (e.g. recent=3:int4)")
    ks, _, vs = fmt.partition("/")
    return int(count), LayerStorage(k=parse_tensor_spec(ks.strip().removeprefix("k=")), v=parse_tensor_spec(vs.strip().removeprefix("v=")))


def get_format(spec: str | KVFormat) -> KVFormat:
    """Resolve a preset, a JSON file or an inline spec string to a validated format (a retired preset name: the one-line
    error naming its replacement)."""
    if isinstance(spec, KVFormat):
        return spec
    try:
        if spec in PRESETS:
            return PRESETS[spec]
        if spec in RETIRED:
            raise retired_error(spec)
        if spec.endswith(".json"):
            path = Path(spec)
            if not path.is_file():
                raise TrtkvError(f"KV format file {spec} does not exist", SPEC_HELP)
            return KVFormat.model_validate(json.loads(path.read_text()))
        text = spec
        head, _, rest = spec.partition(",")
        if head.strip() in PRESETS and rest:  # a preset with more fields ("int2,recent=3:int4"): its spec string, then them
            text = PRESETS[head.strip()].spec() + "," + rest
        keys = [item.partition("=")[0].strip() for item in text.split(",")]
        if "k" not in keys and "v" not in keys:
            raise TrtkvError(f"unknown KV format {spec!r}", SPEC_HELP)
        for need in ("k", "v"):
            if need not in keys:
                raise TrtkvError(f"KV format {spec!r} is missing {need}=", f"add {need}=<dtype>:<granularity> (both k= and v= are required), e.g. '{spec},{need}=int8:token'")
        fields: dict = {"name": spec}
        seen: dict[str, str] = {}
        for item in text.split(","):
            key, _, value = item.partition("=")
            key = key.strip()
            if key in seen:
                raise ValueError(f"repeated field {seen[key]!r} and {item.strip()!r}: give {key} once")
            seen[key] = item.strip()
            if key in ("k", "v"):
                fields[key] = parse_tensor_spec(value)
            elif key == "block":
                fields["block_size"] = int(value)
            elif key == "sink":
                fields["sink_tokens"] = int(value)
            elif key == "shared" and not value:
                fields["shared_kv_scale"] = True
            elif key == "layers":  # k_spec/v_spec per layer, separated by |; the name says how many, not each
                fields["layers"] = tuple(LayerStorage(k=parse_tensor_spec(ks), v=parse_tensor_spec(vs))
                                         for ks, _, vs in (item.partition("/") for item in value.split("|")))
                fields["name"] = f"{spec.partition(',layers=')[0]},layers=<{len(fields['layers'])} layers>"
            elif key == "recent":
                fields["recent_blocks"], fields["recent"] = parse_recent(value)
            else:
                raise ValueError(f"unknown field {key!r}")
        return KVFormat(**fields)
    except TrtkvError:
        raise
    except (ValidationError, ValueError, json.JSONDecodeError) as exc:
        raise TrtkvError(f"invalid KV format {spec!r}: {_reason(exc)}", SPEC_HELP) from None


def _reason(exc: Exception) -> str:
    """One line naming the offending field and value (pydantic's bare message names neither)."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    err = exc.errors()[0]
    msg = err["msg"].removeprefix("Value error, ")
    loc = ".".join(str(p) for p in err["loc"])
    if not loc:
        return msg
    got = "" if err["type"] == "missing" or isinstance(err["input"], dict) else f" (got {err['input']!r})"
    return f"{loc}: {msg}{got}"


# --------------------------------------------------------------------------- fitting a format to a model


def fit_format(fmt: KVFormat, head_dim: int) -> tuple[KVFormat | None, str | None]:
    """Fit ``fmt`` to a model's ``head_dim``: ``(format, note)``, or ``(None, why)`` when it cannot fit.

    A group size that does not divide ``head_dim`` becomes the largest divisor of ``head_dim`` below it
    (``g64`` -> ``g32`` at 32, ``g48`` at 48, ``g40`` at 80); per-channel bits (``allocB``) that do not fill whole bytes
    per token row become the most that do (``alloc2.25`` -> ``alloc2`` at 24); a preset's outlier counts keep their share of
    a block's elements (they are written for ``PRESET_HEAD_DIM``: ``out16`` -> ``out32`` at 128), in multiples of
    ``OUTLIER_MULTIPLE``, never fewer than one multiple. Hadamard rotations use blocks of the largest
    power of two dividing ``head_dim`` (``trtkv.quant.hadamard_matrix``); the note says so when that is
    smaller than ``head_dim``. Anything else ``TensorFormat.check_head_dim`` rejects (int4 packing and
    Hadamard rotations need an even ``head_dim``) cannot fit: its problem is the note.
    """
    changes, parts = [], {}
    preset = PRESETS.get(fmt.name) == fmt
    for side in ("k", "v"):
        tf: TensorFormat = getattr(fmt, side)
        n = tf.outliers
        if preset and n and head_dim != PRESET_HEAD_DIM:
            fit_n = max(OUTLIER_MULTIPLE, n * head_dim // PRESET_HEAD_DIM // OUTLIER_MULTIPLE * OUTLIER_MULTIPLE)
            if fit_n != n:
                tf = parts[side] = tf.model_copy(update={"outliers": fit_n})
                changes.append(f"{side.upper()} out{n}->out{fit_n}")
        g = tf.group_size
        if g is not None and head_dim % g:
            fit = max((d for d in range(2, min(g, head_dim) + 1) if head_dim % d == 0), default=None)
            if fit is None:
                return None, f"{fmt.name}: no group size from 2 to {g} divides head_dim {head_dim}"
            tf = parts[side] = tf.model_copy(update={"group_size": fit})
            changes.append(f"{side.upper()} g{g}->g{fit}")
        b = tf.allocated_bits
        if b is not None and (b * head_dim) % 8:  # whole bytes per token row: the most bits that are, never more
            fit_bits = math.floor(b * head_dim / 8) * 8 / head_dim
            if fit_bits <= 0:
                return None, f"{fmt.name}: alloc{b:g} x head_dim {head_dim} is less than a byte per token row"
            tf = parts[side] = tf.model_copy(update={"allocated_bits": fit_bits})
            changes.append(f"{side.upper()} alloc{b:g}->alloc{fit_bits:g}")
        try:
            tf.check_head_dim(head_dim)
        except TrtkvError as e:
            return None, f"{fmt.name}: {e.problem}"
    block = head_dim & -head_dim
    rotated = [s.upper() for s in ("k", "v") if getattr(fmt, s).hadamard]
    if rotated and block < head_dim:
        changes.append(f"Hadamard blocks of {block}")
    if not changes:
        return fmt, None
    note = f"{fmt.name} at head_dim {head_dim}: " + ", ".join(changes)
    if parts:
        fmt = fmt.model_copy(update={**parts, "description": (fmt.description + f" [fitted to head_dim {head_dim}]").strip()})
    return fmt, note


def _fit_hint(fmt: KVFormat, head_dim: int) -> str:
    """The fix for a format that does not fit ``head_dim``: the alignment rules it breaks (int4 2, int2 4, int3 8;
    Hadamard: even), read from the ``DTYPES`` rows."""
    rules = {}
    for f in fmt.layer_formats():
        for t in (f.k, f.v):
            if head_dim % t.traits.row_align:
                rules[t.dtype] = f"{t.dtype} needs a head_dim that is a multiple of {t.traits.row_align}"
            if t.hadamard and head_dim % 2:
                rules["hadamard"] = "hadamard needs an even head_dim"
    why = f" ({'; '.join(rules.values())})" if rules else ""
    return f"choose a format that fits head_dim {head_dim}{why}, e.g. the int8 or fp8 preset"


def fit_formats(specs: list[str | KVFormat], head_dim: int, *, optional: bool = False) -> tuple[list[KVFormat], list[str]]:
    """Resolve ``specs`` for a model of ``head_dim``: ``(formats, one-line notes)``.

    Presets (and, with ``optional``, every format: the defaults) are fitted with ``fit_format``; a
    format that cannot fit is skipped with a note when ``optional``, else it is an error. A spec the
    user wrote out keeps its group size: one that does not divide ``head_dim`` is an error naming
    the group sizes that do.
    """
    out, notes = [], []
    for spec in specs:
        fmt = get_format(spec)
        preset = PRESETS.get(fmt.name) == fmt
        if not (preset or optional):
            for t in (fmt.k, fmt.v):  # the bits per channel the user wrote must fill whole bytes as written
                t.row_code_bits(head_dim)
            bad = [t.group_size for t in (fmt.k, fmt.v) if t.group_size and head_dim % t.group_size]
            if bad:
                divisors = [str(d) for d in range(2, head_dim + 1) if head_dim % d == 0 and d <= max(bad)]
                raise TrtkvError(
                    f"KV format {fmt.name!r}: group size {bad[0]} does not divide the model's head_dim {head_dim}",
                    f"use a group size that divides {head_dim} (g{', g'.join(divisors[-3:]) if divisors else head_dim}), or a preset",
                )
        fitted, note = fit_format(fmt, head_dim)
        if fitted is None:
            if optional:
                notes.append(f"skipped {note}")
                continue
            raise TrtkvError(f"KV format {note}", _fit_hint(fmt, head_dim))
        if note:
            notes.append(note)
        out.append(fitted)
    return out, notes
