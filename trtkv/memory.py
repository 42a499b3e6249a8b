"""The memory plan: what a command will hold (weights, activations, KV) against what the process can have.

Every command that loads a model plans before a weight is read and refuses in one line (``TrtkvError``, exit
code 2) rather than be killed by the kernel. docs/models-and-data.md "Memory plan" has the rules in prose.

**What the process can have** (``available_memory``), host:

1. ``TRTKV_MEMORY_LIMIT`` (bytes, or ``8GiB`` / ``512MiB`` / ``2G``): taken as is (tests, and users who know better);
2. else the memory cgroup of *this* process (``/proc/self/cgroup``; v2 ``memory.max``, v1
   ``memory.limit_in_bytes``; every ancestor up to the hierarchy's root counts, the tightest wins): the limit minus
   what the cgroup is charged now less its page cache (``memory.current`` / ``memory.usage_in_bytes``
   minus the page cache (``inactive_file`` + ``active_file`` of ``memory.stat``), which the kernel reclaims before it kills) — and never more than
   ``MemAvailable``;
3. else ``MemAvailable`` of ``/proc/meminfo``.

The process's own resident memory (python, torch, transformers imported) is already in the cgroup's charge and
already missing from ``MemAvailable``, so both readings are *what more this process can allocate*; the plan adds
``HOST_OVERHEAD`` for what a command allocates beyond the counted tensors (transformers' loading, the allocator's
slack, python objects). On a GPU: NVML's free memory of the device (pynvml, when importable and the device's
index is NVML's: ``CUDA_VISIBLE_DEVICES`` unset), else ``torch.cuda.mem_get_info``; ``GPU_OVERHEAD`` for the CUDA
context and the caching allocator. The GPU side is exercised only with fake readings here (no GPU on this machine).

**What is counted** (``MemoryPlan``): the weights at the dtype (``weight_bytes``: all of them resident, or the
non-layer weights plus one decoder layer when streamed), the activations of one forward (``activation_bytes``),
the KV budget, and the overhead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trtkv.errors import TrtkvError

GIB = 2**30
MIB = 2**20
LIMIT_ENV = "TRTKV_MEMORY_LIMIT"
HOST_OVERHEAD = GIB // 2  # beyond the counted tensors on the host: loading, allocator slack, python objects
GPU_OVERHEAD = GIB // 2  # on a GPU: the CUDA context (when not yet created) and the caching allocator's slack
_V1_UNLIMITED = 1 << 60  # v1 writes "no limit" as a huge page-aligned number (9223372036854771712)

SOURCES = ("TRTKV_MEMORY_LIMIT", "cgroup v2 memory.max", "cgroup v1 memory.limit_in_bytes", "MemAvailable", "NVML",
           "torch.cuda.mem_get_info")


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes the process can still allocate on its device, and where the number comes from (one of ``SOURCES``)."""

    bytes: int
    source: str


# --------------------------------------------------------------------------- sizes

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str, what: str = LIMIT_ENV) -> int:
    """``"8589934592"``, ``"8GiB"``, ``"512 MiB"``, ``"1.5G"`` (K/M/G/T alone are binary, KB/MB/GB decimal) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise TrtkvError(f"{what}={text!r} is not a size", f"give bytes or a size such as 8GiB or 512MiB in {what}")
    return int(float(m.group(1)) * _UNITS[unit])


def gib(n: float) -> str:
    """``27.5 GiB`` (one decimal; small amounts in MiB)."""
    if not n:
        return "0 GiB"
    if abs(n) < 0.05 * GIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / GIB:.1f} GiB"


# --------------------------------------------------------------------------- host readers (roots injectable)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _stat_value(stat: str | None, *keys: str) -> int:
    """The first of ``keys`` in a ``memory.stat`` text (``name value`` lines), else 0."""
    if not stat:
        return 0
    values = dict(line.split(None, 1) for line in stat.splitlines() if " " in line)
    for k in keys:
        if k in values:
            try:
                return int(values[k])
            except ValueError:
                return 0
    return 0


def _cgroup_paths(proc: Path) -> dict[str, str]:
    """{"v2": path, "v1": path} of this process's memory cgroup from ``/proc/self/cgroup``."""
    out: dict[str, str] = {}
    text = _read(proc / "self" / "cgroup") or ""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            out["v2"] = path
        elif "memory" in controllers.split(","):
            out["v1"] = path
    return out


