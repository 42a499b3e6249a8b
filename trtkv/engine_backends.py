"""The engine backends by name: what a manifest records and what every ``--backend`` option takes.

Its own module, importing nothing, so that ``RuntimeConfig`` and the CLI help read the list without loading
torch (``trtkv.manifest`` imports the formats, which import torch).
"""

from __future__ import annotations

from typing import Literal, get_args

Backend = Literal["onnxruntime", "tensorrt-rtx", "tensorrt", "torch"]  # torch: no network, the model by reference (builder/torch_build.py)
BACKENDS: tuple[str, ...] = get_args(Backend)
RUNTIME_BACKENDS: tuple[str, ...] = ("auto", *BACKENDS)  # auto: the manifest's backend (TensorRT when it has a plan and a GPU is present)
