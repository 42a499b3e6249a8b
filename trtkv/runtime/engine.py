"""The interface every engine implements, ``step(batch, cache) -> StepOutput``, and the feeds its step network takes.

Its own module so that the engines in other files (``torch_engine.TorchEngine``) subclass it without importing
``backends``, whose ``open_engine`` imports them: no import cycle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from trtkv.attention import AttentionBackend
from trtkv.errors import TrtkvError
from trtkv.manifest import EngineManifest
from trtkv.runtime.kv_pool import PagedKVCache
from trtkv.runtime.step import StepBatch, StepOutput


class Engine(ABC):
    """A step network that the runtime can call. What the runtime asks of an engine besides ``step`` is here, typed."""

    name: str = ""  # the engine backend (``trtkv.engine_backends``)
    manifest: EngineManifest | None = None
    device: torch.device = torch.device("cpu")  # where its inputs and the cache live
    # the torch engine's attention backend, through which the cache also seals; None: the network attends itself (the
    # cache then seals through ``trtkv.attention.pool_sealer`` of its device)
    attention_backend: AttentionBackend | None = None

    @property
    def cross_blocks(self) -> bool:
        """Whether a prefill step may cross block boundaries (it seals the blocks it fills in the step)."""
        return False

    @property
    def runs_torch_on_cpu(self) -> bool:
        """Whether its steps are torch work on this process's CPU threads (the runtime sets them per step)."""
        return False

    def describe(self) -> str:
        """How the engine runs, for the server's start line: backend, device, attention."""
        return f"{self.name} engine on {self.device}"

    @abstractmethod
    def step(self, batch: StepBatch, cache: PagedKVCache) -> StepOutput:
        """Run one step (prefill chunk or decode) over ``cache``; the cache is read, never written."""

    def feeds(self, batch: StepBatch, cache: PagedKVCache) -> dict[str, torch.Tensor]:
        """The step network's inputs by name (uint8 pools declared int8 at the graph boundary are viewed as int8)."""
        out = {
            "input_ids": batch.input_ids,
            "context_lens": batch.context_lens,
            "new_lens": batch.new_lens,
            "block_tables": batch.block_tables,
            "slot_ids": batch.slot_ids,
        }
        if cache.is_grouped:
            raise TrtkvError(f"the {self.name} engine reads every layer from one stack of pools through the block tables; this cache "
                             "frees the sliding layers' blocks (a window ring) or stores layers apart (a per-layer format)",
                             "build the cache without a ring (RuntimeConfig.free_window_blocks=False), or use the torch engine")
        declared = {t.name: t.dtype for t in self.manifest.inputs} if self.manifest is not None else {}
        for name, t in cache.tensors.items():  # native graphs declare uint8 pools int8: a zero-copy view
            out[name] = t.view(torch.int8) if t.dtype == torch.uint8 and declared.get(name, "int8") == "int8" else t
        return out
