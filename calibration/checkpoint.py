"""``trtkv export``: a calibrated model as a complete checkpoint another engine loads as is.

Two targets (conventions, sources and the hand-off: docs/interop.md):

* ``vllm``: a Hugging Face checkpoint directory (``save_pretrained``: config.json, safetensors
  weights, sharded with ``model.safetensors.index.json`` when larger than ``max_shard_size``,
  tokenizer files) whose ``config.json`` carries a compressed-tensors ``quantization_config`` with
  a ``kv_cache_scheme``, and whose weights hold ``model.layers.{i}.self_attn.k_scale`` / ``v_scale``.
  ``vllm serve OUT --kv-cache-dtype fp8`` loads it.
* ``trtllm``: a TensorRT-LLM checkpoint (``config.json`` + ``rank{r}.safetensors``, weights in
  TensorRT-LLM's LLaMA names, split for ``tp_size`` ranks) with one
  ``transformer.layers.{i}.attention.kv_cache_scaling_factor`` per layer, ready for ``trtllm-build``.

Formats a target cannot represent are refused with the closest format it accepts. The output is
built in a temporary sibling directory and renamed into place when complete
(``trtkv.artifacts.atomic_directory``).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from trtkv import __version__
from trtkv.errors import TrtkvError
from trtkv.families import architectures, family_of
from trtkv.formats import DTYPES, KVFormat, get_format

log = logging.getLogger(__name__)

TARGETS = ("vllm", "trtllm")
DEFAULT_FORMAT = "fp8"
MANIFEST = "trtkv_export.json"
_OUT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32"}


@dataclass
class ExportResult:
    """What ``export_checkpoint`` wrote."""

    out: Path
    target: str
    format: str
    tp_size: int
    dtype: str
    files: list[str]
    scales: dict[str, list[float]]  # per layer: vllm {"k": [...], "v": [...]}; trtllm {"kv": [...]}
    q_amax: list[float] | None = None  # per layer, post-RoPE query absmax folded into the trtllm FP8 scale
    notes: list[str] = field(default_factory=list)

    def next_step(self) -> str:
        if self.target == "vllm":
            tp = f" --tensor-parallel-size {self.tp_size}" if self.tp_size > 1 else ""
            return f"vllm serve {self.out} --kv-cache-dtype fp8{tp}"
        return f"trtllm-build --checkpoint_dir {self.out} --output_dir ENGINE_DIR --kv_cache_type paged --gemm_plugin auto"


# --------------------------------------------------------------------------- what each target can represent


def _describe(fmt: KVFormat) -> str:
    return f"{fmt.name} ({fmt.spec()})"


def check_target_format(target: str, fmt: KVFormat) -> None:
    """Refuse (one ``TrtkvError``) a format the target engine cannot load, naming the closest it accepts."""
    ts = (fmt.k, fmt.v)
    dtypes = {t.dtype for t in ts}
    packed = sorted(d for d in dtypes if DTYPES[d].packed)  # int4 / int3 / int2: no engine we export to stores them
    if target == "vllm":
        fix = "export --kv fp8 (per-tensor FP8 scales; calibrate it first with `trtkv calibrate --kv fp8` if the artifact lacks it)"
        if packed:
            raise TrtkvError(f"vLLM has no {'/'.join(packed).upper()} KV cache, so {_describe(fmt)} cannot be exported to it", fix)
        if dtypes != {"fp8_e4m3"}:
            raise TrtkvError(
                f"vLLM's compressed-tensors kv_cache_scheme loads FP8 (e4m3) KV scales only, not {_describe(fmt)}", fix
            )
        if any(t.granularity not in ("per_tensor", "per_head") for t in ts) or fmt.k.granularity != fmt.v.granularity:
            raise TrtkvError(
                f"vLLM loads static per-tensor (or per-KV-head) k_scale / v_scale only; {_describe(fmt)} has "
                f"{fmt.k.granularity} / {fmt.v.granularity} scales",
                fix,
            )
    elif target == "trtllm":
        fix = "export --kv fp8 or --kv int8-static (one static scale per layer; calibrate it first if the artifact lacks it)"
        if packed:
            raise TrtkvError(
                f"TensorRT-LLM's KV cache has no {'/'.join(packed).upper()} (kv_cache_quant_algo takes INT8 or FP8), so {_describe(fmt)} cannot be exported", fix
            )
        if "fp16" in dtypes or len(dtypes) != 1:
            raise TrtkvError(f"TensorRT-LLM quantizes K and V to one dtype (INT8 or FP8); {_describe(fmt)} mixes them", fix)
        if any(t.granularity != "per_tensor" for t in ts):
            raise TrtkvError(
                f"TensorRT-LLM loads one static per-tensor KV scale per layer; {_describe(fmt)} has "
                f"{fmt.k.granularity} / {fmt.v.granularity} scales",
                fix,
            )
    else:
        raise TrtkvError(f"unknown export target {target!r}", "use --to vllm or --to trtllm")
    if any(t.smooth or t.hadamard for t in ts):
        raise TrtkvError(f"{target} cannot undo trtkv's smoothing / Hadamard transforms of {_describe(fmt)}", fix)
    if any(not t.symmetric for t in ts):
        raise TrtkvError(f"{target} takes symmetric KV scales only; {_describe(fmt)} is asymmetric", fix)
    if fmt.block_size is not None:
        raise TrtkvError(f"{target} has no fp16 open block per sequence ({_describe(fmt)} seals blocks of {fmt.block_size})", fix)


# --------------------------------------------------------------------------- scales


def vllm_scale_tensors(params: Sequence[Any]) -> dict[str, torch.Tensor]:
    """``model.layers.{i}.self_attn.{k,v}_scale``: float32 [1] per tensor, [num_kv_heads] per head."""
    from trtkv.calibration.export import vllm_scales

    return vllm_scales(params)


def trtllm_kv_scales(params: Sequence[Any], fmt: KVFormat, q_amax: Sequence[float] | None = None) -> torch.Tensor:
    """One dequantization scale per layer, float32 [L]: ``max(k_scale, v_scale)``, and for FP8 also
    ``q_amax / 448`` when the query range is known (FP8 context attention quantizes Q with this scale)."""
    s = torch.stack([torch.maximum(lp.k.scale.float().reshape(()), lp.v.scale.float().reshape(())) for lp in params])
    if q_amax is not None and fmt.k.dtype == "fp8_e4m3":
        s = torch.maximum(s, torch.tensor(list(q_amax), dtype=torch.float32) / fmt.k.traits.sym_max)
    return s


@torch.no_grad()
def query_absmax(loaded: Any, windows: torch.Tensor, batch_size: int = 4) -> list[float]:
    """Per-layer absmax of the query as the attention kernel receives it (after RoPE).

    Registers a transformers attention function that records ``|q|.max()`` per ``layer_idx`` and
    then runs the usual SDPA; the model is switched to it only for this pass.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = loaded.model
    amax = torch.zeros(loaded.info.num_layers, dtype=torch.float32)

    def capture(module, query, key, value, attention_mask, **kwargs):
        i = module.layer_idx
        amax[i] = torch.maximum(amax[i], query.detach().abs().amax().float().cpu())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("trtkv_query_absmax", capture)
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = "trtkv_query_absmax"
    try:
        for start in range(0, windows.shape[0], batch_size):
            model(input_ids=windows[start : start + batch_size].to(loaded.device), use_cache=False)
    finally:
        config._attn_implementation = before
    return [float(x) for x in amax]


