"""The torch engine: the transformers model, one batched forward per step, attention over the paged cache.

``TorchEngine.step(batch, cache)`` is the step contract of docs/kv-cache-format.md ("The engine step
contract"), like ``OnnxRuntimeEngine``: the cache is read, never written; the runtime stores
``new_k / new_v`` and seals afterwards (``PagedKVCache.write_new_rows``).

How: the model's attention function is swapped through transformers' attention registry
(``AttentionInterface.register(ATTN_NAME, ...)`` + ``config._attn_implementation``). The model's own
projections, RoPE, norms and MLP run unchanged on the whole padded ``[B, T]`` batch; each attention layer
calls ``paged_attention`` with the query, key and value after RoPE (``[B, heads, T, D]``). It

* captures this step's K / V rows (fp16) into ``new_k / new_v [L, B, T, H, D]``,
* attends over the sealed blocks, the sink rows, the slot's open block and this step's rows ``0 … t``
  rounded to fp16 (what the open block will hold), causal within the step:
  - ``attention="torch"`` (the CPU default): vectorized torch ops -- the batch's sealed blocks gathered with
    ``index_select``; where the format allows (the int4 / int8 presets) their scales folded into the query
    (keys) and the probabilities (values) so the codes are never dequantized, else ``trtkv.quant.dequantize``;
    one additive mask per step, GQA folded into the query axis;
  - ``attention="kernels"`` (the CUDA default): trtkv's Triton kernels through ``plugins.ops.decode_attention`` /
    ``prefill_attention`` (split-K decode for ``T == 1``, paged prefill otherwise; the layouts' ``TensorFormat``
    objects travel, no spec string is made or parsed per step); on CPU it runs under ``TRITON_INTERPRET=1``.

Logits are taken at each sequence's last valid token (``new_lens - 1``) only. Compute dtype is the
model's (float32 on CPU). Supported: decoder-only families whose attention calls the registry with
``module.layer_idx`` (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, SmolLM2 ...). A local layer's window and Gemma 2's
soft-capping arrive as the call's ``sliding_window`` / ``softcap``: the torch ops mask and cap, and so do the kernels
(their ``window`` / ``softcap`` arguments), which start at the first sealed block the window reaches. In a cache with a
window ring (``trtkv.cache_layout.WindowRing``, the runtime's default for such models) a local layer reads only the
ring blocks its window still covers: the torch ops through a view of the step (``_ring_view``) whose block table is
the ring's, the kernels through a logical block table whose column ``j`` is the ring block of sealed block ``j``
(``_ring_table``); otherwise a local layer reads the block tables' pool, the window masked.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from trtkv.cache_layout import PagedKVLayout, block_rope, sealing
from trtkv.errors import TrtkvError
from trtkv.families import of_model
from trtkv.manifest import EngineManifest, load_manifest
from trtkv.models import SLIDING_ATTENTION, load_model
from trtkv.plugins import cpu_attention, ops
from trtkv.plugins.contract.capabilities import CAPABILITIES, CPU_KERNELS, KERNEL_ATTENTION
from trtkv.quant import QuantizedTensor, TensorParams, dequantize, forward_transform, hadamard_matrix, inverse_transform
from trtkv.runtime.engine import Engine
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.lean import LeanDecoder
from trtkv.runtime.step import StepBatch, StepOutput, StepSeals

ATTN_NAME = "trtkv_paged"
STEP_KWARG = "trtkv_step"  # the per-step context, passed through the model's **kwargs to the attention function
ATTENTION_MODES = ("auto", "torch", "cpu", "kernels")


def _params_on(p: TensorParams, device: torch.device) -> TensorParams:
    moved = {f.name: (None if getattr(p, f.name) is None else getattr(p, f.name).to(device)) for f in dataclasses.fields(p)}
    return TensorParams(**moved)


@dataclass
class _Step:
    """What every attention layer of one step needs; built once per step."""

    engine: "TorchEngine"
    batch: StepBatch
    cache: PagedKVCache
    new_k: torch.Tensor  # [L, B, T, H, D] fp16, filled by the attention layers
    new_v: torch.Tensor
    valid: torch.Tensor  # [B, T] bool: real (not padding) new tokens
    # torch attention only
    mask: torch.Tensor | None = None  # [B, 1, T, C + T] bool
    kv_valid: torch.Tensor | None = None  # [B, C] bool: context keys that exist
    kv_invalid: torch.Tensor | None = None  # its negation
    sealed_all_valid: bool = True  # every sequence has sealed_max sealed blocks (nothing to zero)
    sealed_max: int = 0
    held: torch.Tensor | None = None  # [B] sealed blocks each sequence reads, from column 0 of its block table (torch / cpu)
    first_pos: torch.Tensor | None = None  # [B] position of sealed column 0's first row (a ring view: its first block)
    # the CPU kernels' per-step arguments, made by the first layer of each RoPE table (None: keys not stored before RoPE)
    cpu_decode: dict = dataclasses.field(default_factory=dict)
    open_max: int = 0
    cu_seqlens: torch.Tensor | None = None  # kernels, T > 1
    key_pos: torch.Tensor | None = None  # [B, C + T] positions of the mask's keys (torch attention)
    query_pos: torch.Tensor | None = None  # [B, T]
    window_masks: dict = dataclasses.field(default_factory=dict)  # sliding window -> its mask, built once per step
    biases: dict = dataclasses.field(default_factory=dict)  # window (None: global) -> additive mask (``_mask_bias``)
    blockwise: list | None = None  # a prefill's (sequence, query rows, key columns, mask) per query block (``_blockwise``)
    # a ring view's: [B] bool, True where gathered column 0 is the sequence's first block (its sink rows apply);
    # None: true for every sequence (the block tables start at block 0)
    sink_ok: torch.Tensor | None = None
    ring: "_Step | None" = None  # the view of this step the ringed (sliding) layers read, built once per step
    ring_table: torch.Tensor | None = None  # kernels: the ringed layers' logical block table (``_ring_table``)
    # a step across blocks (``TorchEngine.cross_blocks``): the blocks it seals, quantized in the step for the later
    # queries; ``in_step`` blocks per sequence at most, their rows gathered from [open block | step rows] by ``in_step_rows``
    in_step: int = 0
    in_step_rows: torch.Tensor | None = None  # [B, in_step * bs] column of [open_max + T] each in-step sealed row is
    in_step_first: torch.Tensor | None = None  # [B] bool: the step seals the sequence's first block (its sink rows apply)
    in_step_codes: dict = dataclasses.field(default_factory=dict)  # (layer, which) -> those blocks' codes (``StepSeals``)


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
        if attention not in ATTENTION_MODES:
            raise TrtkvError(f"unknown torch-engine attention {attention!r}", f"use one of {', '.join(ATTENTION_MODES)}")
        self.model = model.eval()
        self.manifest = manifest
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if attention == "auto":  # the kernels where they implement the model's attention and the engine's format, on CUDA;
            # on CPU trtkv's C kernels when this machine compiles them
            if self.device.type == "cuda":
                attention = "torch" if kernels_lack(model.config, manifest) else "kernels"
            else:  # (without a manifest, ``kv_format``: the format of the caches it will step, when the caller knows it)
                lacks = cpu_kernels_lack(manifest) or (kv_format is not None and CPU_KERNELS.layout_reasons(kv_format))
                attention = "torch" if cpu_attention.unavailable() or lacks else "cpu"
        if attention == "cpu":
            if self.device.type != "cpu":
                raise TrtkvError(f"--attention cpu runs on the CPU, not on {self.device}", "use --attention kernels or torch on a GPU")
            lack = cpu_kernels_lack(manifest)
            if lack:
                raise TrtkvError(f"trtkv's CPU attention kernels cannot run this engine: {lack}", "use --attention torch")
            cpu_attention.library()  # one line saying why, when they cannot be built here
        if manifest is not None:  # the capability table: a format this path does not read (codebooks, outliers, pre-RoPE keys)
            for r in CAPABILITIES[attention].layout_reasons(manifest.kv_format):
                raise TrtkvError(r, r.hint)
        self.attention = attention
        self.family = of_model(model)  # the family table's row: window rule, final soft-cap
        self._codecs: dict[int, list] = {}
        self.dtype = next(model.parameters()).dtype
        register_attention()
        self._configs = list({id(c): c for c in (model.config, _text_config(model.config))}.values())
        self._decoder = model.get_decoder()
        # the Llama family's layers in a fraction of the ops (runtime/lean.py); the others run transformers' modules
        self.lean = LeanDecoder(model, paged_attention) if lean and LeanDecoder.reason(model) is None else None
        self._head = model.get_output_embeddings()
        self._final_softcap = getattr(_text_config(model.config), "final_logit_softcapping", None) if self.family.final_softcap else None
        self._params: dict[int, list[TensorParams]] = {}
        self._checked: PagedKVCache | None = None  # the last cache whose format this engine's attention was asked about
        # decode steps replay CUDA graphs captured per batch shape (default: on CUDA with the kernels; on CPU
        # ``cuda_graphs=True`` runs the same padded fixed-shape steps eagerly)
        self.cuda_graphs = (self.device.type == "cuda" and self.attention == "kernels") if cuda_graphs is None else cuda_graphs
        self._graphs: dict[tuple[int, int, int], _DecodeGraph] = {}
        self._graph_pool = None

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
        if self._checked is not cache:  # the capability table, for a cache this engine was not built with
            for r in CAPABILITIES[self.attention].layout_reasons(cache.layout.fmt):
                raise TrtkvError(r, r.hint)
            cache.use_model_rope(self.model)  # keys stored before RoPE: read and sealed with each layer's table
            self._checked = cache
        dev = self.device
        batch = StepBatch(*(t.to(dev) for t in (batch.input_ids, batch.context_lens, batch.new_lens, batch.block_tables, batch.slot_ids)))
        B, T = batch.input_ids.shape
        L, H, D = cache.num_layers, cache.layout.num_kv_heads, cache.layout.head_dim
        ar = torch.arange(T, device=dev)
        st = _Step(
            engine=self, batch=batch, cache=cache,
            new_k=torch.empty(L, B, T, H, D, dtype=torch.float16, device=dev),
            new_v=torch.empty(L, B, T, H, D, dtype=torch.float16, device=dev),
            valid=ar[None, :] < batch.new_lens[:, None],
        )
        crossing = T > 1 and bool((batch.context_lens % cache.block_size + batch.new_lens > cache.block_size).any())
        if crossing and not (self.cross_blocks and cache.ring is None):
            raise TrtkvError(f"a step crosses a block boundary (block_size {cache.block_size}) and this engine ({self.attention} attention"
                             f"{', a window ring' if cache.ring is not None else ''}) takes one block per step",
                             "split prefills at block boundaries (trtkv.cache_layout.block_chunks)")
        if self.attention in ("torch", "cpu"):
            self._torch_masks(st)
            if crossing:
                self._in_step_masks(st)
        elif T > 1:
            st.cu_seqlens = F.pad(batch.new_lens.cumsum(0), (1, 0)).to(torch.int32)
        positions = batch.context_lens[:, None] + ar[None, :]
        if self.lean is not None:
            hidden = self.lean(batch.input_ids, positions, **{STEP_KWARG: st})
        else:
            hidden = self._decoder(input_ids=batch.input_ids, position_ids=positions, use_cache=False, **{STEP_KWARG: st}).last_hidden_state
        hidden = hidden[torch.arange(B, device=dev), batch.new_lens - 1]
        logits = self._head(hidden).float()
        if self._final_softcap:  # Gemma 2: the causal-LM head caps its logits (the decoder + head bypass its forward)
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        return StepOutput(logits, st.new_k, st.new_v, self._seals(st))

    @staticmethod
    def _seals(st: _Step) -> StepSeals | None:
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

    def layer_params(self, cache: PagedKVCache, layer: int) -> tuple[TensorParams, TensorParams]:
        """The cache's KV constants of ``layer`` on the engine's device (moved once per cache)."""
        got = self._params.get(id(cache))
        if got is None:
            got = [(_params_on(p.k, self.device), _params_on(p.v, self.device)) for p in cache.params]
            self._params = {id(cache): got}
        return got[layer]

    def layer_codecs(self, cache: PagedKVCache, layer: int) -> tuple:
        """The CPU kernels' row codecs of ``layer``'s K and V (``cpu_attention.RowCodec``), made once per cache."""
        got = self._codecs.get(id(cache))
        if got is None:
            lay = cache.layout
            got = [tuple(cpu_attention.RowCodec.of(cache.layout_of(i).tensor_format(w), self.layer_params(cache, i)[j], lay.num_kv_heads,
                                                   lay.head_dim, lay.block_size) for j, w in enumerate("kv")) for i in range(cache.num_layers)]
            self._codecs = {id(cache): got}
        return got[layer]

    def _torch_masks(self, st: _Step, first: torch.Tensor | None = None) -> None:
        """Key validity and the [B, 1, T, C + T] attention mask of the torch path (C: gathered context keys); ``first``
        [B]: the gathered sealed blocks start at each sequence's block ``first`` (a ring view), not block 0."""
        b, bs = st.batch, st.cache.block_size
        sealed = b.context_lens // bs
        opened = b.context_lens - sealed * bs
        held = sealed if first is None else sealed - first
        st.sealed_max, st.open_max = int(held.max()), int(opened.max())
        st.held = held
        st.first_pos = torch.zeros_like(held) if first is None else first * bs
        dev = self.device
        kv_valid = []
        if st.sealed_max:
            kv_valid.append(torch.arange(st.sealed_max * bs, device=dev)[None, :] < (held * bs)[:, None])
        if st.open_max:
            kv_valid.append(torch.arange(st.open_max, device=dev)[None, :] < opened[:, None])
        B, T = b.input_ids.shape
        st.kv_valid = torch.cat(kv_valid, 1) if kv_valid else torch.zeros(B, 0, dtype=torch.bool, device=dev)
        st.kv_invalid = ~st.kv_valid
        st.sealed_all_valid = bool((held == st.sealed_max).all())
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        st.mask = torch.cat([st.kv_valid[:, None, :].expand(B, T, -1), causal[None].expand(B, T, T)], 2)[:, None]
        # positions of the keys in that order (sealed j -> j; open row i -> sealed tokens + i; new row t -> context + t)
        # and of the queries: what a sliding window compares
        keys = [torch.arange(st.sealed_max * bs, device=dev).expand(B, -1) + (0 if first is None else first[:, None] * bs),
                (sealed * bs)[:, None] + torch.arange(st.open_max, device=dev)[None, :],
                b.context_lens[:, None] + torch.arange(T, device=dev)[None, :]]
        st.key_pos = torch.cat(keys, 1)
        st.query_pos = keys[2]

    @property
    def cross_blocks(self) -> bool:
        """Whether a step may cross block boundaries (the scheduler then prefills a prompt in chunks of its token
        budget): the CPU kernels' prefill seals the step's full blocks in the step, for a model without sliding layers
        (whose windows the in-step mask does not take). The step's outputs are those of block-by-block steps."""
        cfg = _text_config(self.model.config)
        return self.attention == "cpu" and SLIDING_ATTENTION not in self.family.layer_types(cfg, cfg.num_hidden_layers)

    def _in_step_masks(self, st: _Step) -> None:
        """A step across blocks: the mask of ``_torch_masks`` grown by the blocks the step seals. Each query sees the
        sealed blocks from before the step, the blocks the step seals before its own block *quantized* (as the seal
        will store them; ``in_step`` more columns per block), and its own block in fp16 (the open rows only from the
        step's first block, this step's rows of its block up to itself). Where the step seals a sequence's first
        block, later queries read its first ``sink_tokens`` positions in fp16 (the sink rows) instead."""
        b, bs, dev = st.batch, st.cache.block_size, self.device
        B, T = b.input_ids.shape
        ctx = b.context_lens
        j0, opened = ctx // bs, ctx % bs
        ar = torch.arange(T, device=dev)
        jq = (ctx[:, None] + ar[None, :]) // bs  # [B, T] each query's block (and each new row's)
        st.in_step = n = int(((ctx + b.new_lens - 1) // bs - j0).max())
        S, O = st.sealed_max * bs, st.open_max
        base = st.mask[:, 0]  # [B, T, S + O + T]
        open_vis = base[:, :, S : S + O] & (jq == j0[:, None])[:, :, None]
        new_vis = base[:, :, S + O :] & (jq[:, None, :] == jq[:, :, None])
        blocks = j0[:, None] + torch.arange(n, device=dev)[None, :]  # [B, n] the in-step sealed blocks
        quant_vis = (blocks[:, None, :] < jq[:, :, None])[..., None].expand(B, T, n, bs).reshape(B, T, n * bs)
        sink = st.cache.layout.sink_tokens
        st.in_step_first = j0 == 0
        if sink:  # a first block sealed in the step: positions < sink from the fp16 rows for the queries past it
            later = (jq >= 1) & st.in_step_first[:, None]  # [B, T]
            quant_vis = quant_vis.clone()
            quant_vis[:, :, :sink] &= ~later[:, :, None]
            pos_open = torch.arange(O, device=dev)
            sink_open = pos_open[None, :] < opened.clamp(max=sink)[:, None]  # [B, O] open rows at positions < sink
            open_vis = open_vis | (later[:, :, None] & sink_open[:, None, :] & base[:, :, S : S + O])
            new_pos = ctx[:, None] + ar[None, :]  # [B, T]
            new_vis = new_vis | (later[:, :, None] & (new_pos < sink)[:, None, :] & base[:, :, S + O :])
        st.mask = torch.cat([base[:, :, :S], open_vis, new_vis, quant_vis], 2)[:, None]
        rho = torch.arange(n * bs, device=dev)[None, :]  # in-step row -> its column of [open rows | step rows]
        st.in_step_rows = torch.where(rho < opened[:, None], rho, O + rho - opened[:, None]).clamp(max=O + T - 1)

    def _ring_view(self, st: _Step) -> _Step:
        """The step as a ringed layer reads it: each sequence's sealed blocks from ``first_block`` (the first its window
        covers) on, addressed in the ring (``WindowRing.block``), with their own mask and key positions."""
        if st.ring is None:
            ring, b = st.cache.ring, st.batch
            sealed = b.context_lens // ring.block_size
            first = ring.first_block(b.context_lens)
            cols = first[:, None] + torch.arange(max(1, int((sealed - first).max())), device=self.device)[None, :]
            tables = ring.block(b.slot_ids[:, None], cols)  # columns past a sequence's sealed blocks are masked
            view = _Step(engine=self, batch=StepBatch(b.input_ids, b.context_lens, b.new_lens, tables, b.slot_ids), cache=st.cache,
                         new_k=st.new_k, new_v=st.new_v, valid=st.valid, sink_ok=first == 0)
            self._torch_masks(view, first)
            st.ring = view
        return st.ring

    @staticmethod
    def window_mask(st: _Step, window: int) -> torch.Tensor:
        """``st.mask`` of a local layer: also ``key position > query position - window`` (transformers' rule)."""
        got = st.window_masks.get(window)
        if got is None:
            inside = st.key_pos[:, None, :] > (st.query_pos - window)[:, :, None]  # [B, T, C + T]
            got = st.window_masks[window] = st.mask & inside[:, None]
        return got


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


def kernels_lack(config, manifest: EngineManifest | None = None) -> str | None:
    """What of this model's attention (and of the engine's KV format / layout) trtkv's kernels do not implement
    (None: nothing): such engines run the torch ops, on CUDA too."""
    # the capability table's ``kernels`` row; sliding windows (a window ring included) and attention-logit
    # soft-capping are the kernels' own, so the model's config adds no reason
    if manifest is None:
        return None
    reasons = KERNEL_ATTENTION.reasons(manifest.kv_format, None, manifest.limits.block_size, manifest.model.head_dim)
    return reasons[0] if reasons else None


def cpu_kernels_lack(manifest: EngineManifest | None) -> str | None:
    """What of the engine's KV format or sizes trtkv's CPU kernels do not take (the capability table's ``cpu`` row)."""
    if manifest is None:
        return None
    reasons = CPU_KERNELS.reasons(manifest.kv_format, None, manifest.limits.block_size, manifest.model.head_dim)
    return reasons[0] if reasons else None


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def context_kv(st: _Step, layer: int, which: str, new_rows: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Every sequence's keys (or values), the batched form of ``cache_layout.gather_paged``, in two parts:

    * sealed ``[B, sealed_max, H, block_size, D]`` (block-major as in the pool; None when no sequence has a sealed block): dequantized but left
      in the format's **stored channel space** (smoothed / rotated: ``dequantize(..., transforms=False)``), the
      caller folds the transforms into the query and the output instead of undoing them on every row; positions
      ``< sink`` from the sink rows (moved into stored space). Keys stored before RoPE (``prerope``, ``unfolded``)
      come back in model space instead: transforms undone and RoPE applied at each row's position;
    * the rest ``[B, H, open_max + T, D]`` in model space: the open block, then this step's rows ``new_rows``.

    Context rows that do not exist are zero (``st.kv_valid`` says which exist)."""
    cache, b = st.cache, st.batch
    lay: PagedKVLayout = cache.layout_of(layer)
    pool = cache.pool(layer, which)
    fmt = lay.tensor_format(which)
    params = st.engine.layer_params(cache, layer)[0 if which == "k" else 1]
    bs, sink, H, D = lay.block_size, lay.sink_tokens, lay.num_kv_heads, lay.head_dim
    B, dtype = b.batch_size, new_rows.dtype
    S = st.sealed_max * bs
    sealed = None
    if st.sealed_max:
        nb = st.sealed_max
        rope = None
        if fmt.pre_rope:  # keys stored before RoPE: back in model space, rotated at their positions (no fold)
            first = st.first_pos[:, None] + torch.arange(nb, device=st.first_pos.device)[None, :] * bs
            rope = block_rope(cache.rope_for(layer, fmt), first.reshape(-1), bs)
        x = dequantize(sealed_blocks(st, pool), fmt, params, head_axis=-3, dtype=dtype, transforms=rope is not None, rope=rope)
        sealed = x.view(B, nb, H, bs, D)  # block-major, as stored: no transpose copy
        if sink:
            rows = lay.sink_rows(pool.tail)[b.slot_ids].to(dtype)
            rows = rows if fmt.pre_rope else forward_transform(rows, fmt, params, head_axis=-3)
            sealed[:, 0, :, :sink] = _where_sink(st, rows, sealed[:, 0, :, :sink])
        if not st.sealed_all_valid:  # other owners' blocks may hold NaN
            sealed.masked_fill_(st.kv_invalid[:, :S].view(B, nb, 1, bs, 1), 0)
    return sealed, _open_rows(st, layer, which, new_rows)


def _open_rows(st: _Step, layer: int, which: str, new_rows: torch.Tensor) -> torch.Tensor:
    """``[B, H, open_max + T, D]`` in model space: each slot's open block (stale rows zeroed), then ``new_rows``."""
    pool = st.cache.pool(layer, which)
    rest = torch.cat([st.cache.layout_of(layer).open_rows(pool.tail, st.open_max)[st.batch.slot_ids].to(new_rows.dtype), new_rows], 2)
    if st.open_max:
        rest[:, :, : st.open_max].masked_fill_(st.kv_invalid[:, None, st.sealed_max * st.cache.block_size :, None], 0)  # stale tail rows
    return rest


def sealed_blocks(st: _Step, pool) -> QuantizedTensor:
    """The batch's first ``sealed_max`` blocks of ``pool``, gathered [B * sealed_max, ...] (``index_select``: the
    advanced-index gather is 10-30x slower on CPU). Table entries < 0 read block 0; callers mask them."""
    flat = st.batch.block_tables[:, : st.sealed_max].clamp(min=0).reshape(-1)
    return QuantizedTensor(*(None if t is None else t.index_select(0, flat)
                             for t in (pool.data, pool.scale, pool.zero, pool.outlier_index, pool.outlier_value)))


def _where_sink(st: _Step, from_sink: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """``from_sink`` (computed from the sink rows) for the sequences whose gathered column 0 is their first block,
    ``gathered`` for the others (a ring view past the window's first block: no sink rows apply)."""
    if st.sink_ok is None:
        return from_sink
    return torch.where(st.sink_ok.view(-1, *(1,) * (from_sink.dim() - 1)), from_sink, gathered)


def folds_key_scales(fmt) -> bool:
    """Keys whose integer codes have one scale (+ zero) per channel per sealed block: attention folds the scales
    into the query (``(q * s) . c + q . z``) instead of dequantizing every key (the int4 / int8 presets)."""
    return fmt.is_quantized and fmt.is_block_wise and fmt.traits.is_int and len(fmt.traits.planes) <= 1 and not unfolded(fmt)


def unfolded(fmt) -> bool:
    """A format whose sealed rows are dequantized whole (``context_kv``), not folded into the query or probabilities:
    codes through a codebook, outlier lists written over the codes, keys stored before RoPE, rows of per-channel widths."""
    return bool(fmt.codebook or fmt.outliers or fmt.pre_rope or fmt.allocated_bits is not None)


def _shift(fmt, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor | None:
    """``z - off * s``: what ``(c - off) * s + z`` adds to ``c * s`` (None: nothing)."""
    off = fmt.traits.offset(fmt.symmetric)
    if off:
        return -off * scale if zero is None else zero - off * scale
    return zero


def _fields(fmt, codes: torch.Tensor, shape) -> list[torch.Tensor]:
    """The stored codes as float fields ``shape[:-1] + [D / n]`` (``DtypeTraits.code_fields``: channel ``i::n``)."""
    fields = fmt.traits.code_fields(codes)
    return [f.float().view(*shape[:-1], shape[-1] // len(fields)) for f in fields]


def _folded_key_scores(st: _Step, layer: int, qs: torch.Tensor) -> torch.Tensor:
    """Scores ``[B, nb, H, n, bs]`` of the query ``qs`` [B, H, n, D] (stored channel space) against the sealed keys,
    without dequantizing them: ``(c - off) * s + z`` per channel per block is folded into the query, and packed
    codes enter the product field by field (int4: the even channels' nibbles, then the odd ones')."""
    cache, fmt = st.cache, st.cache.layout_of(layer).tensor_format("k")
    B, H, n, D = qs.shape
    qt = sealed_blocks(st, cache.pool(layer, "k"))
    nb = st.sealed_max
    fields = _fields(fmt, qt.codes, (B, nb, H, -1, D))
    scale = qt.scale.float().view(B, nb, H, 1, D)
    shift = _shift(fmt, scale, None if qt.zero is None else qt.zero.float().view(B, nb, H, 1, D))
    if not st.sealed_all_valid:  # blocks past a sequence's sealed ones are other owners': their scales may be NaN
        bs = qt.codes.shape[-2]
        invalid = st.kv_invalid[:, : nb * bs].view(B, nb, bs)[:, :, :1].view(B, nb, 1, 1, 1)
        scale = scale.masked_fill(invalid, 0)
        shift = None if shift is None else shift.masked_fill(invalid, 0)
    qb = qs[:, None]  # [B, 1, H, n, D]
    qsc = qb * scale
    per = len(fields)
    # (a strided query slice would send bmm down its per-matrix loop: 30x slower; the copy is small)
    scores = qsc @ fields[0].transpose(-1, -2) if per == 1 else sum(qsc[..., i::per].contiguous() @ f.transpose(-1, -2) for i, f in enumerate(fields))
    return scores if shift is None else scores + (qb * shift).sum(-1, keepdim=True)


def folds_value_scales(fmt) -> bool:
    """Values whose integer codes have a scale (+ zero) per token (group): attention folds the scales into the
    probabilities (``sum_t p_t s_t c_t``) instead of dequantizing every value (the int4 / int8 presets)."""
    return (fmt.is_quantized and fmt.traits.is_int and not fmt.is_static and not fmt.is_block_wise and len(fmt.traits.planes) <= 1
            and not unfolded(fmt))


def _folded_value_output(st: _Step, layer: int, ps: torch.Tensor, params: TensorParams) -> torch.Tensor:
    """``sum_t p_t v_t`` [B, H, n, D] (model space) over the sealed values for block-major probabilities ``ps``
    [B, nb, H, n, bs], without dequantizing them: ``v = (c - off) * s + z`` per token (group) gives
    ``sum_t (p_t s_t) c_t + sum_t p_t (z_t - off * s_t)``. Positions ``< sink`` come from the sink rows."""
    lay = st.cache.layout_of(layer)
    fmt = lay.tensor_format("v")
    pool = st.cache.pool(layer, "v")
    B, nb, H, n, bs = ps.shape
    D, sink = lay.head_dim, lay.sink_tokens
    groups = fmt.groups(D)
    qt = sealed_blocks(st, pool)
    fields = _fields(fmt, qt.codes, (B, nb, H, bs, D))
    scale = qt.scale.float().view(B, nb, H, bs, groups)
    shift = _shift(fmt, scale, None if qt.zero is None else qt.zero.float().view(B, nb, H, bs, groups))
    if not st.sealed_all_valid:  # other owners' blocks may hold NaN scales; their probabilities are 0
        invalid = st.kv_invalid[:, : nb * bs].view(B, nb, 1, bs, 1)
        scale = scale.masked_fill(invalid, 0)
        shift = None if shift is None else shift.masked_fill(invalid, 0)
    p_sink = None
    if sink:  # the sink positions' probabilities go to the sink rows (where column 0 is the sequence's first block)
        p_sink = _where_sink(st, ps[:, 0, :, :, :sink], torch.zeros_like(ps[:, 0, :, :, :sink]))
        ps = ps.clone()
        ps[:, 0, :, :, :sink] -= p_sink
    per = len(fields)
    if groups == 1:  # one scale per token: into the probabilities
        w = ps * scale[..., 0][:, :, :, None]  # [B, nb, H, n, bs]
    else:  # a scale per group of channels: onto the (fresh float) codes in place, cheaper than a product per group
        w, gw = ps, D // groups // per  # channels of one group in one field
        for f in fields:
            f.view(B, nb, H, bs, groups, gw).mul_(scale[..., None])
    out = ps.new_empty(B, nb, H, n, D // per, per)
    for i, f in enumerate(fields):
        out[..., i] = w @ f
    out = out.view(B, nb, H, n, D).sum(1)
    if shift is not None:
        out = out + torch.einsum("xbhnt,xbhtg->xhng", ps, shift).repeat_interleave(D // groups, -1)
    out = inverse_transform(out, fmt, params, head_axis=-3)
    if p_sink is not None:
        rows = lay.sink_rows(pool.tail)[st.batch.slot_ids].to(out.dtype)
        if not st.sealed_all_valid:  # a slot without a sealed block holds stale sink rows
            rows = rows.masked_fill(st.kv_invalid[:, None, :sink, None], 0)
        out = out + p_sink @ rows
    return out


def _fold_query(q: torch.Tensor, fmt, params: TensorParams) -> torch.Tensor:
    """q [B, H, n, D] such that ``fold(q) . k_stored == q . k_model`` for ``k_model = inverse_transform(k_stored)``
    = ``(k_stored @ H^T) * smooth``: ``(q * smooth) @ H`` (the transpose of ``trtkv.quant.inverse_transform``)."""
    if fmt.smooth:
        q = q * params.smooth.to(q.dtype).view(1, q.shape[1], 1, q.shape[-1])
    if fmt.hadamard:
        q = q @ hadamard_matrix(q.shape[-1], q.dtype, q.device)
    return q


def _torch_attention(st: _Step, layer: int, q, k16, v16, scaling: float, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """Softmax attention over [sealed (stored space) | open block + new rows (model space)] keys: K's transforms
    folded into the query for the sealed part, V's undone once on the sealed part's output. GQA by folding each KV
    head's query group into the query axis (no K/V repeat)."""
    B, Hq, T, D = q.shape
    H = k16.shape[1]
    G = Hq // H
    lay = st.cache.layout_of(layer)
    kp, vp = st.engine.layer_params(st.cache, layer)
    qg = q.reshape(B, H, G * T, D)
    kfmt = lay.tensor_format("k")
    if st.sealed_max and folds_key_scales(kfmt):
        ks, kr = None, _open_rows(st, layer, "k", k16)
        sealed = _folded_key_scores(st, layer, _fold_query(qg, kfmt, kp))
        if lay.sink_tokens:  # the first block's first rows are read from the sink rows (model space, fp16)
            sink = lay.sink_rows(st.cache.pool(layer, "k").tail)[st.batch.slot_ids].to(qg.dtype)
            if not st.sealed_all_valid:  # a slot without a sealed block holds stale sink rows
                sink = sink.masked_fill(st.kv_invalid[:, None, : lay.sink_tokens, None], 0)
            sealed[:, 0, :, :, : lay.sink_tokens] = _where_sink(st, qg @ sink.transpose(-1, -2), sealed[:, 0, :, :, : lay.sink_tokens])
    else:
        ks, kr = context_kv(st, layer, "k", k16)
        sealed = None if ks is None else (qg if kfmt.pre_rope else _fold_query(qg, kfmt, kp))[:, None] @ ks.transpose(-1, -2)
    vfmt = lay.tensor_format("v")
    fold_v = bool(st.sealed_max) and folds_value_scales(vfmt)
    vs, vr = (None, _open_rows(st, layer, "v", v16)) if fold_v else context_kv(st, layer, "v", v16)
    scores = qg @ kr.transpose(-1, -2)
    S = 0
    if sealed is not None:  # [B, 1, H, n, D] @ [B, nb, H, D, bs] -> [B, nb, H, n, bs] -> [B, H, n, nb * bs]
        nb, bs = sealed.shape[1], sealed.shape[4]
        S = nb * bs
        scores = torch.cat([sealed.permute(0, 2, 3, 1, 4).reshape(B, H, G * T, S), scores], -1)
    scores = scores * scaling
    if softcap:  # Gemma 2: cap * tanh(scores / cap), before the mask (as transformers does)
        scores = torch.tanh(scores / softcap) * softcap
    p = (scores + _mask_bias(st, window, G, scores.dtype)).softmax(-1)
    out = p[..., S:] @ vr
    if S:
        ps = p[..., :S].reshape(B, H, G * T, nb, bs).permute(0, 3, 1, 2, 4)  # block-major [B, nb, H, n, bs]
        if fold_v:
            out = out + _folded_value_output(st, layer, ps, vp)
        else:  # [B, nb, H, n, bs] @ [B, nb, H, bs, D], summed over blocks
            out = out + inverse_transform((ps @ vs).sum(1), vfmt, vp, head_axis=-3)
    return out.view(B, Hq, T, D).transpose(1, 2)  # [B, T, Hq, D]


def _cpu_attention(st: _Step, layer: int, q, k16, v16, scaling: float, window: int | None = None,
                   softcap: float | None = None) -> torch.Tensor:
    """The attention of ``_torch_attention`` with the sealed blocks read by trtkv's CPU kernels (``plugins/cpu_attention.c``)
    straight from the pools. A decode step (one token per sequence) is one kernel call per layer (``_cpu_decode``). A
    prefill chunk runs in model space: the kernels dequantize the sealed rows into one buffer with the formats'
    transforms undone (butterflies in registers: no product with the rotation for the query, the output or the open
    rows), the open block and this step's rows follow them there, and one fused ``scaled_dot_product_attention`` (the
    explicit softmax for a soft-capped model) with the step's mask gives the output."""
    B, Hq, T, D = q.shape
    H = k16.shape[1]
    G = Hq // H
    lay = st.cache.layout_of(layer)
    kc, vc = st.engine.layer_codecs(st.cache, layer)
    qg = q.reshape(B, H, G * T, D)
    if T == 1:
        return _cpu_decode(st, layer, lay, qg, k16, v16, kc, vc, scaling, window, softcap).view(B, Hq, T, D).transpose(1, 2)
    keys = _context_rows(st, layer, lay, "k", k16, kc)
    values = _context_rows(st, layer, lay, "v", v16, vc)
    if window is None and not softcap:  # every prefill chunk, so that a chunk's numbers never depend on where it began
        return _blockwise(st, lay, qg.contiguous(), keys, values, scaling).view(B, Hq, T, D).transpose(1, 2)
    bias = _mask_bias(st, window, G, qg.dtype)
    if softcap:  # Gemma 2: cap * tanh(scores / cap) before the mask, which the fused attention cannot
        scores = torch.tanh(qg @ keys.transpose(-1, -2) * (scaling / softcap)) * softcap
        out = (scores + bias).softmax(-1) @ values
    else:
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=bias, scale=scaling)
    return out.view(B, Hq, T, D).transpose(1, 2)


def _blockwise(st: _Step, lay: PagedKVLayout, qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """A prefill chunk attended one sequence and one query block at a time, over that block's keys in position order --
    the sealed blocks before it (the pool's, then those a step across blocks seals, as the seal stores them) and its
    own block's fp16 rows -- with the causal mask of its own block. The call for a query block is the same whatever
    the chunk it is part of began with (a prefix-cache hit, block-by-block steps, a step across blocks, other
    sequences in the batch): the same shapes, values and column order, so the same bits (a fused attention over the
    whole padded chunk sums its keys in an order that depends on the chunk's layout). ``keys`` / ``values`` are
    ``_context_rows``' ``[B, H, S + O + T (+ in_step * bs), D]``; padding rows are left zero; returns ``[B, H, G * T, D]``."""
    B, H, GT, D = qg.shape
    T = int(st.batch.input_ids.shape[1])
    G = GT // T
    if st.blockwise is None:  # the same for every layer: made once per step
        st.blockwise = _blockwise_plan(st, lay, G, qg.dtype)
    out = torch.zeros_like(qg)
    qv, ov = qg.view(B, H, G, T, D), out.view(B, H, G, T, D)
    for i, t, t1, cols, bias in st.blockwise:
        rows = t1 - t
        q = qv[i : i + 1, :, :, t:t1].reshape(1, H, G * rows, D)
        got = F.scaled_dot_product_attention(q, keys[i : i + 1].index_select(2, cols), values[i : i + 1].index_select(2, cols),
                                             attn_mask=bias, scale=scaling)
        ov[i, :, :, t:t1] = got.view(H, G, rows, D)
    return out


def _blockwise_plan(st: _Step, lay: PagedKVLayout, G: int, dtype) -> list:
    """``(sequence, first row, end row, key columns, additive mask)`` of each query block of the step (``_blockwise``)."""
    b, bs = st.batch, st.cache.block_size
    T = int(b.input_ids.shape[1])
    S, O = st.sealed_max * bs, st.open_max
    first_in_step = S + O + T  # the column of the step's first sealed block
    plan = []
    for i, (ctx, n, held) in enumerate(zip(b.context_lens.tolist(), b.new_lens.tolist(), st.held.tolist())):
        opened, j0 = ctx % bs, ctx // bs
        t = 0
        while t < n:
            k = (ctx + t) // bs - j0  # the query block, counted from the step's first
            t1 = min(n, (j0 + k + 1) * bs - ctx)
            own = [*range(S, S + opened), *range(S + O, S + O + t1)] if k == 0 else [*range(S + O + t, S + O + t1)]
            cols = [*range(held * bs), *range(first_in_step, first_in_step + k * bs), *own]
            if lay.sink_tokens and j0 == 0 and k:  # the step sealed the first block: its sink positions are read in fp16
                cols[: lay.sink_tokens] = [S + p if p < opened else S + O + p - opened for p in range(lay.sink_tokens)]
            rows, C = t1 - t, len(cols)
            visible = torch.cat([torch.ones(rows, C - rows, dtype=torch.bool), torch.ones(rows, rows, dtype=torch.bool).tril()], 1)
            bias = torch.zeros(rows, C, dtype=dtype).masked_fill_(~visible, float("-inf"))
            bias = bias[None].expand(G, rows, C).reshape(1, 1, G * rows, C).to(st.engine.device)
            plan.append((i, t, t1, torch.tensor(cols, device=st.engine.device), bias))
            t = t1
    return plan


def _context_rows(st: _Step, layer: int, lay: PagedKVLayout, which: str, new_rows, codec) -> torch.Tensor:
    """``[B, H, S + open_max + T (+ in_step * bs), D]`` in ``new_rows``' dtype, in model space and the step mask's key
    order: the sealed rows (the kernels; sink rows and stale rows as ``context_kv`` has them), the open block, this
    step's rows, then the blocks the step seals as the seal stores them (``_in_step_sealed``)."""
    pool = st.cache.pool(layer, which)
    rest = _open_rows(st, layer, which, new_rows)
    if st.in_step:
        rest = torch.cat([rest, _in_step_sealed(st, layer, which, lay, rest, codec).to(rest.dtype)], 2)
    if not st.sealed_max:
        return rest
    S = st.sealed_max * st.cache.block_size
    table = st.cache.rope_for(layer, lay.tensor_format(which))  # keys stored before RoPE: this layer's table
    rope = None if table is None else table.upto(int((st.first_pos + S).max()))
    out = cpu_attention.dequant(codec, pool, st.batch.block_tables, st.held, st.sealed_max, *_cpu_sink(st, lay, pool),
                                rows=S + rest.shape[2], first_pos=st.first_pos, rope=rope)
    out[:, :, S:] = rest
    return out.to(new_rows.dtype)


def _in_step_sealed(st: _Step, layer: int, which: str, lay: PagedKVLayout, model_rows: torch.Tensor, codec) -> torch.Tensor:
    """``[B, H, in_step * bs, D]`` float32 in model space: the blocks a step across blocks seals, from its open blocks'
    and new rows ``model_rows`` [B, H, open_max + T, D] (fp16 values; a bfloat16 model's are exact in fp16), quantized
    as ``PagedKVCache.seal_rows`` quantizes them (``cache_layout.sealing``: a first block without its sink rows; the
    pool's own ``quantize_blocks``) and read back by the kernels (``codec``). The codes go to the pool with the step's
    output (``StepSeals``): the pool stores them instead of quantizing the rows again."""
    B, H, _, D = model_rows.shape
    n, bs = st.in_step, lay.block_size
    rows = model_rows.float().gather(2, st.in_step_rows[:, None, :, None].expand(B, H, n * bs, D))  # a fresh tensor
    blocks = rows.view(B, H, n, bs, D).transpose(1, 2).reshape(B * n, H, bs, D)
    if lay.sink_tokens:  # the sequences whose first block the step seals: that block without its sink rows, in place
        firsts = blocks.view(B, n, H, bs, D)[:, 0]
        firsts.copy_(torch.where(st.in_step_first[:, None, None, None], sealing(firsts, 0, lay.sink_tokens)[0], firsts))
    first = (st.batch.context_lens // bs) * bs  # [B] the position of each sequence's first in-step block
    positions = first[:, None] + torch.arange(n, device=blocks.device)[None, :] * bs
    qt = st.cache.quantize_blocks(layer, which, blocks, positions.reshape(-1))  # the pool's own seal
    st.in_step_codes[(layer, which)] = qt
    table = st.cache.rope_for(layer, lay.tensor_format(which))  # keys stored before RoPE: this layer's table
    rope = None if table is None else table.upto(int(first.max()) + n * bs)
    return cpu_attention.dequant_blocks(codec, qt, B, first_pos=first, rope=rope)


def _cpu_decode(st: _Step, layer: int, lay: PagedKVLayout, qg, k16, v16, kc, vc, scaling: float, window, softcap) -> torch.Tensor:
    """One token per sequence, the whole attention in one kernel call (``cpu_attention.decode``): [B, H, G, D]."""
    b, bs = st.batch, st.cache.block_size
    table = st.cache.rope_for(layer, lay.tensor_format("k"))  # keys stored before RoPE: this layer's table
    step = st.cpu_decode.get(table)
    if step is None:
        sealed = b.context_lens // bs
        rope = None if table is None else table.upto(int(b.context_lens.max()) + 1)
        step = st.cpu_decode[table] = cpu_attention.DecodeStep(b.block_tables, st.held, st.sealed_max, b.slot_ids, b.context_lens - sealed * bs,
                                                                b.context_lens, st.first_pos, sealed * bs, st.sink_ok, rope)
    kpool, vpool = st.cache.pool(layer, "k"), st.cache.pool(layer, "v")
    # the formats' transforms run inside the kernel (the codecs carry them): no torch op per layer around the call
    return cpu_attention.decode_model_space(kc, vc, kpool, vpool, step, qg, k16[:, :, 0], v16[:, :, 0], scaling, window,
                                            softcap, lay.sink_tokens)


def _cpu_sink(st: _Step, lay: PagedKVLayout, pool) -> tuple:
    """(sink rows [B, H, sink, D] float32, model space as the kernels' reads; which sequences read them) for the CPU
    kernels' dequant; (None, None) without."""
    if not lay.sink_tokens:
        return None, None
    return lay.sink_rows(pool.tail)[st.batch.slot_ids].float(), st.sink_ok


def _mask_bias(st: _Step, window: int | None, G: int, dtype) -> torch.Tensor:
    """0 / -inf [B, 1, G * T, C + T] of the step's mask (a local layer's: with its window), GQA rows repeated; built
    once per step and reused by every layer (an add instead of a negation and a fill per layer)."""
    got = st.biases.get(window)
    if got is None:
        mask = st.mask if window is None else TorchEngine.window_mask(st, window)
        B, _, T, C = mask.shape
        mask = mask if G == 1 else mask[:, :, None].expand(B, 1, G, T, C).reshape(B, 1, G * T, C)
        got = st.biases[window] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return got


def _ring_table(st: _Step) -> torch.Tensor:
    """The block table a ringed layer's kernels read: ``[B, max_blocks]`` whose column ``j`` is the ring block of the
    sequence's sealed block ``j`` (``WindowRing.block(slot, j)``). Only columns from the window's first block on hold
    that block (earlier ones were overwritten); the kernels start there and never read the others. Built once per
    step, as wide as the step's block tables (a fixed shape: CUDA graphs replay it)."""
    if st.ring_table is None:
        b = st.batch
        cols = torch.arange(b.block_tables.shape[1], device=b.slot_ids.device)
        st.ring_table = st.cache.ring.block(b.slot_ids[:, None].long(), cols[None, :]).to(torch.int32)
    return st.ring_table


def _kernel_attention(st: _Step, layer: int, q, k, v, scaling: float, window: int | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """The Triton kernels (``plugins.ops``) with the layer's window / soft-cap; a ringed layer reads its ring blocks
    through ``_ring_table``."""
    cache, b = st.cache, st.batch
    kp, vp = st.engine.layer_params(cache, layer)
    kpool, vpool = cache.pool(layer, "k"), cache.pool(layer, "v")
    tables = _ring_table(st) if cache.is_ringed(layer) else b.block_tables
    extra = dict(sm_scale=scaling, window=int(window or 0), softcap=float(softcap or 0.0))
    kf = cache.layout_of(layer).tensor_format("k")
    if kf.pre_rope:  # keys stored before RoPE: the layer's table on the device, to the engine's longest sequence (no
        # host sync: CUDA graphs capture this step); without a manifest, to this step's
        lim = None if st.engine.manifest is None else st.engine.manifest.limits
        n = lim.max_seq_len if lim is not None else int(b.context_lens.max()) + q.shape[2]
        extra["rope"] = cache.rope_for(layer, kf).upto(n, q.device)
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, T, heads, D]
    if qh.shape[1] == 1:
        out = ops.decode_attention(qh[:, 0].contiguous(), cache.layout_of(layer), kpool, vpool, kh[:, 0].contiguous(), vh[:, 0].contiguous(),
                                   tables, b.context_lens, b.slot_ids, kp, vp, **extra)
        return out[:, None]
    valid = st.valid
    packed = ops.prefill_attention(qh[valid].contiguous(), st.cu_seqlens, cache.layout_of(layer), kpool, vpool, kh[valid].contiguous(),
                                   vh[valid].contiguous(), tables, b.context_lens, b.slot_ids, kp, vp,
                                   max_seqlen_q=qh.shape[1], **extra)
    out = torch.zeros_like(qh)
    out[valid] = packed
    return out


def paged_attention(module, query, key, value, attention_mask=None, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention function (registered as ``ATTN_NAME``): query ``[B, Hq, T, D]``, key / value
    ``[B, H, T, D]`` of this step after RoPE. Returns ``([B, T, Hq, D], None)``."""
    st: _Step | None = kwargs.get(STEP_KWARG)
    if st is None:
        raise TrtkvError("the trtkv paged attention runs only inside TorchEngine.step", "call the model through trtkv.runtime.torch_engine.TorchEngine")
    layer = module.layer_idx
    k16, v16 = key.to(torch.float16), value.to(torch.float16)
    st.new_k[layer] = k16.transpose(1, 2)
    st.new_v[layer] = v16.transpose(1, 2)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    # each family's attention module says whether this layer is local and soft-capped (Mistral, Qwen2/3, Gemma 2/3)
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if st.cache.is_ringed(layer):  # the ring holds only what the cache's window covers
        if window != st.cache.ring.window:
            raise TrtkvError(f"layer {layer} attends over a window of {window} but the cache keeps a ring for {st.cache.ring.window}",
                             "build the cache from the engine's manifest (WindowRing.of(manifest.model, block_size))")
    # this step's rows are attended as the fp16 values the open block will hold (the kernels take them in fp16)
    if st.engine.attention == "kernels":  # windows and soft-caps in the kernels; a ring through its logical block table
        return _kernel_attention(st, layer, query, k16, v16, scaling, window, softcap), None
    if st.cache.is_ringed(layer):
        st = st.engine._ring_view(st)
    if st.engine.attention == "cpu":
        return _cpu_attention(st, layer, query, k16.to(query.dtype), v16.to(query.dtype), scaling, window or None, softcap or None), None
    return _torch_attention(st, layer, query, k16.to(query.dtype), v16.to(query.dtype), scaling, window or None, softcap or None), None


_REGISTERED = False


def register_attention() -> None:
    """Register ``paged_attention`` with transformers (once per process)."""
    global _REGISTERED
    if not _REGISTERED:
        AttentionInterface.register(ATTN_NAME, paged_attention)
        _REGISTERED = True
