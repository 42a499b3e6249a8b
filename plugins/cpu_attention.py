"""trtkv's CPU attention kernels (``cpu_attention.c``): the sealed blocks read straight from the pools.

The torch engine's attention on CPU spends its time on the many small tensor ops that gather, unpack and dequantize
the sealed blocks of every sequence (``trtkv.attention.torch_ops.context_kv``): a few per layer, each a pass over
the batch's whole context. These C functions walk each sequence's block table instead and decode each row once, by
the storage dtype's own lookup tables (``DtypeTraits.plane_tables`` / ``byte_table``: one definition of every codec)
and the format's scale granularity:

* ``decode``: one new token per sequence, the whole attention in one call (decode steps);
* ``dequant``: the sealed rows as float32 ``[B, H, rows, D]`` (stored channel space), with room after them for the
  rows the caller adds, for one fused torch attention (prefill steps).

Every calibrated storage feature is read: codebooks (``nuq``), outlier lists (``outN``: the pools' ``outlier_index`` /
``outlier_value``) and keys stored before RoPE (``prerope``: brought back to model space with the layer's RoPE table,
which ``DecodeStep`` / ``dequant`` take as ``rope``; the decode then scores them with the model-space query).

The library is compiled on first use with the machine's C compiler (``$CC``, else ``cc``; C11 with ``_Float16``: gcc
12+ or clang 15+) for this CPU (``-march=native``) and cached under ``~/.cache/trtkv/cpu-kernels`` by a hash of the
source, the flags, the compiler and the CPU; ``unavailable()`` says why it cannot be used (then the torch ops run).
With OpenMP (``-fopenmp``; else it is built without, and decodes on one thread) a decode call splits its sequences
and heads over the step's torch threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from trtkv.cache_dir import cache_root
from trtkv.errors import TrtkvError
from trtkv.formats import channel_offsets
from trtkv.quant import QuantizedTensor, codebook_of, hadamard_matrix, non_finite, per_channel, widths_of

from .contract.capabilities import CPU_KERNELS, CPU_SEAL, LACKS_HINT

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast")
LIBS = ("-lm",)
OPENMP = ("-fopenmp",)  # the decode's threads (torch's libgomp, already loaded); a compiler without it builds a one-thread library
MAX_PLANES = 4  # as in the C source
MAX_HEAD_DIM = CPU_KERNELS.head_dim_max  # the C source's MAX_HEAD_DIM
KIND_FP16, KIND_LUT, KIND_CHANNELS = 0, 1, 2
GRAN = {"none": 0, "per_tensor": 1, "per_head": 1, "per_channel": 1, "per_token": 2, "per_token_group": 2, "per_block_channel": 3}

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Fmt(ctypes.Structure):
    _fields_ = [("kind", _i64), ("head_dim", _i64), ("block_size", _i64), ("num_heads", _i64), ("row_bytes", _i64),
                ("n_planes", _i64), ("byte_off", _i64 * MAX_PLANES), ("per", _i64 * MAX_PLANES), ("table", _ptr * MAX_PLANES),
                ("linear", _i64), ("width", _i64 * MAX_PLANES), ("low", _i64 * MAX_PLANES), ("signed_bytes", _i64), ("offset", ctypes.c_float),
                ("gran", _i64), ("groups", _i64), ("static_scale", _ptr), ("smooth", _ptr), ("rot", _ptr),
                ("codebook", _ptr), ("levels", _i64), ("codebook_heads", _i64), ("outliers", _i64), ("pre_rope", _i64),
                ("chan_off", _ptr), ("chan_mask", _ptr)]


class _Ctx(ctypes.Structure):
    _fields_ = [("data", _ptr), ("scale", _ptr), ("zero", _ptr), ("tables", _ptr), ("cols", _i64), ("held", _ptr),
                ("batch", _i64), ("nb", _i64), ("sink", _ptr), ("sink_ok", _ptr), ("sink_tokens", _i64), ("oidx", _ptr), ("oval", _ptr),
             ("rope_cos", _ptr), ("rope_sin", _ptr), ("rope_rows", _i64), ("rope_stride", _i64), ("rope_hoff", _i64), ("first_pos", _ptr)]


class _Decode(ctypes.Structure):
    _fields_ = [("n", _i64), ("q", _ptr), ("qf", _ptr), ("new_k", _ptr), ("new_v", _ptr), ("k_tail", _ptr), ("v_tail", _ptr),
                ("tail_rows", _i64), ("slot", _ptr), ("open_len", _ptr), ("q_pos", _ptr), ("first_pos", _ptr), ("open_pos", _ptr),
                ("sink_tokens", _i64), ("sink_ok", _ptr), ("window", _i64), ("scaling", ctypes.c_float), ("softcap", ctypes.c_float), ("out_sealed", _ptr), ("out_rest", _ptr),
                ("model_space", _i64), ("threads", _i64)]


class _SealFmt(ctypes.Structure):
    _fields_ = [("head_dim", _i64), ("block_size", _i64), ("num_heads", _i64), ("block_wise", _i64), ("groups", _i64), ("symmetric", _i64),
                ("sym_min", ctypes.c_float), ("sym_max", ctypes.c_float), ("asym_max", ctypes.c_float), ("offset", _i64), ("row_bytes", _i64),
                ("n_planes", _i64), ("byte_off", _i64 * MAX_PLANES), ("width", _i64 * MAX_PLANES), ("low", _i64 * MAX_PLANES),
                ("signed_bytes", _i64), ("clip", _ptr)]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    flags = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    model = next((line for line in text.splitlines() if line.startswith("model name")), "")
    return model + flags


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | str:
    """The compiled library, or the one-line reason it cannot be had."""
    if os.environ.get("TRTKV_CPU_KERNELS", "1") == "0":
        return "TRTKV_CPU_KERNELS=0"
    cc = _compiler()
    if cc is None:
        return "no C compiler (cc, gcc or clang; set $CC)"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{cc} --version failed: {exc}"
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS + LIBS + OPENMP), version, _cpu_id()]).encode()).hexdigest()[:16]
    out = cache_root() / "cpu-kernels" / f"cpu_attention-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # compiled aside, then renamed: no half-written library
            built = Path(tmp) / out.name
            for extra in (OPENMP, ()):
                try:
                    proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(built), *LIBS, *extra], capture_output=True, text=True, timeout=300)
                except (OSError, subprocess.SubprocessError) as exc:
                    return f"compiling {SOURCE.name} failed: {exc}"
                if proc.returncode == 0:
                    break
            if proc.returncode != 0:
                first = next((line for line in proc.stderr.splitlines() if "error" in line), proc.stderr.strip()[:200])
                return f"compiling {SOURCE.name} with {cc} failed: {first}"
            os.replace(built, out)
    lib = ctypes.CDLL(str(out))
    lib.trtkv_decode.argtypes = [ctypes.POINTER(_Fmt), ctypes.POINTER(_Fmt), ctypes.POINTER(_Ctx), ctypes.POINTER(_Ctx), ctypes.POINTER(_Decode)]
    lib.trtkv_decode.restype = _i64
    lib.trtkv_dequant.argtypes = [ctypes.POINTER(_Fmt), ctypes.POINTER(_Ctx), _ptr, _i64, _i64]
    lib.trtkv_dequant.restype = _i64
    lib.trtkv_seal.argtypes = [ctypes.POINTER(_SealFmt), _ptr, _i64, _ptr, _ptr, _ptr, _i64]
    lib.trtkv_seal.restype = _i64
    return lib


def unavailable() -> str | None:
    """Why the CPU kernels cannot run on this machine (None: they can)."""
    lib = _library()
    return lib if isinstance(lib, str) else None


def library() -> ctypes.CDLL:
    lib = _library()
    if isinstance(lib, str):
        raise TrtkvError(f"trtkv's CPU attention kernels are unavailable: {lib}", "install a C compiler (gcc 12+), or use the torch ops (--attention torch)")
    return lib


@dataclass
class RowCodec:
    """One layer's K or V storage as the kernels read it: the C struct and the tensors it points into (kept alive)."""

    fmt: _Fmt
    keep: tuple

    @property
    def ref(self):
        return ctypes.byref(self.fmt)

    @classmethod
    def of(cls, tf, params, num_heads: int, head_dim: int, block_size: int) -> "RowCodec":
        """For ``TensorFormat`` ``tf`` with its calibrated ``TensorParams`` (static scale) at these sizes."""
        if head_dim > MAX_HEAD_DIM:
            raise TrtkvError(f"head_dim {head_dim} exceeds the CPU kernels' {MAX_HEAD_DIM}", "use the torch ops (--attention torch)")
        if lacks := CPU_KERNELS.lacks(tf):  # the capability table's ``cpu`` row
            raise TrtkvError(f"{tf.short()} keeps {' and '.join(lacks)}, which the {CPU_KERNELS.title} do not read yet", LACKS_HINT)
        traits = tf.traits
        f = _Fmt(head_dim=head_dim, block_size=block_size, num_heads=num_heads, gran=GRAN[tf.granularity])
        keep: list[torch.Tensor] = []
        if not tf.is_quantized:
            f.kind, f.row_bytes = KIND_FP16, head_dim * 2
        elif tf.allocated_bits is not None:  # allocB: each channel's code at its own offset and width (formats.channel_offsets)
            widths = widths_of(tf, params, num_heads)  # the reference's own check: one line when there are none
            offsets = channel_offsets(widths).to(torch.int32).contiguous()
            masks = ((1 << widths) - 1).to(torch.int32).contiguous()
            keep += [offsets, masks]
            f.kind, f.row_bytes, f.chan_off, f.chan_mask = KIND_CHANNELS, tf.packed_dim(head_dim), offsets.data_ptr(), masks.data_ptr()
        else:
            sym = tf.code_symmetric  # how the codes are stored (a codebook's are unsigned table indices)
            f.kind, f.row_bytes = KIND_LUT, traits.packed_dim(head_dim) * traits.storage.itemsize
            if traits.packed:
                planes = [(byte, width, low, table) for (byte, width, low), table in zip(traits.plane_layout(head_dim), traits.plane_tables(sym))]
            else:
                planes = [(0, 8, 0, traits.byte_table(sym))]
            f.n_planes = len(planes)
            for p, (byte, width, low, table) in enumerate(planes):
                table = table.float().contiguous()
                keep.append(table)
                f.byte_off[p], f.per[p], f.table[p], f.width[p], f.low[p] = byte, 8 // width, table.data_ptr(), width, low
            # integer codes decode by shifts, where the shifts give the lookup tables' values exactly (else by lookups)
            f.offset = float(traits.offset(sym))
            f.signed_bytes = int(not traits.packed and traits.storage_for(sym) == torch.int8)
            f.linear = int(traits.is_int and all(torch.equal(table.float(), _linear_table(width, low, f.offset if p == 0 else 0.0, f.signed_bytes))
                                                 for p, (_, width, low, table) in enumerate(planes)))
            if tf.is_static:
                scale = per_channel(params.scale, num_heads, head_dim, "static scale")
                keep.append(scale)
                f.static_scale = scale.data_ptr()
            elif not tf.is_block_wise:
                f.groups = tf.groups(head_dim)
            if tf.codebook:  # nuq: the layer's table, [levels] or [H, levels]
                book = codebook(tf, params, num_heads)
                keep.append(book)
                f.codebook, f.levels, f.codebook_heads = book.data_ptr(), tf.codebook_levels, book.shape[0]
        f.outliers, f.pre_rope = tf.outliers or 0, int(tf.pre_rope)
        if tf.smooth:  # the transforms, for decode_model_space and keys stored before RoPE (else reads stay in stored space)
            if params is None or params.smooth is None:
                raise TrtkvError(f"{tf.short()} smooths its channels but no smoothing factors were given",
                                 "pass the calibration made with this format (`trtkv calibrate --kv ...`)")
            smooth = per_channel(params.smooth, num_heads, head_dim, "smoothing factors")
            keep.append(smooth)
            f.smooth = smooth.data_ptr()
        if tf.hadamard:
            tf.check_head_dim(head_dim)
            rot = hadamard_matrix(head_dim).float().contiguous()
            keep.append(rot)
            f.rot = rot.data_ptr()
        return cls(f, tuple(keep))


