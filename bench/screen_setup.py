"""What the issue-27 screens share: the calibrated model loaded on CPU for eval-cache measurements in their own process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Screened:
    """A calibration artifact with its model: ``info`` (trtkv.models.model_info), the tokenizer and the HF model."""

    art: Any
    info: Any
    tokenizer: Any
    model: Any

    @property
    def name(self) -> str:
        return self.art.recipe.model.name


def load_screened(calibration: str) -> Screened:
    """The artifact at ``calibration`` and the model it was calibrated for (CPU, gradients off)."""
    import torch

    from trtkv.artifacts import load_calibration
    from trtkv.models import load_model, load_tokenizer, model_info

    art = load_calibration(calibration)
    name = art.recipe.model.name
    loaded = load_model(name, device="cpu")
    torch.set_grad_enabled(False)
    return Screened(art, model_info(name), load_tokenizer(name), loaded.model if hasattr(loaded, "model") else loaded)
