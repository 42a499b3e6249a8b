"""trtkv: quantized KV caches for LLM serving through TensorRT and Triton Inference Server."""

__version__ = "0.1.0"
