"""The step network: one pure ONNX function for prefill and decode (docs/kv-cache-format.md, "The engine step contract").

Inputs: ``input_ids [B, T]``, ``context_lens [B]``, ``new_lens [B]``, ``block_tables [B, MB]``,
``slot_ids [B]`` (int64); the stacked pools ``k_data``/``v_data [L, NB, H, bs, P]`` (fp16, or int8 — packed
int4, unsigned int8 and fp8 bit patterns are declared int8 at the graph boundary), their fp16 scales /
zero-points when the format has them, and the fp16 open blocks and sink rows ``k_tail``/``v_tail [L, S, H, bs + sink, D]``.
Outputs: ``logits [B, V]`` float32 at each sequence's last valid token, ``new_k``/``new_v [L, B, T, H, D]``
fp16 (K after RoPE). Every layer: RMSNorm, RoPE (rotate-half, the model's own inv_freq and attention scaling), GQA,
a gated MLP (SwiGLU or GeGLU), optional q/k/v biases, tied or untied embeddings. What differs between families
reaches the graph through ``ModelWeights``, which the weight reader (``builder/weights.py``) fills as the family's
row in ``trtkv.families`` says: q/k RMSNorm per head (``qk_norm``), fused projections split (``fused_projections``),
(1 + w) norms folded into the weights (``norm_offset``), norms of the attention and MLP outputs
(``sandwich_norms``), scaled embeddings (``scaled_embedding``), attention / final logit soft-capping
(``attn_softcap`` / ``final_softcap``); the query scale (e.g. ``query_pre_attn_scalar^-0.5``) and a RoPE table per
layer type come from the model's own modules. Sliding-window layers (the record's layer types, by the family's window
rule) mask keys older than their window (``key_pos > q_pos - window``, transformers' rule).
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto

from trtkv.builder.attention import StepAttention, StepContext
from trtkv.builder.graph import DTYPE, NP_DTYPE, ONNX_NAMES, Graph
from trtkv.builder.weights import ModelWeights
from trtkv.cache_layout import PagedKVLayout
from trtkv.errors import TrtkvError
from trtkv.manifest import TensorSpec
from trtkv.plugins.contract.capabilities import CAPABILITIES

BIG_POS = 2**40  # key position of unreadable keys: never <= a query position


def check_model(info, attention: str, backend: str = "onnxruntime") -> None:
    """Refuse, before any weights load, a model (``trtkv.models.ModelInfo``) the engine would compute wrongly: the step
    network for ONNX backends (the torch engine runs transformers' own layers: every accepted family)."""
    # the torch engine runs transformers' own layers (the table's ``torch`` row: windows and soft-capping reach its
    # paged attention per call); ONNX backends the step network with ``attention``'s row
    path = CAPABILITIES["torch" if backend == "torch" else attention]
    for r in path.model_reasons(info):
        raise TrtkvError(r, r.hint)


def graph_dtype(layout: PagedKVLayout, which: str, plugin: bool = False) -> int:
    """Element type of a pool's data input at the graph boundary: fp16 stays fp16, every 8-bit pattern is int8
    (native: TensorRT-RTX rejects UINT8 tensors); plugin graphs keep the storage dtype the op contract declares."""
    if layout.tensor_format(which).dtype == "fp16":
        return TensorProto.FLOAT16
    if plugin and layout.data_dtype(which) == torch.uint8:
        return TensorProto.UINT8
    return TensorProto.INT8


def cache_input_specs(layout: PagedKVLayout, plugin: bool = False) -> list[tuple[str, int, list, str | None]]:
    """(name, elem type, symbolic shape, storage dtype) of the cache inputs of ``layout``'s format, in order."""
    out = []
    for which in ("k", "v"):
        dt = graph_dtype(layout, which, plugin)
        storage = str(layout.data_dtype(which)).removeprefix("torch.")
        sym = dict(num_blocks="num_blocks", layers="num_layers")  # the layout's shapes, with the graph's symbolic dims
        out.append((f"{which}_data", dt, list(layout.data_shape(which, **sym)), storage))
        for field, shape in (("scale", layout.scale_shape(which, **sym)), ("zero", layout.zero_shape(which, **sym))):
            if shape is not None:
                out.append((f"{which}_{field}", TensorProto.FLOAT16, list(shape), None))
    for which in ("k", "v"):
        out.append((f"{which}_tail", TensorProto.FLOAT16, list(layout.tail_shape("num_slots", layers="num_layers")), None))
    return out


def _fix_layers(shape: list, L: int) -> list:
    return [L if d == "num_layers" else d for d in shape]


def build_step_network(
    w: ModelWeights, layout: PagedKVLayout, params: list, attention: StepAttention, dtype: str = "fp32"
) -> tuple[onnx.ModelProto, list[TensorSpec], list[TensorSpec]]:
    """The ONNX step network of model ``w`` over ``layout``'s paged cache; returns (model, inputs, outputs)."""
    for r in attention.path.layout_reasons(layout.fmt):  # the capability table, before a node is made
        raise TrtkvError(r, r.hint)
    g = Graph("trtkv_step", custom_domains={"trtkv": 1} if attention.name == "plugin" else None)
    cdt, npd = DTYPE[dtype], NP_DTYPE[dtype]
    L, nh, H, D, hid = w.info.num_layers, w.info.num_heads, w.info.num_kv_heads, w.info.head_dim, w.info.hidden_size
    bs = layout.block_size
    i64 = TensorProto.INT64

    # ---------------------------------------------------------------- inputs
    specs_in: list[TensorSpec] = []

    def inp(name, elem, shape, storage=None):
        g.input(name, elem, shape)
        specs_in.append(TensorSpec(name=name, shape=shape, dtype=ONNX_NAMES[elem], storage_dtype=storage))
        return name

    ids = inp("input_ids", i64, ["batch", "new_tokens"])
    ctx_lens = inp("context_lens", i64, ["batch"])
    new_lens = inp("new_lens", i64, ["batch"])
    btab = inp("block_tables", i64, ["batch", "max_blocks"])
    slots = inp("slot_ids", i64, ["batch"])
    cache = {}
    for name, elem, shape, storage in cache_input_specs(layout, plugin=attention.name == "plugin"):
        cache[name] = inp(name, elem, _fix_layers(shape, L), storage if storage and storage != ONNX_NAMES[elem] else None)

    # ---------------------------------------------------------------- shared tensors
    ctx = StepContext(g=g, layout=layout, num_layers=L, num_heads=nh, compute=cdt, params=params)
    for name, x in cache.items():  # [L, N, ...] -> [L*N, ...]: a layer's rows are Gather(pool, index + layer * N)
        ctx.pool[name] = g.op("Reshape", x, g.concat(g.i64(-1), g.op("Shape", x, start=2), axis=0))
    ctx.num_blocks = g.shape_dim(cache["k_data"], 1)
    ctx.num_slots = g.shape_dim(cache["k_tail"], 1)
    ctx.block_idx = g.op("Max", btab, g.scalar(0, np.int64))
    ctx.slot_ids = slots
    B = g.shape_dim(ids, 0)
    T = g.shape_dim(ids, 1)
    MB = g.shape_dim(btab, 1)
    ctx.sealed_len = g.mul(MB, g.i64(bs))
    ctx.extra["q_shape"] = g.concat(B, g.i64(nh), T, g.i64(D), axis=0)
    ctx.extra["graph_inputs"] = {**cache, "block_tables": btab, "context_lens": ctx_lens, "slot_ids": slots}
    ctx.extra["B"], ctx.extra["T"] = B, T

    zero, one = g.scalar(0, np.int64), g.scalar(1, np.int64)
    bs_c = g.scalar(bs, np.int64)
    c2 = g.unsqueeze(ctx_lens, 1)  # [B, 1]
    sealed_tokens = g.mul(g.div(c2, bs_c), bs_c)  # [B, 1]: tokens in sealed blocks
    open_len = g.sub(c2, sealed_tokens)  # [B, 1]
    big = g.scalar(BIG_POS, np.int64)
    j_sealed = g.unsqueeze(g.op("Range", zero, g.op("Squeeze", ctx.sealed_len, g.i64(0)), one), 0)  # [1, MB*bs]
    sealed_ok = g.op("Less", j_sealed, sealed_tokens)  # [B, MB*bs]
    j_tail = g.const(np.arange(bs, dtype=np.int64)[None], "arange_bs")  # [1, bs]
    tail_ok = g.op("Less", j_tail, open_len)  # [B, bs]
    tail_pos = g.add(sealed_tokens, j_tail)
    sink = layout.sink_tokens
    if sink:  # tail rows bs .. bs+sink-1 hold positions 0 .. sink-1 once a block is sealed; the pool's are not read
        has_sealed = g.op("Greater", sealed_tokens, zero)  # [B, 1]
        sealed_ok = g.op("And", sealed_ok, g.op("GreaterOrEqual", j_sealed, g.scalar(sink, np.int64)))
        j_sink = g.const(np.arange(sink, dtype=np.int64)[None], "arange_sink")  # [1, sink]
        b_sink = g.concat(B, g.i64(sink), axis=0)  # the shape [B, sink]
        tail_ok = g.concat(tail_ok, g.op("Expand", has_sealed, b_sink), axis=1)  # [B, bs+sink]
        tail_pos = g.concat(tail_pos, g.op("Expand", j_sink, b_sink), axis=1)
    t_range = g.unsqueeze(g.op("Range", zero, g.op("Squeeze", T, g.i64(0)), one), 0)  # [1, T]
    q_pos = g.add(c2, t_range)  # [B, T] absolute positions of the new tokens
    key_pos = g.concat(
        g.where(sealed_ok, j_sealed, big),
        g.where(tail_ok, tail_pos, big),
        q_pos,
        axis=1,
    )  # [B, Kl]
    visible = g.op("Less", g.unsqueeze(key_pos, 1), g.add(g.unsqueeze(q_pos, 2), one))  # [B, T, Kl]
    ctx.mask = g.op("Tile", g.unsqueeze(visible, 1), g.i64(1, 1, nh // H, 1))  # [B, 1, g*T, Kl]
    if w.info.has_sliding_layers:  # local layers: also key_pos > q_pos - window (the window start per query)
        in_window = g.op("Greater", g.unsqueeze(key_pos, 1), g.sub(g.unsqueeze(q_pos, 2), g.scalar(w.info.sliding_window, np.int64)))
        local = g.op("Tile", g.unsqueeze(g.op("And", visible, in_window), 1), g.i64(1, 1, nh // H, 1))
        ctx.layer_masks = {layer: local for layer in range(L) if w.info.is_sliding(layer)}
    ctx.sealed_valid = g.unsqueeze(sealed_ok, 1, 3)  # [B, 1, MB*bs, 1]
    ctx.tail_valid = g.unsqueeze(tail_ok, 1, 3)  # [B, 1, bs + sink, 1]

    # RoPE tables [B, 1, T, D] (computed in float32, cast to the compute dtype as transformers does), one pair per
    # distinct (inv_freq, scaling): Gemma 3's local and global layers have their own RoPE base
    pos_f = g.unsqueeze(g.cast(q_pos, TensorProto.FLOAT), 2)
    tables: dict[tuple, tuple[str, str]] = {}

    def rope_tables(layer: int) -> tuple[str, str]:
        inv_freq, scaling = w.rope_for(layer)
        key = (inv_freq.tobytes(), scaling)
        if key not in tables:
            freqs = g.mul(pos_f, g.const(inv_freq.astype(np.float32), "inv_freq"))
            emb = g.concat(freqs, freqs, axis=-1)
            scale = g.scalar(scaling, np.float32)
            tables[key] = (g.unsqueeze(g.cast(g.mul(g.op("Cos", emb), scale), cdt), 1), g.unsqueeze(g.cast(g.mul(g.op("Sin", emb), scale), cdt), 1))
        return tables[key]

    def rope(x, layer):  # x [B, heads, T, D]: x * cos + rotate_half(x) * sin
        cos, sin = rope_tables(layer)
        x1, x2 = g.op("Split", x, g.i64(D // 2, D // 2), axis=-1, outputs=2)
        rot = g.concat(g.op("Neg", x2), x1, axis=-1)
        return g.add(g.mul(x, cos), g.mul(rot, sin))

    def gate_act(x):  # SwiGLU: silu; GeGLU: gelu with the tanh approximation (transformers' gelu_pytorch_tanh)
        if w.activation == "silu":
            return g.mul(x, g.op("Sigmoid", x))
        inner = g.mul(g.add(x, g.mul(g.scalar(0.044715, npd), g.mul(x, g.mul(x, x)))), g.scalar(float(np.sqrt(2 / np.pi)), npd))
        return g.mul(g.mul(x, g.scalar(0.5, npd)), g.add(g.op("Tanh", inner), g.scalar(1.0, npd)))

    def softcap(x, cap, dt):  # cap * tanh(x / cap)
        return g.mul(g.op("Tanh", g.div(x, g.scalar(cap, dt))), g.scalar(cap, dt))

    if w.attn_softcap:
        ctx.logit_softcap = float(w.attn_softcap)

    def rms_norm(x, weight):  # in float32 like transformers' LlamaRMSNorm
        xf = x if cdt == TensorProto.FLOAT else g.cast(x, TensorProto.FLOAT)
        var = g.op("ReduceMean", g.mul(xf, xf), g.i64(-1), keepdims=1)
        y = g.div(xf, g.op("Sqrt", g.add(var, g.scalar(w.info.rms_norm_eps, np.float32))))
        if cdt != TensorProto.FLOAT:
            y = g.cast(y, cdt)
        return g.mul(y, g.const(weight.astype(npd), "norm_w"))

    def linear(x, wt, bias=None, hint="w"):
        y = g.matmul(x, g.const(wt.astype(npd), hint))
        return y if bias is None else g.add(y, g.const(bias.astype(npd), hint + "_b"))

    def heads(x, n):  # [B, T, n*D] -> [B, n, T, D]
        return g.transpose(g.reshape(x, (0, 0, n, D)), (0, 2, 1, 3))

    def fp16_values(x):  # what the open block will hold: the value rounded to fp16, in the compute dtype
        if cdt == TensorProto.FLOAT16:
            return x
        return g.cast(g.cast(x, TensorProto.FLOAT16), cdt)

    # ---------------------------------------------------------------- layers
    embed = g.const(w.embed.astype(npd), "embed")
    h = g.gather(embed, ids)  # [B, T, hidden]
    if w.embed_scale != 1.0:  # Gemma: sqrt(hidden)
        h = g.mul(h, g.scalar(w.embed_scale, npd))
    q_scale = g.scalar(w.query_scale if w.query_scale is not None else 1.0 / np.sqrt(D), npd)
    new_k, new_v = [], []
    for layer, lw in enumerate(w.layers):
        x = rms_norm(h, lw.input_norm)
        q, k = heads(linear(x, lw.wq, lw.bq, "wq"), nh), heads(linear(x, lw.wk, lw.bk, "wk"), H)
        if lw.q_norm is not None:  # Qwen3: RMSNorm over each head's channels before RoPE
            q, k = rms_norm(q, lw.q_norm), rms_norm(k, lw.k_norm)
        q = rope(q, layer)
        k = fp16_values(rope(k, layer))
        v = fp16_values(heads(linear(x, lw.wv, lw.bv, "wv"), H))
        new_k.append(g.unsqueeze(g.cast(g.transpose(k, (0, 2, 1, 3)), TensorProto.FLOAT16), 0))  # [1, B, T, H, D]
        new_v.append(g.unsqueeze(g.cast(g.transpose(v, (0, 2, 1, 3)), TensorProto.FLOAT16), 0))
        o = attention.emit(ctx, layer, g.mul(q, q_scale), k, v)  # [B, nh, T, D]
        o = linear(g.reshape(g.transpose(o, (0, 2, 1, 3)), (0, 0, nh * D)), lw.wo, hint="wo")
        h = g.add(h, o if lw.attn_out_norm is None else rms_norm(o, lw.attn_out_norm))
        x = rms_norm(h, lw.post_norm)
        mlp = linear(g.mul(gate_act(linear(x, lw.w_gate, hint="w_gate")), linear(x, lw.w_up, hint="w_up")), lw.w_down, hint="w_down")
        h = g.add(h, mlp if lw.mlp_out_norm is None else rms_norm(mlp, lw.mlp_out_norm))

    # ---------------------------------------------------------------- outputs
    rows = g.add(g.mul(g.op("Range", zero, g.op("Squeeze", B, g.i64(0)), one), g.op("Squeeze", T, g.i64(0))), g.sub(new_lens, one))
    last = g.gather(g.reshape(h, (-1, hid)), rows)  # [B, hidden] at each sequence's last valid token
    last = rms_norm(last, w.final_norm)
    head = embed if w.tied else g.const(w.lm_head.astype(npd), "lm_head")
    logits = g.op("Gemm", last, head, transB=1)
    if cdt != TensorProto.FLOAT:
        logits = g.cast(logits, TensorProto.FLOAT)
    if w.final_softcap:  # Gemma 2
        logits = softcap(logits, float(w.final_softcap), np.float32)
    g.op("Identity", logits, outputs=["logits"])
    g.op("Concat", *new_k, outputs=["new_k"], axis=0)
    g.op("Concat", *new_v, outputs=["new_v"], axis=0)
    out_specs = [
        TensorSpec(name="logits", shape=["batch", w.info.vocab_size], dtype="float32"),
        TensorSpec(name="new_k", shape=[L, "batch", "new_tokens", H, D], dtype="float16"),
        TensorSpec(name="new_v", shape=[L, "batch", "new_tokens", H, D], dtype="float16"),
    ]
    for s in out_specs:
        g.output(s.name, TensorProto.FLOAT if s.dtype == "float32" else TensorProto.FLOAT16, s.shape)
    return g.model(), specs_in, out_specs
