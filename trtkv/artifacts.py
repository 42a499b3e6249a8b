"""The calibration artifact: what ``trtkv calibrate`` writes and eval / the builder read.

Layout of an artifact directory (written atomically, see ``save_calibration``)::

    recipe.json              CalibrationRecipe: provenance, model identity, formats, per-layer summary
    kv_scales.safetensors    {format}.layers.{i}.{k|v}.{scale|smooth|clip|codebook}  float32
    stats.safetensors        raw K/V statistics (trtkv.calibration.stats.KVStats.to_tensors)
    report.md, plots/*.png   human-readable report
    trtllm/, vllm/           scale exports in other engines' conventions (docs/calibration.md)

``load_calibration(dir).params_for(fmt, info)`` returns the per-layer ``LayerParams`` for a
format and refuses (``TrtkvError``) when the artifact was made for another model or did not
calibrate that format.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from trtkv import __version__
from trtkv.errors import TrtkvError
from trtkv.formats import PRESETS, KVFormat, fit_format, get_format
from trtkv.models import ModelInfo
from trtkv.quant import TensorParams

SCHEMA_VERSION = 1
RECIPE_FILE = "recipe.json"
SCALES_FILE = "kv_scales.safetensors"
STATS_FILE = "stats.safetensors"
REPORT_FILE = "report.md"

_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(TensorParams))  # scale, smooth, clip, codebook
_KEY_RE = re.compile(r"^(?P<fmt>.+)\.layers\.(?P<layer>\d+)\.(?P<kv>[kv])\.(?P<field>" + "|".join(_PARAM_FIELDS) + ")$")
_RERUN = "run `trtkv calibrate --model MODEL --dataset DATA --out DIR` again"


@dataclass
class LayerParams:
    """Calibrated constants of one layer: K and V ``TensorParams`` (see trtkv.quant for shapes)."""

    k: TensorParams = field(default_factory=TensorParams)
    v: TensorParams = field(default_factory=TensorParams)


class ModelIdentity(ModelInfo):
    """The model record of the calibrated model, as recipe.json stores it (extra fields are kept)."""

    model_config = ConfigDict(extra="allow", frozen=False)

    @classmethod
    def of(cls, info: Any) -> "ModelIdentity":
        """From a ``trtkv.models.ModelInfo`` (or a mapping with the same fields)."""
        if isinstance(info, ModelIdentity):
            return info
        data = info.model_dump() if isinstance(info, BaseModel) else asdict(info) if is_dataclass(info) else dict(info)
        return cls.model_validate(data)


class LayerChoice(BaseModel):
    """Human-readable summary of one layer's parameters for one format (full tensors are in kv_scales)."""

    model_config = ConfigDict(extra="allow")

    layer: int
    k_scale: list[float] | float | None = None  # per_tensor: float; per_head: [H]; per_channel: per-head max
    v_scale: list[float] | float | None = None
    k_clip: list[float] | float | None = None
    v_clip: list[float] | float | None = None
    k_smooth_max: float | None = None  # largest smoothing divisor of the layer
    v_smooth_max: float | None = None
    k_clip_ratio: float | None = None  # chosen range / absmax range (1.0 = max calibration), mean over heads
    v_clip_ratio: float | None = None
    k_codebook: list[list[float]] | None = None  # nuq formats: the levels per KV head, in code units (the full table)
    v_codebook: list[list[float]] | None = None
    k_channels_at_bits: list[int] | None = None  # alloc formats: how many channels of the layer's heads got 0, 1, 2 ... bits
    v_channels_at_bits: list[int] | None = None


class FormatCalibration(BaseModel):
    model_config = ConfigDict(extra="allow")

    definition: KVFormat
    method: str
    layers: list[LayerChoice] = []
    mse: dict[str, list[float]] = {}  # e.g. {"k": [...per layer], "v": [...], "k_max": [...], "v_max": [...]}


