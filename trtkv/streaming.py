"""Layer streaming: run a model one decoder layer at a time, every window through layer i before layer i+1 loads.

This is the "sequential" pipeline of llm-compressor (ModelOpt calls it layer-wise calibration), and what lets an
8B model calibrate in float32 in an 8 GiB process or a 70B one on a single GPU. The model is built as a skeleton
whose parameters live on the ``meta`` device (no memory); the non-layer weights (embeddings, final norm, and the
vocabulary projection when logits are wanted) are read once, and each decoder layer is read from the checkpoint's
memory-mapped safetensors shards, run over every window, and released. Peak memory is one decoder layer plus the
windows' hidden states.

The layers run exactly as in the resident model, with the model's own code: a first pass through the model's
forward with every decoder layer replaced by a ``_Recorder`` captures what the forward hands each layer
(the embedded input, masks, positions, RoPE tables) without computing any layer; then the real layer ``i`` is
called with those arguments on the hidden states layer ``i-1`` produced; a last pass through the model's forward
with layers that hand back the final hidden states yields the logits (final norm, vocabulary projection and any
logit soft-cap as the family computes them). Caches are the caller's: the attention of layer ``i`` writes its K/V
into the cache it is handed under its own ``layer_idx``, so a calibration statistics cache or the quantized eval
cache sees exactly the tensors the resident pass gives it, in the same order per layer.

Masks depend on how many tokens a cache already holds: during the recording pass a ``LengthCache`` counts them
the way the real cache does (``QuantizedKVLayer`` and ``DynamicLayer`` both report ``cumulative + query`` tokens
at offset 0), so every chunk of a chunked prefill is handed the mask the resident run builds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from trtkv.errors import TrtkvError

LAYERS_PATHS = ("model.layers", "model.model.layers")  # where the decoder layers of a supported family live


class _LengthLayer(DynamicLayer):
    """Counts the tokens a layer of the real cache would hold; stores nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.cumulative_length = 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0


class LengthCache(Cache):
    """The lengths of a ``QuantizedKVCache`` (or any cache that keeps every token at offset 0), without the tensors."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[_LengthLayer() for _ in range(num_layers)])

    def advance(self, layer: int, tokens: int) -> None:
        self.layers[layer].cumulative_length += tokens
        self.layers[layer].is_initialized = True


@dataclass
class LayerCall:
    """What the model's forward handed decoder layer ``i`` for one chunk (the cache argument is replaced when run)."""

    kwargs: dict[str, Any]


@dataclass
class Chunk:
    """One forward of the resident pass: its layer-0 input, the per-layer arguments, then each layer's output."""

    hidden: torch.Tensor  # input of the next layer to run (the embedded tokens before layer 0)
    calls: list[LayerCall] = field(default_factory=list)


class _Recorder(torch.nn.Module):
    """Stands in for decoder layer ``index`` in the recording pass: keeps its arguments, computes nothing."""

    def __init__(self, index: int, sink: list[LayerCall], first: list[torch.Tensor]):
        super().__init__()
        self.index, self.sink, self.first = index, sink, first

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:
            raise TrtkvError("this model passes its decoder layers positional arguments, which layer streaming cannot record",
                             "run it resident (--stream never) with enough memory")
        if self.index == 0:
            self.first.append(hidden_states)
        self.sink.append(LayerCall(kwargs))
        cache = kwargs.get("cache")
        if isinstance(cache, LengthCache):
            cache.advance(self.index, hidden_states.shape[-2])
        return hidden_states


class _Replay(torch.nn.Module):
    """Stands in for the last decoder layer in the final pass: hands back the hidden states the streamed layers made."""

    def __init__(self, hidden: torch.Tensor | None):
        super().__init__()
        self.hidden = hidden

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states if self.hidden is None else self.hidden


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def decoder_layers_path(model: torch.nn.Module) -> str:
    for path in LAYERS_PATHS:
        with contextlib.suppress(AttributeError):
            if isinstance(_get(model, path), torch.nn.ModuleList):
                return path
    raise TrtkvError(f"cannot find the decoder layers of {type(model).__name__}", "use a model of a supported architecture")


