"""The attention backend interface and the one registry of execution paths.

An ``AttentionBackend`` is one way of running attention over the paged cache. It owns, for its path:

* its capability row (``path``: an ``ExecutionPath`` of ``plugins/contract/capabilities.py``, where the kernels'
  own refusals read the same rows) and ``refusal``, which adds the device and the machine to the row's reasons;
* the cache tensors it reads (``cache_shapes``, asked of ``PagedKVLayout``);
* ``begin`` (the state every layer of one step shares) and ``attend`` (one layer's prefill chunk or decode step);
* the seal of full blocks into the pool (``quantize_blocks``; ``seals_in_place`` / ``seal_in_place`` for a kernel
  that writes an open block straight into its pool block).

The torch engine resolves ``--attention`` to one backend when it is built (``resolve``) and hands it to the cache,
which seals through it. ``BACKENDS`` is the registry in ``auto``'s order: the first backend whose ``refusal`` is None
runs. The ONNX step networks and TensorRT-RTX are ``EXPORTERS``: capability rows of the same registry, whose code is
the builder's graph. The reference every backend's codec is tested against is ``trtkv.quant``.
"""

from __future__ import annotations

import dataclasses
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from trtkv.cache_layout import block_rope
from trtkv.errors import TrtkvError
from trtkv.plugins.contract.capabilities import ExecutionPath, Reason, cache_reasons
from trtkv.quant import QuantizedTensor, TensorParams, quantize_block


def _params_on(p: TensorParams, device: torch.device) -> TensorParams:
    moved = {f.name: (None if getattr(p, f.name) is None else getattr(p, f.name).to(device)) for f in dataclasses.fields(p)}
    return TensorParams(**moved)


@dataclass
class AttentionStep:
    """What every attention layer of one step reads, made once per step by ``AttentionBackend.begin``. ``cache`` is
    the runtime's ``PagedKVCache`` and ``batch`` its ``StepBatch`` on the engine's device."""

    backend: "AttentionBackend"
    batch: object
    cache: object
    valid: torch.Tensor  # [B, T] bool: real (not padding) new tokens
    # the blocks a step across blocks seals in the step for its later queries (``CpuKernels``): (layer, "k" / "v") -> codes
    in_step: int = 0
    in_step_codes: dict = dataclasses.field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.backend.device


