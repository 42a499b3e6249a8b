"""The serving runtime: the step batch, the paged KV cache the runtime owns, and the engines that run a step.

``step``     StepBatch / StepOutput: the engine step contract's inputs and outputs (docs/kv-cache-format.md)
``kv_pool``  PagedKVCache: stacked per-layer pools + fp16 open blocks; writes a step's new rows and seals full blocks
``backends`` Engine interface (``step(batch, cache) -> StepOutput``): ONNX Runtime, TensorRT, the torch reference
``sequence`` a request's tokens, cached count, block table and slot; ``SamplingParams``
``block_manager`` KV memory budget -> slots + pool blocks; free lists
``scheduler`` continuous batching: block-boundary chunks, admission, recompute preemption
``sampler`` per-request greedy / temperature / top-k / top-p with seeded generators
``llm_engine`` LLMEngine: schedule -> engine step -> write new rows -> sample -> detokenize (docs/serving.md)
``engine_loop`` the one thread that drives an LLMEngine inside the Triton python backend
"""
