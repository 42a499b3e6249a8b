"""Engines: one interface, ``step(batch, cache) -> StepOutput``, several implementations.

* ``OnnxRuntimeEngine``: the engine directory's ``model.onnx`` under ONNX Runtime (CPU; plugin-mode
  graphs get the ``trtkv::`` custom ops from onnxruntime-extensions).
* ``TensorRTEngine``: a TensorRT / TensorRT-RTX plan on a CUDA GPU. **Never executed here** (no GPU).
* ``TorchReferenceEngine``: the transformers model itself, reading the paged cache through
  ``trtkv.cache_layout.gather_paged``: the reference the others are compared with.

All take the cache as the runtime owns it (``PagedKVCache``) and never write it: the runtime calls
``cache.write_new_rows(batch, out)`` after the step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from trtkv.errors import TrtkvError
from trtkv.manifest import ONNX_FILE, ORT_PLUGIN_ONNX_FILE, EngineManifest, load_manifest
from trtkv.runtime.engine import Engine
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.step import StepBatch, StepOutput

__all__ = ["Engine", "OnnxRuntimeEngine", "TensorRTEngine", "TorchReferenceEngine", "open_engine"]  # Engine: re-exported


class OnnxRuntimeEngine(Engine):
    """``model.onnx`` of an engine directory under ONNX Runtime."""

    name = "onnxruntime"

    def __init__(self, engine_dir: str | Path, *, threads: int | None = None, providers: list[str] | None = None, spinning: bool = True,
                 manifest: EngineManifest | None = None):
        """``spinning=False`` stops ONNX Runtime's idle threads from spin-waiting after a step, which otherwise
        starves torch work (sealing, a torch engine) that runs right after it on the same cores.
        ``manifest``: the directory's, when the caller has loaded it already."""
        import onnxruntime as ort

        self.dir = Path(engine_dir)
        self.manifest = manifest or load_manifest(self.dir)
        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = threads
        if not spinning:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        onnx_file = ONNX_FILE
        if self.manifest.plugin_ops:
            from trtkv.plugins.ort_ops import register_ort_ops

            register_ort_ops(so)
            onnx_file = ORT_PLUGIN_ONNX_FILE
        self.session = ort.InferenceSession(str(self.dir / onnx_file), so, providers=providers or ["CPUExecutionProvider"])
        self._inputs = [i.name for i in self.session.get_inputs()]

    def step(self, batch: StepBatch, cache: PagedKVCache) -> StepOutput:
        feeds = self.feeds(batch, cache)
        arrays = {k: np.ascontiguousarray(feeds[k].cpu().numpy()) for k in self._inputs}
        logits, new_k, new_v = self.session.run(["logits", "new_k", "new_v"], arrays)
        return StepOutput(torch.from_numpy(logits), torch.from_numpy(new_k), torch.from_numpy(new_v))


class TensorRTEngine(Engine):  # pragma: no cover - needs a CUDA GPU; never executed on the CPU machines
    """A TensorRT or TensorRT-RTX plan of the engine directory for this GPU's compute capability.

    NEVER EXECUTED HERE: every line of this class needs a CUDA device. Binds the torch tensors' device
    pointers (cache tensors on the GPU), sets input shapes, runs ``execute_async_v3`` on the current stream.
    """

    name = "tensorrt"

    def __init__(self, engine_dir: str | Path, device: int = 0, manifest: EngineManifest | None = None):
        self.dir = Path(engine_dir)
        self.manifest = manifest or load_manifest(self.dir)
        from trtkv.plugins.trt_plugins import import_tensorrt

        trt = import_tensorrt(self.manifest.backend if self.manifest.backend != "onnxruntime" else "tensorrt")
        major, minor = torch.cuda.get_device_capability(device)
        cc = major * 10 + minor
        plan = self.manifest.plan_for(cc)
        if plan is None:
            have = [p.compute_capability for p in self.manifest.plans]
            raise TrtkvError(f"the engine has no plan for this GPU (sm_{cc}); it has {have}", f"rebuild with --compute-capability {cc}")
        if self.manifest.plugin_ops:
            from trtkv.plugins.trt_plugins import register_plugins

            register_plugins()
        self.trt = trt
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine((self.dir / plan.path).read_bytes())
        self.context = self.engine.create_execution_context()
        self.device = torch.device("cuda", device)

    def step(self, batch: StepBatch, cache: PagedKVCache) -> StepOutput:
        feeds = {k: v.to(self.device).contiguous() for k, v in self.feeds(batch, cache).items()}
        L = self.manifest.model.num_layers
        B, T = batch.input_ids.shape
        H, D = self.manifest.model.num_kv_heads, self.manifest.model.head_dim
        outs = {
            "logits": torch.empty(B, self.manifest.model.vocab_size, dtype=torch.float32, device=self.device),
            "new_k": torch.empty(L, B, T, H, D, dtype=torch.float16, device=self.device),
            "new_v": torch.empty(L, B, T, H, D, dtype=torch.float16, device=self.device),
        }
        for name, t in feeds.items():
            self.context.set_input_shape(name, tuple(t.shape))
            self.context.set_tensor_address(name, t.data_ptr())
        for name, t in outs.items():
            self.context.set_tensor_address(name, t.data_ptr())
        stream = torch.cuda.current_stream(self.device)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise TrtkvError("TensorRT execution failed", "rerun with --debug and check the TensorRT log")
        stream.synchronize()
        return StepOutput(outs["logits"], outs["new_k"], outs["new_v"])