def _calibration_windows(cal: Any, tokenizer: Any, q_windows: int | None) -> torch.Tensor:
    """The token windows recorded in recipe.json (same dataset, split, seq_len, seed), checked by hash."""
    from trtkv.data import describe_dataset, token_windows

    r = cal.recipe
    spec = r.dataset.get("spec")
    text_field = r.dataset.get("text_field", "text")
    skip = "or pass --q-windows 0 to leave the query out of the FP8 scale (documented in docs/interop.md)"
    if not spec or not r.samples or not r.seq_len:
        raise TrtkvError(f"{cal.path}/recipe.json does not record the calibration dataset and windows", f"rerun trtkv calibrate, {skip}")
    if tokenizer is None:
        raise TrtkvError("the model has no tokenizer, so the calibration windows cannot be rebuilt", f"add tokenizer files to the model directory, {skip}")
    try:
        now = describe_dataset(spec, text_field)
    except TrtkvError as exc:
        raise TrtkvError(f"the calibration dataset {spec} cannot be read again ({exc.problem})", f"make it available, {skip}") from None
    if r.dataset.get("sha256") and now["sha256"] != r.dataset["sha256"]:
        raise TrtkvError(f"the dataset {spec} changed since calibration (sha256 differs)", f"recalibrate on the current data, {skip}")
    n = r.samples if q_windows is None else min(q_windows, r.samples)
    return token_windows(tokenizer, spec, seq_len=r.seq_len, samples=r.samples, seed=r.seed, split="calib", text_field=text_field)[:n]


