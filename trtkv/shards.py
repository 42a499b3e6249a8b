"""Which files a Hugging Face model directory's weights are in, and what tensors they hold (headers only).

The one rule: when ``model.safetensors.index.json`` exists, the files its ``weight_map`` names are the checkpoint's
files (a listed shard that is absent is an error naming it; a ``*.safetensors`` the index does not list is ignored);
otherwise every ``*.safetensors`` in the directory is. Everything that reads a model directory's weights
(``model_info``'s parameter count and hash, layer streaming, the copying export) asks ``checkpoint_files`` or
``tensor_index``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtkv.errors import TrtkvError

INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: the file holding it, its safetensors dtype (``"BF16"``, ``"F32"``, ...) and shape."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def _read_index(d: Path) -> dict[str, str]:
    path = d / INDEX_FILE
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("weight_map is not a mapping of tensor names to file names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TrtkvError(f"cannot read the shard index '{path}' ({type(e).__name__}: {e})",
                         "re-download the checkpoint or fix model.safetensors.index.json") from None
    return weight_map


def checkpoint_files(d: str | Path) -> list[Path]:
    """The safetensors files of model directory ``d``, sorted: the index's shards when it has one, else ``*.safetensors``.

    Raises a one-line ``TrtkvError`` when a shard the index lists is missing, or when there are no weights.
    """
    d = Path(d)
    if (d / INDEX_FILE).is_file():
        files = sorted({d / name for name in _read_index(d).values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise TrtkvError(f"model directory '{d}' lacks shard '{missing[0]}'{more} listed in {INDEX_FILE}",
                             "finish the download (every file the index's weight_map names must be present)")
        if files:
            return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        extra = " (pytorch_model.bin is not supported)" if any(d.glob("*.bin")) else ""
        raise TrtkvError(
            f"model directory '{d}' has no *.safetensors weights{extra}",
            "save the model with save_pretrained(..., safe_serialization=True) or pass a .gguf file",
        )
    return files


def safetensors_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor name -> {dtype, shape, data_offsets}, ``__metadata__`` dropped);
    reads the header only. A one-line ``TrtkvError`` when it is not a readable safetensors file."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > _MAX_HEADER:
                raise ValueError("header too large")
            header = json.loads(fh.read(n))
        return {k: v for k, v in header.items() if k != "__metadata__"}
    except Exception as e:
        raise TrtkvError(
            f"'{path}' is not a readable safetensors file ({type(e).__name__})",
            "check that the download is complete",
        ) from None


def tensor_index(d: str | Path) -> dict[str, TensorEntry]:
    """Tensor name -> ``TensorEntry(file, dtype, shape)`` for every tensor of model directory ``d``.

    Reads the safetensors headers of ``checkpoint_files(d)`` only (no weight is read), so it is cheap on a 70B
    checkpoint: what layer streaming and memory planning use to know where each tensor is and how large it is
    (bytes = ``prod(shape) * itemsize(dtype)``). With an index, a tensor its ``weight_map`` assigns to a shard that
    does not hold it is a one-line ``TrtkvError``.
    """
    d = Path(d)
    out: dict[str, TensorEntry] = {}
    for f in checkpoint_files(d):
        for name, meta in safetensors_header(f).items():
            out[name] = TensorEntry(file=f, dtype=str(meta["dtype"]), shape=tuple(int(s) for s in meta["shape"]))
    if (d / INDEX_FILE).is_file():
        wrong = [k for k, v in _read_index(d).items() if k not in out or out[k].file != d / v]
        if wrong:
            raise TrtkvError(f"{INDEX_FILE} in '{d}' puts '{wrong[0]}' in a shard that does not hold it"
                             + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""),
                             "re-download the checkpoint or regenerate its index")
        listed = set(_read_index(d))
        out = {k: v for k, v in out.items() if k in listed}
    return out


__all__ = ["INDEX_FILE", "TensorEntry", "checkpoint_files", "safetensors_header", "tensor_index"]
