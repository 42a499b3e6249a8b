"""Codebooks of ``nuq`` formats: 2**bits levels per layer and KV head, fitted to what the seal really quantizes.

A ``nuq`` format (docs/kv-formats.md) stores each code as an index into a small calibrated table of levels, in the
units of the group's scale: ``x = level[code] * s (+ z)`` instead of ``code * s (+ z)``. The levels are chosen here by
a weighted Lloyd-Max (k-means in one dimension) over the normalized values ``u = (x - z) / s`` that the seal of real
sealed blocks computes (``trtkv.quant.normalized_block``: the format's transforms, block scales, clip and outliers), taken
from whole calibration windows (``KVStats.windows``) cut into blocks as the cache cuts them (the first block without its
sink rows).

What an element's error costs sets its weight:

* **values**: the squared error in the transformed space, ``s^2 (u - level)^2`` (a Hadamard rotation is orthonormal, so
  it is the error of the attention output's contribution);
* **keys**: the error of the attention logits, ``E[(q' . e)^2]`` with ``q'`` the query in the keys' transformed space
  (``q' = (q * smooth) @ H``, the fold of docs/kv-formats.md §2); on the diagonal of ``E[q' q'^T]`` (``KVStats.query``)
  channel ``c`` costs ``E[q'_c^2] s^2 (u - level)^2``.

Codes stay b bits; the table is ``TensorParams.codebook`` [H, 2**bits] (float32, ascending), saved in the calibration
artifact beside the scales.
"""

from __future__ import annotations

import torch

from trtkv.cache_layout import without_sink
from trtkv.errors import TrtkvError
from trtkv.formats import KVFormat, TensorFormat
from trtkv.quant import TensorParams, hadamard_matrix, normalized_block

LLOYD_ITERATIONS = 200
LLOYD_TOL = 1e-6  # code units: stop when no level moves more


def lloyd_max(u: torch.Tensor, w: torch.Tensor, init: torch.Tensor, iterations: int = LLOYD_ITERATIONS) -> torch.Tensor:
    """Levels (ascending, float32, as many as ``init``) minimising ``sum w (u - nearest level)^2`` from ``init``.

    Alternates the nearest-level cells (midpoints between neighbouring levels; a value on a midpoint goes to the lower
    level, as ``trtkv.quant.nearest_level``) and each cell's weighted mean, exactly, on the sorted values (prefix sums).
    A level whose cell holds no weight stays where it is."""
    if u.numel() == 0 or float(w.sum()) <= 0:
        return init.float().clone()
    order = torch.argsort(u)
    us, ws = u[order].double(), w[order].double()
    zero = torch.zeros(1, dtype=torch.float64)
    cw, cwu = torch.cat([zero, ws.cumsum(0)]), torch.cat([zero, (ws * us).cumsum(0)])
    levels = init.double().clone()
    n = us.numel()
    for _ in range(iterations):
        mids = (levels[1:] + levels[:-1]) / 2
        cuts = torch.cat([torch.zeros(1, dtype=torch.long), torch.searchsorted(us, mids, right=True), torch.tensor([n])])
        cell_w = cw[cuts[1:]] - cw[cuts[:-1]]
        cell_wu = cwu[cuts[1:]] - cwu[cuts[:-1]]
        new = torch.where(cell_w > 0, cell_wu / cell_w.clamp_min(1e-300), levels)
        new = torch.sort(new).values
        moved = float((new - levels).abs().max())
        levels = new
        if moved < LLOYD_TOL:
            break
    return levels.float()


def key_channel_weights(query_moment: torch.Tensor, tf: TensorFormat, smooth: torch.Tensor | None) -> torch.Tensor:
    """``E[q'_c^2]`` per KV head and channel of the keys' transformed space [H, D] from ``E[q q^T]`` [H, D, D]:
    ``q' = (q * smooth) @ H`` (smoothing and rotation folded into the query), normalised to mean 1 over the layer."""
    m = query_moment.double()
    D = m.shape[-1]
    if tf.smooth and smooth is not None:
        s = smooth.double()
        m = m * s.unsqueeze(-1) * s.unsqueeze(-2)
    if tf.hadamard:
        h = hadamard_matrix(D, torch.float64)
        m = h.T @ m @ h
    diag = m.diagonal(dim1=-2, dim2=-1).clamp_min(0)
    return (diag / diag.mean().clamp_min(1e-30)).float()


