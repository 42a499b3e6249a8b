"""The engine directory's manifest: one versioned pydantic schema, everything the runtime and the Triton
repository generator need to know about a built engine.

An engine directory (written atomically by ``trtkv build-engine``)::

    manifest.json           EngineManifest (this module)
    model.onnx              the step network (docs/kv-cache-format.md "The engine step contract")
    model.onnx.data         its weights (ONNX external data)
    model.ort.onnx          plugin attention only: the same graph for ONNX Runtime (plugins/ort_ops.py)
    kv_params.safetensors   the KV constants baked into the network, which the runtime needs to SEAL
                            blocks: ``kv.layers.{i}.{k|v}.{scale|smooth|clip}`` float32
    tokenizer/              tokenizer files (``AutoTokenizer.from_pretrained(dir / "tokenizer")``)
    plans/sm{CC}.plan       TensorRT / TensorRT-RTX engines, one per compute capability (TensorRT backends)

``load_manifest(dir)`` reads and validates it (schema version, files present with the recorded sizes,
the KV format and pool shapes consistent with ``trtkv.cache_layout.PagedKVLayout``) and refuses with
one ``TrtkvError`` line otherwise. ``EngineManifest.layout(num_blocks, num_slots)`` is the one way the
runtime gets the pool layout of an engine; it is never re-derived.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field, model_validator

from trtkv.engine_backends import Backend
from trtkv.errors import TrtkvError
from trtkv.formats import KVFormat
from trtkv.models import ModelInfo

SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"
ONNX_FILE = "model.onnx"
ONNX_DATA_FILE = "model.onnx.data"
ORT_PLUGIN_ONNX_FILE = "model.ort.onnx"  # plugin attention: model.onnx with the trtkv:: nodes renamed for onnxruntime-extensions
KV_PARAMS_FILE = "kv_params.safetensors"
KV_PARAMS_PREFIX = "kv"  # keys kv.layers.{i}.{k|v}.{field} (trtkv.artifacts.params_to_tensors with format name "kv")
TOKENIZER_DIR = "tokenizer"
PLANS_DIR = "plans"
SHAPE_FREE_BACKENDS = ("onnxruntime", "torch")  # engines that take any batch, pool and slot count


def accepts_any_shape(backend: str) -> bool:
    """ONNX Runtime (and the torch reference) run any batch / pool size; TensorRT plans only their profile's ``limits``."""
    return backend in SHAPE_FREE_BACKENDS

Attention = Literal["native", "plugin"]
ComputeDtype = Literal["fp16", "fp32"]
_REBUILD = "rebuild the engine with `trtkv build-engine ... --force`"


