"""The attention backends: one object per way of running attention over the paged cache, one file each.

========================  =====================================================================================
``base.py``               ``AttentionBackend`` (capability, attend, seal), ``resolve`` and the registry
``masks.py``              the step's key order and masks (the torch ops and the C kernels' prefill)
``triton.py``             the Triton kernels (CUDA; the interpreter on CPU) and the Triton seal
``cpu.py``                trtkv's C kernels (CPU) and the C seal
``torch_ops.py``          the torch ops (any device) and the reference seal
========================  =====================================================================================

The registry's order is ``auto``'s: the Triton kernels (on CUDA), the C kernels (on CPU), the torch ops. The ONNX
step networks and TensorRT-RTX are exporters: rows of the same registry (``EXPORTERS``) whose attention is the
builder's graph (builder/attention.py).
"""

from trtkv.attention.base import (
    BACKENDS,
    EXPORTERS,
    AttentionBackend,
    AttentionStep,
    Exporter,
    backend_class,
    exporter,
    names,
    pool_reasons,
    pool_sealer,
    register,
    resolve,
)
from trtkv.attention.cpu import CpuKernels
from trtkv.attention.torch_ops import TorchOps
from trtkv.attention.triton import TritonKernels
from trtkv.plugins.contract.capabilities import ONNX_NATIVE, ONNX_PLUGIN, TENSORRT_RTX

# the registry, in auto's order: a new backend is its file and one entry here
for _backend in (TritonKernels, CpuKernels, TorchOps):
    register(_backend)
EXPORTERS.extend(Exporter(p.name, p) for p in (ONNX_NATIVE, ONNX_PLUGIN, TENSORRT_RTX))


def paths():
    """Every row of the registry: the exporters', then each backend's and its seal kernel's (the support matrix's order)."""
    return [*(e.path for e in EXPORTERS), *(p for b in BACKENDS for p in (b.path, b.seal_path) if p is not None)]


__all__ = ["BACKENDS", "EXPORTERS", "AttentionBackend", "AttentionStep", "CpuKernels", "Exporter", "TorchOps", "TritonKernels",
           "backend_class", "exporter", "names", "paths", "pool_reasons", "pool_sealer", "resolve"]
