"""The CUDA driver API as a TensorRT AOT plugin uses it: load PTX (or a cubin assembled by Triton's ptxas) and
launch a function with its arguments in TensorRT's order."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import torch

_CU = None


def _libcuda():
    global _CU
    if _CU is None:
        _CU = ctypes.CDLL("libcuda.so.1")
    return _CU


def _cu_error_name(rc: int) -> str:
    name = ctypes.c_char_p()
    _libcuda().cuGetErrorName(rc, ctypes.byref(name))
    return name.value.decode() if name.value else str(rc)


def _cu_check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: {_cu_error_name(rc)}")


def driver_version() -> int:
    v = ctypes.c_int()
    _cu_check(_libcuda().cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
    return v.value


CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # cuda.h, CUfunction_attribute


class DriverKernel:
    """A PTX kernel loaded with cuModuleLoadData and launched with cuLaunchKernel, like TensorRT does.

    Dynamic shared memory above 48 KiB needs the function's MAX_DYNAMIC_SHARED_SIZE_BYTES raised first
    (cuFuncSetAttribute), as Triton's own launcher does. If the driver cannot JIT the PTX (its PTX ISA is
    newer than the driver: CUDA_ERROR_UNSUPPORTED_PTX_VERSION), the same reordered PTX is assembled with
    Triton's bundled ptxas and loaded as a cubin; ``loaded_as`` says which (a TensorRT engine holding the
    PTX would need a driver that accepts it)."""

    def __init__(self, ptx: str, name: str, shared: int, arch: int | None = None):
        cu = _libcuda()
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # make the primary context current on this thread
        self.module = ctypes.c_void_p()
        self.loaded_as = "ptx"
        rc = cu.cuModuleLoadData(ctypes.byref(self.module), ctypes.c_char_p(ptx.encode() + b"\0"))
        if rc != 0:
            err = _cu_error_name(rc)
            version = re.search(r"^\.version\s+([\d.]+)", ptx, re.M)
            image = assemble_cubin(ptx, arch)  # raises if ptxas fails too
            self.module = ctypes.c_void_p()
            _cu_check(cu.cuModuleLoadData(ctypes.byref(self.module), ctypes.c_char_p(image)), "cuModuleLoadData(cubin)")
            self.loaded_as = f"cubin (driver rejected PTX ISA {version.group(1) if version else '?'}: {err})"
        self.fn = ctypes.c_void_p()
        _cu_check(cu.cuModuleGetFunction(ctypes.byref(self.fn), self.module, name.encode()), "cuModuleGetFunction")
        if shared > 48 * 1024:
            _cu_check(cu.cuFuncSetAttribute(self.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                            ctypes.c_int(shared)), "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
        self.shared = shared

    def launch(self, grid, block: int, args: list) -> None:
        cu = _libcuda()
        holders = []
        for a in args:
            if isinstance(a, torch.Tensor):
                holders.append(ctypes.c_uint64(a.data_ptr()))
            else:
                holders.append(ctypes.c_int32(int(a)))
        arr = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        gx, gy, gz = (int(x) for x in grid)
        _cu_check(cu.cuLaunchKernel(self.fn, gx, gy, gz, block, 1, 1, self.shared, stream, arr, None),
                  "cuLaunchKernel")


def assemble_cubin(ptx: str, arch: int | None) -> bytes:
    """The PTX assembled by Triton's bundled ptxas for its own ``.target``."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    target = re.search(r"^\.target\s+(\w+)", ptx, re.M)
    gpu = target.group(1) if target else f"sm_{arch or 90}"
    arch = arch or int(re.sub(r"\D", "", gpu))
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        subprocess.run([get_ptxas(arch).path, f"--gpu-name={gpu}", str(src), "-o", str(dst)], check=True,
                       capture_output=True, text=True)
        return dst.read_bytes()
