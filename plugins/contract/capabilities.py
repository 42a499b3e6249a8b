"""The one capability table: which execution path runs which KV format, model, block size and head dim.

One object per execution path answers ``reasons(fmt, model, block_size, head_dim)``: why the path cannot run them
(``[]`` when it can). Every argument but ``fmt`` may be None (not asked). Each row is held by its owner in the registry
of ``trtkv.attention``: an attention backend (the torch ops, the C kernels and the C seal, the Triton kernels and the
Triton seal), whose ``refusal`` adds the device and the machine to the row's reasons, or an exporter (the ONNX step
networks, TensorRT-RTX). The builder (``--attention`` and ``--backend`` checks, ``check_model``), the step network's
attention emitters, the torch engine's ``auto`` choice, the pool's seal and the support matrix in docs/architecture.md
(``docs/gen_support_matrix.py``, from the registry) all read these rows; nothing else decides what runs where.

It lives beside ``LIMITS`` (the kernels' limits) in the plugin layer, so that the kernels' own refusals
(``cpu_attention``, ``kernels``) use the same words: the core's formats, model info and family table (``trtkv.families``:
which families the step network computes, which soft-cap) are all it reads (tests/test_layering.py).

Each reason is a ``Reason``: a ``str`` (the message the callers have always raised) with the ``hint`` a caller
puts beside it in a ``TrtkvError``.
"""

from __future__ import annotations

from dataclasses import dataclass

from trtkv.families import architectures, family_of
from trtkv.plugins.contract.limits import LIMITS

NATIVE_BLOCK_SIZES = (4, 8, 16, 32, 64, 128, 256)
KERNEL_BLOCK_SIZES = tuple(b for b in (16, 32, 64, 128) if LIMITS.block_size_problem(b) is None)
KERNEL_HEAD_DIMS = tuple(d for d in (32, 64, 128, 256) if LIMITS.head_dim_problem(d) is None)


# what a tensor format may keep that a path must read to run it: (TensorFormat field, words in a reason, ExecutionPath flag)
FEATURES = (("codebook", "codebooks (nuq)", "codebooks"), ("outliers", "outlier lists (outN)", "outliers"),
            ("pre_rope", "keys before RoPE (prerope)", "pre_rope"), ("allocated_bits", "bits allocated per channel (allocB)", "channel_bits"))
LACKS_HINT = ("use a format every path reads: int8, int4, or the calibration-free 3- / 2-bit spec strings "
              "(docs/kv-formats.md)")


class Reason(str):
    """A reason a path refuses a configuration: the message, with the hint a ``TrtkvError`` shows beside it."""

    hint: str = ""
    kind: str = ""  # "layout" (the format's pool layout), "format", "size", "model"

    def __new__(cls, text: str, hint: str = "", kind: str = "") -> "Reason":
        r = super().__new__(cls, text)
        r.hint, r.kind = hint, kind
        return r


