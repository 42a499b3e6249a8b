"""``RuntimeConfig``: the serving settings and their defaults, in one place.

Kept free of torch so that the CLI options, the generated Triton repository and the python model
can take their defaults from here without loading the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RuntimeConfig:
    kv_memory_gib: float | None = None  # the KV budget: pool blocks + open blocks of every slot
    kv_memory_fraction: float | None = None  # instead: this fraction of free device memory (cuda)
    max_seqs: int = 64  # sequence slots (each costs one fp16 open block per layer and K/V)
    max_batched_tokens: int = 512  # tokens per scheduler step (prefill chunks + decodes)
    backend: str = "auto"  # passed to trtkv.runtime.backends
    device: str = "auto"
    # share sealed blocks between requests with a common prompt prefix (runtime/prefix_cache.py); on by default:
    # a hit gives the same outputs as recomputing (tests/test_prefix_cache.py, every preset format)
    enable_prefix_caching: bool = True
    # sliding-window layers free the sealed blocks their window has passed (trtkv.cache_layout.WindowRing): the torch
    # engine only; prefix caching is then off for such a model (a hit would need the freed blocks)
    free_window_blocks: bool = True