class AttentionBackend(ABC):
    """One execution path of the torch engine's attention (see the module docstring)."""

    name: ClassVar[str]
    path: ClassVar[ExecutionPath]
    seal_path: ClassVar[ExecutionPath | None] = None  # its seal kernel's own row (None: the reference quantizer seals)
    runs_on: ClassVar[tuple[str, ...]]  # device types it runs on when asked by name
    auto_on: ClassVar[tuple[str, ...]]  # device types ``auto`` takes it on
    runs_on_note: ClassVar[str] = ""  # how it runs where ``auto`` does not take it
    cross_blocks: ClassVar[bool] = False  # a prefill step may cross block boundaries (it seals the blocks it fills)
    cuda_graphs: ClassVar[bool] = False  # its decode steps are captured as CUDA graphs on CUDA (no host syncs)

    def __init__(self, device: torch.device | str = "cpu", max_seq_len: int | None = None):
        self.device = torch.device(device)
        self.max_seq_len = max_seq_len  # the engine's longest sequence (None: no manifest; a step's own length)
        self.note = ""  # how ``resolve`` chose it (``auto``: what it passed over, and why)
        self._per_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ (a) capability

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this machine cannot run the backend at all (a sentence: no compiler...), or None."""
        return None

    @classmethod
    def refusal(cls, device, fmt=None, model=None, block_size: int | None = None, head_dim: int | None = None, *,
                auto: bool = False) -> Reason | None:
        """Why this backend does not run ``fmt`` (and the model, sizes) on ``device``, or None; ``auto``: also where
        ``auto`` does not take it though it could run (the Triton kernels on CPU run only under the interpreter)."""
        kind = torch.device(device).type
        if kind not in cls.runs_on:
            return Reason(f"it runs on {' / '.join(cls.runs_on)} only, not on {kind}",
                          f"use --attention {' or '.join(b.name for b in BACKENDS if kind in b.runs_on)} on {kind}", "device")
        if auto and kind not in cls.auto_on:
            return Reason(f"auto takes the {cls.path.title} on {' / '.join(cls.auto_on)} only", f"ask for --attention {cls.name}", "device")
        if why := cls.unavailable():
            return Reason(why, cls.unavailable_hint, "machine")
        if fmt is not None:
            reasons = cls.path.reasons(fmt, model, block_size, head_dim)
        else:
            reasons = [*cls.path.size_reasons(block_size, head_dim), *cls.path.model_reasons(model)]
        return reasons[0] if reasons else None

    unavailable_hint: ClassVar[str] = ""

    @classmethod
    def manifest_refusal(cls, device, manifest=None, kv_format=None, *, auto: bool = False) -> Reason | None:
        """``refusal`` for an engine's manifest (its format, block size, head dim), or for ``kv_format`` alone."""
        if manifest is not None:
            return cls.refusal(device, manifest.kv_format, None, manifest.limits.block_size, manifest.model.head_dim, auto=auto)
        return cls.refusal(device, kv_format, auto=auto)

    def cache_shapes(self, layout) -> dict[str, tuple]:
        """The cache tensors this backend reads (the paged layout's: every path reads the same one)."""
        return self.path.cache_shapes(layout)

    # ------------------------------------------------------------------ (c) attention

    @abstractmethod
    def begin(self, batch, cache, valid: torch.Tensor, crossing: bool) -> AttentionStep:
        """The state of one step every layer shares (masks, per-step kernel arguments); ``crossing``: the step crosses
        block boundaries (only a ``cross_blocks`` backend is asked)."""

    @abstractmethod
    def attend(self, st: AttentionStep, layer: int, q: torch.Tensor, k16: torch.Tensor, v16: torch.Tensor, scaling: float,
               window: int | None, softcap: float | None) -> torch.Tensor:
        """Layer ``layer``'s attention: query ``q`` [B, Hq, T, D] and this step's keys / values ``k16`` / ``v16``
        [B, H, T, D] (fp16, as the open block will hold them) over the sealed blocks, the sink rows, each slot's open
        block and the step's own rows, causal within the step; ``window`` / ``softcap``: the layer's. Returns
        [B, T, Hq, D] in ``q``'s dtype."""

    # ------------------------------------------------------------------ (d) the seal

    def quantize_blocks(self, cache, layer: int, which: str, rows: torch.Tensor, first_positions: torch.Tensor) -> QuantizedTensor:
        """Full blocks ``rows`` [n, H, block_size, D] float32 (sink rows already taken out, ``cache_layout.sealing``) of
        ``layer``'s K or V, whose first tokens sit at ``first_positions`` [n], as the pool stores them: the reference
        quantizer (``trtkv.quant.quantize_block``; keys stored before RoPE unrotated at their positions)."""
        tf, params = cache.layout_of(layer).tensor_format(which), getattr(cache.params[layer], which)
        rope = block_rope(cache.rope_for(layer, tf), first_positions, cache.block_size) if tf.pre_rope else None
        return quantize_block(rows, tf, params, head_axis=-3, rope=rope)

    def seals_in_place(self, cache) -> bool:
        """Whether full open blocks of ``cache`` are sealed one by one, in place, by ``seal_in_place`` (a seal kernel)
        rather than gathered and quantized together (``quantize_blocks``)."""
        return False

    def seal_in_place(self, cache, slot: int, block: int, block_index: int) -> None:
        raise NotImplementedError(f"the {self.name} backend seals through quantize_blocks")

    # ------------------------------------------------------------------ per cache

    def cached(self, cache, key, make):
        """``make()`` once per cache and ``key`` (the cache's constants on this device, the kernels' codecs)."""
        got = self._per_cache.setdefault(cache, {})
        if key not in got:
            got[key] = make()
        return got[key]

    def layer_params(self, cache, layer: int) -> tuple[TensorParams, TensorParams]:
        """The cache's KV constants of ``layer`` on this backend's device (moved once per cache)."""
        every = self.cached(cache, "params", lambda: [(_params_on(p.k, self.device), _params_on(p.v, self.device)) for p in cache.params])
        return every[layer]

    def describe(self) -> str:
        return f"attention {self.name} ({self.path.title}){'; ' + self.note if self.note else ''}"