class CalibrationRecipe(BaseModel):
    """recipe.json: everything needed to reproduce and to check an artifact."""

    model_config = ConfigDict(extra="allow")

    schema_version: int = SCHEMA_VERSION
    trtkv_version: str = __version__
    created: str = ""
    model: ModelIdentity
    dataset: dict[str, Any] = {}
    samples: int = 0
    seq_len: int = 0
    windows_start_with_bos: bool = False  # [BOS] + seq_len-1 tokens per window (the tokenizer adds BOS)
    seed: int = 0
    tokens: int = 0
    method: str = "mse"
    options: dict[str, Any] = {}  # method knobs: percentile, smooth_alpha, grids
    formats: dict[str, FormatCalibration] = {}
    requested_formats: list[str] = []
    throughput: dict[str, float] = {}  # tokens, seconds, tokens_per_s
    exports: dict[str, list[str]] = {}  # format -> relative paths of exported files


# --------------------------------------------------------------------------- params <-> tensors


def params_to_tensors(params: Mapping[str, list[LayerParams]]) -> dict[str, torch.Tensor]:
    """Flatten ``{format: [LayerParams]}`` to safetensors keys ``{fmt}.layers.{i}.{k|v}.{field}`` (float32)."""
    out: dict[str, torch.Tensor] = {}
    for name, layers in params.items():
        for i, lp in enumerate(layers):
            for kv in ("k", "v"):
                tp: TensorParams = getattr(lp, kv)
                for f in _PARAM_FIELDS:
                    t = getattr(tp, f)
                    if t is not None:
                        out[f"{name}.layers.{i}.{kv}.{f}"] = t.detach().to("cpu", torch.float32).contiguous()
    return out


def tensors_to_params(tensors: Mapping[str, torch.Tensor], num_layers: int) -> dict[str, list[LayerParams]]:
    """Inverse of ``params_to_tensors``; every format gets ``num_layers`` entries."""
    out: dict[str, list[LayerParams]] = {}
    for key, t in tensors.items():
        m = _KEY_RE.match(key)
        if m is None:
            continue
        layers = out.setdefault(m["fmt"], [LayerParams() for _ in range(num_layers)])
        i = int(m["layer"])
        if i >= num_layers:
            raise TrtkvError(f"{SCALES_FILE} has key {key} beyond the recipe's {num_layers} layers", _RERUN)
        setattr(getattr(layers[i], m["kv"]), m["field"], t.float())
    return out


# --------------------------------------------------------------------------- atomic save


def _unwritable(path: Path, exc: BaseException, what: str = "the calibration artifact") -> TrtkvError:
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return TrtkvError(
        f"cannot write {what} to {path}: {reason}",
        "choose an --out directory whose parent exists and is writable (or fix its permissions)",
    )


def _write_file(root: Path, rel: str, content: bytes | str | Path) -> None:
    rel_path = Path(rel)
    if rel_path.is_absolute() or ".." in rel_path.parts:
        raise ValueError(f"artifact file names must be relative and inside the artifact: {rel}")
    dest = root / rel_path
    dest.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, Path):
        shutil.copyfile(content, dest)
    elif isinstance(content, str):
        dest.write_text(content)
    else:
        dest.write_bytes(content)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fix_modes(root: Path) -> None:
    """mkdtemp makes 0700 folders and some writers 0600 files: give the artifact ordinary modes."""
    mask = _umask()
    os.chmod(root, 0o777 & ~mask)
    for p in root.rglob("*"):
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