class TensorSpec(BaseModel):
    """One input or output of the step network. Dims are ints or symbolic names (``batch``, ``num_blocks``...)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    shape: list[int | str]
    dtype: str  # as declared at the graph boundary (onnx dtype name, lower case: int64, int8, float16, float32)
    storage_dtype: str | None = None  # the pool's real dtype when it differs (uint8 codes declared int8)


class PoolSpec(BaseModel):
    """The paged cache of one of K or V, all layers stacked (shapes without the leading layer axis)."""

    model_config = ConfigDict(extra="forbid")

    tensor_format: str  # TensorFormat.short()
    data_dtype: str  # storage dtype of data (float16, int8, uint8)
    packed_dim: int
    scale: Literal["none", "per_token", "per_block"] = "none"  # dynamic scale tensor kind
    groups: int = 0  # scales per token and head (per_token kind)
    zero: bool = False


class ModelSpec(ModelInfo):
    """The model record inside the engine (manifest.json's ``model``); the graph was built from these fields."""

    model_config = ConfigDict(extra="allow")


class Limits(BaseModel):
    """What one engine accepts; TensorRT plans are built for exactly these ranges."""

    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(ge=1)
    max_seq_len: int = Field(ge=1)
    block_size: int = Field(ge=1)
    max_blocks_per_seq: int = Field(ge=1)  # ceil(max_seq_len / block_size): block_tables' second dim at most
    max_new_tokens_per_step: int = Field(ge=1)  # = block_size: a step never crosses a block boundary
    max_num_blocks: int = Field(ge=1)  # pool blocks (TensorRT profile max; see accepts_any_shape)
    max_num_slots: int = Field(ge=1)  # open-block slots (TensorRT profile max)


class PlanFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    compute_capability: int  # 80, 86, 89, 120 (sm_XY as XY)
    path: str
    bytes: int
    build_seconds: float


class CalibrationRef(BaseModel):
    model_config = ConfigDict(extra="allow")

    path: str = ""
    sha256: str = ""  # of recipe.json + kv_scales.safetensors; "" when no calibration was used
    format_name: str = ""  # the format's name inside the artifact


class EngineManifest(BaseModel):
    """manifest.json of an engine directory."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    schema_version: int = SCHEMA_VERSION
    trtkv_version: str
    created: str
    model: ModelSpec
    kv_format: KVFormat  # with the engine's block size (fmt.with_block_size): the one serialized definition
    backend: Backend
    attention: Attention
    dtype: ComputeDtype  # compute and weight dtype of the network
    opset: int
    limits: Limits
    k_pool: PoolSpec
    v_pool: PoolSpec
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    all_logits: bool = False  # logits [B, T, V] instead of [B, V]
    bytes_per_token: float  # pool bytes per token, K + V, all layers, scales included
    bytes_per_block: int  # one pool block, K + V, all layers
    tail_bytes_per_slot: int  # one sequence slot's fp16 open blocks, K + V, all layers
    calibration: CalibrationRef
    files: dict[str, int]  # relative path -> bytes
    plans: list[PlanFile] = []
    build: dict[str, Any] = {}  # versions, host, seconds per stage
    runtime_needs: dict[str, str] = {}  # backend -> what it needs at run time

    @model_validator(mode="before")
    @classmethod
    def _derived_fields(cls, data: Any) -> Any:
        """``kv_spec`` in manifest.json is for people; it is derived from ``kv_format``, never read back."""
        if isinstance(data, dict) and "kv_spec" in data:
            data = {k: v for k, v in data.items() if k != "kv_spec"}
        return data

    @computed_field
    @property
    def kv_spec(self) -> str:
        """The format as users write it (``--kv``), written to manifest.json beside the definition."""
        return self.kv_format.spec()

    # ------------------------------------------------------------------ helpers

    def layout(self, num_blocks: int, num_slots: int):
        """The per-layer ``PagedKVLayout`` of this engine for a pool of ``num_blocks`` blocks and ``num_slots`` slots."""
        from trtkv.cache_layout import PagedKVLayout

        return PagedKVLayout(self.kv_format, self.model.num_kv_heads, self.model.head_dim, self.limits.block_size, num_blocks, num_slots)

    @property
    def plugin_ops(self) -> bool:
        """Whether the network's attention is ``trtkv::`` plugin nodes (``build-engine --attention plugin``): its runner
        registers them (ONNX Runtime's custom ops, TensorRT's plugins)."""
        return self.attention == "plugin"

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def plan_for(self, compute_capability: int) -> PlanFile | None:
        return next((p for p in self.plans if p.compute_capability == compute_capability), None)


def pool_spec(layout, which: str) -> PoolSpec:
    """The manifest's description of one pool, read from a ``PagedKVLayout`` (a per-layer format: layer 0's; the
    format's ``layers`` say the rest)."""
    layout = layout.layer(0)
    t = layout.tensor_format(which)
    shape = layout.scale_shape(which)  # None, [NB, H, D] per block and channel, or [NB, H, bs, groups] per token
    kind = "none" if shape is None else ("per_block" if t.is_block_wise else "per_token")
    return PoolSpec(
        tensor_format=t.short(),
        data_dtype=str(layout.data_dtype(which)).removeprefix("torch."),
        packed_dim=layout.packed_dim(which),
        scale=kind,
        groups=shape[-1] if kind == "per_token" else 0,
        zero=layout.zero_shape(which) is not None,
    )


def load_manifest(engine_dir: str | Path, *, check_files: bool = True) -> EngineManifest:
    """Read and validate ``engine_dir/manifest.json``; one ``TrtkvError`` line for anything wrong."""
    root = Path(engine_dir).expanduser()
    if not root.is_dir():
        raise TrtkvError(f"engine directory {root} does not exist", "build one with `trtkv build-engine --out DIR`")
    path = root / MANIFEST_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TrtkvError(f"{root} is not an engine directory (no {MANIFEST_FILE})", "build one with `trtkv build-engine --out DIR`") from None
    try:
        import json

        raw = json.loads(text)
    except ValueError as exc:
        raise TrtkvError(f"{path} is not valid JSON: {exc}", _REBUILD) from None
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if isinstance(version, int) and version > SCHEMA_VERSION:
        raise TrtkvError(f"{path} has schema version {version}, newer than this trtkv understands ({SCHEMA_VERSION})", "upgrade trtkv")
    try:
        m = EngineManifest.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise TrtkvError(f"{path} is invalid: {loc}: {err['msg']}", _REBUILD) from None
    validate_manifest(m, root if check_files else None)
    return m


def validate_manifest(m: EngineManifest, root: Path | None = None) -> None:
    """Cross-field checks (and, with ``root``, the files on disk)."""
    lim = m.limits
    if m.kv_format.block_size != lim.block_size:
        raise TrtkvError(f"manifest: KV format block size {m.kv_format.block_size} != engine block size {lim.block_size}", _REBUILD)
    if lim.max_blocks_per_seq * lim.block_size < lim.max_seq_len:
        raise TrtkvError(f"manifest: {lim.max_blocks_per_seq} blocks of {lim.block_size} cannot hold max_seq_len {lim.max_seq_len}", _REBUILD)
    lay = m.layout(1, 1)  # raises TrtkvError for an inconsistent format / geometry
    for which, spec in (("k", m.k_pool), ("v", m.v_pool)):
        want = pool_spec(lay, which)
        if spec != want:
            raise TrtkvError(f"manifest: {which}_pool {spec.model_dump()} does not match the format's layout {want.model_dump()}", _REBUILD)
    L = m.model.num_layers
    if m.bytes_per_block != lay.block_bytes(range(L)) or m.tail_bytes_per_slot != lay.tail_bytes_per_slot() * L:
        raise TrtkvError("manifest: byte counts do not match the format's layout", _REBUILD)
    names = {t.name for t in m.inputs}
    for need in ("input_ids", "context_lens", "new_lens", "block_tables", "slot_ids", "k_data", "v_data", "k_tail", "v_tail"):
        if need not in names:
            raise TrtkvError(f"manifest: the step network has no input {need}", _REBUILD)
    if m.backend not in ("onnxruntime", "torch") and not m.plans:
        raise TrtkvError(f"manifest: backend {m.backend} but no engine plans", _REBUILD)
    if root is None:
        return
    for rel, size in m.files.items():
        f = root / rel
        if not f.is_file():
            raise TrtkvError(f"engine directory {root} lacks {rel}", _REBUILD)
        if f.stat().st_size != size:
            raise TrtkvError(f"{f} has {f.stat().st_size} bytes, the manifest says {size} (truncated or replaced?)", _REBUILD)
    for p in m.plans:
        if p.path not in m.files:
            raise TrtkvError(f"manifest: plan {p.path} is not listed in files", _REBUILD)
