"""``trtkv build-engine``: model + calibration + KV format -> an engine directory (trtkv/manifest.py).

Stages, each timed and shown: **export** (weights and the ONNX step network, kv_params, tokenizer),
**check** (onnx.checker, one ONNX Runtime step with finite logits), **build** (TensorRT-RTX / TensorRT
plans, one per compute capability; skipped for the ONNX Runtime backend). Everything is written into
a temp sibling of ``--out`` (``trtkv.artifacts.atomic_directory``) and renamed only when complete.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trtkv import __version__
from trtkv.builder import torch_build
from trtkv.builder.step_network import check_model
from trtkv.engine_backends import RUNTIME_BACKENDS
from trtkv.errors import TrtkvError
from trtkv.models import load_model, model_info
from trtkv.plugins.contract.capabilities import CAPABILITIES, TORCH_ENGINE_PATHS, backend_path, cache_reasons

ENGINE_BACKENDS = RUNTIME_BACKENDS  # what --backend takes: the manifest's backends, or auto
DEFAULT_CAPABILITIES = (80, 86, 89, 120)
FAIL_ENV = "TRTKV_BUILD_FAIL_AFTER"  # test hook: raise after the named stage (export | check | build)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# The CPU engine a plain build-engine makes: the torch engine, measured faster where the KV cache matters (2048-token
# decode: 2.2x fp16 / 4.2x int4 of ONNX Runtime) and the one whose int4 keeps up with its fp16 (served at 8 streams:
# 97 %, ONNX Runtime 83 %); ONNX Runtime is faster at short contexts. docs/torch-engine.md "CPU speed".
CPU_DEFAULT_BACKEND = "torch"


def gpu_present() -> bool:
    """True when NVML sees at least one NVIDIA GPU (nvidia-ml-py); False without the package or a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no package, no driver, no device
        return False


def resolve_backend(backend: str) -> str:
    """``auto``: ``tensorrt`` when importable and a GPU is present; ``torch`` on a CUDA machine without TensorRT
    (the kernels run there; TensorRT-RTX plans do not cover SM90); else ``CPU_DEFAULT_BACKEND``."""
    if backend not in ENGINE_BACKENDS:
        raise TrtkvError(f"unknown backend {backend!r}", f"use one of {', '.join(ENGINE_BACKENDS)}")
    if backend != "auto":
        return backend
    if not gpu_present():
        return CPU_DEFAULT_BACKEND
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "torch"
    return "tensorrt"


class Stages:
    """Rich progress per stage: a spinner while it runs, a line with its time when it ends."""

    def __init__(self, console=None):
        self.console = console
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str, what: str):
        t0 = time.perf_counter()
        status = self.console.status(f"[bold]{name}[/] {what}") if self.console else contextlib.nullcontext()
        with status:
            yield
        dt = time.perf_counter() - t0
        self.seconds[name] = round(dt, 3)
        if self.console:
            self.console.print(f"[green]✓[/] [bold]{name:<7}[/] {what} [dim]({dt:.1f} s)[/]")
        if os.environ.get(FAIL_ENV) == name:
            raise RuntimeError(f"simulated failure after stage {name} ({FAIL_ENV})")


def _check_params(fmt, params, num_layers: int, cal_path, requested) -> None:
    """Every static scale / smoothing factor the format needs is in the calibration, for every layer (``requested``: the --kv format)."""
    for i, lp in enumerate(params):
        for which, t in (("k", fmt.k), ("v", fmt.v)):
            p = getattr(lp, which)
            other = lp.v if which == "k" else lp.k
            if t.is_static and p.scale is None and not (fmt.shared_kv_scale and other.scale is not None):
                raise TrtkvError(f"calibration {cal_path} lacks the static {which.upper()} scale of layer {i} that {fmt.spec()} needs", f"rerun trtkv calibrate with --kv {requested.name}")
            if t.smooth and p.smooth is None:
                raise TrtkvError(f"calibration {cal_path} lacks the {which.upper()} smoothing factors of layer {i} that {fmt.spec()} needs", f"rerun trtkv calibrate with --kv {requested.name}")