@dataclass(frozen=True)
class ExecutionPath:
    """One way of running attention over the paged cache (or of sealing it): what it accepts, and why not."""

    name: str
    title: str
    per_layer: bool = False  # reads a per-layer format (one pool layout per layer group)
    step_network: bool = False  # the ONNX step network: only the families whose row says ``step_network``
    windows: bool = True  # sliding-window layers (a window start per layer)
    softcap: bool = True  # attention-logit soft-capping
    kernels: bool = False  # the Triton kernels' storage dtypes, block sizes and head dims (LIMITS), no mse search
    attention_op: bool = False  # the kernels as the step network's attention ops: storage dtypes only (the pool seals)
    block_sizes: tuple[int, ...] | None = None  # None: any (or LIMITS)
    head_dims: tuple[int, ...] | None = None  # None: any (or LIMITS)
    head_dim_max: int | None = None  # None: no bound
    attention_modes: tuple[str, ...] = ("native", "plugin")  # the builder's --attention this backend runs
    prefix_cache: bool = True  # the block manager's prefix cache works over this path
    # decodes ``nuq`` codes through a per-layer codebook / reads a sealed block's ``outN`` outlier list
    # (eval and the reference paged cache read all of them; of the engines, the torch ops and the CPU kernels read all)
    codebooks: bool = False
    outliers: bool = False
    pre_rope: bool = False  # applies RoPE to keys stored before it (``prerope``) when it reads them
    channel_bits: bool = False  # unpacks rows whose channels have their own calibrated code widths (``allocB``)
    window_ring: bool = False  # sliding layers may live in a window ring (the torch engine), which turns prefix caching off

    # ------------------------------------------------------------------ the questions

    def reasons(self, fmt, model=None, block_size: int | None = None, head_dim: int | None = None) -> list[Reason]:
        """Why this path cannot run ``fmt`` for ``model`` (``trtkv.models.ModelInfo``) at this block size and head
        dim ([] when it can); arguments left None are not asked."""
        return [*self.layout_reasons(fmt), *self.size_reasons(block_size, head_dim), *self.format_reasons(fmt),
                *self.model_reasons(model)]

    def layout_reasons(self, fmt) -> list[Reason]:
        if fmt.is_per_layer and not self.per_layer:
            return [Reason(f"KV format {fmt.name} stores each layer its own way, which only the torch engine reads "
                           "(the ONNX step network has one pool layout for every layer)", "build it with --backend torch", "layout")]
        lacks = list(dict.fromkeys(what for f in fmt.layer_formats() for t in (f.k, f.v) for what in self.lacks(t)))
        if lacks:
            # the torch-engine paths that read all of it are the first way out
            readers = [p.title for name in TORCH_ENGINE_PATHS if (p := CAPABILITIES[name]) is not self and
                       not any(p.lacks(t) for f in fmt.layer_formats() for t in (f.k, f.v))]
            hint = f"build it with --backend torch, which reads it ({' / '.join(readers)}); or {LACKS_HINT}" if readers else LACKS_HINT
            return [Reason(f"KV format {fmt.name} keeps {' and '.join(lacks)}, which the {self.title} does not read yet", hint, "layout")]
        return []

    def lacks(self, t) -> list[str]:
        """What of one tensor format (``TensorFormat``) this path does not read: codebooks, outlier lists, keys stored
        before RoPE (``FEATURES``); [] when it reads them all."""
        return [what for attr, what, has in FEATURES if getattr(t, attr) and not getattr(self, has)]

    def size_reasons(self, block_size: int | None = None, head_dim: int | None = None) -> list[Reason]:
        out = []
        if self.kernels:
            for what, value, problem in (("block size", block_size, LIMITS.block_size_problem),
                                         ("head_dim", head_dim, LIMITS.head_dim_problem)):
                p = problem(value) if value is not None else None
                if p:
                    out.append(Reason(f"{what} {p}", "choose another --block-size, or the torch ops", "size"))
            return out
        if self.block_sizes is not None and block_size is not None and block_size not in self.block_sizes:
            out.append(Reason(f"{self.name} attention supports block sizes {list(self.block_sizes)}, not {block_size}",
                              "choose another --block-size", "size"))
        if self.head_dim_max is not None and head_dim is not None and head_dim > self.head_dim_max:
            out.append(Reason(f"{self.name} attention supports head dims up to {self.head_dim_max}, not {head_dim}",
                              "use the torch ops (--attention torch)", "size"))
        if self.head_dims is not None and head_dim is not None and head_dim not in self.head_dims:
            out.append(Reason(f"{self.name} attention supports head dims {list(self.head_dims)}, not {head_dim}",
                              "choose another model or --attention", "size"))
        return out

    def tensor_reason(self, t) -> str | None:
        """Why this path cannot store / read one tensor format (``TensorFormat``), or None."""
        if not (self.kernels or self.attention_op):
            return None
        if LIMITS.dtype_problem(t.dtype):
            return LIMITS.dtype_problem(t.dtype)
        if t.mse and self.kernels:
            return "searches its scales (mse), which the Triton kernels do not (the reference quantizer does)"
        if self.kernels and (problem := LIMITS.outliers_problem(t.outliers)):
            return problem
        return None

    def format_reasons(self, fmt) -> list[Reason]:
        if self.attention_op:  # per tensor, as the attention backends have always said it
            return [Reason(f"{which}={t.short()}: {r}", "choose another --kv, or --attention native", "format")
                    for f in fmt.layer_formats() for which, t in (("k", f.k), ("v", f.v)) if (r := self.tensor_reason(t))]
        if not self.kernels:
            return []
        if any(self.tensor_reason(t) for f in fmt.layer_formats() for t in (f.k, f.v)):
            return [Reason(f"KV format {fmt.spec()} (the kernels take {', '.join(LIMITS.dtypes)}, no mse seal)",
                           "choose another --kv, or the torch ops", "format")]
        return []

    def model_reasons(self, model) -> list[Reason]:
        if model is None:
            return []
        arch = model.architecture
        family = family_of(arch)
        if self.step_network and (family is None or not family.step_network):
            return [Reason(f"build-engine cannot build {arch} yet: the ONNX step network does not implement its layers",
                           "use trtkv eval / calibrate / plan for this model, or build an engine for one of "
                           f"{', '.join(architectures(lambda f: f.step_network))}", "model")]
        out = []
        if not self.windows and model.has_sliding_layers:
            out.append(Reason(f"{model.name} has sliding-window layers (window {model.sliding_window}) and {self.name} attention has no "
                              "window start per layer", "use --attention native", "model"))
        if not self.softcap and family is not None and family.attn_softcap:
            out.append(Reason(f"{arch} soft-caps its attention logits and {self.name} attention does not", "use --attention native", "model"))
        return out

    def attention_reason(self, attention: str) -> Reason | None:
        """Why this backend cannot run the builder's ``--attention`` mode, or None."""
        if attention in self.attention_modes:
            return None
        return Reason("plugin attention needs the trtkv TensorRT plugins, and TensorRT-RTX loads no plugins",
                      "use --attention native with --backend tensorrt-rtx (or --backend tensorrt / onnxruntime for plugin attention)")

    # ------------------------------------------------------------------ cache tensors

    def cache_shapes(self, layout) -> dict[str, tuple]:
        """The cache tensors this path reads (``cache_layout.PagedKVLayout``): name -> shape of one layer's tensor.
        Every path reads the same paged layout (docs/kv-cache-format.md)."""
        out = {}
        for which in ("k", "v"):
            for field, shape in (("data", layout.data_shape(which)), ("scale", layout.scale_shape(which)), ("zero", layout.zero_shape(which))):
                if shape is not None:
                    out[f"{which}_{field}"] = tuple(shape)
            out[f"{which}_tail"] = tuple(layout.tail_shape())
        return out


