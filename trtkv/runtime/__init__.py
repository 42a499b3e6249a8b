"""The serving runtime: the step batch, the paged KV cache the runtime owns, and the engines that run a step.

``step``     StepBatch / StepOutput: the engine step contract's inputs and outputs (docs/kv-cache-format.md)
``kv_pool``  PagedKVCache: stacked per-layer pools + fp16 open blocks; writes a step's new rows and seals full blocks
``backends`` Engine interface (``step(batch, cache) -> StepOutput``): ONNX Runtime, TensorRT, the torch reference
"""
