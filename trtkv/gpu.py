"""Device memory as the driver reports it: pynvml when installed (guarded), else torch.cuda; and the one rule for how
much of it the KV cache takes (``kv_budget_bytes``).

``trtkv serve`` sizes the KV pool from it and ``trtkv plan`` (``--gpu auto`` reads the same numbers) plans with the
same rule and the same default reserve.
"""

from __future__ import annotations

from trtkv.errors import TrtkvError

# The fraction of a GPU's memory kept out of the KV cache for activations, workspace and the CUDA context: `plan
# --reserve` and `serve --reserve` (RuntimeConfig.reserve) default to it (vLLM's --gpu-memory-utilization 0.9 is the same rule).
DEFAULT_RESERVE = 0.1


def kv_budget_bytes(total: int, in_use: int, reserve: float) -> int:
    """Bytes the KV cache may take on a device of ``total`` bytes: all of it but ``reserve`` x total and what is in use
    (the weights: ``plan`` counts them, ``serve`` reads the device once the engine is loaded). Not positive: nothing fits."""
    return total - in_use - int(reserve * total)


def device_memory(index: int = 0) -> tuple[int, int]:
    """(free, total) bytes of GPU ``index``; TrtkvError when there is no GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            return int(info.free), int(info.total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info(index)
            return int(free), int(total)
    except Exception:
        pass
    raise TrtkvError("no GPU found (pynvml and torch.cuda report none)", "pass --gpu NAME or --gpu-mem GIB, or --kv-memory GIB")


def device_name(index: int = 0) -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))
            return name.decode() if isinstance(name, bytes) else str(name)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass
    import torch

    return torch.cuda.get_device_name(index) if torch.cuda.is_available() else "cpu"