@contextlib.contextmanager
def _swapped_layers(model: torch.nn.Module, stand_ins: Sequence[torch.nn.Module]) -> Iterator[None]:
    path = decoder_layers_path(model)
    parent_path, _, name = path.rpartition(".")
    parent = _get(model, parent_path)
    real = getattr(parent, name)
    parent._modules[name] = torch.nn.ModuleList(stand_ins)
    try:
        yield
    finally:
        parent._modules[name] = real


def tensor_files(ckpt: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it (the index's weight map when there is one: ``trtkv.shards``)."""
    from trtkv.shards import tensor_index

    return {k: e.file for k, e in tensor_index(Path(ckpt)).items()}


class LayerStreamer:
    """A model skeleton on the meta device whose weights are read from ``checkpoint_dir`` when asked.

    ``materialize(prefix)`` reads every parameter under a module path (``"model.layers.3"``) at ``dtype`` on ``device``;
    ``release(prefix)`` puts them back on the meta device. ``read_bytes`` / ``read_seconds`` count what was read.
    """

    def __init__(self, model: torch.nn.Module, checkpoint_dir: Path, dtype: torch.dtype, device: torch.device):
        self.model, self.dtype, self.device = model, dtype, device
        self.files = tensor_files(checkpoint_dir)
        self.layers_path = decoder_layers_path(model)
        self.num_layers = len(_get(model, self.layers_path))
        self.read_bytes = 0
        self.read_seconds = 0.0
        self._tied = self._tied_names()

    def _tied_names(self) -> dict[str, str]:
        """Parameters that are the same tensor as another (lm_head tied to the embeddings): name -> the stored name."""
        seen: dict[int, str] = {}
        out: dict[str, str] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                out[name] = seen[id(p)]
            else:
                seen[id(p)] = name
        return out

    def layer_prefix(self, i: int) -> str:
        return f"{self.layers_path}.{i}"

    def _tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self.files.get(name)
        if file is None:
            raise TrtkvError(f"the checkpoint has no tensor {name}, which the model's layers need for layer streaming",
                             "re-save the model with save_pretrained, or run it resident (--stream never)")
        t0 = time.perf_counter()
        with safe_open(str(file), framework="pt", device="cpu") as f:
            t = f.get_tensor(name)
        self.read_bytes += t.numel() * t.element_size()
        out = t.to(device=self.device, dtype=self.dtype if t.is_floating_point() else t.dtype)
        self.read_seconds += time.perf_counter() - t0
        return out

    def materialize(self, prefix: str) -> None:
        """Read every parameter under the module path ``prefix`` (a decoder layer: no tied weights inside)."""
        module = _get(self.model, prefix)
        for name, p in list(module.named_parameters(recurse=True)):
            if p.is_meta:
                self._set(module, name, self._tensor(f"{prefix}.{name}"))

    @staticmethod
    def _set(module: torch.nn.Module, name: str, t: torch.Tensor) -> None:
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        owner._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)

    def release(self, prefix: str) -> None:
        module = _get(self.model, prefix)
        for name, p in list(module.named_parameters(recurse=True)):
            self._set(module, name, torch.empty_like(p, device="meta"))

    def materialize_outside_layers(self, *, skip: Sequence[str] = ()) -> None:
        """Every parameter that is not in a decoder layer (and not under a path in ``skip``, e.g. ``lm_head``)."""
        for name, p in list(self.model.named_parameters()):  # a tied parameter once, under its first name
            if name.startswith(self.layers_path + ".") or any(name == s or name.startswith(s + ".") for s in skip) or not p.is_meta:
                continue
            if name not in self.files and self._is_tied_output(name):
                continue  # _retie gives it the embeddings' weight
            tied_to = [other for other, stored in self._tied.items() if stored == name]
            source = name if name in self.files else next((o for o in tied_to if o in self.files), name)
            self._set(self.model, name, self._tensor(source))
        self._retie()

    def _is_tied_output(self, name: str) -> bool:
        out = self.model.get_output_embeddings()
        tied = getattr(self.model.config.get_text_config(decoder=True), "tie_word_embeddings", False)
        return bool(tied) and out is not None and out.weight is self.model.get_parameter(name)

    def _retie(self) -> None:
        """Tied parameters share the tensor that was read (materializing one side replaced its Parameter object);
        an output projection tied to the embeddings (``tie_word_embeddings``) is the embeddings' weight."""
        for name, stored in self._tied.items():
            src_owner, _, src_leaf = stored.rpartition(".")
            dst_owner, _, dst_leaf = name.rpartition(".")
            src = self.model.get_submodule(src_owner)._parameters[src_leaf]
            if not src.is_meta:
                self.model.get_submodule(dst_owner)._parameters[dst_leaf] = src
        out, inp = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        tied = getattr(self.model.config.get_text_config(decoder=True), "tie_word_embeddings", False)
        if tied and out is not None and inp is not None and not inp.weight.is_meta:
            out._parameters["weight"] = inp.weight


def build_skeleton(checkpoint_dir: Path, dtype: torch.dtype, device: torch.device, attn_implementation: str) -> torch.nn.Module:
    """The model of ``checkpoint_dir`` with every parameter on the meta device and its buffers (RoPE tables) real.

    Buffers get ``dtype`` as ``load_model``'s ``model.to(dtype)`` gives them, so streamed and resident runs compute alike.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(checkpoint_dir), local_files_only=True)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    for mod in model.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None and not b.is_meta:
                mod._buffers[name] = b.to(device=device, dtype=dtype if b.is_floating_point() else b.dtype)
    return model.eval()


# --------------------------------------------------------------------------- running layer-major


@dataclass
class Job:
    """One forward of the resident pass to replay layer by layer: its input ids and the cache its layers write to.

    ``cache`` is the real cache (statistics or quantized); ``length_cache`` counts tokens for the recording pass
    (None: the real cache never grows, as the statistics cache, and the recording pass gets the real one).
    """

    input_ids: torch.Tensor
    cache: Any
    length_cache: LengthCache | None = None
    chunk: Chunk | None = None
    before_layer: Callable[[int], None] | None = None  # called before this job runs a layer (e.g. the reservoir draw)
    tag: str = ""  # the caller's name for the job (e.g. its KV format), for timing
    seconds: float = 0.0  # time its layers took


def record(model: torch.nn.Module, jobs: Sequence[Job]) -> None:
    """The recording pass: each job's layer-0 input and per-layer arguments, in job order (no decoder layer runs)."""
    path = decoder_layers_path(model)
    n = len(_get(model, path))
    base = model.base_model
    for job in jobs:
        sink: list[LayerCall] = []
        first: list[torch.Tensor] = []
        with _swapped_layers(model, [_Recorder(i, sink, first) for i in range(n)]):
            base(input_ids=job.input_ids, cache=job.length_cache if job.length_cache is not None else job.cache, use_cache=True)
        if len(sink) != n or len(first) != 1:
            raise TrtkvError(f"the recording pass saw {len(sink)} of {n} decoder layers", "run this model resident (--stream never)")
        job.chunk = Chunk(hidden=first[0], calls=sink)


def run_layer(layer: torch.nn.Module, index: int, jobs: Sequence[Job]) -> None:
    """Decoder layer ``index`` over every job, in order; each job's hidden states become the layer's output."""
    for job in jobs:
        assert job.chunk is not None, "record() first"
        kwargs = dict(job.chunk.calls[index].kwargs)
        if "cache" in kwargs:
            kwargs["cache"] = job.cache
        if job.before_layer is not None:
            job.before_layer(index)
        t0 = time.perf_counter()
        out = layer(job.chunk.hidden, **kwargs)
        job.chunk.hidden = out[0] if isinstance(out, tuple) else out
        job.seconds += time.perf_counter() - t0


def final_logits(model: torch.nn.Module, job: Job) -> torch.Tensor:
    """The model's own head (final norm, vocabulary projection, soft-cap) on a job's streamed hidden states."""
    assert job.chunk is not None
    n = len(_get(model, decoder_layers_path(model)))
    stand_ins = [_Replay(None) for _ in range(n - 1)] + [_Replay(job.chunk.hidden)]
    with _swapped_layers(model, stand_ins):
        return model(input_ids=job.input_ids, cache=LengthCache(n), use_cache=True).logits


def stream_layers(streamer: LayerStreamer, jobs: Sequence[Job], *, progress: Callable[[str], None] | None = None,
                  release_cache_layer: bool = False) -> None:
    """Every decoder layer over every job, layer-major; ``progress`` gets one line per layer."""
    layers = _get(streamer.model, streamer.layers_path)
    for i in range(streamer.num_layers):
        t0 = time.perf_counter()
        read0 = streamer.read_bytes
        prefix = streamer.layer_prefix(i)
        streamer.materialize(prefix)
        t_load = time.perf_counter() - t0
        try:
            run_layer(layers[i], i, jobs)
        finally:
            streamer.release(prefix)
        if release_cache_layer:
            for job in jobs:
                if isinstance(job.cache, Cache) and i < len(job.cache.layers):
                    job.cache.layers[i].reset()
        if progress is not None:
            progress(f"layer {i + 1}/{streamer.num_layers}: read {(streamer.read_bytes - read0) / 2**30:.2f} GiB in {t_load:.1f} s, "
                     f"{len(jobs)} forward(s) in {time.perf_counter() - t0 - t_load:.1f} s")


# --------------------------------------------------------------------------- loading


def load_streamed(spec: str, device: str = "auto", dtype: str | torch.dtype = "auto", *, tokenizer: Any = None,
                  attn_implementation: str = "sdpa") -> Any:
    """A ``LoadedModel`` whose ``model`` is a skeleton and whose ``streamer`` reads its layers on demand.

    The non-layer weights but the vocabulary projection are read now (``streamer.materialize_outside_layers()``
    reads that too, for logits). A gguf streams from its converted checkpoint (converted first if it is not cached).
    """
    from trtkv import models

    t0 = time.perf_counter()
    dev = models.resolve_device(device)
    dt = dtype if isinstance(dtype, torch.dtype) else models.resolve_dtype(dtype, dev)
    base = models.model_info(spec)
    attn_implementation = models.attention_implementation(base, attn_implementation)
    ckpt, from_cache = models.checkpoint_dir(spec, attn_implementation)
    model = build_skeleton(ckpt, dt, dev, attn_implementation)
    streamer = LayerStreamer(model, ckpt, dt, dev)
    streamer.materialize_outside_layers(skip=("lm_head",))
    tok = models.load_tokenizer(spec, tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
    if tok is None and models.has_tokenizer(ckpt):
        tok = models.load_tokenizer(str(ckpt))
    info = models.info_from_model(base, model)
    return models.LoadedModel(model=model, tokenizer=tok, info=info, device=dev, dtype=dt, checkpoint_dir=ckpt,
                              from_cache=from_cache, load_seconds=time.perf_counter() - t0, streamer=streamer)


def load_planned(model: str, info: Any, tok: Any, *, command: str, windows: tuple[int, int], activations: int, device: str,
                 dtype: str, stream: str, can_stream: bool, console: Any) -> Any:
    """``model`` loaded as the memory plan says (``trtkv.memory.choose_load``): resident, or streamed layer by layer
    (``load_streamed``); refused in one line before any weight is read when neither fits. Once every check has passed
    the command's first line (``windows``: how many, of how many tokens) and the plan's note go to ``console``, so an
    8B model says what it loads before minutes of work. ``activations``: the command's own working set in bytes."""
    from trtkv.memory import choose_load
    from trtkv.models import load_model, resolve_device

    plan = choose_load(info, resolve_device(device), dtype, activations=activations, can_stream=can_stream, stream=stream, command=command)
    n, seq_len = windows
    console.print(f"[bold]{command}[/] {info.name}: {info.shape()}, {info.num_params / 1e9:.2f} B parameters; {n} windows of "
                  f"{seq_len} tokens", highlight=False)
    if plan.note:
        console.print(f"note: {plan.note}", highlight=False)
    dt = str(plan.dtype).removeprefix("torch.")
    if plan.streamed:
        return load_streamed(model, device, dt, tokenizer=tok)
    return load_model(model, device=device, dtype=dt, tokenizer=tok)