@contextlib.contextmanager
def atomic_directory(out_dir: str | Path, *, replace: bool = True, what: str = "the calibration artifact") -> Iterator[Path]:
    """Build a directory atomically: yields a fresh sibling ``{DIR}.tmp-XXXX`` to fill.

    When the ``with`` body completes, the temporary directory gets ordinary modes and is moved into
    place with ``os.replace`` (an existing ``DIR`` is moved aside first and deleted after the swap;
    with ``replace=False`` an existing ``DIR`` is refused up front). On any failure nothing new is
    left behind and an existing ``DIR`` is untouched; an ``OSError`` becomes a ``TrtkvError`` naming
    the path. ``what`` names the output in those messages.
    """
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise TrtkvError(f"--out {out} exists and is not a directory", f"pass a directory path for {what}")
    if out.exists() and not replace:
        raise TrtkvError(f"--out {out} already exists", "pass --force to replace it, or choose another --out")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=parent))
    except OSError as exc:
        raise _unwritable(parent, exc, what) from None

    old: Path | None = None
    try:
        _fix_modes(tmp)
        yield tmp
        _fix_modes(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f"{out.name}.old-", dir=parent))
            os.replace(out, old / "prev")
        os.replace(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            if (old / "prev").exists() and not out.exists():
                os.replace(old / "prev", out)
            shutil.rmtree(old, ignore_errors=True)
        if isinstance(exc, OSError):
            raise _unwritable(out, exc, what) from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_calibration(
    out_dir: str | Path,
    recipe: CalibrationRecipe,
    params: Mapping[str, list[LayerParams]],
    stats_tensors: Mapping[str, torch.Tensor] | None = None,
    report_files: Mapping[str, bytes | str | Path] | None = None,
) -> Path:
    """Write an artifact directory atomically (``atomic_directory``) and return its path.

    Everything is written into a sibling ``{DIR}.tmp-XXXX`` first; only when every file is
    complete is it moved into place with ``os.replace`` (an existing ``DIR`` is moved aside
    first and deleted after the swap). On any failure nothing new is left behind and an existing
    ``DIR`` is untouched. ``report_files`` maps relative paths (``report.md``, ``plots/x.png``,
    ``trtllm/...``) to their content.
    """
    from safetensors.torch import save_file

    num_layers = recipe.model.num_layers
    for name, layers in params.items():
        if len(layers) != num_layers:
            raise ValueError(f"format {name}: {len(layers)} layer params for a {num_layers}-layer model")
    with atomic_directory(out_dir) as tmp:
        (tmp / RECIPE_FILE).write_text(recipe.model_dump_json(indent=2) + "\n")
        save_file(params_to_tensors(params), str(tmp / SCALES_FILE), metadata={"trtkv": __version__, "schema": str(SCHEMA_VERSION)})
        if stats_tensors:
            save_file({k: v.detach().cpu().contiguous() for k, v in stats_tensors.items()}, str(tmp / STATS_FILE))
        for rel, content in (report_files or {}).items():
            _write_file(tmp, rel, content)
    return Path(out_dir).expanduser().absolute()


# --------------------------------------------------------------------------- load


def _same_storage(a: KVFormat, b: KVFormat) -> bool:
    return a.k == b.k and a.v == b.v and a.shared_kv_scale == b.shared_kv_scale


@dataclass
class Calibration:
    """A loaded artifact: the recipe and the per-format parameters."""

    path: Path
    recipe: CalibrationRecipe
    params: dict[str, list[LayerParams]]

    @property
    def formats(self) -> list[str]:
        return list(self.recipe.formats)

    def check_model(self, info: Any, *, allow_other_model: bool = False) -> None:
        """Refuse a model whose KV geometry (always) or weights hash (unless allowed) differs."""
        want = self.recipe.model
        got = ModelIdentity.of(info)
        if (want.num_layers, want.num_kv_heads, want.head_dim) != (got.num_layers, got.num_kv_heads, got.head_dim):
            raise TrtkvError(
                f"calibration {self.path} was made for {want.name} ({want.shape()}) but the model {got.name} has {got.shape()}",
                f"calibrate this model: trtkv calibrate --model {got.name} --out DIR",
            )
        if want.sha256 != got.sha256 and not allow_other_model:
            raise TrtkvError(
                f"calibration {self.path} was made for {want.name} (sha256 {want.sha256[:12]}) but the model "
                f"{got.name} has sha256 {got.sha256[:12]} (same shape, different weights)",
                f"calibrate this model (trtkv calibrate --model {got.name}), or pass --allow-other-model to reuse the scales",
            )

    def definition(self, fmt: str | KVFormat) -> str | KVFormat:
        """The artifact's own definition for a format name it holds that is not a preset (e.g. a ``--budget`` choice),
        else ``fmt``: a preset's name is the preset, whatever an older artifact stored under it (``params_for`` refuses
        a stored definition that differs)."""
        if isinstance(fmt, str) and fmt in self.recipe.formats and fmt not in PRESETS:
            return self.recipe.formats[fmt].definition
        return fmt

    def _resolve(self, fmt: str | KVFormat) -> tuple[str, KVFormat]:
        if isinstance(fmt, str) and fmt in self.recipe.formats and fmt not in PRESETS:
            return fmt, self.recipe.formats[fmt].definition
        want = get_format(fmt)
        if isinstance(fmt, str) and fmt in PRESETS:  # a preset by name: as calibration fitted it to the model
            want = fit_format(want, self.recipe.model.head_dim)[0] or want
        if want.name in self.recipe.formats:
            have = self.recipe.formats[want.name].definition
            if not _same_storage(have, want):
                raise TrtkvError(
                    f"calibration {self.path} has a format named {want.name} with a different definition ({have.spec()} vs {want.spec()})",
                    f"rerun trtkv calibrate with --kv {want.name if want.name in PRESETS else repr(want.spec())}",
                )
            return want.name, want
        for name, fc in self.recipe.formats.items():
            if _same_storage(fc.definition, want):
                return name, want
        return want.name, want

    def params_for(self, fmt: str | KVFormat, info: Any, *, allow_other_model: bool = False) -> list[LayerParams]:
        """Per-layer parameters of ``fmt`` (a name, spec string or ``KVFormat``) for the model ``info``.

        Formats that need no calibration (fp16, dynamic scales without smoothing) that are not
        in the artifact get empty parameters (no clip); anything else missing is an error.
        """
        self.check_model(info, allow_other_model=allow_other_model)
        name, kvf = self._resolve(fmt)
        if name in self.params or name in self.recipe.formats:
            layers = self.params.get(name) or [LayerParams() for _ in range(self.recipe.model.num_layers)]
            return [LayerParams(k=lp.k.map(lambda t: t), v=lp.v.map(lambda t: t)) for lp in layers]
        if not kvf.needs_calibration:
            return [LayerParams() for _ in range(self.recipe.model.num_layers)]
        have = ", ".join(self.recipe.formats) or "none"
        raise TrtkvError(
            f"calibration {self.path} has no parameters for KV format {name} (calibrated: {have})",
            f"rerun trtkv calibrate with --kv {name}",
        )


def load_calibration(path: str | Path) -> Calibration:
    """Read an artifact directory written by ``save_calibration``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path).expanduser()
    if not root.is_dir():
        raise TrtkvError(f"calibration directory {root} does not exist", _RERUN)
    recipe_path = root / RECIPE_FILE
    try:
        recipe = CalibrationRecipe.model_validate_json(recipe_path.read_text())
    except FileNotFoundError:
        raise TrtkvError(f"{root} is not a calibration artifact (no {RECIPE_FILE})", _RERUN) from None
    except ValidationError as exc:
        raise TrtkvError(f"{recipe_path} is invalid: {exc.errors()[0]['msg']}", _RERUN) from None
    except ValueError as exc:
        raise TrtkvError(f"{recipe_path} is not valid JSON: {exc}", _RERUN) from None
    if recipe.schema_version > SCHEMA_VERSION:
        raise TrtkvError(
            f"{recipe_path} has schema version {recipe.schema_version}, newer than this trtkv understands ({SCHEMA_VERSION})",
            "upgrade trtkv",
        )
    scales_path = root / SCALES_FILE
    try:
        tensors = load_file(str(scales_path))
    except FileNotFoundError:
        raise TrtkvError(f"{root} has no {SCALES_FILE}", _RERUN) from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise TrtkvError(f"{scales_path} is unreadable: {exc}", _RERUN) from None
    params = tensors_to_params(tensors, recipe.model.num_layers)
    return Calibration(path=root, recipe=recipe, params=params)


def calibration_sha256(path: str | Path) -> str:
    """Identity of an artifact: sha256 over ``recipe.json`` and ``kv_scales.safetensors`` (name, NUL, bytes, in that order)."""
    h = hashlib.sha256()
    for name in (RECIPE_FILE, SCALES_FILE):
        h.update(name.encode() + b"\0")
        h.update((Path(path) / name).read_bytes())
    return h.hexdigest()


def load_stats_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The raw statistics of an artifact (``trtkv.calibration.stats.KVStats.from_tensors`` rebuilds them)."""
    from safetensors.torch import load_file

    p = Path(path)
    p = p / STATS_FILE if p.is_dir() else p
    if not p.is_file():
        raise TrtkvError(f"{p} does not exist", _RERUN)
    return load_file(str(p))


def json_floats(t: torch.Tensor | None, digits: int = 6) -> list[float] | float | None:
    """A small tensor as rounded JSON numbers (0-d -> float)."""
    if t is None:
        return None
    vals = t.detach().float().cpu()
    if vals.dim() == 0:
        return float(f"{vals.item():.{digits}g}")
    return [float(f"{v:.{digits}g}") for v in vals.flatten().tolist()]


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False) + "\n"