def build_engine(
    model: str = "smollm2-135m",
    calibration: str | Path | None = None,
    kv: str = "int4",
    out: str | Path = "trtkv-out/engine",
    *,
    backend: str = "auto",
    attention: str = "native",
    max_batch: int = 16,
    max_seq_len: int | None = None,
    block_size: int | None = None,
    compute_capabilities: list[int] | tuple[int, ...] = DEFAULT_CAPABILITIES,
    dtype: str | None = None,
    force: bool = False,
    loaded: Any = None,
    console: Any = None,
    smoke_check: bool = True,
) -> Path:
    """Build an engine directory; returns its path. ``loaded``: an already loaded ``LoadedModel`` (tests)."""
    import torch

    from trtkv.artifacts import atomic_directory, calibration_sha256, load_calibration, params_to_tensors
    from trtkv.builder.plugin_nodes import get_backend
    from trtkv.builder.trt_build import check_capabilities
    from trtkv.cache_layout import PagedKVLayout
    from trtkv.formats import DEFAULT_BLOCK_SIZE, calibration_needed, fit_formats, get_format
    from trtkv.manifest import KV_PARAMS_PREFIX, Limits
    from trtkv.plugins.trt_plugins import import_tensorrt

    # ------------------------------------------------------------ arguments (before any work)
    out = Path(out).expanduser().absolute()
    if out.exists() and not force:
        raise TrtkvError(f"--out {out} already exists", "pass --force to replace it, or choose another --out")
    backend = resolve_backend(backend)
    if attention not in ("native", "plugin"):
        raise TrtkvError(f"unknown attention mode {attention!r}", "use --attention native or plugin")
    dtype = dtype or ("fp32" if backend in ("onnxruntime", "torch") else "fp16")
    if dtype not in ("fp16", "fp32"):
        raise TrtkvError(f"unknown dtype {dtype!r}", "use --dtype fp16 or fp32")
    caps = sorted(set(int(c) for c in compute_capabilities))
    check_capabilities(backend, caps)
    trt = import_tensorrt(backend) if backend not in ("onnxruntime", "torch") else None
    if max_batch < 1 or (max_seq_len is not None and max_seq_len < 1):
        raise TrtkvError(f"--max-batch and --max-seq-len must be positive (got {max_batch}, {max_seq_len})", "pass positive integers")
    if calibration is not None:  # a format the calibration holds by name (e.g. a --budget choice) is its definition
        kv = load_calibration(calibration).definition(kv)
    base_fmt = get_format(kv)  # the one parse; fitted to the model's head_dim below
    # the capability table: a torch-backend engine runs where one of the torch engine's attentions reads the format
    # (serving asks again for the attention it picks), an ONNX one the step network's
    reasons = cache_reasons(base_fmt, TORCH_ENGINE_PATHS) if backend == "torch" else \
        (backend_path(backend) or CAPABILITIES[attention]).layout_reasons(base_fmt)
    for r in reasons:
        raise TrtkvError(r, r.hint)
    bs = block_size or base_fmt.block_size or DEFAULT_BLOCK_SIZE
    base_fmt.with_block_size(bs)  # validates --block-size before the model loads
    if calibration is None and base_fmt.needs_calibration:  # before any weights load
        raise calibration_needed([base_fmt], model)
    att = get_backend(attention)
    if (rtx := backend_path(backend)) is not None and (r := rtx.attention_reason(attention)) is not None:
        raise TrtkvError(r, r.hint)

    # ------------------------------------------------------------ model and calibration
    base_info = loaded.info if loaded is not None else model_info(model)
    check_model(base_info, attention, backend)  # before any weights load
    if loaded is None:  # the memory plan first: a refusal writes nothing (trtkv/memory.py)
        loaded = _load_for_build(model, base_info, backend, dtype, console)
    info = loaded.info
    [base_fmt], notes = fit_formats([base_fmt], info.head_dim)  # presets fit any head_dim
    fmt = base_fmt.with_block_size(bs)
    if console:
        for note in notes:
            console.print(f"note: {note}")
    reasons = att.reasons(fmt, info.head_dim, bs)
    if reasons:
        raise TrtkvError(f"{attention} attention cannot build {fmt.spec()}: {'; '.join(reasons)}", "choose another --block-size / --kv, or the other --attention")
    max_pos = info.max_position_embeddings
    if max_seq_len is None:
        max_seq_len, note = default_max_seq_len(info, backend, max_batch, bs)
        if console and note:
            console.print(f"note: {note}", highlight=False)
    elif max_pos and max_seq_len > max_pos:
        raise TrtkvError(f"--max-seq-len {max_seq_len} is beyond {info.name}'s {max_pos} positions", f"pass --max-seq-len {max_pos} or less")
    layout1 = PagedKVLayout(fmt, info.num_kv_heads, info.head_dim, bs, 1, 1)  # validates group sizes, int4 head dim
    cal_ref: dict[str, Any] = {}
    if calibration is not None:
        cal = load_calibration(calibration)
        params = cal.params_for(base_fmt, info)
        cal_ref = {"path": str(Path(calibration).absolute()), "sha256": calibration_sha256(calibration), "format_name": cal._resolve(base_fmt)[0]}
    else:
        from trtkv.artifacts import LayerParams

        params = [LayerParams() for _ in range(info.num_layers)]
    _check_params(fmt, params, info.num_layers, calibration, base_fmt)

    max_blocks = -(-max_seq_len // bs)
    limits = Limits(
        max_batch=max_batch, max_seq_len=max_seq_len, block_size=bs, max_blocks_per_seq=max_blocks,
        max_new_tokens_per_step=bs, max_num_blocks=max_batch * max_blocks, max_num_slots=max_batch,
    )
    stages = Stages(console)
    if console:
        console.print(f"[bold]build-engine[/] {info.name} · kv {fmt.spec()} · {backend} · {attention} attention · {dtype} · block {bs}")

    with atomic_directory(out, replace=True, what="the engine directory") as tmp:
        with stages.stage("export", "ONNX step network, kv_params, tokenizer" if backend != "torch" else "kv_params, tokenizer, weights reference"):
            if backend == "torch":  # no network: the torch engine runs the model (builder/torch_build.py)
                onnx_inputs, onnx_outputs = torch_build.step_specs(layout1, info.num_layers, info.vocab_size)
            else:
                onnx_inputs, onnx_outputs = _export(tmp, loaded, layout1, params, att, dtype)
            from safetensors.torch import save_file

            from trtkv.manifest import KV_PARAMS_FILE, TOKENIZER_DIR

            save_file(params_to_tensors({KV_PARAMS_PREFIX: params}), str(tmp / KV_PARAMS_FILE), metadata={"trtkv": __version__, "format": fmt.spec()})
            if loaded.tokenizer is not None:
                loaded.tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
            if attention == "plugin":
                from trtkv.manifest import ONNX_FILE, ORT_PLUGIN_ONNX_FILE
                from trtkv.plugins.ort_ops import write_ort_model

                write_ort_model(str(tmp / ONNX_FILE), str(tmp / ORT_PLUGIN_ONNX_FILE))
        with stages.stage("check", "onnx.checker + one ONNX Runtime step" if backend != "torch" else "one torch-engine step"):
            if backend == "torch":
                if smoke_check and loaded.model is None:
                    loaded = _load_for_smoke_step(model, loaded, console)
                if smoke_check and loaded.model is not None:
                    torch_build.smoke_step(loaded, layout1, params)
            else:
                _check(tmp, fmt, info, layout1, params, attention, smoke_check)
        plans = []
        if backend not in ("onnxruntime", "torch"):
            from trtkv.builder.trt_build import build_plan
            from trtkv.manifest import ONNX_FILE, PLANS_DIR, PlanFile

            targets: list[int | None] = caps if backend == "tensorrt-rtx" else [None]
            with stages.stage("build", f"{backend} plans for {', '.join(f'SM{c}' for c in caps) if backend == 'tensorrt-rtx' else 'this GPU'}"):
                for cc in targets:
                    if cc is None:  # pragma: no cover - tensorrt on a GPU only
                        major, minor = torch.cuda.get_device_capability()
                        cc_real = major * 10 + minor
                    else:
                        cc_real = cc
                    blob, secs = build_plan(trt, backend, tmp / ONNX_FILE, onnx_inputs, limits, cc)
                    rel = f"{PLANS_DIR}/sm{cc_real}.plan"
                    (tmp / PLANS_DIR).mkdir(exist_ok=True)
                    (tmp / rel).write_bytes(blob)
                    plans.append(PlanFile(compute_capability=cc_real, path=rel, bytes=len(blob), build_seconds=round(secs, 2)))
                    if console:
                        console.print(f"  SM{cc_real}: {len(blob) / 2**20:.1f} MiB in {secs:.1f} s")
        manifest = _manifest(tmp, loaded, fmt, backend, attention, dtype, limits, layout1, onnx_inputs, onnx_outputs, cal_ref, plans, stages, trt, caps)
        if backend == "torch":
            manifest = torch_build.torch_manifest(manifest, tmp)
        (tmp / "manifest.json").write_text(manifest.model_dump_json(indent=2) + "\n", encoding="utf-8")
    if console:
        print_summary(console, manifest, out)
    return out


UNKNOWN_CONTEXT = 2048  # --max-seq-len of a model whose record names no context length


def default_max_seq_len(info, backend: str, max_batch: int, block_size: int) -> tuple[int, str | None]:
    """--max-seq-len when it is not given: the model's context, bounded by the memory plan of the engine on the device
    this machine would run it on (``trtkv.runtime.torch_engine.longest_context``: the weights and the activations of
    ``max_batch`` sequences' largest step); a TensorRT-RTX build, for GPUs this machine lacks, takes the model's
    context, and so does a machine that cannot hold the weights at all (the engine is for another). The note says why."""
    import torch

    from trtkv.runtime.torch_engine import longest_context

    context = info.max_position_embeddings
    if not context:
        return UNKNOWN_CONTEXT, f"--max-seq-len {UNKNOWN_CONTEXT}: {info.name}'s record names no context length; pass --max-seq-len to choose"
    if backend == "tensorrt-rtx":
        return context, None
    device = torch.device("cuda" if backend in ("torch", "tensorrt") and torch.cuda.is_available() else "cpu")
    n = longest_context(info, device, max_batch=max_batch, block_size=block_size, context=context)
    if n is None:
        return context, (f"--max-seq-len {context}, {info.name}'s context: its weights do not fit this machine's {device.type} "
                         "memory, so the memory plan is made where the engine opens (`trtkv serve` refuses in one line if "
                         "it does not fit there); pass --max-seq-len to choose")
    if n == context:
        return context, None
    return n, (f"--max-seq-len {n}: {info.name}'s context of {context} tokens at --max-batch {max_batch} does not fit the memory "
               f"plan on {device.type} (the weights and the activations of a step over every sequence's context); "
               "pass --max-seq-len, or a smaller --max-batch")


@dataclass
class _NoWeights:
    """What ``build-engine --backend torch`` needs of a model without reading its weights: the record and the tokenizer
    (the engine references the weights by path + sha256; the torch engine loads them when it opens)."""

    info: Any
    tokenizer: Any
    model: Any = None


def _load_for_build(model: str, info, backend: str, dtype: str, console):
    """The model as the build needs it, planned before a weight is read. ``--backend torch``: no weights at all (the
    record and the tokenizer); the ONNX backends: the weights in float32, plus the step network's copy of them at
    ``dtype`` and its serialized proto (2 x the weights at the network dtype, counted as the build's activations)."""
    from trtkv.memory import choose_load, element_size
    from trtkv.models import load_tokenizer

    if backend == "torch":
        return _NoWeights(info=info, tokenizer=load_tokenizer(model, required=False))
    import torch

    net = torch.float32 if dtype == "fp32" else torch.float16
    try:
        lp = choose_load(info, torch.device("cpu"), "float32", activations=2 * info.num_params * element_size(net),
                         can_stream=False, command="build-engine")
    except TrtkvError as exc:
        raise TrtkvError(exc.problem, "try --backend torch (its build reads no weights), or a machine or cgroup with more memory") from None
    return load_model(model, device="cpu", dtype=lp.dtype)


def _load_for_smoke_step(model: str, loaded, console):
    """The weights for the torch engine's one check step when they fit (float32, else bfloat16); else the check is
    skipped with a note, and the engine is checked against the weights when it opens (path + sha256)."""
    import torch

    from trtkv.memory import activation_bytes, choose_load

    info = loaded.info
    try:
        lp = choose_load(info, torch.device("cpu"), "auto", activations=activation_bytes(info, batch=1, seq_len=2, dtype=torch.float32),
                         can_stream=False, command="build-engine check step")
    except TrtkvError as exc:
        if console:
            console.print(f"note: the torch-engine check step is skipped: {exc.problem}")
        return loaded
    if console and lp.note:
        console.print(f"note: {lp.note}")
    full = load_model(model, device="cpu", dtype=lp.dtype)
    return _NoWeights(info=info, tokenizer=loaded.tokenizer, model=full.model)


def _export(tmp: Path, loaded, layout, params, att, dtype):
    import onnx

    from trtkv.builder.step_network import build_step_network
    from trtkv.builder.weights import extract_weights
    from trtkv.manifest import ONNX_DATA_FILE, ONNX_FILE

    w = extract_weights(loaded.model, loaded.info)
    proto, inputs, outputs = build_step_network(w, layout, params, att, dtype)
    onnx.save_model(proto, str(tmp / ONNX_FILE), save_as_external_data=True, all_tensors_to_one_file=True, location=ONNX_DATA_FILE, size_threshold=1024)
    return inputs, outputs


def _check(tmp: Path, fmt, info, layout1, params, attention: str, smoke: bool) -> None:
    """onnx.checker on the saved model; one ONNX Runtime step over a random pool, logits must be finite."""
    import onnx
    import torch

    from trtkv.manifest import ONNX_FILE

    try:
        onnx.checker.check_model(str(tmp / ONNX_FILE), full_check=False)
    except onnx.checker.ValidationError as exc:  # a builder bug, not a user error
        raise RuntimeError(f"the exported step network is invalid ONNX: {exc}") from exc
    if not smoke:
        return
    import onnxruntime as ort

    from trtkv.cache_layout import PagedKVLayout
    from trtkv.runtime.kv_pool import PagedKVCache
    from trtkv.runtime.step import StepBatch

    so = ort.SessionOptions()
    if attention == "plugin":
        from trtkv.plugins.ort_ops import register_ort_ops

        register_ort_ops(so)
    from trtkv.manifest import ORT_PLUGIN_ONNX_FILE

    sess = ort.InferenceSession(str(tmp / (ORT_PLUGIN_ONNX_FILE if attention == "plugin" else ONNX_FILE)), so, providers=["CPUExecutionProvider"])
    bs = layout1.block_size
    cache = PagedKVCache(PagedKVLayout(fmt, info.num_kv_heads, info.head_dim, bs, 2, 1), info.num_layers, params)
    batch = StepBatch.make([[1, 2]], [bs], [[0, 1]], [0])
    feeds = {"input_ids": batch.input_ids, "context_lens": batch.context_lens, "new_lens": batch.new_lens, "block_tables": batch.block_tables, "slot_ids": batch.slot_ids}
    declared = {i.name: i.type for i in sess.get_inputs()}
    feeds.update({k: (v.view(torch.int8) if v.dtype == torch.uint8 and declared.get(k) == "tensor(int8)" else v) for k, v in cache.tensors.items()})
    names = list(declared)
    logits = sess.run(["logits"], {k: feeds[k].numpy() for k in names})[0]
    if logits.shape != (1, info.vocab_size) or not torch.isfinite(torch.from_numpy(logits)).all():
        raise RuntimeError(f"the step network's smoke step gave logits of shape {logits.shape} with non-finite values")


def _manifest(tmp, loaded, fmt, backend, attention, dtype, limits, layout1, inputs, outputs, cal_ref, plans, stages, trt, caps):
    from trtkv.builder.graph import OPSET
    from trtkv.manifest import CalibrationRef, EngineManifest, ModelSpec, pool_spec

    info = loaded.info
    L = info.num_layers
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    versions = {k: _version(k) for k in ("onnx", "onnxruntime", "torch", "transformers")}
    if trt is not None:
        versions[trt.__name__] = getattr(trt, "__version__", None)
    needs = {
        "onnxruntime": f"onnxruntime>={versions['onnxruntime'] and versions['onnxruntime'].split('.')[0] + '.' + versions['onnxruntime'].split('.')[1]} on CPU"
        + (" + onnxruntime-extensions and torch (trtkv:: ops as Python custom ops)" if attention == "plugin" else ""),
    }
    if backend == "tensorrt-rtx":
        needs["tensorrt-rtx"] = f"tensorrt-rtx {versions.get('tensorrt_rtx')} runtime, an NVIDIA GPU of compute capability {', '.join(f'SM{c}' for c in caps)}, a CUDA driver"
    if backend == "tensorrt":
        needs["tensorrt"] = f"tensorrt {versions.get('tensorrt')} (the build's version) on the GPU the plan was built for" + (", trtkv plugins registered" if attention == "plugin" else "")
    return EngineManifest(
        trtkv_version=__version__,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        model=ModelSpec.model_validate(info.model_dump()),
        kv_format=fmt,
        backend=backend,
        attention=attention,
        dtype=dtype,
        opset=OPSET,
        limits=limits,
        k_pool=pool_spec(layout1, "k"),
        v_pool=pool_spec(layout1, "v"),
        inputs=inputs,
        outputs=outputs,
        bytes_per_token=layout1.block_bytes(range(L)) / limits.block_size,
        bytes_per_block=layout1.block_bytes(range(L)),
        tail_bytes_per_slot=layout1.tail_bytes_per_slot() * L,
        calibration=CalibrationRef(**cal_ref),
        files=files,
        plans=plans,
        build={"versions": versions, "host": platform.node(), "machine": platform.machine(), "stage_seconds": dict(stages.seconds)},
        runtime_needs=needs,
    )


def print_summary(console, m, out: Path) -> None:
    """Files and sizes, pool bytes, and what each backend needs at run time."""
    from rich.table import Table

    t = Table(title=f"engine {out}", show_header=True)
    t.add_column("file")
    t.add_column("size", justify="right")
    for rel, size in m.files.items():
        t.add_row(rel, _human(size))
    console.print(t)
    console.print(
        f"pool: {m.bytes_per_token:,.0f} B/token ({m.kv_spec}); open blocks{' and recent blocks' if m.kv_format.token_aged else ''}: {m.tail_bytes_per_slot:,} B per sequence slot; "
        f"limits: batch {m.limits.max_batch}, {m.limits.max_seq_len} tokens, blocks of {m.limits.block_size}"
    )
    for name, need in m.runtime_needs.items():
        console.print(f"  run with [bold]{name}[/]: {need}")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