# --------------------------------------------------------------------------- TensorRT-LLM


def _rope_scaling(cfg: Any) -> dict | None:
    """rotary_scaling from a transformers config (v5 ``rope_parameters`` or v4 fields); the base is the record's."""
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    scaling = getattr(cfg, "rope_scaling", None) if not rp else None
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rp and rope_type != "default":
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        scaling.setdefault("type", rope_type)
    return dict(scaling) if scaling else None


def trtllm_config(cfg: Any, info: Any, fmt: KVFormat, tp_size: int, dtype: str) -> dict:
    """The TensorRT-LLM ``config.json`` of a LLaMA-family model (field names: docs/interop.md)."""
    from trtkv.calibration.export import TRTLLM_ALGO

    return {
        "architecture": info.architecture,
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": info.vocab_size,
        "max_position_embeddings": info.max_position_embeddings,
        "hidden_size": info.hidden_size,
        "num_hidden_layers": info.num_layers,
        "num_attention_heads": info.num_heads,
        "num_key_value_heads": info.num_kv_heads,
        "head_size": info.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": cfg.hidden_act,
        "norm_epsilon": info.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": info.rope_theta,
        "rotary_scaling": _rope_scaling(cfg),
        "attn_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": info.tie_word_embeddings,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "mapping": {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": TRTLLM_ALGO[fmt.k.dtype]},
    }


def check_trtllm_model(info: Any, cfg: Any, tp_size: int) -> None:
    """Refuse what the TensorRT-LLM LLaMA checkpoint cannot hold or ``tp_size`` cannot split."""
    family = family_of(info.architecture)
    if family is None or not family.trtllm_export:
        raise TrtkvError(
            f"the TensorRT-LLM export writes LLaMA-family checkpoints ({', '.join(architectures(lambda f: f.trtllm_export))}); "
            f"{info.architecture} has other weight names there",
            "convert it with TensorRT-LLM's own convert_checkpoint.py and merge the scales from trtllm/ in the calibration directory, or export --to vllm",
        )
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise TrtkvError(f"{info.name} has attention / MLP biases, which this export does not write", "export --to vllm")
    H, KV = info.num_heads, info.num_kv_heads
    if tp_size < 1:
        raise TrtkvError(f"--tp-size must be at least 1, got {tp_size}", "pass e.g. --tp-size 2")
    if H % tp_size:
        raise TrtkvError(f"{H} attention heads cannot be split over --tp-size {tp_size}", f"use a tp size dividing {H}")
    if (KV % tp_size) and (tp_size % KV):
        raise TrtkvError(
            f"{KV} KV heads cannot be split over --tp-size {tp_size}: each rank needs whole KV heads, or {tp_size} must be a multiple of {KV} so TensorRT-LLM's replication applies",
            f"use a tp size that divides {KV} or is a multiple of it (and divides {H})",
        )
    if cfg.intermediate_size % tp_size:
        raise TrtkvError(f"intermediate_size {cfg.intermediate_size} cannot be split over --tp-size {tp_size}", "use a smaller --tp-size")


def _kv_rows(w: torch.Tensor, num_kv: int, head_dim: int, tp_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a K or V projection ``[num_kv*head_dim, ...]``.

    KV heads >= tp: contiguous blocks of heads. Fewer KV heads than ranks (tp a multiple of them):
    each rank gets one whole head, head ``rank * num_kv // tp_size`` (TensorRT-LLM replicates KV heads
    up to tp_size, so consecutive ranks share a head, matching their query heads' GQA group).
    """
    if num_kv >= tp_size:
        return w.chunk(tp_size, 0)[rank]
    head = rank * num_kv // tp_size
    return w[head * head_dim : (head + 1) * head_dim]


def trtllm_rank_weights(model: torch.nn.Module, info: Any, tp_size: int, rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s weights in TensorRT-LLM's LLaMA names (no KV scales)."""
    H, KV, D = info.num_heads, info.num_kv_heads, info.head_dim
    core = model.model
    out: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor) -> None:
        out[name] = t.detach().to("cpu", dtype).contiguous().clone()

    put("transformer.vocab_embedding.weight", core.embed_tokens.weight)  # use_parallel_embedding: false
    for i, layer in enumerate(core.layers):
        p = f"transformer.layers.{i}."
        a, m = layer.self_attn, layer.mlp
        q = a.q_proj.weight.chunk(tp_size, 0)[rank]
        k = _kv_rows(a.k_proj.weight, KV, D, tp_size, rank)
        v = _kv_rows(a.v_proj.weight, KV, D, tp_size, rank)
        assert q.shape[0] == H // tp_size * D
        put(p + "input_layernorm.weight", layer.input_layernorm.weight)
        put(p + "attention.qkv.weight", torch.cat([q, k, v], 0))
        put(p + "attention.dense.weight", a.o_proj.weight.chunk(tp_size, 1)[rank])
        put(p + "post_layernorm.weight", layer.post_attention_layernorm.weight)
        put(p + "mlp.fc.weight", m.gate_proj.weight.chunk(tp_size, 0)[rank])  # the activated branch
        put(p + "mlp.gate.weight", m.up_proj.weight.chunk(tp_size, 0)[rank])
        put(p + "mlp.proj.weight", m.down_proj.weight.chunk(tp_size, 1)[rank])
    put("transformer.ln_f.weight", core.norm.weight)
    lm = model.get_output_embeddings().weight.detach()
    padded = -(-lm.shape[0] // tp_size) * tp_size
    if padded != lm.shape[0]:  # vocab padded with zero rows to a multiple of tp_size
        lm = torch.cat([lm, lm.new_zeros(padded - lm.shape[0], lm.shape[1])], 0)
    put("lm_head.weight", lm.chunk(tp_size, 0)[rank])
    return out


# --------------------------------------------------------------------------- driver


def _out_dtype(dtype: str, loaded: Any) -> str:
    d = (dtype or "auto").strip().lower()
    d = _DTYPE_ALIASES.get(d, d)
    if d == "auto":
        src = None
        ckpt = getattr(loaded, "checkpoint_dir", None)
        if ckpt is not None and (Path(ckpt) / "config.json").is_file():
            cfg = json.loads((Path(ckpt) / "config.json").read_text())
            src = cfg.get("dtype") or cfg.get("torch_dtype")
        return src if src in ("float16", "bfloat16") else "float16"
    if d not in _OUT_DTYPES:
        raise TrtkvError(f"unknown --dtype {dtype!r}", "use --dtype auto, float16, bfloat16 or float32")
    return d


def _plan_load(model: str, info: Any, target: str, fmt: KVFormat, tp_size: int, dtype: str, cal: Any, q_windows: int | None):
    """(load dtype, note): float32 when it fits (as before), else the output dtype (the written weights are the same:
    they are cast to it anyway). Counted beyond the weights: the copy at the output dtype the writer makes
    (vLLM: the whole state dict; TensorRT-LLM: one rank's share), and the FP8 query-range forward over batches of 4
    calibration windows."""
    from types import SimpleNamespace

    from trtkv.memory import activation_bytes, choose_load, element_size
    from trtkv.models import gguf_cache_dir

    src = Path(info.source)
    out = _OUT_DTYPES[_out_dtype(dtype, SimpleNamespace(checkpoint_dir=src if src.is_dir() else gguf_cache_dir(model)))]
    copy = info.num_params * element_size(out) // (tp_size if target == "trtllm" else 1)
    seq = cal.recipe.seq_len or 2048
    forward = activation_bytes(info, batch=4, seq_len=seq, dtype=torch.float32) if target == "trtllm" and fmt.k.dtype == "fp8_e4m3" and q_windows != 0 else 0
    cpu = torch.device("cpu")
    try:
        return choose_load(info, cpu, "float32", activations=copy + forward, can_stream=False, command="export").dtype, None
    except TrtkvError as first:
        try:
            lp = choose_load(info, cpu, out, activations=forward, can_stream=False, command="export")
        except TrtkvError as exc:
            raise TrtkvError(exc.problem, "try a smaller --q-windows (0 skips the query pass), or a machine or cgroup with more memory") from None
        return lp.dtype, f"weights loaded in {str(out).removeprefix('torch.')}, the output dtype, not float32 ({first.problem.split(': ', 1)[1]})"


def _copy_source(model: str, info: Any, dtype: str, max_shard_size: str | int, refused: TrtkvError) -> tuple[Any, str]:
    """The source to copy tensor by tensor when the resident export does not fit (vLLM only: no weight is transformed):
    an object with ``info``, ``model`` None, ``tokenizer`` and ``checkpoint_dir``; refused in one line when even one
    output shard does not fit."""
    from types import SimpleNamespace

    from trtkv.memory import HOST_OVERHEAD, available_memory, gib, parse_bytes
    from trtkv.models import checkpoint_dir, load_tokenizer

    shard = max_shard_size if isinstance(max_shard_size, int) else parse_bytes(max_shard_size, "--max-shard-size")
    largest = info.vocab_size * info.hidden_size * 4  # the embeddings, the largest tensor, as read (up to float32)
    budget = available_memory(torch.device("cpu"))
    need = shard + largest + HOST_OVERHEAD  # the shard being filled, the tensor just read (its cast goes into the shard)
    if need > budget.bytes:
        raise TrtkvError(f"{refused.problem}; copying the weights shard by shard needs {gib(need)} with --max-shard-size {max_shard_size}",
                         f"pass a smaller --max-shard-size (e.g. 1GB), or {refused.fix}") from None
    ckpt, _ = checkpoint_dir(model)
    src = SimpleNamespace(info=info, model=None, tokenizer=load_tokenizer(model, required=False), checkpoint_dir=ckpt)
    return src, f"weights copied tensor by tensor from the source shards at most {max_shard_size} at a time ({refused.problem.split(': ', 1)[1]})"


def _vllm_quantization_config(fmt: KVFormat) -> dict:
    from trtkv.calibration.export import vllm_kv_cache_scheme

    return {
        "quant_method": "compressed-tensors",
        "format": "dense",  # the weights stay unquantized; only the KV cache is
        "quantization_status": "frozen",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": vllm_kv_cache_scheme(fmt),
    }


def _write_vllm(tmp: Path, loaded: Any, scales: dict[str, torch.Tensor], fmt: KVFormat, dtype: str, max_shard_size: str | int) -> None:
    model = loaded.model
    tdt = _OUT_DTYPES[dtype]
    state = {k: v.detach().to("cpu", tdt) for k, v in model.state_dict().items()}
    state.update(scales)
    model.save_pretrained(str(tmp), state_dict=state, max_shard_size=max_shard_size)
    # vLLM creates k_scale / v_scale only when config.json itself carries quantization_config
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = dtype  # save_pretrained records the in-memory (float32) dtype, not the saved one
    cfg["quantization_config"] = _vllm_quantization_config(fmt)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(str(tmp))


def _write_vllm_copied(tmp: Path, src: Any, scales: dict[str, torch.Tensor], fmt: KVFormat, dtype: str, max_shard_size: str | int,
                       progress: Callable[[str], None]) -> None:
    """The vLLM checkpoint copied tensor by tensor from the source checkpoint's shards, no model in memory: at most
    one output shard (``max_shard_size``) and one source tensor are held. What a model too large for the process takes
    (the resident writer holds the model and a copy of it); the names are the source's Hugging Face ones."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from trtkv.memory import parse_bytes
    from trtkv.streaming import tensor_files

    limit = max_shard_size if isinstance(max_shard_size, int) else parse_bytes(max_shard_size, "--max-shard-size")
    tdt = _OUT_DTYPES[dtype]
    files = tensor_files(src.checkpoint_dir)
    shards: list[dict[str, torch.Tensor]] = [{}]
    names: list[str] = []
    size, total = 0, 0

    t0 = time.perf_counter()

    def flush() -> None:
        nonlocal size
        name = f".shard-{len(names):05d}.safetensors"
        save_file(shards[-1], str(tmp / name), metadata={"format": "pt"})
        names.append(name)
        shards[-1] = {}
        progress(f"  shard {len(names)} written ({size / 2**30:.2f} GiB; {total / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s)")
        size = 0

    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    keys = [(name, None) for f in sorted(by_file) for name in by_file[f]] + [(k, v) for k, v in scales.items()]
    weight_map: dict[str, int] = {}
    for name, given in keys:
        if given is None:
            with safe_open(str(files[name]), framework="pt", device="cpu") as h:
                t = h.get_tensor(name)
            t = t.to(tdt) if t.is_floating_point() else t
        else:
            t = given
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > limit:
            flush()
        shards[-1][name] = t
        weight_map[name] = len(names)
        size += nbytes
        total += nbytes
    flush()
    n = len(names)
    final = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for old, new in zip(names, final):
        (tmp / old).rename(tmp / new)
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: final[i] for k, i in weight_map.items()}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    cfg = json.loads((Path(src.checkpoint_dir) / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = dtype
    cfg["quantization_config"] = _vllm_quantization_config(fmt)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = Path(src.checkpoint_dir) / "generation_config.json"
    if gen.is_file():
        (tmp / gen.name).write_text(gen.read_text())
    if src.tokenizer is not None:
        src.tokenizer.save_pretrained(str(tmp))


def _write_trtllm(tmp: Path, loaded: Any, kv_scale: torch.Tensor, fmt: KVFormat, tp_size: int, dtype: str) -> None:
    from safetensors.torch import save_file

    cfg = trtllm_config(loaded.model.config, loaded.info, fmt, tp_size, dtype)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for rank in range(tp_size):
        w = trtllm_rank_weights(loaded.model, loaded.info, tp_size, rank, _OUT_DTYPES[dtype])
        for i, s in enumerate(kv_scale.tolist()):
            t = torch.tensor([s], dtype=torch.float32)
            w[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"] = t
            w[f"transformer.layers.{i}.attention.kv_cache_rcp_scaling_factor"] = torch.reciprocal(t)
        save_file(w, str(tmp / f"rank{rank}.safetensors"), metadata={"format": "pt"})
        del w
    if loaded.tokenizer is not None:  # not part of the checkpoint: for the runner's --tokenizer_dir
        loaded.tokenizer.save_pretrained(str(tmp / "tokenizer"))


def export_checkpoint(
    calibration: str | Path,
    model: str,
    target: str,
    out: str | Path,
    *,
    kv: str | KVFormat | None = None,
    tp_size: int = 1,
    force: bool = False,
    dtype: str = "auto",
    max_shard_size: str | int = "5GB",
    q_windows: int | None = None,
    loaded: Any = None,
    allow_other_model: bool = False,
    progress: Callable[[str], None] | None = None,
) -> ExportResult:
    """Write a complete ``target`` checkpoint of ``model`` with the KV scales of ``calibration``.

    ``kv``: the format to export (default ``fp8``); ``tp_size``: TensorRT-LLM ranks (vLLM splits at
    load time; the value is only echoed in the serve command); ``dtype``: weights dtype (``auto``:
    the source's fp16/bf16, else float16); ``max_shard_size``: vLLM shard size (``save_pretrained``);
    ``q_windows``: TensorRT-LLM FP8 only, how many of the recorded calibration windows to run for the
    query range (default all, 0 = leave Q out); ``loaded``: an already loaded ``LoadedModel`` of ``model``;
    ``progress(line)``: told what is about to be read once every check and the memory plan passed (an 8B model's
    first line, before a minute of reading), then each shard written when copying tensor by tensor.
    """
    from trtkv.artifacts import atomic_directory, load_calibration
    from trtkv.models import load_model, model_info

    target = (target or "").strip().lower()
    if target not in TARGETS:
        raise TrtkvError(f"unknown export target {target!r}", "use --to vllm or --to trtllm")
    dest = Path(out).expanduser().absolute()
    if dest.exists() and not force:
        raise TrtkvError(f"--out {dest} already exists", "pass --force to replace it, or choose another --out")
    if tp_size < 1:
        raise TrtkvError(f"--tp-size must be at least 1, got {tp_size}", "pass e.g. --tp-size 2")
    if q_windows is not None and q_windows < 0:
        raise TrtkvError(f"--q-windows must be 0 or more, got {q_windows}", "pass e.g. --q-windows 8, or 0 to skip")
    cal = load_calibration(calibration)
    fmt = get_format(kv or DEFAULT_FORMAT)
    check_target_format(target, fmt)
    info = loaded.info if loaded is not None else model_info(model)
    params = cal.params_for(fmt, info, allow_other_model=allow_other_model)  # refuses another model / missing format
    load_note = None
    say = progress or (lambda line: None)
    if loaded is None:  # the memory plan before a weight is read: a refusal writes nothing
        first = (f"export {info.name}: {info.shape()}, {info.num_params / 1e9:.2f} B parameters; {fmt.name} KV scales into a "
                 f"{target} checkpoint")
        try:
            load_dtype, load_note = _plan_load(model, info, target, fmt, tp_size, dtype, cal, q_windows)
            say(f"{first}; loading the weights in {str(load_dtype).removeprefix('torch.')}")
            loaded = load_model(model, device="cpu", dtype=load_dtype)
        except TrtkvError as refused:
            if target != "vllm" or not refused.problem.startswith("export does not fit"):
                raise
            loaded, load_note = _copy_source(model, info, dtype, max_shard_size, refused)
            say(f"{first}; copying the weights tensor by tensor, at most {max_shard_size} per shard")
    if target == "trtllm":
        check_trtllm_model(loaded.info, loaded.model.config, tp_size)
    elif loaded.info.num_heads % tp_size:
        raise TrtkvError(
            f"vLLM cannot split {loaded.info.num_heads} attention heads over --tensor-parallel-size {tp_size}",
            f"use a tp size dividing {loaded.info.num_heads}",
        )
    elif loaded.info.num_kv_heads % tp_size and tp_size % loaded.info.num_kv_heads:
        raise TrtkvError(
            f"vLLM cannot split {loaded.info.num_kv_heads} KV heads over --tensor-parallel-size {tp_size}",
            f"use a tp size that divides {loaded.info.num_kv_heads} or is a multiple of it",
        )
    out_dtype = _out_dtype(dtype, loaded)
    notes: list[str] = [load_note] if load_note else []
    q_amax = None
    if target == "vllm":
        scales = vllm_scale_tensors(params)
        summary = {kv_: [float(scales[f"model.layers.{i}.self_attn.{kv_}_scale"].max()) for i in range(len(params))] for kv_ in "kv"}
    else:
        if fmt.k.dtype == "fp8_e4m3" and q_windows != 0:
            windows = _calibration_windows(cal, loaded.tokenizer, q_windows)
            q_amax = query_absmax(loaded, windows)
            notes.append(f"FP8 scale = max(K, V, Q ranges) / 448; Q absmax (post-RoPE) measured on {windows.shape[0]} x {windows.shape[1]} calibration tokens")
        elif fmt.k.dtype == "fp8_e4m3":
            notes.append("FP8 scale = max(K, V ranges) / 448; the query range was not measured (--q-windows 0): Q may saturate in FP8 context attention")
        kv_scale = trtllm_kv_scales(params, fmt, q_amax)
        summary = {"kv": [float(x) for x in kv_scale]}
    if not all(torch.isfinite(torch.tensor(v)).all() and min(v) > 0 for v in summary.values()):
        raise TrtkvError(f"calibration {cal.path} has non-positive or non-finite scales for {fmt.name}", "rerun trtkv calibrate")

    what = f"the {target} checkpoint"
    with atomic_directory(dest, what=what) as tmp:
        if target == "vllm" and loaded.model is None:
            _write_vllm_copied(tmp, loaded, scales, fmt, out_dtype, max_shard_size, say)
        elif target == "vllm":
            _write_vllm(tmp, loaded, scales, fmt, out_dtype, max_shard_size)
        else:
            _write_trtllm(tmp, loaded, kv_scale, fmt, tp_size, out_dtype)
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        result = ExportResult(out=dest, target=target, format=fmt.name, tp_size=tp_size, dtype=out_dtype,
                              files=files + [MANIFEST], scales=summary, q_amax=q_amax, notes=notes)
        manifest = {
            "trtkv_version": __version__,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "calibration": str(cal.path.absolute()),
            "model": {"name": loaded.info.name, "sha256": loaded.info.sha256, "architecture": loaded.info.architecture},
            "calibration_method": cal.recipe.formats[fmt.name].method if fmt.name in cal.recipe.formats else cal.recipe.method,
            "format_definition": fmt.model_dump(),
            "scale_direction": "dequantize: x = code * scale",
            "next_step": result.next_step(),
            **{k: v for k, v in asdict(result).items() if k not in ("out", "files")},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return result


__all__ = [
    "ExportResult", "export_checkpoint", "check_target_format", "check_trtllm_model", "trtllm_config",
    "trtllm_rank_weights", "trtllm_kv_scales", "vllm_scale_tensors", "query_absmax", "TARGETS",
]
