"""Device memory as the driver reports it: pynvml when installed (guarded), else torch.cuda.

``trtkv serve`` sizes the KV pool from it and ``trtkv plan --gpu auto`` reads the same numbers.
"""

from __future__ import annotations

from trtkv.errors import TrtkvError


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
