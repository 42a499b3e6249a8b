"""The torch engine: the transformers model, one batched forward per step, attention over the paged cache.

``TorchEngine.step(batch, cache)`` is the step contract of docs/kv-cache-format.md ("The engine step contract"), like
``OnnxRuntimeEngine``: the cache is read, never written; the runtime stores ``new_k / new_v`` and seals afterwards
(``PagedKVCache.write_new_rows``, through the engine's attention backend).

How: the model's attention function is swapped through transformers' attention registry
(``AttentionInterface.register(ATTN_NAME, ...)`` + ``config._attn_implementation``). The model's own projections,
RoPE, norms and MLP run unchanged on the whole padded ``[B, T]`` batch (or the lean decoder's, runtime/lean.py); each
attention layer calls ``paged_attention`` with the query, key and value after RoPE (``[B, heads, T, D]``), which
captures this step's K / V rows (fp16) into ``new_k / new_v [L, B, T, H, D]`` and hands the layer to the engine's
attention backend (``trtkv.attention``: the torch ops, trtkv's C kernels or the Triton kernels, resolved once from
``--attention`` when the engine is built), with the layer's sliding window and soft-cap as the model's attention module
passes them. Logits are taken at each sequence's last valid token (``new_lens - 1``) only. Compute dtype is the
model's (float32 on CPU). Supported: decoder-only families whose attention calls the registry with
``module.layer_idx`` (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, SmolLM2 ...).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AttentionInterface

from trtkv.attention import AttentionBackend, AttentionStep, resolve
from trtkv.errors import TrtkvError
from trtkv.families import of_model
from trtkv.manifest import EngineManifest, load_manifest
from trtkv.models import SLIDING_ATTENTION, load_model
from trtkv.runtime.engine import Engine
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.lean import LeanDecoder
from trtkv.runtime.step import StepBatch, StepOutput, StepSeals

ATTN_NAME = "trtkv_paged"
STEP_KWARG = "trtkv_step"  # the per-step context, passed through the model's **kwargs to the attention function


@dataclass
class _Step:
    """What every attention layer of one step needs; built once per step."""

    attention: AttentionBackend
    attn: AttentionStep  # the backend's own state of the step
    new_k: torch.Tensor  # [L, B, T, H, D] fp16, filled by the attention layers
    new_v: torch.Tensor


def load_plan(m: EngineManifest, device: torch.device, dtype: str | None = None, *, kv_bytes: int = 0):
    """The memory plan of opening engine ``m`` on ``device`` (``trtkv.memory.choose_load``), before a weight is read:
    the weights resident (default dtype: float32 on CPU when it fits, else bfloat16; bfloat16 on CUDA), the KV budget
    ``kv_bytes``, and the activations of the largest step the engine takes (``max_batch`` sequences x one block of new
    tokens over ``max_seq_len`` of context, last-token logits). Raises the one-line refusal when they do not fit."""
    lim = m.limits
    return _plan_load(m.model, device, dtype, kv_bytes=kv_bytes, max_batch=lim.max_batch, step_tokens=lim.max_new_tokens_per_step,
                      context=lim.max_seq_len)


def _plan_load(info, device, dtype=None, *, kv_bytes: int, max_batch: int, step_tokens: int, context: int):
    from trtkv.memory import activation_bytes, choose_load

    device = torch.device(device)
    request = dtype or ("auto" if device.type == "cpu" else "bfloat16")
    act = activation_bytes(info, batch=max_batch, seq_len=step_tokens, context=context, dtype=torch.float32, logits=False) \
        + max_batch * info.vocab_size * 4
    return choose_load(info, device, request, activations=act, kv=kv_bytes, can_stream=False, stream="never",
                       command=f"opening the torch engine of {info.name}")


def longest_context(info, device, *, max_batch: int, block_size: int, context: int) -> int | None:
    """The longest sequence (``context``, else halved, in whole blocks) an engine for ``max_batch`` sequences can be
    opened with on ``device``: ``load_plan``'s rule (the weights and the largest step's activations, which grow with
    the context, against what the process can have). None when not even one block fits: the weights alone do not fit
    ``device``, which then says nothing about the context (the engine will be opened on another machine)."""
    n = context
    while True:
        try:
            _plan_load(info, device, max_batch=max_batch, step_tokens=block_size, context=n, kv_bytes=0)
            return n
        except TrtkvError:
            if n <= block_size:
                return None
            n = max(block_size, (n // 2) // block_size * block_size)




class TorchEngine(Engine):
    """A transformers causal LM over trtkv's paged cache (see the module docstring)."""

    name = "torch"

    def __init__(self, model, manifest: EngineManifest | None = None, *, attention: str = "auto", device=None,
                 cuda_graphs: bool | None = None, lean: bool = True, kv_format=None):
        """``attention``: a backend's name, or ``auto`` (``trtkv.attention.resolve``: the first registered backend that
        runs the manifest's format and sizes on ``device``; without a manifest, ``kv_format``: the format of the caches
        it will step, when the caller knows it)."""
        self.model = model.eval()
        self.manifest = manifest
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.attention_backend = resolve(attention, self.device, manifest, kv_format)
        self.family = of_model(model)  # the family table's row: window rule, final soft-cap
        self.dtype = next(model.parameters()).dtype
        register_attention()
        self._configs = list({id(c): c for c in (model.config, _text_config(model.config))}.values())
        self._decoder = model.get_decoder()
        # the Llama family's layers in a fraction of the ops (runtime/lean.py); the others run transformers' modules
        self.lean = LeanDecoder(model, paged_attention) if lean and LeanDecoder.reason(model) is None else None
        self._head = model.get_output_embeddings()
        self._final_softcap = getattr(_text_config(model.config), "final_logit_softcapping", None) if self.family.final_softcap else None
        self._checked: PagedKVCache | None = None  # the last cache whose format this engine's attention was asked about
        # decode steps replay CUDA graphs captured per batch shape (default: on CUDA with a backend without host syncs;
        # on CPU ``cuda_graphs=True`` runs the same padded fixed-shape steps eagerly)
        self.cuda_graphs = (self.device.type == "cuda" and self.attention_backend.cuda_graphs) if cuda_graphs is None else cuda_graphs
        self._graphs: dict[tuple[int, int, int], _DecodeGraph] = {}
        self._graph_pool = None

    @property
    def attention(self) -> str:
        """The attention backend's name."""
        return self.attention_backend.name

    @property
    def runs_torch_on_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def cross_blocks(self) -> bool:
        """Whether a step may cross block boundaries (the scheduler then prefills a prompt in chunks of its token
        budget): a backend that seals the step's full blocks in the step, for a model without sliding layers (whose
        windows the in-step mask does not take). The step's outputs are those of block-by-block steps."""
        cfg = _text_config(self.model.config)
        return self.attention_backend.cross_blocks and SLIDING_ATTENTION not in self.family.layer_types(cfg, cfg.num_hidden_layers)

    def describe(self) -> str:
        return f"{self.name} engine on {self.device}, {self.attention_backend.describe()}" + (", lean forward" if self.lean is not None else "")

    @classmethod
    def from_engine_dir(cls, engine_dir: str | Path, *, device=None, dtype: str | None = None, attention: str = "auto",
                        manifest: EngineManifest | None = None, kv_bytes: int = 0) -> "TorchEngine":
        """Load the model an engine directory of backend ``torch`` references (path + sha256, checked); ``manifest``:
        the directory's, when the caller loaded it already; ``kv_bytes``: the KV budget the caller will allocate on
        the same device, counted in the memory plan made before the weights are read (``load_plan``)."""
        m = manifest or load_manifest(engine_dir)
        if m.backend != "torch":
            raise TrtkvError(f"{engine_dir} is a {m.backend} engine, not a torch one", "open it with its own backend, or rebuild with --backend torch")
        device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        resolve(attention, device, m)  # a refusal before the weights are read
        lp = load_plan(m, device, dtype, kv_bytes=kv_bytes)
        if lp.note:
            print(lp.note, file=sys.stderr)
        src = m.model.source if m.model.source and Path(m.model.source).exists() else m.model.name
        loaded = load_model(src, device=str(device), dtype=lp.dtype)
        if loaded.info.sha256 != m.model.sha256:
            raise TrtkvError(
                f"the weights at {src} (sha256 {loaded.info.sha256[:12]}...) are not the ones the engine was built for ({m.model.sha256[:12]}...)",
                "restore the original weights or rebuild the engine with `trtkv build-engine --backend torch --force`",
            )
        return cls(loaded.model, m, attention=attention, device=device)

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self, batch: StepBatch, cache: PagedKVCache) -> StepOutput:
        B, T = batch.input_ids.shape
        with self._paged_attention():
            if self.cuda_graphs and T == 1 and B <= GRAPH_BUCKETS[-1]:
                return self._graph_decode(batch, cache)
            return self._step(batch, cache)

    @contextmanager
    def _paged_attention(self):
        """The model's attention is trtkv's for the step only: the model stays usable by its owner between steps."""
        before = [c._attn_implementation for c in self._configs]
        for c in self._configs:
            c._attn_implementation = ATTN_NAME
        try:
            yield
        finally:
            for c, b in zip(self._configs, before):
                c._attn_implementation = b

    def _step(self, batch: StepBatch, cache: PagedKVCache) -> StepOutput:
        backend = self.attention_backend
        if self._checked is not cache:  # the capability table, for a cache this engine was not built with
            for r in backend.path.layout_reasons(cache.layout.fmt):
                raise TrtkvError(r, r.hint)
            cache.use_model_rope(self.model)  # keys stored before RoPE: read and sealed with each layer's table
            cache.seal_through(backend)  # the cache seals what this engine's attention reads
            self._checked = cache
        dev = self.device
        batch = StepBatch(*(t.to(dev) for t in (batch.input_ids, batch.context_lens, batch.new_lens, batch.block_tables, batch.slot_ids)))
        B, T = batch.input_ids.shape
        L, H, D = cache.num_layers, cache.layout.num_kv_heads, cache.layout.head_dim
        crossing = T > 1 and bool((batch.context_lens % cache.block_size + batch.new_lens > cache.block_size).any())
        if crossing and not (self.cross_blocks and cache.ring is None):
            raise TrtkvError(f"a step crosses a block boundary (block_size {cache.block_size}) and this engine ({self.attention} attention"
                             f"{', a window ring' if cache.ring is not None else ''}) takes one block per step",
                             "split prefills at block boundaries (trtkv.cache_layout.block_chunks)")
        ar = torch.arange(T, device=dev)
        st = _Step(backend, backend.begin(batch, cache, ar[None, :] < batch.new_lens[:, None], crossing),
                   new_k=torch.empty(L, B, T, H, D, dtype=torch.float16, device=dev), new_v=torch.empty(L, B, T, H, D, dtype=torch.float16, device=dev))
        positions = batch.context_lens[:, None] + ar[None, :]
        if self.lean is not None:
            hidden = self.lean(batch.input_ids, positions, **{STEP_KWARG: st})
        else:
            hidden = self._decoder(input_ids=batch.input_ids, position_ids=positions, use_cache=False, **{STEP_KWARG: st}).last_hidden_state
        hidden = hidden[torch.arange(B, device=dev), batch.new_lens - 1]
        logits = self._head(hidden).float()
        if self._final_softcap:  # Gemma 2: the causal-LM head caps its logits (the decoder + head bypass its forward)
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        return StepOutput(logits, st.new_k, st.new_v, self._seals(st.attn))

    @staticmethod
    def _seals(st: AttentionStep) -> StepSeals | None:
        """The blocks the step sealed for its later queries, for the pool to store as they are (``StepSeals``)."""
        if not st.in_step_codes:
            return None
        b, bs = st.batch, st.cache.block_size
        first = b.context_lens // bs
        count = ((b.context_lens + b.new_lens - 1) // bs - first).clamp(min=0)
        return StepSeals(first.tolist(), count.tolist(), st.in_step, dict(st.in_step_codes))

    # ------------------------------------------------------------------ CUDA graphs (decode)

    def graph_shape(self, batch: StepBatch) -> tuple[int, int]:
        """(rows, block-table columns) a decode batch is padded to and replayed at: powers of two (a graph per
        shape; the split-K decode grid grows with the columns, so they are not padded to the engine's maximum)."""
        rows = next(b for b in GRAPH_BUCKETS if b >= batch.batch_size)
        cols = 1 << max(0, int(batch.block_tables.shape[1]) - 1).bit_length()
        if self.manifest is not None:
            cols = max(min(cols, self.manifest.limits.max_blocks_per_seq), int(batch.block_tables.shape[1]))
        return rows, cols

    def _graph_decode(self, batch: StepBatch, cache: PagedKVCache) -> StepOutput:
        """Replay (capturing on first use) the decode graph of this batch's shape: the batch is copied into the
        graph's fixed input tensors, padded (``StepBatch.padded_to``), and the real rows of the outputs returned.
        Off CUDA the same padded step runs eagerly (what the tests check on CPU)."""
        B = batch.batch_size
        shape = self.graph_shape(batch)
        padded = batch.padded_to(*shape)
        o = self._replay(shape, padded, cache) if self.device.type == "cuda" else self._step(padded, cache)
        if o is None:  # capture failed: graphs are off from now on
            return self._step(batch, cache)
        return StepOutput(o.logits[:B].clone(), o.new_k[:, :B].clone(), o.new_v[:, :B].clone())

    def _replay(self, shape: tuple[int, int], padded: StepBatch, cache: PagedKVCache) -> StepOutput | None:  # pragma: no cover - CUDA only
        g = self._graphs.get((*shape, id(cache)))
        if g is None or g.cache is not cache:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()  # one memory pool for every graph: replays never overlap
            try:
                g = self._graphs[(*shape, id(cache))] = _DecodeGraph.capture(self, padded, cache, self._graph_pool)
            except Exception as e:  # a model whose forward cannot be captured
                warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); decoding without graphs", stacklevel=3)
                self.cuda_graphs = False
                return None
        for static, new in zip(dataclasses.astuple(g.inputs), dataclasses.astuple(padded)):
            static.copy_(new, non_blocking=True)
        g.graph.replay()
        return g.outputs


GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # decode batch sizes a CUDA graph is captured for


@dataclass
class _DecodeGraph:
    """One captured decode step: fixed input tensors, the graph, and the output tensors its replays overwrite."""

    cache: PagedKVCache  # the pools the graph reads (held: a graph must not outlive them)
    inputs: StepBatch
    graph: "torch.cuda.CUDAGraph"
    outputs: StepOutput

    @classmethod
    def capture(cls, engine: "TorchEngine", batch: StepBatch, cache: PagedKVCache, pool) -> "_DecodeGraph":  # pragma: no cover - CUDA only
        inputs = StepBatch(*(t.to(engine.device).clone() for t in dataclasses.astuple(batch)))
        side = torch.cuda.Stream(engine.device)
        side.wait_stream(torch.cuda.current_stream(engine.device))
        with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, the allocator fills its pools
            for _ in range(2):
                engine._step(inputs, cache)
        torch.cuda.current_stream(engine.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = engine._step(inputs, cache)
        return cls(cache, inputs, graph, outputs)




def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def paged_attention(module, query, key, value, attention_mask=None, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention function (registered as ``ATTN_NAME``): query ``[B, Hq, T, D]``, key / value
    ``[B, H, T, D]`` of this step after RoPE. Returns ``([B, T, Hq, D], None)``."""
    st: _Step | None = kwargs.get(STEP_KWARG)
    if st is None:
        raise TrtkvError("the trtkv paged attention runs only inside TorchEngine.step", "call the model through trtkv.runtime.torch_engine.TorchEngine")
    layer = module.layer_idx
    k16, v16 = key.to(torch.float16), value.to(torch.float16)  # attended as the fp16 values the open block will hold
    st.new_k[layer] = k16.transpose(1, 2)
    st.new_v[layer] = v16.transpose(1, 2)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    # each family's attention module says whether this layer is local and soft-capped (Mistral, Qwen2/3, Gemma 2/3)
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    cache = st.attn.cache
    if cache.is_ringed(layer) and window != cache.ring.window:  # the ring holds only what the cache's window covers
        raise TrtkvError(f"layer {layer} attends over a window of {window} but the cache keeps a ring for {cache.ring.window}",
                         "build the cache from the engine's manifest (WindowRing.of(manifest.model, block_size))")
    return st.attention.attend(st.attn, layer, query, k16, v16, scaling, window or None, softcap or None), None


_REGISTERED = False


def register_attention() -> None:
    """Register ``paged_attention`` with transformers (once per process)."""
    global _REGISTERED
    if not _REGISTERED:
        AttentionInterface.register(ATTN_NAME, paged_attention)
        _REGISTERED = True
