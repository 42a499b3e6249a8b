"""Next-token sampling with per-request parameters in one batch.

Each row of the logits has its own temperature, top-k, top-p, banned tokens and random generator.
Greedy rows take the argmax. Sampled rows draw with the exponential race (``argmax p_i / E_i`` with
``E_i ~ Exp(1)`` from the request's own ``torch.Generator``), which is an exact draw from ``p`` and
uses one fixed-size random vector per token, so a seeded request produces the same tokens whatever
else is in the batch and however often it is preempted.
"""

from __future__ import annotations

import secrets

import torch

from trtkv.runtime.sequence import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else secrets.randbits(63))
    return g


def filter_top_k_top_p(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero all but the ``top_k`` most likely tokens, then all outside the smallest set with mass >= ``top_p``.

    ``probs`` [V] sums to one; the result is renormalised. Ties at the boundary keep the earlier index
    (a stable descending sort), so the kept set is deterministic.
    """
    sorted_p, idx = torch.sort(probs, descending=True, stable=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        kept = sorted_p * keep
        mass_before = torch.cumsum(kept, 0) - kept  # mass of strictly more likely kept tokens
        keep &= mass_before < top_p * kept.sum()
    out = torch.zeros_like(probs)
    out[idx[keep]] = sorted_p[keep]
    return out / out.sum()


class Sampler:
    """Samples one token per row; returns the tokens and their log-probabilities (of the unfiltered softmax at T)."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator],
        banned: list[list[int]] | None = None,
    ) -> tuple[list[int], list[float]]:
        logits = logits.float()
        if banned:
            logits = logits.clone()
            for row, ids in enumerate(banned):
                if ids:
                    logits[row, ids] = float("-inf")
        tokens: list[int] = []
        logprobs: list[float] = []
        for row, (p, g) in enumerate(zip(params, generators)):
            x = logits[row]
            if p.greedy:
                tok = int(torch.argmax(x))
                lp = torch.log_softmax(x, -1)[tok]
            else:
                scaled = x / p.temperature
                probs = torch.softmax(scaled, -1)
                if p.top_k > 0 or p.top_p < 1.0:
                    probs = filter_top_k_top_p(probs, p.top_k, p.top_p)
                race = torch.empty_like(probs).exponential_(generator=g)
                tok = int(torch.argmax(probs / race))
                lp = torch.log_softmax(scaled, -1)[tok]
            tokens.append(tok)
            logprobs.append(float(lp))
        return tokens, logprobs
