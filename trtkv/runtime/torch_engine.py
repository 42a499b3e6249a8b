"""The torch engine: the transformers model, one batched forward per step, attention over the paged cache.

``TorchEngine.step(batch, cache)`` is the step contract of docs/kv-cache-format.md ("The engine step
contract"), like ``OnnxRuntimeEngine``: the cache is read, never written; the runtime stores
``new_k / new_v`` and seals afterwards (``PagedKVCache.write_new_rows``).

How: the model's attention function is swapped through transformers' attention registry
(``AttentionInterface.register(ATTN_NAME, ...)`` + ``config._attn_implementation``). The model's own
projections, RoPE, norms and MLP run unchanged on the whole padded ``[B, T]`` batch; each attention layer
calls ``paged_attention`` with the query, key and value after RoPE (``[B, heads, T, D]``). It

* captures this step's K / V rows (fp16) into ``new_k / new_v [L, B, T, H, D]``,
* attends over the sealed blocks (dequantized), the sink rows, the slot's open block and this step's
  rows ``0 … t`` rounded to fp16 (what the open block will hold), causal within the step:
  - ``attention="torch"`` (the CPU default): vectorized torch ops -- the batch's block tables gathered in
    one index, dequantized with ``trtkv.quant.dequantize`` (bit operations for int4, no table lookups),
    masked ``scaled_dot_product_attention`` with GQA;
  - ``attention="kernels"`` (the CUDA default): trtkv's Triton kernels through ``torch.ops.trtkv``
    (split-K decode for ``T == 1``, paged prefill otherwise); on CPU it runs under ``TRITON_INTERPRET=1``.

Logits are taken at each sequence's last valid token (``new_lens - 1``) only. Compute dtype is the
model's (float32 on CPU). Supported: decoder-only families whose attention calls the registry with
``module.layer_idx`` (Llama, Mistral, Qwen2, SmolLM2 ...); sliding-window layers read the whole context.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from trtkv.cache_layout import PagedKVLayout
from trtkv.errors import TrtkvError
from trtkv.manifest import EngineManifest, load_manifest
from trtkv.models import load_model
from trtkv.plugins import ops
from trtkv.quant import QuantizedTensor, TensorParams, dequantize, forward_transform, hadamard_matrix, inverse_transform
from trtkv.runtime.backends import Engine
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.step import StepBatch, StepOutput

ATTN_NAME = "trtkv_paged"
STEP_KWARG = "trtkv_step"  # the per-step context, passed through the model's **kwargs to the attention function
ATTENTION_MODES = ("auto", "torch", "kernels")


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
    open_max: int = 0
    cu_seqlens: torch.Tensor | None = None  # kernels, T > 1


class TorchEngine(Engine):
    """A transformers causal LM over trtkv's paged cache (see the module docstring)."""

    name = "torch"

    def __init__(self, model, manifest: EngineManifest | None = None, *, attention: str = "auto", device=None):
        if attention not in ATTENTION_MODES:
            raise TrtkvError(f"unknown torch-engine attention {attention!r}", f"use one of {', '.join(ATTENTION_MODES)}")
        self.model = model.eval()
        self.manifest = manifest
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.attention = ("kernels" if self.device.type == "cuda" else "torch") if attention == "auto" else attention
        self.dtype = next(model.parameters()).dtype
        register_attention()
        for cfg in {id(c): c for c in (model.config, _text_config(model.config))}.values():
            cfg._attn_implementation = ATTN_NAME
        self._decoder = model.get_decoder()
        self._head = model.get_output_embeddings()
        self._params: dict[int, list[TensorParams]] = {}

    @classmethod
    def from_engine_dir(cls, engine_dir: str | Path, *, device=None, dtype: str | None = None, attention: str = "auto",
                        manifest: EngineManifest | None = None) -> "TorchEngine":
        """Load the model an engine directory of backend ``torch`` references (path + sha256, checked); ``manifest``:
        the directory's, when the caller loaded it already."""
        m = manifest or load_manifest(engine_dir)
        if m.backend != "torch":
            raise TrtkvError(f"{engine_dir} is a {m.backend} engine, not a torch one", "open it with its own backend, or rebuild with --backend torch")
        device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or ("float32" if device.type == "cpu" else "bfloat16")
        src = m.model.source if m.model.source and Path(m.model.source).exists() else m.model.name
        loaded = load_model(src, device=str(device), dtype=dtype)
        if loaded.info.sha256 != m.model.sha256:
            raise TrtkvError(
                f"the weights at {src} (sha256 {loaded.info.sha256[:12]}...) are not the ones the engine was built for ({m.model.sha256[:12]}...)",
                "restore the original weights or rebuild the engine with `trtkv build-engine --backend torch --force`",
            )
        return cls(loaded.model, m, attention=attention, device=device)

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self, batch: StepBatch, cache: PagedKVCache) -> StepOutput:
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
        if self.attention == "torch":
            self._torch_masks(st)
        elif T > 1:
            st.cu_seqlens = F.pad(batch.new_lens.cumsum(0), (1, 0)).to(torch.int32)
        positions = batch.context_lens[:, None] + ar[None, :]
        out = self._decoder(input_ids=batch.input_ids, position_ids=positions, use_cache=False, **{STEP_KWARG: st})
        hidden = out.last_hidden_state[torch.arange(B, device=dev), batch.new_lens - 1]
        logits = self._head(hidden).float()
        return StepOutput(logits, st.new_k, st.new_v)

    def layer_params(self, cache: PagedKVCache, layer: int) -> tuple[TensorParams, TensorParams]:
        """The cache's KV constants of ``layer`` on the engine's device (moved once per cache)."""
        got = self._params.get(id(cache))
        if got is None:
            got = [(_params_on(p.k, self.device), _params_on(p.v, self.device)) for p in cache.params]
            self._params = {id(cache): got}
        return got[layer]

    def _torch_masks(self, st: _Step) -> None:
        """Key validity and the [B, 1, T, C + T] attention mask of the torch path (C: gathered context keys)."""
        b, bs = st.batch, st.cache.block_size
        sealed = b.context_lens // bs
        opened = b.context_lens - sealed * bs
        st.sealed_max, st.open_max = int(sealed.max()), int(opened.max())
        dev = self.device
        kv_valid = []
        if st.sealed_max:
            kv_valid.append(torch.arange(st.sealed_max * bs, device=dev)[None, :] < (sealed * bs)[:, None])
        if st.open_max:
            kv_valid.append(torch.arange(st.open_max, device=dev)[None, :] < opened[:, None])
        B, T = b.input_ids.shape
        st.kv_valid = torch.cat(kv_valid, 1) if kv_valid else torch.zeros(B, 0, dtype=torch.bool, device=dev)
        st.kv_invalid = ~st.kv_valid
        st.sealed_all_valid = bool((sealed == st.sealed_max).all())
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        st.mask = torch.cat([st.kv_valid[:, None, :].expand(B, T, -1), causal[None].expand(B, T, T)], 2)[:, None]


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def context_kv(st: _Step, layer: int, which: str, new_rows: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Every sequence's keys (or values), the batched form of ``cache_layout.gather_paged``, in two parts:

    * sealed ``[B, sealed_max, H, block_size, D]`` (block-major as in the pool; None when no sequence has a sealed block): dequantized but left
      in the format's **stored channel space** (smoothed / rotated: ``dequantize(..., transforms=False)``), the
      caller folds the transforms into the query and the output instead of undoing them on every row; positions
      ``< sink`` from the sink rows (moved into stored space);
    * the rest ``[B, H, open_max + T, D]`` in model space: the open block, then this step's rows ``new_rows``.

    Context rows that do not exist are zero (``st.kv_valid`` says which exist)."""
    cache, b = st.cache, st.batch
    lay: PagedKVLayout = cache.layout
    pool = cache.pool(layer, which)
    fmt = lay.tensor_format(which)
    params = st.engine.layer_params(cache, layer)[0 if which == "k" else 1]
    bs, sink, H, D = lay.block_size, lay.sink_tokens, lay.num_kv_heads, lay.head_dim
    B, dtype = b.batch_size, new_rows.dtype
    S = st.sealed_max * bs
    sealed = None
    if st.sealed_max:
        nb = st.sealed_max
        flat = b.block_tables[:, :nb].clamp(min=0).reshape(-1)
        qt = QuantizedTensor(
            codes=pool.data[flat],
            scale=None if pool.scale is None else pool.scale[flat],
            zero=None if pool.zero is None else pool.zero[flat],
        )
        x = dequantize(qt, fmt, params, head_axis=-3, dtype=dtype, transforms=False)  # [B * nb, H, bs, D]
        sealed = x.view(B, nb, H, bs, D)  # block-major, as stored: no transpose copy
        if sink:
            sealed[:, 0, :, :sink] = forward_transform(pool.tail[b.slot_ids, :, bs : bs + sink].to(dtype), fmt, params, head_axis=-3)
        if not st.sealed_all_valid:  # other owners' blocks may hold NaN
            sealed.masked_fill_(st.kv_invalid[:, :S].view(B, nb, 1, bs, 1), 0)
    rest = torch.cat([pool.tail[b.slot_ids, :, : st.open_max].to(dtype), new_rows], 2)
    if st.open_max:
        rest[:, :, : st.open_max].masked_fill_(st.kv_invalid[:, None, S:, None], 0)  # stale tail rows
    return sealed, rest


def _fold_query(q: torch.Tensor, fmt, params: TensorParams) -> torch.Tensor:
    """q [B, H, n, D] such that ``fold(q) . k_stored == q . k_model`` for ``k_model = inverse_transform(k_stored)``
    = ``(k_stored @ H^T) * smooth``: ``(q * smooth) @ H`` (the transpose of ``trtkv.quant.inverse_transform``)."""
    if fmt.smooth:
        q = q * params.smooth.to(q.dtype).view(1, q.shape[1], 1, q.shape[-1])
    if fmt.hadamard:
        q = q @ hadamard_matrix(q.shape[-1], q.dtype, q.device)
    return q


def _torch_attention(st: _Step, layer: int, q, k16, v16, scaling: float) -> torch.Tensor:
    """Softmax attention over [sealed (stored space) | open block + new rows (model space)] keys: K's transforms
    folded into the query for the sealed part, V's undone once on the sealed part's output. GQA by folding each KV
    head's query group into the query axis (no K/V repeat)."""
    B, Hq, T, D = q.shape
    H = k16.shape[1]
    G = Hq // H
    lay = st.cache.layout
    kp, vp = st.engine.layer_params(st.cache, layer)
    qg = q.reshape(B, H, G * T, D)
    ks, kr = context_kv(st, layer, "k", k16)
    vs, vr = context_kv(st, layer, "v", v16)
    scores = qg @ kr.transpose(-1, -2)
    S = 0
    if ks is not None:  # [B, 1, H, n, D] @ [B, nb, H, D, bs] -> [B, nb, H, n, bs] -> [B, H, n, nb * bs]
        nb, bs = ks.shape[1], ks.shape[3]
        S = nb * bs
        sealed = (_fold_query(qg, lay.tensor_format("k"), kp)[:, None] @ ks.transpose(-1, -2)).permute(0, 2, 3, 1, 4)
        scores = torch.cat([sealed.reshape(B, H, G * T, S), scores], -1)
    mask = st.mask if G == 1 else st.mask[:, :, None].expand(B, 1, G, T, -1).reshape(B, 1, G * T, -1)
    p = (scores * scaling).masked_fill_(~mask, float("-inf")).softmax(-1)
    out = p[..., S:] @ vr
    if vs is not None:  # [B, nb, H, n, bs] @ [B, nb, H, bs, D], summed over blocks
        ps = p[..., :S].reshape(B, H, G * T, nb, bs).permute(0, 3, 1, 2, 4)
        out = out + inverse_transform((ps @ vs).sum(1), lay.tensor_format("v"), vp, head_axis=-3)
    return out.view(B, Hq, T, D).transpose(1, 2)  # [B, T, Hq, D]


def _kernel_attention(st: _Step, layer: int, q, k, v, scaling: float) -> torch.Tensor:
    cache, b = st.cache, st.batch
    kp, vp = st.engine.layer_params(cache, layer)
    kpool, vpool = cache.pool(layer, "k"), cache.pool(layer, "v")
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, T, heads, D]
    if qh.shape[1] == 1:
        out = ops.decode_attention(qh[:, 0].contiguous(), cache.layout, kpool, vpool, kh[:, 0].contiguous(), vh[:, 0].contiguous(),
                                   b.block_tables, b.context_lens, b.slot_ids, kp, vp, sm_scale=scaling)
        return out[:, None]
    valid = st.valid
    packed = ops.prefill_attention(qh[valid].contiguous(), st.cu_seqlens, cache.layout, kpool, vpool, kh[valid].contiguous(),
                                   vh[valid].contiguous(), b.block_tables, b.context_lens, b.slot_ids, kp, vp, sm_scale=scaling,
                                   max_seqlen_q=qh.shape[1])
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
    # this step's rows are attended as the fp16 values the open block will hold (the kernels take them in fp16)
    if st.engine.attention == "kernels":
        return _kernel_attention(st, layer, query, k16, v16, scaling), None
    return _torch_attention(st, layer, query, k16.to(query.dtype), v16.to(query.dtype), scaling), None


_REGISTERED = False


def register_attention() -> None:
    """Register ``paged_attention`` with transformers (once per process)."""
    global _REGISTERED
    if not _REGISTERED:
        AttentionInterface.register(ATTN_NAME, paged_attention)
        _REGISTERED = True