def _ancestors(base: Path, path: str) -> list[Path]:
    """``base/a/b``, ``base/a``, ``base``: the process's cgroup and every ancestor inside the mounted hierarchy."""
    parts = [p for p in path.strip("/").split("/") if p]
    dirs = [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def cgroup_available(proc: str | Path = "/proc", cgroup: str | Path = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """(bytes this process's memory cgroup can still be charged, source) or None when no limit is set.

    Per cgroup level with a limit: ``limit - (usage - inactive_file - active_file)`` (the page cache of files read, such
    as a checkpoint just hashed, is reclaimed before the kernel kills anything); the smallest over the process's cgroup and
    its ancestors. v2 first (``memory.max``; "max" = none), then v1 (``memory.limit_in_bytes``; a huge value = none).
    """
    proc, cgroup = Path(proc), Path(cgroup)
    paths = _cgroup_paths(proc)
    best: tuple[int, str] | None = None

    def consider(avail: int, source: str) -> None:
        nonlocal best
        if best is None or avail < best[0]:
            best = (max(0, avail), source)

    if "v2" in paths:
        base = cgroup if (cgroup / "cgroup.controllers").is_file() else cgroup / "unified"
        for d in _ancestors(base, paths["v2"]):
            limit = _read(d / "memory.max")
            if limit is None or limit == "max" or not limit.isdigit():
                continue
            usage = int(_read(d / "memory.current") or 0)
            stat = _read(d / "memory.stat")
            usage -= _stat_value(stat, "inactive_file") + _stat_value(stat, "active_file")  # clean page cache is reclaimed
            consider(int(limit) - max(0, usage), "cgroup v2 memory.max")
    if best is None and "v1" in paths:
        for d in _ancestors(cgroup / "memory", paths["v1"]):
            limit = _read(d / "memory.limit_in_bytes")
            if limit is None or not limit.isdigit() or int(limit) >= _V1_UNLIMITED:
                continue
            usage = int(_read(d / "memory.usage_in_bytes") or 0)
            stat = _read(d / "memory.stat")
            usage -= _stat_value(stat, "total_inactive_file", "inactive_file") + _stat_value(stat, "total_active_file", "active_file")
            consider(int(limit) - max(0, usage), "cgroup v1 memory.limit_in_bytes")
    return best


def mem_available(proc: str | Path = "/proc") -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None when unreadable)."""
    for line in (_read(Path(proc) / "meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def host_memory(proc: str | Path = "/proc", cgroup: str | Path = "/sys/fs/cgroup", env: dict | None = None) -> MemoryBudget:
    """What this process can still allocate on the host: ``TRTKV_MEMORY_LIMIT``, else min(cgroup, MemAvailable)."""
    env = os.environ if env is None else env
    if env.get(LIMIT_ENV):
        return MemoryBudget(parse_bytes(env[LIMIT_ENV]), LIMIT_ENV)
    avail = mem_available(proc)
    cg = cgroup_available(proc, cgroup)
    if cg is not None and (avail is None or cg[0] <= avail):
        return MemoryBudget(cg[0], cg[1])
    if avail is None:  # no /proc (not Linux): nothing to plan against; the plan never refuses
        return MemoryBudget(1 << 62, "MemAvailable")
    return MemoryBudget(avail, "MemAvailable")


# --------------------------------------------------------------------------- GPU readers (fakes injectable)


def nvml_free(index: int) -> int | None:
    """Free bytes of NVML device ``index``; None without pynvml or a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no package, no driver, no device
        return None


def torch_free(index: int) -> int:
    return int(torch.cuda.mem_get_info(index)[0])


def gpu_memory(index: int = 0, *, nvml: Callable[[int], int | None] | None = None,
               mem_get_info: Callable[[int], int] | None = None, env: dict | None = None) -> MemoryBudget:
    """Free memory of CUDA device ``index``: NVML when it answers and its index is torch's (no ``CUDA_VISIBLE_DEVICES``
    remapping), else ``torch.cuda.mem_get_info``. ``TRTKV_MEMORY_LIMIT`` overrides both. ``nvml`` / ``mem_get_info``:
    the readers (default ``nvml_free`` / ``torch_free``, looked up at call time so tests can replace them)."""
    env = os.environ if env is None else env
    nvml = nvml or nvml_free
    mem_get_info = mem_get_info or torch_free
    if env.get(LIMIT_ENV):
        return MemoryBudget(parse_bytes(env[LIMIT_ENV]), LIMIT_ENV)
    if not env.get("CUDA_VISIBLE_DEVICES"):
        free = nvml(index)
        if free is not None:
            return MemoryBudget(free, "NVML")
    return MemoryBudget(mem_get_info(index), "torch.cuda.mem_get_info")


def available_memory(device: torch.device) -> MemoryBudget:
    """What this process can still allocate on ``device`` (host memory for ``cpu``, the GPU's free memory for ``cuda``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_memory(device.index or 0)
    return host_memory()


# --------------------------------------------------------------------------- what a command holds


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def non_layer_params(info) -> int:
    """Parameters outside the decoder layers: the embedding (vocab x hidden), the LM head when untied (again
    vocab x hidden) and the final norm (hidden)."""
    emb = info.vocab_size * info.hidden_size
    return emb * (1 if info.tie_word_embeddings else 2) + info.hidden_size


def layer_params(info) -> int:
    """Parameters of one decoder layer: what is not the non-layer part, split evenly over the layers (the families
    trtkv supports have uniform layers; exact enough for a plan)."""
    return max(0, info.num_params - non_layer_params(info)) // max(1, info.num_layers)


def weight_bytes(info, dtype: torch.dtype, *, streamed: bool) -> int:
    """Bytes of weights held at ``dtype``: all of them (resident), or the non-layer part plus one decoder layer (streamed)."""
    n = min(info.num_params, non_layer_params(info) + layer_params(info)) if streamed else info.num_params
    return n * element_size(dtype)


def activation_bytes(info, *, batch: int, seq_len: int, dtype: torch.dtype, logits: bool = True,
                     context: int | None = None, intermediate_size: int | None = None) -> int:
    """An honest peak for one forward of ``batch`` x ``seq_len`` new tokens over ``context`` tokens (default
    ``seq_len``), one layer at a time (transformers frees a layer's temporaries before the next):

    - the hidden states: the residual stream, its normed copy and the attention / MLP output, 4 x tokens x hidden;
    - the attention scores at ``dtype`` (eager, and sdpa's math path on CPU, materialize them):
      batch x heads x seq_len x context, twice (scores and probabilities);
    - the queries and the keys / values repeated to every head: tokens x heads x head_dim x 3 (new) plus
      batch x context x heads x head_dim x 2 (the K/V the attention reads);
    - the MLP intermediate: tokens x intermediate x 3 (gate, up, their product); ``intermediate_size`` defaults
      to 4 x hidden when the record has none;
    - the logits in float32 when the command computes them (``logits``): tokens x vocab, and once more for the
      log-softmax a score takes.
    """
    ctx = seq_len if context is None else context
    tokens = batch * seq_len
    el = element_size(dtype)
    heads = info.num_heads or info.num_kv_heads
    inter = intermediate_size or 4 * info.hidden_size
    per_layer = (
        4 * tokens * info.hidden_size
        + 2 * batch * heads * seq_len * ctx
        + 3 * tokens * heads * info.head_dim
        + 2 * batch * ctx * heads * info.head_dim
        + 3 * tokens * inter
    ) * el
    return per_layer + (2 * tokens * info.vocab_size * 4 if logits else 0)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes a command will hold on its device, and the budget they must fit in."""

    weights: int
    activations: int
    kv: int
    overhead: int
    budget: MemoryBudget
    dtype: torch.dtype = torch.float32
    streamed: bool = False

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.kv + self.overhead

    @property
    def fits(self) -> bool:
        return self.total <= self.budget.bytes

    def describe(self) -> str:
        w = f"weights {gib(self.weights)} {_dtype_name(self.dtype)}" + (" (one layer streamed)" if self.streamed else "")
        return (f"needs {gib(self.total)} ({w} + activations {gib(self.activations)} + KV {gib(self.kv)} + overhead "
                f"{gib(self.overhead)}), the process can have {gib(self.budget.bytes)} ({self.budget.source})")


@dataclass(frozen=True)
class LoadPlan:
    dtype: torch.dtype
    streamed: bool
    plan: MemoryPlan
    note: str | None = None


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


def _requested(dtype_request: str | torch.dtype) -> torch.dtype | None:
    if isinstance(dtype_request, torch.dtype):
        return dtype_request
    d = (dtype_request or "auto").strip().lower()
    d = _ALIASES.get(d, d)
    if d == "auto":
        return None
    if d not in _DTYPES:
        raise TrtkvError(f"unknown dtype '{dtype_request}'", "use --dtype auto, float32, float16 or bfloat16")
    return _DTYPES[d]


def plan_memory(info, device: torch.device, dtype: torch.dtype, *, streamed: bool, activations: int, kv: int = 0,
                budget: MemoryBudget | None = None) -> MemoryPlan:
    device = torch.device(device)
    return MemoryPlan(
        weights=weight_bytes(info, dtype, streamed=streamed), activations=activations, kv=kv,
        overhead=GPU_OVERHEAD if device.type == "cuda" else HOST_OVERHEAD,
        budget=budget or available_memory(device), dtype=dtype, streamed=streamed,
    )


def choose_load(info, device: torch.device, dtype_request: str, *, activations: int, kv: int = 0, can_stream: bool,
                stream: str = "auto", command: str) -> LoadPlan:
    """The dtype and residency a command loads ``info``'s model with, or a one-line ``TrtkvError`` when nothing fits.

    ``stream``: ``auto`` (stream only when resident does not fit), ``always``, ``never``; streaming is considered
    only where ``can_stream``. ``dtype_request`` ``auto``: on CPU float32 resident if it fits, else float32 streamed
    (``can_stream``; bf16 matmuls are emulated on CPU, ~50x slower, so streaming float32 beats resident bf16), else
    bfloat16 resident; on CUDA float16 resident, else float16 streamed. An explicit dtype is kept: resident, else
    streamed. ``note`` says what was picked and why when it is not the plain first choice (the command prints it).
    """
    if stream not in ("auto", "always", "never"):
        raise TrtkvError(f"unknown stream mode {stream!r}", "use auto, always or never")
    if stream == "always" and not can_stream:
        raise TrtkvError(f"{command} cannot stream the model layer by layer", "load it resident (drop --stream)")
    device = torch.device(device)
    budget = available_memory(device)
    want = _requested(dtype_request)
    cpu = device.type != "cuda"
    if want is not None:
        dtypes = [want]
    else:
        dtypes = [torch.float32, torch.bfloat16] if cpu else [torch.float16]
    modes = {"always": [True], "never": [False], "auto": [False, True] if can_stream else [False]}[stream]
    if not can_stream:
        modes = [False]
    # in order of preference; CPU auto: float32 resident, float32 streamed, bfloat16 resident, bfloat16 streamed
    candidates = [(dt, s) for dt in dtypes for s in modes]
    plans = [plan_memory(info, device, dt, streamed=s, activations=activations, kv=kv, budget=budget) for dt, s in candidates]
    for i, p in enumerate(plans):
        if p.fits:
            note = None
            if i > 0 or want is None:
                first = plans[0]
                why = "" if i == 0 else f"; {_dtype_name(first.dtype)}{' streamed' if first.streamed else ' resident'} would need {gib(first.total)}"
                how = "streamed layer by layer" if p.streamed else "resident"
                note = (f"{command}: loading the weights in {_dtype_name(p.dtype)}, {how} ({p.describe()}{why})")
            return LoadPlan(p.dtype, p.streamed, p, note)
    best = min(plans, key=lambda p: p.total)
    fixes = []
    if want == torch.float32:
        fixes.append("--dtype bfloat16")
    if can_stream and not any(p.streamed for p in plans):
        fixes.append("--stream (layer streaming)")
    if activations > 0.25 * best.total:
        fixes.append("a smaller --samples / --windows / --seq-len / --batch-size")
    if kv:
        fixes.append("a smaller --kv-memory")
    fixes.append(f"a machine or cgroup with {gib(best.total)}" + (" on the GPU" if not cpu else ""))
    raise TrtkvError(f"{command} does not fit in memory: {best.describe()}", "try " + ", or ".join(fixes))


def conversion_bytes(info) -> int:
    """Host bytes the one-time GGUF conversion holds: transformers dequantizes the whole model in float32 before it
    is saved (the GGUF itself is memory-mapped: page cache the kernel can drop), plus the largest tensor's
    dequantization transient (the embeddings) and the overhead."""
    return info.num_params * 4 + info.vocab_size * info.hidden_size * 4 + HOST_OVERHEAD


def check_conversion(info, cache_dir: Path) -> None:
    """Refuse, in one line and before anything is read, a GGUF conversion the host memory cannot hold (a kill by the
    kernel otherwise, with nothing printed)."""
    need, budget = conversion_bytes(info), host_memory()
    if need > budget.bytes:
        raise TrtkvError(
            f"converting {Path(info.source).name} to a Hugging Face checkpoint (once; it is cached) needs {gib(need)} of host "
            f"memory (transformers dequantizes the whole model in float32); the process can have {gib(budget.bytes)} ({budget.source})",
            f"convert it once where that memory is (e.g. `trtkv plan --model {info.source}` on a larger machine) and copy "
            f"{cache_dir} here, or pass a Hugging Face safetensors directory as --model")


__all__ = [
    "GIB", "GPU_OVERHEAD", "HOST_OVERHEAD", "LIMIT_ENV", "SOURCES", "LoadPlan", "MemoryBudget", "MemoryPlan",
    "activation_bytes", "available_memory", "cgroup_available", "check_conversion", "choose_load", "conversion_bytes", "gpu_memory", "host_memory",
    "layer_params", "mem_available", "non_layer_params", "parse_bytes", "plan_memory", "weight_bytes",
]