def codebook(tf, params, num_heads: int) -> torch.Tensor:
    """A ``nuq`` format's calibrated levels as the kernels read them: float32 ``[1 or H, 2**bits]``, checked."""
    given = codebook_of(tf, params)  # the reference's own check: one line when there is none
    book = given.float().reshape(-1, given.shape[-1]).contiguous()
    if book.shape[-1] != tf.codebook_levels or book.shape[0] not in (1, num_heads):
        raise TrtkvError(f"a codebook of shape {tuple(given.shape)} for {tf.short()} (wants [{tf.codebook_levels}] or "
                         f"[{num_heads}, {tf.codebook_levels}])", "recalibrate with this format and model")
    return book


def _linear_table(width: int, low: int, offset: float, signed: bool) -> torch.Tensor:
    """What byte v of a plane of ``width``-bit fields holds, as the shift decoder computes it: [256, 8 / width]."""
    v = torch.arange(256, dtype=torch.int64)
    if signed:
        return (v.to(torch.uint8).view(torch.int8).float() - offset)[:, None]
    fields = (v[:, None] >> (torch.arange(8 // width) * width)) & ((1 << width) - 1)
    return (fields << low).float() - offset


def _p(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _rope(rope) -> tuple:
    """A RoPE table ``(cos, sin)`` [P, D] as the kernels read it: ``(cos, sin, stride, hoff)``, float32 and contiguous,
    channel d < D / 2 of row p at ``p * stride + d`` and channel D / 2 + d at ``p * stride + hoff + d``. Where both
    tables' halves are equal -- the rotate-half layout of every supported model (its angles concatenated twice) -- the
    first halves alone (stride D / 2, hoff 0: half the table read per key row); else whole rows (stride D, hoff D / 2).
    (None, None, 0, 0) without a table."""
    if rope is None:
        return None, None, 0, 0
    # every step asks for the engine's tables, one per kind of layer (RopeTable.upto, which makes a new one to grow, never
    # changing one in place; its tensors are inference tensors, which keep no version counter): read once per table object
    for seen, read in _ROPE_READ:
        if all(a is b for a, b in zip(seen, rope)):
            return read
    cos, sin = (t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous() for t in rope)
    half = cos.shape[-1] // 2
    if cos.shape[-1] % 2 == 0 and all(torch.equal(t[:, :half], t[:, half:]) for t in (cos, sin)):
        read = (cos[:, :half].contiguous(), sin[:, :half].contiguous(), half, 0)
    else:
        read = (cos, sin, cos.shape[-1], half)
    _ROPE_READ[:] = [(tuple(rope), read), *_ROPE_READ[: _ROPE_TABLES - 1]]
    return read


_ROPE_TABLES = 4  # tables _rope remembers: a model's kinds of layer (Gemma 3: local and global) and a grown copy
_ROPE_READ: list = []  # the last tables _rope was given, newest first, and how the kernels read each


def _ctx(pool, tables: torch.Tensor, held: torch.Tensor, nb: int, sink: torch.Tensor | None, sink_ok: torch.Tensor | None,
         first_pos: torch.Tensor | None = None, rope=None) -> tuple[_Ctx, tuple]:
    for name, t in (("data", pool.data), ("scale", pool.scale), ("zero", pool.zero), ("outlier_index", pool.outlier_index),
                    ("outlier_value", pool.outlier_value)):
        if t is not None and (t.device.type != "cpu" or not t.is_contiguous()):
            raise TrtkvError(f"the CPU kernels read contiguous CPU pools; pool {name} is not", "allocate the cache with PagedKVLayout.allocate")
    tables = tables.to(torch.int64).contiguous()
    held = held.to(torch.int64).contiguous()
    sink = None if sink is None else sink.float().contiguous()
    sink_ok = None if sink_ok is None else sink_ok.to(torch.uint8).contiguous()
    first_pos = None if first_pos is None else first_pos.to(torch.int64).contiguous()
    cos, sin, stride, hoff = _rope(rope)
    c = _Ctx(data=_p(pool.data), scale=_p(pool.scale), zero=_p(pool.zero), tables=_p(tables), cols=tables.shape[1], held=_p(held),
             batch=tables.shape[0], nb=nb, sink=_p(sink), sink_ok=_p(sink_ok), sink_tokens=0 if sink is None else sink.shape[2],
             oidx=_p(pool.outlier_index), oval=_p(pool.outlier_value), rope_cos=_p(cos), rope_sin=_p(sin),
             rope_rows=0 if cos is None else cos.shape[0], rope_stride=stride, rope_hoff=hoff, first_pos=_p(first_pos))
    return c, (tables, held, sink, sink_ok, first_pos, cos, sin)


def _need_rope(codec: RowCodec, ctx: _Ctx) -> None:
    """Keys stored before RoPE read the layer's table at every sealed row's position: one line when it is not there."""
    f = codec.fmt
    if not f.pre_rope:
        return
    if not ctx.rope_cos or not ctx.first_pos:
        raise TrtkvError("keys stored before RoPE (prerope) need the layer's RoPE table and the blocks' positions",
                         "pass rope=RopeTable.upto(...) and first_pos (the torch engine does)")
    first = (ctypes.c_int64 * ctx.batch).from_address(ctx.first_pos)
    held = (ctypes.c_int64 * ctx.batch).from_address(ctx.held)
    last = max((first[b] + min(held[b], ctx.nb) * f.block_size for b in range(ctx.batch) if held[b] > 0), default=0)
    if last > ctx.rope_rows:
        raise TrtkvError(f"the RoPE table covers positions below {ctx.rope_rows}, the sealed keys reach {last - 1}",
                         "pass a table of every position read (RopeTable.upto)")


def _check(rc: int) -> None:
    if rc != 0:
        raise TrtkvError("trtkv's CPU attention kernel refused its arguments", "report this as a bug")


def dequant(codec: RowCodec, pool, tables, held, nb: int, sink=None, sink_ok=None, rows: int | None = None, first_pos=None,
            rope=None) -> torch.Tensor:
    """Sealed rows of columns ``0 .. nb - 1`` as float32 ``[B, H, rows, D]`` in model space (the format's transforms
    undone; ``sink`` rows, given in model space, in place where ``sink_ok`` says): rows ``0 .. nb * bs - 1`` (zeros past
    ``held``), the rest (``rows`` defaults to ``nb * bs``) left for the caller to fill. Keys stored before RoPE are
    rotated at their positions: ``first_pos`` [B] is the position of each sequence's column 0, row 0 and ``rope`` the
    model's ``(cos, sin)`` [P, D] of positions ``0 .. P - 1`` covering every row read (``trtkv.rope.RopeTable.upto``)."""
    f = codec.fmt
    c, keep = _ctx(pool, tables, held, nb, sink, sink_ok, first_pos, rope)
    rows = nb * f.block_size if rows is None else rows
    out = torch.empty(c.batch, f.num_heads, rows, f.head_dim, dtype=torch.float32)
    _need_rope(codec, c)
    _check(library().trtkv_dequant(ctypes.byref(f), ctypes.byref(c), out.data_ptr(), rows, torch.get_num_threads()))
    return out


def dequant_blocks(codec: RowCodec, qt: QuantizedTensor, batch: int, first_pos=None, rope=None) -> torch.Tensor:
    """Blocks ``qt`` [batch * n, H, bs, ...] as a seal made them (``seal``, ``trtkv.quant.quantize_block``), sequence b's
    n blocks one after the other, dequantized like ``dequant`` reads them from a pool: float32 [batch, H, n * bs, D] in
    model space (keys stored before RoPE: ``first_pos`` [batch] the position of each one's first row)."""
    n = qt.codes.shape[0] // batch
    blocks = SimpleNamespace(**{name: None if t is None else t.contiguous() for name, t in (
        ("data", qt.codes), ("scale", qt.scale), ("zero", qt.zero), ("outlier_index", qt.outlier_index), ("outlier_value", qt.outlier_value))})
    tables = torch.arange(batch * n, dtype=torch.int64).view(batch, n)
    return dequant(codec, blocks, tables, torch.full((batch,), n, dtype=torch.int64), n, first_pos=first_pos, rope=rope)


class DecodeStep:
    """What every layer's ``decode`` call of one step shares, made once per step: the block tables and sealed blocks
    each sequence reads, its slot, open rows and positions (``first_pos``: of sealed column 0, row 0 -- a window ring's
    first block; ``open_pos``: of open row 0; ``q_pos``: of the new token), as int64 tensors and already in the C
    argument structs, so that a layer's call only sets its own pointers (the Python side of a call was most of its
    time)."""

    def __init__(self, tables, held, nb: int, slot, open_len, q_pos, first_pos, open_pos, sink_ok=None, rope=None):
        i64 = lambda t: t.to(torch.int64).contiguous()
        self.tensors = (i64(tables), i64(held), i64(slot), i64(open_len), i64(q_pos), i64(first_pos), i64(open_pos),
                        None if sink_ok is None else sink_ok.to(torch.uint8).contiguous())
        cos, sin, stride, hoff = _rope(rope)
        self.tensors += (cos, sin)
        tables, held, slot, open_len, q_pos, first_pos, open_pos, sink_ok, cos, sin = self.tensors
        self.batch = tables.shape[0]
        # keys stored before RoPE read ``rope`` (the model's (cos, sin) [P, D], positions 0 .. P - 1) at their positions
        self.kc, self.vc = (_Ctx(tables=_p(tables), cols=tables.shape[1], held=_p(held), batch=self.batch, nb=nb, first_pos=_p(first_pos),
                                 rope_cos=_p(cos), rope_sin=_p(sin), rope_rows=0 if cos is None else cos.shape[0], rope_stride=stride,
                                 rope_hoff=hoff) for _ in range(2))
        self.args = _Decode(slot=_p(slot), open_len=_p(open_len), q_pos=_p(q_pos), first_pos=_p(first_pos), open_pos=_p(open_pos),
                            sink_ok=_p(sink_ok))
        self.refs = tuple(ctypes.byref(x) for x in (self.kc, self.vc, self.args))


def decode_model_space(kcodec: RowCodec, vcodec: RowCodec, kpool, vpool, step: DecodeStep, q: torch.Tensor, new_k: torch.Tensor,
                       new_v: torch.Tensor, scaling: float, window: int | None = None, softcap: float | None = None,
                       sink_tokens: int = 0) -> torch.Tensor:
    """``decode`` with the formats' transforms inside the kernel: the query folded by the keys' (smoothing, rotation;
    the codecs carry them), the sealed values' part transformed back by the values' and added. Returns the attention
    output [B, H, n, D] in model space -- no torch op per layer around the call."""
    return _decode(kcodec, vcodec, kpool, vpool, step, q, None, new_k, new_v, scaling, window, softcap, sink_tokens)[1]


def decode(kcodec: RowCodec, vcodec: RowCodec, kpool, vpool, step: DecodeStep, q: torch.Tensor, qf: torch.Tensor, new_k: torch.Tensor,
           new_v: torch.Tensor, scaling: float, window: int | None = None, softcap: float | None = None, sink_tokens: int = 0,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token's attention per sequence: ``q`` / ``qf`` [B, H, n, D] (model space / keys' transforms folded in),
    this step's row ``new_k`` / ``new_v`` [B, H, D] (model space), the open blocks and the first ``sink_tokens`` rows of
    the first block (for the sequences ``step``'s ``sink_ok`` names) from the pools' tails, the sealed blocks through
    the block tables. Returns (the sealed values' part in stored space, the tails' and new row's part in model space),
    each [B, H, n, D]."""
    return _decode(kcodec, vcodec, kpool, vpool, step, q, qf, new_k, new_v, scaling, window, softcap, sink_tokens)


def _decode(kcodec, vcodec, kpool, vpool, step, q, qf, new_k, new_v, scaling, window, softcap, sink_tokens):
    B, H, n, D = q.shape
    q, new_k, new_v = (t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous() for t in (q, new_k, new_v))
    model_space = qf is None
    qf = q if model_space else qf if qf.dtype == torch.float32 and qf.is_contiguous() else qf.float().contiguous()
    out = torch.empty(2, B, H, n, D, dtype=torch.float32)
    kc, vc, a = step.kc, step.vc, step.args
    kc.data, kc.scale, kc.zero, kc.oidx, kc.oval = kpool.data.data_ptr(), _p(kpool.scale), _p(kpool.zero), _p(kpool.outlier_index), _p(kpool.outlier_value)
    vc.data, vc.scale, vc.zero, vc.oidx, vc.oval = vpool.data.data_ptr(), _p(vpool.scale), _p(vpool.zero), _p(vpool.outlier_index), _p(vpool.outlier_value)
    a.n, a.q, a.qf, a.new_k, a.new_v = n, q.data_ptr(), qf.data_ptr(), new_k.data_ptr(), new_v.data_ptr()
    a.k_tail, a.v_tail, a.tail_rows = kpool.tail.data_ptr(), vpool.tail.data_ptr(), kpool.tail.shape[-2]
    a.sink_tokens, a.window, a.scaling, a.softcap = sink_tokens, int(window or 0), scaling, softcap or 0.0
    a.out_sealed, a.out_rest, a.model_space = out.data_ptr(), out[1].data_ptr(), int(model_space)
    a.threads = torch.get_num_threads()  # the step's threads (the engine sets them per step): [B, H] pairs split over them
    _need_rope(kcodec, kc)
    _check(library().trtkv_decode(kcodec.ref, vcodec.ref, *step.refs))
    return out[0], out[1]


@dataclass
class SealCodec:
    """One layer's K or V seal as the kernel runs it: the C struct and the tensors it points into (kept alive)."""

    fmt: _SealFmt
    keep: tuple
    storage: torch.dtype

    @staticmethod
    def reason(tf) -> str | None:
        """Why the kernel does not seal ``tf`` (the reference quantizer does), or None."""
        if not tf.is_quantized or not tf.traits.is_int:
            return f"{tf.dtype} is not an integer code"
        if tf.is_static:
            return "static scales"
        if tf.mse:
            return "its scales are searched (mse)"
        if lacks := CPU_SEAL.lacks(tf):  # the capability table's ``cpu-seal`` row: the reference quantizer keeps them
            return f"keeps {' and '.join(lacks)}"
        return None

    @classmethod
    def of(cls, tf, params, num_heads: int, head_dim: int, block_size: int) -> "SealCodec | None":
        """For ``TensorFormat`` ``tf`` with its calibrated ``TensorParams`` (clip); None where ``reason`` names one."""
        if cls.reason(tf) or head_dim > MAX_HEAD_DIM:
            return None
        traits, sym = tf.traits, tf.symmetric
        f = _SealFmt(head_dim=head_dim, block_size=block_size, num_heads=num_heads, block_wise=int(tf.is_block_wise),
                     groups=1 if tf.is_block_wise else tf.groups(head_dim), symmetric=int(sym), sym_min=traits.sym_min,
                     sym_max=traits.sym_max, asym_max=traits.asym_max, offset=traits.offset(sym),
                     row_bytes=traits.packed_dim(head_dim) * traits.storage.itemsize,
                     signed_bytes=int(not traits.packed and traits.storage_for(sym) == torch.int8))
        planes = traits.plane_layout(head_dim) if traits.packed else [(0, 8, 0)]
        f.n_planes = len(planes)
        for p, (byte, width, low) in enumerate(planes):
            f.byte_off[p], f.width[p], f.low[p] = byte, width, low
        keep = []
        clip = None if params is None else params.clip
        if clip is not None:
            clip = clip.float().expand(num_heads).contiguous() if clip.dim() == 0 else clip.float().contiguous()
            keep.append(clip)
            f.clip = clip.data_ptr()
        return cls(f, tuple(keep), traits.storage_for(sym))


def seal(codec: SealCodec, x: torch.Tensor) -> QuantizedTensor:
    """Blocks ``x`` [N, H, bs, D] (float32, stored space) quantized as the pool stores them: ``trtkv.quant.quantize_block``'s
    codes, scales and zero-points, byte for byte; a NaN or inf in ``x`` is ``trtkv.quant.check_finite``'s error."""
    f = codec.fmt
    x = x.float().contiguous()
    N = x.shape[0]
    codes = torch.empty(N, f.num_heads, f.block_size, f.row_bytes, dtype=torch.uint8)
    shape = (N, f.num_heads, f.head_dim) if f.block_wise else (N, f.num_heads, f.block_size, f.groups)
    scale = torch.empty(shape, dtype=torch.float16)
    zero = None if f.symmetric else torch.empty(shape, dtype=torch.float16)
    rc = library().trtkv_seal(ctypes.byref(f), x.data_ptr(), N, codes.data_ptr(), scale.data_ptr(), _p(zero), torch.get_num_threads())
    if rc == -3:
        raise non_finite("K/V input")
    _check(rc)
    return QuantizedTensor(codes=codes.view(codec.storage), scale=scale, zero=zero)