ONNX_NATIVE = ExecutionPath("native", "ONNX step network, native attention", step_network=True, block_sizes=NATIVE_BLOCK_SIZES)
ONNX_PLUGIN = ExecutionPath("plugin", "ONNX step network, plugin attention (trtkv:: ops)", step_network=True, windows=False,
                            softcap=False, attention_op=True, block_sizes=KERNEL_BLOCK_SIZES, head_dims=KERNEL_HEAD_DIMS)
TENSORRT_RTX = ExecutionPath("tensorrt-rtx", "TensorRT-RTX engine (native attention only, no plugins)", step_network=True,
                             block_sizes=NATIVE_BLOCK_SIZES, attention_modes=("native",))
# the torch ops dequantize such sealed rows whole (codebook levels, outlier lists written back, RoPE applied to keys
# stored before it, rows of per-channel code widths unpacked) where they fold the others' scales into the query
TORCH_OPS = ExecutionPath("torch", "torch engine, torch ops", per_layer=True, window_ring=True, codebooks=True, outliers=True,
                          pre_rope=True, channel_bits=True)
# the Triton kernels read codebooks (a table lookup), outlier lists (one-hot products over a tile of one block) and keys
# stored before RoPE (brought to model space per tile with the model's table); the seal kernel writes them all
KERNEL_ATTENTION = ExecutionPath("kernels", "torch engine, Triton attention kernels", per_layer=True, window_ring=True, kernels=True,
                                 codebooks=True, outliers=True, pre_rope=True, channel_bits=True)
# trtkv's C kernels (plugins/cpu_attention.c) decode every storage dtype through its own lookup tables, a nuq
# format's codes through the layer's codebook, an alloc format's codes at each channel's offset and width, write a
# block's outlier list over its codes and bring keys stored before RoPE back to model space (the rotation undone by
# butterflies, RoPE from the model's table)
CPU_KERNELS = ExecutionPath("cpu", "torch engine, trtkv's C attention kernels (CPU)", per_layer=True, window_ring=True, head_dim_max=1024,
                            codebooks=True, outliers=True, pre_rope=True, channel_bits=True)