def sealed_blocks(windows: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Whole windows [W, S, H, D] cut into the blocks the cache seals: [W, S // bs, H, bs, D] (the partial last block
    stays open, so it is left out; each window's first block without its sink rows, ``trtkv.cache_layout.without_sink``)."""
    bs = fmt.block_size
    if not bs:
        raise TrtkvError(f"KV format {fmt.name} has no sealed blocks to fit a codebook to", "add block=N to the format")
    W, S, H, D = windows.shape
    nb = S // bs
    if nb == 0:
        raise TrtkvError(f"calibration windows of {S} tokens hold no whole block of {bs}", "calibrate with --seq-len of a block or more")
    blocks = windows[:, : nb * bs].reshape(W, nb, bs, H, D).permute(0, 1, 3, 2, 4).contiguous()
    blocks[:, 0] = without_sink(blocks[:, 0], fmt.sink_tokens)
    return blocks


def fit_codebook(blocks: torch.Tensor, tf: TensorFormat, params: TensorParams | None, channel_weight: torch.Tensor | None = None,
                 *, per_head: bool = True) -> torch.Tensor:
    """Levels [H, 2**bits] of ``tf`` fitted on sealed ``blocks`` [..., H, bs, D] (see the module docstring);
    ``channel_weight`` [H, D] (keys: ``key_channel_weights``) multiplies each element's squared error. ``per_head``
    False: one table for the layer, repeated per head."""
    p = TensorParams() if params is None else params.map(lambda t: t)
    p.codebook = None
    grid_tf = tf.model_copy(update={"codebook": False})  # the ranges the seal computes do not depend on the levels
    u, s, dense = normalized_block(blocks, grid_tf, p, head_axis=-3)
    w = s.square()
    if channel_weight is not None:
        w = w * channel_weight.float().reshape(channel_weight.shape[0], 1, channel_weight.shape[1])
    H = u.shape[-3]
    n = tf.codebook_levels
    heads = lambda t: t.movedim(-3, 0).reshape(H, -1)  # [H, everything else]
    u, w, dense = heads(u), heads(w), heads(dense)
    if not per_head:
        one = lloyd_max(u[dense], w[dense], spread_levels(u[dense], n))
        return one.expand(H, -1).clone()
    return torch.stack([lloyd_max(u[h][dense[h]], w[h][dense[h]], spread_levels(u[h][dense[h]], n)) for h in range(H)])


def spread_levels(u: torch.Tensor, n: int) -> torch.Tensor:
    """Where Lloyd-Max starts: ``n`` levels evenly over the values' range (every level's cell holds values, which the
    grid's own code values would not: symmetric scales never reach the lowest code, -4 of int3)."""
    if u.numel() == 0:
        return torch.linspace(0.0, 1.0, n)
    return torch.linspace(float(u.min()), float(u.max()), n)


def layer_query_moment(query_moment: torch.Tensor | None, layer: int, what: str) -> torch.Tensor:
    """Layer ``layer``'s ``E[q q^T]`` [H, D, D] of ``query_moment`` [L, H, D, D]; one line naming ``what`` is weighted by
    it when the statistics hold none."""
    if query_moment is None:
        raise TrtkvError(f"{what} are weighted by the queries, and the statistics hold no query moments",
                         "recollect the statistics (trtkv calibrate collects them)")
    return query_moment[layer]


def fit_codebooks(windows: dict[str, torch.Tensor], fmt: KVFormat, params: list, query_moment: torch.Tensor | None, *,
                  per_head: bool = True, weight_keys: bool = True, layers: range | None = None) -> None:
    """Fit and set ``params[i].k/v.codebook`` for every layer of ``fmt`` whose K or V is ``nuq``, in place.

    ``windows[kind]`` [L, W, S, H, D] whole calibration windows (``KVStats.windows``); ``query_moment`` [L, H, D, D]
    ``E[q q^T]`` (``KVStats.query_moment``), required when keys are weighted by the queries (``weight_keys``)."""
    for i in layers if layers is not None else range(len(params)):
        f = fmt.layer(i)
        for kind, tf in (("k", f.k), ("v", f.v)):
            if not tf.codebook:
                continue
            tp: TensorParams = getattr(params[i], kind)
            weight = key_channel_weights(layer_query_moment(query_moment, i, "key codebooks"), tf, tp.smooth) if kind == "k" and weight_keys else None
            blocks = sealed_blocks(windows[kind][i].float(), fmt)
            tp.codebook = fit_codebook(blocks, tf, tp, weight, per_head=per_head)
