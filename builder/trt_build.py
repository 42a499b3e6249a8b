"""TensorRT and TensorRT-RTX engine builds of the step network: parse the ONNX, one optimization profile, one plan.

``tensorrt-rtx`` builds ahead of time on a CPU-only machine for the compute capabilities given
(SM75/80/86/89/120/121; not SM90/SM100). ``tensorrt`` is the same glue with the ``tensorrt`` module;
it builds for the GPU it runs on and is never executed on the CPU machines (see docs/builder.md for the
lines that never ran).
"""

from __future__ import annotations

import time
from pathlib import Path

from trtkv.errors import TrtkvError
from trtkv.manifest import Limits, TensorSpec

RTX_CAPABILITIES = (75, 80, 86, 89, 120, 121)  # tensorrt_rtx.ComputeCapability (1.7): SM75 … SM121, no SM90 / SM100


def check_capabilities(backend: str, caps: list[int]) -> None:
    if backend != "tensorrt-rtx":
        return
    bad = [c for c in caps if c not in RTX_CAPABILITIES]
    if bad:
        raise TrtkvError(
            f"TensorRT-RTX cannot target compute capability {', '.join(f'SM{c}' for c in bad)} (it targets {', '.join(f'SM{c}' for c in RTX_CAPABILITIES)})",
            "drop it from --compute-capability; for SM90 / SM100 (H100, H200, B200) use --backend torch (the Triton kernels), or --backend tensorrt on that GPU with TensorRT installed",
        )


def dim_ranges(limits: Limits) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of every symbolic dim of the step network."""
    opt_b = min(limits.max_batch, 8)
    return {
        "batch": (1, opt_b, limits.max_batch),
        "new_tokens": (1, 1, limits.max_new_tokens_per_step),
        "max_blocks": (1, max(1, limits.max_blocks_per_seq // 2), limits.max_blocks_per_seq),
        "num_blocks": (1, max(1, limits.max_num_blocks // 2), limits.max_num_blocks),
        "num_slots": (1, opt_b, limits.max_num_slots),
    }


def _shape(spec: TensorSpec, ranges: dict, which: int) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else ranges[d][which] for d in spec.shape)


def build_plan(trt, backend: str, onnx_path: Path, inputs: list[TensorSpec], limits: Limits, cc: int | None, log=print) -> tuple[bytes, float]:
    """Build one serialized plan; returns (plan bytes, seconds). ``cc`` None: the present GPU (``tensorrt``)."""
    t0 = time.perf_counter()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if backend == "tensorrt":  # pragma: no cover - never executed here (tensorrt is not installable on CPU machines)
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        from trtkv.plugins.trt_plugins import register_plugins  # registered before parsing (plugin attention)

        register_plugins()
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TrtkvError(f"{backend} could not parse the step network: {errors[:400]}", "report this with the ONNX file (trtkv build-engine --backend onnxruntime keeps it)")
    config = builder.create_builder_config()
    if cc is not None:
        config.num_compute_capabilities = 1
        config.set_compute_capability(getattr(trt.ComputeCapability, f"SM{cc}"), 0)
    ranges = dim_ranges(limits)
    profile = builder.create_optimization_profile()
    for spec in inputs:
        profile.set_shape(spec.name, _shape(spec, ranges, 0), _shape(spec, ranges, 1), _shape(spec, ranges, 2))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise TrtkvError(f"{backend} failed to build the engine for SM{cc}", "rerun with --debug; the TensorRT log above names the layer")
    return bytes(plan), time.perf_counter() - t0