KERNEL_SEAL = ExecutionPath("seal", "Triton seal kernel (the pool's seal on CUDA)", per_layer=True, window_ring=True, kernels=True,
                             codebooks=True, outliers=True, pre_rope=True, channel_bits=True)
# the C seal (the pool's seal on CPU): a nuq format's nearest-level codes are the reference quantizer's
CPU_SEAL = ExecutionPath("cpu-seal", "trtkv's C seal kernel (the pool's seal on CPU)", per_layer=True, window_ring=True, head_dim_max=1024)



def kernels_take(fmt) -> bool:
    """Whether the Triton kernels seal and decode every layer's K and V of ``fmt`` (storage dtypes, no ``mse`` seal):
    the ``seal`` and ``kernels`` rows, asked by the contract tests."""
    return kernels_attend(fmt) and not KERNEL_SEAL.layout_reasons(fmt) and not KERNEL_SEAL.format_reasons(fmt)


def kernels_attend(fmt) -> bool:
    """Whether the Triton attention kernels read every layer's K and V of ``fmt`` (the ``kernels`` row; the pool may
    still seal with the reference quantizer): asked by the AOT configuration list."""
    return not KERNEL_ATTENTION.layout_reasons(fmt) and not KERNEL_ATTENTION.format_reasons(fmt)


# The op contract (plugins/contract: PagedKVSeal, PagedDecode*, PagedPrefillAttention) is what the Triton kernels, the
# ONNX Runtime custom ops and the TensorRT plugins all implement: its format attributes are refused for what any of
# them does not read.
OP_PATHS = ("plugin", "kernels", "seal")


def kernel_refusal(t, paths: tuple[str, ...] = ("kernels", "seal")) -> str | None:
    """Why the Triton kernels (``paths``: the attention kernels' and the seal's rows) cannot store / read one tensor
    format, as one line, or None: the features they lack, or an outlier count they cannot tile."""
    lacks = list(dict.fromkeys(w for name in paths for w in CAPABILITIES[name].lacks(t)))
    if lacks:
        return f"keeps {' and '.join(lacks)}, which the Triton kernels do not read yet"
    return LIMITS.outliers_problem(t.outliers)


def op_refusal(t) -> str | None:
    """Why the trtkv:: ops cannot store / read one tensor format (``TensorFormat``), as one line, or None."""
    lacks = list(dict.fromkeys(w for name in OP_PATHS for w in CAPABILITIES[name].lacks(t)))
    if lacks:
        return f"keeps {' and '.join(lacks)}, which the trtkv:: ops (Triton kernels, ONNX Runtime / TensorRT plugins) do not read yet"
    return None


CAPABILITIES: dict[str, ExecutionPath] = {p.name: p for p in (ONNX_NATIVE, ONNX_PLUGIN, TENSORRT_RTX, TORCH_OPS, CPU_KERNELS, KERNEL_ATTENTION, KERNEL_SEAL,
                                                              CPU_SEAL)}


TORCH_ENGINE_PATHS = ("torch", "cpu", "kernels")  # the torch engine's attentions (a torch-backend engine runs one of them)
ENGINE_PATHS = (*TORCH_ENGINE_PATHS, "native", "plugin", "tensorrt-rtx")  # every path that attends over a paged cache


def cache_reasons(fmt, paths: tuple[str, ...] = ENGINE_PATHS) -> list[Reason]:
    """Why none of ``paths`` reads ``fmt``'s pools (a paged cache -- or a torch-backend engine, with
    ``TORCH_ENGINE_PATHS`` -- of it would serve nothing): the torch ops' layout reasons when each path has one, else []."""
    if any(not CAPABILITIES[name].layout_reasons(fmt) for name in paths):
        return []
    return TORCH_OPS.layout_reasons(fmt)


def backend_path(backend: str) -> ExecutionPath | None:
    """The path an engine backend adds its own limits with (TensorRT-RTX: no plugins), or None."""
    return CAPABILITIES.get(backend) if backend == "tensorrt-rtx" else None

