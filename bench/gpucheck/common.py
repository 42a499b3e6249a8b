"""What every gpu_check section shares: the geometry, the run context, the log, versions and the error metric."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from typing import Callable

import torch

from trtkv.quant import TensorParams

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128  # the GPU run's geometry
DRY_GEOMETRY = (4, 2, 64)  # the dry run's heads q / kv, head_dim


def geometry(dry: bool) -> tuple[int, int, int]:
    return DRY_GEOMETRY if dry else (HEADS_Q, HEADS_KV, HEAD_DIM)


class Log:
    def __init__(self):
        self.t0 = time.time()
        self.lines: list[str] = []

    def __call__(self, msg: str = "") -> None:
        line = f"[{time.time() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self.lines.append(msg)


@dataclass
class Run:
    """One gpu_check run: what a section reads (log, device, dry run, its time budget) and ``result``, the
    report's data, which sections fill under their own keys."""

    log: Log
    device: str
    dry: bool
    result: dict
    budget_s: float = 1e9


@dataclass(frozen=True)
class Section:
    """One part of the check: ``run(Run)`` fills ``Run.result[key]``, ``report(result)`` gives its markdown
    lines. ``skippable``: named in ``--skip``."""

    name: str
    key: str
    run: Callable[[Run], None]
    report: Callable[[dict], list[str]]
    budget_s: float = 1e9
    skippable: bool = True
    empty: Callable[[], object] = list  # makes the result before the section ran


def versions(driver_version: Callable[[], int]) -> dict:
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "platform": platform.platform()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), capability=f"{p.major}.{p.minor}",
                    sm_count=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
        try:
            info["driver"] = driver_version()
        except Exception:
            pass
    else:
        info.update(device=f"cpu ({platform.processor() or platform.machine()})")
    return info


def p_of(params: TensorParams | None, name: str):
    return None if params is None else getattr(params, name)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))