class TorchReferenceEngine(Engine):
    """The transformers model over the paged cache: per sequence, the cached K/V are read back with
    ``gather_paged`` (sealed blocks dequantized, open block fp16) into a ``DynamicCache`` and the new tokens
    run through the model at their positions. Slow and simple; the reference for the other engines.
    """

    name = "torch"
    runs_torch_on_cpu = True

    def __init__(self, model, manifest: EngineManifest | None = None):
        import inspect

        self.model = model
        self.manifest = manifest
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # transformers 5 renamed it

    @torch.inference_mode()
    def step(self, batch: StepBatch, cache: PagedKVCache) -> StepOutput:
        from transformers import DynamicCache

        from trtkv.cache_layout import gather_paged

        if cache.ring is not None:
            raise TrtkvError("the reference engine reads sealed blocks through the block tables; a window ring addresses them by slot",
                             "compare against a cache that keeps every block (no ring)")
        lay, L = cache.layout, cache.num_layers
        B, T = batch.input_ids.shape
        H, D = lay.num_kv_heads, lay.head_dim
        dtype = next(self.model.parameters()).dtype
        cache.use_model_rope(self.model)  # keys stored before RoPE: read back here and sealed with each layer's table
        logits = torch.zeros(B, self.model.config.vocab_size)
        new_k = torch.zeros(L, B, T, H, D, dtype=torch.float16)
        new_v = torch.zeros_like(new_k)
        for b in range(B):
            c, n, slot = int(batch.context_lens[b]), int(batch.new_lens[b]), int(batch.slot_ids[b])
            dc = DynamicCache()
            if c:
                for layer in range(L):
                    kv = [
                        gather_paged(cache.layout_of(layer), w, cache.pool(layer, w), batch.block_tables[b], c, getattr(cache.params[layer], w), slot=slot,
                                     rope=cache.rope_for(layer, cache.layout_of(layer).tensor_format(w)))
                        for w in ("k", "v")
                    ]
                    dc.update(kv[0].transpose(0, 1)[None].to(dtype), kv[1].transpose(0, 1)[None].to(dtype), layer)
            pos = torch.arange(c, c + n)[None]
            out = self.model(input_ids=batch.input_ids[b : b + 1, :n], position_ids=pos, use_cache=True, **{self._cache_kw: dc})
            logits[b] = out.logits[0, -1].float()
            for layer in range(L):
                keys, values = dc.layers[layer].keys, dc.layers[layer].values
                new_k[layer, b, :n] = keys[0, :, c : c + n].transpose(0, 1).half()
                new_v[layer, b, :n] = values[0, :, c : c + n].transpose(0, 1).half()
        return StepOutput(logits, new_k, new_v)


def open_engine(engine_dir: str | Path, backend: str = "auto", manifest: EngineManifest | None = None, **kw) -> Engine:
    """The engine of ``engine_dir`` for ``backend`` (``auto``: TensorRT when the manifest has a plan and a GPU is present);
    ``manifest``: the directory's, when the caller has loaded it already (loaded once per process)."""
    m = manifest or load_manifest(engine_dir)
    if backend == "auto":
        backend = "torch" if m.backend == "torch" else ("tensorrt" if (m.plans and torch.cuda.is_available()) else "onnxruntime")
    if backend == "torch":  # imported on demand: transformers and the Triton ops
        from trtkv.runtime.torch_engine import TorchEngine

        return TorchEngine.from_engine_dir(engine_dir, manifest=m, **kw)
    if backend == "onnxruntime":
        return OnnxRuntimeEngine(engine_dir, manifest=m, **kw)
    if backend in ("tensorrt", "tensorrt-rtx"):
        return TensorRTEngine(engine_dir, manifest=m, **kw)  # pragma: no cover - GPU only
    from trtkv.engine_backends import RUNTIME_BACKENDS

    raise TrtkvError(f"unknown engine backend {backend!r}", f"use one of {', '.join(RUNTIME_BACKENDS)}")
