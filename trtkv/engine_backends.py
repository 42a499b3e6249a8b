"""The engine backends and the torch engine's attention backends by name: what ``--backend`` and ``--attention`` take.

Its own module, importing nothing, so that ``RuntimeConfig`` and the CLI help read the list without loading
torch (``trtkv.manifest`` imports the formats, which import torch).
"""

from __future__ import annotations

from typing import Literal, get_args

Backend = Literal["onnxruntime", "tensorrt-rtx", "tensorrt", "torch"]  # torch: no network, the model by reference (builder/torch_build.py)
BACKENDS: tuple[str, ...] = get_args(Backend)
RUNTIME_BACKENDS: tuple[str, ...] = ("auto", *BACKENDS)  # auto: the manifest's backend (TensorRT when it has a plan and a GPU is present)

# the torch engine's attention backends by name (``trtkv.attention``'s registry, whose test checks the two agree); auto:
# the first of them that runs the engine's format on its device
Attention = Literal["auto", "kernels", "cpu", "torch"]
ATTENTIONS: tuple[str, ...] = get_args(Attention)