@dataclass(frozen=True)
class Exporter:
    """A path whose attention is a built network, not runtime code: its capability row in the registry."""

    name: str
    path: ExecutionPath


BACKENDS: list[type[AttentionBackend]] = []  # in ``auto``'s order; filled in trtkv/attention/__init__.py
EXPORTERS: list[Exporter] = []


def register(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Add a backend to the registry; the order of registration is ``auto``'s."""
    if any(b.name == cls.name for b in BACKENDS):
        raise ValueError(f"an attention backend named {cls.name!r} is registered already")
    BACKENDS.append(cls)
    return cls


def exporter(name: str) -> Exporter:
    """The exporter row named ``name`` (``native``, ``plugin``, ``tensorrt-rtx``)."""
    for e in EXPORTERS:
        if e.name == name:
            return e
    raise TrtkvError(f"unknown exporter {name!r}", f"use one of {', '.join(e.name for e in EXPORTERS)}")


def names() -> tuple[str, ...]:
    return tuple(b.name for b in BACKENDS)


def backend_class(name: str) -> type[AttentionBackend]:
    for b in BACKENDS:
        if b.name == name:
            return b
    raise TrtkvError(f"unknown attention backend {name!r}", f"use one of auto, {', '.join(names())}")


def resolve(name: "str | AttentionBackend", device, manifest=None, kv_format=None) -> AttentionBackend:
    """The backend ``--attention name`` runs on ``device`` for the engine of ``manifest`` (or caches of ``kv_format``):
    ``auto`` is the first registered backend with no ``refusal`` (its ``note`` says what it passed over and why); a
    named backend that refuses is one ``TrtkvError`` line naming why. A backend object is checked the same way and
    returned as it is (one made with its own options)."""
    device = torch.device(device)
    max_seq_len = manifest.limits.max_seq_len if manifest is not None else None
    if isinstance(name, AttentionBackend):
        if r := type(name).manifest_refusal(device, manifest, kv_format):
            raise TrtkvError(f"--attention {name.name}: {r}", r.hint)
        if name.device != device:
            raise TrtkvError(f"an attention backend made for {name.device} given to an engine on {device}", "make it for the engine's device")
        if name.max_seq_len is None:
            name.max_seq_len = max_seq_len
        return name
    if name != "auto":
        cls = backend_class(name)
        if r := cls.manifest_refusal(device, manifest, kv_format):
            raise TrtkvError(f"--attention {name}: {r}", r.hint)
        return cls(device, max_seq_len)
    skipped = []
    for cls in BACKENDS:
        r = cls.manifest_refusal(device, manifest, kv_format, auto=True)
        if r is None:
            chosen = cls(device, max_seq_len)
            chosen.note = "chosen by auto" + (f"; not {'; not '.join(skipped)}" if skipped else "")
            return chosen
        if r.kind != "device":
            skipped.append(f"{cls.name}: {r}")
    raise TrtkvError(r, r.hint)  # the last resort's (the torch ops') reason


def pool_sealer(device) -> AttentionBackend:
    """The backend a cache seals through when no engine handed it one: ``auto``'s choice on the cache's device (for a
    network engine's cache, or a cache made on its own)."""
    return resolve("auto", device)


def pool_reasons(fmt) -> list[Reason]:
    """Why no path that attends over a paged cache reads ``fmt``'s pools (a paged cache of it would serve nothing)."""
    return cache_reasons(fmt)
