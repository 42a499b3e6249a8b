"""Bits per channel of ``allocB`` formats: each channel's code width, chosen from its measured error at calibration.

Pre-RoPE key channels are far from alike: within a sealed block their spread, weighted by what the queries read of
them, differs by orders of magnitude per KV head. An ``allocB`` format keeps the channels apart (no rotation) and gives
each the code width its error earns (transform coding's reverse water-filling; against a Hadamard rotation with equal bits it measured half the
key-side KL at the same bits, docs/accuracy.md):

1. the whole calibration windows (``KVStats.windows``) are cut into the blocks the cache seals and brought to the
   format's frame (``prerope``: RoPE undone at each row's position, from the layer's own table);
2. every channel goes through the seal's own per-block grid (``trtkv.quant.channel_codes``) at each width the format
   allows (``TensorFormat.channel_widths``: 0 = the block mean alone, 1, 2, 4, 8), and its squared error is weighted by
   what a logit reads of it -- ``E[q_c^2]`` of the queries of its KV head (``codebook.key_channel_weights``), averaged
   over each RoPE pair ``(c, c + D/2)`` for keys stored before RoPE (the rotation mixes the pair);
3. per layer and KV head, widths grow greedily by the error saved per code bit (the next allowed width, or the one after
   where a channel's measured errors are not convex) until a token row's ``B x D`` bits are spent.

The table [H, D] per layer is ``TensorParams.bits``, saved in the calibration artifact beside the scales.
"""

from __future__ import annotations

import torch

from trtkv.calibration.codebook import key_channel_weights, layer_query_moment, sealed_blocks
from trtkv.errors import TrtkvError
from trtkv.formats import KVFormat, TensorFormat
from trtkv.quant import TensorParams, channel_codes, forward_transform


def channel_errors(blocks: torch.Tensor, tf: TensorFormat, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Each channel's mean squared error [H, D, len(tf.channel_widths)] when sealed ``blocks`` [..., H, bs, D] (already
    in the format's frame) go through its block grid with every channel at each allowed width (no outliers), times
    ``weight`` [H, D] when given."""
    H, D = blocks.shape[-3], blocks.shape[-1]
    out = []
    for width in tf.channel_widths:
        qt = channel_codes(blocks, torch.full((H, 1, D), width))
        hat = qt.codes * qt.scale + qt.zero
        err = (hat - blocks).square().reshape(-1, H, blocks.shape[-2], D).mean(dim=(0, 2))
        out.append(err if weight is None else err * weight)
    return torch.stack(out, -1)


def allocate(errors: torch.Tensor, widths: tuple[int, ...], row_bits: int) -> torch.Tensor:
    """Widths [H, D] (int64, each from ``widths``, ascending from 0) from each channel's error at every width
    ``errors`` [H, D, len(widths)]: per head, greedily the upgrade -- to the next allowed width or the one after -- that
    saves the most error per bit, until no upgrade fits in ``row_bits`` bits (ties: the lower channel)."""
    H, D, n = errors.shape
    if widths[0] != 0 or list(widths) != sorted(widths) or n != len(widths):
        raise ValueError(f"widths {widths} must ascend from 0, one per column of errors ({n})")
    w = torch.tensor(widths, dtype=torch.long)
    err = errors.double()
    level = torch.zeros(H, D, dtype=torch.long)  # index into ``widths``
    for h in range(H):
        spent = 0
        while True:
            best, pick = 0.0, None
            for step in (1, 2):
                nxt = level[h] + step
                ok = nxt < n
                nxt_c = nxt.clamp_max(n - 1)
                cost = (w[nxt_c] - w[level[h]]).double()
                gain = (err[h].gather(-1, level[h, :, None]) - err[h].gather(-1, nxt_c[:, None])).squeeze(-1) / cost.clamp_min(1)
                gain[~ok | (spent + cost > row_bits)] = -1.0
                c = int(gain.argmax())
                if gain[c] > best * (1 + 1e-12):
                    best, pick = float(gain[c]), (c, int(nxt_c[c]), int(cost[c]))
            if pick is None:
                break
            c, lv, cost = pick
            level[h, c] = lv
            spent += cost
    return w[level]


def key_weights(query_moment: torch.Tensor, tf: TensorFormat, smooth: torch.Tensor | None) -> torch.Tensor:
    """What the logits read of each key channel [H, D] (``codebook.key_channel_weights``); keys stored before RoPE take
    the mean over each RoPE pair ``(c, c + D/2)``, which the rotation mixes at every relative position."""
    w = key_channel_weights(query_moment, tf, smooth)
    if tf.pre_rope:
        half = w.shape[-1] // 2
        pair = (w[..., :half] + w[..., half:]) / 2
        w = torch.cat([pair, pair], -1)
    return w


def allocate_channel_bits(windows: dict[str, torch.Tensor], fmt: KVFormat, params: list, query_moment: torch.Tensor | None,
                          rope=None, *, weight_keys: bool = True) -> None:
    """Set ``params[i].k/v.bits`` [H, D] for every layer of ``fmt`` whose K or V is ``allocB``, in place (module docstring).

    ``windows[kind]`` [L, W, S, H, D] whole calibration windows (``KVStats.windows``); ``query_moment`` [L, H, D, D]
    (``KVStats.query_moment``) weights key errors (``weight_keys``); ``rope`` (each layer's ``trtkv.rope.RopeTable``,
    ``RopeTable.per_layer(model)``) for ``prerope``: a layer's keys leave RoPE by its own table."""
    for i in range(len(params)):
        f = fmt.layer(i)
        for kind, tf in (("k", f.k), ("v", f.v)):
            if tf.allocated_bits is None:
                continue
            if kind not in windows or windows[kind].shape[1] == 0:
                raise TrtkvError("allocating bits per channel needs whole calibration windows, and the statistics hold none",
                                 "recollect the statistics (trtkv calibrate keeps them)")
            tp: TensorParams = getattr(params[i], kind)
            x = windows[kind][i].float()  # [W, S, H, D]
            cs = None
            if tf.pre_rope:
                if rope is None:
                    raise TrtkvError(f"{tf.short()} keeps keys before RoPE, and no RoPE table was given to allocate its bits",
                                     "calibrate with the model loaded (trtkv calibrate passes its RoPE table)")
                cos, sin = rope[i].rows(0, x.shape[1])
                cs = (cos[:, None].to(x.device), sin[:, None].to(x.device))
            frame = forward_transform(x, tf, tp, head_axis=-2, rope=cs)
            blocks = sealed_blocks(frame, fmt)
            weight = key_weights(layer_query_moment(query_moment, i, "key bits"), tf, tp.smooth) if kind == "k" and weight_keys else None
            errors = channel_errors(blocks, tf, weight)
            tp.bits = allocate(errors, tf.channel_widths, tf.row_code_bits(x.shape[-1])).float()
